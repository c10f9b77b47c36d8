"""Per-rank bodies of the Flux.1 / Flux.2 parallel-VAE tests (spawned gloo ranks, test_parallel_flux_vae.py).

Every case compares the parallel result with the stock one computed on the same rank (diffusers' own methods,
no collectives) or, for the pipelines, with a one-process run of the same tiny pipeline. One process group
serves all cases of a world size; results are small dicts of numbers.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _dist_vae_cases import _diff, _run  # noqa: E402  (max diff; one parallel decode + encode)


def vae(cls_name: str = "AutoencoderKLFlux2", levels: int = 2, seed: int = 0, quant: bool = True):
    """A tiny random-weight 2-D VAE: ``levels`` blocks (8, 16, 16 channels), 4 groups, spatial factor
    ``2 ** (levels - 1)``, the mid-block attention on."""
    import diffusers

    torch.manual_seed(seed)
    return getattr(diffusers, cls_name)(
        in_channels=3, out_channels=3, block_out_channels=(8, 16, 16)[:levels], layers_per_block=1,
        down_block_types=("DownEncoderBlock2D",) * levels, up_block_types=("UpDecoderBlock2D",) * levels,
        latent_channels=4, norm_num_groups=4, sample_size=32, use_quant_conv=quant, use_post_quant_conv=quant).eval()


VAES = {"flux2": lambda: vae("AutoencoderKLFlux2", 2), "flux2_deep": lambda: vae("AutoencoderKLFlux2", 3, seed=1),
        "flux1": lambda: vae("AutoencoderKL", 2, seed=2, quant=False)}


def inputs(v, h, w, seed):
    g = torch.Generator().manual_seed(seed)
    s = 2 ** (len(v.config.block_out_channels) - 1)
    z = torch.randn(1, v.config.latent_channels, h, w, generator=g) * 2
    x = torch.rand(1, 3, s * h, s * w, generator=g) * 2 - 1
    return z, x


def group_norm_cases(mesh):
    """distributed_group_norm on this rank's uneven row band vs torch's GroupNorm of the whole tensor."""
    import torch.nn.functional as F

    from lite_boost.parallel.vae import distributed_group_norm, split_rows

    comm = mesh.world
    out = {}
    g = torch.Generator().manual_seed(3)
    for rows, groups, shift, dtype in ((5, 4, 0.0, torch.float32), (7, 2, 0.0, torch.float32),
                                       (9, 8, 100.0, torch.float32), (5, 1, 3.0, torch.float32),
                                       (7, 4, 0.0, torch.bfloat16)):
        x = (torch.randn(2, 8, rows, 6, generator=g) * 3 + shift).to(dtype)
        w, b = torch.randn(8, generator=g).to(dtype), torch.randn(8, generator=g).to(dtype)
        sizes = split_rows(rows, comm.size)
        start = sum(sizes[:comm.rank])
        band = x.narrow(-2, start, sizes[comm.rank])
        # the reference: torch's GroupNorm of the whole tensor in fp64 (bf16 inputs: of the same bf16 values)
        ref = F.group_norm(x.double(), groups, w.double(), b.double(), 1e-6).narrow(-2, start, sizes[comm.rank])
        torch_err = _diff(F.group_norm(x.float(), groups, w.float(), b.float(), 1e-6).narrow(
            -2, start, sizes[comm.rank]).double(), ref)
        got = distributed_group_norm(band, groups, w, b, 1e-6, comm=comm)
        # negative control: torch's GroupNorm of the band alone (statistics of this band only)
        alone = F.group_norm(band.double(), groups, w.double(), b.double(), 1e-6)
        out[(rows, groups, shift, str(dtype))] = dict(
            diff=_diff(got.double(), ref), rel=((got.double() - ref).abs() / (ref.abs() + 1e-2)).max().item(),
            torch_err=torch_err,
            alone=_diff(alone, ref), dtype=str(got.dtype), shape=tuple(got.shape) == tuple(band.shape))
    try:
        distributed_group_norm(torch.zeros(1, 6, 2, 2), 4, comm=comm)
        out["bad_groups"] = "no error"
    except ValueError as exc:
        out["bad_groups"] = str(exc)
    return out


def exact_cases(mesh):
    """Exact mode vs stock: three VAEs, uneven bands (5 x 7, 9 x 6 latents), too few rows (2 x 3 on 3 ranks runs
    unsplit), return_dict=False, and the VAE's own tiling."""
    out = {}
    with torch.no_grad():
        for name, make in VAES.items():
            v = make()
            for h, w in ((5, 7), (9, 6), (2, 3)):
                z, x = inputs(v, h, w, seed=10 * h + w)
                ref_d, ref_e = v.decode(z).sample, v.encode(x).latent_dist.mean
                dec, enc, dc, ec, _ = _run(v, mesh.world, z, x, mode="exact")
                out[(name, h, w)] = dict(dec=_diff(dec, ref_d), enc=_diff(enc, ref_e), ref_abs=ref_d.abs().mean().item(),
                                         enc_abs=ref_e.abs().mean().item(), halos=dc.get("vae_halo", 0),
                                         norms=dc.get("vae_group_norm", 0), enc_halos=ec.get("vae_halo", 0),
                                         enc_norms=ec.get("vae_group_norm", 0), dec_calls=dc)
            # negative control: the same bands with each rank's own GroupNorm statistics must NOT match
            z, x = inputs(v, 9, 6, seed=96)
            ref_d = v.decode(z).sample
            out[(name, "local_norms")] = dict(dec=_diff(_run(v, mesh.world, z, x, mode="exact",
                                                             adapter=_LocalNorms(v))[0], ref_d))
            # _decode(z, return_dict=False) through the wrapped method: a tuple
            from lite_boost.parallel.vae import parallelize_vae, unparallelize_vae

            parallelize_vae(v, mesh.world, mode="exact")
            try:
                tup = v._decode(z, False)
            finally:
                unparallelize_vae(v)
            out[(name, "tuple")] = dict(is_tuple=isinstance(tup, tuple), dec=_diff(tup[0], ref_d))
            # the VAE's own tiling: latent tiles of 4 (stride 3), pixel tiles of 4 * scale
            s = 2 ** (len(v.config.block_out_channels) - 1)
            v.enable_tiling()
            v.tile_latent_min_size, v.tile_sample_min_size = 4, 4 * s
            z, x = inputs(v, 9, 7, seed=77)
            ref_d, ref_e = v.decode(z).sample, v.encode(x).latent_dist.mean
            dec, enc, dc, ec, _ = _run(v, mesh.world, z, x, mode="exact")
            out[(name, "tiled")] = dict(dec=_diff(dec, ref_d), enc=_diff(enc, ref_e), ref_abs=ref_d.abs().mean().item(),
                                        enc_abs=ref_e.abs().mean().item(), halos=dc.get("vae_halo", 0),
                                        enc_halos=ec.get("vae_halo", 0))
            v.disable_tiling()
    return out


