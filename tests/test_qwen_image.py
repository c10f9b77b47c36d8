"""Boosted Qwen-Image pipelines (T2I, Edit, Edit-2511, Edit-Plus) against stock diffusers, one process.

fp32, CFG on with cond / uncond prompts of different lengths, 3 heads, odd token grids (3 x 5), tiny
in-memory pipelines without text encoder (prompt embeddings passed in).
"""

import warnings

import pytest
import torch

import _qwen_cases as cases
import lite_boost
from lite_boost.config import BoostConfig, ConfigError, SparseConfig
from lite_boost.demo import TinyQwenImageSpec, tiny_qwen_image_pipeline, tiny_qwen_image_transformer
from lite_boost.models.qwenimage import QwenImageJointProcessor
from lite_boost.ops.rope import RotaryEmbedding
from conftest import check_regional_compile

TOL = 1e-5
SPEC = TinyQwenImageSpec(heads=3)
PIPELINES = [("t2i", SPEC), ("edit", SPEC), ("edit", TinyQwenImageSpec(heads=5, zero_cond_t=True)),
             ("edit_plus", SPEC)]


@pytest.fixture(scope="module", autouse=True)
def _small_condition_images():
    restore = cases.small_condition_images()
    yield
    restore()


def _images(pipe, kind, **kw):
    return pipe(**cases.call_kwargs(kind, **kw)).images


@pytest.mark.parametrize("kind, spec", PIPELINES, ids=["t2i", "edit", "edit2511_h5", "edit_plus"])
def test_boosted_pipeline_matches_stock(kind, spec):
    pipe = tiny_qwen_image_pipeline(kind, spec=spec)
    stock = _images(pipe, kind)
    stock_pixels = _images(pipe, kind, output_type="pt", steps=1)
    assert lite_boost.boost(pipe) is pipe
    got = _images(pipe, kind)
    assert stock.abs().max() > 0.1 and got.shape == stock.shape
    assert (got - stock).abs().max().item() <= TOL
    assert (_images(pipe, kind, output_type="pt", steps=1) - stock_pixels).abs().max().item() <= TOL
    state = pipe.transformer._lite_boost
    assert state.rope_patched and state.rope_cache.hits >= 1
    assert all(isinstance(p, QwenImageJointProcessor) for p in pipe.transformer.attn_processors.values())
    lite_boost.unboost(pipe)
    assert (_images(pipe, kind) - stock).abs().max().item() == 0.0


def test_padded_text_in_a_batch_matches_stock():
    """Two prompts padded to one length (mask present): padded text keys are never attended."""
    pipe = tiny_qwen_image_pipeline("t2i", spec=SPEC)
    kw = dict(batch=2, valid=[7, 4], text=(7, 6))
    stock = _images(pipe, "t2i", **kw)
    lite_boost.boost(pipe)
    got = _images(pipe, "t2i", **kw)
    assert (got - stock).abs().max().item() <= TOL
    # the mask matters: without it the result differs
    unmasked = pipe(**{**cases.call_kwargs("t2i", **kw), "prompt_embeds_mask": None}).images
    assert (unmasked - stock).abs().max().item() > 1e-3


def test_rope_tables_are_the_models_own_in_cached_form():
    model = lite_boost.boost(tiny_qwen_image_transformer(SPEC))
    stock = type(model.pos_embed).forward(model.pos_embed, [[(1, 3, 5), (1, 4, 8)]], device=torch.device("cpu"),
                                          max_txt_seq_len=6)
    img, txt = model.pos_embed([[(1, 3, 5), (1, 4, 8)]], device=torch.device("cpu"), max_txt_seq_len=6)
    assert isinstance(img, RotaryEmbedding) and isinstance(txt, RotaryEmbedding)
    assert torch.equal(img.freqs[0, :, 0], stock[0]) and torch.equal(txt.freqs[0, :, 0], stock[1])
    # a sequence-parallel slice past the end gets identity rows
    model._lite_boost.rope_range = lambda n: (40, 50)
    part, _ = model.pos_embed([[(1, 3, 5), (1, 4, 8)]], device=torch.device("cpu"), max_txt_seq_len=6)
    assert torch.equal(part.freqs[0, :7, 0], stock[0][40:]) and (part.freqs[0, 7:] == 1).all()


# --------------------------------------------------------------------------------------------- sparse
SPARSE_GRID = dict(height=64, width=128)  # 8 x 16 = 128 image tokens, 32 blocks of 4


