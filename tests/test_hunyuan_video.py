"""Boosted HunyuanVideo pipelines (T2V, I2V latent-concat, I2V token-replace) against stock diffusers, one process.

fp32, 3 heads, 5 x 2 x 4 = 40 video tokens through the pipelines and odd grids (3 x 3 x 5) in direct
transformer calls, text padded (11 of 16 cond tokens real, 7 uncond), true CFG on and off; tiny in-memory
pipelines without text encoders (prompt embeddings, pooled embeddings and masks passed in).
"""

import pytest
import torch

import _tiny_hunyuan as hy
import lite_boost
from lite_boost.config import BoostConfig, ConfigError, SparseConfig
from lite_boost.models.hunyuan_video import HUNYUAN_VIDEO, HunyuanVideoJointProcessor
from lite_boost.ops.rope import RotaryEmbedding
from conftest import check_regional_compile

TOL = 1e-5
KINDS = ["t2v", "latent_concat", "token_replace"]


def _latents(pipe, spec, **kw):
    return pipe(**hy.call_kwargs(spec, **kw)).frames


@pytest.mark.parametrize("kind", KINDS)
def test_boosted_pipeline_matches_stock(kind):
    spec = hy.HySpec(kind=kind)
    pipe = hy.hunyuan_pipeline(spec)
    stock = {cfg: _latents(pipe, spec, cfg=cfg) for cfg in (False, True)}
    decoded = kind == "t2v"  # one decoded run through the (untouched) VAE
    stock_pixels = _latents(pipe, spec, output_type="pt", steps=1) if decoded else None
    assert lite_boost.boost(pipe) is pipe
    for cfg in (False, True):
        got = _latents(pipe, spec, cfg=cfg)
        assert stock[cfg].abs().max() > 0.1 and got.shape == stock[cfg].shape
        assert (got - stock[cfg]).abs().max().item() <= TOL
    if decoded:
        assert (_latents(pipe, spec, output_type="pt", steps=1) - stock_pixels).abs().max().item() <= TOL
    state = pipe.transformer._lite_boost
    assert state.rope_patched and state.rope_cache.hits >= 1
    procs = pipe.transformer.attn_processors
    # every dual and single block attention, never the token refiner's
    assert {k for k, p in procs.items() if isinstance(p, HunyuanVideoJointProcessor)} == {
        "transformer_blocks.0.attn.processor", "single_transformer_blocks.0.attn.processor"}
    assert type(procs["context_embedder.token_refiner.refiner_blocks.0.attn.processor"]).__name__ == "AttnProcessor2_0"
    assert sorted(p.layer_idx for p in state.self_attention_processors) == [0, 1]  # single blocks continue
    lite_boost.unboost(pipe)
    assert (_latents(pipe, spec, cfg=True) - stock[True]).abs().max().item() == 0.0


@pytest.mark.parametrize("site", ["transformer_blocks", "single_transformer_blocks"])
def test_processor_matches_stock_attention_at_awkward_shapes(site):
    """One attention call, stock processor vs shim, with the model's own mask and RoPE: odd grid, padding."""
    from diffusers.models.transformers.transformer_hunyuan_video import HunyuanVideoAttnProcessor2_0

    spec = hy.HySpec(heads=3)
    model = hy.hunyuan_transformer(spec)
    attn = getattr(model, site)[0].attn
    g = torch.Generator().manual_seed(1)
    grid, text = (3, 3, 5), 12
    image = torch.randn(2, 45, 48, generator=g)
    txt = torch.randn(2, text, 48, generator=g)
    mask = torch.ones(2, 1, 1, 45 + text, dtype=torch.bool)
    mask[0, ..., 45 + 7:] = False  # sample 0: 7 real text tokens, sample 1: all 12
    latent = torch.zeros(2, spec.in_channels, *grid)
    rope = model.rope(latent)
    with torch.no_grad():
        ref_img, ref_txt = HunyuanVideoAttnProcessor2_0()(attn, image, txt, mask, rope)
        lite_boost.boost(model)
        got_img, got_txt = HunyuanVideoJointProcessor(0, "joint")(attn, image, txt, mask, model.rope(latent))
        unmasked, _ = HunyuanVideoJointProcessor(0, "joint")(attn, image, txt, None, model.rope(latent))
    assert (got_img - ref_img).abs().max() <= TOL and (got_txt - ref_txt).abs().max() <= TOL
    assert (unmasked - ref_img).abs().max() > 1e-3  # the padded text keys matter


