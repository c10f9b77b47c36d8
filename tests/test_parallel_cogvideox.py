"""CogVideoX under ParallelManager (Ulysses at 2 and 3 ranks, batched CFG split) vs one process (fp32, gloo).

The text (7 tokens) stays replicated, the first block sees this rank's shard of the video tokens and the
whole text, joint attention exchanges only the video tokens, the pipeline's RoPE (cos, sin) is split with
them; batched CFG (B = 2) puts one branch on each cfg rank, with Pyramid Attention Broadcast too.
"""

import math

import pytest

import _dist_cogvideox_cases as cases
from _dist_utils import run_ranks

TOL = 1e-5
LAYERS, TEXT = 2, 7

CASES_2 = list(cases.CASES) + list(cases.REFUSALS)
CASES_3 = [n for n, c in cases.CASES.items() if c[3] == 1 and n in ("5b_h3", "2b_h3", "15_h3", "i2v15_h5", "5b_h2",
                                                                     "5b_sparse075_h3", "5b_fbc_h3")]

_RESULTS = {}


def _results(world):
    if world not in _RESULTS:
        _RESULTS[world] = run_ranks(cases.run_cases, world, {2: CASES_2, 3: CASES_3}[world], timeout=600)
    return _RESULTS[world]


def _video_tokens(variant, h, w):
    return (2 if variant in ("15", "i2v15") else 3) * (h // 16) * (w // 16)


def _check(world, name):
    variant, heads, (h, w), cfg_degree, extra, call_extra = cases.CASES[name]
    seq = world // cfg_degree
    steps = call_extra.get("steps", 2)
    video = math.ceil(_video_tokens(variant, h, w) / seq)
    # batched CFG split: each cfg rank runs a batch of one where one process runs a batch of two (other
    # GEMM shapes, float32 reassociation): 1e-5 relative to the output's scale (about 15 here)
    tol = TOL * (_results(world)[0][name]["ref_abs"] if cfg_degree > 1 else 1.0)
    for rank, res in enumerate(_results(world)):
        r = res[name]
        assert r["ref_abs"] > 0.1 and r["maxdiff"] <= tol, f"{name} rank {rank}/{world}: {r}"
        # the blocks see a shard of the video tokens and the whole (replicated) text
        assert r["seen"] and set(r["seen"]) == {(video, TEXT)}, r["seen"]
        if seq > 1 and "cache" not in extra:
            c = r["calls"]
            # one packed exchange each way and one text gather per joint attention, one gather per call
            assert c["qkv_to_heads"] == c["heads_to_seq"] == c["joint_heads"] == LAYERS * c["gather"], c
            assert c["gather"] == steps, c
        if cfg_degree > 1:
            assert r["cfg_calls"] == {"computed": 0, "split": steps}, r["cfg_calls"]
        if "pyramid_attention_broadcast" in str(extra):
            # one call per step (its half of the batch), the same attentions reused as in one process, and
            # fewer computed than an uncached run (the counted leaf, norm_q, runs once per stream: 2 per attention)
            assert r["work"] == r["ref_work"] and r["work"][0] == steps and r["work"][1] < 2 * LAYERS * steps, r
        if "sparse" in extra:
            sparsity = extra["sparse"]["sparsity"]
            assert r["sparse_paths"] == (["sparse"] if sparsity else ["dense"]), r
            if sparsity:
                assert r["sparse_effective"] > 0.2, r


def test_refusals_name_the_option_on_every_rank_without_a_hang():
    for res in _results(2):
        assert "AutoencoderKLCogVideoX" in res["vae_exact_refused"]["error"], res["vae_exact_refused"]
        # guidance_scale <= 1 (batch 1): nothing to split, every cfg rank runs the whole call, no error or hang
        assert res["cfg2_without_guidance_runs"]["error"] is None, res["cfg2_without_guidance_runs"]


@pytest.mark.parametrize("name", [n for n in CASES_2 if n in cases.CASES])
def test_parity_2_ranks(name):
    _check(2, name)


@pytest.mark.parametrize("name", CASES_3)
def test_parity_3_ranks(name):
    _check(3, name)
