"""Boosted Flux.1 pipelines and transformers against stock diffusers, one process.

fp32, true CFG (negative prompt, true_cfg_scale > 1: separate cond / uncond calls), 3 heads, odd token
grids (3 x 5), 7 text tokens, tiny in-memory pipelines without text encoders (prompt embeddings passed
in); two dual-stream and two single-stream blocks.
"""

import warnings

import pytest
import torch

import _tiny_flux as tf
import lite_boost
from lite_boost.config import BoostConfig, ConfigError, SparseConfig
from lite_boost.models.flux import FLUX, CachedFluxRope, FluxAttnProcessor, FluxRope
from lite_boost.ops.rope import RotaryEmbedding
from conftest import check_regional_compile

TOL = 1e-5
SPEC = tf.TinyFluxSpec(heads=3)
KINDS = list(tf.PIPELINES)


def _images(pipe, kind, **kw):
    return pipe(**tf.call_kwargs(kind, **kw)).images


def _stock_tables(model, inputs):
    ids = torch.cat([inputs["txt_ids"], inputs["img_ids"]])
    return type(model.pos_embed).forward(model.pos_embed, ids)


@pytest.mark.parametrize("kind", KINDS)
def test_boosted_pipeline_matches_stock(kind):
    pipe = tf.pipeline(kind)
    stock = _images(pipe, kind)
    assert lite_boost.boost(pipe) is pipe
    got = _images(pipe, kind)
    assert stock.abs().max() > 0.1 and got.shape == stock.shape
    assert (got - stock).abs().max().item() <= TOL
    state = pipe.transformer._lite_boost
    assert state.rope_patched and state.rope_cache.hits >= 1 and state.call is None
    assert all(isinstance(p, FluxAttnProcessor) for p in pipe.transformer.attn_processors.values())
    assert sorted(p.layer_idx for p in state.processors.values()) == list(range(SPEC.layers + SPEC.single_layers))
    lite_boost.unboost(pipe)
    assert (_images(pipe, kind) - stock).abs().max().item() == 0.0


def test_true_cfg_decoded_image_matches_stock():
    pipe = tf.pipeline("t2i")
    stock = _images(pipe, "t2i", output_type="pt", steps=1)
    lite_boost.boost(pipe)
    assert (_images(pipe, "t2i", output_type="pt", steps=1) - stock).abs().max().item() <= TOL


@pytest.mark.parametrize("text_ids", ["zeros", "random"])
@pytest.mark.parametrize("reference", [None, (4, 6)])
def test_transformer_matches_stock_with_rotated_text_and_a_reference_image(text_ids, reference):
    """diffusers' model-test layout (random text ids: the text is rotated too), and Kontext's reference tokens."""
    spec = tf.TinyFluxSpec(heads=3, guidance_embeds=True)
    inputs = tf.transformer_inputs(spec, batch=2, grid=(3, 5), text=9, text_ids=text_ids, reference=reference)
    stock = tf.transformer(spec)
    model = lite_boost.boost(tf.transformer(spec))
    with torch.no_grad():
        ref, got = stock(**inputs).sample, model(**inputs).sample
        again = model(**inputs).sample  # served from the cache
    assert (got - ref).abs().max().item() <= TOL and torch.equal(got, again)
    assert model._lite_boost.rope_cache.hits == 1


def test_rope_tables_are_the_models_own_in_cached_form():
    model = lite_boost.boost(tf.transformer(SPEC))
    state = model._lite_boost
    inputs = tf.transformer_inputs(SPEC, text=6, text_ids="random")
    cos, sin = _stock_tables(model, inputs)
    ids = torch.cat([inputs["txt_ids"], inputs["img_ids"]])
    state.call = lite_boost.models.flux.FluxCall(inputs["txt_ids"], inputs["img_ids"])
    rope = model.pos_embed(ids)
    assert isinstance(rope, FluxRope) and isinstance(rope.text, RotaryEmbedding)
    phasors = torch.complex(cos[:, 0::2], sin[:, 1::2])
    assert torch.equal(rope.text.freqs[0, :, 0], phasors[:6]) and torch.equal(rope.image.freqs[0, :, 0], phasors[6:])
    # a sequence-parallel slice of the image rows past the end gets identity rows; the text stays whole
    state.rope_range = lambda n: (10, 20)
    part = model.pos_embed(ids)
    assert part.text.freqs.shape[1] == 6 and torch.equal(part.image.freqs[0, :5, 0], phasors[16:])
    assert (part.image.freqs[0, 5:] == 1).all()
    state.rope_range = None
    # ids that are not the call's (or no call at all): diffusers' own tables
    state.call = None
    out = model.pos_embed(ids)
    assert isinstance(out, tuple) and not isinstance(out, FluxRope) and torch.equal(out[0], cos)


