"""Boosted CogVideoX pipelines (2B, 5B, 1.5, I2V 5B / 1.5) against stock diffusers, one process.

fp32, batched CFG (B = 2), 3 heads, odd token grids (3 x 5 tokens per latent frame), odd text length,
RoPE passed in by the pipeline (5B / 1.5, ``patch_size_t`` 2) or sincos position embeddings (2B), tiny
in-memory pipelines without text encoder (prompt embeddings passed in).
"""

import pytest
import torch

import _tiny_cogvideox as T
import lite_boost
from lite_boost.config import BoostConfig, ConfigError, SparseConfig
from lite_boost.models.cogvideox import COGVIDEOX, CogVideoXJointProcessor
from conftest import check_regional_compile

TOL = 1e-5


def _frames(pipe, spec, **kw):
    return pipe(**T.call_kwargs(spec, **kw)).frames


@pytest.mark.parametrize("variant", T.VARIANTS)
def test_boosted_pipeline_matches_stock(variant):
    spec = T.TinyCogSpec(variant)
    pipe = T.tiny_pipeline(spec)
    stock = _frames(pipe, spec)
    assert lite_boost.boost(pipe) is pipe
    assert all(isinstance(p, CogVideoXJointProcessor) for p in pipe.transformer.attn_processors.values())
    got = _frames(pipe, spec)
    assert stock.abs().max() > 0.1 and got.shape == stock.shape
    assert (got - stock).abs().max().item() <= TOL
    lite_boost.unboost(pipe)
    assert (_frames(pipe, spec) - stock).abs().max().item() == 0.0


def test_decoded_video_matches_stock_and_cfg_off():
    spec = T.TinyCogSpec("5b")
    pipe = T.tiny_pipeline(spec)
    stock = _frames(pipe, spec, steps=1, output_type="pt")
    no_cfg = _frames(pipe, spec, cfg=False)
    lite_boost.boost(pipe)
    assert (_frames(pipe, spec, steps=1, output_type="pt") - stock).abs().max().item() <= TOL
    assert (_frames(pipe, spec, cfg=False) - no_cfg).abs().max().item() <= TOL


@pytest.mark.parametrize("variant", ["2b", "5b", "15"])
def test_transformer_matches_stock_at_other_text_lengths(variant):
    """Direct transformer calls, B = 2, text of 7 tokens (2B: the sincos table fixes it) or 11."""
    spec = T.TinyCogSpec(variant, heads=3)
    model = T.tiny_transformer(spec)
    inputs = T.transformer_inputs(spec, grid=(3, 3, 5), text=T.TEXT_LEN if variant == "2b" else 11)
    with torch.no_grad():
        stock = model(**inputs).sample
        lite_boost.boost(model)
        got = model(**inputs).sample
    assert (got - stock).abs().max().item() <= TOL and stock.abs().max() > 0.1


def test_the_shim_attends_every_text_key():
    """Dropping the text stream from the attention changes the result: the joint path is really used."""
    spec = T.TinyCogSpec("5b")
    model = lite_boost.boost(T.tiny_transformer(spec))
    inputs = T.transformer_inputs(spec)
    with torch.no_grad():
        ref = model(**inputs).sample
        for p in model._lite_boost.self_attention_processors:
            inner = p.attn_fn
            p.attn_fn = lambda q, k, v, joint, _f=inner: (_f(q, k, v), joint.q)
        assert (model(**inputs).sample - ref).abs().max() > 1e-3


# --------------------------------------------------------------------------------------------- sparse
SPARSE_CALL = dict(height=64, width=128)  # 4 x 8 tokens per latent frame: 96 video tokens (64 with patch_size_t 2)


