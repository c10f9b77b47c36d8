"""Per-rank bodies of the Qwen-Image 2.1 parallel parity tests (spawned gloo ranks, test_parallel_qwen_image21.py).

Each case builds a tiny pipeline from a fixed seed (``QwenImage21Pipeline``, the ``QwenImage21ModularPipeline``
with its ClassifierFreeGuidance guider, or the ``QwenImage21TurboModularPipeline``), runs it in this process with
stock diffusers (the reference; for the sparse cases lite_boost.boost with the same sparse config, one process),
then a fresh copy under ``ParallelManager`` on the rank group, and returns the max abs difference of the outputs,
the sequence lengths the first block saw in the reference and in the parallel run (call by call), and the
collectives that ran. All cases of one world size share one process group (one mesh per layout).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _dist_utils import parallel_record  # noqa: E402

STEPS = 2
SQUARE = (64, 64)  # 4 x 4 = 16 target tokens (3 ranks: 6 + 6 + 4)
WIDE = (64, 160)  # 4 x 10 = 40 target tokens (3 ranks: 14 + 14 + 12)
SPARSE = (128, 192)  # 8 x 12 = 96 target tokens, 24 blocks of 4
_SPARSE = {"sparse_type": "rf_v2", "block_size": 4, "backend": "gather", "keep_sink": False}
# a condition image (32 x 64 px: 2 x 4 tokens) between two text runs, in the prefix
COND_LAYOUT = (("text", 3), ("image", None), ("text", 4))

# name -> pipeline kind, layout ("ulysses", "ring", "cfg"), prefix KV caching, (height, width), sparsity
CASES = {
    "pipe_ulysses_kv": ("pipe", "ulysses", True, SQUARE, None),
    "pipe_ulysses_nokv": ("pipe", "ulysses", False, WIDE, None),
    "pipe_ring_kv": ("pipe", "ring", True, WIDE, None),
    "pipe_ring_nokv": ("pipe", "ring", False, SQUARE, None),
    "pipe_cfg2_kv": ("pipe", "cfg", True, SQUARE, None),
    "pipe_cfg2_nokv": ("pipe", "cfg", False, SQUARE, None),
    "cond_image_ulysses_kv": ("cond", "ulysses", True, WIDE, None),  # no CFG: one call a step
    "cond_image_ring_kv": ("cond", "ring", True, SQUARE, None),
    "modular_ulysses_kv": ("modular", "ulysses", True, WIDE, None),
    "modular_ulysses_nokv": ("modular", "ulysses", False, SQUARE, None),
    "modular_ring_kv": ("modular", "ring", True, SQUARE, None),
    "modular_ring_nokv": ("modular", "ring", False, WIDE, None),
    "modular_cfg2_kv": ("modular", "cfg", True, SQUARE, None),
    "modular_cfg2_nokv": ("modular", "cfg", False, SQUARE, None),
    "turbo_ulysses_kv": ("turbo", "ulysses", True, SQUARE, None),
    "turbo_ring_nokv": ("turbo", "ring", False, WIDE, None),
    "pipe_ulysses_sparse0": ("pipe", "ulysses", True, SPARSE, 0.0),
    "pipe_ulysses_sparse075": ("pipe", "ulysses", True, SPARSE, 0.75),
    # 4 ranks: cfg 2 x a sequence degree of 2 (each CFG branch split over its two ranks)
    "pipe_cfg2_ulysses2_kv": ("pipe", "cfg_ulysses", True, WIDE, None),
    "pipe_cfg2_ring2_nokv": ("pipe", "cfg_ring", False, SQUARE, None),
    "modular_cfg2_ulysses2_nokv": ("modular", "cfg_ulysses", False, SQUARE, None),
    "modular_cfg2_ring2_kv": ("modular", "cfg_ring", True, WIDE, None),
}

CASES_2 = [n for n, c in CASES.items() if not c[1].startswith("cfg_")]
CASES_3 = [n for n, c in CASES.items() if not c[1].startswith("cfg") and c[4] is None]  # cfg 2 needs an even world
CASES_4 = [n for n, c in CASES.items() if c[1].startswith("cfg_")]


def cfg_on(kind) -> bool:
    """Whether the case's pipeline runs CFG (two transformer calls a step)."""
    return kind in ("pipe", "modular")


