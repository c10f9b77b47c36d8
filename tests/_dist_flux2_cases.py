"""Per-rank bodies of the Flux.2 parallel parity tests (spawned gloo ranks, test_parallel_flux2.py).

Each case builds a tiny Flux.2 pipeline (or bare transformer) from a fixed seed, runs it in this process
with stock diffusers (the reference; the sparsity-0 case too: it must equal dense), then a fresh copy
under ``ParallelManager`` on the rank group, and returns the max abs difference, the token counts the
first dual and single block saw, the text rows the last single block produced and the collectives.
All cases of one world size share one process group per layout.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _dist_utils import parallel_record  # noqa: E402

# name -> kind ("klein", "dev", "model"), layout ("ulysses", "ring", "cfg"), sparsity, extra call arguments
# 6 x 10 px = 3 x 5 = 15 image tokens, 7 text tokens (9 for the negative prompt's case)
CASES = {
    "klein_ulysses": ("klein", "ulysses", None, {}),
    "klein_ring": ("klein", "ring", None, {}),
    "klein_cfg": ("klein", "cfg", None, {}),
    "dev_ulysses": ("dev", "ulysses", None, {}),
    "klein_sparse0_ulysses": ("klein", "ulysses", 0.0, {"height": 16, "width": 32}),
    "model_reference_ring": ("model", "ring", None, {}),  # random text ids, a 2 x 3 reference after the target
}


def _config(world, layout, sparsity):
    degrees = {"ulysses": {"ulysses_degree": world}, "ring": {"ring_degree": world}, "cfg": {"cfg_degree": 2}}[layout]
    cfg = {"parallel": {**degrees, "timeout_s": 120}}
    if sparsity is not None:
        cfg["sparse"] = {"sparse_type": "rf_v2", "sparsity": sparsity, "block_size": 4, "backend": "gather"}
    return cfg


def run_cases(rank, world_size, init_method, names):
    import torch

    import _tiny_flux2 as t2
    from lite_boost.parallel import ParallelManager, initialize_usp, unparallelize

    meshes, out = {}, {}
    for name in names:
        kind, layout, sparsity, extra = CASES[name]
        config = _config(world_size, layout, sparsity)
        if layout not in meshes:
            meshes[layout] = initialize_usp(config, init_method=init_method)
        mesh = meshes[layout]
        seen, texts = [], []
        stats = mesh.sequence.enable_stats()
        stats.reset()
        if kind == "model":
            spec = t2.TinyFlux2Spec(guidance_embeds=True)
            x = t2.transformer_inputs(spec, text_ids="random", reference=(2, 3))
            with torch.no_grad():
                ref = t2.transformer(spec)(**x).sample
                target = model = t2.transformer(spec)
                ParallelManager(model, config, mesh=mesh)
        else:
            call = lambda: t2.call_kwargs(kind, **extra)  # noqa: E731
            ref = t2.pipeline(kind)(**call()).images
            stats.reset()
            target = t2.pipeline(kind)
            ParallelManager(target, config, mesh=mesh)
            model = target.transformer
        handles = [
            model.transformer_blocks[0].register_forward_hook(
                lambda mod, args, kw, res: seen.append(("dual", res[1].shape[1], res[0].shape[1])), with_kwargs=True),
            model.single_transformer_blocks[0].register_forward_pre_hook(
                lambda mod, args, kw: seen.append(("single", kw["hidden_states"].shape[1])), with_kwargs=True),
            model.single_transformer_blocks[-1].register_forward_hook(
                lambda mod, args, kw, res: texts.append(res.detach().clone()), with_kwargs=True)]
        with torch.no_grad():
            got = model(**x).sample if kind == "model" else target(**call()).images
        for handle in handles:
            handle.remove()
        mesh.sequence.stats = None
        out[name] = {**parallel_record(model, mesh, got, ref, seen, stats), "last_rows": texts[-1]}
        unparallelize(target)
    return out
