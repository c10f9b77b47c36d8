"""Boosted LTX-Video pipelines (T2V, I2V, condition) and transformer against stock diffusers, one process.

fp32, batched CFG on (B = 2), padded text (prompt 5 of 8 tokens, negative 3), 3 heads, an odd token
grid (2 x 3 x 5), tiny in-memory pipelines without text encoder (prompt embeddings passed in).
"""

import pytest
import torch

import _tiny_ltx as tl
import lite_boost
from lite_boost.config import BoostConfig, ConfigError, SparseConfig
from lite_boost.models.ltx import LTX, LTXAttnProcessor
from lite_boost.ops.rope import RotaryEmbedding
from conftest import check_regional_compile

TOL = 1e-5
PIPELINES = [("t2v", tl.TinyLTXSpec(), {}),
             ("t2v", tl.TinyLTXSpec(heads=5), {}),  # inner dim 40: the RoPE's identity pad (40 % 6 = 4 channels)
             ("i2v", tl.TinyLTXSpec(), {}),  # per-token timesteps (the first frame's tokens at 0)
             ("condition", tl.TinyLTXSpec(), {}),  # video_coords, condition lerped into frame 0
             ("condition", tl.TinyLTXSpec(), {"frame_index": 8})]  # condition tokens prepended (45 tokens)


def _frames(pipe, kind, **kw):
    return pipe(**tl.call_kwargs(kind, **kw)).frames


@pytest.mark.parametrize("kind, spec, extra", PIPELINES, ids=["t2v", "t2v_h5_pad", "i2v", "condition",
                                                              "condition_prefix"])
def test_boosted_pipeline_matches_stock(kind, spec, extra):
    pipe = tl.tiny_ltx_pipeline(kind, spec=spec)
    seen = []
    pipe.transformer.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["hidden_states"].shape[:2]),
                                               with_kwargs=True)
    stock = _frames(pipe, kind, **extra)
    assert lite_boost.boost(pipe) is pipe
    got = _frames(pipe, kind, **extra)
    assert stock.abs().max() > 0.1 and got.shape == stock.shape
    assert (got - stock).abs().max().item() <= TOL
    assert set(seen) == {torch.Size([2, 45 if extra else 30])}  # batched CFG; prefix tokens in front
    state = pipe.transformer._lite_boost
    assert state.rope_patched
    if kind != "condition":  # grid tables served from the cache; video_coords tables are per call
        assert state.rope_cache.hits >= 1
    assert all(isinstance(p, LTXAttnProcessor) for p in pipe.transformer.attn_processors.values())
    lite_boost.unboost(pipe)
    assert (_frames(pipe, kind, **extra) - stock).abs().max().item() == 0.0


def test_decoded_video_matches_stock():
    pipe = tl.tiny_ltx_pipeline("t2v")
    stock = _frames(pipe, "t2v", output_type="pt", steps=1)
    lite_boost.boost(pipe)
    got = _frames(pipe, "t2v", output_type="pt", steps=1)
    assert got.shape == (1, 9, 3, 96, 160) and (got - stock).abs().max().item() <= TOL


def test_padded_text_batch_matches_stock_and_the_mask_matters():
    pipe = tl.tiny_ltx_pipeline("t2v")
    kw = dict(batch=2, valid=[7, 3])
    stock = _frames(pipe, "t2v", **kw)
    lite_boost.boost(pipe)
    assert (_frames(pipe, "t2v", **kw) - stock).abs().max().item() <= TOL
    call = tl.call_kwargs("t2v", **kw)
    unmasked = pipe(**{**call, "prompt_attention_mask": torch.ones_like(call["prompt_attention_mask"])}).frames
    assert (unmasked - stock).abs().max().item() > 1e-3


