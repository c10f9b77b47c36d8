"""Per-rank bodies of the LTX-Video parallel parity tests (spawned gloo ranks, test_parallel_ltx.py).

Each case builds a tiny pipeline from a fixed seed and runs it in this process with stock diffusers (the
reference; for sparse / cached cases: with lite_boost.boost and the same config, single process), then a
fresh copy under ``ParallelManager`` on the rank group, and returns the max abs difference of the output
latents, what the first block saw (batch, video tokens, per-token modulation rows) and the collectives
that ran. All cases of one world size share one process group.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _dist_utils import parallel_record  # noqa: E402

# transformer calls and computed self-attentions (a reused attention does not count): count_block_work
WORK = dict(blocks="transformer_blocks", ffn="ff", attn="attn1")

# name -> kind, heads, (height, width, frames), cfg_degree, extra config, extra call arguments
# 96 x 160 x 9 px = 2 x 3 x 5 = 30 tokens; 96 x 160 x 17 px = 3 x 3 x 5 = 45; 128 x 256 x 25 px = 4 x 4 x 8 = 128
SMALL, ODD, SPARSE = (96, 160, 9), (96, 160, 17), (128, 256, 25)
_SPARSE = {"sparse_type": "rf_v2", "block_size": 4, "backend": "gather"}
CASES = {
    "t2v_h3_tok30": ("t2v", 3, SMALL, 1, {}, {}),
    "t2v_h5_tok45": ("t2v", 5, ODD, 1, {}, {}),  # inner dim 40: RoPE identity pad; 45 tokens: uneven shards
    "t2v_h2_tok30": ("t2v", 2, SMALL, 1, {}, {}),  # fewer heads than ranks at 3 and 4
    "t2v_h4_padded_batch2": ("t2v", 4, SMALL, 1, {}, {"batch": 2, "valid": [7, 3]}),
    "i2v_h3": ("i2v", 3, SMALL, 1, {}, {}),  # per-token timesteps, sharded with the tokens
    "condition_h3": ("condition", 3, SMALL, 1, {}, {}),  # video_coords RoPE rows
    "condition_prefix_h3": ("condition", 3, SMALL, 1, {}, {"frame_index": 8}),  # 15 condition tokens in front
    "condition_none_h3": ("condition", 3, SMALL, 1, {}, {"frame_index": None}),  # (B, 1) timesteps: broadcast
    "t2v_decoded_h3": ("t2v", 3, SMALL, 1, {}, {"output_type": "pt", "steps": 1}),  # exact parallel VAE decode
    "t2v_diffusers_rope_h3": ("t2v", 3, SMALL, 1, {}, {}),  # diffusers' own RoPE tables, split by the plan
    "t2v_sparse0_h3": ("t2v", 3, SPARSE, 1, {"sparse": {**_SPARSE, "sparsity": 0.0}}, {}),
    "t2v_sparse075_h3": ("t2v", 3, SPARSE, 1, {"sparse": {**_SPARSE, "sparsity": 0.75}}, {}),
    "i2v_first_block_cache_h3": ("i2v", 3, SMALL, 1, {"cache": "first_block_cache:threshold=0.5"}, {"steps": 4}),
    "t2v_cfg2_h3": ("t2v", 3, SMALL, 2, {}, {}),
    "i2v_cfg2_h3": ("i2v", 3, SMALL, 2, {}, {}),  # per-token timesteps split on the batch and the sequence
    "condition_prefix_cfg2_h3": ("condition", 3, SMALL, 2, {}, {"frame_index": 8}),  # video_coords split too
    "t2v_cfg2_mag_cache_h3": ("t2v", 3, SMALL, 2, {"cache": {"method": "mag_cache", "threshold": 0.5,
                                                               "num_inference_steps": 4, "max_skip_steps": 2,
                                                               "mag_ratios": [1.0, 0.99, 0.98, 0.97]}},
                              {"steps": 4}),
    "t2v_cfg2_no_guidance_h3": ("t2v", 3, SMALL, 2, {}, {"guidance": 1.0}),  # B = 1: nothing split
    # a state shared by cond and uncond is fine with batched CFG: each cfg rank reuses its half of the batch
    "t2v_cfg2_pab_h3": ("t2v", 3, SMALL, 2, {"cache": {"method": "pyramid_attention_broadcast",
                                                         "spatial_attention_block_skip_range": 2,
                                                         "spatial_attention_timestep_skip_range": (0, 1000)}},
                        {"steps": 4}),
}


def tokens(kind, hwf, extra):
    h, w, f = hwf
    n = ((f - 1) // 8 + 1) * (h // 32) * (w // 32)
    if kind == "condition" and (extra.get("frame_index", 0) or 0) > 0:
        n += (h // 32) * (w // 32)  # one latent frame of condition tokens
    return n


def _config(cfg_degree, extra):
    return {"parallel": {"cfg_degree": cfg_degree, "timeout_s": 120}, **extra}


def _keep_diffusers_rope(pipe):
    m = pipe.transformer
    if "forward" in m.rope.__dict__:
        del m.rope.forward
        m._lite_boost.rope_patched = False


def run_cases(rank, world_size, init_method, names):
    import _tiny_ltx as tl
    import lite_boost
    from lite_boost.cache import count_block_work
    from lite_boost.parallel import ParallelManager, initialize_usp, unparallelize

    meshes, out = {}, {}
    for name in names:
        kind, heads, (h, w, f), cfg_degree, extra_cfg, extra = CASES[name]
        spec = tl.TinyLTXSpec(heads=heads)
        config = _config(cfg_degree, extra_cfg)
        call = lambda: tl.call_kwargs(kind, height=h, width=w, frames=f, **extra)  # noqa: E731
        ref_pipe = tl.tiny_ltx_pipeline(kind, spec=spec)
        if extra_cfg:
            lite_boost.boost(ref_pipe, extra_cfg)
        with count_block_work([ref_pipe.transformer], **WORK) as ref_work:
            ref = ref_pipe(**call()).frames
        if cfg_degree not in meshes:
            meshes[cfg_degree] = initialize_usp(config, init_method=init_method)
        mesh = meshes[cfg_degree]
        pipe = tl.tiny_ltx_pipeline(kind, spec=spec)
        ParallelManager(pipe, config, mesh=mesh)
        if "diffusers_rope" in name:
            _keep_diffusers_rope(pipe)
        seen = []
        hook = pipe.transformer.transformer_blocks[0].register_forward_pre_hook(
            lambda mod, args, kw: seen.append((tuple(kw["hidden_states"].shape[:2]), kw["temb"].shape[1],
                                               kw["encoder_hidden_states"].shape[1])), with_kwargs=True)
        stats = mesh.sequence.enable_stats()
        stats.reset()
        with count_block_work([pipe.transformer], **WORK) as work:
            got = pipe(**call()).frames
        hook.remove()
        mesh.sequence.stats = None
        cache = pipe.transformer._lite_boost.extras.get("cache")
        ref_cache = ref_pipe.transformer._lite_boost.extras.get("cache") if extra_cfg else None
        out[name] = {
            **parallel_record(pipe.transformer, mesh, got, ref, seen, stats),
            "decisions": [d.compute for d in cache.decisions] if cache is not None else None,
            "ref_decisions": [d.compute for d in ref_cache.decisions] if ref_cache is not None else None,
            "work": (work.calls, work.attn_runs),
            "ref_work": (ref_work.calls, ref_work.attn_runs),
        }
        unparallelize(pipe)
    # the LTX VAE runs exact mode only: an explicit chunked mode is refused on every rank before any collective
    from lite_boost.config import ConfigError

    try:
        ParallelManager(tl.tiny_ltx_pipeline("t2v"), {"parallel": {"vae_parallel": "chunked"}},
                        mesh=next(iter(meshes.values())))
    except ConfigError as exc:
        out["vae_chunked_refused"] = f"{type(exc).__name__}: {exc}"
    return out
