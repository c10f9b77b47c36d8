"""Boosted HunyuanVideo-1.5 pipelines (T2V, I2V) against stock diffusers, one process.

fp32, 3 heads, 3 x 3 x 5 = 45 video tokens, padded Qwen / ByT5 text (7 of 10 and 4 of 6 real tokens for
cond, 5 and 3 for uncond) plus the 729 image-side tokens T2V adds (all padding), the ClassifierFreeGuidance
guider at scale 4 (two calls per step); tiny in-memory pipelines without text encoders.
"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import _tiny_hunyuan as hy
import lite_boost
from lite_boost.config import BoostConfig, ConfigError, SparseConfig
from lite_boost.models.hunyuan_video import HUNYUAN_VIDEO_15, HunyuanVideo15JointProcessor

TOL = 1e-5


def _latents(pipe, spec, **kw):
    return pipe(**hy.call_kwargs_15(spec, **kw)).frames


@pytest.mark.parametrize("task", ["t2v", "i2v"])
def test_boosted_pipeline_matches_stock(task):
    spec = hy.Hy15Spec(task=task)
    pipe = hy.hunyuan15_pipeline(spec)
    stock = _latents(pipe, spec)
    lite_boost.boost(pipe)
    got = _latents(pipe, spec)
    assert stock.abs().max() > 0.1 and (got - stock).abs().max().item() <= TOL
    assert all(isinstance(p, HunyuanVideo15JointProcessor) for k, p in pipe.transformer.attn_processors.items()
               if k.startswith("transformer_blocks."))
    assert pipe.transformer._lite_boost.rope_cache.hits >= 1
    lite_boost.unboost(pipe)
    assert (_latents(pipe, spec) - stock).abs().max().item() == 0.0


class _Shapes(TorchDispatchMode):
    """Records the shape of every tensor an op produces."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.shapes.append(tuple(t.shape))
        return out


def _attention_call(processor_cls):
    """One attention call of block 0 at 45 image + 40 text tokens (17 real), every output row."""
    from diffusers.models.transformers.transformer_hunyuan_video15 import HunyuanVideo15AttnProcessor2_0

    spec = hy.Hy15Spec()
    model = hy.hunyuan15_transformer(spec)
    attn = model.transformer_blocks[0].attn
    g = torch.Generator().manual_seed(1)
    image, text = torch.randn(1, 45, 24, generator=g), torch.randn(1, 40, 24, generator=g)
    mask = torch.zeros(1, 40)
    mask[0, :17] = 1
    rope = model.rope(torch.zeros(1, 9, 3, 3, 5))
    proc = HunyuanVideo15AttnProcessor2_0() if processor_cls is None else processor_cls(0, "joint")
    if processor_cls is not None:
        rope = lite_boost.boost(model).rope(torch.zeros(1, 9, 3, 3, 5))
    with torch.no_grad(), _Shapes() as shapes:
        out = proc(attn, image, text, mask, rope)
    return out, shapes.shapes


def test_processor_uses_a_key_padding_mask_not_the_dense_one():
    (ref_img, ref_txt), stock_shapes = _attention_call(None)
    (img, txt), shapes = _attention_call(HunyuanVideo15JointProcessor)
    s = 45 + 40
    assert any(sh[-2:] == (s, s) for sh in stock_shapes)  # stock builds (B, 1, S, S)
    assert not any(len(sh) >= 2 and sh[-2:] == (s, s) for sh in shapes), sorted(set(shapes))
    assert (img - ref_img).abs().max() <= TOL
    assert (txt - ref_txt).abs().max() <= TOL  # padded text rows too (zero attention, as the dense mask gives)


def test_padded_text_in_a_batch_matches_stock():
    spec = hy.Hy15Spec()
    model = hy.hunyuan15_transformer(spec)
    inputs = hy.transformer_inputs_15(spec, batch=2, valid=[(6, 4), (3, 2)], t2v=False)
    with torch.no_grad():
        stock = model(**inputs).sample
        got = lite_boost.boost(model)(**inputs).sample
        unpadded = model(**{**inputs, "encoder_attention_mask": torch.ones(2, 6)}).sample
    assert (got - stock).abs().max().item() <= TOL and (unpadded - stock).abs().max().item() > 1e-4


# --------------------------------------------------------------------------------------------- sparse
def test_sparsity_zero_equals_stock_and_sparse_skips_blocks():
    spec = hy.Hy15Spec()
    pipe = hy.hunyuan15_pipeline(spec)
    call = dict(height=32, width=32, frames=5)  # 3 x 8 x 8 = 192 video tokens
    stock = _latents(pipe, spec, **call)
    base = dict(block_size=4, backend="gather")
    lite_boost.boost(pipe, BoostConfig(sparse=SparseConfig(sparsity=0.0, **base)))
    assert (_latents(pipe, spec, **call) - stock).abs().max().item() <= TOL
    lite_boost.boost(pipe, BoostConfig(sparse=SparseConfig(sparsity=0.75, **base)))
    sparse = _latents(pipe, spec, **call)
    st = pipe.transformer._lite_boost.extras["sparse"]
    assert {e.path for e in st.events} == {"sparse"} and st.grid == (3, 8, 8) and st.mean_effective_sparsity() > 0.2
    assert (sparse - stock).abs().max() > 1e-4 and torch.isfinite(sparse).all()