@pytest.mark.parametrize("heads", [3, 2])  # inner dim 24 (no pad) and 16 (4 identity channels in front)
def test_rope_tables_are_the_models_own_in_cached_form(heads):
    model = lite_boost.boost(tl.tiny_ltx_transformer(tl.TinyLTXSpec(heads=heads)))
    rope = model.rope
    x = torch.zeros(2, 30, 8)
    args = (2, 3, 5, (8 / 25, 32, 32))
    cos, sin = type(rope).forward(rope, x, *args)
    emb = rope(x, *args)
    assert isinstance(emb, RotaryEmbedding) and emb.freqs.shape == (1, 30, 1, heads * 4)
    assert torch.equal(emb.freqs[0, :, 0].real, cos[0, :, 0::2]) and torch.equal(emb.freqs[0, :, 0].imag, sin[0, :, 1::2])
    if heads == 2:
        assert (emb.freqs[0, :, 0, :2] == 1).all()  # the identity pad rotates nothing
    assert rope(x, *args) is emb and model._lite_boost.rope_cache.hits == 1
    # a sequence-parallel slice past the end: this rank's rows, identity rows after the sequence
    model._lite_boost.rope_range = lambda n: (24, 36)
    part = rope(x, *args)
    assert torch.equal(part.freqs[0, :6, 0].real, cos[0, 24:, 0::2]) and (part.freqs[0, 6:] == 1).all()
    # per-sample video_coords: per-sample tables for this rank's rows of the coordinates
    coords = tl.transformer_inputs(tl.TinyLTXSpec(heads=heads), coords=True)["video_coords"]
    cos_c, sin_c = type(rope).forward(rope, x, video_coords=coords)
    part = rope(x, video_coords=coords)
    assert part.freqs.shape == (2, 12, 1, heads * 4) and (part.freqs[:, 6:] == 1).all()
    assert torch.equal(part.freqs[:, :6, 0].imag, sin_c[:, 24:, 1::2])


@pytest.mark.parametrize("case", ["grid", "per_token", "coords", "unmasked", "batch1"])
def test_transformer_matches_stock_on_direct_inputs(case):
    stock = tl.tiny_ltx_transformer()
    model = lite_boost.boost(tl.tiny_ltx_transformer())
    kw = dict(per_token=case == "per_token", coords=case == "coords", masked=case != "unmasked",
              batch=1 if case == "batch1" else 2, grid=(3, 1, 7))
    inputs = tl.transformer_inputs(**kw)
    with torch.no_grad():
        ref = stock(**inputs).sample
        got = model(**inputs).sample
    assert (got - ref).abs().max().item() <= TOL


def test_a_rope_module_of_another_kind_keeps_diffusers_tables():
    """A subclass overriding forward: the cached form does not claim to reproduce it."""
    from diffusers.models.transformers.transformer_ltx import LTXVideoRotaryPosEmbed

    class ScaledRope(LTXVideoRotaryPosEmbed):
        def forward(self, hidden_states, *args, **kwargs):
            return super().forward(hidden_states, *args, **kwargs)

    def with_rope(model):
        model.rope = ScaledRope(dim=model.rope.dim)
        return model

    stock = with_rope(tl.tiny_ltx_transformer())
    model = lite_boost.boost(with_rope(tl.tiny_ltx_transformer()))
    assert not model._lite_boost.rope_patched
    inputs = tl.transformer_inputs()
    with torch.no_grad():
        assert (model(**inputs).sample - stock(**inputs).sample).abs().max().item() <= TOL


# --------------------------------------------------------------------------------------------- sparse
SPARSE = dict(height=128, width=256, frames=25)  # 4 x 4 x 8 = 128 video tokens, 32 blocks of 4


def test_sparsity_zero_equals_stock_and_a_sparse_run_skips_blocks():
    pipe = tl.tiny_ltx_pipeline("t2v")
    stock = _frames(pipe, "t2v", **SPARSE)
    base = dict(block_size=4, backend="gather")
    lite_boost.boost(pipe, BoostConfig(sparse=SparseConfig(sparsity=0.0, **base)))
    assert (_frames(pipe, "t2v", **SPARSE) - stock).abs().max().item() <= TOL
    lite_boost.boost(pipe, BoostConfig(sparse=SparseConfig(sparsity=0.75, **base)))
    sparse = _frames(pipe, "t2v", **SPARSE)
    st = pipe.transformer._lite_boost.extras["sparse"]
    assert {e.path for e in st.events} == {"sparse"} and st.grid == (4, 4, 8)
    assert st.mean_effective_sparsity() > 0.3
    assert (sparse - stock).abs().max() > 1e-4 and torch.isfinite(sparse).all()


