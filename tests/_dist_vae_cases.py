"""Per-rank bodies of the parallel-VAE tests (spawned gloo ranks, see test_parallel_vae.py).

Every case compares the parallel decode / encode with the sequential one computed on the same rank
(the stock diffusers method, no collectives). One process group serves all cases of a world size.
Results are small dicts of numbers so the parent asserts (and prints) them.
"""

from __future__ import annotations

import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "wan_vae_small")


def tiny_vae(seed=0):
    from diffusers import AutoencoderKLWan

    torch.manual_seed(seed)
    return AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1).eval()


def _inputs(n_lat, h, w, seed):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(1, 16, n_lat, h, w, generator=g)
    x = torch.rand(1, 3, 1 + 4 * (n_lat - 1), 8 * h, 8 * w, generator=g) * 2 - 1
    return z, x


def _diff(a, b):
    if tuple(a.shape) != tuple(b.shape):
        return float("inf")
    return (a - b).abs().max().item()


def _conv_kernels(call):
    """(call(), (aten::mkldnn_convolution calls, aten::slow_conv3d_forward calls)) counted with the profiler."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = call()
    ev = {e.key: e.count for e in prof.key_averages()}
    return out, (ev.get("aten::mkldnn_convolution", 0), ev.get("aten::slow_conv3d_forward", 0))


def _run(vae, comm, z, x, **kw):
    from lite_boost.parallel.vae import parallel_vae_state, parallelize_vae, unparallelize_vae

    parallelize_vae(vae, comm, **kw)
    stats = comm.enable_stats()
    stats.reset()
    try:
        dec = vae.decode(z).sample
        dec_calls = dict(stats.calls)
        plan = parallel_vae_state(vae).last_plan  # the decode's (encode plans balance another cost)
        stats.reset()
        enc = vae.encode(x).latent_dist.mean if x is not None else None
        enc_calls = dict(stats.calls)
        enc_plan = parallel_vae_state(vae).last_plan
    finally:
        unparallelize_vae(vae)
        comm.stats = None
    return dec, enc, dec_calls, enc_calls, (plan, enc_plan)


def bookkeeping_cases(mesh):
    """Frame count and order (1, 2, 5, 21 latent frames), incl. more ranks than chunks: chunked mode
    with an overlap covering the whole prefix must equal the sequential decode / encode up to fp32
    rounding (a chunk runs the VAE's 1x1 (post-)quant convolution over its own frames instead of all
    frames; on some CPUs the kernel for another frame count rounds the last bit differently)."""
    vae = tiny_vae()
    out = {}
    with torch.no_grad():
        for n in (1, 2, 5, 21):
            z, x = _inputs(n, 2, 3, seed=n)
            ref_d, ref_e = vae.decode(z).sample, vae.encode(x).latent_dist.mean
            # chunk_size 1: more chunks than ranks, round-robin; 8 at 21 frames: two chunks on rank 0
            for chunk_size in ((None, 1) if n < 21 else (None, 8)):
                dec, enc, dc, ec, (plan, _) = _run(vae, mesh.world, z, x, mode="chunked", overlap=n,
                                                   chunk_size=chunk_size)
                out[(n, chunk_size)] = dict(
                    dec_frames=dec.shape[2], ref_frames=ref_d.shape[2], dec_diff=_diff(dec, ref_d),
                    enc_frames=enc.shape[2], enc_diff=_diff(enc, ref_e), chunks=len(plan.chunks),
                    dec_calls=dc, enc_calls=ec)
    return out


def chunked_cases(mesh):
    """Default-style overlap on random weights: rank 0's chunk bit-identical, frame count exact,
    every rank gets the same video; gather='rank0' leaves the others an empty video."""
    vae = tiny_vae()
    out = {}
    with torch.no_grad():
        for n, ov in ((5, 1), (9, 2)):
            z, x = _inputs(n, 2, 3, seed=10 + n)
            ref_d, ref_e = vae.decode(z).sample, vae.encode(x).latent_dist.mean
            dec, enc, dc, ec, (plan, enc_plan) = _run(vae, mesh.world, z, x, mode="chunked", overlap=ov)
            c0, e0 = plan.chunks[0], enc_plan.chunks[0]
            f0 = 1 + 4 * (c0.stop - 1)
            out[(n, ov)] = dict(
                shape_ok=dec.shape == ref_d.shape and enc.shape == ref_e.shape,
                chunk0_equal=torch.equal(dec[:, :, :f0], ref_d[:, :, :f0]),
                enc_chunk0_equal=torch.equal(enc[:, :, : e0.stop], ref_e[:, :, : e0.stop]),
                rest_diff=_diff(dec[:, :, f0:], ref_d[:, :, f0:]), dec_sum=dec.double().sum().item(),
                chunks=[(c.rank, c.start, c.stop, c.warm_start) for c in plan.chunks], dec_calls=dc)
        z, _ = _inputs(5, 2, 3, seed=99)
        ref = vae.decode(z).sample
        dec, _, dc, _, _ = _run(vae, mesh.world, z, None, mode="chunked", overlap=5, gather="rank0")
        out["rank0"] = dict(frames=dec.shape[2], equal=torch.equal(dec, ref) if dec.shape[2] else None, calls=dc)
        # the runner's phase timers (benchmarks): one record per own chunk, then concat/pad, gather,
        # stitch; recording them changes nothing in the output
        from lite_boost.parallel.vae import parallelize_vae, unparallelize_vae

        z, _ = _inputs(9, 2, 3, seed=19)
        runner = parallelize_vae(vae, mesh.world, mode="chunked", overlap=2)
        try:
            plain = vae.decode(z).sample
            untimed = list(runner.last_phases)
            runner.record_phases = True
            timed = vae.decode(z).sample
            phases = runner.last_phases
            mine = [c.index for c in runner.last_plan.for_rank(mesh.world.rank)]
        finally:
            unparallelize_vae(vae)
        out["phases"] = dict(equal=torch.equal(plain, timed), untimed=untimed, mine=mine,
                             names=[(p["name"], p.get("index")) for p in phases],
                             nonneg=all(p["wall"] >= 0 and p["cpu"] >= 0 for p in phases))
    return out


def exact_cases(mesh):
    """Exact mode vs sequential: decode and encode, several frame counts, uneven bands, tiling."""
    from lite_boost.parallel.vae import vae_adapter_for

    vae = tiny_vae()
    out = {}
    with torch.no_grad():
        for n, h, w in ((1, 3, 4), (2, 5, 3), (5, 4, 6), (21, 3, 2)):
            z, x = _inputs(n, h, w, seed=20 + n)
            ref_d, ref_e = vae.decode(z).sample, vae.encode(x).latent_dist.mean
            dec, enc, dc, ec, _ = _run(vae, mesh.world, z, x, mode="exact")
            out[(n, h, w)] = dict(dec=_diff(dec, ref_d), enc=_diff(enc, ref_e), ref_abs=ref_d.abs().mean().item(),
                                  halos=dc.get("vae_halo", 0), enc_halos=ec.get("vae_halo", 0))
            if (n, h) == (2, 5) and mesh.world.size == 2:  # every band >= 2 rows at every level
                ad = vae_adapter_for(vae)
                per_call = {k: len(lay.halo) - len(lay.pairs) + len(lay.bottom_halo)
                            for k, lay in ((k, ad.spatial_layout(k)) for k in ("decode", "encode"))}
                out[(n, h, w)].update(pairs=len(ad.spatial_layout("decode").pairs),
                                      expect_halos=n * per_call["decode"], expect_enc_halos=2 * per_call["encode"],
                                      dec_gathers=dc.get("gather", 0))
        # a frame tall enough that PyTorch runs the full-resolution convolutions with oneDNN, while each
        # rank's band alone would fall below its size threshold into the im2col kernel: the bands must
        # keep the full frame's kernel (counted with the profiler), and the result must stay exact
        z, x = _inputs(2, 54, 1, seed=41)
        ref_d = vae.decode(z).sample
        kernels = {}
        for name in ("seq", "par"):
            dec, kernels[name] = _conv_kernels(lambda: vae.decode(z).sample if name == "seq"
                                               else _run(vae, mesh.world, z, None, mode="exact")[0])
        out["full_frame_kernel"] = dict(dec=_diff(dec, ref_d), enc=0.0, ref_abs=ref_d.abs().mean().item(),
                                        kernels=kernels)
        # with the VAE's own spatial tiling (tiles of 32x32 pixels, stride 16: 3 x 3 tiles)
        vae.enable_tiling(tile_sample_min_height=32, tile_sample_min_width=32, tile_sample_stride_height=16,
                          tile_sample_stride_width=16)
        z, x = _inputs(3, 6, 6, seed=31)
        ref_d, ref_e = vae.decode(z).sample, vae.encode(x).latent_dist.mean
        for mode, kw in (("exact", {}), ("chunked", {"overlap": 3})):
            dec, enc, dc, ec, _ = _run(vae, mesh.world, z, x, mode=mode, **kw)
            out[("tiled", mode)] = dict(dec=_diff(dec, ref_d), enc=_diff(enc, ref_e), halos=dc.get("vae_halo", 0))
        vae.disable_tiling()
    return out


def seam_case(mesh):
    """Trained small VAE: chunked decode / encode at the adapter's default overlaps vs sequential."""
    from diffusers import AutoencoderKLWan

    from lite_boost.models.wan_vae import WAN_VAE_DEFAULT_ENCODE_OVERLAP, WAN_VAE_DEFAULT_OVERLAP
    from lite_boost.parallel.vae import parallel_vae_state, parallelize_vae, unparallelize_vae

    sys.path.insert(0, os.path.join(os.path.dirname(DATA), "..", "..", "scripts"))
    from train_small_wan_vae import procedural_video, psnr

    vae = AutoencoderKLWan.from_pretrained(DATA).eval()
    video = procedural_video(torch.Generator().manual_seed(777), 81, 32, 32).unsqueeze(0)
    with torch.no_grad():
        z = vae.encode(video).latent_dist.mode()
        ref = vae.decode(z).sample
        parallelize_vae(vae, mesh.world, mode="chunked")
        dec = vae.decode(z).sample
        plan = parallel_vae_state(vae).last_plan
        enc = vae.encode(video).latent_dist.mode()
        enc_plan = parallel_vae_state(vae).last_plan
        unparallelize_vae(vae)
        dec_enc = vae.decode(enc).sample  # what the encode seams do to pixels (sequential decode)
    seams = []
    for c in plan.chunks[1:]:
        a = 1 + 4 * (c.start - 1)
        seams.append(psnr(dec[:, :, a : a + 4], ref[:, :, a : a + 4]))
    peak = (z.max() - z.min()).item()
    enc_seams, enc_pix = [], []
    for c in enc_plan.chunks[1:]:
        err = (enc[:, :, c.start] - z[:, :, c.start]).double().pow(2).mean().item()
        enc_seams.append(float("inf") if err == 0 else 10 * math.log10(peak ** 2 / err))
        a = 1 + 4 * (c.start - 1)
        enc_pix.append(psnr(dec_enc[:, :, a : a + 4], ref[:, :, a : a + 4]))
    s0 = enc_plan.chunks[0].stop
    return dict(overlap=plan.overlap, default=WAN_VAE_DEFAULT_OVERLAP, seams=seams, recon=psnr(ref, video),
                chunk0_equal=torch.equal(dec[:, :, :1 + 4 * (plan.chunks[0].stop - 1)],
                                         ref[:, :, :1 + 4 * (plan.chunks[0].stop - 1)]),
                enc_overlap=enc_plan.overlap, enc_default=WAN_VAE_DEFAULT_ENCODE_OVERLAP, enc_seams=enc_seams,
                enc_pix=enc_pix, enc_chunk0_equal=torch.equal(enc[:, :, :s0], z[:, :, :s0]))


