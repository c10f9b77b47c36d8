"""Quantized Linear layers (``BoostConfig(quant=...)``, lite_boost.quant): config, layer selection, device
checks, numerics against an fp64 reference of the documented scheme, unboost, save_pretrained,
``.to()``, torch.compile, composition with sparse attention / step caching / ParallelManager, and the
Ascend W8A8 path against an executable specification of torch_npu's two operators."""

import copy
import re
import sys
import warnings

import pytest
import torch

import lite_boost
import lite_boost.quant as Q
from lite_boost.config import QUANT_METHODS, BoostConfig, ConfigError, QuantConfig, SparseConfig
from lite_boost.demo import TinyWanSpec, tiny_wan_pipeline, tiny_wan_transformer
from lite_boost.quant import QuantError

from conftest import pipeline_kwargs
from quant_specs import make_torch_npu_quant, reference_linear

BLOCK_LINEARS = ("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0", "attn2.to_q", "attn2.to_k",
                 "attn2.to_v", "attn2.to_out.0", "ffn.net.0.proj", "ffn.net.2")


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _inputs(grid=(3, 8, 9), seed=0, i2v=False, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    f, h, w = grid
    x = torch.randn(1, 36 if i2v else 16, f, 2 * h, 2 * w, generator=g).to(dtype)
    ctx = torch.randn(1, 512, 32, generator=g).to(dtype)
    kw = {"encoder_hidden_states_image": torch.randn(1, 257, 4, generator=g).to(dtype)} if i2v else {}
    return (x, torch.tensor([700.0]), ctx), kw


def _model(heads=3, i2v=False, dtype=torch.float32, layers=2):
    if i2v:
        spec = TinyWanSpec(heads=heads, layers=layers, in_channels=36, image_dim=4, added_kv_proj_dim=heads * 24)
    else:
        spec = TinyWanSpec(heads=heads, layers=layers)
    return tiny_wan_transformer(spec, dtype=dtype)


def _run(model, args, kw=None):
    with torch.no_grad():
        return model(*args, **(kw or {})).sample


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _block_names(layers=2, extra=()):
    return [f"blocks.{i}.{n}" for i in range(layers) for n in BLOCK_LINEARS + tuple(extra)]


# ---------------------------------------------------------------------------------------- config
def test_config_forms_and_round_trip(tmp_path):
    assert QuantConfig().method == "int8_dynamic" and QuantConfig().include is None
    assert BoostConfig(quant="int8_dynamic").quant == QuantConfig()
    assert BoostConfig.from_dict({"quant": {"method": "int8_weight_only"}}).quant.method == "int8_weight_only"
    assert BoostConfig.coerce(QuantConfig("fp8")).quant.method == "fp8"
    cfg = BoostConfig(quant=QuantConfig("int8_dynamic", include=r"blocks\.0\..*", exclude=[r".*attn2.*"]))
    assert cfg.quant.include == (r"blocks\.0\..*",) and cfg.quant.exclude == (r".*attn2.*",)
    assert BoostConfig.from_dict(cfg.to_dict()) == cfg
    path = tmp_path / "boost.yaml"
    path.write_text("quant:\n  method: int8_dynamic\n  exclude: ['.*ffn.*']\nsparse:\n  sparsity: 0.5\n")
    loaded = BoostConfig.from_yaml(str(path))
    assert loaded.quant == QuantConfig(exclude=(".*ffn.*",)) and loaded.sparse.sparsity == 0.5
    assert list(QUANT_METHODS) == list(Q.QUANT_METHOD_INFO)


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(method="int4"), r"method must be one of \['int8_dynamic', 'int8_weight_only', 'fp8', 'w8a8_npu'\]"),
    (dict(include=["(unclosed"]), "is not a valid regular expression"),
    (dict(include=[]), "quant include must list at least one regular expression"),
    (dict(exclude=[3]), "must be a regular expression or a list of them"),
    (dict(keep_original="yes"), "keep_original must be True or False"),
])
def test_config_rejects_bad_values(kwargs, fragment):
    with pytest.raises(ConfigError, match=fragment):
        QuantConfig(**kwargs)