def test_sparse_i2v_follows_the_steps_and_condition_calls_run_dense():
    pipe = tl.tiny_ltx_pipeline("i2v")
    lite_boost.boost(pipe, BoostConfig(sparse=SparseConfig(sparsity=0.75, block_size=4, backend="gather",
                                                           dense_steps_first=1)))
    _frames(pipe, "i2v", steps=3, **SPARSE)
    st = pipe.transformer._lite_boost.extras["sparse"]
    assert [(e.step, e.path) for e in st.events if e.layer == 0] == [(0, "dense"), (1, "sparse"), (2, "sparse")]
    _frames(pipe, "i2v", steps=3, **SPARSE)  # a second generation starts again at step 0
    assert st.tracker.generation == 1 and [e.step for e in st.events if e.layer == 0] == [0, 1, 2]

    cond = tl.tiny_ltx_pipeline("condition")
    lite_boost.boost(cond, BoostConfig(sparse=SparseConfig(sparsity=0.75, block_size=4, backend="gather")))
    _frames(cond, "condition", **SPARSE)
    st = cond.transformer._lite_boost.extras["sparse"]
    assert st.grid is None and {e.path for e in st.events} == {"dense"}  # video_coords: no grid to window


# --------------------------------------------------------------------------------------------- caching
STEPS = 4
CACHES = {
    "first_block_cache": {"threshold": 0.5},
    "taylorseer_cache": {"cache_interval": 2, "disable_cache_before_step": 1, "taylor_factors_dtype": "float32"},
    "mag_cache": {"mag_ratios": [1.0, 0.99, 0.98, 0.97], "num_inference_steps": STEPS, "threshold": 0.5,
                  "max_skip_steps": 2},
    "pyramid_attention_broadcast": {"spatial_attention_block_skip_range": 2,
                                    "spatial_attention_timestep_skip_range": (0, 1000)},
}


def _stock_cache_config(method, pipe):
    """diffusers' own config for each case, written out by hand (the reference)."""
    import diffusers.hooks as h

    if method == "first_block_cache":
        return h.FirstBlockCacheConfig(threshold=0.5)
    if method == "taylorseer_cache":
        return h.TaylorSeerCacheConfig(cache_interval=2, disable_cache_before_step=1, taylor_factors_dtype=torch.float32,
                                       cache_identifiers=[r"^transformer_blocks\.\d+\.(attn1|attn2|ff)$"])
    if method == "mag_cache":
        return h.MagCacheConfig(mag_ratios=[1.0, 0.99, 0.98, 0.97], num_inference_steps=STEPS, threshold=0.5,
                                max_skip_steps=2)
    return h.PyramidAttentionBroadcastConfig(spatial_attention_block_skip_range=2,
                                             spatial_attention_timestep_skip_range=(0, 1000),
                                             current_timestep_callback=lambda: pipe.current_timestep)


@pytest.mark.parametrize("kind", ["t2v", "i2v"])
@pytest.mark.parametrize("method", sorted(CACHES))
def test_step_cache_equals_the_stock_diffusers_hook(method, kind):
    from lite_boost.cache import count_block_work

    work_of = dict(blocks="transformer_blocks", ffn="ff", attn="attn1")
    stock_pipe = tl.tiny_ltx_pipeline(kind)
    plain = _frames(stock_pipe, kind, steps=STEPS)
    stock_pipe.transformer.enable_cache(_stock_cache_config(method, stock_pipe))
    stock = _frames(stock_pipe, kind, steps=STEPS)
    pipe = lite_boost.boost(tl.tiny_ltx_pipeline(kind), {"cache": {"method": method, **CACHES[method]}})
    with count_block_work([pipe.transformer], **work_of) as work:
        got = _frames(pipe, kind, steps=STEPS)
    assert (got - stock).abs().max().item() <= TOL
    assert (stock - plain).abs().max() > 1e-5  # the cache really skipped work ...
    assert work.ffn_runs < work.calls or work.attn_runs < work.calls * 2, work.summary()  # ... here too
    assert (_frames(pipe, kind, steps=STEPS) - got).abs().max().item() == 0.0  # fresh cache state per call


def test_cache_refusals_name_the_reason():
    pipe = tl.tiny_ltx_pipeline("t2v")
    with pytest.raises(ConfigError, match=r"sea_cache' is not supported for LTXPipeline \(diffusers' SeaCache"):
        lite_boost.boost(pipe, {"cache": "sea_cache"})
    with pytest.raises(ConfigError, match=r"'faster_cache'|accepted methods"):
        lite_boost.boost(pipe, {"cache": "faster_cache"})
    assert not lite_boost.api.is_boosted(pipe)