def test_sparsity_zero_equals_stock_and_sparse_keeps_text_dense():
    pipe = tiny_qwen_image_pipeline("t2i", spec=SPEC)
    stock = _images(pipe, "t2i", **SPARSE_GRID)
    base = dict(block_size=4, backend="gather")
    lite_boost.boost(pipe, BoostConfig(sparse=SparseConfig(sparsity=0.0, **base)))
    zero = _images(pipe, "t2i", **SPARSE_GRID)
    assert (zero - stock).abs().max().item() <= TOL
    lite_boost.boost(pipe, BoostConfig(sparse=SparseConfig(sparsity=0.75, **base)))
    sparse = _images(pipe, "t2i", **SPARSE_GRID)
    st = pipe.transformer._lite_boost.extras["sparse"]
    assert {e.path for e in st.events} == {"sparse"} and st.grid == (1, 8, 16)
    assert 0.3 < st.mean_effective_sparsity() < 0.75  # text rows / columns forced dense
    assert (sparse - stock).abs().max() > 1e-4 and torch.isfinite(sparse).all()
    # a padded text mask runs the call dense (the block-sparse kernel takes no mask), with the reason
    _images(pipe, "t2i", batch=2, valid=[7, 3], **SPARSE_GRID)
    assert {e.reason for e in st.events} == {"the text has a key-padding mask (the block-sparse kernel takes none)"}


def test_sparse_edit_grid_counts_the_condition_image():
    """Edit with a condition image of the output's size: one (2, h, w) grid, both images windowed."""
    pipe = tiny_qwen_image_pipeline("edit", spec=SPEC)
    lite_boost.boost(pipe, BoostConfig(sparse=SparseConfig(sparsity=0.75, block_size=4, backend="gather",
                                                           keep_sink=False)))
    out = _images(pipe, "edit", height=32, width=64)  # the condition image is 32 x 64 too: 4 x 8 tokens each
    st = pipe.transformer._lite_boost.extras["sparse"]
    assert st.grid == (2, 4, 8) and {e.path for e in st.events} == {"sparse"} and torch.isfinite(out).all()
    _images(pipe, "edit")  # a 3 x 5 target with a 4 x 8 condition: no common grid, dense
    assert st.grid is None and {e.path for e in st.events} == {"dense"}


def test_sparse_joint_attention_keeps_text_rows_and_columns_dense():
    """The text queries attend every image key, and every image query attends every text key."""
    from lite_boost.adapter.sparse import ScheduledSparseAttention, SparseState
    from lite_boost.ops.joint import joint_attention
    from lite_boost.schedule import SparseSchedule
    import _dist_joint_cases as jc

    cfg = SparseConfig(sparsity=0.75, block_size=4, backend="gather", keep_sink=False)
    state = SparseState(cfg, SparseSchedule(cfg))
    state.grid = (1, 6, 8)
    fn = ScheduledSparseAttention(0, state, None)
    (q, k, v), joint = jc.make_case(0, 1, 48, 5, 2, 8, False, True)
    out, text_out = fn(q, k, v, joint=joint)
    ref, ref_text = joint_attention(jc.sdpa_kernel, q, k, v, joint)
    assert state.events[-1].path == "sparse" and state.events[-1].effective_sparsity > 0.3
    assert (text_out - ref_text).abs().max() < TOL  # text rows: dense
    # an image query's output without the text keys would differ: they are kept (compare to a text-free run)
    no_text = jc.sdpa_kernel(q, k, v)
    assert (out - no_text).abs().max() > 1e-2


def test_sparse_on_a_family_without_a_sparse_path_names_the_option():
    from lite_boost.adapter import AttentionSite, ModelFamily

    fam = ModelFamily("toy", transformers=("ToyModel",), attention=(AttentionSite("blocks.*.attn", QwenImageJointProcessor,
                                                                                  "self"),))
    with pytest.raises(ConfigError, match=r"sparse \(BoostConfig.sparse\) is not supported for the toy family "
                                          r"\(no latent token grid declared\); families with sparse: \['wan', 'qwen-image'[^]]*\]"):
        fam.check_config(BoostConfig(sparse=SparseConfig()))


# --------------------------------------------------------------------------------------------- caching
CACHES = {
    "first_block_cache": {"threshold": 0.5},  # decisions flip between steps at this threshold
    "taylorseer_cache": {"cache_interval": 2, "disable_cache_before_step": 1},
    "mag_cache": {"mag_ratios": [1.0, 0.99, 0.98, 0.97], "num_inference_steps": 4, "threshold": 0.5,
                  "max_skip_steps": 2},
}


