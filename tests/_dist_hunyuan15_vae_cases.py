"""Per-rank bodies of the HunyuanVideo-1.5 parallel-VAE tests (spawned gloo ranks, test_parallel_hunyuan15_vae.py).

Every case compares the parallel decode / encode with the sequential one computed on the same rank
(the stock diffusers method, no collectives); the pipeline cases compare with a one-process run of the
same tiny pipeline. One process group serves all cases of a world size; results are small dicts.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _dist_vae_cases import _conv_kernels, _diff, _run  # noqa: E402  (conv kernel counts; max diff; one parallel decode + encode)


def vae_small():
    """The tiny pipelines' VAE: 4x spatial (2 downsamplers), 2x temporal."""
    from _tiny_hunyuan import _hunyuan15_vae

    return _hunyuan15_vae()


def vae_deep():
    """8x spatial (3 downsamplers), 4x temporal (two temporal up/down samplers), like the real 16x / 4x VAE."""
    from diffusers import AutoencoderKLHunyuanVideo15

    torch.manual_seed(1)
    return AutoencoderKLHunyuanVideo15(
        in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 16, 16), layers_per_block=1,
        spatial_compression_ratio=8, temporal_compression_ratio=4, downsample_match_channel=False,
        upsample_match_channel=False).eval()


VAES = {"small": vae_small, "deep": vae_deep}


def inputs(vae, n_lat, h, w, seed):
    cfg = vae.config
    g = torch.Generator().manual_seed(seed)
    t, s = cfg.temporal_compression_ratio, cfg.spatial_compression_ratio
    z = torch.randn(1, cfg.latent_channels, n_lat, h, w, generator=g)
    x = torch.rand(1, 3, 1 + t * (n_lat - 1), s * h, s * w, generator=g) * 2 - 1
    return z, x


def _ZeroEdges(vae):
    from lite_boost.models.hunyuan_video15_vae import HunyuanVideo15VAEAdapter

    class ZeroEdges(HunyuanVideo15VAEAdapter):
        def spatial_layout(self, kind):
            layout = super().spatial_layout(kind)
            layout.replicate = []
            return layout

    return ZeroEdges(vae)


def exact_cases(mesh):
    """Exact mode vs sequential: both VAEs, images and clips, uneven bands, too few rows, tiling."""
    from lite_boost.parallel.vae import vae_adapter_for

    out = {}
    with torch.no_grad():
        for name, make in VAES.items():
            vae = make()
            ad = vae_adapter_for(vae)
            per_call = {k: len(ad.spatial_layout(k).halo) for k in ("decode", "encode")}
            for n, h, w in ((1, 3, 4), (2, 5, 3), (3, 7, 5), (2, 2, 3)):
                z, x = inputs(vae, n, h, w, seed=10 * n + h)
                ref_d, ref_e = vae.decode(z).sample, vae.encode(x).latent_dist.mean
                dec, enc, dc, ec, _ = _run(vae, mesh.world, z, x, mode="exact")
                out[(name, n, h, w)] = dict(dec=_diff(dec, ref_d), enc=_diff(enc, ref_e),
                                            ref_abs=ref_d.abs().mean().item(), enc_abs=ref_e.abs().mean().item(),
                                            halos=dc.get("vae_halo", 0), enc_halos=ec.get("vae_halo", 0),
                                            expect_halos=per_call["decode"], expect_enc_halos=per_call["encode"])
            # negative control: the same bands with zero rows at the image edges (what a zero-padded conv
            # would see) instead of the replicated edge row must NOT match
            z, x = inputs(vae, 2, 5, 3, seed=25)
            ref_d = vae.decode(z).sample
            dec = _run(vae, mesh.world, z, x, mode="exact", adapter=_ZeroEdges(vae))[0]
            out[(name, "zero_edges")] = dict(dec=_diff(dec, ref_d))
            if name == "small":
                # a frame tall enough that PyTorch runs full-frame convolutions with oneDNN while a band alone
                # would fall back to the im2col kernel: the bands keep the full frame's kernel (profiler counts)
                z, _ = inputs(vae, 5, 54, 1, seed=41)
                kernels = {}
                for which in ("seq", "par"):
                    dec, kernels[which] = _conv_kernels(lambda: vae.decode(z).sample if which == "seq"
                                                        else _run(vae, mesh.world, z, x, mode="exact")[0])
                    ref_d = dec if which == "seq" else ref_d
                out[(name, "full_frame_kernel")] = dict(dec=_diff(dec, ref_d), kernels=kernels)
            # the VAE's own spatial tiling: 4 x 4 latent tiles (stride 3), 4 * scale pixel tiles (stride 3 * scale)
            s = vae.config.spatial_compression_ratio
            vae.enable_tiling(tile_sample_min_height=4 * s, tile_sample_min_width=4 * s, tile_latent_min_height=4,
                              tile_latent_min_width=4)
            z, x = inputs(vae, 2, 9, 7, seed=77)
            ref_d, ref_e = vae.decode(z).sample, vae.encode(x).latent_dist.mean
            for mode, kw in (("exact", {}), ("chunked", {"overlap": 2})):
                dec, enc, dc, ec, _ = _run(vae, mesh.world, z, x, mode=mode, **kw)
                out[(name, "tiled", mode)] = dict(dec=_diff(dec, ref_d), enc=_diff(enc, ref_e),
                                                  ref_abs=ref_d.abs().mean().item(), enc_abs=ref_e.abs().mean().item(),
                                                  halos=dc.get("vae_halo", 0), enc_halos=ec.get("vae_halo", 0))
            vae.disable_tiling()
    return out