def test_parallel_refusals_come_before_any_collective():
    import torch.distributed as dist

    from lite_boost.parallel import ParallelManager

    pipe = tl.tiny_ltx_pipeline("t2v")
    with pytest.raises(ConfigError, match=r"sea_cache' is not supported for LTXPipeline"):
        ParallelManager(pipe, {"parallel": {"cfg_degree": 2}, "cache": "sea_cache"})
    with pytest.raises(ConfigError, match=r"cfg_degree=2 needs a pipeline that runs classifier-free guidance"):
        ParallelManager(pipe.transformer, {"parallel": {"cfg_degree": 2}})
    assert not lite_boost.api.is_boosted(pipe) and not dist.is_initialized()


def test_batched_cfg_parallel_refuses_a_cache_that_decides_from_the_batch():
    """First-Block Cache's statistic spans the whole B = 2 batch; under cfg_degree 2 each cfg rank holds
    half of it. Refused before any collective; the fixed-schedule methods are offered, Pyramid Attention
    Broadcast among them (its one state shared by cond and uncond is split with the batch: each cfg
    rank reuses its half; parity in test_parallel_ltx.py, t2v_cfg2_pab_h3)."""
    from lite_boost.cache import check_cache_support
    from lite_boost.config import CacheConfig
    from lite_boost.parallel import ParallelManager

    pipe = tl.tiny_ltx_pipeline("t2v")
    with pytest.raises(ConfigError, match=r"'first_block_cache' decides from the activations of the whole batch.*"
                                          r"use one of \['mag_cache', 'taylorseer_cache', 'pyramid_attention_broadcast'\]"):
        ParallelManager(pipe, {"parallel": {"cfg_degree": 2}, "cache": "first_block_cache"})
    assert check_cache_support(pipe, CacheConfig("pyramid_attention_broadcast"), cfg_degree=2) is not None
    assert not lite_boost.api.is_boosted(pipe)


# --------------------------------------------------------------------------------------------- compile
@pytest.mark.parametrize("kind", ["sparse", "per_token", "coords"])  # stock, dense: test_family_contract.py
def test_explain_reports_no_graph_break(kind, fresh_dynamo):
    model = tl.tiny_ltx_transformer()
    if kind != "stock":
        lite_boost.boost(model, BoostConfig(sparse=SparseConfig(sparsity=0.75, block_size=4, backend="gather"))
                         if kind == "sparse" else None)
    inputs = tl.transformer_inputs(grid=(2, 4, 8), per_token=kind == "per_token", coords=kind == "coords")
    with torch.no_grad():
        report = torch._dynamo.explain(model)(**inputs)
    reasons = [r.reason.splitlines()[0] for r in report.break_reasons]
    assert report.graph_break_count == 0 and report.graph_count == 1, reasons


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sparse"])  # dense: tests/test_family_contract.py
def test_compile_repeated_blocks_fullgraph_matches_eager(kind, fresh_dynamo):
    """diffusers' regional compile recipe with inductor on a boosted transformer, two steps."""
    model = tl.tiny_ltx_transformer()
    config = BoostConfig(sparse=SparseConfig(sparsity=0.75, block_size=4, backend="gather")) if kind == "sparse" else None
    lite_boost.boost(model, config)
    inputs = tl.transformer_inputs(grid=(2, 4, 8))
    steps = [torch.tensor([900.0, 900.0]), torch.tensor([600.0, 600.0])]
    check_regional_compile(model, inputs, steps, sparse=kind == "sparse")


# --------------------------------------------------------------------------------------------- registry
def test_family_is_registered_with_its_features():
    from lite_boost.models import SUPPORTED_MODELS
    from lite_boost.registry import family_of

    for name in ("LTXPipeline", "LTXImageToVideoPipeline", "LTXConditionPipeline"):
        assert SUPPORTED_MODELS[name] is LTX.boost_pipeline
    assert SUPPORTED_MODELS["LTXVideoTransformer3DModel"] is LTX.boost_transformer
    assert family_of(tl.tiny_ltx_pipeline("i2v")) is LTX
    features = LTX.features
    assert all(features[f] is None for f in ("dense", "sparse", "sequence_parallel", "cfg_parallel", "step_cache",
                                             "compile", "quant", "parallel_vae"))  # exact parallel VAE only
    assert LTX.pipeline.cfg.kind == "batched" and LTX.sharding.text == "replicate"


def test_lite_boost_models_lists_the_family(capsys):
    from lite_boost.cli import main

    assert main(["models"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("| ltx |"))
    assert "LTXImageToVideoPipeline" in row and "| cross | batched |" in row
    assert row.count("| yes") == 8 and row.count("| no") == 0