@pytest.mark.parametrize("method", sorted(CACHES))
def test_step_cache_equals_the_stock_diffusers_hook(method):
    from lite_boost.cache import build_diffusers_config, count_block_work

    kw = dict(steps=4)
    stock_pipe = tiny_qwen_image_pipeline("t2i", spec=SPEC)
    plain = _images(stock_pipe, "t2i", **kw)
    dcfg = build_diffusers_config(method, CACHES[method])
    stock_pipe.transformer.enable_cache(dcfg)
    stock = _images(stock_pipe, "t2i", **kw)
    pipe = lite_boost.boost(tiny_qwen_image_pipeline("t2i", spec=SPEC), {"cache": {"method": method, **CACHES[method]}})
    with count_block_work([pipe.transformer], blocks="transformer_blocks", ffn="img_mlp", attn="attn") as work:
        got = _images(pipe, "t2i", **kw)
    assert (got - stock).abs().max().item() <= TOL
    assert (stock - plain).abs().max() > 1e-5  # the cache really skipped work ...
    assert work.ffn_runs < work.calls or work.attn_runs < work.calls * 2, work.summary()  # ... here too
    assert (_images(pipe, "t2i", **kw) - got).abs().max().item() == 0.0  # fresh cache state per pipeline call


def test_cache_methods_qwen_image_refuses_name_the_reason():
    pipe = tiny_qwen_image_pipeline("t2i")
    with pytest.raises(ConfigError, match=r"'faster_cache'|accepted methods"):
        lite_boost.boost(pipe, {"cache": "faster_cache"})
    with pytest.raises(ConfigError, match=r"sea_cache' is not supported for QwenImagePipeline \(diffusers' SeaCache"):
        lite_boost.boost(pipe, {"cache": "sea_cache"})
    with pytest.raises(ConfigError, match=r"pyramid_attention_broadcast' is not supported .*text lengths differ"):
        lite_boost.boost(pipe, {"cache": "pyramid_attention_broadcast"})
    assert not lite_boost.api.is_boosted(pipe)


# --------------------------------------------------------------------------------------------- compile
@pytest.fixture
def _fresh_dynamo():
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
    torch._dynamo.reset()


@pytest.mark.parametrize("kind", ["sparse", "masked", "edit2511"])  # stock, dense: test_family_contract.py
def test_explain_reports_no_graph_break(kind, _fresh_dynamo):
    spec = TinyQwenImageSpec(heads=3, zero_cond_t=kind == "edit2511")
    model = tiny_qwen_image_transformer(spec)
    if kind != "stock":
        lite_boost.boost(model, BoostConfig(sparse=SparseConfig(sparsity=0.75, block_size=4, backend="gather"))
                         if kind == "sparse" else None)
    inputs = cases.transformer_inputs(spec, grid=(4, 8), masked=kind == "masked",
                                      condition=(4, 8) if kind == "edit2511" else None)
    with torch.no_grad():
        report = torch._dynamo.explain(model)(**inputs)
    reasons = [r.reason.splitlines()[0] for r in report.break_reasons]
    assert report.graph_break_count == 0 and report.graph_count == 1, reasons


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sparse"])  # dense: tests/test_family_contract.py
def test_compile_repeated_blocks_fullgraph_matches_eager(kind, _fresh_dynamo):
    """diffusers' regional compile recipe with inductor on a boosted transformer, two steps."""
    model = tiny_qwen_image_transformer(SPEC)
    config = BoostConfig(sparse=SparseConfig(sparsity=0.75, block_size=4, backend="gather")) if kind == "sparse" else None
    lite_boost.boost(model, config)
    inputs = cases.transformer_inputs(SPEC, grid=(4, 8))
    steps = [torch.tensor([0.9]), torch.tensor([0.6])]
    check_regional_compile(model, inputs, steps, sparse=kind == "sparse")


# --------------------------------------------------------------------------------------------- registry
def test_family_is_registered_with_its_features():
    from lite_boost.models import SUPPORTED_MODELS
    from lite_boost.models.qwenimage import QWEN_IMAGE
    from lite_boost.registry import families, family_of

    for name in ("QwenImagePipeline", "QwenImageEditPipeline", "QwenImageEditPlusPipeline"):
        assert SUPPORTED_MODELS[name] is QWEN_IMAGE.boost_pipeline
    assert SUPPORTED_MODELS["QwenImageTransformer2DModel"] is QWEN_IMAGE.boost_transformer
    assert [f.name for f in families()][:2] == ["wan", "qwen-image"]
    assert family_of(tiny_qwen_image_pipeline("t2i")) is QWEN_IMAGE
    features = QWEN_IMAGE.features
    assert all(features[f] is None for f in ("dense", "sparse", "sequence_parallel", "cfg_parallel", "step_cache",
                                             "compile", "quant", "parallel_vae"))
    assert QWEN_IMAGE.quant_patterns == ("transformer_blocks.*",)


def test_lite_boost_models_lists_the_families_and_their_features(capsys):
    from lite_boost.cli import main

    assert main(["models"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("| qwen-image |"))
    assert "QwenImageEditPlusPipeline" in row and "| text_first | separate |" in row
    assert row.count("| yes") == 8 and row.count("| no") == 0  # parallel_vae too (the Wan 2.1 VAE structure)
    assert "qwen-image: step caches first_block_cache, mag_cache, taylorseer_cache" in out
    assert "| wan |" in out
