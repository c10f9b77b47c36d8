"""Block-sparse self-attention in boosted Wan pipelines: parity with stock, and the step/layer schedule."""

import pytest
import torch

import lite_boost
from lite_boost import BoostConfig, SparseConfig
from lite_boost.demo import tiny_wan_pipeline
from lite_boost.adapter.sparse import STATE_KEY, ScheduledSparseAttention as SparseWanAttention
from lite_boost.schedule import SparseSchedule, StepTracker

from conftest import pipeline_kwargs

# 128x192 pixels, 5 frames -> latent 2x16x24 -> token grid 2x8x12 = 192 tokens (12 blocks of 16)
SIZE = dict(height=128, width=192, num_frames=5)


@pytest.fixture(autouse=True)
def _gather_kernel(monkeypatch):
    """The kernels are tested in test_rain_fusion.py; skip FlexAttention compiles here."""
    monkeypatch.setenv("LITE_BOOST_SPARSE_BACKEND", "gather")


def latents(pipe, steps=3, seed=0):
    return pipe(**pipeline_kwargs("t2v", steps=steps, seed=seed, **SIZE)).frames


@pytest.fixture(scope="module")
def stock():
    pipe = tiny_wan_pipeline()
    return pipe, {steps: latents(pipe, steps) for steps in (3, 4)}


def sparse_state(pipe):
    return pipe.transformer._lite_boost.extras[STATE_KEY]


def test_sparsity_zero_pipeline_matches_stock(stock):
    pipe, ref = stock
    lite_boost.boost(pipe, BoostConfig(sparse=SparseConfig(sparsity=0.0, block_size=16, window=(1, 4, 4))))
    try:
        out = latents(pipe)
        events = sparse_state(pipe).events
    finally:
        lite_boost.unboost(pipe)
    torch.testing.assert_close(out, ref[3], atol=1e-5, rtol=1e-5)
    assert events and all(e.path == "dense" for e in events)


def test_all_dense_schedule_matches_stock_and_sparse_differs(stock):
    pipe, ref = stock
    base = dict(sparsity=0.7, block_size=16, window=(1, 4, 4))
    lite_boost.boost(pipe, BoostConfig(sparse=SparseConfig(**base, dense_steps_first=3)))
    try:
        out = latents(pipe)
    finally:
        lite_boost.unboost(pipe)
    torch.testing.assert_close(out, ref[3], atol=1e-5, rtol=1e-5)
    lite_boost.boost(pipe, BoostConfig(sparse=SparseConfig(**base)))
    try:
        sparse = latents(pipe)
        again = latents(pipe)
        state = sparse_state(pipe)
        assert all(e.path == "sparse" for e in state.events)
        # half the 192 tokens are the first (sink) frame, whose rows are dense: 0.21 expected
        assert 0.1 < state.mean_effective_sparsity() < 0.7
    finally:
        lite_boost.unboost(pipe)
    assert (sparse - ref[3]).abs().max() > 1e-4  # the sparse path really ran
    assert torch.equal(sparse, again)  # deterministic run to run
    assert torch.isfinite(sparse).all()


def test_schedule_dense_steps_layers_and_mask_reuse(stock):
    pipe, _ = stock
    cfg = SparseConfig(sparsity=0.7, block_size=16, window=(1, 4, 4), dense_steps_first=1, dense_steps_last=1,
                       dense_layers=(0,), mask_reuse_steps=2)
    lite_boost.boost(pipe, BoostConfig(sparse=cfg))
    try:
        procs = pipe.transformer._lite_boost.self_attention_processors
        assert all(isinstance(p.attn_fn, SparseWanAttention) for p in procs)
        assert not any(isinstance(p.attn_fn, SparseWanAttention)
                       for p in pipe.transformer._lite_boost.cross_attention_processors)
        latents(pipe, steps=4)
        events = list(sparse_state(pipe).events)
        latents(pipe, steps=4)  # a second generation starts again at step 0
        events2 = list(sparse_state(pipe).events)
    finally:
        lite_boost.unboost(pipe)
    got = {(e.step, e.call, e.layer): (e.path, e.reused) for e in events}
    assert len(got) == len(events) == 4 * 2 * 2  # steps x CFG calls x layers
    for call in (0, 1):
        for step in range(4):
            assert got[(step, call, 0)] == ("dense", False)  # dense layer
        assert got[(0, call, 1)] == ("dense", False)  # dense warm-up step
        assert got[(1, call, 1)] == ("sparse", False)  # mask computed
        assert got[(2, call, 1)] == ("sparse", True)  # mask reused (R = 2)
        assert got[(3, call, 1)] == ("dense", False)  # dense last step
    assert [(e.step, e.call, e.layer, e.path, e.reused) for e in events2] == \
        [(e.step, e.call, e.layer, e.path, e.reused) for e in events]


