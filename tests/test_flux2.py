"""Boosted Flux.2 pipelines and transformers against stock diffusers, one process.

fp32, 3 heads, odd token grids (3 x 5), 7 text tokens, tiny in-memory pipelines without text encoders
(prompt embeddings passed in); two dual-stream and two single-stream blocks. Flux.2 [klein] runs CFG as
two calls; Flux.2 [dev] is guidance-distilled. The family contract (parity, unboost, save / load, bf16,
graph breaks, regional compile) is its row in test_family_contract.py.
"""

import pytest
import torch

import _tiny_flux2 as t2
import lite_boost
from lite_boost.config import BoostConfig, ConfigError, SparseConfig
from lite_boost.models.flux2 import FLUX2, Flux2AttnProcessor, Flux2SingleAttnProcessor

TOL = 1e-5
SPEC = t2.TinyFlux2Spec()


def _images(pipe, kind, **kw):
    return pipe(**t2.call_kwargs(kind, **kw)).images


@pytest.mark.parametrize("kind", list(t2.PIPELINES))
def test_boosted_pipeline_matches_stock(kind):
    pipe = t2.pipeline(kind)
    kw = dict(text=9) if kind == "klein" else {}
    stock = _images(pipe, kind, **kw)
    assert lite_boost.boost(pipe) is pipe
    got = _images(pipe, kind, **kw)
    assert stock.abs().max() > 0.1 and (got - stock).abs().max().item() <= TOL
    state = pipe.transformer._lite_boost
    assert state.rope_patched and state.rope_cache.hits >= 1 and state.call is None
    assert {type(p) for p in pipe.transformer.attn_processors.values()} == {Flux2AttnProcessor, Flux2SingleAttnProcessor}
    assert sorted(p.layer_idx for p in state.processors.values()) == list(range(SPEC.layers + SPEC.single_layers))
    lite_boost.unboost(pipe)
    assert torch.equal(_images(pipe, kind, **kw), stock)


@pytest.mark.parametrize("text_ids", ["pipeline", "random"])
def test_transformer_matches_stock_with_a_reference_image_and_positional_args(text_ids):
    spec = t2.TinyFlux2Spec(guidance_embeds=True)
    x = t2.transformer_inputs(spec, batch=2, text=9, text_ids=text_ids, reference=(4, 6))
    stock, model = t2.transformer(spec), lite_boost.boost(t2.transformer(spec))
    args = [x[k] for k in ("hidden_states", "encoder_hidden_states", "timestep", "img_ids", "txt_ids", "guidance")]
    with torch.no_grad():
        ref = stock(**x).sample
        got, again, positional = model(**x).sample, model(**x).sample, model(*args).sample
    assert (got - ref).abs().max().item() <= TOL and torch.equal(got, again) and torch.equal(got, positional)
    assert model._lite_boost.rope_cache.hits >= 2  # the second call's text and image tables


def test_rope_tables_are_the_models_own_and_the_image_rows_follow_the_rank():
    from lite_boost.models.flux2 import Flux2Call

    model = lite_boost.boost(t2.transformer(SPEC))
    state, rope = model._lite_boost, model.pos_embed
    x = t2.transformer_inputs(SPEC, text_ids="random")
    txt, img = x["txt_ids"][0], x["img_ids"][0]
    cos, sin = type(rope).forward(rope, img)
    state.call = Flux2Call(x["txt_ids"], x["img_ids"])
    state.rope_range = lambda n: (10, 20)  # a sequence-parallel slice past the end of the 15 image rows
    table, empty = rope(img)
    assert empty.shape[0] == 0 and torch.equal(table[:5], torch.complex(cos[10:, 0::2], sin[10:, 1::2]))
    assert (table[5:] == 1).all() and rope(txt)[0].shape[0] == 7  # the text stays whole
    state.call = None
    assert torch.equal(rope(img)[0], cos)  # outside a call: diffusers' own tables


def test_fused_projections_and_the_processors_outside_the_cached_form():
    stock, model = t2.transformer(SPEC), t2.transformer(SPEC)
    stock.fuse_qkv_projections()
    model.fuse_qkv_projections()
    lite_boost.boost(model)
    x = t2.transformer_inputs(SPEC)
    with torch.no_grad():
        assert (model(**x).sample - stock(**x).sample).abs().max().item() <= TOL
        tables = stock.pos_embed(torch.cat([x["txt_ids"][0], x["img_ids"][0]]))  # diffusers' (cos, sin) form
        hidden = torch.randn(1, 22, 48)
        mine, ref = model.single_transformer_blocks[0].attn, stock.single_transformer_blocks[0].attn
        assert (mine(hidden, image_rotary_emb=tables) - ref(hidden, image_rotary_emb=tables)).abs().max() <= TOL
        mine.processor.attn_fn = lambda q, k, v, joint=None: None  # any wrapper (Ulysses, sparse)
        with pytest.raises(ValueError, match="single-stream block needs num_txt_tokens"):
            mine(hidden, image_rotary_emb=tables)
        with pytest.raises(ValueError, match="does not accept attention_mask"):
            model.transformer_blocks[0].attn(hidden[:, 7:], hidden[:, :7], attention_mask=torch.ones(1, 22))