def test_changed_ids_are_never_served_stale_tables():
    """The cache keys on the caller's id tensors (identity and version): an in-place edit rebuilds."""
    stock, model = tf.transformer(SPEC), lite_boost.boost(tf.transformer(SPEC))
    inputs = tf.transformer_inputs(SPEC)
    with torch.no_grad():
        model(**inputs)
        inputs["img_ids"][:, 2] += 1.0  # in place: same tensor, new contents
        assert (model(**inputs).sample - stock(**inputs).sample).abs().max().item() <= TOL
        with torch.inference_mode():  # inference tensors have no version counter: keyed by their contents
            ids = inputs["img_ids"].clone()
            first = model(**{**inputs, "img_ids": ids}).sample
            ids[:, 1] += 2.0
            second = model(**{**inputs, "img_ids": ids}).sample
            ref = stock(**{**inputs, "img_ids": ids}).sample
    assert (second - ref).abs().max().item() <= TOL and (second - first).abs().max().item() > 1e-3


def test_fused_projections_match_stock():
    stock, model = tf.transformer(SPEC), tf.transformer(SPEC)
    stock.fuse_qkv_projections()
    model.fuse_qkv_projections()
    lite_boost.boost(model)
    assert model.transformer_blocks[0].attn.fused_projections
    inputs = tf.transformer_inputs(SPEC)
    with torch.no_grad():
        assert (model(**inputs).sample - stock(**inputs).sample).abs().max().item() <= TOL


def test_processor_contract_outside_the_cached_form():
    """A block called with diffusers' (cos, sin) tables works densely; a wrapped attn_fn needs the text length."""
    model = lite_boost.boost(tf.transformer(SPEC))
    stock = tf.transformer(SPEC)
    inputs = tf.transformer_inputs(SPEC)
    tables = _stock_tables(stock, inputs)
    g = torch.Generator().manual_seed(3)
    hidden, text, temb = torch.randn(1, 15, 48, generator=g), torch.randn(1, 7, 48, generator=g), torch.randn(1, 48)
    with torch.no_grad():
        for blocks in ("transformer_blocks", "single_transformer_blocks"):
            mine, ref = getattr(model, blocks)[0], getattr(stock, blocks)[0]
            out, want = mine(hidden, text, temb, tables), ref(hidden, text, temb, tables)
            assert all((a - b).abs().max().item() <= TOL for a, b in zip(out, want))
        proc = model.single_transformer_blocks[0].attn.processor
        proc.attn_fn = lambda q, k, v, joint=None: None  # any wrapper (Ulysses, sparse)
        with pytest.raises(ValueError, match="single-stream block needs lite_boost's cached RoPE"):
            model.single_transformer_blocks[0](hidden, text, temb, tables)
        with pytest.raises(ValueError, match="does not accept attention_mask"):
            model.transformer_blocks[0].attn(hidden, text, attention_mask=torch.ones(1, 22))


def test_ip_adapter_processor_sends_the_model_to_the_generic_path_and_is_kept():
    """The family shim has no IP-Adapter branch: a model holding diffusers' IP-Adapter processor is boosted on the
    generic path, that processor (and its weights) kept; parity with an IP-Adapter is in test_loaders.py."""
    from diffusers.models.transformers.transformer_flux import FluxIPAdapterAttnProcessor

    model = tf.transformer(SPEC)
    proc = FluxIPAdapterAttnProcessor(48, 32)
    model.transformer_blocks[0].attn.set_processor(proc)
    lite_boost.boost(model)
    assert model._lite_boost.family.name == "generic"
    assert model.transformer_blocks[0].attn.processor is proc
    lite_boost.unboost(model)
    assert not hasattr(model, "_lite_boost") and model.transformer_blocks[0].attn.processor is proc


