"""Boosted Qwen-Image 2.1 pipelines and transformers against stock diffusers, one process.

fp32, 3 heads, tiny in-memory pipelines without a text encoder (prompt embeddings passed in; condition images
through an instance ``encode_prompt`` that lays out random embeddings as the vision-language encoder would).
Sequences interleave text and condition images (two adjacent images too), the target image last; text padded
per sample; the pipeline's prefix KV caching (extract, then cached steps) on and off. The family contract
(parity, unboost, save / load, bf16, graph breaks, regional compile) is its row in test_family_contract.py.
"""

import pytest
import torch

import _tiny_qwen21 as t
import lite_boost
from lite_boost.config import BoostConfig, ConfigError, SparseConfig
from lite_boost.models.qwenimage21 import QWEN_IMAGE_21, QwenImage21Processor

TOL = 1e-5


def _max(a, b):
    return (a - b).abs().max().item()


@pytest.mark.parametrize("kv", [True, False])
def test_boosted_pipeline_matches_stock(kv):
    """CFG with cond / uncond prompts of different lengths, the uncond one padded; prefix KV caching on and off."""
    pipe = t.pipeline()
    stock = pipe(**t.call_kwargs(kv=kv)).images
    assert lite_boost.boost(pipe) is pipe
    got = pipe(**t.call_kwargs(kv=kv)).images
    assert stock.abs().max() > 0.1 and _max(got, stock) <= TOL
    state = pipe.transformer._lite_boost
    assert {type(p) for p in pipe.transformer.attn_processors.values()} == {QwenImage21Processor}
    assert state.rope_patched and state.rope_cache.hits >= 2 and state.call is None  # cond / uncond tables reused
    lite_boost.unboost(pipe)
    assert torch.equal(pipe(**t.call_kwargs(kv=kv)).images, stock)


def test_image_conditioned_pipeline_matches_stock():
    """Two condition images between text runs (VAE-encoded, their tokens in the prefix), KV caching."""
    layout = (("text", 3), ("image", None), ("text", 2), ("image", None), ("text", 4))

    def run(pipe):
        kw = dict(t.call_kwargs(cfg=False, steps=3), image=[t.condition_image(32, 64), t.condition_image(64, 32, 1)],
                  output_resolution=64, height=64, width=96)
        return pipe(**kw).images

    stock = run(t.image_conditioned(t.pipeline(), layout))
    got = run(lite_boost.boost(t.image_conditioned(t.pipeline(), layout)))
    assert stock.abs().max() > 0.1 and _max(got, stock) <= TOL


