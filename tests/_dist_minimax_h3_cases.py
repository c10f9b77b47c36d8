"""Per-rank bodies of the MiniMax-H3 parallel parity tests (spawned gloo ranks, test_parallel_minimax_h3.py).

Each case builds a tiny MiniMax-H3 transformer from a fixed seed and the pipeline's packed layout (text, a
keyframe condition, audio, target video: token counts that divide neither 2 nor 3), runs it in this process
(stock diffusers, or the one-process boost with the same block-sparse config), then a fresh copy under
``ParallelManager`` on the rank group, and returns the max abs differences of both outputs (video and audio),
the packed rows the first block saw, the sparse paths and the collectives. All cases of one world size share
one process group per layout.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _dist_utils import parallel_record  # noqa: E402

# the packed sequences: "default" = 5 text + 15 condition + 6 audio + 3 x 3 x 5 video = 71 rows;
# "large" = 7 text + 64 condition + 10 audio + 4 x 8 x 8 video = 337 rows (sparse cases, blocks of 16)
SHAPES = {"default": {}, "large": dict(frames=4, height=16, width=16, text=7, audio_latents=5)}

# name -> (layout, sparsity, shape, batch)
CASES = {
    "ulysses": ("ulysses", None, "default", 1),
    "ring": ("ring", None, "default", 1),
    "ulysses_batch2": ("ulysses", None, "default", 2),
    "sparse0_ulysses": ("ulysses", 0.0, "large", 1),
    "sparse0_ring": ("ring", 0.0, "large", 1),
    "sparse_ulysses": ("ulysses", 0.5, "large", 1),
    "sparse_ring": ("ring", 0.5, "large", 1),
    "usp": ("usp", None, "default", 1),
    "sparse_usp": ("usp", 0.5, "large", 1),
}


def _config(world, layout, sparsity):
    degrees = {"ulysses": {"ulysses_degree": world}, "ring": {"ring_degree": world},
               "usp": {"ulysses_degree": 2, "ring_degree": world // 2}}[layout]
    cfg = {"parallel": {**degrees, "timeout_s": 120}}
    if sparsity is not None:
        cfg["sparse"] = sparse_config(sparsity)
    return cfg


def sparse_config(sparsity):
    return {"sparse_type": "rf_v2", "sparsity": sparsity, "block_size": 16, "dense_steps_first": 0,
            "dense_steps_last": 0, "min_seq_len": 0}


def run_cases(rank, world_size, init_method, names):
    import torch

    import _tiny_minimax_h3 as mm
    import lite_boost
    from lite_boost.parallel import ParallelManager, initialize_usp, unparallelize

    meshes, out = {}, {}
    for name in names:
        layout, sparsity, shape, batch = CASES[name]
        config = _config(world_size, layout, sparsity)
        if layout not in meshes:
            meshes[layout] = initialize_usp(config, init_method=init_method)
        mesh = meshes[layout]
        x = mm.transformer_inputs(batch=batch, **SHAPES[shape])
        with torch.no_grad():
            reference = mm.transformer()
            if sparsity:  # the one-process block-sparse boost is the reference of a sparse parallel run
                lite_boost.boost(reference, {"sparse": sparse_config(sparsity)})
            ref = reference(**x, return_dict=False)
        model = mm.transformer()
        stats = mesh.sequence.enable_stats()
        stats.reset()
        ParallelManager(model, config, mesh=mesh)
        seen = []
        handle = model.transformer_blocks[0].register_forward_pre_hook(
            lambda mod, args, kw: seen.append(tuple((args[0] if args else kw["hidden_states"]).shape)),
            with_kwargs=True)
        with torch.no_grad():
            got = model(**x, return_dict=False)
        handle.remove()
        mesh.sequence.stats = None
        out[name] = {**parallel_record(model, mesh, got[0], ref[0], seen, stats),
                     "audio_maxdiff": (got[1] - ref[1]).abs().max().item(), "audio_abs": ref[1].abs().max().item(),
                     "rows": x["position_ids"].shape[0]}
        unparallelize(model)
    return out
