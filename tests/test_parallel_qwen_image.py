"""Qwen-Image under ParallelManager (Ulysses at 2 and 3 ranks, CFG parallel) vs one process (fp32, gloo).

The text stays replicated (cond and uncond prompts of different lengths, 7 and 5 tokens, no
divisibility), the first block sees this rank's shard of the image tokens and the whole text, joint
attention exchanges only the image tokens, Edit-2511's per-token modulation is sharded with the tokens.
"""

import math

import pytest

import _dist_qwen_cases as cases
from _dist_utils import run_ranks

TOL = 1e-5
LAYERS, STEPS = 2, 2
IMAGE_TOKENS = {"t2i": lambda h, w: (h // 8) * (w // 8), "edit": lambda h, w: (h // 8) * (w // 8) + 32,
                "edit_plus": lambda h, w: (h // 8) * (w // 8) + 64}

CASES_2 = list(cases.CASES)
CASES_3 = [n for n, c in cases.CASES.items() if c[3] == 1]

_RESULTS = {}


def _results(world):
    if world not in _RESULTS:
        _RESULTS[world] = run_ranks(cases.run_cases, world, {2: CASES_2, 3: CASES_3}[world], timeout=600)
    return _RESULTS[world]


def _check(world, name):
    kind, heads, (h, w), cfg_degree, zero_cond_t, sparsity, extra = cases.CASES[name]
    seq = world // cfg_degree
    texts = set(extra.get("text", (7, 5))) if extra.get("cfg", True) else {extra.get("text", (7, 5))[0]}
    image = math.ceil(IMAGE_TOKENS[kind](h, w) / seq)
    for rank, res in enumerate(_results(world)):
        r = res[name]
        assert r["ref_abs"] > 0.1 and r["maxdiff"] <= TOL, f"{name} rank {rank}/{world}: {r}"
        # the blocks see a shard of the image tokens and the whole (replicated) text
        assert {i for i, _ in r["seen"]} == {image}, r["seen"]
        assert {t for _, t in r["seen"]} <= texts and r["seen"], r["seen"]
        calls_per_rank = STEPS * (1 if cfg_degree > 1 or not extra.get("cfg", True) else 2)
        if extra.get("ring"):
            assert r["ring_degree"] == seq, r  # every sequence rank on the ring
        elif seq > 1:
            c = r["calls"]
            # one packed exchange each way and one text gather per joint attention, one gather per call
            assert c["qkv_to_heads"] == c["heads_to_seq"] == c["joint_heads"] == LAYERS * c["gather"], c
            assert c["gather"] == calls_per_rank, c
        if cfg_degree > 1:
            calls = r["cfg_calls"]
            if extra.get("cfg", True):
                assert calls["computed"] == calls["deferred"] == STEPS, calls
            else:
                assert calls["deferred"] == 0 and calls["computed"] == STEPS, calls
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


@pytest.mark.parametrize("world", [2, 3])
def test_block_sparse_ring_is_refused_for_joint_attention(world):
    for res in _results(world):
        msg = res["ring_sparse_refused"]
        assert msg and "ring_degree" in msg and "qwen-image" in msg and "wan" in msg, msg