def test_config_rejects_unknown_keys_and_types():
    with pytest.raises(ConfigError, match=r"unknown QuantConfig key\(s\) \['methd'\]"):
        BoostConfig.from_dict({"quant": {"methd": "int8_dynamic"}})
    with pytest.raises(ConfigError, match="quant must be a QuantConfig"):
        BoostConfig(quant=8)
    with pytest.raises(ConfigError, match="method must be one of"):
        BoostConfig(quant="int3")


# ---------------------------------------------------------------------------------------- selection
@pytest.mark.parametrize("i2v", [False, True])
def test_default_selection_is_the_blocks_linear_layers(i2v):
    model = _model(i2v=i2v)
    lite_boost.boost(model, {"quant": "int8_dynamic"})
    state = Q.quant_state(model)
    extra = ("attn2.add_k_proj", "attn2.add_v_proj") if i2v else ()
    assert sorted(state.layers) == sorted(_block_names(extra=extra))
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear):
            quantized = type(mod.weight) is not torch.nn.Parameter
            assert quantized == (name in state.layers), name  # embeddings, proj_out: full precision
    for name in ("scale_shift_table", "blocks.0.scale_shift_table", "patch_embedding.weight", "proj_out.weight"):
        assert type(model.get_parameter(name)) is torch.nn.Parameter and model.get_parameter(name).dtype == torch.float32


def test_include_and_exclude_patterns():
    model = _model()
    lite_boost.boost(model, BoostConfig(quant=QuantConfig(include=[r"blocks\.\d+\.ffn\..*", r"proj_out"],
                                                          exclude=[r"blocks\.1\..*"])))
    assert sorted(Q.quant_state(model).layers) == ["blocks.0.ffn.net.0.proj", "blocks.0.ffn.net.2", "proj_out"]


@pytest.mark.parametrize("quant, fragment", [
    (QuantConfig(include=[r"blocks\.\d+\.ff\..*"]), r"include pattern 'blocks\\\\.\\\\d\+\\\\.ff\\\\..\*' matches no nn.Linear"),
    (QuantConfig(exclude=[r"blocks\.\d+\.attn3\..*"]), "exclude pattern .* matches no nn.Linear"),
    (QuantConfig(include=[r"blocks\.0\..*"], exclude=[r"blocks\..*"]), "leaves no layer .* to quantize"),
    (QuantConfig("fp8"), r"quant method 'fp8' cannot run on cpu \(it needs a CUDA GPU with FP8 tensor cores "
                         r"\(sm89\+\), not cpu\); methods that can run on cpu: \['int8_dynamic', 'int8_weight_only'\]"),
    (QuantConfig("w8a8_npu"), r"quant method 'w8a8_npu' cannot run on cpu \(it needs an Ascend NPU \(torch_npu\), "
                              r"not cpu\); methods that can run on cpu: \['int8_dynamic', 'int8_weight_only'\]"),
])
def test_bad_requests_fail_before_anything_is_touched(quant, fragment):
    pipe = tiny_wan_pipeline("t2v", spec=TinyWanSpec(heads=3))
    before = {n: p for n, p in pipe.transformer.named_parameters()}
    processors = dict(pipe.transformer.attn_processors)
    with pytest.raises(ConfigError, match=fragment):
        lite_boost.boost(pipe, BoostConfig(sparse=SparseConfig(sparsity=0.5), quant=quant))
    assert not lite_boost.api.is_boosted(pipe)
    assert {n: p for n, p in pipe.transformer.named_parameters()} == before
    assert all(a is b for a, b in zip(pipe.transformer.attn_processors.values(), processors.values()))


def test_device_and_dtype_rules(monkeypatch):
    assert Q.usable_methods("cpu") == ["int8_dynamic", "int8_weight_only"]
    assert "Ascend" in Q.method_problem("w8a8_npu", "cpu") and "sm89" in Q.method_problem("fp8", "cpu")
    # an FP8-capable device reached, but the model is float32: per-row FP8 scaling needs bfloat16
    monkeypatch.setattr(Q, "method_problem", lambda m, d: None)
    with pytest.raises(ConfigError, match=r"quant method 'fp8' needs a bfloat16 model, got float32"):
        Q.plan_quant(_model(), QuantConfig("fp8"), (r"blocks\..*",))
    with pytest.raises(ConfigError, match=r"'w8a8_npu' needs a float16 or bfloat16 model, got float32"):
        Q.plan_quant(_model(), QuantConfig("w8a8_npu"), (r"blocks\..*",))


