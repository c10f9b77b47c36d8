"""diffusers' loaders on boosted models: LoRA (load, set_adapters, fuse / unfuse, unload; before or after boosting;
with quantization), processor swaps, attention-backend switches and IP-Adapters.

Reference: the stock pipeline / model put through the same loader calls (with quantization: the stock model
quantized by torchao itself on the same layers). What a boosted model cannot take is refused with a LoaderError
before anything changes (the outputs and the module tree are checked after the refusal).
"""

import copy

import pytest
import torch

import lite_boost
from _lora import lora_state_dict
from lite_boost.errors import LoaderError

peft = pytest.importorskip("peft")
TOL = 1e-5


def _diff(a, b) -> float:
    return (a - b).abs().max().item()


# -------------------------------------------------------------------------------------------- Wan (a family)
def _wan():
    from lite_boost.demo import tiny_wan_pipeline

    return tiny_wan_pipeline()


def _run(pipe, steps=2):
    return pipe(prompt="a cat", negative_prompt="", height=16, width=16, num_frames=1, num_inference_steps=steps,
                guidance_scale=1.0, generator=torch.Generator().manual_seed(0), output_type="latent").frames


def _boosted_processors(pipe) -> bool:
    from lite_boost.adapter.processor import LiteBoostProcessor

    return lite_boost.api.is_boosted(pipe) and all(
        isinstance(m.processor, LiteBoostProcessor) for m in pipe.transformer.modules() if hasattr(m, "set_processor"))


@pytest.mark.parametrize("order", ["after", "before"])
@torch.no_grad()
def test_wan_lora_lifecycle_equals_stock(order):
    """load two LoRAs, set_adapters with weights, fuse, unfuse, unload, unboost: each state equals stock's."""
    stock, pipe = _wan(), _wan()
    lora_a, lora_b = lora_state_dict(stock.transformer, 1), lora_state_dict(stock.transformer, 2)
    base = _run(stock)
    if order == "after":
        lite_boost.boost(pipe)
    for p in (stock, pipe):
        p.load_lora_weights(lora_a, adapter_name="a")
        p.load_lora_weights(lora_b, adapter_name="b")
    if order == "before":
        lite_boost.boost(pipe)
    assert _boosted_processors(pipe)
    steps = [("both", lambda p: None),
             ("weights", lambda p: p.set_adapters(["a", "b"], adapter_weights=[0.7, -0.4])),
             ("fused", lambda p: p.fuse_lora(lora_scale=0.8)),
             ("unfused", lambda p: p.unfuse_lora()),
             ("only a", lambda p: p.set_adapters("a")),
             ("unloaded", lambda p: p.unload_lora_weights())]
    for what, step in steps:
        step(stock), step(pipe)
        ref = _run(stock)
        assert _diff(ref, base) > 1e-3 or what == "unloaded", what  # the LoRA does change the output
        assert _diff(_run(pipe), ref) <= TOL, what
        assert _boosted_processors(pipe), what
    assert _diff(_run(pipe), base) <= TOL
    lite_boost.unboost(pipe)
    assert _diff(_run(pipe), _run(stock)) == 0  # the same weights (fuse / unfuse rounded both alike)


def _quantized_stock(pipe, layers):
    """The stock reference of BoostConfig(quant="int8_weight_only"): torchao's own quantize_ on the same layers."""
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    wanted = set(layers)
    quantize_(pipe.transformer, Int8WeightOnlyConfig(), filter_fn=lambda m, fqn: fqn in wanted)
    return pipe