# --------------------------------------------------------------------------------------------- caching
CACHES = {
    "taylorseer_cache": {"cache_interval": 2, "disable_cache_before_step": 1},
    "pyramid_attention_broadcast": {"spatial_attention_block_skip_range": 2,
                                    "spatial_attention_timestep_skip_range": (0, 1000)},
}


@pytest.mark.parametrize("method", sorted(CACHES))
def test_step_cache_equals_the_stock_diffusers_hook(method):
    from lite_boost.cache import build_diffusers_config

    spec = hy.Hy15Spec()
    stock_pipe = hy.hunyuan15_pipeline(spec)
    plain = _latents(stock_pipe, spec, steps=4)
    stock_pipe.transformer.enable_cache(build_diffusers_config(
        method, CACHES[method], current_timestep_callback=lambda: stock_pipe.current_timestep))
    stock = _latents(stock_pipe, spec, steps=4)
    pipe = lite_boost.boost(hy.hunyuan15_pipeline(spec), {"cache": {"method": method, **CACHES[method]}})
    got = _latents(pipe, spec, steps=4)
    # TaylorSeer extrapolates from differences of the computed steps' outputs, which scales the ~1e-6 fp32
    # rounding differences of the boosted attention; how far depends on the CPU's kernels (outputs of ~1.5:
    # 1.1e-5 on a Zen 4, 9.2e-5 on an AVX2-only Zen 3); still 5x below what the cache itself changes (> 1e-3)
    tol = 2e-4 if method == "taylorseer_cache" else TOL
    assert (got - stock).abs().max().item() <= tol and (stock - plain).abs().max() > 1e-3


def test_block_caches_are_refused_with_the_reason():
    pipe = hy.hunyuan15_pipeline()
    for method in ({"method": "first_block_cache"}, {"method": "mag_cache", "mag_ratios": [1.0, 0.9],
                                                     "num_inference_steps": 2}):
        with pytest.raises(ConfigError, match=rf"'{method['method']}' is not supported for HunyuanVideo15Pipeline "
                                              r"\(diffusers registers no block metadata"):
            lite_boost.boost(pipe, {"cache": method})
    assert not lite_boost.api.is_boosted(pipe)


# --------------------------------------------------------------------------------------------- compile
def _block_inputs(model, spec):
    """What the model hands transformer_blocks[0]: image tokens, reordered text, temb, (B, T) mask, RoPE."""
    seen = {}
    hook = model.transformer_blocks[0].register_forward_pre_hook(lambda m, a: seen.setdefault("args", a))
    with torch.no_grad():
        model(**hy.transformer_inputs_15(spec, valid=[(4, 3)]))
    hook.remove()
    return seen["args"]


@pytest.mark.parametrize("kind", ["sparse"])  # stock, dense: tests/test_family_contract.py
def test_explain_reports_no_graph_break_in_a_block(kind, fresh_dynamo):
    """1.5's forward reorders the text with boolean indexing (data-dependent shapes: graph breaks in stock
    too, outside the blocks); a block has none, boosted or not."""
    spec = hy.Hy15Spec()
    model = hy.hunyuan15_transformer(spec)
    if kind != "stock":
        lite_boost.boost(model, BoostConfig(sparse=SparseConfig(sparsity=0.75, block_size=4, backend="gather"))
                         if kind == "sparse" else None)
    args = _block_inputs(model, spec)
    with torch.no_grad():
        report = torch._dynamo.explain(model.transformer_blocks[0])(*args)
    assert report.graph_break_count == 0 and report.graph_count == 1, [r.reason for r in report.break_reasons]


# --------------------------------------------------------------------------------------------- registry
def test_family_is_registered_with_its_features():
    from lite_boost.models import SUPPORTED_MODELS

    for name in ("HunyuanVideo15Pipeline", "HunyuanVideo15ImageToVideoPipeline"):
        assert SUPPORTED_MODELS[name] is HUNYUAN_VIDEO_15.boost_pipeline
    assert SUPPORTED_MODELS["HunyuanVideo15Transformer3DModel"] is HUNYUAN_VIDEO_15.boost_transformer
    features = HUNYUAN_VIDEO_15.features
    assert all(features[f] is None for f in ("dense", "sparse", "sequence_parallel", "cfg_parallel", "step_cache",
                                             "compile", "quant"))
    assert HUNYUAN_VIDEO_15.describe()["cfg"] == "guider"
