"""MiniMax-H3 under ParallelManager (Ulysses, Ring, Ulysses x Ring; block-sparse) vs one process.

fp32, gloo. The packed sequence (text, keyframe condition, audio and video rows) is split at the first block,
its per-row AdaLN / timestep indices with it; attention over the whole sequence stays exact, so both outputs
(video and audio) equal the one-process run. Block-sparse runs compare with the one-process block-sparse boost
of the same config (sparsity 0: with stock dense). Row counts (71, 337) divide neither 2 nor 3 nor 4.

The modular pipeline (diffusers' t2va core denoise workflow, MiniMaxH3ModularPipeline on a tiny transformer,
prompt embeddings in, latents out) runs the same way: 643 packed rows (7 text, 414 audio, 37 x 2 x 3 video),
both latents of every rank equal to the one-process pipeline. cfg_degree 2 is refused for it at planning (the
checkpoint is guidance-distilled: no second branch to split), with no torch.distributed call on any rank.
"""

import math

import pytest
import torch

import _dist_minimax_h3_cases as cases
from _dist_utils import run_ranks

TOL = 1e-5
LAYERS = 2  # blocks of the tiny pipeline transformer
MODEL_2 = [n for n, c in cases.CASES.items() if c[0] != "usp"]
PIPE = {w: [n for n, c in cases.PIPE_CASES.items() if w in c[2]] for w in (2, 3)}
NAMES = {2: ["cfg_refused"] + MODEL_2 + PIPE[2], 3: MODEL_2 + PIPE[3],
         4: [n for n, c in cases.CASES.items() if c[0] == "usp"]}
_RESULTS = {}


def _results(world):
    if world not in _RESULTS:
        _RESULTS[world] = run_ranks(cases.run_cases, world, NAMES[world], timeout=900)
    return _RESULTS[world]


def _check(world, name):
    layout, sparsity, shape, batch = cases.CASES[name]
    for rank, res in enumerate(_results(world)):
        r = res[name]
        assert r["ref_abs"] > 0.1 and r["maxdiff"] <= TOL, f"{name} rank {rank}/{world}: {r}"
        assert r["audio_abs"] > 0.1 and r["audio_maxdiff"] <= TOL, f"{name} rank {rank}/{world}: {r}"
        assert r["rows"] % world, r["rows"]  # uneven shards
        assert r["seen"] == [(batch, math.ceil(r["rows"] / world), 24)], r["seen"]  # the block sees its shard
        if layout in ("ring", "usp"):
            assert r["ring_degree"] == (world if layout == "ring" else world // 2)
        if sparsity is not None:  # sparsity 0 runs dense; otherwise the packed layout is recognised (no fallback)
            assert r["sparse_paths"] == (["sparse"] if sparsity else ["dense"]), r


@pytest.mark.parametrize("name", MODEL_2)
def test_parity_2_ranks(name):
    _check(2, name)


@pytest.mark.parametrize("name", MODEL_2)
def test_parity_3_ranks(name):
    _check(3, name)


@pytest.mark.parametrize("name", NAMES[4])
def test_parity_4_ranks_ulysses_x_ring(name):
    _check(4, name)


# ------------------------------------------------------------------------------------------ the modular pipeline
def _check_pipeline(world, name):
    layout, sparse, _ = cases.PIPE_CASES[name]
    results = _results(world)
    assert cases.PIPE_ROWS % world  # uneven shards
    for rank, res in enumerate(results):
        r = res[name]
        assert r["ref_abs"] > 0.1 and r["maxdiff"] <= TOL, f"{name} rank {rank}/{world}: {r}"
        assert r["audio_abs"] > 0.1 and r["audio_maxdiff"] <= TOL, f"{name} rank {rank}/{world}: {r}"
        for key in ("latents", "audio_latents"):  # every rank ends with the same latents, bit for bit
            assert torch.equal(r[key], results[0][name][key]), (name, rank, key)
        n = r["ref_calls"]  # transformer calls of the one-process run
        assert n >= 2 and r["sequence_degree"] == world, r
        assert r["seen"] == [(1, math.ceil(cases.PIPE_ROWS / world), 24)], r["seen"]  # the block sees its shard
        c = r["calls"]
        assert c["gather"] == 2 * n, c  # video and audio heads gathered at every call
        if layout == "ulysses":
            assert c["qkv_to_heads"] == c["heads_to_seq"] == LAYERS * n, c
        else:
            assert r["ring_degree"] == world and "qkv_to_heads" not in c, r
            # K / V passed on world - 1 times per block and call
            assert r["dist_calls"].get("batch_isend_irecv") == LAYERS * n * (world - 1), r["dist_calls"]
        if sparse is not None:  # the same sparse path as the one-process boost, and sparse != dense there
            assert r["ref_sparse_paths"] == r["sparse_paths"] == ["sparse"], r
            assert r["sparse_vs_dense"] > 1e-5, r


@pytest.mark.parametrize("name", PIPE[2])
def test_pipeline_parity_2_ranks(name):
    _check_pipeline(2, name)


@pytest.mark.parametrize("name", PIPE[3])
def test_pipeline_parity_3_ranks(name):
    _check_pipeline(3, name)


def test_pipeline_cfg_degree_2_is_refused_at_planning_on_every_rank():
    """ParallelManager(pipe, cfg_degree 2) at 2 ranks: the same ConfigError with the family's reason on both ranks,
    before any torch.distributed call (without a process group: none is created; on a cfg 2 x 1 mesh: no
    collective), the pipeline left unboosted; the group then runs the other cases."""
    results = _results(2)
    for rank, res in enumerate(results):
        for name in ("cfg_refused", "cfg_refused_on_mesh"):
            r = res[name]
            assert r["error"] is not None and "cfg_degree=2" in r["error"], (rank, name, r)
            assert "MiniMaxH3ModularPipeline" in r["error"] and "guidance-distilled" in r["error"], r["error"]
            assert r["error"] == results[0][name]["error"]
            assert r["dist_calls"] == {} and not r["boosted"], (rank, name, r)
        assert not res["cfg_refused"]["initialized"] and res["cfg_refused_on_mesh"]["initialized"]
        assert res["pipe_ulysses"]["dist_calls"], res["pipe_ulysses"]  # the counter sees the collectives that run