def pipeline_cases(mesh, init_method):
    """T2V and I2V tiny pipelines, stock single process vs ParallelManager (Ulysses + parallel VAE)."""
    import copy

    import lite_boost
    from conftest import pipeline_kwargs
    from lite_boost.demo import TinyWanSpec, tiny_wan_pipeline
    from lite_boost.parallel import ParallelManager, unparallelize
    from lite_boost.parallel.vae import parallel_vae_state

    out = {}
    for kind in ("t2v", "i2v"):
        base = tiny_wan_pipeline(kind, spec=TinyWanSpec(heads=3, head_dim=24))
        kw = dict(height=32, width=48, num_frames=5, steps=2, output_type="pt")
        ref = lite_boost.boost(copy.deepcopy(base))(**pipeline_kwargs(kind, **kw)).frames
        for mode, extra in (("exact", {}), ("chunked", {"vae_overlap": 2})):
            pipe = copy.deepcopy(base)
            enc_calls = []
            ParallelManager(pipe, {"parallel": {"timeout_s": 120, "vae_parallel": mode, **extra}}, mesh=mesh)
            state = parallel_vae_state(pipe.vae)
            got = pipe(**pipeline_kwargs(kind, **kw)).frames
            enc_calls.append(dict(state.calls))
            unparallelize(pipe)
            out[(kind, mode)] = dict(diff=_diff(got, ref), ref_abs=ref.abs().mean().item(), calls=enc_calls[0],
                                     removed=parallel_vae_state(pipe.vae) is None and "_decode" not in pipe.vae.__dict__)
    return out


