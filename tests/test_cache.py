"""Step caching (diffusers' cache hooks) on a boosted single-process Wan pipeline.

Reference: stock diffusers with the same hook enabled by hand (``transformer.enable_cache`` with a
diffusers config built here, independently of lite_boost). Every case uses settings under which the
cache really skips work (checked: the output differs from the uncached run), so equality with the
reference is not the trivial "nothing was cached".
"""

import functools
import os

import pytest
import torch

import lite_boost
from lite_boost.cache import count_block_work
from lite_boost.config import BoostConfig, CacheConfig, ConfigError
from lite_boost.demo import TinyWanSpec, tiny_wan_pipeline

from conftest import pipeline_kwargs

HWF = (48, 80, 9)  # 3 x 3 x 5 = 45 tokens
STEPS = 6
MAG_RATIOS = [1.0, 0.98, 0.97, 0.99, 0.96, 0.98]


def _diffusers_config(method, pipe_holder):
    """diffusers' own config object for each case (the stock reference), written out by hand."""
    import diffusers.hooks as h

    if method == "first_block_cache":
        return h.FirstBlockCacheConfig(threshold=0.14)
    if method == "mag_cache":
        return h.MagCacheConfig(threshold=0.05, num_inference_steps=STEPS, mag_ratios=MAG_RATIOS)
    if method == "taylorseer_cache":
        return h.TaylorSeerCacheConfig(cache_interval=2, disable_cache_before_step=2, taylor_factors_dtype=torch.float32,
                                       cache_identifiers=[r"^blocks\.\d+\.(attn1|attn2|ffn)$"])
    if method == "pyramid_attention_broadcast":
        return h.PyramidAttentionBroadcastConfig(spatial_attention_block_skip_range=2, cross_attention_block_skip_range=3,
                                                 spatial_attention_timestep_skip_range=(0, 1000),
                                                 cross_attention_timestep_skip_range=(0, 1000),
                                                 current_timestep_callback=lambda: pipe_holder[0].current_timestep)
    if method == "sea_cache":
        return h.SeaCacheConfig(threshold=0.3)
    raise AssertionError(method)


OURS = {
    "first_block_cache": {"threshold": 0.14},
    "mag_cache": {"threshold": 0.05, "num_inference_steps": STEPS, "mag_ratios": MAG_RATIOS},
    "taylorseer_cache": {"cache_interval": 2, "disable_cache_before_step": 2, "taylor_factors_dtype": "float32"},
    "pyramid_attention_broadcast": {"spatial_attention_block_skip_range": 2, "cross_attention_block_skip_range": 3,
                                    "spatial_attention_timestep_skip_range": (0, 1000),
                                    "cross_attention_timestep_skip_range": (0, 1000)},
    "sea_cache": {"threshold": 0.3},
}


def _call(**kw):
    h, w, f = HWF
    return pipeline_kwargs("t2v", height=h, width=w, num_frames=f, steps=STEPS, **kw)


def _pipe(**kw):
    return tiny_wan_pipeline("t2v", spec=TinyWanSpec(heads=3), **kw)


@functools.lru_cache(maxsize=1)
def _uncached():
    return _pipe()(**_call()).frames


@pytest.mark.parametrize("method", sorted(OURS))
def test_every_method_matches_stock_diffusers(method):
    uncached = _uncached()

    stock = _pipe()
    holder = [stock]
    stock.transformer.enable_cache(_diffusers_config(method, holder))
    with count_block_work([stock.transformer]) as stock_work:
        ref = stock(**_call()).frames

    pipe = lite_boost.boost(_pipe(), BoostConfig(cache=CacheConfig(method, OURS[method])))
    assert pipe.transformer.is_cache_enabled
    with count_block_work([pipe.transformer]) as work:
        got = pipe(**_call()).frames
    # a second call starts from a fresh cache state (diffusers alone would carry the first call's over)
    again = pipe(**_call()).frames if method in ("first_block_cache", "taylorseer_cache") else got

    assert (ref - uncached).abs().max().item() > 1e-4, "the reference skipped nothing: settings too mild"
    assert (got - ref).abs().max().item() <= 1e-5
    assert (again - ref).abs().max().item() <= 1e-5
    assert (work.calls, work.ffn_runs, work.attn_runs) == (stock_work.calls, stock_work.ffn_runs, stock_work.attn_runs)


