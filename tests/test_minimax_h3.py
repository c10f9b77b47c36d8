"""MiniMax-H3 (one process): what only this family does.

The packed layouts come from diffusers' own modular-pipeline steps (tests/_tiny_minimax_h3.py). The contract
(boost = stock, unboost, save / load, bf16, compile) is the ``minimax-h3`` row of tests/test_family_contract.py;
multi-process parity is tests/test_parallel_minimax_h3.py.
"""

import warnings

import pytest
import torch

import _tiny_minimax_h3 as mm
import lite_boost
from conftest import check_regional_compile
from lite_boost import BoostConfig, SparseConfig
from lite_boost.models.minimax_h3 import MINIMAX_H3, packed_video_grid

TOL = 1e-5
LARGE = dict(frames=4, height=16, width=16, text=7, audio_latents=5)  # 7 + 64 + 10 rows before 4 x 8 x 8 video


def _sparse(sparsity=0.5):
    return BoostConfig(sparse=SparseConfig(sparsity=sparsity, block_size=16, dense_steps_first=0, dense_steps_last=0,
                                           min_seq_len=0))


def _diff(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a, b))


@pytest.mark.parametrize("shape", [dict(anchors=()), dict(anchors=("first", "last")), dict(batch=2, text=9)])
@torch.no_grad()
def test_boosted_equals_stock_on_the_pipeline_layouts(shape):
    """Both outputs (video and audio rows) at the t2va layout without / with two keyframes, and a batch of 2."""
    stock, model = mm.transformer(), lite_boost.boost(mm.transformer())
    x = mm.transformer_inputs(**shape)
    ref = stock(**x, return_dict=False)
    assert _diff(model(**x, return_dict=False), ref) <= TOL
    state = model._lite_boost
    assert state.rope_patched and len(state.processors) == 4  # 2 blocks + 2 token-refiner blocks
    assert [p.role for p in state.self_attention_processors] == ["self", "self"]
    model(**x, return_dict=False)
    assert state.rope_cache.hits >= 1


@torch.no_grad()
def test_rope_is_the_models_own_in_fp32_and_fused_projections():
    """The cached tables are the module's own (cos, sin), served per row range with identity rows past the end;
    rotating in pair order after interleaving the rotary halves equals diffusers' rotate-half; fused QKV works."""
    stock, model = mm.transformer(), mm.transformer()
    stock.fuse_qkv_projections()
    model.fuse_qkv_projections()
    lite_boost.boost(model)
    x = mm.transformer_inputs()
    assert _diff(model(**x, return_dict=False), stock(**x, return_dict=False)) <= TOL
    pos = x["position_ids"]
    cos, sin = stock.rope(pos)
    state = model._lite_boost
    state.rope_range = lambda n: (60, 80)  # a sequence-parallel slice past the end of the 71 rows
    table = model.rope(pos)
    half = cos.shape[-1] // 2
    assert torch.equal(table.freqs[0, :11, 0], torch.complex(cos[60:, :half], sin[60:, :half]))
    assert (table.freqs[0, 11:] == 1).all()
    state.rope_range = None
    hidden = torch.randn(1, pos.shape[0], 24)
    mine, ref = model.transformer_blocks[1].attn, stock.transformer_blocks[1].attn
    assert (mine(hidden, model.rope(pos)) - ref(hidden, (cos, sin))).abs().max() <= TOL
    assert (mine(hidden, (cos, sin)) - ref(hidden, (cos, sin))).abs().max() <= TOL  # diffusers' tables too
    with pytest.raises(ValueError, match="does not accept attention_mask"):
        mine(hidden, (cos, sin), torch.ones(1, pos.shape[0], pos.shape[0]))


def test_packed_video_grid_reads_the_target_video_behind_the_other_rows():
    for shape, want in [({}, (3, 3, 5, 5 + 15 + 6)), (LARGE, (4, 8, 8, 7 + 64 + 10)),
                        (dict(anchors=()), (3, 3, 5, 5 + 6))]:
        lay, _ = mm.layout(**shape)
        assert packed_video_grid(lay["position_ids"], lay["video_indices"]) == want
    lay, _ = mm.layout()
    shuffled = lay["position_ids"].clone()
    shuffled[-3:] = shuffled[-3:].flip(0)  # the last frame is no raster any more
    assert packed_video_grid(shuffled, lay["video_indices"]) is None
    assert packed_video_grid(lay["position_ids"], lay["video_indices"][:-1]) is None  # no video row at the end