def chunked_cases(mesh):
    """Chunked mode: frame counts; an overlap covering the prefix = sequential; at the default overlap
    rank 0's chunk equals the sequential prefix and the other chunks really are approximations."""
    vae = vae_deep()
    out = {}
    with torch.no_grad():
        for n, overlap in ((1, 1), (2, 2), (5, 5), (5, None), (7, None)):
            z, x = inputs(vae, n, 3, 2, seed=40 + n)
            ref_d, ref_e = vae.decode(z).sample, vae.encode(x).latent_dist.mean
            dec, enc, dc, ec, (plan, enc_plan) = _run(vae, mesh.world, z, x, mode="chunked", overlap=overlap)
            f0 = 1 + 4 * (plan.chunks[0].stop - 1)
            e0 = enc_plan.chunks[0].stop
            out[(n, overlap)] = dict(
                shapes=(tuple(dec.shape) == tuple(ref_d.shape), tuple(enc.shape) == tuple(ref_e.shape)),
                dec=_diff(dec, ref_d), enc=_diff(enc, ref_e), chunks=len(plan.chunks),
                chunk0=_diff(dec[:, :, :f0], ref_d[:, :, :f0]), enc_chunk0=_diff(enc[:, :, :e0], ref_e[:, :, :e0]),
                dec_calls=dc, enc_calls=ec, dec_sum=dec.double().sum().item())
    return out


def pipelines_cases(mesh):
    """HunyuanVideo15Pipeline (T2V: decode) and HunyuanVideo15ImageToVideoPipeline (I2V: encode + decode),
    decoded to pixels: one process (stock) vs ParallelManager (Ulysses + the parallel VAE)."""
    import _tiny_hunyuan as hy

    from lite_boost.parallel import ParallelManager, unparallelize
    from lite_boost.parallel.vae import parallel_vae_state

    out = {}
    for task in ("t2v", "i2v"):
        spec = hy.Hy15Spec(heads=3, task=task)
        ref = hy.hunyuan15_pipeline(spec)(**hy.call_kwargs_15(spec, output_type="pt")).frames
        for mode in ("exact", "chunked"):
            pipe = hy.hunyuan15_pipeline(spec)
            ParallelManager(pipe, {"parallel": {"timeout_s": 120, "vae_parallel": mode}}, mesh=mesh)
            state = parallel_vae_state(pipe.vae)
            stats = mesh.world.enable_stats()
            stats.reset()
            got = pipe(**hy.call_kwargs_15(spec, output_type="pt")).frames
            halos = stats.calls.get("vae_halo", 0)
            mesh.world.stats = None
            calls = dict(state.calls)
            unparallelize(pipe)
            out[(task, mode)] = dict(diff=_diff(got, ref), ref_abs=ref.abs().mean().item(), calls=calls, halos=halos,
                                     mode=state.mode, removed=parallel_vae_state(pipe.vae) is None
                                     and "_decode" not in pipe.vae.__dict__)
    return out


def run_cases(rank, world, init_method, names):
    from lite_boost.parallel.groups import init_mesh

    mesh = init_mesh({"timeout_s": 120}, init_method=init_method)
    torch.manual_seed(0)
    return {name: globals()[f"{name}_cases"](mesh) for name in names}
