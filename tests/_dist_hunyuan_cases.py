"""Per-rank bodies of the HunyuanVideo / -1.5 parallel parity tests (spawned gloo ranks, test_parallel_hunyuan.py).

Each case builds a tiny pipeline from a fixed seed and runs it in this process with stock diffusers (the
reference; sparse cases: boosted with the same sparse config, one process), then a fresh copy under
``ParallelManager`` on the rank group, and returns the max abs difference of the output latents, what the
first dual and single blocks saw (image and text tokens, first-frame rows) and the collectives that ran.
All cases of one world size share one process group.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _dist_utils import parallel_record  # noqa: E402

LAYERS = 2  # attention layers of every tiny model (HunyuanVideo: 1 dual + 1 single; 1.5: 2 dual)
STEPS = 2

# name -> family, kind / task, heads, call arguments, cfg_degree, sparsity
# HunyuanVideo 16 x 32 px, 17 frames = 5 x 2 x 4 = 40 tokens (3 ranks: 14, 14, 12); token-replace 32 x 32 px,
# 5 frames = 2 x 4 x 4 = 32 tokens, first frame 16 (3 ranks: 11 + 5 + 0 first-frame rows); 1.5: 3 x 3 x 5 = 45.
CASES = {
    "hv_t2v_h3": ("hv", "t2v", 3, {}, 1, None),
    "hv_t2v_true_cfg_h3": ("hv", "t2v", 3, {"cfg": True}, 1, None),
    "hv_t2v_h2": ("hv", "t2v", 2, {}, 1, None),  # fewer heads than ranks on 3
    "hv_t2v_padded_batch2_h3": ("hv", "t2v", 3, {"batch": 2, "valid": (11, 7)}, 1, None),
    "hv_token_replace_h3": ("hv", "token_replace", 3, {"height": 32, "width": 32, "frames": 5, "cfg": True}, 1, None),
    "hv_latent_concat_h3": ("hv", "latent_concat", 3, {"cfg": True}, 1, None),
    "hv_diffusers_rope_h3": ("hv", "t2v", 3, {}, 1, None),  # diffusers' own RoPE tables kept
    "hv_sparse0_h3": ("hv", "t2v", 3, {"height": 64, "width": 64, "frames": 5}, 1, 0.0),
    "hv_sparse075_h3": ("hv", "t2v", 3, {"height": 64, "width": 64, "frames": 5}, 1, 0.75),
    "hv_fbc_h3": ("hv", "t2v", 3, {"cfg": True, "steps": 4, "cache": {"method": "first_block_cache",
                                                                       "threshold": 0.5}}, 1, None),
    "hv_t2v_cfg2_h3": ("hv", "t2v", 3, {"cfg": True}, 2, None),
    "hv_token_replace_cfg2_h3": ("hv", "token_replace", 3, {"height": 32, "width": 32, "frames": 5, "cfg": True}, 2,
                                 None),  # two calls per step without context names
    "hv_t2v_cfg2_distilled_h3": ("hv", "t2v", 3, {}, 2, None),  # no true CFG: one call per step, nothing split
    "hy15_t2v_h3": ("15", "t2v", 3, {}, 1, None),
    "hy15_i2v_h3": ("15", "i2v", 3, {}, 1, None),
    "hy15_sparse075_h3": ("15", "t2v", 3, {"height": 32, "width": 32}, 1, 0.75),
    "hy15_t2v_cfg2_h3": ("15", "t2v", 3, {}, 2, None),
    "hy15_t2v_cfg2_stop_h3": ("15", "t2v", 3, {"steps": 4, "stop": 0.5}, 2, None),  # guider CFG for 2 of 4 steps
}


def _config(cfg_degree, sparsity, cache=None):
    cfg = {"parallel": {"cfg_degree": cfg_degree, "timeout_s": 120}}
    if cache is not None:  # the reference: one process, the same cache (= diffusers' hook, test_hunyuan_video.py)
        cfg["cache"] = cache
    if sparsity is not None:
        cfg["sparse"] = {"sparse_type": "rf_v2", "sparsity": sparsity, "block_size": 4, "backend": "gather",
                         "keep_sink": False}
    return cfg


def _build(family, kind, heads, extra):
    import _tiny_hunyuan as hy

    call = {k: v for k, v in extra.items() if k != "cache"}
    call.setdefault("steps", STEPS)
    if family == "hv":
        spec = hy.HySpec(heads=heads, kind=kind)
        return (lambda: hy.hunyuan_pipeline(spec)), (lambda: hy.call_kwargs(spec, **call))
    stop = call.pop("stop", 1.0)
    spec = hy.Hy15Spec(heads=heads, task=kind)
    return (lambda: hy.hunyuan15_pipeline(spec, stop=stop)), (lambda: hy.call_kwargs_15(spec, **call))


def run_cases(rank, world_size, init_method, names):
    import lite_boost
    from lite_boost.parallel import ParallelManager, initialize_usp, unparallelize

    meshes, out = {}, {}
    for name in names:
        family, kind, heads, extra, cfg_degree, sparsity = CASES[name]
        config = _config(cfg_degree, sparsity, extra.get("cache"))
        make, call = _build(family, kind, heads, extra)
        ref_pipe = make()
        if sparsity is not None or "cache" in config:
            lite_boost.boost(ref_pipe, dict(config, parallel={"timeout_s": 120}))
        ref = ref_pipe(**call()).frames
        if cfg_degree not in meshes:
            meshes[cfg_degree] = initialize_usp(config, init_method=init_method)
        mesh = meshes[cfg_degree]
        pipe = make()
        ParallelManager(pipe, config, mesh=mesh)
        m = pipe.transformer
        if "diffusers_rope" in name:
            del m.rope.forward
            m._lite_boost.rope_patched = False
        seen, first_rows = [], []
        blocks = [m.transformer_blocks[0]] + ([m.single_transformer_blocks[0]] if family == "hv" else [])
        hooks = [b.register_forward_hook(lambda mod, args, res: seen.append((res[0].shape[1], res[1].shape[1])))
                 for b in blocks]
        if kind == "token_replace":  # the first-frame row count each rank's blocks get
            hooks += [b.register_forward_pre_hook(lambda mod, args: first_rows.append(args[6])) for b in blocks]
        stats = mesh.sequence.enable_stats()
        stats.reset()
        got = pipe(**call()).frames
        for h in hooks:
            h.remove()
        mesh.sequence.stats = None
        out[name] = {**parallel_record(m, mesh, got, ref, seen, stats), "first_rows": sorted(set(first_rows))}
        unparallelize(pipe)
    return out