@pytest.mark.parametrize("order", ["after", "before"])
@torch.no_grad()
def test_wan_lora_with_quant_runs_and_refuses_fusing(order):
    pytest.importorskip("torchao")
    from lite_boost.quant import quant_state

    stock, pipe, fp = _wan(), _wan(), _wan()
    lora = lora_state_dict(stock.transformer, 1)
    if order == "before":
        pipe.load_lora_weights(lora, adapter_name="a")
    lite_boost.boost(pipe, {"quant": "int8_weight_only"})
    layers = [n.removesuffix(".base_layer") for n in quant_state(pipe.transformer).layers]
    assert not any("lora_" in n for n in layers)  # the LoRA's own layers stay in full precision
    if order == "after":
        pipe.load_lora_weights(lora, adapter_name="a")
    _quantized_stock(stock, layers).load_lora_weights(lora, adapter_name="a")
    ref = _run(stock)
    out = _run(pipe)
    assert _diff(out, ref) <= TOL
    fp.load_lora_weights(lora, adapter_name="a")
    assert 0 < _diff(out, _run(fp)) < 0.1  # quantized, close to the full-precision LoRA run

    tree = [n for n, _ in pipe.transformer.named_modules()]
    for call in (pipe.fuse_lora, pipe.unfuse_lora, pipe.transformer.fuse_lora):
        with pytest.raises(LoaderError, match=r"quant='int8_weight_only'.*fuse before boosting"):
            call()
    assert [n for n, _ in pipe.transformer.named_modules()] == tree
    assert not any(getattr(m, "merged", False) for m in pipe.transformer.modules())
    assert _diff(_run(pipe), ref) == 0
    pipe.set_adapters("a", adapter_weights=0.5)  # the rest of the LoRA API works
    stock.set_adapters("a", adapter_weights=0.5)
    assert _diff(_run(pipe), _run(stock)) <= TOL
    pipe.set_adapters("a", adapter_weights=1.0)

    lite_boost.unboost(pipe)  # the full-precision weights come back under the LoRA
    assert _diff(_run(pipe), _run(fp)) <= TOL
    pipe.unload_lora_weights()
    fp.unload_lora_weights()
    assert _diff(_run(pipe), _run(fp)) == 0


@torch.no_grad()
def test_wan_lora_fused_before_quant_boost():
    """The refusal's advice: load, fuse, unload the LoRA, then boost with quant (= torchao on the fused weights)."""
    pytest.importorskip("torchao")
    from lite_boost.quant import quant_state

    stock, pipe = _wan(), _wan()
    lora = lora_state_dict(stock.transformer, 3)
    for p in (stock, pipe):
        p.load_lora_weights(lora, adapter_name="a")
        p.fuse_lora()
        p.unload_lora_weights()
    lite_boost.boost(pipe, {"quant": "int8_weight_only"})
    _quantized_stock(stock, quant_state(pipe.transformer).layers)
    assert _diff(_run(pipe), _run(stock)) <= TOL


@torch.no_grad()
def test_family_processor_swap_and_backend_switch_are_refused():
    from diffusers.models.transformers.transformer_wan import WanAttnProcessor

    pipe = _wan()
    base = _run(pipe)
    lite_boost.boost(pipe)
    ref = _run(pipe)
    model = pipe.transformer
    procs = [m.processor for m in model.modules() if hasattr(m, "set_processor")]
    with pytest.raises(LoaderError, match=r"set_attn_processor: WanTransformer3DModel is boosted by lite_boost "
                                          r"\(the wan family\).*lite_boost.unboost"):
        model.set_attn_processor(WanAttnProcessor())
    with pytest.raises(LoaderError, match=r"set_attn_processor"):
        model.set_default_attn_processor() if hasattr(model, "set_default_attn_processor") else \
            model.set_attn_processor(WanAttnProcessor())
    with pytest.raises(LoaderError, match=r"set_attention_backend: .*attention_backend=None"):
        model.set_attention_backend("native")
    with pytest.raises(LoaderError, match=r"reset_attention_backend: .*attention_backend=None"):
        model.reset_attention_backend()
    assert [m.processor for m in model.modules() if hasattr(m, "set_processor")] == procs
    assert _diff(_run(pipe), ref) == 0
    lite_boost.unboost(pipe)  # the guards go with the boost
    assert "set_attn_processor" not in model.__dict__ and "fuse_lora" not in pipe.__dict__
    model.set_attn_processor(WanAttnProcessor())
    model.set_attention_backend("native")
    assert _diff(_run(pipe), base) <= TOL


