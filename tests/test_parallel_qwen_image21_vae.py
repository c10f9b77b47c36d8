"""Parallel VAE of Qwen-Image 2.1 (``AutoencoderKLQwenImage21``, exact mode) vs the stock one-process VAE.

Multi-process (2 and 3 gloo ranks, fp32): decode and encode of tiny random-weight VAEs (the released residual
structure and the plain one) at latent heights that split unevenly over the ranks, a batch of 2, a 4-frame encode
input, diffusers' spatial tiling; the tiny ``QwenImage21Pipeline`` under ``ParallelManager`` (text-to-image with
CFG, and with a condition image: encode and decode) against stock in one process; ``unparallelize`` leaves the
stock VAE. One process: ``chunked`` and inputs stock diffusers refuses are refused before any collective.
"""

import types

import pytest
import torch

import _dist_vae_cases as cases
from _dist_utils import run_ranks

TOL = 1e-5
_RESULTS = {}


def _results(world):
    if world not in _RESULTS:
        _RESULTS[world] = run_ranks(cases.run_cases, world, ["qwen21_exact", "qwen21_pipeline"], timeout=600)
        for rank, res in enumerate(_RESULTS[world]):  # the numbers, for the log (-s)
            for name, rows in res.items():
                for key, r in rows.items():
                    print(f"world {world} rank {rank} {name} {key}: {r}")
    return _RESULTS[world]


@pytest.mark.parametrize("world", [2, 3])
def test_qwen21_vae_exact_matches_stock(world):
    for rank, res in enumerate(_results(world)):
        for key, r in res["qwen21_exact"].items():
            assert r["ref_abs"] > 0.01 and r["enc_abs"] > 0.01, (rank, key, r)
            assert r["dec"] <= TOL and r["enc"] <= TOL, (rank, world, key, r)
            assert r["halos"] > 0 and r["enc_halos"] > 0, (rank, key, r)  # really split into bands
            assert r["restored"], (rank, key, r)


@pytest.mark.parametrize("world", [2, 3])
def test_qwen21_pipeline_parallel_vae_matches_stock(world):
    for rank, res in enumerate(_results(world)):
        for kind, r in res["qwen21_pipeline"].items():
            assert r["shape"] == (1, 4, 64, 96) and r["ref_abs"] > 0.01, r  # RGBA, 64 x 96 px
            assert r["diff"] <= TOL, (rank, world, kind, r)
            assert r["mode"] == "exact" and r["halos"] > 0, r  # the VAE ran in bands
            assert r["calls"] == {"decode": 1, "encode": 1 if kind == "cond" else 0}, r
            assert r["removed"], r


class _NoCollectives:
    """A 2-rank communicator stand-in: any collective (any attribute but size / rank) fails the test."""

    size, rank = 2, 0

    def __getattr__(self, name):
        raise AssertionError(f"collective or communicator use before the input check: {name}")


@pytest.mark.usefixtures("single_process_env")
def test_qwen21_vae_refusals_before_any_collective(monkeypatch):
    from lite_boost.config import ConfigError
    from lite_boost.parallel.vae import parallelize_vae, unparallelize_vae, vae_adapter_for

    vae = cases.tiny_qwen21_vae()
    assert type(vae_adapter_for(vae)).__name__ == "QwenImage21VAEAdapter"
    with pytest.raises(ConfigError, match=r"vae_parallel='chunked' is not supported for AutoencoderKLQwenImage21 "
                                          r".*valid vae_parallel here: \['exact', 'off'\]"):
        parallelize_vae(vae, _NoCollectives(), mode="chunked")
    assert "_decode" not in vae.__dict__
    parallelize_vae(vae, _NoCollectives(), mode="exact")
    try:
        with torch.no_grad():
            z = torch.randn(1, 8, 2, 3, 3)
            with pytest.raises(ValueError, match=r"AutoencoderKLQwenImage21\.decode: the VAE takes one latent frame; "
                                                 r"the input has 2 frames"):
                vae.decode(z)
            with pytest.raises(ValueError, match=r"AutoencoderKLQwenImage21\.encode: .* the input has 5 frames"):
                vae.encode(torch.rand(1, 4, 5, 24, 24))
    finally:
        unparallelize_vae(vae)
    with torch.no_grad():  # what stock does with the same inputs
        with pytest.raises(RuntimeError, match="Expected 3D .* or 4D .* input to conv2d"):
            vae.decode(torch.randn(1, 8, 2, 3, 3))
        with pytest.raises(ValueError, match="cannot take a feature cache"):
            vae.encode(torch.rand(1, 4, 5, 24, 24))
    # the pipeline: chunked refused at planning, before any process group (2-rank launcher environment)
    import _tiny_qwen21 as t
    import lite_boost

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    pipe = t.pipeline()
    with pytest.raises(ConfigError, match="vae_parallel='chunked' is not supported for AutoencoderKLQwenImage21"):
        lite_boost.ParallelManager(pipe, {"parallel": {"vae_parallel": "chunked"}})
    assert not lite_boost.api.is_boosted(pipe)
