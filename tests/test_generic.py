"""The generic path: every installed diffusers transformer class boosted exactly, or refused with the reason.

The tiny configurations and inputs are diffusers' own (each class's ``*TesterConfig`` in diffusers'
``tests/models/transformers``, stored in tests/data/diffusers_tiny.pt). For every class: a class lite_boost
claims (a named family, or the generic path) runs one forward boosted and equals the stock model within 1e-5
in fp32, and on the generic path lite_boost's attention backend really ran; a class it does not claim is
refused with an error naming the class and why, and ``lite-boost models``' static reading of the class agrees.
"""

import copy

import pytest
import torch

import lite_boost
from _diffusers_tiny import build, case_names, inputs, model_class
from lite_boost.registry import UnsupportedModelError, family_of

TOL = 1e-5
# Tiny configs too slow for the suite on 2 shared cores (checked in diffusers' own tests instead).
SLOW = {"PRXTransformer2DModel": "its tiny config takes about 11 s to build and 5 s per forward on 2 CPU cores"}
CASES = [n for n in case_names() if model_class(n) is not None]


def _first(out):
    if isinstance(out, (tuple, list)):
        return _first(out[0])
    if hasattr(out, "to_tuple"):
        return _first(out.to_tuple())
    return out


class _Count:
    """Wraps an attention backend function and counts its calls."""

    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.fn(*args, **kwargs)


@pytest.mark.parametrize("name", CASES)
@torch.no_grad()
def test_boosted_equals_stock_or_refused(name):
    if name in SLOW:
        pytest.skip(SLOW[name])
    from lite_boost.adapter.generic import class_problem, generic_context

    stock = build(name)
    boosted = copy.deepcopy(stock)
    try:
        lite_boost.boost(boosted)
    except UnsupportedModelError as exc:
        assert name in str(exc) and "dispatch_attention_fn" in str(exc), str(exc)
        assert class_problem(type(stock)) is not None, f"lite-boost models would list {name} as generic"
        return
    ctx = generic_context(boosted)
    counter = None
    if ctx is not None:  # the generic path: count the calls diffusers' dispatcher hands lite_boost's backend
        from diffusers.models.attention_dispatch import _AttentionBackendRegistry

        counter = _AttentionBackendRegistry._backends[ctx.name] = _Count(_AttentionBackendRegistry._backends[ctx.name])
        assert class_problem(type(stock)) is None, f"lite-boost models would not list {name} as generic"
    ref = _first(stock(**inputs(name)))
    out = _first(boosted(**inputs(name)))
    assert out.shape == ref.shape
    assert (out - ref).abs().max().item() <= TOL
    if counter is not None:
        assert counter.calls > 0, "lite_boost's attention backend never ran"
    lite_boost.unboost(boosted)
    assert getattr(boosted, "_lite_boost", None) is None


def test_thirty_classes_are_claimed():
    """At least 30 installed transformer classes have a boost path (named family or generic)."""
    from lite_boost.adapter.generic import class_problem, installed_transformer_classes
    from lite_boost.registry import SUPPORTED_MODELS

    claimed = [n for n, cls in installed_transformer_classes().items()
               if n in SUPPORTED_MODELS or class_problem(cls) is None]
    assert len(claimed) >= 30, claimed


# ------------------------------------------------------------------ one generic model, every feature
GEN = "SkyReelsV2Transformer3DModel"  # Wan-like video DiT, patch (1, 2, 2); its family is unregistered here


@pytest.fixture(autouse=True)
def _skyreels_on_the_generic_path(monkeypatch):
    """SkyReels-V2 has a family (lite_boost.models.skyreels_v2); these tests run it as a model without one."""
    from conftest import without_family

    without_family(monkeypatch, "skyreels-v2")


def _pair(name=GEN):
    stock = build(name)
    return stock, lite_boost.boost(copy.deepcopy(stock))


