"""Step caching on ChronoEdit: its pipeline names no cache_context, the boosted pipeline names the calls.

Reference: stock diffusers' own hook (``transformer.enable_cache``) on a stock tiny ChronoEditPipeline whose
transformer calls are wrapped, by this test, in ``with transformer.cache_context("cond" / "uncond")`` in the
pipeline's order (cond, then uncond, every step): the boosted, cached pipeline equals it within 1e-5 (fp32),
skips the same work (attention / FFN runs counted on leaf modules), and unboost gives the stock pipeline back.
A 2-rank CFG-parallel run with the cache equals the one-process cached run.
"""

from __future__ import annotations

import pytest
import torch

import _tiny_wan_derived as tiny
import lite_boost
from lite_boost.adapter.cache import call_names
from lite_boost.config import ConfigError

TOL = 1e-5
STEPS = 4
TAYLOR = {"cache_interval": 2, "disable_cache_before_step": 1, "taylor_factors_dtype": "float32"}
PAB = {"spatial_attention_block_skip_range": 2, "spatial_attention_timestep_skip_range": (0, 1000)}


def _stock_config(method, pipe):
    import diffusers.hooks as h

    if method == "taylorseer_cache":
        return h.TaylorSeerCacheConfig(cache_interval=2, disable_cache_before_step=1,
                                       taylor_factors_dtype=torch.float32,
                                       cache_identifiers=[r"^blocks\.\d+\.(attn1|attn2|ffn)$"])
    return h.PyramidAttentionBroadcastConfig(spatial_attention_block_skip_range=2,
                                             spatial_attention_timestep_skip_range=(0, 1000),
                                             current_timestep_callback=lambda: pipe.current_timestep)


class NamedByHand:
    """Wraps each call of a stock transformer in ``transformer.cache_context(name)``: cond, uncond, cond, ...
    (CFG on) or cond every call (CFG off), restarted by :meth:`restart` before each pipeline call."""

    def __init__(self, model, cfg: bool = True):
        self.model, self.cfg, self.calls, self.names, self.ctx = model, cfg, 0, [], None
        self.handles = [model.register_forward_pre_hook(self.enter), model.register_forward_hook(self.leave)]

    def restart(self, cfg: bool = True):
        self.cfg, self.calls, self.names = cfg, 0, []

    def enter(self, module, args):
        name = "uncond" if self.cfg and self.calls % 2 else "cond"
        self.calls += 1
        self.names.append(name)
        self.ctx = module.cache_context(name)
        self.ctx.__enter__()

    def leave(self, module, args, output):
        self.ctx.__exit__(None, None, None)


class Work:
    """Leaf-module runs of every block's self-attention / cross-attention / FFN (a reused output runs none)."""

    def __init__(self, model):
        self.runs = {"attn1": 0, "attn2": 0, "ffn": 0}
        self.handles = []
        for block in model.blocks:
            for name in self.runs:
                leaf = next(m for m in getattr(block, name).modules() if not list(m.children()))
                self.handles.append(leaf.register_forward_pre_hook(lambda *a, n=name: self._bump(n)))

    def _bump(self, name):
        self.runs[name] += 1

    def remove(self):
        for h in self.handles:
            h.remove()


def _run(pipe, **over):
    work = Work(pipe.transformer)
    try:
        frames = pipe(**tiny.call_kwargs("chronoedit", num_inference_steps=STEPS, **over)).frames
    finally:
        work.remove()
    return frames, work.runs


CASES = [
    ("taylorseer_cache", TAYLOR, {}),
    ("pyramid_attention_broadcast", PAB, {}),
    ("taylorseer_cache", TAYLOR, dict(guidance_scale=1.0)),  # CFG off: one call per step, all "cond"
    # temporal reasoning: 3 latent frames for the first 2 steps (both computed), then the two-frame edit
    ("taylorseer_cache", TAYLOR, dict(num_frames=9, enable_temporal_reasoning=True, num_temporal_reasoning_steps=2)),
]


