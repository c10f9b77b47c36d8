"""Boosted Wan pipelines must reproduce stock diffusers output (fp32, CFG on, 2 steps)."""

import pytest
import torch

import lite_boost
from lite_boost.demo import TinyWanSpec, tiny_wan_pipeline
from lite_boost.models.wan import LiteBoostWanAttnProcessor
from lite_boost.ops.rope import RotaryEmbedding

from conftest import pipeline_kwargs

TOL = 1e-5


def _run(pipe, kind, **kw):
    return pipe(**pipeline_kwargs(kind, **kw)).frames


@pytest.mark.parametrize(
    "kind, spec, two_stage",
    [
        ("t2v", TinyWanSpec(), False),
        ("t2v", TinyWanSpec(heads=3, head_dim=24, layers=2), True),  # Wan2.2 A14B layout: transformer_2
        ("i2v", TinyWanSpec(), False),
    ],
)
def test_boosted_pipeline_matches_stock(kind, spec, two_stage):
    pipe = tiny_wan_pipeline(kind, spec=spec, two_stage=two_stage)
    stock = _run(pipe, kind, height=48, width=80)  # odd token grid: 2 frames x 3 x 5 tokens
    assert lite_boost.boost(pipe) is pipe
    boosted = _run(pipe, kind, height=48, width=80)
    assert boosted.shape == stock.shape
    assert (boosted - stock).abs().max().item() <= TOL
    modules = [pipe.transformer] + ([pipe.transformer_2] if two_stage else [])
    for module in modules:
        state = module._lite_boost
        assert state.rope_patched and state.rope_cache.hits >= 1 and state.rope_cache.misses == 1
        assert all(isinstance(p, LiteBoostWanAttnProcessor) for p in module.attn_processors.values())
    # decoded video too
    boosted_video = _run(pipe, kind, output_type="np")
    lite_boost.unboost(pipe)
    stock_video = _run(pipe, kind, output_type="np")
    assert abs(boosted_video - stock_video).max() <= TOL


def test_boost_twice_is_idempotent_and_reconfigurable():
    pipe = tiny_wan_pipeline("t2v")
    lite_boost.boost(pipe)
    state = pipe.transformer._lite_boost
    proc = pipe.transformer.blocks[0].attn1.processor
    lite_boost.boost(pipe)
    assert pipe.transformer._lite_boost is state and pipe.transformer.blocks[0].attn1.processor is proc
    lite_boost.boost(pipe, {"attention_backend": "sdpa"})
    assert pipe.transformer._lite_boost is not state
    assert pipe.transformer.blocks[0].attn1.processor.backend == "sdpa"
    # the originals kept for unboost are diffusers' processors, not the first boost's
    from diffusers.models.transformers.transformer_wan import WanAttnProcessor

    lite_boost.unboost(pipe)
    assert isinstance(pipe.transformer.blocks[0].attn1.processor, WanAttnProcessor)


def test_transformer_alone_and_rope_output():
    from lite_boost.demo import tiny_wan_transformer

    model = tiny_wan_transformer(TinyWanSpec(heads=3))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 16, 3, 10, 14, generator=g)
    t = torch.tensor([500, 20])
    ctx = torch.randn(2, 7, 32, generator=g)
    with torch.no_grad():
        ref = model(x, t, ctx).sample
        lite_boost.boost(model)
        emb = model.rope(x)
        assert isinstance(emb, RotaryEmbedding) and emb.freqs.shape == (1, 3 * 5 * 7, 1, 12)
        out = model(x, t, ctx).sample
    assert model._lite_boost.grid == (3, 5, 7)
    assert (out - ref).abs().max().item() <= TOL