def test_reference_kv_caching_runs_diffusers_processors_on_one_process_and_is_refused_otherwise():
    x = t2.transformer_inputs(SPEC, reference=(2, 3))
    kw = dict(kv_cache_mode="extract", num_ref_tokens=6, ref_fixed_timestep=0.0, return_dict=False)
    from diffusers.models.transformers.transformer_flux2 import (Flux2KVAttnProcessor,
                                                                 Flux2KVParallelSelfAttnProcessor)

    stock, model = t2.transformer(SPEC), lite_boost.boost(t2.transformer(SPEC))
    for block in stock.transformer_blocks:  # what Flux2KleinKVPipeline does to the stock model
        block.attn.set_processor(Flux2KVAttnProcessor())
    for block in stock.single_transformer_blocks:
        block.attn.set_processor(Flux2KVParallelSelfAttnProcessor())
    with torch.no_grad():
        (ref, ref_cache), (got, cache) = stock(**x, **kw), model(**x, **kw)
        assert (got - ref).abs().max().item() <= TOL
        assert torch.equal(cache.get_single(1).k_ref, ref_cache.get_single(1).k_ref)
        lite_boost.boost(model, BoostConfig(sparse=SparseConfig(sparsity=0.0, block_size=4, backend="gather")))
        with pytest.raises(ValueError, match="kv_cache_mode='extract'.*one process with dense attention"):
            model(**x, **kw)


def _kv_processors(model):
    """What Flux2KleinKVPipeline._set_kv_attn_processors does: diffusers' KV processors, block by block."""
    from diffusers.models.transformers.transformer_flux2 import (Flux2KVAttnProcessor,
                                                                 Flux2KVParallelSelfAttnProcessor)

    for block in model.transformer_blocks:
        block.attn.set_processor(Flux2KVAttnProcessor())
    for block in model.single_transformer_blocks:
        block.attn.set_processor(Flux2KVParallelSelfAttnProcessor())


@torch.no_grad()
def test_per_block_kv_processors_set_after_boosting_equal_stock():
    """Flux2KleinKVPipeline sets diffusers' KV processors block by block (attn.set_processor) on the transformer
    it is given: on a boosted one they get diffusers' own RoPE tables, and extract / cached calls equal stock's;
    diffusers' processors on only some blocks (the rest lite_boost's) too. Boosted without the swap, kv_cache_mode
    runs too (lite_boost's processors hand such calls to diffusers' KV processors)."""
    from diffusers.models.transformers.transformer_flux2 import Flux2KVAttnProcessor

    x = t2.transformer_inputs(SPEC, reference=(2, 3))
    kw = dict(kv_cache_mode="extract", num_ref_tokens=6, ref_fixed_timestep=0.0, return_dict=False)
    stock = t2.transformer(SPEC)
    plain = stock(**x, return_dict=False)[0]
    _kv_processors(stock)
    ref, ref_cache = stock(**x, **kw)
    cached_ref = stock(**x, kv_cache=ref_cache, kv_cache_mode="cached", num_ref_tokens=6, return_dict=False)[0]
    model = lite_boost.boost(t2.transformer(SPEC))
    model.transformer_blocks[0].attn.set_processor(Flux2KVAttnProcessor())  # one block diffusers', the rest ours
    assert (model(**x, return_dict=False)[0] - plain).abs().max().item() <= TOL
    _kv_processors(model)
    got, cache = model(**x, **kw)
    assert (got - ref).abs().max().item() <= TOL
    assert torch.equal(cache.get_single(1).k_ref, ref_cache.get_single(1).k_ref)
    cached = model(**x, kv_cache=cache, kv_cache_mode="cached", num_ref_tokens=6, return_dict=False)[0]
    assert (cached - cached_ref).abs().max().item() <= TOL