def test_rope_tables_are_the_models_own_in_cached_form():
    model = hy.hunyuan_transformer()
    latent = torch.zeros(1, 4, 3, 3, 5)
    cos, sin = model.rope(latent)
    lite_boost.boost(model)
    emb = model.rope(latent)
    assert isinstance(emb, RotaryEmbedding) and emb.freqs.shape == (1, 45, 1, 8)
    assert torch.equal(emb.freqs[0, :, 0], torch.complex(cos[:, 0::2], sin[:, 1::2]))
    assert model.rope(latent) is emb  # cached
    model._lite_boost.rope_range = lambda n: (40, 50)  # a sequence-parallel slice past the end: identity rows
    part = model.rope(latent)
    assert torch.equal(part.freqs[0, :5], emb.freqs[0, 40:]) and (part.freqs[0, 5:] == 1).all()


def test_padded_text_in_a_batch_matches_stock_and_the_mask_matters():
    spec = hy.HySpec()
    model = hy.hunyuan_transformer(spec)
    inputs = hy.transformer_inputs(spec, batch=2, valid=[7, 12])
    with torch.no_grad():
        stock = model(**inputs).sample
        lite_boost.boost(model)
        got = model(**inputs).sample
        unpadded = model(**{**inputs, "encoder_attention_mask": torch.ones(2, 12)}).sample
    assert (got - stock).abs().max().item() <= TOL
    assert (unpadded - stock).abs().max().item() > 1e-3


# --------------------------------------------------------------------------------------------- sparse
SPARSE_CALL = dict(height=64, width=64, frames=5)  # 2 x 8 x 8 = 128 video tokens, 32 blocks of 4


def test_sparsity_zero_equals_stock_and_sparse_skips_blocks_with_padded_text():
    spec = hy.HySpec()
    pipe = hy.hunyuan_pipeline(spec)
    stock = _latents(pipe, spec, **SPARSE_CALL)
    base = dict(block_size=4, backend="gather", keep_sink=False)  # (2 frames: the sink would be half the video)
    lite_boost.boost(pipe, BoostConfig(sparse=SparseConfig(sparsity=0.0, **base)))
    assert (_latents(pipe, spec, **SPARSE_CALL) - stock).abs().max().item() <= TOL
    lite_boost.boost(pipe, BoostConfig(sparse=SparseConfig(sparsity=0.75, **base)))
    sparse = _latents(pipe, spec, **SPARSE_CALL)
    st = pipe.transformer._lite_boost.extras["sparse"]
    # the text is padded (11 of 16 real): the padded tokens are left out, every call still sparse
    assert {e.path for e in st.events} == {"sparse"} and st.grid == (2, 8, 8)
    assert {e.layer for e in st.events} == {0, 1} and 0.3 < st.mean_effective_sparsity() < 0.75
    assert (sparse - stock).abs().max() > 1e-4 and torch.isfinite(sparse).all()


def test_sparse_token_replace_i2v_runs_sparse():
    spec = hy.HySpec(kind="token_replace")
    pipe = lite_boost.boost(hy.hunyuan_pipeline(spec), BoostConfig(sparse=SparseConfig(sparsity=0.75, block_size=4,
                                                                                        backend="gather")))
    out = _latents(pipe, spec, cfg=True, **SPARSE_CALL)
    st = pipe.transformer._lite_boost.extras["sparse"]
    assert {e.path for e in st.events} == {"sparse"} and torch.isfinite(out).all()


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
    from lite_boost.cache import build_diffusers_config

    # true CFG (cond / uncond contexts) for the methods that keep a state per context
    spec, kw = hy.HySpec(), dict(steps=4, cfg=method in ("first_block_cache", "taylorseer_cache"))
    stock_pipe = hy.hunyuan_pipeline(spec)
    plain = _latents(stock_pipe, spec, **kw)
    stock_pipe.transformer.enable_cache(build_diffusers_config(
        method, CACHES[method], current_timestep_callback=lambda: stock_pipe.current_timestep))
    stock = _latents(stock_pipe, spec, **kw)
    pipe = lite_boost.boost(hy.hunyuan_pipeline(spec), {"cache": {"method": method, **CACHES[method]}})
    got = _latents(pipe, spec, **kw)
    assert (got - stock).abs().max().item() <= TOL
    assert (stock - plain).abs().max() > 1e-5  # the cache really skipped work
    assert (_latents(pipe, spec, **kw) - got).abs().max().item() == 0.0  # fresh cache state per pipeline call


