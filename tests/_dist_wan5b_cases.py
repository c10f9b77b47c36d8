"""Per-rank bodies of the Wan2.2-TI2V-5B multi-process tests (spawned gloo ranks, see test_wan22_5b.py).

Every case computes its reference on each rank in one process (boosted with the same feature config,
no collectives), then runs a fresh copy under ParallelManager, and returns small dicts of numbers.
One process group serves every case of a world size, so the start-up is paid once per world size.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

TIMEOUT_S = 120


@dataclass(frozen=True)
class Case:
    kind: str  # "t2v" (WanPipeline) or "i2v" (WanImageToVideoPipeline), both expand_timesteps=True
    hwf: tuple  # height, width, num_frames
    cfg: int = 1  # cfg_degree
    heads: int = 3
    sparsity: float | None = None
    cache: str | None = None
    vae: str = "exact"  # vae_parallel


# 96 x 160 x 9 -> 3 x 3 x 5 = 45 tokens (uneven on 2 and 4 ranks); 64 x 160 x 5 -> 2 x 2 x 5 = 20 (uneven on 3)
T45, T20 = (96, 160, 9), (64, 160, 5)
PIPELINE_CASES = {
    "t2v_tok45": Case("t2v", T45),
    "i2v_tok45": Case("i2v", T45),
    "t2v_tok20": Case("t2v", T20),
    "i2v_tok20_h5": Case("i2v", T20, heads=5),
    "t2v_cfg2": Case("t2v", T45, cfg=2),
    "i2v_cfg2": Case("i2v", T45, cfg=2),
    "t2v_cfg2_seq2": Case("t2v", T45, cfg=2),
    "i2v_cfg2_seq2": Case("i2v", T45, cfg=2),
    "t2v_sparse0": Case("t2v", T45, sparsity=0.0),
    "i2v_sparse08": Case("i2v", T45, sparsity=0.8),
    "i2v_sparse08_tok20": Case("i2v", T20, sparsity=0.8),
    "t2v_fbc": Case("t2v", T45, cache="first_block_cache:threshold=0.11"),
    "i2v_fbc_tok20": Case("i2v", T20, cache="first_block_cache:threshold=0.07"),
    # 3 latent frames on 2 ranks: the default decode overlap (2) covers the second chunk's whole prefix
    "i2v_vae_chunked": Case("i2v", T45, vae="chunked"),
}
# transformer-level shard probes: name -> latent token grid (F, H, W)
SHARD_CASES = {"shards_tok45": (3, 3, 5), "shards_tok20": (2, 2, 5)}
WORLD_CASES = {
    2: ["t2v_tok45", "i2v_tok45", "t2v_cfg2", "i2v_cfg2", "t2v_sparse0", "i2v_sparse08", "t2v_fbc", "i2v_vae_chunked",
        "shards_tok45", "compiled", "vae"],
    3: ["t2v_tok20", "i2v_tok20_h5", "i2v_sparse08_tok20", "i2v_fbc_tok20", "shards_tok20", "shards_tok45", "vae"],
    4: ["t2v_cfg2_seq2", "i2v_cfg2_seq2"],
}


def _config(case: Case, parallel: bool) -> dict:
    cfg = {}
    if parallel:
        cfg["parallel"] = {"cfg_degree": case.cfg, "timeout_s": TIMEOUT_S, "vae_parallel": case.vae}
    if case.sparsity is not None:
        cfg["sparse"] = {"sparse_type": "rf_v2", "sparsity": case.sparsity, "block_size": 4, "backend": "gather"}
    if case.cache is not None:
        cfg["cache"] = case.cache
    return cfg


def _diff(a, b):
    return (a - b).abs().max().item() if tuple(a.shape) == tuple(b.shape) else math.inf


class _BlockProbe:
    """Records what ``blocks[0]`` receives: tokens of hidden_states and of the per-token timestep_proj."""

    def __init__(self, model):
        self.tokens, self.temb = [], []
        self.handle = model.blocks[0].register_forward_pre_hook(self._pre)

    def _pre(self, mod, args):
        hidden, _, temb = args[:3]
        self.tokens.append(hidden.shape[1])
        self.temb.append(temb.shape[1] if temb.ndim == 4 else None)

    def remove(self):
        self.handle.remove()


def pipeline_case(name, mesh):
    import lite_boost
    from _tiny_wan5b import call_kwargs, tiny_wan5b_pipeline
    from lite_boost.parallel import ParallelManager, unparallelize
    from lite_boost.parallel.comm import head_split
    from lite_boost.parallel.vae import parallel_vae_state

    case = PIPELINE_CASES[name]
    steps = 4 if case.cache else 2
    kw = lambda: call_kwargs(case.kind, case.hwf, steps=steps)  # noqa: E731
    ref_pipe = lite_boost.boost(tiny_wan5b_pipeline(case.kind, heads=case.heads), _config(case, parallel=False))
    ref = ref_pipe(**kw()).frames
    pipe = tiny_wan5b_pipeline(case.kind, heads=case.heads)
    ParallelManager(pipe, _config(case, parallel=True), mesh=mesh)
    probe = _BlockProbe(pipe.transformer)
    stats = mesh.sequence.enable_stats()
    stats.reset()
    try:
        got = pipe(**kw()).frames
    finally:
        probe.remove()
    par = pipe.transformer._lite_boost.extras["parallel"]
    out = dict(maxdiff=_diff(got, ref), ref_abs=ref.abs().mean().item(), block_tokens=sorted(set(probe.tokens)),
               temb_tokens=sorted(set(probe.temb)), transformer_calls=len(probe.tokens),
               qkv_exchanges=stats.calls.get("qkv_to_heads", 0), layers=len(pipe.transformer.blocks),
               cfg_calls=dict(par.cfg.calls) if par.cfg is not None else None,
               vae_calls=dict(parallel_vae_state(pipe.vae).calls))
    if case.sparsity is not None:
        def sparse(p):
            st = p.transformer._lite_boost.extras["sparse"]
            return sorted({e.path for e in st.events}), st.mean_effective_sparsity()

        (out["ref_paths"], out["ref_effective"]), (out["paths"], out["effective"]) = sparse(ref_pipe), sparse(pipe)
        out["local_heads"] = head_split(case.heads, mesh.sequence_degree)[mesh.sequence_rank]
    if case.cache is not None:
        def decisions(p):
            return [(d.context, d.compute) for d in p.transformer._lite_boost.extras["cache"].decisions]

        out["ref_decisions"], out["decisions"] = [c for _, c in decisions(ref_pipe)], [c for _, c in decisions(pipe)]
    mesh.sequence.stats = None
    unparallelize(pipe)
    return out


def _transformer_inputs(grid, seed=3):
    """Batch 2, a different timestep per token, the first frame's tokens at 0 (as first_frame_mask gives)."""
    g = torch.Generator().manual_seed(seed)
    f, h, w = grid
    x = torch.randn(2, 48, f, 2 * h, 2 * w, generator=g)
    t = (torch.rand(2, f * h * w, generator=g) * 900).round() + 50
    t[:, : h * w] = 0
    return x, t, torch.randn(2, 512, 32, generator=g)