def test_sparsity_zero_equals_stock_and_sparse_uses_the_image_grid():
    pipe = t2.pipeline("klein")
    kw = dict(height=16, width=32)  # 8 x 16 = 128 image tokens, 32 blocks of 4
    stock = _images(pipe, "klein", **kw)
    base = dict(block_size=4, backend="gather")
    lite_boost.boost(pipe, BoostConfig(sparse=SparseConfig(sparsity=0.0, **base)))
    assert (_images(pipe, "klein", **kw) - stock).abs().max().item() <= TOL
    lite_boost.boost(pipe, BoostConfig(sparse=SparseConfig(sparsity=0.75, **base)))
    sparse = _images(pipe, "klein", **kw)
    st = pipe.transformer._lite_boost.extras["sparse"]
    assert {e.path for e in st.events} == {"sparse"} and st.grid == (1, 8, 16)
    assert {e.layer for e in st.events} == set(range(SPEC.layers + SPEC.single_layers))
    assert (sparse - stock).abs().max() > 1e-4 and torch.isfinite(sparse).all()
    with torch.no_grad():  # target + reference of one size: two images; of different sizes: dense
        pipe.transformer(**t2.transformer_inputs(SPEC, grid=(4, 8), reference=(4, 8)))
        assert st.grid == (2, 4, 8)
        pipe.transformer(**t2.transformer_inputs(SPEC, grid=(4, 8), reference=(2, 3)))
        assert st.grid is None


CACHES = {"mag_cache": {"mag_ratios": [1.0, 0.99, 0.98, 0.97], "num_inference_steps": 4, "threshold": 0.5,
                        "max_skip_steps": 2},
          "taylorseer_cache": {"cache_interval": 2, "disable_cache_before_step": 1}}


@pytest.mark.parametrize("method", sorted(CACHES))
def test_step_cache_equals_the_stock_diffusers_hook(method):
    from lite_boost.cache import build_diffusers_config

    stock_pipe = t2.pipeline("klein")
    plain = _images(stock_pipe, "klein", steps=4)
    stock_pipe.transformer.enable_cache(build_diffusers_config(
        method, CACHES[method], current_timestep_callback=lambda: float(stock_pipe.current_timestep)))
    stock = _images(stock_pipe, "klein", steps=4)
    pipe = lite_boost.boost(t2.pipeline("klein"), {"cache": {"method": method, **CACHES[method]}})
    got = _images(pipe, "klein", steps=4)
    assert (got - stock).abs().max().item() <= TOL and (stock - plain).abs().max() > 1e-5
    assert torch.equal(_images(pipe, "klein", steps=4), got)  # fresh cache state per pipeline call


def test_refusals_name_the_reason():
    from lite_boost.parallel import ParallelManager

    dev = t2.pipeline("dev")
    with pytest.raises(ConfigError, match=r"not supported for Flux2Pipeline \(it calls the transformer without "
                                          r"cache_context"):
        lite_boost.boost(dev, {"cache": "taylorseer_cache"})
    with pytest.raises(ConfigError, match=r"first_block_cache.*stock diffusers fails"):
        lite_boost.boost(t2.pipeline("klein"), {"cache": "first_block_cache"})
    with pytest.raises(ConfigError, match=r"cfg_degree=2 needs a pipeline that runs classifier-free guidance; "
                                          r"Flux2Pipeline is not one"):
        ParallelManager(dev, {"parallel": {"cfg_degree": 2}})
    assert not lite_boost.api.is_boosted(dev)
    assert FLUX2.features["sparse"] is None and FLUX2.features["cfg_parallel"] is None


def test_explain_reports_no_graph_break_on_the_sparse_path(fresh_dynamo):
    model = lite_boost.boost(t2.transformer(SPEC), BoostConfig(sparse=SparseConfig(sparsity=0.75, block_size=4,
                                                                                   backend="gather")))
    with torch.no_grad():
        report = torch._dynamo.explain(model)(**t2.transformer_inputs(SPEC, grid=(4, 8)))
    assert report.graph_break_count == 0 and report.graph_count == 1, [r.reason for r in report.break_reasons]


def test_int8_weight_only_quantizes_the_blocks_and_stays_close():
    x = t2.transformer_inputs(SPEC)
    model = lite_boost.boost(t2.transformer(SPEC), {"quant": "int8_weight_only"})
    with torch.no_grad():
        ref, got = t2.transformer(SPEC)(**x).sample, model(**x).sample
    assert "quant" in model._lite_boost.extras and 0 < ((got - ref).norm() / ref.norm()).item() < 0.01


def test_generate_runs_a_saved_pipeline_without_a_text_encoder(tmp_path, capsys):
    """``lite-boost generate --model PATH``: prompt embeddings from the family's tiny record, no negative_prompt
    argument (Flux.2's pipelines take none), boosted = stock; under inference mode the RoPE cache serves."""
    import re

    from lite_boost.cli import main

    t2.pipeline("klein").save_pretrained(tmp_path / "klein")
    assert main(["generate", "--model", str(tmp_path / "klein"), "--height", "16", "--width", "16", "--steps", "2",
                 "--warmup", "0", "--output", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert float(re.search(r"max \|boosted - stock\| over the image \(values in \[0, 1\]\): (\S+)", out).group(1)) <= TOL
    hits = int(re.search(r"RoPE tables: cached, (\d+) hits", out).group(1))
    assert hits >= 4, out
