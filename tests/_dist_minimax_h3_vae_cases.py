"""Per-rank bodies of the MiniMax-H3 parallel-VAE tests (spawned gloo ranks, test_parallel_minimax_h3_vae.py).

The VAE cases compare the clip-parallel decode / encode of a tiny random-weight ``AutoencoderKLMiniMaxH3``
with the stock one-process call made on the same rank before it (no collectives); the pipeline case compares
``ParallelManager`` on the tiny MiniMax-H3 pipeline with a decode step against the one-process pipeline. One
process group serves all cases of a world size; results are small dicts.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# decode: latent frames (clips of 5 + 2 latent frames: 7 -> 1 clip, 8 / 12 -> 2, 14 / 17 -> 3, 22 -> 4, 27 -> 5;
# 8 and 14 pad the tail) x latent rows x columns; encode: video frames (1 -> the image path, 22 -> 2 clips of 17,
# 39 -> 3, 56 -> 4) at 4x the latent size
DECODE = {2: (7, 8, 14, 17, 22), 3: (8, 17, 22, 27)}
ENCODE = {2: (1, 22, 39), 3: (22, 56)}
LATENT_HW = (3, 2)
TILED_HW = (4, 3)  # 16 x 12 pixels: 3 x 2 tiles of 8 x 8 pixels (overlap 4)


def _diff(a, b):
    return float("inf") if a.shape != b.shape else (a - b).abs().max().item()


def _ranges(plan):
    return None if plan is None else [(r.start, r.stop) for r in plan.ranges]


def _counted(vae, name):
    """Count this rank's own calls of the VAE's per-clip method (instance attribute; the runner calls it)."""
    calls = []
    stock = getattr(vae, name)

    def counted(x):
        calls.append(tuple(x.shape))
        return stock(x)

    object.__setattr__(vae, name, counted)
    return calls


def _run(vae, comm, fn):
    """fn() under the clip-parallel VAE: (output, collectives counted, ClipPlan, own per-clip calls)."""
    from lite_boost.parallel.vae import parallel_vae_state, parallelize_vae, unparallelize_vae

    own = {k: _counted(vae, f"_{k}_clip") for k in ("decode", "encode")}
    parallelize_vae(vae, comm)
    stats = comm.enable_stats()
    stats.reset()
    try:
        out = fn()
        calls = dict(stats.calls)
        plan = parallel_vae_state(vae).last_clips
    finally:
        unparallelize_vae(vae)
        comm.stats = None
        for k in ("decode", "encode"):
            object.__delattr__(vae, f"_{k}_clip")
    return out, calls, plan, own


def _inputs(vae, n_lat, hw, frames, seed):
    g = torch.Generator().manual_seed(seed)
    s = vae.spatial_compression_ratio
    z = torch.randn(2 if seed % 2 else 1, vae.config.latent_channels, n_lat, *hw, generator=g)
    x = torch.randn(1, 3, frames, hw[0] * s, hw[1] * s, generator=g)
    return z, x


def exact_cases(mesh, world):
    """Decode and encode vs stock at clip counts around the rank count; default (one tile), untiled, small tiles."""
    import _tiny_minimax_h3 as mm

    vae = mm.video_vae()
    out = {}
    with torch.no_grad():
        for tiling in ("default", "off", "small"):
            if tiling == "off":
                vae.disable_tiling()
            elif tiling == "small":
                vae.enable_tiling(tile_sample_min_height=8, tile_sample_min_width=8, tile_sample_min_overlap_height=4,
                                  tile_sample_min_overlap_width=4)
            hw = TILED_HW if tiling == "small" else LATENT_HW
            for n in DECODE[world]:
                z, _ = _inputs(vae, n, hw, 1, seed=n)
                ref = vae.decode(z).sample
                got, calls, plan, own = _run(vae, mesh.world, lambda: vae.decode(z).sample)
                out[("decode", tiling, n)] = dict(diff=_diff(got, ref), ref_abs=ref.abs().mean().item(),
                                                  shape=tuple(got.shape), calls=calls, own=len(own["decode"]),
                                                  ranges=_ranges(plan))
            for f in ENCODE[world]:
                _, x = _inputs(vae, 1, hw, f, seed=f)
                ref = vae.encode(x).latent_dist.mean
                got, calls, plan, own = _run(vae, mesh.world, lambda: vae.encode(x).latent_dist.mean)
                out[("encode", tiling, f)] = dict(diff=_diff(got, ref), ref_abs=ref.abs().mean().item(),
                                                  shape=tuple(got.shape), calls=calls, own=len(own["encode"]),
                                                  ranges=_ranges(plan))
        # use_slicing: decode() calls _decode once per batch item; each call spreads its own clips
        vae.disable_tiling()
        vae.enable_slicing()
        z, _ = _inputs(vae, 14, LATENT_HW, 1, seed=3)  # batch 2
        ref = vae.decode(z).sample
        got, calls, plan, own = _run(vae, mesh.world, lambda: vae.decode(z).sample)
        out[("decode", "slicing", 14)] = dict(diff=_diff(got, ref), ref_abs=ref.abs().mean().item(),
                                              shape=tuple(got.shape), calls=calls, own=len(own["decode"]))
    return out


def errors_cases(mesh, world):
    """Every rank raises (no rank left waiting): a clip failing on the last rank; inputs of different
    clip counts per rank; an adapter predicting other windows than _decode passes. Then a good call."""
    import _tiny_minimax_h3 as mm

    from lite_boost.models.minimax_h3_vae import MiniMaxH3VAEAdapter
    from lite_boost.parallel.vae import parallelize_vae, unparallelize_vae

    class Shifted(MiniMaxH3VAEAdapter):  # every window one latent frame late
        def clip_inputs(self, inp, kind, *args, **kwargs):
            return [c.roll(1, dims=2) for c in super().clip_inputs(inp, kind, *args, **kwargs)]

    vae = mm.video_vae()
    rank = mesh.world.rank
    out = {}
    z, _ = _inputs(vae, 17, LATENT_HW, 1, seed=4)  # 3 clips: one on every rank at 3 ranks
    with torch.no_grad():
        ref = vae.decode(z).sample
        for case in ("clip_fails", "shapes_differ", "bad_prediction", "after"):
            runner = parallelize_vae(vae, mesh.world, adapter=Shifted(vae) if case == "bad_prediction" else None)
            if case == "clip_fails" and rank == world - 1:
                def boom(x):
                    raise MemoryError("out of memory in this clip (injected)")
                object.__setattr__(vae, "_decode_clip", boom)
            zz = z[:, :, :12] if (case == "shapes_differ" and rank == 0) else z  # 2 clips on rank 0, 3 elsewhere
            try:
                got = vae.decode(zz).sample
                out[case] = dict(error=None, diff=_diff(got, ref))
            except Exception as exc:  # noqa: BLE001
                out[case] = dict(error=f"{type(exc).__name__}: {exc}")
            finally:
                vae.__dict__.pop("_decode_clip", None)
                unparallelize_vae(vae)
            out[case]["left"] = sorted(k for k in ("_decode", "_decode_clip", "_encode") if k in vae.__dict__)
            out[case]["runner"] = repr(runner)
    return out


def pipeline_cases(mesh, world):
    """The tiny MiniMax-H3 pipeline with a video decode step (37 latent frames: 7 clips) under ParallelManager
    (Ulysses over all ranks, parallel VAE by default) vs the one-process pipeline; unparallelize restores it."""
    import _tiny_minimax_h3 as mm

    from lite_boost.parallel import ParallelManager, unparallelize
    from lite_boost.parallel.vae import parallel_vae_state

    def call():
        kw = mm.call_kwargs(text=7, steps=3)
        kw.update(output=["videos", "latents"], output_type="pt")
        return kw

    with torch.no_grad():
        ref = mm.decode_pipeline()(**call())
        pipe = mm.decode_pipeline()
        ParallelManager(pipe, {"parallel": {"timeout_s": 120}}, mesh=mesh)
        state = parallel_vae_state(pipe.vae)
        own = _counted(pipe.vae, "_decode_clip")
        stats = mesh.world.enable_stats()
        stats.reset()
        got = pipe(**call())
        calls = {k: v for k, v in stats.calls.items() if k.startswith("vae_")}
        mesh.world.stats = None
        plan = state.last_clips
        object.__delattr__(pipe.vae, "_decode_clip")
        unparallelize(pipe)
        removed = parallel_vae_state(pipe.vae) is None and not {"_decode", "_encode"} & set(pipe.vae.__dict__)
        again = pipe(**call())  # unparallelized: the stock pipeline again
    return {"pipe": dict(diff=_diff(got["videos"], ref["videos"]), latents=_diff(got["latents"], ref["latents"]),
                         ref_abs=ref["videos"].abs().mean().item(), shape=tuple(got["videos"].shape),
                         mode=state.mode, calls=calls, own=len(own), clips=plan.num_clips,
                         ranges=_ranges(plan), removed=removed,
                         again=_diff(again["videos"], ref["videos"]))}


def run_cases(rank, world, init_method, names):
    from lite_boost.parallel.groups import init_mesh

    mesh = init_mesh({"timeout_s": 120}, init_method=init_method)
    torch.manual_seed(0)
    out = {}
    for name in names:
        out.update({(name,) + (k if isinstance(k, tuple) else (k,)): v
                    for k, v in globals()[f"{name}_cases"](mesh, world).items()})
    return out