# --------------------------------------------------------------------------------------------- sparse
SPARSE = dict(height=32, width=64)  # 8 x 16 = 128 image tokens, 32 blocks of 4


def test_sparsity_zero_equals_stock_and_sparse_keeps_text_dense():
    pipe = tf.pipeline("t2i")
    stock = _images(pipe, "t2i", **SPARSE)
    base = dict(block_size=4, backend="gather")
    lite_boost.boost(pipe, BoostConfig(sparse=SparseConfig(sparsity=0.0, **base)))
    zero = _images(pipe, "t2i", **SPARSE)
    assert (zero - stock).abs().max().item() <= TOL
    lite_boost.boost(pipe, BoostConfig(sparse=SparseConfig(sparsity=0.75, **base)))
    sparse = _images(pipe, "t2i", **SPARSE)
    st = pipe.transformer._lite_boost.extras["sparse"]
    assert {e.path for e in st.events} == {"sparse"} and st.grid == (1, 8, 16)
    assert {e.layer for e in st.events} == set(range(SPEC.layers + SPEC.single_layers))  # dual and single blocks
    assert 0.3 < st.mean_effective_sparsity() < 0.75  # text rows / columns forced dense
    assert (sparse - stock).abs().max() > 1e-4 and torch.isfinite(sparse).all()


def test_sparse_grid_comes_from_the_image_ids():
    pipe = tf.pipeline("kontext")
    lite_boost.boost(pipe, BoostConfig(sparse=SparseConfig(sparsity=0.75, block_size=4, backend="gather",
                                                           keep_sink=False)))
    st = pipe.transformer._lite_boost.extras["sparse"]
    _images(pipe, "kontext", height=16, width=32, reference=(16, 32))  # a reference of the output's size
    assert st.grid == (2, 4, 8) and {e.path for e in st.events} == {"sparse"}
    _images(pipe, "kontext")  # 3 x 5 target with a 4 x 6 reference: no common grid, dense
    assert st.grid is None and {e.path for e in st.events} == {"dense"}
    model = pipe.transformer
    with torch.no_grad():
        model(**tf.transformer_inputs(spec=SPEC, grid=(4, 8)))
        assert st.grid == (1, 4, 8)
        inputs = tf.transformer_inputs(spec=SPEC, grid=(4, 8))
        inputs["img_ids"] = torch.randn(32, 3)  # not a raster (diffusers' model tests): dense
        model(**inputs)
        assert st.grid is None


# --------------------------------------------------------------------------------------------- caching
CACHES = {
    "first_block_cache": {"threshold": 0.5},
    "taylorseer_cache": {"cache_interval": 2, "disable_cache_before_step": 1},
    "mag_cache": {"mag_ratios": [1.0, 0.99, 0.98, 0.97], "num_inference_steps": 4, "threshold": 0.5,
                  "max_skip_steps": 2},
    "pyramid_attention_broadcast": {"spatial_attention_block_skip_range": 2,
                                    "spatial_attention_timestep_skip_range": (0, 1000)},
}


@pytest.mark.parametrize("method", sorted(CACHES))
def test_step_cache_equals_the_stock_diffusers_hook(method):
    from lite_boost.cache import build_diffusers_config, count_block_work

    kw = dict(steps=4)
    stock_pipe = tf.pipeline("t2i")
    plain = _images(stock_pipe, "t2i", **kw)
    dcfg = build_diffusers_config(method, CACHES[method],
                                  current_timestep_callback=lambda: float(stock_pipe.current_timestep))
    stock_pipe.transformer.enable_cache(dcfg)
    stock = _images(stock_pipe, "t2i", **kw)
    pipe = lite_boost.boost(tf.pipeline("t2i"), {"cache": {"method": method, **CACHES[method]}})
    with count_block_work([pipe.transformer], blocks="single_transformer_blocks", ffn="proj_mlp", attn="attn") as work:
        got = _images(pipe, "t2i", **kw)
    assert (got - stock).abs().max().item() <= TOL
    assert (stock - plain).abs().max() > 1e-5  # the cache really skipped work ...
    assert work.ffn_runs < work.calls or work.attn_runs < work.calls * 2, work.summary()  # ... here too
    assert (_images(pipe, "t2i", **kw) - got).abs().max().item() == 0.0  # fresh cache state per pipeline call