def test_processor_dict_of_the_wrong_length_is_a_value_error_as_on_stock():
    """A bad argument is reported as such (ValueError naming both counts, as stock diffusers does), before the
    refusal of the swap itself; nothing changes (diffusers' own attention tests check this on a boosted model)."""
    from diffusers.models.transformers.transformer_wan import WanAttnProcessor

    stock, pipe = _wan().transformer, _wan()
    lite_boost.boost(pipe)
    model = pipe.transformer
    layers = len(stock.attn_processors)
    wrong = {next(iter(stock.attn_processors)): WanAttnProcessor()}
    with pytest.raises(ValueError, match="number of processors"):
        stock.set_attn_processor(wrong)
    procs = dict(model.attn_processors)
    with pytest.raises(ValueError, match=rf"number of processors in the dict \(1\) does not match the number of "
                                         rf"attention layers of WanTransformer3DModel \({layers}\)") as err:
        model.set_attn_processor(wrong)
    assert not isinstance(err.value, LoaderError)
    assert dict(model.attn_processors) == procs


@torch.no_grad()
def test_fusing_that_swaps_processors_is_refused_before_the_projections_fuse():
    """CogVideoX's fuse_qkv_projections fuses the projections, then swaps in diffusers' fused processors: on a
    family-boosted model it is refused before the fusion (no to_qkv appears, the output stays stock's); a model
    whose fusion swaps nothing (Flux.1) fuses boosted and still equals stock."""
    import _tiny_cogvideox as T
    import _tiny_flux as TF

    spec = T.TinyCogSpec()
    x = T.transformer_inputs(spec)
    stock, model = T.tiny_transformer(spec), lite_boost.boost(T.tiny_transformer(spec))
    ref = stock(**x, return_dict=False)[0]
    with pytest.raises(LoaderError, match=r"fuse_qkv_projections \(which swaps in diffusers' fused attention "
                                          r"processors\): CogVideoXTransformer3DModel is boosted by lite_boost "
                                          r"\(the cogvideox family\)"):
        model.fuse_qkv_projections()
    assert not any(hasattr(m, "to_qkv") or getattr(m, "fused_projections", False) for m in model.modules())
    assert _diff(model(**x, return_dict=False)[0], ref) <= TOL
    lite_boost.unboost(model)
    model.fuse_qkv_projections()  # the stock model fuses as before
    assert _diff(model(**x, return_dict=False)[0], ref) <= 1e-4

    fx = TF.transformer_inputs()
    stock, model = TF.transformer(), lite_boost.boost(TF.transformer())
    ref = stock(**fx, return_dict=False)[0]
    model.fuse_qkv_projections()
    assert any(getattr(m, "fused_projections", False) for m in model.modules())
    assert _diff(model(**fx, return_dict=False)[0], ref) <= 1e-4


# ------------------------------------------------------------------------------------- Flux IP-Adapter
@torch.no_grad()
def test_flux_ip_adapter_on_boosted_pipeline_is_refused_before_anything_changes():
    import _tiny_flux

    pipe = lite_boost.boost(_tiny_flux.pipeline())
    model = pipe.transformer
    components = dict(pipe.components)
    procs = [m.processor for m in model.modules() if hasattr(m, "set_processor")]
    with pytest.raises(LoaderError, match=r"load_ip_adapter: FluxTransformer2DModel is boosted by lite_boost "
                                          r"\(the flux family\).*IP-Adapter.*Load the IP-Adapter before boosting"):
        pipe.load_ip_adapter({"image_proj": {}, "ip_adapter": {}}, weight_name="ip_adapter.safetensors")
    with pytest.raises(LoaderError, match=r"load_ip_adapter"):  # the transformer's own loader, called directly
        model._load_ip_adapter_weights([{"image_proj": {}, "ip_adapter": {}}])
    assert dict(pipe.components) == components and getattr(model, "encoder_hid_proj", None) is None
    assert [m.processor for m in model.modules() if hasattr(m, "set_processor")] == procs