@pytest.mark.parametrize("flags", [frozenset({"avx2"}), frozenset({"avx2", "avx512_vnni"}), frozenset({"amx_int8"})])
def test_int8_dynamic_on_a_cpu_without_int8_dot_products_warns(monkeypatch, flags):
    """int8_dynamic stays correct everywhere, but on a CPU without VNNI / AMX its int8 products run as fp32 GEMMs,
    so it is no faster than fp32: planning says so (PerformanceWarning naming the method, the reason and the
    memory-only alternative); with them, no warning."""
    from lite_boost.errors import PerformanceWarning
    from lite_boost.ops import precision

    monkeypatch.setattr(precision, "_cpu_flags", lambda: flags)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Q.plan_quant(_model(), QuantConfig("int8_dynamic"), (r"blocks\..*",))
        Q.plan_quant(_model(), QuantConfig("int8_weight_only"), (r"blocks\..*",))  # no int8 matmul: never warned
    slow = [w for w in caught if issubclass(w.category, PerformanceWarning)]
    if flags & {"avx512_vnni", "avx_vnni", "amx_int8"}:
        assert not slow
    else:
        assert len(slow) == 1
        msg = str(slow[0].message)
        assert "'int8_dynamic'" in msg and "no int8 dot-product instructions" in msg and "int8_weight_only" in msg


@pytest.mark.parametrize("path", ["fp32", "u8s8", "int_mm"])
def test_exact_int8_mm_equals_the_integer_sums(path):
    """Every path of exact_int8_mm gives the exact int32 sums, at the extremes of int8 and with input features
    that are not a multiple of the fp32 path's slice; one unsliced fp32 GEMM would round where it does not."""
    from lite_boost.ops.quant_int8 import EXACT_FP32_K, exact_int8_mm

    g = torch.Generator().manual_seed(0)
    for m, k, n in ((5, 2500, 7), (3, EXACT_FP32_K, 4), (1, 1, 1), (2, 0, 3)):
        a = torch.randint(-128, 128, (m, k), generator=g, dtype=torch.int8)
        b = torch.randint(-128, 128, (k, n), generator=g, dtype=torch.int8)
        got = exact_int8_mm(a, b, path)
        assert got.dtype == torch.int32 and torch.equal(got.long(), a.long() @ b.long()), (m, k, n)
    a = torch.full((2, 3000), -128, dtype=torch.int8)
    assert (exact_int8_mm(a, a.t().contiguous(), path) == 3000 * 2**14).all()  # every product at its largest
    # 2000 * 127 * 127 + 1 is odd and above 2**24: fp32 cannot hold it, the sliced sums are exact
    a = torch.cat([torch.full((1, 2000), 127, dtype=torch.int8), torch.ones(1, 1, dtype=torch.int8)], 1)
    want = 2000 * 127 * 127 + 1
    assert int((a.float() @ a.t().float()).item()) != want
    assert exact_int8_mm(a, a.t().contiguous(), path).item() == want
    with pytest.raises(ValueError, match=r"path must be one of \['int_mm', 'u8s8', 'fp32'\], got 'x'"):
        exact_int8_mm(a, a.t(), "x")
    with pytest.raises(ValueError, match=r"needs int8 \(M, K\) @ \(K, N\), got torch.float32"):
        exact_int8_mm(a.float(), a.t(), path)


def _no_int_mm(*args, **kwargs):
    raise AssertionError("torch._int_mm called on the exact fp32 path")


