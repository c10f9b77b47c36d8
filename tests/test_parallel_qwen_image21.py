"""Qwen-Image 2.1 under ParallelManager vs one process (fp32, gloo, 2, 3 and 4 ranks).

``QwenImage21Pipeline`` (text-to-image with CFG, cond / uncond texts of different lengths, one padded; and with a
condition image between two text runs), the ``QwenImage21ModularPipeline`` (ClassifierFreeGuidance guider) and the
``QwenImage21TurboModularPipeline`` (no guidance), each with the pipeline's prefix KV caching on and off: Ulysses and
Ring over all ranks (2 and 3: 16 and 40 target tokens, uneven shards at 3), cfg_degree 2 (2 ranks), Ulysses 2 x
block-sparse over the target grid against one-process sparse with the same config; at 4 ranks cfg_degree 2 x
Ulysses 2 and cfg_degree 2 x Ring 2 (each branch split over its own two ranks) for the pipeline and the modular
pipeline. The prefix (text, condition
image) stays whole on every rank; the first block sees it plus this rank's target shard (a cached step: the shard
only). Every rank's output equals the one-process output within 1e-5. Block-sparse Ring is refused for this joint
family, and cfg_degree 2 for the Turbo pipeline (no guidance), with a ConfigError before any collective.
"""

import math

import pytest

import _dist_qwen21_cases as cases
from _dist_utils import run_ranks

TOL = 1e-5
LAYERS = 2  # TinyQwenImage21Spec
_RESULTS = {}


def _results(world):
    if world not in _RESULTS:
        names = {2: cases.CASES_2, 3: cases.CASES_3, 4: cases.CASES_4}[world]
        _RESULTS[world] = run_ranks(cases.run_cases, world, names, timeout=900)
    return _RESULTS[world]


def _check(world, name):
    kind, layout, kv, (h, w), sparsity = cases.CASES[name]
    target = (h // 16) * (w // 16)
    seq = {"cfg": 1, "cfg_ulysses": world // 2, "cfg_ring": world // 2}.get(layout, world)
    shard = math.ceil(target / seq)
    for rank, res in enumerate(_results(world)):
        r = res[name]
        assert r["ref_abs"] > 0.1 and r["maxdiff"] <= TOL, f"{name} rank {rank}/{world}: {r}"
        ref_calls = r["ref_calls"]  # the first block's sequence length, call by call, in one process
        calls = (2 if cases.cfg_on(kind) else 1) * cases.STEPS
        assert len(ref_calls) == calls and all(n >= target for n in ref_calls), r
        if kv:  # extract at the first step, target rows only after
            assert ref_calls[calls // cases.STEPS:] == [target] * (calls - calls // cases.STEPS), r
        else:
            assert min(ref_calls) > target, r
        if layout == "cfg":  # cfg rank 0 runs every cond call, cfg rank 1 every uncond call, whole
            assert r["sequence_degree"] == 1 and r["seen_calls"] == ref_calls[r["cfg_rank"]::2], r
            assert r["cfg_calls"] == {"computed": cases.STEPS, "deferred": cases.STEPS}, r["cfg_calls"]
            continue
        if layout.startswith("cfg_"):  # each CFG branch on its own ranks, split over them
            assert r["cfg_calls"] == {"computed": cases.STEPS, "deferred": cases.STEPS}, r["cfg_calls"]
            ref_calls, calls = ref_calls[r["cfg_rank"]::2], cases.STEPS
        # the prefix whole, the target split: this rank's shard (equal shards, the last one padded)
        assert r["seen_calls"] == [n - target + shard for n in ref_calls], r
        assert r["sequence_degree"] == seq and r["calls"]["gather"] == calls, r
        if layout.endswith("ulysses"):
            assert r["ring_degree"] == 1, r
            assert r["calls"]["qkv_to_heads"] == r["calls"]["heads_to_seq"] == LAYERS * calls, r
        else:
            assert r["ring_degree"] == seq and "qkv_to_heads" not in r["calls"], r
            assert r["ring_calls"] == {"ring_kv": LAYERS * calls * (seq - 1)}, r
        if sparsity is not None:
            assert r["sparse_paths"] == (["sparse"] if sparsity else ["dense"]), r
            if sparsity:
                assert r["sparse_effective"] > 0.3, r


@pytest.mark.parametrize("name", cases.CASES_2)
def test_parity_2_ranks(name):
    _check(2, name)


@pytest.mark.parametrize("name", cases.CASES_3)
def test_parity_3_ranks(name):
    _check(3, name)


@pytest.mark.parametrize("name", cases.CASES_4)
def test_parity_4_ranks_cfg_times_sequence(name):
    _check(4, name)


@pytest.mark.parametrize("world", [2, 3])
def test_sparse_ring_is_refused_before_any_collective(world):
    for res in _results(world):
        assert res["ring_sparse_refused"] is not None
        assert (f"sparse attention with ring_degree={world} is not available for qwen-image-2.1"
                in res["ring_sparse_refused"]), res["ring_sparse_refused"]


@pytest.mark.usefixtures("single_process_env")
def test_cfg_degree_2_on_the_turbo_pipeline_is_refused_before_any_collective(monkeypatch):
    """QwenImage21TurboModularPipeline runs no guidance (no guider): cfg_degree 2 raises naming it, in one process
    with a 2-rank launcher environment and no rendezvous (reaching init would fail differently)."""
    import lite_boost
    from lite_boost.config import ConfigError

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    pipe = cases.turbo_pipeline()
    with pytest.raises(ConfigError, match=r"cfg_degree=2 splits the guider's two predictions .* "
                                          r"QwenImage21TurboModularPipeline\.guider is no guider\. Valid cfg_degree "
                                          r"here: \[1\]"):
        lite_boost.ParallelManager(pipe, {"parallel": {"cfg_degree": 2}})
    assert not lite_boost.api.is_boosted(pipe)