@torch.no_grad()
def test_flux_ip_adapter_loaded_before_boost_runs_on_the_generic_path_equal_to_stock():
    """An IP-Adapter loaded before boosting: the model goes to the generic path (diffusers' IP-Adapter processors, both
    their attentions through lite_boost's backend); set_ip_adapter_scale, unload_ip_adapter, unboost equal stock."""
    import _tiny_flux as tf

    from lite_boost.adapter.generic import generic_context
    from lite_boost.registry import family_of

    stock, pipe = tf.pipeline(), tf.pipeline()
    emb, neg = torch.randn(1, 1, 8, generator=torch.Generator().manual_seed(3)), torch.zeros(1, 1, 8)
    for p in (stock, pipe):
        p.load_ip_adapter(tf.ip_adapter(p.transformer, 1), weight_name="ip_adapter.safetensors",
                          image_encoder_pretrained_model_name_or_path=None)
        p.set_ip_adapter_scale(0.7)

    def run(p, e=emb):
        return p(**tf.call_kwargs("t2i"), ip_adapter_image_embeds=[e], negative_ip_adapter_image_embeds=[neg]).images

    ref = run(stock)
    assert _diff(ref, run(stock, emb + 3)) > 1e-3  # the image embedding changes the output
    lite_boost.boost(pipe)
    assert family_of(pipe).name == "generic" and pipe.transformer._lite_boost.family.name == "generic"
    ctx = generic_context(pipe.transformer)
    calls = []
    inner = ctx.cross_attn_fn
    ctx.cross_attn_fn = lambda *a: (calls.append(a[0].shape[1]), inner(*a))[1]
    assert _diff(run(pipe), ref) <= TOL
    assert len(calls) == 2 * 2 * tf.TinyFluxSpec().layers  # 2 steps x (cond, uncond) x dual blocks: the IP branch
    ctx.cross_attn_fn = inner
    for p in (stock, pipe):
        p.set_ip_adapter_scale(0.3)
    assert _diff(run(pipe), run(stock)) <= TOL
    for p in (stock, pipe):
        p.unload_ip_adapter()
    assert _diff(pipe(**tf.call_kwargs("t2i")).images, stock(**tf.call_kwargs("t2i")).images) <= TOL
    assert lite_boost.api.is_boosted(pipe) and family_of(pipe).name == "generic"  # boosted as it was
    lite_boost.unboost(pipe)
    assert not lite_boost.api.is_boosted(pipe) and family_of(pipe).name == "flux"
    lite_boost.boost(pipe)  # without the IP-Adapter: the family again
    assert pipe.transformer._lite_boost.family.name == "flux"
    assert _diff(pipe(**tf.call_kwargs("t2i")).images, stock(**tf.call_kwargs("t2i")).images) <= TOL


# ----------------------------------------------------------------------------------- the generic path
GEN = "SkyReelsV2Transformer3DModel"  # run without its family: boosted through diffusers' dispatcher


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out.sample