class _EmbedProbe:
    """The timestep entering the condition embedder, its temb / timestep_proj and blocks[0]'s inputs."""

    def __init__(self, model):
        self.seen = {}
        self.handles = [
            model.condition_embedder.register_forward_pre_hook(self._emb_pre, with_kwargs=True),
            model.condition_embedder.register_forward_hook(self._emb_post),
            model.blocks[0].register_forward_pre_hook(self._block_pre),
        ]

    def _emb_pre(self, mod, args, kwargs):
        self.seen["timestep"] = args[0].clone()

    def _emb_post(self, mod, args, out):
        self.seen["temb"], self.seen["timestep_proj"] = out[0].clone(), out[1].clone()

    def _block_pre(self, mod, args):
        self.seen["hidden"], self.seen["block_temb"] = args[0].clone(), args[2].clone()

    def remove(self):
        for h in self.handles:
            h.remove()


def shard_case(name, mesh):
    """Direct transformer call with per-token timesteps: the shards of timestep, temb, timestep_proj and
    hidden states a rank sees are the one-process tensors' rows of that rank's token range."""
    import lite_boost
    from _tiny_wan5b import tiny_wan5b_transformer
    from lite_boost.parallel import ParallelManager

    grid = SHARD_CASES[name]
    x, t, ctx = _transformer_inputs(grid)
    ref_model = lite_boost.boost(tiny_wan5b_transformer())
    model = ParallelManager(tiny_wan5b_transformer(), {"parallel": {"timeout_s": TIMEOUT_S}}, mesh=mesh)
    ref_probe, probe = _EmbedProbe(ref_model), _EmbedProbe(model)
    with torch.no_grad():
        ref = ref_model(x, t, ctx).sample
        got = model(hidden_states=x, timestep=t, encoder_hidden_states=ctx, return_dict=False)[0]
    ref_probe.remove()
    probe.remove()
    P, r, S = mesh.sequence_degree, mesh.sequence_rank, math.prod(grid)
    shard = -(-S // P)
    lo, hi = r * shard, min((r + 1) * shard, S)
    a, b = ref_probe.seen, probe.seen
    ref_rows = {"timestep": a["timestep"].view(2, S), "temb": a["temb"], "timestep_proj": a["timestep_proj"],
                "hidden": a["hidden"], "block_temb": a["block_temb"]}
    got_rows = {"timestep": b["timestep"].view(2, -1), **{k: b[k] for k in ("temb", "timestep_proj", "hidden",
                                                                          "block_temb")}}
    shape_ok = all(v.shape[1] == shard for v in got_rows.values())
    slices = max(_diff(got_rows[k][:, : hi - lo], ref_rows[k][:, lo:hi]) for k in ref_rows) if shape_ok else math.inf
    return dict(maxdiff=_diff(got, ref), ref_abs=ref.abs().max().item(), shape_ok=shape_ok, slices=slices,
                block_tokens=got_rows["hidden"].shape[1], shard=shard)


def compiled_case(mesh):
    """Blocks compiled with fullgraph=True (dynamo + AOT, aot_eager) hold the Ulysses exchanges; per-token
    timesteps on two steps (the graph is reused), 45 tokens and 3 heads on the sequence group."""
    import warnings

    import lite_boost
    from _tiny_wan5b import tiny_wan5b_transformer
    from lite_boost.parallel import ParallelManager

    warnings.simplefilter("ignore")
    torch._dynamo.reset()
    ref_model = lite_boost.boost(tiny_wan5b_transformer())
    model = ParallelManager(tiny_wan5b_transformer(), {"parallel": {"timeout_s": TIMEOUT_S}}, mesh=mesh)
    model.compile_repeated_blocks(fullgraph=True, backend="aot_eager")
    stats = model._lite_boost.extras["parallel"].hooks.comm.enable_stats()
    stats.reset()
    diffs = []
    with torch.no_grad():
        for seed in (3, 4):
            x, t, ctx = _transformer_inputs(SHARD_CASES["shards_tok45"], seed=seed)
            diffs.append(_diff(model(x, t, ctx).sample, ref_model(x, t, ctx).sample))
    out = dict(diffs=diffs, eager_collectives=dict(stats.calls))
    model._lite_boost.extras["parallel"].hooks.comm.stats = None
    torch._dynamo.reset()
    return out


def vae_inputs(n_lat, h, w, seed):
    """Latents (48 channels, n_lat x h x w) and a video of 1 + 4 (n_lat - 1) frames of 16 h x 16 w pixels."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(1, 48, n_lat, h, w, generator=g)
    x = torch.rand(1, 3, 1 + 4 * (n_lat - 1), 16 * h, 16 * w, generator=g) * 2 - 1
    return z, x


def vae_case(mesh):
    """The 48-channel residual, patchified VAE: exact mode (decode and encode, uneven bands, the VAE's own
    spatial tiling, a call too small to split) and chunked mode vs the sequential VAE."""
    from _dist_vae_cases import _run
    from _tiny_wan5b import tiny_wan5b_vae

    comm = mesh.world
    vae = tiny_wan5b_vae()
    out = {}

    def run(z, x, **kw):
        dec, enc, dc, ec, (plan, enc_plan) = _run(vae, comm, z, x, **kw)
        return dec, enc, dc, ec, plan, enc_plan

    with torch.no_grad():
        # (latent frames, latent rows, latent columns): 1 frame = the I2V conditioning encode; 5 rows on 2 / 3
        # ranks = uneven bands; 6 x 10 = the pipelines' latent; 2 rows on 3 ranks = too small, runs unsplit
        shapes = [(1, 3, 4), (2, 5, 3), (3, 6, 10), (5, 4, 6)] + ([(2, 2, 2)] if comm.size == 3 else [])
        for n, h, w in shapes:
            z, x = vae_inputs(n, h, w, seed=20 + n)
            ref_d, ref_e = vae.decode(z).sample, vae.encode(x).latent_dist.mean
            dec, enc, dc, ec, _, _ = run(z, x, mode="exact")
            key = ("exact", n, h, w) + (("unsplit",) if h < comm.size else ())
            out[key] = dict(dec=_diff(dec, ref_d), enc=_diff(enc, ref_e), halos=dc.get("vae_halo", 0),
                            enc_halos=ec.get("vae_halo", 0))
            # every halo convolution as one call after its exchange (the "auto" policy's path for large
            # CPU convolutions; this VAE's are small, so "auto" above overlaps every exchange)
            dec, enc, dc, ec, _, _ = run(z, x, mode="exact", overlap_halo=False)
            out[key[:1] + ("single_call",) + key[1:]] = dict(
                dec=_diff(dec, ref_d), enc=_diff(enc, ref_e), halos=dc.get("vae_halo", 0), enc_halos=ec.get("vae_halo", 0))
            for label, overlap in (("prefix", n), ("default", None)):
                dec, enc, dc, ec, plan, enc_plan = run(z, x, mode="chunked", overlap=overlap)
                f0 = 1 + 4 * (plan.chunks[0].stop - 1)
                e0 = enc_plan.chunks[0].stop
                whole = label == "prefix"  # an overlap covering every chunk's prefix: the whole output is exact
                out[("chunked", label, n, h, w)] = dict(
                    dec=_diff(dec, ref_d) if whole else _diff(dec[:, :, :f0], ref_d[:, :, :f0]),
                    enc=_diff(enc, ref_e) if whole else _diff(enc[:, :, :e0], ref_e[:, :, :e0]),
                    # chunk 0 is the sequential call on a prefix (its 1x1 (post-)quant convolution over
                    # fewer frames may round the last bit differently on some CPUs)
                    chunk0=max(_diff(dec[:, :, :f0], ref_d[:, :, :f0]), _diff(enc[:, :, :e0], ref_e[:, :, :e0])),
                    shape_ok=dec.shape == ref_d.shape and enc.shape == ref_e.shape, dec_calls=dc)
        # with the VAE's own spatial tiling (tiles of 64 x 64 pixels, stride 32)
        vae.enable_tiling(tile_sample_min_height=64, tile_sample_min_width=64, tile_sample_stride_height=32,
                          tile_sample_stride_width=32)
        z, x = vae_inputs(3, 6, 6, seed=31)
        ref_d, ref_e = vae.decode(z).sample, vae.encode(x).latent_dist.mean
        dec, enc, dc, ec, _, _ = run(z, x, mode="exact")
        out[("exact", "tiled")] = dict(dec=_diff(dec, ref_d), enc=_diff(enc, ref_e), halos=dc.get("vae_halo", 0),
                                       enc_halos=ec.get("vae_halo", 0))
        vae.disable_tiling()
    return out


def run_cases(rank, world_size, init_method, names):
    from lite_boost.parallel import initialize_usp

    meshes = {}

    def mesh(cfg):
        if cfg not in meshes:  # one mesh per cfg degree, sharing the default group
            meshes[cfg] = initialize_usp({"parallel": {"cfg_degree": cfg, "timeout_s": TIMEOUT_S}},
                                         init_method=init_method)
        return meshes[cfg]

    out = {}
    for name in names:
        if name in PIPELINE_CASES:
            out[name] = pipeline_case(name, mesh(PIPELINE_CASES[name].cfg))
        elif name in SHARD_CASES:
            out[name] = shard_case(name, mesh(1))
        elif name == "compiled":
            out[name] = compiled_case(mesh(1))
        elif name == "vae":
            out[name] = vae_case(mesh(1))
        else:
            raise KeyError(name)
    return out