@pytest.mark.parametrize("flags", [frozenset({"avx2"}), frozenset({"avx2", "avx512_vnni"})], ids=["avx2", "vnni"])
def test_int8_dynamic_on_the_cpu_equals_torchao_layer_for_layer(monkeypatch, flags):
    """On a CPU without int8 dot products the int8-dynamic layers compute through exact fp32 GEMMs, never
    torch._int_mm's generic loop, and each layer's output equals torchao's own Int8Tensor Linear on the same
    input bit for bit (fp32 and bf16); the model compiles with no graph break and unboost drops the instance
    forwards. With VNNI torchao's own path runs (no instance forward)."""
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_

    from lite_boost.ops import precision

    monkeypatch.setattr(precision, "_cpu_flags", lambda: flags)
    routed = "avx512_vnni" not in flags
    for dtype in (torch.float32, torch.bfloat16):
        stock = _model(dtype=dtype)
        ref = copy.deepcopy(stock)
        quantize_(ref, Int8DynamicActivationInt8WeightConfig(set_inductor_config=False),
                  filter_fn=lambda m, fqn: fqn in set(_block_names()))
        model = lite_boost.boost(copy.deepcopy(stock), {"quant": "int8_dynamic"})
        layers = Q.quant_state(model).layers
        assert sorted(layers) == sorted(_block_names())
        assert all(("forward" in model.get_submodule(n).__dict__) == routed for n in layers)
        seen = {}
        handles = [model.get_submodule(n).register_forward_hook(
            lambda m, i, o, n=n: seen.__setitem__(n, (i[0].detach().clone(), o.detach().clone()))) for n in layers]
        args, _ = _inputs(dtype=dtype)
        with monkeypatch.context() as mp:
            if routed:
                mp.setattr(torch, "_int_mm", _no_int_mm)
            out = _run(model, args)
        for h in handles:
            h.remove()
        assert set(seen) == set(layers) and out.dtype == dtype
        with torch.no_grad():
            for n, (x, y) in seen.items():
                assert torch.equal(y, ref.get_submodule(n)(x)), (n, dtype)
        if routed:
            torch._dynamo.reset()
            with torch.no_grad():
                report = torch._dynamo.explain(model)(*args)
            assert report.graph_break_count == 0 and report.graph_count == 1
            torch._dynamo.reset()
        lite_boost.unboost(model)
        assert not any("forward" in m.__dict__ for m in model.modules())
        assert torch.equal(_run(model, args), _run(stock, args))


def test_torchao_missing_names_the_extra(monkeypatch):
    real = Q._import
    monkeypatch.setattr(Q, "_import", lambda name: "torchao is not installed" if name == "torchao" else real(name))
    with pytest.raises(ConfigError, match=r"'int8_dynamic' cannot run on cpu \(torchao is not installed \(pip install "
                                          r"'lite-boost\[quant\]'\)\); methods that can run on cpu: none"):
        lite_boost.boost(_model(), {"quant": "int8_dynamic"})


def test_already_quantized_layers_are_refused():
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    model = _model()
    quantize_(model, Int8WeightOnlyConfig())
    with pytest.raises(ConfigError, match=r"layer 'blocks.0.attn1.to_q' .* already holds a quantized weight \(Int8Tensor"):
        lite_boost.boost(model, {"quant": "int8_dynamic"})
    assert not lite_boost.api.is_boosted(model)


# ---------------------------------------------------------------------------------------- numerics
@pytest.mark.parametrize("method", ["int8_dynamic", "int8_weight_only"])
def test_each_layer_computes_the_documented_scheme(method):
    """Every selected layer of the boosted model, on the input it really received, equals the fp64
    reference of the scheme; the model output is within quantization error of fp32 stock.

    (The whole-model output is not compared with a fake-quantized stock model: rounding to int8 is
    discontinuous, so the last-bit differences between two fp32 implementations of the other ops flip
    a few roundings downstream and the outputs then differ by a fraction of the quantization error.)"""
    stock = _model()
    args, _ = _inputs()
    ref_fp32 = _run(stock, args)
    weights = {n: (stock.get_submodule(n).weight.detach().clone(), stock.get_submodule(n).bias.detach().clone())
               for n in _block_names()}
    model = lite_boost.boost(copy.deepcopy(stock), {"quant": method})
    seen = {}
    handles = [model.get_submodule(n).register_forward_hook(
        lambda m, i, o, n=n: seen.__setitem__(n, (i[0].detach().clone(), o.detach().clone()))) for n in weights]
    out = _run(model, args)
    for h in handles:
        h.remove()
    assert set(seen) == set(weights)
    for n, (x, y) in seen.items():
        ref = reference_linear(*weights[n], x, method)
        assert _rel(y, ref) < 1e-5, (n, _rel(y, ref))
        assert _rel(y, x.double() @ weights[n][0].double().t() + weights[n][1].double()) > 1e-4, n  # really quantized
    err_vs_fp32 = _rel(out, ref_fp32)
    assert 1e-4 < err_vs_fp32 < 2e-2, err_vs_fp32


