"""Few-step runs (4 steps, guidance-free, a shifted flow scheduler, a LoRA as distilled models ship): block-sparse
attention and step caches run where they make sense at that count, and say so (FewStepWarning) where their
settings cover the whole run, or refuse (ConfigError, before the transformer runs) where they would compute wrongly.

References: stock diffusers (dense boost, all-dense schedules) and diffusers' own cache hooks on the stock pipeline.
"""

import warnings

import pytest
import torch

import lite_boost
from lite_boost import BoostConfig, CacheConfig, SparseConfig
from lite_boost.adapter.steps import FewStepWarning
from lite_boost.config import ConfigError

TOL = 1e-5
STEPS = 4
SPARSE = dict(sparsity=0.7, block_size=16, window=(1, 4, 4))


@pytest.fixture(autouse=True)
def _gather_kernel(monkeypatch):
    monkeypatch.setenv("LITE_BOOST_SPARSE_BACKEND", "gather")  # the kernels are tested in test_rain_fusion.py


def _pipe():
    from diffusers import UniPCMultistepScheduler

    from lite_boost.demo import tiny_wan_pipeline

    pipe = tiny_wan_pipeline()
    pipe.scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=5.0)
    try:  # a few-step distilled model usually comes as a LoRA: one is loaded where peft is installed
        import peft  # noqa: F401
    except ImportError:
        return pipe
    from _lora import lora_state_dict

    pipe.load_lora_weights(lora_state_dict(pipe.transformer, 7), adapter_name="distilled")
    return pipe


def _run(pipe):
    # 128 x 192 px, 5 frames: a 2 x 8 x 12 token grid (192 tokens, 12 blocks of 16)
    return pipe(prompt="a cat", height=128, width=192, num_frames=5, num_inference_steps=STEPS, guidance_scale=1.0,
                generator=torch.Generator().manual_seed(0), output_type="latent").frames


def _quiet_run(pipe):
    with warnings.catch_warnings():
        warnings.simplefilter("error", FewStepWarning)
        return _run(pipe)


@pytest.fixture(scope="module")
def stock():
    pipe = _pipe()
    return pipe, _run(pipe)


def test_four_step_sparse_runs_and_all_dense_schedule_says_so(stock):
    from lite_boost.adapter.sparse import STATE_KEY

    pipe, ref = stock
    lite_boost.boost(pipe, BoostConfig(sparse=SparseConfig(**SPARSE, dense_steps_first=1)))
    try:
        out = _quiet_run(pipe)
        paths = {(e.step, e.path) for e in pipe.transformer._lite_boost.extras[STATE_KEY].events}
    finally:
        lite_boost.unboost(pipe)
    assert {p for s, p in paths if s == 0} == {"dense"} and {p for s, p in paths if s > 0} == {"sparse"}
    assert (out - ref).abs().max() > 1e-4

    lite_boost.boost(pipe, BoostConfig(sparse=SparseConfig(**SPARSE, dense_steps_first=3, dense_steps_last=1)))
    try:
        with pytest.warns(FewStepWarning, match=r"4-step run: sparse: dense_steps_first=3 \+ dense_steps_last=1 cover "
                                                r"all 4 steps.*never runs"):
            out = _run(pipe)
        assert (out - ref).abs().max() <= TOL  # indeed all dense
        _quiet_run(pipe)  # said once per step count
    finally:
        lite_boost.unboost(pipe)


def _stock_cached(method: str, **params):
    """diffusers' own hook on a stock pipeline: the reference of a boosted cache."""
    from lite_boost.cache import build_diffusers_config

    pipe = _pipe()
    pipe.transformer.enable_cache(build_diffusers_config(method, params))
    out = _run(pipe)
    return out