def test_first_block_cache_decisions_flip_and_are_logged():
    pipe = lite_boost.boost(_pipe(), {"cache": "first_block_cache:threshold=0.14"})
    pipe(**_call())
    log = pipe.transformer._lite_boost.extras["cache"].decisions
    assert [d.context for d in log[:2]] == ["cond", "uncond"]
    assert len(log) == 2 * STEPS
    decisions = [d.compute for d in log]
    assert True in decisions and False in decisions
    for d in log:  # the logged statistic is what the threshold test saw
        if d.statistic is not None:
            assert d.compute == (d.statistic > 0.14)


def test_two_stage_pipeline_caches_both_transformers():
    cfg = {"cache": {"method": "first_block_cache", "threshold": 0.14}}
    stock = _pipe(two_stage=True)
    import diffusers.hooks as h

    for m in (stock.transformer, stock.transformer_2):
        m.enable_cache(h.FirstBlockCacheConfig(threshold=0.14))
    ref = stock(**_call()).frames
    pipe = lite_boost.boost(_pipe(two_stage=True), cfg)
    assert pipe.transformer.is_cache_enabled and pipe.transformer_2.is_cache_enabled
    got = pipe(**_call()).frames
    assert (got - ref).abs().max().item() <= 1e-5


def test_unboost_removes_the_hooks_and_restores_stock_output():
    ref = _uncached()
    pipe = lite_boost.boost(_pipe(), {"cache": "taylorseer_cache:cache_interval=2,disable_cache_before_step=1"})
    pipe(**_call())
    lite_boost.unboost(pipe)
    t = pipe.transformer
    assert not t.is_cache_enabled and not hasattr(t, "_lite_boost")
    left = [n for n, m in t.named_modules() if getattr(m, "_diffusers_hook", None) is not None and m._diffusers_hook.hooks]
    assert left == []
    assert (pipe(**_call()).frames - ref).abs().max().item() <= 1e-5
    # boost again with another method, then with none: replaced, not stacked
    lite_boost.boost(pipe, {"cache": "first_block_cache"})
    lite_boost.boost(pipe, {"cache": "mag_cache:calibrate=true,num_inference_steps=6"})
    assert type(t._cache_config).__name__ == "MagCacheConfig"
    lite_boost.boost(pipe, None)
    assert not t.is_cache_enabled


