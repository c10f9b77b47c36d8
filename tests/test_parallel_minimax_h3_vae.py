"""Parallel VAE for MiniMax-H3 (lite_boost.models.minimax_h3_vae: exact mode by whole clips) vs the stock VAE.

Single-process: the clip plan (balanced contiguous runs, fewer clips than ranks), the adapter's predicted clip
windows = the ones diffusers' ``_decode`` / ``_encode`` pass (recorded), "chunked" refused before anything runs,
the family's feature entry. Multi-process (gloo, 2 and 3 ranks, one process group per world size): decode and
encode of a tiny random-weight ``AutoencoderKLMiniMaxH3`` = the stock one-process call within 1e-5 (fp32) at clip
counts that do not divide by the ranks, fewer clips than ranks and one clip (run whole, no collective), with the
VAE's default tiling, without tiling and with small tiles, and batch slicing; failures raise on every rank (no
hang); the tiny MiniMax-H3 pipeline with a video decode step under ParallelManager = the one-process pipeline,
unparallelize restores the stock VAE.
"""

import pytest
import torch

import _dist_minimax_h3_vae_cases as cases
import _tiny_minimax_h3 as mm
from _dist_utils import run_ranks

from lite_boost import ConfigError
from lite_boost.parallel.comm import Communicator
from lite_boost.parallel.vae import parallelize_vae, plan_clips, vae_adapter_for

TOL = 1e-5
NAMES = ["exact", "errors", "pipeline"]
_RESULTS = {}


def _results(world):
    if world not in _RESULTS:
        _RESULTS[world] = run_ranks(cases.run_cases, world, NAMES, timeout=600)
    return _RESULTS[world]


# ------------------------------------------------------------------------------------------ one process
@pytest.mark.parametrize("n, world, want", [
    (7, 2, [(0, 4), (4, 7)]), (3, 2, [(0, 2), (2, 3)]), (4, 3, [(0, 2), (2, 3), (3, 4)]),
    (2, 3, [(0, 1), (1, 2), (2, 2)]), (1, 4, [(0, 1), (1, 1), (1, 1), (1, 1)]), (6, 3, [(0, 2), (2, 4), (4, 6)])])
def test_plan_clips_contiguous_and_balanced(n, world, want):
    plan = plan_clips(n, world)
    assert [(r.start, r.stop) for r in plan.ranges] == want
    assert [plan.owner(i) for i in range(n)] == sorted(plan.owner(i) for i in range(n))
    assert plan.describe().startswith(f"{n} clips on {world} ranks")


@pytest.mark.parametrize("bad", [-1, 2.0, True])
def test_plan_clips_rejects_bad_counts(bad):
    with pytest.raises(ValueError, match="num_clips must be an integer >= 0"):
        plan_clips(bad, 2)
    with pytest.raises(ValueError, match="world_size must be an integer >= 1"):
        plan_clips(2, 0)


def _recorded(vae, name, fn):
    """The inputs diffusers' own code passes to ``name`` during fn() (stock VAE, instance wrapper)."""
    seen, stock = [], getattr(vae, name)

    def rec(x):
        seen.append(x.clone())
        return stock(x)

    object.__setattr__(vae, name, rec)
    try:
        out = fn()
    finally:
        object.__delattr__(vae, name)
    return out, seen