def test_unboost_removes_the_hook_and_restores_stock(stock):
    pipe, ref = stock
    lite_boost.boost(pipe, BoostConfig(sparse=SparseConfig(sparsity=0.7, block_size=16)))
    hook_id = sparse_state(pipe).hook.id
    assert hook_id in pipe.transformer._forward_pre_hooks
    lite_boost.unboost(pipe)
    assert hook_id not in pipe.transformer._forward_pre_hooks
    torch.testing.assert_close(latents(pipe), ref[3], atol=0, rtol=0)


# --------------------------------------------------------------------------------------------- #
# schedule logic alone                                                                           #
# --------------------------------------------------------------------------------------------- #


def test_sparse_schedule_rules():
    s = SparseSchedule(SparseConfig(dense_steps_first=2, dense_steps_last=1, dense_layers=(3,), mask_reuse_steps=3))
    assert s.dense_reason(0, 10, 0) and s.dense_reason(1, 10, 0) and s.dense_reason(2, 10, 0) is None
    assert s.dense_reason(9, 10, 0) and s.dense_reason(8, 10, 0) is None
    assert s.dense_reason(9, None, 0) is None  # total unknown: no dense tail
    assert "dense_layers" in s.dense_reason(5, 10, 3)
    assert s.reuse(6, 4) and not s.reuse(7, 4) and not s.reuse(4, None)
    assert SparseSchedule(SparseConfig(sparse_type=None)).dense_reason(5, 10, 0) == "sparse_type=None"


class _FakeScheduler:
    def __init__(self, n):
        self.timesteps = torch.linspace(1000, 100, n)
        self.step_index = None


class _FakePipe:
    def __init__(self, n):
        self.scheduler = _FakeScheduler(n)


def test_step_tracker_follows_scheduler_and_cfg_calls():
    pipe = _FakePipe(3)
    tr = StepTracker()
    tr.attach(pipe)
    seen = []
    for step, t in enumerate(pipe.scheduler.timesteps):
        for _ in range(2):  # cond, uncond
            tr.observe(t)
            seen.append((tr.step, tr.call, tr.total))
        pipe.scheduler.step_index = step + 1
    assert seen == [(0, 0, 3), (0, 1, 3), (1, 0, 3), (1, 1, 3), (2, 0, 3), (2, 1, 3)]
    pipe.scheduler.step_index = None  # set_timesteps of the next generation
    tr.observe(torch.tensor(1000.0))
    assert (tr.step, tr.call, tr.generation) == (0, 0, 1)


def test_step_tracker_without_scheduler_counts_timesteps():
    tr = StepTracker()
    out = []
    for t in (900, 900, 700, 700, 500, 900, 900):
        tr.observe(torch.tensor([t]))
        out.append((tr.step, tr.call, tr.generation))
    assert out == [(0, 0, 0), (0, 1, 0), (1, 0, 0), (1, 1, 0), (2, 0, 0), (0, 0, 1), (0, 1, 1)]
    assert tr.total is None


def test_step_tracker_reads_per_token_timesteps_by_their_noisiest_token():
    """Image-to-video per-token timesteps keep the conditioning tokens (first) at 0 every step: the
    step and a new generation still follow the schedule."""
    tr = StepTracker()
    out = []
    for t in (900, 700, 500, 900):
        per_token = torch.tensor([[0.0, t, t], [0.0, t, t]])
        tr.observe(per_token)
        out.append((tr.step, tr.generation))
    assert out == [(0, 0), (1, 0), (2, 0), (0, 1)]


def test_config_backend_overrides_the_environment(stock):
    pipe, _ = stock
    cfg = SparseConfig(sparsity=0.6, block_size=16, window=(1, 4, 4), backend="reference")
    lite_boost.boost(pipe, BoostConfig(sparse=cfg))
    try:
        latents(pipe)
        events = sparse_state(pipe).events
    finally:
        lite_boost.unboost(pipe)
    sparse = [e for e in events if e.path == "sparse"]
    assert sparse and all(e.backend == "reference" for e in sparse)
