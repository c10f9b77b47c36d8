"""Per-rank bodies of the Qwen-Image parallel parity tests (spawned gloo ranks, test_parallel_qwen_image.py).

Each case builds a tiny pipeline from a fixed seed and runs it in this process with stock diffusers (the
reference; for sparse cases: with lite_boost.boost and the same sparse config, single process), then a
fresh copy under ``ParallelManager`` on the rank group, and returns the max abs difference of the output
latents, what the first block saw (image and text tokens) and the collectives that ran. All cases of
one world size share one process group.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _dist_utils import parallel_record  # noqa: E402

# name -> kind, heads, (height, width), cfg_degree, zero_cond_t, sparsity, extra call arguments
# 24 x 40 px = 3 x 5 = 15 image tokens; Edit adds a 32 x 64 px condition image (4 x 8 = 32 tokens)
CASES = {
    "t2i_h3_tok15": ("t2i", 3, (24, 40), 1, False, None, {}),
    "t2i_h5_tok28": ("t2i", 5, (32, 56), 1, False, None, {}),  # 28 tokens: 3 ranks get 10, 10, 8
    "t2i_h2_tok15": ("t2i", 2, (24, 40), 1, False, None, {}),  # fewer heads than ranks on 3
    "t2i_h4_padded_batch2": ("t2i", 4, (24, 40), 1, False, None, {"batch": 2, "valid": [7, 4], "text": (7, 6)}),
    "edit_h3": ("edit", 3, (24, 40), 1, False, None, {}),
    "edit2511_h5": ("edit", 5, (24, 40), 1, True, None, {}),  # per-token modulate_index, sharded
    "edit_plus_h3": ("edit_plus", 3, (24, 40), 1, False, None, {}),
    "t2i_diffusers_rope_h3": ("t2i", 3, (24, 40), 1, False, None, {}),  # diffusers' own RoPE tables kept
    "t2i_sparse0_h3": ("t2i", 3, (64, 128), 1, False, 0.0, {}),
    "t2i_sparse075_h3": ("t2i", 3, (64, 128), 1, False, 0.75, {}),
    "t2i_cfg2_h3": ("t2i", 3, (24, 40), 2, False, None, {}),
    "edit_cfg2_h3": ("edit", 3, (24, 40), 2, False, None, {}),  # the pipeline slices the deferred output
    "t2i_cfg2_no_guidance_h3": ("t2i", 3, (24, 40), 2, False, None, {"cfg": False}),  # nothing deferred
    # Ring attention over all sequence ranks (ulysses_degree 1): the replicated text joins once
    "t2i_ring_h3": ("t2i", 3, (24, 40), 1, False, None, {"ring": True}),
    "edit2511_ring_h5": ("edit", 5, (24, 40), 1, True, None, {"ring": True}),
    "t2i_cfg2_ring_h3": ("t2i", 3, (24, 40), 2, False, None, {"ring": True}),
}


def _config(cfg_degree, sparsity, ring=False):
    cfg = {"parallel": {"cfg_degree": cfg_degree, "timeout_s": 120}}
    if ring:
        cfg["parallel"]["ulysses_degree"] = 1
    if sparsity is not None:
        cfg["sparse"] = {"sparse_type": "rf_v2", "sparsity": sparsity, "block_size": 4, "backend": "gather"}
    return cfg


def _keep_diffusers_rope(pipe):
    m = pipe.transformer
    if "forward" in m.pos_embed.__dict__:
        del m.pos_embed.forward
        m._lite_boost.rope_patched = False


def run_cases(rank, world_size, init_method, names):
    import _qwen_cases as qc
    import lite_boost
    from lite_boost.demo import TinyQwenImageSpec, tiny_qwen_image_pipeline
    from lite_boost.parallel import ParallelManager, initialize_usp, unparallelize

    qc.small_condition_images()
    meshes, out = {}, {}
    for name in names:
        kind, heads, (h, w), cfg_degree, zero_cond_t, sparsity, extra = CASES[name]
        ring = extra.get("ring", False)
        extra = {k: v for k, v in extra.items() if k != "ring"}
        spec = TinyQwenImageSpec(heads=heads, zero_cond_t=zero_cond_t)
        config = _config(cfg_degree, sparsity, ring)
        call = lambda: qc.call_kwargs(kind, height=h, width=w, **extra)  # noqa: E731
        ref_pipe = tiny_qwen_image_pipeline(kind, spec=spec)
        if sparsity is not None:
            lite_boost.boost(ref_pipe, dict(config, parallel={"timeout_s": 120}))
        ref = ref_pipe(**call()).images
        if (cfg_degree, ring) not in meshes:
            meshes[cfg_degree, ring] = initialize_usp(config, init_method=init_method)
        mesh = meshes[cfg_degree, ring]
        pipe = tiny_qwen_image_pipeline(kind, spec=spec)
        ParallelManager(pipe, config, mesh=mesh)
        if "diffusers_rope" in name:
            _keep_diffusers_rope(pipe)
        seen = []
        hook = pipe.transformer.transformer_blocks[0].register_forward_hook(
            lambda mod, args, res: seen.append((res[1].shape[1], res[0].shape[1])))  # (image, text) tokens
        stats = mesh.sequence.enable_stats()
        stats.reset()
        got = pipe(**call()).images
        hook.remove()
        mesh.sequence.stats = None
        out[name] = parallel_record(pipe.transformer, mesh, got, ref, seen, stats)
        unparallelize(pipe)
    # block-sparse Ring is for self-attention families: refused on every rank before any collective
    from lite_boost.config import ConfigError

    mesh = meshes.get((1, True)) or initialize_usp(_config(1, None, True), init_method=init_method)
    try:
        ParallelManager(tiny_qwen_image_pipeline("t2i"), _config(1, 0.75, True), mesh=mesh)
        out["ring_sparse_refused"] = None
    except ConfigError as e:
        out["ring_sparse_refused"] = str(e)
    return out
