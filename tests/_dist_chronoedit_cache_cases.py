"""Per-rank body of ChronoEdit's step cache under CFG parallelism (spawned gloo ranks, test_cache_chronoedit.py).

Every rank runs the tiny ChronoEdit pipeline boosted with the cache in one process (the reference, no
collectives), then a fresh pipeline under ``ParallelManager`` with cfg degree 2 and the same cache, twice
(the second call starts a new generation), then again after ``unparallelize`` (still boosted and cached, one
process). Pyramid Attention Broadcast (one state for both branches) is refused before any collective.
"""

from __future__ import annotations

import os
import sys
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

STEPS = 4
TAYLOR = {"method": "taylorseer_cache", "cache_interval": 2, "disable_cache_before_step": 1,
          "taylor_factors_dtype": "float32"}


def run(rank, world_size, init_method, over):
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    import lite_boost
    import _tiny_wan_derived as tiny
    from lite_boost.adapter.cache import call_names
    from lite_boost.config import ConfigError
    from lite_boost.parallel import initialize_usp

    def call(pipe):
        return pipe(**tiny.call_kwargs("chronoedit", num_inference_steps=STEPS, **over)).frames

    ref_pipe = lite_boost.boost(tiny.pipeline("chronoedit"), {"cache": TAYLOR})
    ref = call(ref_pipe)
    ref_names = list(call_names(ref_pipe).names)
    par = {"cfg_degree": 2, "timeout_s": 120}
    mesh = initialize_usp({"parallel": par}, init_method=init_method)
    refused = None
    try:
        lite_boost.ParallelManager(tiny.pipeline("chronoedit"), {"parallel": par, "cache": {
            "method": "pyramid_attention_broadcast"}}, mesh=mesh)
    except ConfigError as exc:
        refused = str(exc)
    pipe = tiny.pipeline("chronoedit")
    lite_boost.ParallelManager(pipe, {"parallel": par, "cache": TAYLOR}, mesh=mesh)
    first = call(pipe)
    names = list(call_names(pipe).names)
    second = call(pipe)
    calls = dict(pipe.transformer._lite_boost.extras["parallel"].cfg.calls)
    lite_boost.parallel.unparallelize(pipe)
    after = call(pipe)  # one process again, still cached: the names still restart at check_inputs
    restored = pipe.__dict__.get("check_inputs") is call_names(pipe)._wrapper
    lite_boost.unboost(pipe)
    return {"first": (first - ref).abs().max().item(), "second": (second - ref).abs().max().item(),
            "after": (after - ref).abs().max().item(), "ref_abs": ref.abs().max().item(), "names": names,
            "ref_names": ref_names, "cfg_calls": calls, "refused": refused,
            "restored": restored, "unboosted": "check_inputs" not in pipe.__dict__ and call_names(pipe) is None}