@torch.no_grad()
def test_sparsity_zero_equals_stock_and_the_sparse_layout_is_the_packed_one(monkeypatch):
    """sparsity 0 = dense (stock); at 0.5 the kernel gets the target video grid and every row in front of it
    (text, keyframe condition, audio) as its dense lead; the output then differs from dense."""
    import lite_boost.adapter.sparse as sparse_mod

    x = mm.transformer_inputs(**LARGE)
    stock = mm.transformer()
    ref = stock(**x, return_dict=False)
    zero = lite_boost.boost(mm.transformer(), _sparse(0.0))
    assert _diff(zero(**x, return_dict=False), ref) <= TOL
    calls = []
    real = sparse_mod.sparse_attention

    def spy(q, k, v, **kw):
        calls.append((q.shape[1], kw["txt_len"], kw["latent_shape_q"]))
        return real(q, k, v, **kw)

    monkeypatch.setattr(sparse_mod, "sparse_attention", spy)
    model = lite_boost.boost(mm.transformer(), _sparse(0.5))
    got = model(**x, return_dict=False)
    assert calls == [(337, 81, (4, 8, 8))] * 2  # the two blocks; the token refiner never goes sparse
    st = model._lite_boost.extras["sparse"]
    assert {e.path for e in st.events} == {"sparse"} and st.mean_effective_sparsity() > 0.1
    assert _diff(got, ref) > 1e-4


@torch.no_grad()
def test_a_layout_without_a_video_raster_runs_dense():
    """diffusers' own test inputs end with video rows whose positions are no frame raster of the packed grid we
    read as such only when they are one; a call with video rows not at the end runs dense."""
    x = mm.transformer_inputs(**LARGE)
    n = x["position_ids"].shape[0]
    order = torch.cat([torch.arange(n - 10, n), torch.arange(0, n - 10)])  # move the last 10 rows to the front
    inverse = torch.argsort(order)
    y = dict(x, position_ids=x["position_ids"][order], token_tags=x["token_tags"][order],
             timestep_indices=x["timestep_indices"][order],
             **{k: inverse[x[k]] for k in ("video_indices", "audio_indices", "text_indices")})
    stock, model = mm.transformer(), lite_boost.boost(mm.transformer(), _sparse(0.5))
    assert _diff(model(**y, return_dict=False), stock(**y, return_dict=False)) <= TOL
    assert {e.path for e in model._lite_boost.extras["sparse"].events} == {"dense"}


CACHES = {"taylorseer_cache": {"cache_interval": 2, "disable_cache_before_step": 1},
          "pyramid_attention_broadcast": {"spatial_attention_block_skip_range": 2,
                                          "spatial_attention_timestep_skip_range": (0.0, 1.0)}}
STEPS = (0.9, 0.7, 0.5, 0.3)  # MiniMax-H3's timesteps are in [0, 1], unscaled


def _steps(model, x, now=None):
    outs = []
    with torch.no_grad(), model.cache_context("cond"):
        for t in STEPS:
            if now is not None:
                now.append(t)
            outs.append(model(**{**x, "timestep": torch.full_like(x["timestep"], t)}, return_dict=False))
    return outs


@pytest.mark.parametrize("method", sorted(CACHES))
def test_step_cache_equals_the_stock_diffusers_hook(method):
    from lite_boost.cache import build_diffusers_config

    x = mm.transformer_inputs()
    stock = mm.transformer()
    plain = _steps(stock, x)
    now = []
    stock.enable_cache(build_diffusers_config(method, CACHES[method], current_timestep_callback=lambda: now[-1]))
    ref = _steps(stock, x, now)
    model = lite_boost.boost(mm.transformer(), {"cache": {"method": method, **CACHES[method]}})
    got = _steps(model, x)
    assert max(_diff(g, r) for g, r in zip(got, ref)) <= TOL
    assert max(_diff(r, p) for r, p in zip(ref, plain)) > 1e-5  # the hook skipped or approximated something


@pytest.fixture
def _fresh_dynamo():
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
    torch._dynamo.reset()