def test_unboost_gives_back_bit_identical_stock_output_and_parameters():
    model = _model()
    args, _ = _inputs()
    stock_out = _run(model, args)
    params = dict(model.named_parameters())
    keys = {k: (v.dtype, v.shape) for k, v in model.state_dict().items()}
    lite_boost.boost(model, BoostConfig(sparse=SparseConfig(sparsity=0.8, block_size=16, backend="gather"),
                                        quant=QuantConfig()))
    assert not torch.equal(_run(model, args), stock_out)
    lite_boost.unboost(model)
    assert torch.equal(_run(model, args), stock_out)
    assert all(p is params[n] for n, p in model.named_parameters())  # the very same Parameter objects
    assert {k: (v.dtype, v.shape) for k, v in model.state_dict().items()} == keys
    assert not any("extra_repr" in m.__dict__ or "forward" in m.__dict__ for m in model.modules())
    # boosting again with another config restores first, then applies the new one
    lite_boost.boost(model, {"quant": "int8_dynamic"})
    lite_boost.boost(model, {"quant": {"method": "int8_weight_only", "include": [r"blocks\.0\.ffn\..*"]}})
    assert sorted(Q.quant_state(model).layers) == ["blocks.0.ffn.net.0.proj", "blocks.0.ffn.net.2"]
    lite_boost.unboost(model)
    assert torch.equal(_run(model, args), stock_out)


def test_keep_original_false_refuses_unboost_and_save_and_changes_nothing(tmp_path):
    model = _model()
    args, _ = _inputs()
    lite_boost.boost(model, BoostConfig(quant=QuantConfig(keep_original=False)))
    out = _run(model, args)
    with pytest.raises(QuantError, match=r"cannot unboost: the 20 quantized layers' full-precision weights were not "
                                         r"kept \(QuantConfig\(keep_original=False\)\); reload the model"):
        lite_boost.unboost(model)
    with pytest.raises(QuantError, match="were not kept"):
        lite_boost.boost(model, {"quant": "int8_weight_only"})  # re-boost needs the originals too
    with pytest.raises(QuantError, match="cannot save_pretrained a quantized model"):
        model.save_pretrained(tmp_path / "m")
    assert lite_boost.api.is_boosted(model) and torch.equal(_run(model, args), out)
    assert not (tmp_path / "m").exists()


def test_save_pretrained_writes_the_original_weights(tmp_path):
    """A quantized pipeline saves the stock checkpoint (quantization is re-applied by boost after loading)."""
    from diffusers import WanTransformer3DModel

    pipe = tiny_wan_pipeline("t2v", spec=TinyWanSpec(heads=3))
    stock = {k: v.clone() for k, v in pipe.transformer.state_dict().items()}
    lite_boost.boost(pipe, {"quant": "int8_dynamic"})
    args, _ = _inputs()
    out = _run(pipe.transformer, args)
    pipe.save_pretrained(tmp_path / "pipe")
    loaded = WanTransformer3DModel.from_pretrained(tmp_path / "pipe" / "transformer")
    assert set(loaded.state_dict()) == set(stock)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in stock.items())
    assert torch.equal(_run(pipe.transformer, args), out)  # still quantized after the save
    assert Q.quant_state(pipe.transformer) is not None


def test_to_dtype_keeps_the_quantized_layers_and_unboost_follows_it():
    """``.to(dtype)``: quantized layers keep their int8 data (their output follows the activations' dtype),
    the other parameters are cast; unboost then restores the original weights in the new dtype."""
    model = _model()
    orig = {n: p.detach().clone() for n, p in model.named_parameters()}
    args, _ = _inputs()
    ref = _run(copy.deepcopy(model).to(torch.bfloat16), tuple(a.to(torch.bfloat16) for a in args))
    lite_boost.boost(model, {"quant": "int8_dynamic"})
    model.to("cpu").to(torch.bfloat16)
    qw = model.blocks[0].ffn.net[0].proj.weight
    assert type(qw).__name__ == "Int8Tensor" and qw.qdata.dtype == torch.int8
    assert model.proj_out.weight.dtype == torch.bfloat16
    out = _run(model, tuple(a.to(torch.bfloat16) for a in args))
    assert out.dtype == torch.bfloat16 and _rel(out, ref) < 5e-2
    lite_boost.unboost(model)
    for n, p in model.named_parameters():
        assert p.dtype == torch.bfloat16 and torch.equal(p, orig[n].to(torch.bfloat16)), n