def _LocalNorms(v):
    from lite_boost.models.flux_vae import Flux2DVAEAdapter

    class LocalNorms(Flux2DVAEAdapter):
        def spatial_layout(self, kind):
            layout = super().spatial_layout(kind)
            layout.group_norm = []
            return layout

    return LocalNorms(v)


def pipelines_cases(mesh):
    """The tiny Flux.2 [klein] and Flux.1 pipelines decoded to pixels: one process (stock) vs ParallelManager
    (Ulysses over the ranks, the parallel VAE on by default); then unparallelize restores the stock VAE."""
    import _tiny_flux as t1
    import _tiny_flux2 as t2

    from lite_boost.parallel import ParallelManager, unparallelize
    from lite_boost.parallel.vae import parallel_vae_state

    out = {}
    runs = {"flux2": (lambda: t2.pipeline("klein"), lambda: t2.call_kwargs("klein", output_type="pt")),  # 6 x 10 px
            "flux1": (lambda: t1.pipeline("t2i"), lambda: t1.call_kwargs("t2i", output_type="pt"))}  # 12 x 20 px
    for name, (make, call) in runs.items():
        ref = make()(**call()).images
        pipe = make()
        ParallelManager(pipe, {"parallel": {"timeout_s": 120}}, mesh=mesh)
        state = parallel_vae_state(pipe.vae)
        stats = mesh.world.enable_stats()
        stats.reset()
        got = pipe(**call()).images
        halos, norms = stats.calls.get("vae_halo", 0), stats.calls.get("vae_group_norm", 0)
        mesh.world.stats = None
        calls = dict(state.calls) if state is not None else None
        unparallelize(pipe)
        again = pipe(**call()).images  # the stock VAE again (and the unparallelized transformer)
        out[name] = dict(diff=_diff(got, ref), ref_abs=ref.abs().mean().item(), calls=calls, halos=halos, norms=norms,
                         mode=state.mode if state is not None else None, again=_diff(again, ref),
                         removed=parallel_vae_state(pipe.vae) is None and "_decode" not in pipe.vae.__dict__
                         and not any("forward" in m.__dict__ for m in pipe.vae.modules()))
    return out


def run_cases(rank, world, init_method, names):
    from lite_boost.parallel.groups import init_mesh

    mesh = init_mesh({"timeout_s": 120}, init_method=init_method)
    torch.manual_seed(0)
    return {name: globals()[f"{name}_cases"](mesh) for name in names}