@torch.no_grad()
def test_generic_lora_and_processor_swap_equal_stock(monkeypatch):
    from _diffusers_tiny import build, inputs
    from conftest import without_family

    without_family(monkeypatch, "skyreels-v2")  # SkyReels-V2 has a family: run it as a model without one

    from lite_boost.adapter.generic import generic_context

    stock = build(GEN)
    model = lite_boost.boost(copy.deepcopy(stock))
    ctx = generic_context(model)
    lora = lora_state_dict(stock, 5, targets=["to_q", "to_k", "to_v", "to_out.0"], prefix=None)
    for m in (stock, model):
        m.load_lora_adapter(copy.deepcopy(lora), adapter_name="a", prefix=None)
        m.load_lora_adapter(copy.deepcopy(lora_state_dict(stock, 6, targets=["to_q"], prefix=None)),
                            adapter_name="b", prefix=None)
        m.set_adapters(["a", "b"], weights=[0.6, 1.0])
    x = inputs(GEN)
    assert _diff(_first(model(**x)), _first(stock(**x))) <= TOL
    for m in (stock, model):
        m.fuse_lora(lora_scale=1.0)
    assert _diff(_first(model(**x)), _first(stock(**x))) <= TOL
    for m in (stock, model):
        m.unfuse_lora()

    # a processor swap is taken: the new processors run through lite_boost's backend, as the old ones did
    calls = []
    inner = ctx.self_attn_fn
    ctx.self_attn_fn = lambda *a: (calls.append(1), inner(*a))[1]
    for m in (stock, model):
        m.set_attn_processor({n: type(p)() for n, p in m.attn_processors.items()})
    assert all(p._attention_backend is ctx.name for p in model.attn_processors.values())
    assert _diff(_first(model(**x)), _first(stock(**x))) <= TOL and calls
    with pytest.raises(LoaderError, match=r"set_attention_backend: .*the generic path"):
        model.set_attention_backend("native")
    with pytest.raises(LoaderError, match=r"reset_attention_backend: .*the generic path"):
        model.reset_attention_backend()
    assert all(p._attention_backend is ctx.name for p in model.attn_processors.values())
    ctx.self_attn_fn = inner
    lite_boost.unboost(model)
    assert all(p._attention_backend is None for p in model.attn_processors.values())
    for m in (stock, model):
        m.unload_lora()
    assert _diff(_first(model(**x)), _first(stock(**x))) == 0


# ------------------------------------------------------------------------- every family: LoRA on the model
FAMILY_MODELS = ["WanTransformer3DModel", "FluxTransformer2DModel", "QwenImageTransformer2DModel",
                 "HunyuanVideoTransformer3DModel", "LTXVideoTransformer3DModel", "CogVideoXTransformer3DModel",
                 "HunyuanVideo15Transformer3DModel", "LTX2VideoTransformer3DModel", "MiniMaxH3Transformer3DModel"]


@pytest.mark.parametrize("name", FAMILY_MODELS)
@torch.no_grad()
def test_family_model_lora_before_and_after_boost_equals_stock(name):
    """diffusers' own tiny config of each family's transformer: a LoRA on every attention projection, loaded after
    boosting (and then a second one, loaded before a re-boost with another config), equals stock with the same."""
    from _diffusers_tiny import build, inputs

    from lite_boost.registry import family_of

    stock = build(name)
    assert family_of(stock) is not None and family_of(stock).name != "generic"
    model = lite_boost.boost(copy.deepcopy(stock))
    x = inputs(name)
    base = _first(stock(**x))
    targets = ["to_q", "to_k", "to_v", "to_out.0"]
    for m in (stock, model):
        m.load_lora_adapter(lora_state_dict(stock, 8, targets=targets, prefix=None), adapter_name="a", prefix=None)
    ref = _first(stock(**x))
    assert _diff(ref, base) > 1e-4 and _diff(_first(model(**x)), ref) <= TOL
    lite_boost.unboost(model)
    for m in (stock, model):
        m.load_lora_adapter(lora_state_dict(stock, 9, targets=["to_q", "to_v"], prefix=None), adapter_name="b",
                            prefix=None)
        m.set_adapters(["a", "b"], weights=[0.5, 1.0])
    lite_boost.boost(model, {"rope_cache_size": 4})
    ref2 = _first(stock(**x))
    assert _diff(ref2, ref) > 1e-4
    assert _diff(_first(model(**x)), ref2) <= TOL