def qwen_exact_cases(mesh):
    """Qwen-Image's VAE (Wan 2.1's structure under its own classes) in exact mode vs sequential: an image
    (one latent frame) and a short clip, decode and encode, uneven bands."""
    from diffusers import AutoencoderKLQwenImage

    torch.manual_seed(0)
    vae = AutoencoderKLQwenImage(base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1).eval()
    out = {}
    with torch.no_grad():
        for n, h, w in ((1, 5, 4), (1, 7, 3), (2, 4, 6)):
            z, x = _inputs(n, h, w, seed=50 + n + h)
            ref_d, ref_e = vae.decode(z).sample, vae.encode(x).latent_dist.mean
            dec, enc, dc, ec, _ = _run(vae, mesh.world, z, x, mode="exact")
            out[(n, h, w)] = dict(dec=_diff(dec, ref_d), enc=_diff(enc, ref_e), ref_abs=ref_d.abs().mean().item(),
                                  halos=dc.get("vae_halo", 0), enc_halos=ec.get("vae_halo", 0))
    return out


def run_cases(rank, world, init_method, names):
    from lite_boost.parallel.groups import init_mesh

    mesh = init_mesh({"timeout_s": 120}, init_method=init_method)
    torch.manual_seed(0)
    res = {}
    for name in names:
        if name == "pipelines":
            res[name] = pipeline_cases(mesh, init_method)
        else:
            res[name] = globals()[f"{name}_cases" if name != "seam" else "seam_case"](mesh)
    return res