@pytest.mark.slow
def test_compile_repeated_blocks_fullgraph_sparse_matches_eager(_fresh_dynamo):
    """diffusers' regional compile recipe (inductor, fullgraph) on the block-sparse boost: every block sparse."""
    model = lite_boost.boost(mm.transformer(), _sparse(0.5))
    x = mm.transformer_inputs(**LARGE)
    check_regional_compile(model, x, [torch.full_like(x["timestep"], t) for t in (0.9, 0.6)], sparse=True)


def test_block_cache_methods_are_refused_with_the_reason():
    from lite_boost import ConfigError

    for cache in ("first_block_cache", {"method": "mag_cache", "mag_ratios": [1.0, 0.9], "num_inference_steps": 2}):
        with pytest.raises(ConfigError, match="block hooks do not know MiniMaxH3TransformerBlock"):
            lite_boost.boost(mm.transformer(), {"cache": cache})


@torch.no_grad()
def test_default_quantization_is_the_linear_layers_of_the_blocks_and_the_token_refiner():
    """int8 dynamic quantization by default: every Linear of the transformer blocks and of the token refiner
    blocks (the model's _repeated_blocks), nothing else; the output stays close to stock and unboost restores it."""
    import lite_boost.quant as Q

    x = mm.transformer_inputs()
    stock = mm.transformer()
    ref = stock(**x, return_dict=False)[0]
    model = lite_boost.boost(mm.transformer(), {"quant": "int8_dynamic"})
    layers = set(Q.quant_state(model).layers)
    want = {n for n, m in stock.named_modules() if isinstance(m, torch.nn.Linear)
            and (n.startswith("transformer_blocks.") or n.startswith("token_refiner.refiner_blocks."))}
    assert layers == want and any(n.startswith("token_refiner.") for n in layers)
    got = model(**x, return_dict=False)[0]
    assert ((got - ref).norm() / ref.norm()).item() < 0.05
    lite_boost.unboost(model)
    assert torch.equal(model(**x, return_dict=False)[0], ref)


# ------------------------------------------------------------------------------------------ the modular pipeline
def _latents(pipe, **kw):
    out = pipe(**mm.call_kwargs(**kw))
    return out["latents"], out["audio_latents"]


def test_boosted_modular_pipeline_equals_stock_and_sparsity_zero_too():
    """diffusers' t2va core denoise workflow (a MiniMaxH3ModularPipeline, prompt embeddings in, latents out):
    boost(pipe) = stock on both latents; sparsity 0 = stock with the grid and lead read from the pipeline's layout
    (6 text + 414 audio rows in front of 37 x 2 x 3 video tokens)."""
    ref = _latents(mm.pipeline())
    pipe = lite_boost.boost(mm.pipeline())
    assert pipe.transformer._lite_boost.family is MINIMAX_H3
    assert _diff(_latents(pipe), ref) <= TOL
    lite_boost.unboost(pipe)
    assert _diff(_latents(pipe), ref) == 0
    zero = lite_boost.boost(mm.pipeline(), _sparse(0.0))
    assert _diff(_latents(zero), ref) <= TOL
    st = zero.transformer._lite_boost.extras["sparse"]
    assert (st.grid, st.lead) == ((37, 2, 3), 6 + 414)
    sparse = lite_boost.boost(mm.pipeline(), _sparse(0.5))
    assert _diff(_latents(sparse), ref) > 1e-5
    assert {e.path for e in sparse.transformer._lite_boost.extras["sparse"].events} == {"sparse"}


def test_modular_pipeline_refusals_name_the_reason():
    from lite_boost import ConfigError
    from lite_boost.parallel import ParallelManager

    with pytest.raises(ConfigError, match="without cache_context"):
        lite_boost.boost(mm.pipeline(), {"cache": "taylorseer_cache"})
    with pytest.raises(ConfigError, match=r"cfg_degree=2 needs a pipeline that runs classifier-free guidance; "
                                          r"MiniMaxH3ModularPipeline is not one \(the checkpoint is guidance-distilled"):
        ParallelManager(mm.pipeline(), {"parallel": {"cfg_degree": 2}})


def test_family_is_registered_with_its_features():
    from lite_boost.registry import family_of

    assert family_of(mm.transformer()) is MINIMAX_H3 and MINIMAX_H3.joint == "packed"
    f = MINIMAX_H3.features
    for feature in ("dense", "sparse", "sequence_parallel", "step_cache", "compile", "quant"):
        assert f[feature] is None, (feature, f[feature])