@pytest.mark.parametrize("variant, grid", [("5b", (3, 4, 8)), ("15", (2, 4, 8)), ("2b", (3, 4, 8))])
def test_sparsity_zero_equals_stock_and_sparse_keeps_text_dense(variant, grid):
    spec = T.TinyCogSpec(variant)
    pipe = T.tiny_pipeline(spec)
    stock = _frames(pipe, spec, **SPARSE_CALL)
    base = dict(block_size=4, backend="gather")
    lite_boost.boost(pipe, BoostConfig(sparse=SparseConfig(sparsity=0.0, **base)))
    assert (_frames(pipe, spec, **SPARSE_CALL) - stock).abs().max().item() <= TOL
    lite_boost.boost(pipe, BoostConfig(sparse=SparseConfig(sparsity=0.75, **base)))
    sparse = _frames(pipe, spec, **SPARSE_CALL)
    st = pipe.transformer._lite_boost.extras["sparse"]
    assert {e.path for e in st.events} == {"sparse"} and st.grid == grid  # the latent grid, from the model
    assert 0.1 < st.mean_effective_sparsity() < 0.75  # text rows / columns forced dense
    assert (sparse - stock).abs().max() > 1e-4 and torch.isfinite(sparse).all()


# --------------------------------------------------------------------------------------------- caching
CACHES = {
    "first_block_cache": {"threshold": 0.5},
    "taylorseer_cache": {"cache_interval": 2, "disable_cache_before_step": 1, "taylor_factors_dtype": "float32",
                         "cache_identifiers": [r"^transformer_blocks\.\d+\.(attn1|ff)$"]},
    "mag_cache": {"mag_ratios": [1.0, 0.99, 0.98, 0.97], "num_inference_steps": 4, "threshold": 0.5,
                  "max_skip_steps": 2},
    "pyramid_attention_broadcast": {"spatial_attention_block_skip_range": 2,
                                    "spatial_attention_timestep_skip_range": (0, 1000)},
}


def _stock_config(method, pipe):
    """diffusers' own config object (the stock reference), written out by hand."""
    import diffusers.hooks as h

    p = dict(CACHES[method])
    if method == "first_block_cache":
        return h.FirstBlockCacheConfig(**p)
    if method == "mag_cache":
        return h.MagCacheConfig(**p)
    if method == "taylorseer_cache":
        return h.TaylorSeerCacheConfig(**{**p, "taylor_factors_dtype": torch.float32})
    return h.PyramidAttentionBroadcastConfig(**p, current_timestep_callback=lambda: pipe.current_timestep)


@pytest.mark.parametrize("method", sorted(CACHES))
def test_step_cache_equals_the_stock_diffusers_hook(method):
    from lite_boost.cache import count_block_work

    spec = T.TinyCogSpec("5b")
    kw = dict(steps=4)
    stock_pipe = T.tiny_pipeline(spec)
    plain = _frames(stock_pipe, spec, **kw)
    stock_pipe.transformer.enable_cache(_stock_config(method, stock_pipe))
    stock = _frames(stock_pipe, spec, **kw)
    pipe = lite_boost.boost(T.tiny_pipeline(spec), {"cache": {"method": method, **CACHES[method]}})
    with count_block_work([pipe.transformer], blocks="transformer_blocks", ffn="ff", attn="attn1") as work:
        got = _frames(pipe, spec, **kw)
    assert (got - stock).abs().max().item() <= TOL
    assert (stock - plain).abs().max() > 1e-5  # the cache really skipped work ...
    # ... here too (the counted leaf of attn1 is norm_q, which the shim runs once per stream: 2 per attention)
    assert work.ffn_runs < work.calls or work.attn_runs < 2 * work.calls * spec.layers, work.summary()
    assert (_frames(pipe, spec, **kw) - got).abs().max().item() == 0.0  # fresh cache state per pipeline call


def test_cache_refusals_name_the_reason():
    pipe = T.tiny_pipeline(T.TinyCogSpec("5b"))
    with pytest.raises(ConfigError, match=r"sea_cache' is not supported for CogVideoXPipeline \(diffusers' SeaCache"):
        lite_boost.boost(pipe, {"cache": "sea_cache"})
    with pytest.raises(ConfigError, match=r"'faster_cache'|accepted methods"):
        lite_boost.boost(pipe, {"cache": "faster_cache"})
    assert not lite_boost.api.is_boosted(pipe)