@torch.no_grad()
def test_four_step_caches_run_or_say_why_not(stock):
    pipe, ref = stock
    # First-Block Cache (no warm-up): runs at 4 steps and equals diffusers' own hook; a loose threshold skips
    lite_boost.boost(pipe, BoostConfig(cache=CacheConfig("first_block_cache", {"threshold": 0.5})))
    try:
        out = _quiet_run(pipe)
        decisions = lite_boost.adapter.cache.cache_runtime(pipe.transformer).decisions
    finally:
        lite_boost.unboost(pipe)
    assert (out - _stock_cached("first_block_cache", threshold=0.5)).abs().max() <= TOL
    assert any(not d.compute for d in decisions) and (out - ref).abs().max() > 1e-5

    # TaylorSeer's warm-up (disable_cache_before_step) covering the run: said, and the output is the uncached one
    lite_boost.boost(pipe, BoostConfig(cache=CacheConfig("taylorseer_cache", {"disable_cache_before_step": 4})))
    try:
        with pytest.warns(FewStepWarning, match=r"taylorseer_cache: with disable_cache_before_step=4.*nothing is "
                                                r"predicted; lower disable_cache_before_step below 4"):
            out = _run(pipe)
    finally:
        lite_boost.unboost(pipe)
    assert (out - ref).abs().max() <= TOL

    # MagCache calibrated for another step count: refused before the transformer runs
    cfg = CacheConfig("mag_cache", {"num_inference_steps": 28, "mag_ratios": [1.0] * 28})
    lite_boost.boost(pipe, BoostConfig(cache=cfg))
    try:
        with pytest.raises(ConfigError, match=r"mag_cache: num_inference_steps=28 but this run has 4 steps.*"
                                              r"num_inference_steps=4"):
            _run(pipe)
    finally:
        lite_boost.unboost(pipe)
    lite_boost.boost(pipe, BoostConfig(cache=CacheConfig("mag_cache", {"num_inference_steps": 4, "retention_ratio": 0.25,
                                                                       "mag_ratios": [1.0, 0.99, 0.98, 0.97]})))
    try:
        out = _quiet_run(pipe)
    finally:
        lite_boost.unboost(pipe)
    assert (out - _stock_cached("mag_cache", num_inference_steps=4, retention_ratio=0.25,
                                mag_ratios=[1.0, 0.99, 0.98, 0.97])).abs().max() <= TOL


def test_step_problem_rules():
    """The per-method rules at the edges (what skips at all in an N-step run), against diffusers' own definitions."""
    from types import SimpleNamespace as NS

    from lite_boost.cache import step_count_problem

    assert step_count_problem("first_block_cache", NS(threshold=0.1), 4)[0] is None
    assert "computes every step" in step_count_problem("first_block_cache", NS(threshold=0.1), 1)[0]
    # TaylorSeer predicts step s when s >= before and (s - before - 1) % interval != 0 (diffusers' hook)
    assert step_count_problem("taylorseer_cache", NS(disable_cache_before_step=3, cache_interval=5), 4)[0] is None
    assert step_count_problem("taylorseer_cache", NS(disable_cache_before_step=1, cache_interval=1), 4)[0]
    assert step_count_problem("taylorseer_cache", NS(disable_cache_before_step=2, cache_interval=5,
                                                     disable_cache_after_step=2), 4)[0]
    assert step_count_problem("mag_cache", NS(num_inference_steps=4, retention_ratio=0.9), 4)[0]
    assert step_count_problem("mag_cache", NS(num_inference_steps=4, retention_ratio=0.2), 4)[0] is None
    assert step_count_problem("sea_cache", NS(retention_steps=2, cache_end_steps=2), 4)[0]
    assert step_count_problem("sea_cache", NS(retention_steps=1, cache_end_steps=1), 4)[0] is None
    pab = NS(spatial_attention_block_skip_range=2, spatial_attention_timestep_skip_range=(100, 800))
    assert step_count_problem("pyramid_attention_broadcast", pab, 4, [999.0, 950.0, 900.0, 850.0])[0]
    assert step_count_problem("pyramid_attention_broadcast", pab, 4, [999.0, 750.0, 500.0, 250.0])[0] is None