def test_cache_refusals_name_the_reason():
    with pytest.raises(ConfigError, match=r"sea_cache' is not supported for FluxPipeline \(diffusers' SeaCache"):
        lite_boost.boost(tf.pipeline("t2i"), {"cache": "sea_cache"})
    with pytest.raises(ConfigError, match=r"'faster_cache'|accepted methods"):
        lite_boost.boost(tf.pipeline("t2i"), {"cache": "faster_cache"})
    kontext = tf.pipeline("kontext")
    with pytest.raises(ConfigError, match=r"not supported for FluxKontextPipeline \(it calls the transformer without "
                                          r"cache_context.*with step caching: \['FluxPipeline'\]"):
        lite_boost.boost(kontext, {"cache": "first_block_cache"})
    assert not lite_boost.api.is_boosted(kontext)


def test_cfg_parallel_is_refused_for_the_guidance_distilled_pipelines():
    from lite_boost.parallel import ParallelManager

    for kind in ("control", "fill"):
        with pytest.raises(ConfigError, match=r"cfg_degree=2 needs a pipeline that runs classifier-free guidance; "
                                              r"Flux(Control|Fill)Pipeline is not one"):
            ParallelManager(tf.pipeline(kind), {"parallel": {"cfg_degree": 2}})


# --------------------------------------------------------------------------------------------- compile
@pytest.fixture
def _fresh_dynamo():
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
    torch._dynamo.reset()


@pytest.mark.parametrize("kind", ["sparse", "kontext"])  # stock, dense (random text ids): test_family_contract.py
def test_explain_reports_no_graph_break(kind, _fresh_dynamo):
    model = tf.transformer(SPEC)
    if kind != "stock":
        lite_boost.boost(model, BoostConfig(sparse=SparseConfig(sparsity=0.75, block_size=4, backend="gather"))
                         if kind == "sparse" else None)
    inputs = tf.transformer_inputs(SPEC, grid=(4, 8), text_ids="random" if kind == "random_text_ids" else "zeros",
                                   reference=(4, 8) if kind == "kontext" else None)
    with torch.no_grad():
        report = torch._dynamo.explain(model)(**inputs)
    reasons = [r.reason.splitlines()[0] for r in report.break_reasons]
    assert report.graph_break_count == 0 and report.graph_count == 1, reasons


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sparse"])  # dense: tests/test_family_contract.py
def test_compile_repeated_blocks_fullgraph_matches_eager(kind, _fresh_dynamo):
    """diffusers' regional compile recipe with inductor on a boosted transformer, two steps."""
    model = tf.transformer(SPEC)
    config = BoostConfig(sparse=SparseConfig(sparsity=0.75, block_size=4, backend="gather")) if kind == "sparse" else None
    lite_boost.boost(model, config)
    inputs = tf.transformer_inputs(SPEC, grid=(4, 8))
    steps = [torch.tensor([0.9]), torch.tensor([0.6])]
    check_regional_compile(model, inputs, steps, sparse=kind == "sparse")


# --------------------------------------------------------------------------------------------- registry
def test_family_is_registered_with_its_features():
    from lite_boost.models import SUPPORTED_MODELS
    from lite_boost.registry import family_of

    for name in FLUX.pipelines:
        assert SUPPORTED_MODELS[name] is FLUX.boost_pipeline
    assert SUPPORTED_MODELS["FluxTransformer2DModel"] is FLUX.boost_transformer
    assert family_of(tf.pipeline("kontext")) is FLUX
    features = FLUX.features
    assert all(features[f] is None for f in ("dense", "sparse", "sequence_parallel", "cfg_parallel", "step_cache",
                                             "compile", "quant", "parallel_vae"))
    assert FLUX.quant_patterns == ("transformer_blocks.*", "single_transformer_blocks.*")
    assert isinstance(tf.pipeline("t2i").transformer.pos_embed, torch.nn.Module)
    assert CachedFluxRope.__module__ == "lite_boost.models.flux"


def test_lite_boost_models_lists_the_family(capsys):
    from lite_boost.cli import main

    assert main(["models"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("| flux |"))
    assert "FluxKontextPipeline" in row and "| text_first | separate |" in row
    assert row.count("| yes") == 8 and row.count("| no") == 0  # parallel_vae too (models/flux_vae.py)
