"""Per-rank bodies of the MiniMax-H3 parallel parity tests (spawned gloo ranks, test_parallel_minimax_h3.py).

Each case builds a tiny MiniMax-H3 transformer from a fixed seed and the pipeline's packed layout (text, a
keyframe condition, audio, target video: token counts that divide neither 2 nor 3), runs it in this process
(stock diffusers, or the one-process boost with the same block-sparse config), then a fresh copy under
``ParallelManager`` on the rank group, and returns the max abs differences of both outputs (video and audio),
the packed rows the first block saw, the sparse paths and the collectives. The ``pipe_*`` cases do the same
with diffusers' modular pipeline (MiniMaxH3ModularPipeline, latents out); ``cfg_refused`` asks ParallelManager
for cfg_degree 2 on that pipeline, first before any process group exists, then on a cfg x 1 mesh. All cases of
one world size share one process group (one mesh per layout).
"""

from __future__ import annotations

import contextlib
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
    """Run ``names`` in order ("cfg_refused" first: it starts without a process group); name -> record."""
    meshes, out = {}, {}
    for name in names:
        if name == "cfg_refused":
            out.update(_cfg_refusals(world_size, init_method, meshes))
        elif name in PIPE_CASES:
            out[name] = _pipe_case(name, world_size, init_method, meshes)
        else:
            out[name] = _model_case(name, world_size, init_method, meshes)
    return out


def _mesh(meshes, key, config, init_method):
    from lite_boost.parallel import initialize_usp

    if key not in meshes:
        meshes[key] = initialize_usp(config, init_method=init_method)
    return meshes[key]


def _model_case(name, world_size, init_method, meshes):
    import torch

    import _tiny_minimax_h3 as mm
    import lite_boost
    from lite_boost.parallel import ParallelManager, unparallelize

    layout, sparsity, shape, batch = CASES[name]
    config = _config(world_size, layout, sparsity)
    mesh = _mesh(meshes, layout, config, init_method)
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
    record = {**parallel_record(model, mesh, got[0], ref[0], seen, stats),
              "audio_maxdiff": (got[1] - ref[1]).abs().max().item(), "audio_abs": ref[1].abs().max().item(),
              "rows": x["position_ids"].shape[0]}
    unparallelize(model)
    return record


# ------------------------------------------------------------------------------------------ the modular pipeline
# diffusers' t2va core denoise workflow (MiniMaxH3ModularPipeline, tests/_tiny_minimax_h3.py): 7 text + 414 audio
# rows + 37 x 2 x 3 video tokens = 643 packed rows (2 ranks: 322 + 321, 3 ranks: 215 + 214 + 214), 3 steps.
PIPE_TEXT = 7
PIPE_ROWS = PIPE_TEXT + 414 + 37 * 2 * 3
PIPE_STEPS = 3
PIPE_SPARSE = {"sparse_type": "rf_v2", "sparsity": 0.5, "block_size": 16, "dense_steps_first": 0,
               "dense_steps_last": 0, "min_seq_len": 0}

# name -> (layout, sparse config or None, world sizes)
PIPE_CASES = {
    "pipe_ulysses": ("ulysses", None, (2, 3)),
    "pipe_ring": ("ring", None, (2, 3)),
    "pipe_ring_sparse": ("ring", PIPE_SPARSE, (2,)),
    "pipe_ulysses_sparse": ("ulysses", PIPE_SPARSE, (3,)),
}


def _pipe_call():
    import _tiny_minimax_h3 as mm

    return mm.call_kwargs(text=PIPE_TEXT, steps=PIPE_STEPS)


_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "all_gather_object",
                "all_to_all", "all_to_all_single", "broadcast", "broadcast_object_list", "barrier",
                "reduce_scatter_tensor", "send", "recv", "batch_isend_irecv", "init_process_group", "new_group",
                "new_subgroups", "monitored_barrier")


