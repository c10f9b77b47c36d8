"""Flux.2 under ParallelManager (Ulysses and Ring at 2 and 3 ranks, CFG parallel for [klein]) vs one process.

fp32, gloo. The text stays replicated: the dual blocks see this rank's image shard and the whole text, the
single blocks see [whole text, image shard] (split at the call's text length); only image tokens enter the
exchanges. The text rows leaving the last single block are identical on every rank of a sequence group.
"""

import math

import pytest
import torch

import _dist_flux2_cases as cases
from _dist_utils import run_ranks

TOL = 1e-5
TEXT, IMAGE = 7, {"klein": 15, "dev": 15, "model": 15 + 6}
CASES_2 = list(cases.CASES)
CASES_3 = ["klein_ulysses", "klein_ring", "model_reference_ring"]
_RESULTS = {}


def _results(world):
    if world not in _RESULTS:
        _RESULTS[world] = run_ranks(cases.run_cases, world, {2: CASES_2, 3: CASES_3}[world], timeout=600)
    return _RESULTS[world]


def _check(world, name):
    kind, layout, sparsity, extra = cases.CASES[name]
    seq = 1 if layout == "cfg" else world
    tokens = IMAGE[kind] if "height" not in extra else (extra["height"] // 2) * (extra["width"] // 2)
    image = math.ceil(tokens / seq)
    results = _results(world)
    for rank, res in enumerate(results):
        r = res[name]
        assert r["ref_abs"] > 0.1 and r["maxdiff"] <= TOL, f"{name} rank {rank}/{world}: {r}"
        assert r["seen"] == [("dual", image, TEXT), ("single", TEXT + image)], r["seen"]
        if layout == "cfg":
            assert r["cfg_calls"]["computed"] == r["cfg_calls"]["deferred"] == 2, r["cfg_calls"]  # 2 steps
        if layout == "ring":
            assert r["ring_degree"] == world
        if sparsity is not None:
            assert r["sparse_paths"] == ["dense"], r  # sparsity 0
    if seq > 1:  # the text rows a single block hands on are the same on every rank
        first = results[0][name]["last_rows"][:, :TEXT]
        assert all(torch.equal(res[name]["last_rows"][:, :TEXT], first) for res in results[1:]), name


@pytest.mark.parametrize("name", CASES_2)
def test_parity_2_ranks(name):
    _check(2, name)


@pytest.mark.parametrize("name", CASES_3)
def test_parity_3_ranks(name):
    _check(3, name)