# --------------------------------------------------------------------------------------------- compile
@pytest.mark.parametrize("kind", ["sparse", "2b"])  # stock, dense: tests/test_family_contract.py
def test_explain_reports_no_graph_break(kind, fresh_dynamo):
    spec = T.TinyCogSpec("2b" if kind == "2b" else "5b")
    model = T.tiny_transformer(spec)
    if kind != "stock":
        lite_boost.boost(model, BoostConfig(sparse=SparseConfig(sparsity=0.75, block_size=4, backend="gather"))
                         if kind == "sparse" else None)
    inputs = T.transformer_inputs(spec, grid=(2, 4, 8))
    with torch.no_grad():
        report = torch._dynamo.explain(model)(**inputs)
    reasons = [r.reason.splitlines()[0] for r in report.break_reasons]
    assert report.graph_break_count == 0 and report.graph_count == 1, reasons


@pytest.mark.parametrize("kind", ["sparse"])  # dense: tests/test_family_contract.py
def test_compile_repeated_blocks_fullgraph_matches_eager(kind, fresh_dynamo):
    """diffusers' regional compile recipe with inductor on a boosted transformer, two steps."""
    spec = T.TinyCogSpec("5b")
    model = T.tiny_transformer(spec)
    config = BoostConfig(sparse=SparseConfig(sparsity=0.75, block_size=4, backend="gather")) if kind == "sparse" else None
    lite_boost.boost(model, config)
    model._repeated_blocks = ("CogVideoXBlock",)  # diffusers declares none for CogVideoX: on this instance
    inputs = T.transformer_inputs(spec, grid=(2, 4, 8))
    steps = [torch.tensor([900, 900]), torch.tensor([600, 600])]
    check_regional_compile(model, inputs, steps, sparse=kind == "sparse")


# --------------------------------------------------------------------------------------------- registry
def test_family_is_registered_with_its_features():
    from lite_boost.models import SUPPORTED_MODELS
    from lite_boost.registry import family_of

    for name in ("CogVideoXPipeline", "CogVideoXImageToVideoPipeline", "CogVideoXVideoToVideoPipeline",
                 "CogVideoXFunControlPipeline"):
        assert SUPPORTED_MODELS[name] is COGVIDEOX.boost_pipeline
    assert SUPPORTED_MODELS["CogVideoXTransformer3DModel"] is COGVIDEOX.boost_transformer
    assert family_of(T.tiny_pipeline(T.TinyCogSpec("i2v"))) is COGVIDEOX
    features = COGVIDEOX.features
    assert all(features[f] is None for f in ("dense", "sparse", "sequence_parallel", "cfg_parallel", "step_cache",
                                             "compile", "quant"))
    assert "each rank decodes the whole video" in features["parallel_vae"]
    assert COGVIDEOX.describe()["cfg"] == "batched"


def test_video_to_video_and_fun_control_pipelines_boost_like_t2v():
    """The other pipelines of the transformer: same shim on the same transformer."""
    from diffusers import CogVideoXFunControlPipeline, CogVideoXVideoToVideoPipeline

    spec = T.TinyCogSpec("5b")
    video = [T.image(48, 80, s) for s in range(9)]
    for cls, extra, variant in ((CogVideoXVideoToVideoPipeline, {"video": video, "strength": 0.8}, "5b"),
                                (CogVideoXFunControlPipeline, {"control_video": video}, "i2v")):
        base = T.tiny_pipeline(spec)  # Fun-Control: latents + control latents on channels, as I2V
        pipe = cls(tokenizer=None, text_encoder=None, vae=base.vae, transformer=T.tiny_transformer(T.TinyCogSpec(variant)),
                   scheduler=base.scheduler)
        pipe.set_progress_bar_config(disable=True)

        def call():
            kw = T.call_kwargs(spec, steps=3)
            del kw["num_frames"]
            return pipe(**kw, **extra).frames

        stock = call()
        lite_boost.boost(pipe)
        assert lite_boost.api.is_boosted(pipe)
        assert (call() - stock).abs().max().item() <= TOL and stock.abs().max() > 0.1