@torch.no_grad()
def test_lora_on_boosted_model_compiles_without_graph_breaks():
    """Regional compile (fullgraph=True) of a boosted Wan transformer with two LoRAs equals eager; set_adapters after
    compiling still takes effect (a recompile, not a stale graph)."""
    from _diffusers_tiny import build, inputs

    name = "WanTransformer3DModel"
    stock = build(name)
    model = lite_boost.boost(copy.deepcopy(stock))
    for m in (stock, model):
        m.load_lora_adapter(lora_state_dict(stock, 10, prefix=None), adapter_name="a", prefix=None)
        m.load_lora_adapter(lora_state_dict(stock, 11, prefix=None), adapter_name="b", prefix=None)
        m.set_adapters(["a", "b"], weights=[1.0, 0.5])
    x = inputs(name)
    model.compile_repeated_blocks(fullgraph=True, backend="eager")
    assert _diff(_first(model(**x)), _first(stock(**x))) <= TOL
    for m in (stock, model):
        m.set_adapters("b")
    assert _diff(_first(model(**x)), _first(stock(**x))) <= TOL


@torch.no_grad()
def test_flux_controlnet_residuals_on_boosted_transformer_equal_stock():
    """A ControlNet runs stock; its block residuals enter the boosted transformer through diffusers' forward."""
    from diffusers import FluxControlNetModel

    from _diffusers_tiny import build, init_dict, inputs

    name = "FluxTransformer2DModel"
    stock = build(name)
    model = lite_boost.boost(copy.deepcopy(stock))
    x = inputs(name)
    torch.manual_seed(3)
    controlnet = FluxControlNetModel(**init_dict(name)).eval()
    for p in controlnet.parameters():
        p.normal_(0, 0.1)  # diffusers zero-initialises the residual projections: make them count
    blocks, single = controlnet(**x, controlnet_cond=torch.randn(x["hidden_states"].shape), return_dict=False)
    kw = dict(controlnet_block_samples=blocks, controlnet_single_block_samples=single)
    ref = stock(**x, **kw).sample
    assert _diff(ref, stock(**x).sample) > 1e-3
    assert _diff(model(**x, **kw).sample, ref) <= TOL


# ------------------------------------------------------------------------------ sharded weights (ParallelManager)
@torch.no_grad()
def test_tensor_parallel_plan_refuses_a_loaded_lora_before_any_collective():
    """LoRA loaded, then ParallelManager(tp_degree=2): the planner's check names the LoRA layer and what to do."""
    from _diffusers_tiny import build

    from lite_boost.api import check_weight_sharding

    model = build("WanTransformer3DModel")
    model.load_lora_adapter(lora_state_dict(model, 12, prefix=None), adapter_name="a", prefix=None)
    with pytest.raises(lite_boost.ConfigError, match=r"blocks.0.attn1.to_q carries an adapter \(a LoRA: "
                                                     r"peft\..*Linear.*fuse_lora\(\); pipe.unload_lora_weights\(\)"):
        check_weight_sharding(model, [model], lite_boost.BoostConfig(), 2, tp_degree=2)
    model.fuse_lora()
    model.unload_lora()
    check_weight_sharding(model, [model], lite_boost.BoostConfig(), 2, tp_degree=2)  # the advice works


@torch.no_grad()
def test_lora_loading_refused_on_sharded_weights(monkeypatch):
    """A model whose weights ParallelManager split (its record in extras['parallel'] lists the shards) refuses
    load_lora_weights / load_lora_adapter / fuse_lora before anything changes. (The record is set by hand here:
    the multi-process sharding itself is tested in test_weight_sharding.py.)"""
    from types import SimpleNamespace

    pipe = _wan()
    lora = lora_state_dict(pipe.transformer, 13)
    lite_boost.boost(pipe)
    pipe.transformer._lite_boost.extras["parallel"] = SimpleNamespace(weights=[object()])
    tree = [n for n, _ in pipe.transformer.named_modules()]
    for call in (lambda: pipe.load_lora_weights(lora, adapter_name="a"),
                 lambda: pipe.transformer.load_lora_adapter(lora, adapter_name="a", prefix="transformer"),
                 pipe.fuse_lora):
        with pytest.raises(LoaderError, match=r"ParallelManager split its weights.*before ParallelManager"):
            call()
    assert [n for n, _ in pipe.transformer.named_modules()] == tree
    del pipe.transformer._lite_boost.extras["parallel"]
    pipe.load_lora_weights(lora, adapter_name="a")  # unsharded: taken
    assert any("lora_A" in n for n, _ in pipe.transformer.named_modules())