@contextlib.contextmanager
def _counting_collectives():
    """Count every call of torch.distributed's collectives (and group creation) made inside the block (isend /
    irecv stay as they are: P2POp checks their identity; batch_isend_irecv counts them)."""
    import torch.distributed as dist

    calls, saved = {}, {}

    def counted(name, fn):
        def call(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            return fn(*args, **kwargs)
        return call

    for name in _COLLECTIVES:
        if hasattr(dist, name):
            saved[name] = getattr(dist, name)
            setattr(dist, name, counted(name, saved[name]))
    try:
        yield calls
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def _cfg_refusals(world_size, init_method, meshes):
    """ParallelManager(pipe, cfg_degree 2) on the modular pipeline: "cfg_refused" before any process group exists
    (none exists afterwards either, so no collective can have run), "cfg_refused_on_mesh" with a cfg 2 x sequence
    1 mesh over this group (no torch.distributed call while refusing; the group runs the next cases)."""
    import torch.distributed as dist

    import _tiny_minimax_h3 as mm
    from lite_boost import ConfigError
    from lite_boost.parallel import ParallelManager

    assert not dist.is_initialized(), "cfg_refused must run first"
    out = {}
    config = {"parallel": {"cfg_degree": 2, "timeout_s": 60}}
    for name in ("cfg_refused", "cfg_refused_on_mesh"):
        mesh = _mesh(meshes, "cfg", config, init_method) if name == "cfg_refused_on_mesh" else None
        pipe = mm.pipeline()
        error = None
        with _counting_collectives() as calls:
            try:
                ParallelManager(pipe, config, mesh=mesh, init_method=init_method)
            except ConfigError as exc:
                error = str(exc)
        out[name] = {"error": error, "dist_calls": dict(calls), "initialized": dist.is_initialized(),
                     "boosted": getattr(pipe.transformer, "_lite_boost", None) is not None}
    return out


def _pipe_case(name, world_size, init_method, meshes):
    """The one-process pipeline (stock; sparse: boosted with the same sparse config, and stock to show sparse
    changes the result), then a fresh pipeline under ParallelManager on this rank group."""
    import torch

    import _tiny_minimax_h3 as mm
    import lite_boost
    from lite_boost.parallel import ParallelManager, unparallelize

    layout, sparse, _ = PIPE_CASES[name]
    config = _config(world_size, layout, None)
    ref_pipe = mm.pipeline()
    if sparse is not None:
        config["sparse"] = sparse
        lite_boost.boost(ref_pipe, {"sparse": sparse})
    ref_calls = []
    handle = ref_pipe.transformer.register_forward_pre_hook(lambda *a: ref_calls.append(1))
    with torch.no_grad():
        ref = ref_pipe(**_pipe_call())
    handle.remove()
    record = {"ref_calls": len(ref_calls)}
    if sparse is not None:
        with torch.no_grad():
            dense = mm.pipeline()(**_pipe_call())
        record["ref_sparse_paths"] = sorted({e.path for e in ref_pipe.transformer._lite_boost.extras["sparse"].events})
        record["sparse_vs_dense"] = max((ref[k] - dense[k]).abs().max().item() for k in ("latents", "audio_latents"))
    mesh = _mesh(meshes, layout, config, init_method)
    pipe = mm.pipeline()
    ParallelManager(pipe, config, mesh=mesh)
    seen = []
    hook = pipe.transformer.transformer_blocks[0].register_forward_pre_hook(
        lambda mod, args, kw: seen.append(tuple((args[0] if args else kw["hidden_states"]).shape)), with_kwargs=True)
    stats = mesh.sequence.enable_stats()
    stats.reset()
    with torch.no_grad(), _counting_collectives() as dist_calls:  # also the counter's positive control
        got = pipe(**_pipe_call())
    hook.remove()
    mesh.sequence.stats = None
    record.update(parallel_record(pipe.transformer, mesh, got["latents"], ref["latents"], seen, stats),
                  audio_maxdiff=(got["audio_latents"] - ref["audio_latents"]).abs().max().item(),
                  audio_abs=ref["audio_latents"].abs().max().item(), dist_calls=dict(dist_calls),
                  latents=got["latents"].clone(), audio_latents=got["audio_latents"].clone())
    unparallelize(pipe)
    return record
