"""Exact parallel VAE for LTX-Video (lite_boost.models.ltx_vae) against the one-process diffusers VAE.

Single process: the adapter's layout for the 0.9.0-, 0.9.1- and 0.9.5-style configs (which convolutions
exchange halos, the encoder's band unit, the noise-injecting blocks that draw the whole frame's noise) and
the refusals before any collective (chunked mode; modules that are not row-local). Multi-process (gloo, 2 and 3 ranks, one
process group per world size): decode and encode within 1e-5 of one process for every config, uneven
bands, a call too small to split, with and without spatial tiling, framewise (temporal-tile) decoding,
both halo paths, and the T2V / I2V / condition pipelines end to end at 2 ranks.
"""

import pytest
import torch

import _dist_ltx_vae_cases as cases
import _tiny_ltx as tl
from _dist_utils import run_ranks

from lite_boost.config import ConfigError
from lite_boost.parallel.vae import vae_adapter_for

TOL = 1e-5


# ------------------------------------------------------------------------------------------ single process
@pytest.mark.parametrize("version", tl.VAE_VERSIONS)
def test_layout_covers_every_spatial_convolution(version):
    """Every LTXVideoCausalConv3d with a spatial kernel is a halo module (its inner Conv3d, one row), the
    encoder's bands are multiples of patch 4 x its row strides (32), nothing is gathered, and the blocks
    that draw a noise frame draw it for the whole frame."""
    from diffusers.models.autoencoders.autoencoder_kl_ltx import LTXVideoCausalConv3d, LTXVideoResnetBlock3d

    vae = tl.tiny_ltx_vae(version=version)
    ad = vae_adapter_for(vae)
    assert ad.modes == ("exact",)
    for kind, root in (("decode", vae.decoder), ("encode", vae.encoder)):
        lay = ad.spatial_layout(kind)
        noisy = [m for m in root.modules() if isinstance(m, LTXVideoResnetBlock3d) and m.per_channel_scale1 is not None]
        want = [m.conv for m in root.modules() if isinstance(m, LTXVideoCausalConv3d) and m.kernel_size[1] > 1]
        assert [m for m, _ in lay.halo] == want and all(r == 1 for _, r in lay.halo)
        assert lay.gather == [] and lay.band_random == noisy
        assert (len(noisy) > 0) == (version == "0.9.1" and kind == "decode")
        assert lay.unit == (32 if kind == "encode" else 1)
        # conv pairs share one exchange only where nothing between them shifts zero rows (no timestep)
        assert (len(lay.pairs) > 0) == (kind == "encode" or version == "0.9.0")


def test_chunked_and_unsupported_modules_fail_before_any_collective(monkeypatch):
    from lite_boost.parallel import ParallelManager

    pipe = tl.tiny_ltx_pipeline("t2v")
    monkeypatch.setenv("WORLD_SIZE", "2")  # no rendezvous: reaching init_process_group would fail differently
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    with pytest.raises(ConfigError, match=r"vae_parallel='chunked' is not supported for AutoencoderKLLTXVideo "
                                          r"\(LTXVideoVAEAdapter\); valid vae_parallel here: \['exact', 'off'\]"):
        ParallelManager(pipe, {"parallel": {"vae_parallel": "chunked"}})
    pipe.vae.decoder.up_blocks[0].extra = torch.nn.GroupNorm(1, 8)  # statistics over the whole frame
    with pytest.raises(NotImplementedError, match=r"up_blocks.0.extra \(GroupNorm\) is not row-local; set "
                                                  r"vae_parallel='off'"):
        ParallelManager(pipe, {"parallel": {"vae_parallel": "exact"}})
    with pytest.raises(ConfigError, match="MASTER_ADDR"):  # 'off' leaves the VAE alone
        ParallelManager(pipe, {"parallel": {"vae_parallel": "off"}})


# ------------------------------------------------------------------------------------------ multi-process
_NAMES = {2: ["exact", "pipeline"], 3: ["exact"]}
_RESULTS = {}


def _results(world):
    if world not in _RESULTS:
        _RESULTS[world] = run_ranks(cases.run_cases, world, _NAMES[world], timeout=600)
    return _RESULTS[world]


@pytest.mark.parametrize("world", [2, 3])
def test_exact_matches_one_process(world):
    for rank, res in enumerate(_results(world)):
        ex = res["exact"]
        for key, r in ex.items():
            if key[1] == "layout":
                continue
            assert r["dec"] <= TOL and r["enc"] <= TOL, (world, rank, key, r)
            assert r["ref_abs"] > 0.01 and r["enc_abs"] > 0.01, (key, r)
            rows = key[2] if isinstance(key[1], int) else 5
            split = rows >= world  # decode: one latent row per rank at least; encode: 32 pixel rows
            assert (r["halos"] > 0) == split and (r["enc_halos"] > 0) == split, (world, key, r)
        for version in tl.VAE_VERSIONS:
            lay = ex[(version, "layout")]
            # 5 latent rows: every band >= 2 rows at every level at 2 ranks ([3, 2] latent, [96, 64] px):
            # ONE exchange per conv pair, one per other spatial conv; ONE all-gather: the output's
            # (untiled: the deferred gather)
            r = ex[(version, 1, 5, 2)]
            if world == 2:
                d, e = lay["decode"], lay["encode"]
                assert r["halos"] == d["halo"] - d["pairs"] and r["enc_halos"] == e["halo"] - e["pairs"], (version, r)
                assert r["dec_calls"].get("gather") == 1 and r["enc_calls"].get("gather") == 1, r


def test_pipelines_end_to_end():
    for rank, res in enumerate(_results(2)):
        for (kind, version), r in res["pipeline"].items():
            assert r["ref_abs"] > 0.01 and r["diff"] <= TOL, (rank, kind, version, r)
            assert r["calls"] == {"decode": 1, "encode": 0 if kind == "t2v" else 1}, r
            assert r["halos"] > 0 and r["removed"], r