@pytest.mark.parametrize("method, params, over", CASES)
def test_cached_pipeline_equals_the_stock_hook_with_named_calls(method, params, over):
    cfg = over.get("guidance_scale", 5.0) > 1
    stock_pipe = tiny.pipeline("chronoedit")
    plain, plain_work = _run(stock_pipe, **over)
    named = NamedByHand(stock_pipe.transformer, cfg)
    stock_pipe.transformer.enable_cache(_stock_config(method, stock_pipe))
    stock, stock_work = _run(stock_pipe, **over)
    calls = STEPS * (2 if cfg else 1)
    assert named.names == (["cond", "uncond"] * STEPS if cfg else ["cond"] * STEPS)

    pipe = tiny.pipeline("chronoedit")
    lite_boost.boost(pipe, {"cache": {"method": method, **params}})
    got, got_work = _run(pipe, **over)
    assert call_names(pipe).names == named.names
    diff = (got - stock).abs().max().item()
    assert (stock - plain).abs().max() > 1e-4 and diff <= TOL, diff
    print(f"{method} {over}: max|boosted - stock hook| {diff:.2e}, cache effect {(stock - plain).abs().max():.2e}, "
          f"work {got_work} of {plain_work}")
    # the cache really skipped work, exactly as much as the stock hook did
    blocks = len(pipe.transformer.blocks)
    assert plain_work["attn1"] == calls * blocks and got_work == stock_work, (got_work, stock_work)
    assert got_work["attn1"] < plain_work["attn1"]
    # a second call starts afresh (a new generation), again = the stock hook's second call
    named.restart(cfg)
    stock_pipe.transformer._diffusers_hook.reset_stateful_hooks(recurse=True)
    stock2, _ = _run(stock_pipe, **over)
    got2, _ = _run(pipe, **over)
    assert (got2 - stock2).abs().max().item() <= TOL and (got2 - got).abs().max().item() <= TOL
    # unboost: no names, no hooks, the stock pipeline's output
    lite_boost.unboost(pipe)
    assert call_names(pipe) is None and "check_inputs" not in pipe.__dict__
    assert not pipe.transformer._forward_pre_hooks and not pipe.transformer._forward_hooks
    assert getattr(pipe.transformer, "_cache_config", None) is None
    back, back_work = _run(pipe, **over)
    assert (back - plain).abs().max().item() == 0.0 and back_work == plain_work


def test_other_methods_are_refused_with_the_reason():
    for method, why in (("first_block_cache", "block metadata"), ("mag_cache", "block metadata"),
                        ("sea_cache", "SeaCache")):
        pipe = tiny.pipeline("chronoedit")
        params = {"calibrate": True} if method == "mag_cache" else {}
        with pytest.raises(ConfigError, match=rf"{method}.*{why}"):
            lite_boost.boost(pipe, {"cache": {"method": method, **params}})
        assert not lite_boost.api.is_boosted(pipe) and "check_inputs" not in pipe.__dict__


def test_no_names_without_a_cache_and_a_caller_named_call_keeps_its_name():
    pipe = lite_boost.boost(tiny.pipeline("chronoedit"))
    assert call_names(pipe) is None and "check_inputs" not in pipe.__dict__
    lite_boost.boost(pipe, {"cache": {"method": "taylorseer_cache", **TAYLOR}})  # re-boost: names installed
    names = call_names(pipe)
    assert names is not None and "check_inputs" in pipe.__dict__
    lite_boost.boost(pipe, {"cache": {"method": "taylorseer_cache", **TAYLOR}})  # same config: the same names
    assert call_names(pipe) is names
    x = tiny.transformer_inputs("chronoedit", frames=2)
    with torch.no_grad(), pipe.transformer.cache_context("mine"):
        pipe.transformer(**x)
        ctx = lite_boost.adapter.cache.cache_runtime(pipe.transformer)._context()
        assert ctx is not None and ctx.name == "mine"
    assert names.names == []
    lite_boost.boost(pipe)  # cache off again: names removed
    assert call_names(pipe) is None and "check_inputs" not in pipe.__dict__


@pytest.mark.parametrize("over", [{}, dict(num_frames=9, enable_temporal_reasoning=True,
                                         num_temporal_reasoning_steps=2, output_type="pt")])
def test_cfg_parallel_with_the_cache_equals_one_process(over):
    import _dist_chronoedit_cache_cases as cases
    from _dist_utils import run_ranks

    per_rank = run_ranks(cases.run, 2, over, timeout=600)
    for rank, res in enumerate(per_rank):
        assert res["first"] <= TOL and res["second"] <= TOL and res["after"] <= TOL, (rank, res)
        assert res["names"] == res["ref_names"] == ["cond", "uncond"] * STEPS, (rank, res["names"])
        assert res["cfg_calls"] == {"computed": 2 * STEPS, "deferred": 2 * STEPS}, (rank, res["cfg_calls"])  # 2 calls
        assert "pyramid_attention_broadcast" in (res["refused"] or "") and "cfg_degree=2" in res["refused"]
        assert res["restored"] and res["unboosted"] and res["ref_abs"] > 0.1
        print(rank, {k: res[k] for k in ("first", "second", "after", "ref_abs")})