@torch.no_grad()
def test_generic_unboost_restores_processors_and_registry():
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

    from lite_boost.adapter.generic import generic_context

    stock, model = _pair()
    members = len(AttentionBackendName)
    name = generic_context(model).name
    assert name in _AttentionBackendRegistry._backends
    procs = [m.processor for m in model.modules() if hasattr(m, "set_processor")]
    assert all(p._attention_backend is name for p in procs)
    assert len(AttentionBackendName) == members and name.value not in AttentionBackendName._value2member_map_
    assert lite_boost.boost(model) is model and generic_context(model).name is name  # same config: no-op
    lite_boost.unboost(model)
    assert all(p._attention_backend is None for p in procs)
    assert name not in _AttentionBackendRegistry._backends
    assert (_first(model(**inputs(GEN))) - _first(stock(**inputs(GEN)))).abs().max().item() == 0


@torch.no_grad()
def test_generic_first_block_cache_equals_diffusers_hook():
    from diffusers.hooks import FirstBlockCacheConfig

    from lite_boost.config import ConfigError

    name = "MotifVideoTransformer3DModel"  # no family of its own; diffusers' block hooks know its blocks
    stock, model = _pair(name)
    stock.enable_cache(FirstBlockCacheConfig(threshold=0.2))
    lite_boost.boost(model, {"cache": {"method": "first_block_cache", "threshold": 0.2}})
    for t in (900, 800, 700):
        x = {**inputs(name), "timestep": torch.tensor([t])}
        with stock.cache_context("cond"), model.cache_context("cond"):
            assert (_first(model(**x)) - _first(stock(**x))).abs().max().item() <= TOL
    other = build(GEN)  # SkyReels-V2's blocks are unknown to diffusers' block hooks: refused, nothing changed
    with pytest.raises(ConfigError, match="SkyReelsV2TransformerBlock"):
        lite_boost.boost(other, {"cache": {"method": "first_block_cache"}})
    assert getattr(other, "_lite_boost", None) is None


@torch.no_grad()
def test_generic_quant_defaults_to_repeated_blocks():
    pytest.importorskip("torchao")
    from lite_boost.quant import quant_state

    stock, model = _pair()
    lite_boost.boost(model, {"quant": "int8_weight_only"})
    layers = quant_state(model).layers
    assert layers and all(n.startswith("blocks.") for n in layers)
    assert not any(n.startswith("proj_out") or n.startswith("condition_embedder") for n in layers)
    out, ref = _first(model(**inputs(GEN))), _first(stock(**inputs(GEN)))
    assert (out - ref).abs().max().item() < 0.05 * ref.abs().max().item()  # int8 weights: close, not equal
    lite_boost.unboost(model)
    assert (_first(model(**inputs(GEN))) - ref).abs().max().item() == 0


def test_generic_pipeline_refusal_names_the_class():
    from diffusers import AllegroTransformer3DModel  # attention not through the dispatcher

    model = build("AllegroTransformer3DModel")
    with pytest.raises(UnsupportedModelError, match="AllegroTransformer3DModel.*dispatch_attention_fn"):
        lite_boost.boost(model)
    assert isinstance(model, AllegroTransformer3DModel) and getattr(model, "_lite_boost", None) is None


# ------------------------------------------------------------------ block-sparse over the latent grid
SPARSE = {"sparse": {"sparsity": 0.5, "block_size": 16, "backend": "gather"}}


@torch.no_grad()
def test_generic_sparse_runs_on_the_grid_self_attention_only():
    stock, model = _pair()
    dense = lite_boost.boost(copy.deepcopy(stock), {"sparse": {"sparsity": 0.0, "block_size": 16}})
    ref = _first(stock(**inputs(GEN)))
    assert (_first(dense(**inputs(GEN))) - ref).abs().max().item() <= TOL  # sparsity 0 keeps every block
    lite_boost.boost(model, SPARSE)
    out = _first(model(**inputs(GEN)))
    events = model._lite_boost.extras["sparse"].events
    # one event per block's self-attention (the grid: 2 x 8 x 8 tokens); cross-attention never enters
    assert [(e.layer, e.path) for e in events] == [(0, "sparse"), (1, "sparse")]
    assert all(e.effective_sparsity > 0 for e in events)
    assert 0 < (out - ref).abs().max().item() < 0.5 * ref.abs().max().item()
    lite_boost.unboost(model)
    assert (_first(model(**inputs(GEN))) - ref).abs().max().item() <= TOL