# ------------------------------------------------------------------------------------------ Qwen-Image 2.1
def tiny_qwen21_vae(residual=True, seed=0):
    """A random-weight ``AutoencoderKLQwenImage21`` (8x, 4 image channels, 8 latent channels). ``residual``: the
    released structure (AvgDown3D / DupUp3D shortcuts, temporal resamplers that skip a first frame); else the
    plain one (residual blocks and resamplers only)."""
    from diffusers import AutoencoderKLQwenImage21

    torch.manual_seed(seed)
    kw = dict(is_residual=residual)  # (attn_scales: stock's encoder passes feat_cache to its attention blocks)
    return AutoencoderKLQwenImage21(base_dim=8, decoder_base_dim=8, z_dim=8, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                                    temperal_downsample=[False, True, True], latents_mean=[0.0] * 8,
                                    latents_std=[1.0] * 8, scale_factor_spatial=8, **kw).eval()


def _qwen21_inputs(h, w, seed, batch=1, frames=1):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(batch, 8, 1, h, w, generator=g)
    x = torch.rand(batch, 4, frames, 8 * h, 8 * w, generator=g) * 2 - 1
    return z, x


def _restored(vae) -> bool:
    """No hook, no instance-level forward / conv kernel and the stock row padding on any module of ``vae``."""
    return all(not m._forward_pre_hooks and not m._forward_hooks and "forward" not in m.__dict__
               and "_conv_forward" not in m.__dict__ for m in vae.modules()) and "_decode" not in vae.__dict__ \
        and "_encode" not in vae.__dict__


def _paddings(vae):
    return [(getattr(m, "_padding", None), getattr(m, "padding", None)) for m in vae.modules()]