def test_cache_composes_with_sparse_attention_and_its_step_schedule():
    sparse = {"sparse_type": "rf_v2", "sparsity": 0.5, "block_size": 8, "dense_steps_first": 2,
              "backend": "gather"}
    plain = lite_boost.boost(_pipe(), {"sparse": sparse})
    plain(**_call())
    cached = lite_boost.boost(_pipe(), {"sparse": sparse, "cache": "first_block_cache:threshold=0.14"})
    out = cached(**_call()).frames
    ev_plain = plain.transformer._lite_boost.extras["sparse"].events
    ev_cached = cached.transformer._lite_boost.extras["sparse"].events
    # layer 0 runs at every call in both: the schedule sees the same (step, call) sequence
    steps = lambda evs: [(e.step, e.call, e.path) for e in evs if e.layer == 0]  # noqa: E731
    assert steps(ev_cached) == steps(ev_plain)
    assert [s for s, _, _ in steps(ev_plain)] == [i // 2 for i in range(2 * STEPS)]
    assert {e.path for e in ev_cached if e.step < 2} == {"dense"}
    assert "sparse" in {e.path for e in ev_cached if e.step >= 2}
    # the skipped layers really were skipped by the cache
    log = cached.transformer._lite_boost.extras["cache"].decisions
    skipped = sum(not d.compute for d in log)
    assert skipped > 0
    assert len([e for e in ev_cached if e.layer == 1]) == 2 * STEPS - skipped
    assert torch.isfinite(out).all()


def test_cli_spec_and_config_forms():
    c = CacheConfig.parse("pyramid_attention_broadcast:spatial_attention_block_skip_range=3,"
                          "spatial_attention_timestep_skip_range=100/700")
    assert c.method == "pyramid_attention_broadcast"
    assert c.params == {"spatial_attention_block_skip_range": 3, "spatial_attention_timestep_skip_range": (100, 700)}
    m = CacheConfig.parse("mag_cache:mag_ratios=1/0.99/0.98,num_inference_steps=3,calibrate=false")
    assert m.params["mag_ratios"] == (1.0, 0.99, 0.98) and m.params["calibrate"] is False
    b = BoostConfig(cache={"method": "first_block_cache", "threshold": 0.2})
    assert b == BoostConfig.from_dict(b.to_dict()) == BoostConfig(cache="first_block_cache:threshold=0.2")
    assert BoostConfig.coerce(CacheConfig()).cache.method == "first_block_cache"
    assert hash(b.cache) == hash(CacheConfig("first_block_cache", {"threshold": 0.2}))


@pytest.mark.parametrize(
    "spec, match",
    [
        ("fbc", r"unknown cache method 'fbc'; accepted methods: \['first_block_cache', 'mag_cache'"),
        ("faster_cache", r"accepted methods"),
        ("first_block_cache:thresh=0.1", r"unknown parameter\(s\) \['thresh'\].*accepted: \['threshold"),
        ("first_block_cache:threshold=-0.1", r"threshold out of range.*>= 0.0"),
        ("first_block_cache:threshold=abc", r"threshold must be a number"),
        ("first_block_cache:threshold", r"must be PARAM=VALUE"),
        ("mag_cache", r"needs mag_ratios .* or calibrate=True"),
        ("mag_cache:mag_ratios=1/-2", r"mag_ratios must be a non-empty list of positive"),
        ("mag_cache:retention_ratio=1.5,calibrate=true", r"retention_ratio out of range.*<= 1.0"),
        ("taylorseer_cache:cache_interval=0", r"cache_interval out of range.*>= 1"),
        ("taylorseer_cache:taylor_factors_dtype=int8", r"taylor_factors_dtype must be one of \['float32'"),
        ("taylorseer_cache:cache_identifiers=[", r"not a valid regular expression"),
        ("pyramid_attention_broadcast:spatial_attention_timestep_skip_range=800/100", r"needs low < high"),
        ("sea_cache:residual_order=2", r"residual_order must be one of \[0, 1\]"),
        ("sea_cache:power_exp=0", r"power_exp out of range.*> 0.0"),
        ("", r"METHOD\[:PARAM=VALUE"),
    ],
)
def test_bad_cache_config_names_the_accepted_values(spec, match):
    with pytest.raises(ConfigError, match=match):
        BoostConfig(cache=spec)


def test_bad_targets_fail_before_anything_is_modified():
    # image-to-video Wan: SeaCache would silently run uncached
    i2v = tiny_wan_pipeline("i2v")
    with pytest.raises(ConfigError, match=r"sea_cache.*text-to-video.*use first_block_cache"):
        lite_boost.boost(i2v, {"cache": "sea_cache"})
    assert not hasattr(i2v.transformer, "_lite_boost") and not i2v.transformer.is_cache_enabled

    # a model whose adapter declares no cache support
    from lite_boost.models import SUPPORTED_MODELS, register_model

    class NoCacheModel(torch.nn.Module):
        pass

    touched = []
    register_model("NoCacheModel")(lambda target, config: touched.append(target) or target)
    try:
        with pytest.raises(ConfigError, match=r"NoCacheModel has no cache adapter; models with one: \['WanImageToVideoPipeline'"):
            lite_boost.boost(NoCacheModel(), {"cache": "first_block_cache"})
        assert touched == []
    finally:
        del SUPPORTED_MODELS["NoCacheModel"]

    # a user-enabled diffusers cache is not silently stacked on
    import diffusers.hooks as h

    pipe = _pipe()
    pipe.transformer.enable_cache(h.FirstBlockCacheConfig())
    with pytest.raises(ConfigError, match=r"already has a diffusers cache enabled.*disable_cache\(\)"):
        lite_boost.boost(pipe, {"cache": "mag_cache:calibrate=true"})
    assert not hasattr(pipe.transformer, "_lite_boost")


def test_parallel_manager_rejects_shared_state_cache_with_cfg_parallel_before_any_collective():
    import torch.distributed as dist

    from lite_boost.parallel import ParallelManager

    with pytest.raises(ConfigError, match=r"pyramid_attention_broadcast.*cfg_degree=2 use one of \['first_block_cache'"):
        ParallelManager(_pipe(), {"parallel": {"cfg_degree": 2}, "cache": "pyramid_attention_broadcast"})
    assert not dist.is_initialized()


def test_compiled_boosted_transformer_with_a_cache_matches_eager():
    """torch.compile of a boosted transformer whose cache hooks are on: same decisions, same output."""
    torch._dynamo.reset()
    spec = "first_block_cache:threshold=0.14"
    eager = lite_boost.boost(_pipe(), {"cache": spec})
    h, w, f = HWF
    call = lambda: pipeline_kwargs("t2v", height=h, width=w, num_frames=f, steps=3)  # noqa: E731
    ref = eager(**call()).frames
    pipe = lite_boost.boost(_pipe(), {"cache": spec})
    # in place, as diffusers documents for its pipelines; aot_eager = dynamo + AOT tracing without
    # inductor's code generation (minutes on 2 cores); the inductor backend gives the same result
    pipe.transformer.compile(backend=os.environ.get("LITE_BOOST_TEST_COMPILE_BACKEND", "aot_eager"))
    got = pipe(**call()).frames
    log = lambda p: [(d.context, d.call, d.compute) for d in p.transformer._lite_boost.extras["cache"].decisions]  # noqa: E731
    assert log(pipe) == log(eager) and False in [c for _, _, c in log(eager)]
    assert (got - ref).abs().max().item() <= 1e-4
    assert (pipe(**call()).frames - ref).abs().max().item() <= 1e-4  # second call: fresh state, no recompile error


def test_cli_generate_with_cache_prints_what_was_applied(tmp_path, capsys):
    from lite_boost.cli import main

    rc = main(["generate", "--height", "32", "--width", "48", "--num-frames", "5", "--steps", "4", "--warmup", "0",
               "--cache", "first_block_cache:threshold=0.14", "--output", str(tmp_path / "v.mp4")])
    out = capsys.readouterr().out
    assert rc == 0
    assert "| text encode (not boosted) |" in out and "| VAE decode (not boosted) |" in out
    assert "applied:" in out and "- step cache: first_block_cache(threshold=0.14): " in out
    assert "- attention backend: sdpa" in out and "- parallel: one process" in out
    with pytest.raises(SystemExit, match=r"--cache: unknown parameter\(s\) \['thresh'\]"):
        main(["generate", "--cache", "first_block_cache:thresh=1"])


def test_cache_runtime_puts_the_timestep_on_the_pipelines_scale():
    """CacheAdapter.timestep_scale: a transformer called with t / 1000 (Flux) reports the pipeline's t."""
    from lite_boost.cache import CacheRuntime

    model = torch.nn.Linear(2, 2)
    runtime = CacheRuntime(model, "pyramid_attention_broadcast", timestep_scale=1000.0)
    runtime._pre_forward(model, (), {"timestep": torch.tensor([0.25, 0.5])})
    assert runtime.current_timestep() == 500.0
    plain = CacheRuntime(model, "pyramid_attention_broadcast")
    plain._pre_forward(model, (), {"timestep": torch.tensor([0.25, 0.5])})
    assert plain.current_timestep() == 0.5