def test_weight_bytes_are_a_quarter():
    model = lite_boost.boost(_model(), {"quant": "int8_dynamic"})
    before, after = Q.quant_state(model).weight_bytes(model)
    n_out = sum(model.get_submodule(n).out_features for n in Q.quant_state(model).layers)
    assert after == before // 4 + 5 * n_out  # int8 data + per output channel an fp32 scale and an int8 zero point


# ---------------------------------------------------------------------------------------- compile
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_explain_reports_no_graph_break(sparse):
    torch._dynamo.reset()
    model = _model()
    cfg = BoostConfig(sparse=SparseConfig(sparsity=0.8, block_size=16, backend="gather") if sparse else None,
                      quant=QuantConfig())
    lite_boost.boost(model, cfg)
    args, _ = _inputs()
    with torch.no_grad():
        report = torch._dynamo.explain(model)(*args)
    reasons = [r.reason.splitlines()[0] for r in report.break_reasons]
    assert report.graph_break_count == 0 and report.graph_count == 1, reasons
    torch._dynamo.reset()


@pytest.mark.slow
def test_compile_repeated_blocks_fullgraph_matches_eager_quantized():
    """diffusers' regional compile with inductor: each quantized layer compiles to the same result as eager
    (a compiled int8 layer stack within 1e-6 of eager on the same input), and the whole model stays within
    a fraction of the quantization error (inductor's fused norms / RoPE differ from eager in the last bit,
    which flips a few int8 roundings downstream)."""
    torch._dynamo.reset()
    stock = _model()
    model = lite_boost.boost(copy.deepcopy(stock), BoostConfig(sparse=SparseConfig(sparsity=0.8, block_size=16,
                                                                                   backend="gather"),
                                                               quant=QuantConfig()))
    args, _ = _inputs(grid=(3, 5, 7))
    stock_out = _run(lite_boost.boost(stock, BoostConfig(sparse=SparseConfig(sparsity=0.8, block_size=16,
                                                                             backend="gather"))), args)
    ref = _run(model, args)
    ffn = model.blocks[0].ffn
    x = torch.randn(1, 105, 72)
    with torch.no_grad():
        ffn_eager = ffn(x)
        ffn_compiled = torch.compile(ffn, fullgraph=True)(x)
    assert _rel(ffn_compiled, ffn_eager) < 1e-6
    model.compile_repeated_blocks(fullgraph=True)
    out = _run(model, args)
    torch._dynamo.reset()
    assert _rel(out, ref) < 0.5 * _rel(ref, stock_out), (_rel(out, ref), _rel(ref, stock_out))


# ---------------------------------------------------------------------------------------- composition
def test_composes_with_sparse_attention_and_step_caching():
    """sparse + quant + First-Block Cache in one boost = the obvious composition done by hand (torchao's
    quantize_ on the blocks' Linear layers of a stock pipeline, then boost with sparse + cache); unboost
    gives back stock."""
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_

    kw = dict(height=64, width=128, num_frames=5, steps=4)
    sparse = SparseConfig(sparsity=0.8, block_size=16, backend="gather")
    cache = {"method": "first_block_cache", "threshold": 0.3}
    stock = tiny_wan_pipeline("t2v", spec=TinyWanSpec(heads=3))
    with torch.no_grad():
        stock_out = stock(**pipeline_kwargs("t2v", **kw)).frames
    ref = tiny_wan_pipeline("t2v", spec=TinyWanSpec(heads=3))
    names = set(_block_names())
    quantize_(ref.transformer, Int8DynamicActivationInt8WeightConfig(set_inductor_config=False),
              filter_fn=lambda m, fqn: fqn in names)
    lite_boost.boost(ref, BoostConfig(sparse=sparse, cache=cache))
    with torch.no_grad():
        ref_out = ref(**pipeline_kwargs("t2v", **kw)).frames
    lite_boost.boost(stock, BoostConfig(sparse=sparse, cache=cache, quant="int8_dynamic"))
    with torch.no_grad():
        out = stock(**pipeline_kwargs("t2v", **kw)).frames
    extras = stock.transformer._lite_boost.extras
    assert {"sparse", "cache", "quant"} <= set(extras)
    assert {e.path for e in extras["sparse"].events} == {"sparse"}
    decisions = [d.compute for d in extras["cache"].decisions]
    assert decisions == [d.compute for d in ref.transformer._lite_boost.extras["cache"].decisions]
    assert not all(decisions), decisions  # the cache really reused blocks
    assert (out - ref_out).abs().max().item() <= 1e-6
    assert _rel(out, stock_out) > 1e-4
    lite_boost.unboost(stock)
    with torch.no_grad():
        assert torch.equal(stock(**pipeline_kwargs("t2v", **kw)).frames, stock_out)