def test_cache_refusals_name_the_reason():
    pipe = hy.hunyuan_pipeline()
    with pytest.raises(ConfigError, match=r"sea_cache' is not supported for HunyuanVideoPipeline \(diffusers' SeaCache"):
        lite_boost.boost(pipe, {"cache": "sea_cache"})
    i2v = hy.hunyuan_pipeline(hy.HySpec(kind="token_replace"))
    with pytest.raises(ConfigError, match=r"'first_block_cache' is not supported for an image-to-video HunyuanVideo "
                                          r"transformer \(image_condition_type='token_replace'\).*without the cache_context"):
        lite_boost.boost(i2v, {"cache": "first_block_cache"})
    assert not lite_boost.api.is_boosted(pipe) and not lite_boost.api.is_boosted(i2v)
    lite_boost.boost(i2v, {"cache": {"method": "mag_cache", **CACHES["mag_cache"]}})  # needs no context
    assert torch.isfinite(_latents(i2v, hy.HySpec(kind="token_replace"), steps=4)).all()


# --------------------------------------------------------------------------------------------- compile
@pytest.mark.parametrize("kind", ["sparse", "token_replace"])  # stock, dense: tests/test_family_contract.py
def test_explain_reports_no_graph_break(kind, fresh_dynamo):
    spec = hy.HySpec(kind="token_replace" if kind == "token_replace" else "t2v")
    model = hy.hunyuan_transformer(spec)
    if kind != "stock":
        lite_boost.boost(model, BoostConfig(sparse=SparseConfig(sparsity=0.75, block_size=4, backend="gather"))
                         if kind == "sparse" else None)
    inputs = hy.transformer_inputs(spec, grid=(2, 4, 8), valid=[7])
    with torch.no_grad():
        report = torch._dynamo.explain(model)(**inputs)
    reasons = [r.reason.splitlines()[0] for r in report.break_reasons]
    assert report.graph_break_count == 0 and report.graph_count == 1, reasons


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sparse"])  # dense: tests/test_family_contract.py
def test_compile_repeated_blocks_fullgraph_matches_eager(kind, fresh_dynamo):
    spec = hy.HySpec()
    model = hy.hunyuan_transformer(spec)
    config = BoostConfig(sparse=SparseConfig(sparsity=0.75, block_size=4, backend="gather")) if kind == "sparse" else None
    lite_boost.boost(model, config)
    inputs = hy.transformer_inputs(spec, grid=(2, 4, 8), valid=[7])
    steps = [torch.tensor([900.0]), torch.tensor([600.0])]
    check_regional_compile(model, inputs, steps, sparse=kind == "sparse")


# --------------------------------------------------------------------------------------------- registry
def test_family_is_registered_with_its_features():
    from lite_boost.models import SUPPORTED_MODELS
    from lite_boost.registry import family_of

    for name in ("HunyuanVideoPipeline", "HunyuanVideoImageToVideoPipeline"):
        assert SUPPORTED_MODELS[name] is HUNYUAN_VIDEO.boost_pipeline
    assert SUPPORTED_MODELS["HunyuanVideoTransformer3DModel"] is HUNYUAN_VIDEO.boost_transformer
    assert family_of(hy.hunyuan_pipeline(hy.HySpec(kind="latent_concat"))) is HUNYUAN_VIDEO
    features = HUNYUAN_VIDEO.features
    assert all(features[f] is None for f in ("dense", "sparse", "sequence_parallel", "cfg_parallel", "step_cache",
                                             "compile", "quant"))
    assert "no parallel-VAE adapter" in features["parallel_vae"]
    assert HUNYUAN_VIDEO.describe()["cfg"] == "separate" and HUNYUAN_VIDEO.pipeline.cfg.by_call_order
    assert HUNYUAN_VIDEO.joint == "image_first"