def _config(world, layout, sparsity=None):
    degrees = {"ulysses": {"ulysses_degree": world}, "ring": {"ring_degree": world}, "cfg": {"cfg_degree": 2},
               "cfg_ulysses": {"cfg_degree": 2, "ulysses_degree": world // 2},
               "cfg_ring": {"cfg_degree": 2, "ring_degree": world // 2}}[layout]
    cfg = {"parallel": {**degrees, "timeout_s": 120}}
    if sparsity is not None:
        cfg["sparse"] = {**_SPARSE, "sparsity": sparsity}
    return cfg


def turbo_pipeline():
    """A ``QwenImage21TurboModularPipeline`` of the tiny components (denoise and decode blocks, no guider)."""
    import _tiny_qwen21 as t
    from diffusers.modular_pipelines.qwenimage21 import QwenImage21TurboAutoBlocks

    base = t.pipeline()
    blocks = QwenImage21TurboAutoBlocks()
    for name in ("text_encoder", "vae_encoder"):
        blocks.sub_blocks.pop(name)
    pipe = blocks.init_pipeline()
    pipe.update_components(transformer=base.transformer, vae=base.vae, scheduler=base.scheduler)
    return pipe


def build(kind):
    import _tiny_qwen21 as t

    if kind == "pipe":
        return t.pipeline()
    if kind == "cond":
        return t.image_conditioned(t.pipeline(), COND_LAYOUT)
    if kind == "modular":
        return t.modular_pipeline()
    return turbo_pipeline()


def call_kwargs(kind, kv, hw):
    import _tiny_qwen21 as t

    h, w = hw
    if kind == "pipe":
        return t.call_kwargs(height=h, width=w, steps=STEPS, kv=kv)
    if kind == "cond":
        return dict(t.call_kwargs(height=h, width=w, steps=STEPS, kv=kv, cfg=False), output_resolution=64,
                    image=[t.condition_image(32, 64)])
    return t.modular_kwargs(height=h, width=w, steps=STEPS, kv=kv, cfg=kind == "modular")


def _hook(pipe, seen):
    return pipe.transformer.transformer_blocks[0].register_forward_pre_hook(
        lambda mod, args, kw: seen.append(kw["hidden_states"].shape[1]), with_kwargs=True)


def run_cases(rank, world_size, init_method, names):
    import _tiny_qwen21 as t
    import lite_boost
    from lite_boost.config import ConfigError
    from lite_boost.parallel import ParallelManager, initialize_usp, unparallelize

    meshes, out = {}, {}
    for name in names:
        kind, layout, kv, hw, sparsity = CASES[name]
        config = _config(world_size, layout, sparsity)
        ref_pipe = build(kind)
        if sparsity is not None:
            lite_boost.boost(ref_pipe, {"sparse": config["sparse"]})
        ref_seen = []
        hook = _hook(ref_pipe, ref_seen)
        ref = t.run(ref_pipe, call_kwargs(kind, kv, hw))
        hook.remove()
        if layout not in meshes:
            meshes[layout] = initialize_usp(config, init_method=init_method)
        mesh = meshes[layout]
        pipe = build(kind)
        ParallelManager(pipe, config, mesh=mesh)
        seen = []
        hook = _hook(pipe, seen)
        stats = mesh.sequence.enable_stats()
        stats.reset()
        ring_stats = mesh.ring.enable_stats() if mesh.ring_degree > 1 else None
        if ring_stats is not None:
            ring_stats.reset()
        got = t.run(pipe, call_kwargs(kind, kv, hw))
        hook.remove()
        mesh.sequence.stats = mesh.ring.stats = None
        out[name] = {**parallel_record(pipe.transformer, mesh, got, ref, seen, stats),
                     "seen_calls": seen, "ref_calls": ref_seen, "cfg_rank": mesh.cfg.rank,
                     "ring_calls": dict(ring_stats.calls) if ring_stats is not None else None}
        unparallelize(pipe)
    # block-sparse Ring is for self-attention families: refused on every rank before any collective
    mesh = meshes.get("ring") or initialize_usp(_config(world_size, "ring"), init_method=init_method)
    try:
        ParallelManager(build("pipe"), _config(world_size, "ring", 0.75), mesh=mesh)
        out["ring_sparse_refused"] = None
    except ConfigError as e:
        out["ring_sparse_refused"] = str(e)
    return out