@pytest.mark.slow
def test_parallel_manager_ranks_quantize_alike_and_match_one_process():
    """2 gloo ranks (Ulysses over 45 tokens, 3 heads) and cfg 2 with int8 layers = the one-process quantized boost;
    with int8 attention on top where the CPU runs it."""
    import _dist_quant_cases as cases
    from _dist_utils import run_ranks

    from lite_boost.ops.precision import cpu_int8_reason

    results = run_ranks(cases.quantized_parallel, 2, timeout=300)
    expected = {"seq2", "cfg2_sparse"} | ({"seq2_attn8", "cfg2_sparse_attn8"} if cpu_int8_reason() is None else set())
    for rank, res in enumerate(results):
        assert set(res) == expected, (rank, sorted(res))
        for name, r in res.items():
            assert r["max_diff"] <= 1e-5, (rank, name, r)
            assert r["layers"] == 20 and r["quant_rel_err"] > 1e-4, (rank, name, r)
    assert results[0]["seq2"]["weights_digest"] == results[1]["seq2"]["weights_digest"]


# ---------------------------------------------------------------------------------------- Ascend W8A8
def test_w8a8_linear_follows_the_documented_operators():
    from lite_boost.ops.quant_npu import quantize_weight_per_channel, w8a8_linear

    npu = make_torch_npu_quant()
    g = torch.Generator().manual_seed(0)
    w = torch.randn(40, 24, generator=g)
    b = torch.randn(40, generator=g)
    wq, ws = quantize_weight_per_channel(w)
    assert wq.dtype == torch.int8 and wq.abs().max() == 127 and ws.dtype == torch.float32
    for dtype in (torch.bfloat16, torch.float16):
        x = torch.randn(2, 7, 24, generator=g).to(dtype)
        out = w8a8_linear(npu, x, wq, ws, b.to(dtype))
        # fp64 reference: per-token scale rowMax|x| / 127, per-channel weight scale
        xd = x.double()
        xs = xd.abs().amax(-1, keepdim=True) / 127
        ref = (torch.round(xd / xs) * xs) @ (wq.double() * ws.double()[:, None]).t() + b.to(dtype).double()
        assert out.dtype == dtype and out.shape == (2, 7, 40)
        tol = 1e-2 if dtype == torch.bfloat16 else 2e-3
        assert _rel(out, ref) < tol, (dtype, _rel(out, ref))
        assert _rel(out, x.double() @ w.double().t() + b.double()) < 0.05
    with pytest.raises(TypeError, match="W8A8 linear needs float16 or bfloat16 activations"):
        w8a8_linear(npu, torch.randn(3, 24), wq, ws, b)
    # the spec really checks the contract: an untransposed weight or a float16 bias with float16 output fail
    xq, xs = npu.npu_dynamic_quant(torch.randn(3, 24).half())
    with pytest.raises(ValueError, match="do not multiply"):
        npu.npu_quant_matmul(xq, wq, ws, pertoken_scale=xs, output_dtype=torch.float16)
    with pytest.raises(TypeError, match="unsupported combination"):
        npu.npu_quant_matmul(xq, wq.t(), ws, pertoken_scale=xs, bias=b.half(), output_dtype=torch.float16)