@torch.no_grad()
def test_generic_sparse_compile_clean_and_regional_compile_equals_eager():
    stock, model = _pair()
    lite_boost.boost(model, SPARSE)
    x = inputs(GEN)
    eager = _first(model(**x))
    try:
        report = torch._dynamo.explain(model)(**x)
        assert report.graph_break_count == 0 and report.graph_count == 1, report.break_reasons
        torch._dynamo.reset()
        model.compile_repeated_blocks(fullgraph=True, backend="aot_eager")
        assert (_first(model(**x)) - eager).abs().max().item() <= TOL
        assert model._lite_boost.extras["sparse"].events[-1].path == "sparse"
    finally:
        torch._dynamo.reset()


@torch.no_grad()
def test_generic_sparse_refuses_unknown_layouts():
    from lite_boost.config import ConfigError

    # Chroma packs its latents as (B, S, C) and attends text and image tokens jointly: no grid to read
    model = lite_boost.boost(build("ChromaTransformer2DModel"), SPARSE)
    with pytest.raises(ConfigError, match="ChromaTransformer2DModel.*latent token grid.*packed"):
        model(**inputs("ChromaTransformer2DModel"))
    # a cache that skips single attention layers would shift the grid calls' order: refused before any change
    other = build(GEN)
    with pytest.raises(ConfigError, match="pyramid_attention_broadcast.*sparse"):
        lite_boost.boost(other, {**SPARSE, "cache": {"method": "pyramid_attention_broadcast"}})
    assert getattr(other, "_lite_boost", None) is None


# ------------------------------------------------------------------ discoverable: lite-boost models / generate
def test_models_lists_every_installed_transformer_class():
    from lite_boost.adapter.generic import installed_transformer_classes
    from lite_boost.cli import installed_classes_report

    report = installed_classes_report()
    classes = installed_transformer_classes()
    assert len(classes) >= 60
    rows = {line.split(" | ")[0].lstrip("| "): line for line in report.splitlines() if line.startswith("| ")}
    assert set(classes) <= set(rows)
    assert "| family wan |" in rows["WanTransformer3DModel"]
    assert "| generic | yes |" in rows[GEN]
    assert "| no |" in rows["AllegroTransformer3DModel"] and "dispatch_attention_fn" in rows["AllegroTransformer3DModel"]


def _tiny_skyreels_pipeline():
    from diffusers import SkyReelsV2Pipeline, SkyReelsV2Transformer3DModel, UniPCMultistepScheduler

    from lite_boost.demo import tiny_wan_pipeline

    wan = tiny_wan_pipeline("t2v")
    torch.manual_seed(0)
    transformer = SkyReelsV2Transformer3DModel(num_attention_heads=3, attention_head_dim=24, in_channels=16,
                                               out_channels=16, text_dim=32, freq_dim=32, ffn_dim=64, num_layers=2,
                                               rope_max_seq_len=64).eval()
    return SkyReelsV2Pipeline(tokenizer=wan.tokenizer, text_encoder=wan.text_encoder, transformer=transformer,
                              vae=wan.vae, scheduler=UniPCMultistepScheduler(flow_shift=3.0, prediction_type="flow_prediction",
                                                                             use_flow_sigmas=True))


def test_generate_model_runs_a_generic_pipeline(tmp_path, capsys):
    import re

    from lite_boost.cli import main

    folder = tmp_path / "skyreels"
    _tiny_skyreels_pipeline().save_pretrained(folder)
    assert main(["generate", "--model", str(folder), "--height", "32", "--width", "32", "--num-frames", "5",
                 "--steps", "2", "--warmup", "0", "--output", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert f"{folder} (SkyReelsV2Pipeline, the generic family)" in out
    diff = float(re.search(r"max \|boosted - stock\| over the video \(values in \[0, 1\]\): (\S+)", out).group(1))
    assert diff <= 1e-5
