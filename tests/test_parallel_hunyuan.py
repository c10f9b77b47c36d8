"""HunyuanVideo and HunyuanVideo-1.5 under ParallelManager (Ulysses at 2 and 3 ranks, CFG parallel) vs one process.

fp32, gloo. The text stays replicated (padded: key-padding masks), the first dual and single blocks see
this rank's shard of the video tokens and the whole text, joint attention exchanges only the video
tokens, the I2V token-replace blocks get this rank's count of first-frame rows, First-Block Cache decides
alike on every rank; CFG parallel by call order (HunyuanVideo, with and without context names) and
through 1.5's guider (also when it switches CFG off for some steps).
"""

import math

import pytest

import _dist_hunyuan_cases as cases
from _dist_utils import run_ranks

TOL = 1e-5
TOKENS = {"hv": lambda e: (((e.get("frames", 17) - 1) // 4 + 1) * (e.get("height", 16) // 8) * (e.get("width", 32) // 8)),
          "15": lambda e: (((e.get("frames", 5) - 1) // 2 + 1) * (e.get("height", 12) // 4) * (e.get("width", 20) // 4))}
CASES_2 = list(cases.CASES)
# 3 ranks: uneven shards (40 tokens -> 14, 14, 12; 2 heads for 3 ranks), first-frame rows across ranks,
# padded batches, sparse, the cache decision, 1.5 (the other cases add nothing at 3 that 2 do not cover)
CASES_3 = ["hv_t2v_h3", "hv_t2v_h2", "hv_t2v_padded_batch2_h3", "hv_token_replace_h3", "hv_sparse075_h3", "hv_fbc_h3",
           "hy15_t2v_h3", "hy15_i2v_h3"]

_RESULTS = {}


def _results(world):
    if world not in _RESULTS:
        _RESULTS[world] = run_ranks(cases.run_cases, world, {2: CASES_2, 3: CASES_3}[world], timeout=900)
    return _RESULTS[world]


def _check(world, name):
    family, kind, heads, extra, cfg_degree, sparsity = cases.CASES[name]
    seq = world // cfg_degree
    tokens = TOKENS[family](extra)
    shard = math.ceil(tokens / seq)
    two_calls = extra.get("cfg", False) if family == "hv" else True  # 1.5: the guider runs CFG
    for rank, res in enumerate(_results(world)):
        r = res[name]
        assert r["ref_abs"] > 0.1 and r["maxdiff"] <= TOL, f"{name} rank {rank}/{world}: {r}"
        assert {i for i, _ in r["seen"]} == {shard}, r["seen"]  # the blocks see a shard of the video tokens
        assert r["seen"] and all(t >= 16 for _, t in r["seen"]), r["seen"]  # ... and the whole text
        if kind == "token_replace":
            first = tokens // (((extra["frames"] - 1) // 4) + 1)  # one latent frame's tokens
            me = rank % seq
            assert r["first_rows"] == [max(0, min(first - me * shard, shard))], (rank, r["first_rows"])
        if seq > 1:
            c = r["calls"]
            # one packed exchange each way and one text gather per joint attention, one gather per call
            assert c["qkv_to_heads"] == c["heads_to_seq"] == c["joint_heads"], c
            if "cache" in extra:  # First-Block Cache skipped the single block on some steps, on every rank alike
                assert c["qkv_to_heads"] < cases.LAYERS * c["gather"], c
            else:
                assert c["qkv_to_heads"] == cases.LAYERS * c["gather"], c
        if cfg_degree > 1:
            calls = r["cfg_calls"]
            steps = extra.get("steps", cases.STEPS)
            split = steps if two_calls and "stop" not in extra else (steps // 2 if two_calls else 0)
            assert calls["deferred"] == split and calls["computed"] == steps, calls
        if sparsity is not None:
            assert r["sparse_paths"] == (["sparse"] if sparsity else ["dense"]), r
            if sparsity:
                assert r["sparse_effective"] > 0.2, r


@pytest.mark.parametrize("name", CASES_2)
def test_parity_2_ranks(name):
    _check(2, name)


@pytest.mark.parametrize("name", CASES_3)
def test_parity_3_ranks(name):
    _check(3, name)


def test_cfg_parallel_refusals_come_before_any_collective():
    """A guider with three predictions (skip-layer guidance) cannot be split over two cfg ranks."""
    from diffusers.guiders import SkipLayerGuidance

    import _tiny_hunyuan as hy
    import lite_boost
    from lite_boost.config import ConfigError

    pipe = hy.hunyuan15_pipeline()
    pipe.guider = SkipLayerGuidance(skip_layer_guidance_layers=[0])
    with pytest.raises(ConfigError, match=r"cfg_degree=2 splits the guider's two predictions.*SkipLayerGuidance"):
        lite_boost.ParallelManager(pipe, {"parallel": {"cfg_degree": 2}})
    assert not lite_boost.api.is_boosted(pipe)