@pytest.mark.parametrize("layout", list(t.LAYOUTS))
@pytest.mark.parametrize("pad", [None, [2, 0]])
def test_transformer_and_prefix_kv_caching_match_stock(layout, pad):
    """Whole-sequence calls and the extract / cached calls of KV caching, batch 2 with per-sample padding."""
    x = t.transformer_inputs(layout=layout, batch=2, pad=pad)
    stock, model = t.transformer(), lite_boost.boost(t.transformer())
    with torch.no_grad():
        assert _max(model(**x).sample, stock(**x).sample) <= TOL
        refs = [stock(**kw).sample for kw in t.kv_calls(x, stock)]
        gots = [model(**kw).sample for kw in t.kv_calls(x, model)]
    assert [g.shape[1] for g in gots] == [x["img_mask"].shape[1] + 3 * x["hidden_states"].shape[1] // 4, 12]
    assert all(_max(g, r) <= TOL for g, r in zip(gots, refs))


def test_prefix_rows_never_see_the_target():
    """The block-causal mask: changing the target's latents changes no prefix row (text, condition images)."""
    x = t.transformer_inputs(layout="two_conditions_adjacent", pad=[1])
    model = lite_boost.boost(t.transformer())
    y = dict(x, hidden_states=x["hidden_states"].clone())
    y["hidden_states"][:, -12:] += 1.0  # the target's 2 x 6 tokens
    with torch.no_grad():
        a, b = model(**x).sample, model(**y).sample
    n = a.shape[1] - 12
    assert torch.equal(a[:, :n], b[:, :n]) and _max(a[:, n:], b[:, n:]) > 1e-2


def test_rope_tables_are_the_models_own_and_the_target_rows_follow_the_rank():
    from lite_boost.ops.rope import phasors_from_complex

    model = lite_boost.boost(t.transformer())
    state, rope = model._lite_boost, model.pos_embed
    x = t.transformer_inputs(layout="one_condition")
    img_shapes = x["img_shapes"][0]
    pad = torch.repeat_interleave(x["img_mask"][0], torch.where(x["img_mask"][0], 4, 1))
    stock = type(rope).forward(rope, img_shapes, pad, device=torch.device("cpu"))
    table = rope(img_shapes, pad, device=torch.device("cpu"))
    assert torch.equal(table, stock) and table.dtype == torch.complex64
    assert rope(img_shapes, pad, device=torch.device("cpu")) is table  # cached
    head = pad.shape[0] - 12
    state.rope_range = lambda n: (8, 16)  # rank 1 of 2 of a 12-token target: 4 real rows, 4 identity rows
    served = rope(img_shapes, pad, device=torch.device("cpu"))
    assert torch.equal(served[:head], stock[:head])
    assert torch.equal(served[head:], phasors_from_complex(stock[head:], 8, 16).freqs[0, :, 0])
    assert torch.equal(served[head + 4:], torch.ones(4, stock.shape[1], dtype=torch.complex64))


def test_sparsity_zero_equals_stock_and_sparse_keeps_the_prefix_dense():
    x = t.transformer_inputs(layout="one_condition", target=(8, 12), pad=[2])
    with torch.no_grad():
        ref = t.transformer()(**x).sample
        cfg = dict(sparse_type="rf_v2", block_size=4, backend="gather", keep_sink=False)
        dense = lite_boost.boost(t.transformer(), BoostConfig(sparse=SparseConfig(sparsity=0.0, **cfg)))
        assert _max(dense(**x).sample, ref) <= TOL
        sparse = lite_boost.boost(t.transformer(), BoostConfig(sparse=SparseConfig(sparsity=0.75, **cfg)))
        got = sparse(**x).sample
    state = sparse._lite_boost.extras["sparse"]
    assert state.grid == (1, 8, 12) and {e.path for e in state.events} == {"sparse"}
    assert state.mean_effective_sparsity() > 0.3
    n = ref.shape[1] - 96
    assert _max(got[:, :n], ref[:, :n]) <= TOL  # text and condition-image rows: block-causal, dense
    assert torch.isfinite(got).all() and _max(got[:, n:], ref[:, n:]) > 1e-3  # the target skipped blocks


def test_family_is_registered_with_its_features():
    from lite_boost.models import SUPPORTED_MODELS
    from lite_boost.registry import family_of

    assert SUPPORTED_MODELS["QwenImage21Pipeline"] is QWEN_IMAGE_21.boost_pipeline
    assert SUPPORTED_MODELS["QwenImage21Transformer2DModel"] is QWEN_IMAGE_21.boost_transformer
    assert family_of(t.pipeline()) is QWEN_IMAGE_21
    features = QWEN_IMAGE_21.features
    for f in ("dense", "sparse", "sequence_parallel", "cfg_parallel", "compile", "quant", "parallel_vae"):
        assert features[f] is None, f
    assert "QwenImage21TransformerBlock" in features["step_cache"]


@torch.no_grad()
def test_lora_loaded_after_boost_equals_stock():
    """A LoRA on every attention projection and the SwiGLU, loaded after boosting, equals stock with the same (the
    processor reuses the module's projections); unboost, a second adapter, re-boost: still equal."""
    import copy

    from _lora import lora_state_dict

    x = t.transformer_inputs(layout="one_condition", pad=[2])
    stock = t.transformer()
    model = lite_boost.boost(copy.deepcopy(stock))
    base = stock(**x).sample
    targets = ["to_q", "to_k", "to_v", "to_out.0", "img_mlp.proj"]
    for m in (stock, model):
        m.load_lora_adapter(lora_state_dict(stock, 8, targets=targets, prefix=None), adapter_name="a", prefix=None)
    ref = stock(**x).sample
    assert _max(ref, base) > 1e-4 and _max(model(**x).sample, ref) <= TOL
    lite_boost.unboost(model)
    for m in (stock, model):
        m.load_lora_adapter(lora_state_dict(stock, 9, targets=["to_q", "to_v"], prefix=None), adapter_name="b",
                            prefix=None)
        m.set_adapters(["a", "b"], weights=[0.5, 1.0])
    lite_boost.boost(model, {"rope_cache_size": 4})
    ref2 = stock(**x).sample
    assert _max(ref2, ref) > 1e-4 and _max(model(**x).sample, ref2) <= TOL


def test_int8_weight_only_quantizes_the_blocks_and_stays_close():
    x = t.transformer_inputs(layout="one_condition")
    model = lite_boost.boost(t.transformer(), {"quant": "int8_weight_only"})
    with torch.no_grad():
        ref, got = t.transformer()(**x).sample, model(**x).sample
    assert "quant" in model._lite_boost.extras and 0 < ((got - ref).norm() / ref.norm()).item() < 0.01


def test_generate_runs_the_tiny_built_in_pipeline(tmp_path, capsys):
    """``lite-boost generate --family qwen-image-2.1``: the record's tiny pipeline, random prompt embeddings,
    CFG, boosted = stock."""
    import re

    from lite_boost.cli import main

    assert main(["generate", "--family", "qwen-image-2.1", "--steps", "2", "--height", "64", "--width", "96",
                 "--guidance-scale", "4", "--warmup", "0", "--output", str(tmp_path / "img.png")]) == 0
    out = capsys.readouterr().out
    assert "tiny built-in QwenImage21Pipeline (the qwen-image-2.1 family), 64x96, 2 steps" in out
    assert "4 x 6 = 24 image tokens after 12 / 7 text tokens (cond / uncond" in out
    assert float(re.search(r"max \|boosted - stock\| over the image \(values in \[0, 1\]\): (\S+)", out).group(1)) <= TOL
    assert "- RoPE tables: cached" in out


def test_step_cache_is_refused_with_the_reason_before_anything_changes():
    pipe = t.pipeline()
    for method in ("first_block_cache", "taylorseer_cache", "pyramid_attention_broadcast"):
        with pytest.raises(ConfigError, match=r"cache .* not supported for the qwen-image-2.1 family \(no diffusers "
                                              r"step-cache hook fits: First-Block Cache and MagCache"):
            lite_boost.boost(pipe, {"cache": method})
    assert not lite_boost.api.is_boosted(pipe)


@pytest.mark.parametrize("kv", [True, False])
def test_boosted_modular_pipeline_matches_stock(kv):
    """QwenImage21ModularPipeline (denoise and decode blocks, ClassifierFreeGuidance guider) with cond / uncond texts
    of different lengths: boosted = stock, unboost gives stock back."""
    stock = t.run(t.modular_pipeline(), t.modular_kwargs(kv=kv))
    pipe = lite_boost.boost(t.modular_pipeline())
    assert {type(p) for p in pipe.transformer.attn_processors.values()} == {QwenImage21Processor}
    got = t.run(pipe, t.modular_kwargs(kv=kv))
    assert stock.abs().max() > 0.1 and _max(got, stock) <= TOL
    lite_boost.unboost(pipe)
    assert torch.equal(t.run(pipe, t.modular_kwargs(kv=kv)), stock)


def test_cfg_plans_of_the_two_pipeline_kinds():
    plan = QWEN_IMAGE_21.pipeline
    assert plan.cfg_for(t.pipeline()).kind == "separate"
    modular = plan.cfg_for(t.modular_pipeline())
    assert (modular.kind, modular.cond, modular.uncond) == ("guider", "pred_cond", "pred_uncond")


@torch.no_grad()
@pytest.mark.parametrize("kind", ["sparse", "cached"])
def test_explain_adds_no_graph_break_on_the_sparse_and_cached_paths(kind, fresh_dynamo):
    """Stock's forward breaks where it reads tensors (its RoPE and prefix layout); the boosted sparse path and the
    target-only cached step add none."""
    x = t.transformer_inputs(layout="one_condition", target=(8, 12), pad=[2])
    config = BoostConfig(sparse=SparseConfig(sparsity=0.75, sparse_type="rf_v2", block_size=4, backend="gather",
                                             keep_sink=False)) if kind == "sparse" else None

    def call(model):
        if kind == "sparse":
            return x
        calls = t.kv_calls(x, model)
        model(**calls[0])  # eager extract, then the cached step is explained
        return calls[1]

    stock_model = t.transformer()
    stock = torch._dynamo.explain(stock_model)(**call(stock_model))
    torch._dynamo.reset()
    model = lite_boost.boost(t.transformer(), config)
    boosted = torch._dynamo.explain(model)(**call(model))
    assert boosted.graph_break_count <= stock.graph_break_count, [r.reason for r in boosted.break_reasons]