@pytest.mark.parametrize("n", [7, 8, 11, 12, 14, 22])
def test_adapter_predicts_the_decode_windows(n):
    """clip_inputs = what _decode passes to _decode_clip (count, shapes, values), incl. the padded tails."""
    vae = mm.video_vae()
    ad = vae_adapter_for(vae)
    z = torch.randn(1, 4, n, 2, 2)
    with torch.no_grad():
        _, seen = _recorded(vae, "_decode_clip", lambda: vae._decode(z))
    want = ad.clip_inputs(z, "decode")
    assert len(want) == len(seen) == -(-(n + 3) // 5) - 1
    assert all(torch.equal(a, b) for a, b in zip(want, seen))
    assert all(w.shape[2] == 7 for w in want)  # tokens_chunk_size 5 + token_overlap 2


@pytest.mark.parametrize("frames", [1, 17, 22, 39, 40])
def test_adapter_predicts_the_encode_chunks(frames):
    vae = mm.video_vae()
    x = torch.randn(1, 3, frames, 12, 8)
    with torch.no_grad():
        _, seen = _recorded(vae, "_encode_clip", lambda: vae._encode(x))
    want = vae_adapter_for(vae).clip_inputs(x, "encode")
    assert len(want) == len(seen) == (1 if frames == 1 else -(-frames // 17))
    assert all(torch.equal(a, b) for a, b in zip(want, seen))


def test_chunked_mode_refused_before_anything_runs():
    vae = mm.video_vae()
    comm = Communicator(None, 2, 0)  # no process group: a collective would fail
    with pytest.raises(ConfigError, match=r"vae_parallel='chunked' is not supported for AutoencoderKLMiniMaxH3.*"
                                          r"\['exact', 'off'\]"):
        parallelize_vae(vae, comm, mode="chunked")
    assert "_decode" not in vae.__dict__ and "_encode" not in vae.__dict__
    with pytest.raises(NotImplementedError, match="by whole clips, not by rows"):
        vae_adapter_for(vae).spatial_layout("decode")


def test_family_record_has_parallel_vae():
    from lite_boost.models.minimax_h3 import MINIMAX_H3

    assert MINIMAX_H3.supports("parallel_vae")
    assert "audio VAE" in MINIMAX_H3.notes


# ------------------------------------------------------------------------------------------ gloo ranks
def _check_exact(world):
    results = _results(world)
    for kind, frames in (("decode", cases.DECODE[world]), ("encode", cases.ENCODE[world])):
        for tiling in ("default", "off", "small"):
            for f in frames:
                for rank, res in enumerate(results):
                    r = res[("exact", kind, tiling, f)]
                    assert r["ref_abs"] > 0.05 and r["diff"] <= TOL, (kind, tiling, f, rank, r)
                    assert r["shape"] == results[0][("exact", kind, tiling, f)]["shape"]
                    if r["ranges"] is None:  # one clip: every rank runs the call whole, no collective
                        assert r["calls"] == {} and r["own"] == 1, r
                        continue
                    start, stop = r["ranges"][rank]
                    assert r["own"] == stop - start, r  # this rank ran its own clips only
                    assert r["calls"] == {"vae_clip_header": 1, "vae_clip_shapes": 1, "vae_clip_gather": 1}, r


def _clip_counts(world):
    res = _results(world)[0]
    return {k[1:]: (len(v["ranges"]) and v["ranges"][-1][1]) for k, v in res.items()
            if k[0] == "exact" and v.get("ranges")}


def test_decode_encode_2_ranks():
    _check_exact(2)
    counts = _clip_counts(2)
    assert counts[("decode", "off", 14)] == 3 and counts[("encode", "off", 39)] == 3  # odd clip counts
    r = _results(2)[0][("exact", "decode", "off", 7)]
    assert r["ranges"] is None  # 7 latent frames: one clip


def test_decode_encode_3_ranks():
    _check_exact(3)
    counts = _clip_counts(3)
    assert counts[("decode", "off", 8)] == 2 and counts[("encode", "off", 22)] == 2  # fewer clips than ranks
    assert counts[("decode", "off", 22)] == 4 and counts[("decode", "off", 27)] == 5  # 4, 5 clips on 3 ranks
    for res in _results(3):
        assert res[("exact", "decode", "off", 8)]["ranges"][2] == (2, 2)  # rank 2 owns none and still gathers


@pytest.mark.parametrize("world", [2, 3])
def test_decode_with_batch_slicing(world):
    for res in _results(world):
        r = res[("exact", "decode", "slicing", 14)]
        assert r["ref_abs"] > 0.05 and r["diff"] <= TOL and r["shape"][0] == 2, r
        assert r["calls"]["vae_clip_gather"] == 2, r  # one clip-parallel call per batch item


@pytest.mark.parametrize("world", [2, 3])
def test_failures_raise_on_every_rank(world):
    for rank, res in enumerate(_results(world)):
        fails = res[("errors", "clip_fails")]["error"]
        if rank == world - 1:
            assert fails.startswith("MemoryError: out of memory in this clip (injected)"), fails
        else:
            assert "VAECollectiveError" in fails and f"rank(s) [{world - 1}] failed" in fails, fails
        differ = res[("errors", "shapes_differ")]["error"]
        assert "VAECollectiveError" in differ and "different clip counts" in differ, differ
        bad = res[("errors", "bad_prediction")]["error"]
        assert bad.startswith("RuntimeError") and "did not predict" in bad and "vae_parallel='off'" in bad, bad
        after = res[("errors", "after")]
        assert after["error"] is None and after["diff"] <= TOL, after  # the group still works
        for case in ("clip_fails", "shapes_differ", "bad_prediction", "after"):
            assert res[("errors", case)]["left"] == [], res[("errors", case)]  # nothing left installed


@pytest.mark.parametrize("world", [2, 3])
def test_pipeline_parallel_vae_matches_one_process(world):
    for rank, res in enumerate(_results(world)):
        r = res[("pipeline", "pipe")]
        assert r["mode"] == "exact" and r["clips"] == 7, r  # 37 latent frames
        assert r["ref_abs"] > 0.05 and r["diff"] <= TOL and r["latents"] <= TOL, r
        start, stop = r["ranges"][rank]
        assert r["own"] == stop - start and r["calls"]["vae_clip_gather"] == 1, r
        assert r["removed"] and r["again"] <= TOL, r
