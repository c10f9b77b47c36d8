"""Per-rank bodies of the CogVideoX parallel parity tests (spawned gloo ranks, test_parallel_cogvideox.py).

Each case builds a tiny pipeline from a fixed seed and runs it in this process with stock diffusers (the
reference; sparse and cached cases: lite_boost.boost with the same config, single process), then a
fresh copy under ``ParallelManager`` on the rank group, and returns the max abs difference of the
output, what the first block saw (video and text tokens) and the collectives that ran. All cases of
one world size share one process group.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _dist_utils import parallel_record  # noqa: E402

# transformer calls and computed self-attentions (a reused attention does not count): count_block_work
WORK = dict(blocks="transformer_blocks", ffn="ff", attn="attn1")

# name -> variant, heads, (height, width), cfg_degree, config extra, call extra
# 48 x 80 px x 9 frames = 3 latent frames x 3 x 5 tokens = 45 video tokens (2 x 15 = 30 with patch_size_t 2)
SPARSE = {"sparse_type": "rf_v2", "block_size": 4, "backend": "gather"}
CASES = {
    "5b_h3": ("5b", 3, (48, 80), 1, {}, {}),
    "2b_h3": ("2b", 3, (48, 80), 1, {}, {}),  # sincos position embeddings, no RoPE
    "15_h3": ("15", 3, (48, 80), 1, {}, {}),  # patch_size_t 2
    "i2v15_h5": ("i2v15", 5, (48, 80), 1, {}, {}),  # image latents on channels, ofs
    "5b_h2": ("5b", 2, (48, 80), 1, {}, {}),  # fewer heads than ranks on 3
    "5b_h3_decoded": ("5b", 3, (48, 80), 1, {}, {"output_type": "pt", "steps": 1}),  # each rank decodes whole
    "5b_sparse0_h3": ("5b", 3, (64, 128), 1, {"sparse": {**SPARSE, "sparsity": 0.0}}, {}),
    "5b_sparse075_h3": ("5b", 3, (64, 128), 1, {"sparse": {**SPARSE, "sparsity": 0.75}}, {}),
    "5b_fbc_h3": ("5b", 3, (48, 80), 1, {"cache": {"method": "first_block_cache", "threshold": 0.5}}, {"steps": 4}),
    "5b_cfg2_h3": ("5b", 3, (48, 80), 2, {}, {}),  # batched CFG split over the cfg group
    "i2v15_cfg2_h3": ("i2v15", 3, (48, 80), 2, {}, {}),  # image latents and ofs with the batch split
    # a state shared by cond and uncond is fine with batched CFG: each cfg rank reuses its half of the batch
    "5b_cfg2_pab_h3": ("5b", 3, (48, 80), 2, {"cache": {"method": "pyramid_attention_broadcast",
                                                          "spatial_attention_block_skip_range": 2,
                                                          "spatial_attention_timestep_skip_range": (0, 1000)}},
                       {"steps": 4}),
}


# refusals, checked on every rank without a hang: name -> (cfg_degree, config extra, call extra)
REFUSALS = {
    "vae_exact_refused": (1, {"parallel": {"vae_parallel": "exact", "timeout_s": 120}}, {}),
    # batched CFG split needs both branches in the batch: guidance_scale <= 1 runs a batch of one
    "cfg2_without_guidance_runs": (2, {}, {"cfg": False}),  # batch 1: every cfg rank runs the whole call
}


def _refusal(name, mesh_for):
    import _tiny_cogvideox as T
    from lite_boost.parallel import ParallelManager

    cfg_degree, extra, call_extra = REFUSALS[name]
    spec = T.TinyCogSpec("5b")
    pipe = T.tiny_pipeline(spec)
    config = {**_config(cfg_degree, {}), **extra}
    try:
        ParallelManager(pipe, config, mesh=mesh_for(cfg_degree, config))
        pipe(**T.call_kwargs(spec, **call_extra))
    except Exception as e:  # noqa: BLE001 (the message is what the test checks)
        return {"error": f"{type(e).__name__}: {e}"}
    return {"error": None}


def _config(cfg_degree, extra):
    return {"parallel": {"cfg_degree": cfg_degree, "timeout_s": 120}, **extra}


def run_cases(rank, world_size, init_method, names):
    import _tiny_cogvideox as T
    import lite_boost
    from lite_boost.cache import count_block_work
    from lite_boost.parallel import ParallelManager, initialize_usp, unparallelize

    meshes, out = {}, {}

    def mesh_for(cfg_degree, config):
        if cfg_degree not in meshes:
            meshes[cfg_degree] = initialize_usp(config, init_method=init_method)
        return meshes[cfg_degree]

    for name in names:
        if name in REFUSALS:
            out[name] = _refusal(name, mesh_for)
            continue
        variant, heads, (h, w), cfg_degree, extra, call_extra = CASES[name]
        spec = T.TinyCogSpec(variant, heads=heads)
        config = _config(cfg_degree, extra)
        call = lambda: T.call_kwargs(spec, height=h, width=w, **call_extra)  # noqa: E731
        ref_pipe = T.tiny_pipeline(spec)
        if extra:
            lite_boost.boost(ref_pipe, dict(extra))
        with count_block_work([ref_pipe.transformer], **WORK) as ref_work:
            ref = ref_pipe(**call()).frames
        mesh = mesh_for(cfg_degree, config)
        pipe = T.tiny_pipeline(spec)
        ParallelManager(pipe, config, mesh=mesh)
        seen = []
        hook = pipe.transformer.transformer_blocks[0].register_forward_hook(
            lambda mod, args, res: seen.append((res[0].shape[1], res[1].shape[1])))  # (video, text) tokens
        stats = mesh.sequence.enable_stats()
        stats.reset()
        with count_block_work([pipe.transformer], **WORK) as work:
            got = pipe(**call()).frames
        hook.remove()
        mesh.sequence.stats = None
        out[name] = {**parallel_record(pipe.transformer, mesh, got, ref, seen, stats),
                     "work": (work.calls, work.attn_runs), "ref_work": (ref_work.calls, ref_work.attn_runs)}
        unparallelize(pipe)
    return out