# ------------------------------------------------------------------------------------------ ControlNet pipelines
@pytest.mark.parametrize("kind", ["flux", "flux_multi", "qwen", "qwen_multi"])
@torch.no_grad()
def test_controlnet_pipeline_boost_equals_stock(kind):
    """boost(FluxControlNetPipeline / QwenImageControlNetPipeline): the transformer by its family, the ControlNet
    (or each in the Multi wrapper) on the generic path with the attention settings only; equals stock; unboost
    restores both."""
    import _tiny_controlnet as tc

    from lite_boost.adapter.generic import generic_context

    stock, pipe = tc.pipeline(kind), tc.pipeline(kind)
    ref = stock(**tc.call_kwargs(kind)).images
    off = tc.call_kwargs(kind)
    off["controlnet_conditioning_scale"] = [0.0] * len(off["control_image"]) if isinstance(
        off["control_image"], list) else 0.0
    assert _diff(stock(**off).images, ref) > 1e-3  # the ControlNet's residuals change the output
    lite_boost.boost(pipe)
    assert _boosted_processors(pipe)
    ctx = generic_context(pipe.controlnet)
    assert ctx is not None and pipe.controlnet._lite_boost.config == lite_boost.BoostConfig()
    calls = []
    inner = ctx.self_attn_fn
    ctx.self_attn_fn = lambda *a: (calls.append(1), inner(*a))[1]
    assert _diff(pipe(**tc.call_kwargs(kind)).images, ref) <= TOL and calls  # the ControlNet ran lite_boost's
    ctx.self_attn_fn = inner
    lite_boost.unboost(pipe)
    assert getattr(pipe.controlnet, "_lite_boost", None) is None and not lite_boost.api.is_boosted(pipe)
    assert all(getattr(m.processor, "_attention_backend", None) is None
               for m in pipe.controlnet.modules() if hasattr(m, "set_processor"))
    assert _diff(pipe(**tc.call_kwargs(kind)).images, ref) == 0


def test_controlnet_takes_the_attention_settings_only():
    from lite_boost.adapter.controlnet import controlnet_config

    cfg = lite_boost.BoostConfig.coerce({"attention_backend": "sdpa", "rope_cache_size": 4, "cache": "first_block_cache",
                                         "sparse": {"sparsity": 0.5}, "quant": "int8_weight_only"})
    assert controlnet_config(cfg) == lite_boost.BoostConfig(attention_backend="sdpa", rope_cache_size=4)


@pytest.mark.parametrize("kind", ["flux", "qwen"])
def test_controlnet_pipeline_cfg_parallel_refused_at_planning(kind, monkeypatch):
    """cfg_degree 2 on a ControlNet pipeline (the generic pipeline path, which has no CFG plan for it: the pipeline
    keeps its guidance decision in a local variable) is refused by the planner, before any collective."""
    import _tiny_controlnet as tc

    from lite_boost.api import is_boosted
    from lite_boost.plan import make_plan

    for k, v in {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(k, v)
    pipe = tc.pipeline(kind)
    with pytest.raises(lite_boost.ConfigError, match=r"cfg_degree=2: .*ControlNetPipeline runs on lite_boost's generic "
                                                     r"pipeline path.*Valid cfg_degree here: \[1\]"):
        make_plan(pipe, {"parallel": {"cfg_degree": 2}}, parallel=True)
    assert not is_boosted(pipe)
    make_plan(pipe, {"parallel": {"cfg_degree": 1}}, parallel=True)  # sequence parallel: planned
