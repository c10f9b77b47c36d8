"""Flux.1 under ParallelManager (Ulysses at 2 and 3 ranks, CFG parallel) vs one process (fp32, gloo).

The text stays replicated: the dual blocks see this rank's image shard and the whole text, the single
blocks see [whole text, image shard] and split it at the text length of the call; only the image tokens
enter the all_to_all. The text rows leaving the last single block are identical on every rank.
"""

import math

import pytest
import torch

import _dist_flux_cases as cases
from _dist_utils import run_ranks

TOL = 1e-5
LAYERS, SINGLE, STEPS = 2, 2, 2
TEXT = 7


def _image_tokens(kind, h, w):
    if kind == "model":
        return h * w
    n = (h // 4) * (w // 4)
    return n + (4 * 6 if kind == "kontext" else 0)  # Kontext: the 16 x 24 px reference after the target


CASES_2 = list(cases.CASES)
CASES_3 = [n for n, c in cases.CASES.items() if c[3] == 1]
_RESULTS = {}


def _results(world):
    if world not in _RESULTS:
        _RESULTS[world] = run_ranks(cases.run_cases, world, {2: CASES_2, 3: CASES_3}[world], timeout=900)
    return _RESULTS[world]


def _check(world, name):
    kind, heads, (h, w), cfg_degree, sparsity, extra = cases.CASES[name]
    seq = world // cfg_degree
    text = extra.get("text", TEXT)
    image = math.ceil(_image_tokens(kind, h, w) / seq)
    results = _results(world)
    for rank, res in enumerate(results):
        r = res[name]
        assert r["ref_abs"] > 0.1 and r["maxdiff"] <= TOL, f"{name} rank {rank}/{world}: {r}"
        # dual blocks: this rank's image shard and the whole text; single blocks: [whole text, image shard]
        assert r["seen"] == [("dual", image, text), ("single", image, text)], r["seen"]
        if seq > 1:
            c = r["calls"]
            calls = 1 if kind == "model" else STEPS * (1 if cfg_degree > 1 or not extra.get("cfg", True)
                                                       or kind == "control" else 2)
            # one packed exchange each way and one text gather per attention (dual and single), one gather per call
            assert c["qkv_to_heads"] == c["heads_to_seq"] == c["joint_heads"] == (LAYERS + SINGLE) * c["gather"], c
            assert c["gather"] == calls, c
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
    # the text rows a single block hands on are the same on every rank of a sequence group
    groups = [list(range(g * seq, (g + 1) * seq)) for g in range(cfg_degree)]
    for group in groups:
        first = results[group[0]][name]["last_text"]
        for rank in group[1:]:
            assert torch.equal(results[rank][name]["last_text"], first), (name, rank)


@pytest.mark.parametrize("name", CASES_2)
def test_parity_2_ranks(name):
    _check(2, name)


@pytest.mark.parametrize("name", CASES_3)
def test_parity_3_ranks(name):
    _check(3, name)
