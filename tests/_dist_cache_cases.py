"""Per-rank bodies of the cached parallel parity tests (spawned gloo ranks, see test_cache_parallel.py).

Each case builds a tiny pipeline from a fixed seed and runs it single-process with
``lite_boost.boost`` and the cache on (the reference, on every rank, no collectives), then runs a
fresh copy under ``ParallelManager`` with the same config, and returns both outputs' difference and
both decision logs. Many cases share one process group (start-up paid once per world size).
"""

from __future__ import annotations

import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

STEPS = 6
MAG = "mag_ratios=1/0.98/0.97/0.99/0.96/0.98,num_inference_steps=6,threshold=0.05"
# name -> heads, (height, width, frames), cfg_degree, cache spec, extra config
# token grids: 48x80x9 -> 3x3x5 = 45 tokens (uneven on 2: 23 + 22 with one padded row), 32x80x5 -> 20
# tokens (uneven on 3: 7 + 7 + 6). FBC thresholds sit between the statistics of different steps so
# that the decisions flip from step to step (the test checks both kinds occur, with a margin).
CASES = {
    "fbc_h3_tok45": (3, (48, 80, 9), 1, "first_block_cache:threshold=0.14", {}),
    "fbc_h3_tok20": (3, (32, 80, 5), 1, "first_block_cache:threshold=0.16", {}),
    "fbc_sparse_h3_tok45": (3, (48, 80, 9), 1, "first_block_cache:threshold=0.14",
                            {"sparse": {"sparse_type": "rf_v2", "sparsity": 0.5, "block_size": 8, "backend": "gather"}}),
    "fbc_two_stage_h3_tok45": (3, (48, 80, 9), 1, "first_block_cache:threshold=0.14", {"two_stage": True}),
    "sea_h3_tok45": (3, (48, 80, 9), 1, "sea_cache:threshold=0.3", {}),
    "mag_h3_tok45": (3, (48, 80, 9), 1, "mag_cache:" + MAG, {}),
    "taylor_h3_tok45": (3, (48, 80, 9), 1, "taylorseer_cache:cache_interval=2,disable_cache_before_step=2", {}),
    "pab_h3_tok45": (3, (48, 80, 9), 1, "pyramid_attention_broadcast:spatial_attention_block_skip_range=2,"
                     "spatial_attention_timestep_skip_range=0/1000", {}),
    "fbc_cfg2_h3_tok45": (3, (48, 80, 9), 2, "first_block_cache:threshold=0.14", {}),
    "fbc_cfg2_h3_tok20": (3, (32, 80, 5), 2, "first_block_cache:threshold=0.16", {}),
    "sea_cfg2_h3_tok45": (3, (48, 80, 9), 2, "sea_cache:threshold=0.3", {}),
    "taylor_cfg2_h3_tok45": (3, (48, 80, 9), 2, "taylorseer_cache:cache_interval=2,disable_cache_before_step=2", {}),
}


def _config(cfg_degree, cache, extra):
    cfg = {"parallel": {"cfg_degree": cfg_degree, "timeout_s": 120}, "cache": cache}
    if "sparse" in extra:
        cfg["sparse"] = extra["sparse"]
    return cfg


def _decisions(pipe):
    out = []
    for m in (pipe.transformer, getattr(pipe, "transformer_2", None)):
        if m is None:
            continue
        rt = m._lite_boost.extras["cache"]
        out.append([(d.context, d.call, d.statistic, d.compute) for d in rt.decisions])
    return out


def _work(models, run):
    from lite_boost.cache import count_block_work

    with count_block_work(models) as c:
        out = run()
    return out, (c.calls, c.ffn_runs, c.attn_runs)


def run_cases(rank, world_size, init_method, names):
    import lite_boost
    from conftest import pipeline_kwargs
    from lite_boost.demo import TinyWanSpec, tiny_wan_pipeline
    from lite_boost.parallel import ParallelManager, initialize_usp, unparallelize

    meshes = {}
    out = {}
    for name in names:
        heads, (h, w, f), cfg_degree, cache, extra = CASES[name]
        config = _config(cfg_degree, cache, extra)
        two = extra.get("two_stage", False)
        call = lambda: pipeline_kwargs("t2v", height=h, width=w, num_frames=f, steps=STEPS)  # noqa: E731
        ref_pipe = tiny_wan_pipeline("t2v", spec=TinyWanSpec(heads=heads), two_stage=two)
        lite_boost.boost(ref_pipe, dict(config, parallel={}))
        ref, ref_work = _work([ref_pipe.transformer, ref_pipe.transformer_2], lambda: ref_pipe(**call()).frames)

        pipe = tiny_wan_pipeline("t2v", spec=TinyWanSpec(heads=heads), two_stage=two)
        if cfg_degree not in meshes:
            meshes[cfg_degree] = initialize_usp(config, init_method=init_method)
        mesh = meshes[cfg_degree]
        ParallelManager(pipe, config, mesh=mesh)
        got, work = _work([pipe.transformer, pipe.transformer_2], lambda: pipe(**call()).frames)
        decisions = _decisions(pipe) if cache.startswith("first_block") else None
        # second call: fresh cache state on every rank (checked where the state carries over: FBC)
        got2 = pipe(**call()).frames if cache.startswith("first_block") else got
        out[name] = {
            "maxdiff": (got - ref).abs().max().item() if got.shape == ref.shape else math.inf,
            "maxdiff_second_call": (got2 - ref).abs().max().item() if got2.shape == ref.shape else math.inf,
            "ref_decisions": _decisions(ref_pipe) if cache.startswith("first_block") else None,
            "decisions": decisions,
            "ref_work": ref_work,
            "work": work,
            "cfg_rank": mesh.cfg_rank,
        }
        unparallelize(pipe)
    return out
