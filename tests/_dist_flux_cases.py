"""Per-rank bodies of the Flux.1 parallel parity tests (spawned gloo ranks, test_parallel_flux.py).

Each case builds a tiny pipeline (or transformer) from a fixed seed and runs it in this process with
stock diffusers (the reference; sparse cases: lite_boost.boost with the same sparse config, one
process), then a fresh copy under ``ParallelManager`` on the rank group. It returns the max abs
difference of the outputs, the token counts the first dual and first single block saw, the text rows
the last single block produced (for the cross-rank identity check) and the collectives that ran.
All cases of one world size share one process group.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _dist_utils import parallel_record  # noqa: E402

# name -> kind, heads, (height, width) px, cfg_degree, sparsity, extra call arguments
# 12 x 20 px = 3 x 5 = 15 image tokens; Kontext adds a 16 x 24 px reference (4 x 6 = 24 tokens)
CASES = {
    "t2i_h3_tok15": ("t2i", 3, (12, 20), 1, None, {}),
    "t2i_h5_tok28": ("t2i", 5, (16, 28), 1, None, {}),  # 28 tokens: 3 ranks get 10, 10, 8
    "t2i_h2_tok15_text9": ("t2i", 2, (12, 20), 1, None, {"text": 9}),  # fewer heads than ranks on 3
    "t2i_h4_batch2": ("t2i", 4, (12, 20), 1, None, {"batch": 2}),
    "t2i_guidance_h3": ("t2i", 3, (12, 20), 1, None, {"cfg": False, "guidance": True}),  # dev-style distilled
    "img2img_h3": ("img2img", 3, (12, 20), 1, None, {}),
    "kontext_h3": ("kontext", 3, (12, 20), 1, None, {}),
    "control_h3": ("control", 3, (12, 20), 1, None, {}),
    "model_random_txt_ids_h3": ("model", 3, (3, 5), 1, None, {}),  # text rotated by its own ids
    "model_controlnet_h3": ("model", 3, (3, 5), 1, None, {"controlnet": True}),  # residuals sharded with the tokens
    "t2i_sparse0_h3": ("t2i", 3, (32, 64), 1, 0.0, {}),
    "t2i_sparse075_h3": ("t2i", 3, (32, 64), 1, 0.75, {}),
    "t2i_cfg2_h3": ("t2i", 3, (12, 20), 2, None, {}),
    "kontext_cfg2_h3": ("kontext", 3, (12, 20), 2, None, {}),  # unnamed passes; the pipeline slices the output
    "t2i_cfg2_no_guidance_h3": ("t2i", 3, (12, 20), 2, None, {"cfg": False}),  # nothing deferred
}


def _config(cfg_degree, sparsity):
    cfg = {"parallel": {"cfg_degree": cfg_degree, "timeout_s": 120}}
    if sparsity is not None:
        cfg["sparse"] = {"sparse_type": "rf_v2", "sparsity": sparsity, "block_size": 4, "backend": "gather"}
    return cfg


def _spec(heads, extra):
    import _tiny_flux as tf

    return tf.TinyFluxSpec(heads=heads, guidance_embeds=extra.get("guidance", False))


def _run_model(spec, config, mesh, hooks, controlnet=False):
    """The bare transformer (diffusers' model-test layout: random text ids) under ParallelManager vs stock.

    controlnet: ControlNet residuals for every dual block (Xlabs-style repeat) and for the single blocks.
    """
    import torch

    import _tiny_flux as tf
    from lite_boost.parallel import ParallelManager

    inputs = tf.transformer_inputs(spec, grid=(3, 5), text=7, text_ids="random")
    if controlnet:
        g = torch.Generator().manual_seed(5)
        width = spec.heads * spec.head_dim
        inputs["controlnet_block_samples"] = [torch.randn(1, 15, width, generator=g)]
        inputs["controlnet_single_block_samples"] = [torch.randn(1, 15, width, generator=g) for _ in range(2)]
        inputs["controlnet_blocks_repeat"] = True
    with torch.no_grad():
        ref = tf.transformer(spec)(**inputs).sample
        model = tf.transformer(spec)
        ParallelManager(model, config, mesh=mesh)
        hooks(model)
        got = model(**inputs).sample
    return model, got, ref


def run_cases(rank, world_size, init_method, names):
    import torch

    import _tiny_flux as tf
    import lite_boost
    from lite_boost.parallel import ParallelManager, initialize_usp, unparallelize

    meshes, out = {}, {}
    for name in names:
        kind, heads, (h, w), cfg_degree, sparsity, extra = CASES[name]
        spec = _spec(heads, extra)
        config = _config(cfg_degree, sparsity)
        if cfg_degree not in meshes:
            meshes[cfg_degree] = initialize_usp(config, init_method=init_method)
        mesh = meshes[cfg_degree]
        seen, texts, handles = [], [], []

        def hooks(model):
            handles.append(model.transformer_blocks[0].register_forward_hook(
                lambda mod, args, kw, res: seen.append(("dual", res[1].shape[1], res[0].shape[1])), with_kwargs=True))
            handles.append(model.single_transformer_blocks[0].register_forward_pre_hook(
                lambda mod, args, kw: seen.append(("single", kw["hidden_states"].shape[1],
                                                   kw["encoder_hidden_states"].shape[1])), with_kwargs=True))
            handles.append(model.single_transformer_blocks[-1].register_forward_hook(
                lambda mod, args, kw, res: texts.append(res[0].detach().clone()), with_kwargs=True))

        stats = mesh.sequence.enable_stats()
        stats.reset()
        if kind == "model":
            model, got, ref = _run_model(spec, config, mesh, hooks, controlnet=extra.get("controlnet", False))
            target = model
        else:
            call_extra = {k: v for k, v in extra.items() if k != "guidance"}
            call = lambda: tf.call_kwargs(kind, height=h, width=w, spec=spec, **call_extra)  # noqa: E731
            ref_pipe = tf.pipeline(kind, spec=spec)
            if sparsity is not None:
                lite_boost.boost(ref_pipe, dict(config, parallel={"timeout_s": 120}))
            ref = ref_pipe(**call()).images
            stats.reset()
            target = tf.pipeline(kind, spec=spec)
            ParallelManager(target, config, mesh=mesh)
            model = target.transformer
            hooks(model)
            got = target(**call()).images
        for handle in handles:
            handle.remove()
        mesh.sequence.stats = None
        out[name] = {**parallel_record(model, mesh, got, ref, seen, stats), "last_text": texts[-1] if texts else None}
        unparallelize(target)
    return out