def qwen21_exact_cases(mesh):
    """AutoencoderKLQwenImage21 in exact mode vs the stock one-process VAE: decode and encode at latent heights
    that do not divide evenly over the ranks, both structures, a batch of 2, a 4-frame encode input (stock encodes
    its first frame), spatial tiling; after unparallelize the VAE is stock again (no hook, padding restored, a
    decode bit-equal to the one before)."""
    out = {}
    with torch.no_grad():
        for residual in (True, False):
            vae = tiny_qwen21_vae(residual)
            pads = _paddings(vae)
            for h, w, batch, frames in ((5, 4, 1, 1), (7, 3, 1, 4), (4, 6, 2, 1)):
                z, x = _qwen21_inputs(h, w, seed=60 + h, batch=batch, frames=frames)
                ref_d, ref_e = vae.decode(z).sample, vae.encode(x).latent_dist.mean
                dec, enc, dc, ec, _ = _run(vae, mesh.world, z, x, mode="exact")
                after = vae.decode(z).sample
                out[(residual, h, w)] = dict(
                    dec=_diff(dec, ref_d), enc=_diff(enc, ref_e), ref_abs=ref_d.abs().mean().item(),
                    enc_abs=ref_e.abs().mean().item(), halos=dc.get("vae_halo", 0), enc_halos=ec.get("vae_halo", 0),
                    restored=_restored(vae) and _paddings(vae) == pads and torch.equal(after, ref_d))
        vae = tiny_qwen21_vae(True)
        # diffusers' spatial tiling (tiles of 32 x 32 px, stride 16): every tile split into bands, gathered per tile
        vae.enable_tiling(tile_sample_min_height=32, tile_sample_min_width=32, tile_sample_stride_height=16,
                          tile_sample_stride_width=16)
        z, x = _qwen21_inputs(6, 5, seed=70)
        ref_d, ref_e = vae.decode(z).sample, vae.encode(x).latent_dist.mean
        dec, enc, dc, ec, _ = _run(vae, mesh.world, z, x, mode="exact")
        out["tiled"] = dict(dec=_diff(dec, ref_d), enc=_diff(enc, ref_e), ref_abs=ref_d.abs().mean().item(),
                            enc_abs=ref_e.abs().mean().item(), halos=dc.get("vae_halo", 0),
                            enc_halos=ec.get("vae_halo", 0), restored=_restored(vae))
    return out


def qwen21_pipeline_cases(mesh):
    """The tiny QwenImage21Pipeline (16x VAE) under ParallelManager (Ulysses over all ranks, the parallel VAE at
    its default, exact) vs stock in one process, image out: text-to-image with CFG (decode of 4 x 6 latents) and
    with a condition image (its 64 x 128 px encode, then the decode); unparallelize leaves the stock VAE."""
    import _tiny_qwen21 as t
    from lite_boost.parallel import ParallelManager, unparallelize
    from lite_boost.parallel.vae import parallel_vae_state

    out = {}
    for kind in ("t2i", "cond"):
        def build():
            pipe = t.pipeline()
            return pipe if kind == "t2i" else t.image_conditioned(pipe)

        def kwargs():
            if kind == "t2i":
                return t.call_kwargs(height=64, width=96, steps=2, output_type="pt")
            return dict(t.call_kwargs(height=64, width=96, steps=2, cfg=False, output_type="pt"),
                        output_resolution=96, image=[t.condition_image(32, 64)])

        ref = t.run(build(), kwargs())
        pipe = build()
        ParallelManager(pipe, {"parallel": {"timeout_s": 120}}, mesh=mesh)
        state = parallel_vae_state(pipe.vae)
        stats = mesh.world.enable_stats()
        stats.reset()
        got = t.run(pipe, kwargs())
        calls = dict(stats.calls)
        mesh.world.stats = None
        unparallelize(pipe)
        z = torch.randn(1, 4, 1, 3, 5, generator=torch.Generator().manual_seed(3))
        with torch.no_grad():
            stock = t.pipeline().vae.decode(z).sample  # the same seeded weights, never parallelized
            again = pipe.vae.decode(z).sample
        out[kind] = dict(diff=_diff(got, ref), ref_abs=ref.abs().mean().item(), shape=tuple(got.shape),
                         mode=state.mode if state is not None else None, calls=dict(state.calls) if state else None,
                         halos=calls.get("vae_halo", 0), removed=parallel_vae_state(pipe.vae) is None
                         and _restored(pipe.vae) and torch.equal(again, stock))
    return out
