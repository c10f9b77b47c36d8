"""Per-rank bodies of the LTX-Video parallel-VAE tests (spawned gloo ranks, test_parallel_ltx_vae.py).

Every case compares the exact-mode decode / encode of a tiny AutoencoderKLLTXVideo (0.9.0-, 0.9.1- and
0.9.5-style configs, tests/_tiny_ltx.py) with the stock one-process call on the same rank, from the same
RNG state (the 0.9.1 decoder draws noise). One process group serves all cases of a world size.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _dist_vae_cases import _diff  # noqa: E402  (max abs difference, inf on a shape mismatch)

# (latent frames, latent rows, latent columns): video = 1 + 8 (n - 1) frames, 32 x rows, 32 x columns pixels
SHAPES = ((2, 3, 5), (1, 5, 2), (3, 7, 3), (1, 2, 3))  # 2 rows: fewer than 3 ranks, that call runs unsplit
TILES = dict(tile_sample_min_height=128, tile_sample_min_width=128, tile_sample_stride_height=96,
             tile_sample_stride_width=96)


def _inputs(n, h, w, seed):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(1, 8, n, h, w, generator=g)
    x = torch.rand(1, 3, 1 + 8 * (n - 1), 32 * h, 32 * w, generator=g) * 2 - 1
    return z, x


def _calls(vae, z, temb, x):
    torch.manual_seed(123)  # the 0.9.1 decoder's noise: the same draws in both runs
    dec = vae.decode(z, temb).sample
    enc = vae.encode(x).latent_dist.mean
    return dec, enc


def _compare(vae, comm, z, x, temb=None, **kw):
    from lite_boost.parallel.vae import parallelize_vae, unparallelize_vae

    with torch.no_grad():
        ref_d, ref_e = _calls(vae, z, temb, x)
        parallelize_vae(vae, comm, mode="exact", **kw)
        stats = comm.enable_stats()
        stats.reset()
        try:
            torch.manual_seed(123)
            dec = vae.decode(z, temb).sample
            dc = dict(stats.calls)
            stats.reset()
            enc = vae.encode(x).latent_dist.mean
            ec = dict(stats.calls)
        finally:
            unparallelize_vae(vae)
            comm.stats = None
    return dict(dec=_diff(dec, ref_d), enc=_diff(enc, ref_e), ref_abs=ref_d.abs().mean().item(),
                enc_abs=ref_e.abs().mean().item(), halos=dc.get("vae_halo", 0), enc_halos=ec.get("vae_halo", 0),
                dec_calls=dc, enc_calls=ec)


def exact_cases(mesh):
    """Each config: several shapes (uneven bands, one call too small to split), with and without the
    VAE's spatial tiling; 0.9.0 also with framewise (temporal-tile) decode / encode and both halo paths."""
    import _tiny_ltx as tl

    from lite_boost.parallel.vae import vae_adapter_for

    comm, out = mesh.world, {}
    for version in tl.VAE_VERSIONS:
        vae = tl.tiny_ltx_vae(version=version)
        temb = torch.tensor([0.05]) if vae.config.timestep_conditioning else None
        for i, (n, h, w) in enumerate(SHAPES):
            z, x = _inputs(n, h, w, seed=10 * i + len(version))
            out[(version, n, h, w)] = _compare(vae, comm, z, x, temb)
        layouts = {k: vae_adapter_for(vae).spatial_layout(k) for k in ("decode", "encode")}
        out[(version, "layout")] = {k: dict(halo=len(lay.halo), pairs=len(lay.pairs), gather=len(lay.gather),
                                            band_random=len(lay.band_random), unit=lay.unit)
                                    for k, lay in layouts.items()}
        vae.enable_tiling(**TILES)  # 224 x 160 px: 3 x 2 tiles of 4 x 4 latent rows (the last 1 row high)
        z, x = _inputs(2, 7, 5, seed=77)
        out[(version, "tiled")] = _compare(vae, comm, z, x, temb)
        vae.disable_tiling()
        if version == "0.9.0":
            z, x = _inputs(2, 5, 3, seed=5)
            for overlap_halo in (True, False):
                out[(version, "overlap_halo", overlap_halo)] = _compare(vae, comm, z, x, overlap_halo=overlap_halo)
            vae.use_framewise_decoding = True  # 3 latent frames > 2 per tile; 17 video frames > 16 (encode too)
            z, x = _inputs(3, 5, 3, seed=6)
            out[(version, "framewise")] = _compare(vae, comm, z, x)
            vae.enable_tiling(**TILES)
            z, x = _inputs(3, 5, 5, seed=7)
            out[(version, "framewise_tiled")] = _compare(vae, comm, z, x)
    return out


def pipeline_cases(mesh):
    """T2V (0.9.0 and the timestep-conditioned 0.9.5 VAE), I2V and the condition pipeline (VAE encode
    too): stock single process vs ParallelManager (Ulysses + exact parallel VAE), decoded video."""
    import _tiny_ltx as tl

    from lite_boost.parallel import ParallelManager, unparallelize
    from lite_boost.parallel.vae import parallel_vae_state

    out = {}
    for kind, version in (("t2v", "0.9.0"), ("t2v", "0.9.5"), ("i2v", "0.9.0"), ("condition", "0.9.5")):
        call = lambda: tl.call_kwargs(kind, height=160, width=96, frames=9, steps=1, output_type="pt")  # noqa: E731
        ref = tl.tiny_ltx_pipeline(kind, vae_version=version)(**call()).frames
        pipe = tl.tiny_ltx_pipeline(kind, vae_version=version)
        ParallelManager(pipe, {"parallel": {"timeout_s": 120, "vae_parallel": "exact"}}, mesh=mesh)
        state = parallel_vae_state(pipe.vae)
        stats = mesh.world.enable_stats()
        stats.reset()
        got = pipe(**call()).frames
        halos = stats.calls.get("vae_halo", 0)
        mesh.world.stats = None
        out[(kind, version)] = dict(diff=_diff(got, ref), ref_abs=ref.abs().mean().item(), calls=dict(state.calls),
                                    halos=halos)
        unparallelize(pipe)
        out[(kind, version)]["removed"] = parallel_vae_state(pipe.vae) is None and "_decode" not in pipe.vae.__dict__
    return out


def run_cases(rank, world, init_method, names):
    from lite_boost.parallel.groups import init_mesh

    mesh = init_mesh({"timeout_s": 120}, init_method=init_method)
    return {name: globals()[f"{name}_cases"](mesh) for name in names}
