"""Step caching under ParallelManager: rank-consistent decisions, parity with one process, faults.

For 2 and 3 sequence ranks and cfg 2 x sequence 2, each case runs the same cached pipeline in one
process (the reference) and under ParallelManager, with First-Block-Cache thresholds that make the
decisions flip from step to step. Every rank must make exactly the reference's decisions (in the
branches it runs), do the same amount of transformer work, and produce the reference's output.
Uneven shards (45 tokens on 2 ranks, 20 on 3) check that padding never enters the statistic.
"""

import os
import subprocess
import time

import pytest

import _dist_cache_cases as cases
from _dist_utils import HERE, launch_fault_workers, run_ranks

TOL = 1e-5
WORLD_CASES = {
    2: ["fbc_h3_tok45", "fbc_sparse_h3_tok45", "fbc_two_stage_h3_tok45", "sea_h3_tok45", "mag_h3_tok45",
        "taylor_h3_tok45", "pab_h3_tok45"],
    3: ["fbc_h3_tok20", "fbc_h3_tok45", "sea_h3_tok45"],
    4: ["fbc_cfg2_h3_tok45", "fbc_cfg2_h3_tok20", "sea_cfg2_h3_tok45", "taylor_cfg2_h3_tok45"],
}
_RESULTS = {}


def _results(world):
    if world not in _RESULTS:
        _RESULTS[world] = run_ranks(cases.run_cases, world, WORLD_CASES[world], timeout=600)
    return _RESULTS[world]


def _check(world, name):
    per_rank = [r[name] for r in _results(world)]
    cfg_degree = cases.CASES[name][2]
    for rank, res in enumerate(per_rank):
        assert res["maxdiff"] <= TOL, (rank, res["maxdiff"])
        assert res["maxdiff_second_call"] <= TOL, (rank, res["maxdiff_second_call"])
        if cfg_degree == 1:  # each rank runs every call (on its shard): same work as one process
            assert res["work"] == res["ref_work"], (rank, res["work"], res["ref_work"])
    if per_rank[0]["ref_decisions"] is None:
        # fixed-schedule / replicated-indicator methods: the cache must still have skipped work
        calls, ffn, attn = per_rank[0]["ref_work"]
        assert ffn < calls or attn < calls * 2, per_rank[0]["ref_work"]
        return
    threshold = float(cases.CASES[name][3].split("threshold=")[1])
    every = [e for log in per_rank[0]["ref_decisions"] for e in log]  # all transformers (Wan2.2 has two)
    computes = [c for _, _, _, c in every]
    assert True in computes and False in computes, f"decisions do not flip: {computes}"
    margins = [abs(s - threshold) for _, _, s, _ in every if s is not None]
    assert min(margins) > 1e-4, "a statistic sits on the threshold: rounding could flip it"
    for rank, res in enumerate(per_rank):
        for ref_log, log in zip(res["ref_decisions"], res["decisions"]):
            branches = {"cond", "uncond"} if cfg_degree == 1 else {("cond", "uncond")[res["cfg_rank"]]}
            want = [(ctx, call, c) for ctx, call, _, c in ref_log if ctx in branches]
            assert [(ctx, call, c) for ctx, call, _, c in log] == want, rank
            for (_, _, s_ref, _), (_, _, s, _) in zip([e for e in ref_log if e[0] in branches], log):
                if s_ref is not None:
                    assert abs(s - s_ref) <= 1e-5 * abs(s_ref), (s, s_ref)  # same statistic up to rounding


@pytest.mark.parametrize("name", WORLD_CASES[2])
def test_cached_parity_2_ranks(name):
    _check(2, name)


@pytest.mark.parametrize("name", WORLD_CASES[3])
def test_cached_parity_3_ranks(name):
    _check(3, name)


@pytest.mark.parametrize("name", WORLD_CASES[4])
def test_cached_parity_cfg2_x_seq2(name):
    _check(4, name)


# ------------------------------------------------------------------------------------------ faults
WORKER = os.path.join(HERE, "_dist_cache_fault_worker.py")
TIMEOUT_S = 4.0


@pytest.mark.parametrize("mode", ["raise", "die", "hang"])
def test_failing_rank_during_a_cached_run_ends_all_ranks(mode):
    world, faulty = 2, 1
    procs = launch_fault_workers(WORKER, mode, world, faulty, TIMEOUT_S)
    try:
        start = time.monotonic()
        try:  # start-up (imports, rendezvous) + the collective timeout + slack on a loaded machine
            procs[0].wait(timeout=90 + TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pass
        code = procs[0].poll()
        log = procs[0].communicate(timeout=10)[0] if code is not None else ""
        assert code is not None, f"healthy rank still running {time.monotonic() - start:.0f}s after a {mode} fault"
        assert code != 0, f"healthy rank exited 0 after a {mode} fault:\n{log[-2000:]}"
        if mode == "hang":  # the healthy rank's error names the collective, its group and the time waited
            assert "all_gather 'cache_decision' of the First-Block-Cache statistic" in log, log[-2000:]
            assert "sequence group (size 2" in log and "after " in log
        else:
            assert procs[faulty].wait(timeout=30) != 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            try:
                p.communicate(timeout=10)
            except Exception:  # noqa: BLE001
                pass