def test_w8a8_npu_boost_on_the_spec(monkeypatch):
    """The whole w8a8_npu path on a bf16 tiny Wan, with torch_npu replaced by the executable spec and the
    device gate opened for the CPU: selection, output vs the fp64 reference, compile, unboost."""
    npu = make_torch_npu_quant()
    monkeypatch.setitem(sys.modules, "torch_npu", npu)
    real = Q.method_problem
    monkeypatch.setattr(Q, "method_problem", lambda m, d: None if m == "w8a8_npu" else real(m, d))
    stock = _model(dtype=torch.bfloat16)
    args, _ = _inputs(dtype=torch.bfloat16)
    args = (args[0], args[1], args[2])
    stock_out = _run(stock, args)
    fp32_out = _run(copy.deepcopy(stock).float(), tuple(a.float() for a in args))
    model = lite_boost.boost(copy.deepcopy(stock), {"quant": "w8a8_npu"})
    state = Q.quant_state(model)
    assert sorted(state.layers) == sorted(_block_names())
    lin = model.blocks[0].attn1.to_q
    assert lin.weight.dtype == torch.int8 and lin.weight_scale.dtype == torch.float32
    out = _run(model, args)
    assert npu.calls["npu_quant_matmul"] == 20 and npu.calls["npu_dynamic_quant"] == 20
    assert _rel(out, fp32_out) < 5e-2
    with torch.no_grad():
        report = torch._dynamo.explain(model)(*args)
    assert report.graph_break_count == 0, [r.reason for r in report.break_reasons]
    torch._dynamo.reset()
    before, after = state.weight_bytes(model)
    assert after < 0.55 * before  # int8 + fp32 scales vs bf16
    lite_boost.unboost(model)
    assert torch.equal(_run(model, args), stock_out)
    assert "weight_scale" not in dict(model.blocks[0].attn1.to_q.named_buffers())


# ---------------------------------------------------------------------------------------- CLI
def test_cli_generate_with_quant_reports_layers_and_psnr(tmp_path, capsys):
    from lite_boost.cli import main

    args = ["generate", "--steps", "2", "--height", "32", "--width", "48", "--num-frames", "5", "--warmup", "0",
            "--sparsity", "0", "--quant", "int8_dynamic", "--output", str(tmp_path / "v.mp4")]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert re.search(r"- Linear layers: int8_dynamic on 20 Linear layers", out), out
    assert "quantization approximate by design" in out
    assert float(re.search(r"video PSNR boosted vs stock: (\S+) dB", out).group(1)) > 30


def test_cli_refuses_a_method_the_device_cannot_run_before_any_run():
    from lite_boost.cli import main

    with pytest.raises(SystemExit, match=r"--quant fp8 cannot run on cpu .*; methods that can run on cpu: "
                                         r"\['int8_dynamic', 'int8_weight_only'\]"):
        main(["generate", "--quant", "fp8", "--steps", "1"])


# ---------------------------------------------------------------------------------------- other families
def test_another_family_quantizes_its_declared_layers_and_unboosts():
    """The quantization code knows no model: Qwen-Image's family declares ``transformer_blocks.*``."""
    import _qwen_cases as qcases
    from lite_boost.demo import TinyQwenImageSpec, tiny_qwen_image_transformer

    spec = TinyQwenImageSpec(heads=3)
    model = tiny_qwen_image_transformer(spec)
    kw = qcases.transformer_inputs(spec)
    with torch.no_grad():
        stock = model(**kw).sample
    lite_boost.boost(model, {"quant": "int8_dynamic"})
    layers = Q.quant_state(model).layers
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    assert layers and all(n.startswith("transformer_blocks.") for n in layers)
    assert sorted(layers) == sorted(n for n in linears if n.startswith("transformer_blocks."))
    with torch.no_grad():
        out = model(**kw).sample
    assert 1e-5 < _rel(out, stock) < 5e-2
    lite_boost.unboost(model)
    with torch.no_grad():
        assert torch.equal(model(**kw).sample, stock)


def test_a_family_without_default_layers_is_refused():
    import dataclasses

    from lite_boost.registry import family_of

    fam = dataclasses.replace(family_of(_model()), name="wan-noquant", quant_patterns=())
    assert fam.features["quant"] == "no default quantization patterns"
    model = _model()
    with pytest.raises(ConfigError, match=r"quant \(BoostConfig.quant\) is not supported for the wan-noquant family "
                                          r"\(no default quantization patterns\); families with quant: \['wan', "):
        fam.boost_transformer(model, {"quant": "int8_dynamic"})
    assert not lite_boost.api.is_boosted(model)
