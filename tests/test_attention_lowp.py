"""Low-precision dense attention backends (SageAttention, FlashAttention-3 FP8, Ascend int8) against their
documented contracts (tests/lowp_specs.py, tests/attention_specs.py) and the dispatch rules of ``precision``."""

import dataclasses
import importlib
import sys
import types

import pytest
import torch

from lite_boost.ops import AttentionBackendError, attention, select_backend

from attention_specs import make_flash_attn_interface, make_torch_npu, reference_attention, reference_lse
from lowp_specs import cosine, make_flash_attn_interface_fp8, make_sageattention, rel_l1

A = importlib.import_module("lite_boost.ops.attention")
L = importlib.import_module("lite_boost.ops._attention_lowp")
LOWP = ("sage", "sage_fp8", "fa3_fp8", "npu_int8")
# error levels: SageAttention's papers report relative L1 of about 1-3% for int8 Q K^T with 16-bit P V and
# a few percent with FP8 P V, cosine >= 0.999; Ascend's int8 mode also quantizes P and V (per tensor)
BOUNDS = {"sage": (0.9995, 0.03), "sage_fp8": (0.998, 0.07), "fa3_fp8": (0.998, 0.07), "npu_int8": (0.999, 0.05)}


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.delenv(A.ENV_VAR, raising=False)
    A.clear_caches()
    yield
    A.clear_caches()


def _qkv(b=1, s=150, n=4, d=64, nk=2, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, s, n, d, generator=g)
    k = torch.randn(b, s + 21, nk, d, generator=g) + 0.5  # a common offset: what K smoothing removes
    v = torch.randn(b, s + 21, nk, d, generator=g)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _on_cpu(monkeypatch, *names):
    """Let these backends run on CPU tensors (their kernels replaced by the executable specifications)."""
    for name in names:
        spec = A.BACKENDS[name]
        monkeypatch.setitem(A.BACKENDS, name, dataclasses.replace(spec, devices=spec.devices + ("cpu",),
                                                                  probe=lambda: None))


def _fakes(monkeypatch, arch=(9, 0), calls=None, fa3=True, npu=True):
    monkeypatch.setitem(sys.modules, "sageattention", make_sageattention(arch, calls))
    monkeypatch.setitem(sys.modules, "flash_attn_interface", make_flash_attn_interface_fp8() if fa3 else None)
    monkeypatch.setitem(sys.modules, "torch_npu", make_torch_npu() if npu else None)
    monkeypatch.setattr(L, "cuda_capability", lambda device=None: arch)
    # the CPU int8 kernel is tested in test_low_precision.py; here it must not build the C++ library
    monkeypatch.setitem(A.BACKENDS, "cpu_int8", dataclasses.replace(A.BACKENDS["cpu_int8"],
                                                                    probe=lambda: "not under test here"))
    A.clear_caches()


def _gpu(monkeypatch, arch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: arch)


def _decide(device, precision, dtype=torch.bfloat16, head_dim=128, requested=None, need_lse=False, masked=False):
    return A._decide(device, dtype, head_dim, 8, False, requested, "requested by the call" if requested else "automatic",
                     masked, need_lse, precision)


# ----------------------------------------------------------------------------- dispatch and refusals


@pytest.mark.parametrize("arch, int8, fp8", [
    ((8, 0), "sage", None),          # Ampere: no FP8 at all
    ((8, 6), "sage", None),
    ((8, 9), "sage", "sage_fp8"),    # Ada: SageAttention's FP8 P V; FA3 needs Hopper
    ((9, 0), "sage", "fa3_fp8"),     # Hopper: FA3 FP8 first
    ((12, 0), "sage", "sage_fp8"),
    ((7, 5), None, None),            # Turing: nothing low-precision
])
def test_cuda_order_per_precision_and_gpu(monkeypatch, arch, int8, fp8):
    _fakes(monkeypatch, arch)
    _gpu(monkeypatch, arch)
    for precision, want in (("int8", int8), ("fp8", fp8)):
        name, error = _decide("cuda", precision)
        assert name == want, (precision, error)
        if want is None:
            assert f"sm{arch[0]}{arch[1]}" in error and "precision='auto'" in error
    # precision "auto" never picks a low-precision backend, even where all of them could run
    name, _ = _decide("cuda", "auto")
    assert name not in LOWP


def test_fp8_without_flash_attn_interface_falls_to_sage_and_says_why(monkeypatch, caplog):
    _fakes(monkeypatch, (9, 0), fa3=False)
    _gpu(monkeypatch, (9, 0))
    with caplog.at_level("INFO", logger="lite_boost.attention"):
        assert _decide("cuda", "fp8") == ("sage_fp8", None)
    assert any("fa3_fp8: flash_attn_interface" in r.getMessage() for r in caplog.records)


def test_fa3_without_descale_is_not_fp8_capable(monkeypatch):
    _fakes(monkeypatch, (9, 0))
    monkeypatch.setitem(sys.modules, "flash_attn_interface", make_flash_attn_interface())
    monkeypatch.setitem(sys.modules, "flash_attn_interface",
                        types.SimpleNamespace(flash_attn_func=lambda q, k, v, softmax_scale=None, causal=False: q,
                                              __spec__=sys.modules["flash_attn_interface"].__spec__))
    A.clear_caches()
    assert "takes no q_descale" in L.probe_fa3_fp8()


def test_npu_int8_order_and_no_fp8_on_ascend(monkeypatch):
    _fakes(monkeypatch)
    monkeypatch.setattr(torch, "npu", types.SimpleNamespace(is_available=lambda: True), raising=False)
    assert _decide("npu", "int8") == ("npu_int8", None)
    name, error = _decide("npu", "fp8")
    assert name is None and "fa3_fp8: wrong device: needs cuda, got npu" in error
    assert "CANN documents no FP8 input" in error and "CANN documents no FP8 input" in A.precision_reason("npu", "fp8")
    # the int8 mode needs a head dim aligned to 32 (int8 inputs), as documented
    name, error = _decide("npu", "int8", head_dim=80)
    assert name is None and "unsupported head dim 80: needs <= 512 and a multiple of 32" in error


def test_cpu_int8_without_its_kernel_refuses_clearly_instead_of_running_fp32(monkeypatch):
    """On a CPU whose int8 kernel cannot run (no int8 dot products, no library) int8 is refused, never fp32."""
    monkeypatch.setitem(A.BACKENDS, "cpu_int8", dataclasses.replace(A.BACKENDS["cpu_int8"],
                                                                    probe=lambda: "no int8 dot products (test)"))
    A.clear_caches()
    q, k, v = _qkv(dtype=torch.float32)
    with pytest.raises(AttentionBackendError) as info:
        attention(q, k, v, precision="int8")
    msg = str(info.value)
    assert "precision=int8" in msg and "sage: wrong device: needs cuda, got cpu" in msg
    assert "cpu_int8: no int8 dot products (test)" in msg
    assert "precision='auto' (full precision) would run this call on ['sdpa']" in msg
    with pytest.raises(AttentionBackendError, match="fa3_fp8: wrong device"):
        select_backend(q, k, precision="fp8")
    A.clear_caches()


def test_refusals_name_the_reason_and_the_usable_backends(monkeypatch):
    _fakes(monkeypatch)
    _on_cpu(monkeypatch, *LOWP)
    q, k, v = _qkv()
    # a forced backend of another precision
    with pytest.raises(AttentionBackendError, match=r"'sdpa' .* computes in full precision, not int8.*Usable "
                                                    r"backends for this call: \['sage', 'npu_int8'\]"):
        attention(q, k, v, precision="int8", backend="sdpa")
    with pytest.raises(AttentionBackendError, match="'sage_fp8' .* computes in fp8, not int8"):
        attention(q, k, v, precision="int8", backend="sage_fp8")
    # head dim above SageAttention's 128
    q2 = torch.zeros(1, 4, 2, 192, dtype=torch.bfloat16)
    assert select_backend(q2, precision="fp8") == "fa3_fp8"
    with pytest.raises(AttentionBackendError, match="'sage' .* unsupported head dim 192: needs <= 128"):
        select_backend(q2, backend="sage", precision="int8")
    # FA3 FP8: head dim a multiple of 16
    with pytest.raises(AttentionBackendError, match="unsupported head dim 72: needs <= 256 and a multiple of 16"):
        select_backend(torch.zeros(1, 4, 2, 72, dtype=torch.bfloat16), backend="fa3_fp8")
    # key-padding masks are not taken by low-precision kernels
    with pytest.raises(AttentionBackendError, match="no key-padding mask support"):
        attention(q, k, v, precision="int8", key_mask=torch.ones(1, k.shape[1], dtype=torch.bool))
    with pytest.raises(ValueError, match=r"precision must be one of \['auto', 'int8', 'fp8'\], got 'int4'"):
        attention(q, k, v, precision="int4")


def test_package_absent_is_named(monkeypatch):
    monkeypatch.setitem(sys.modules, "sageattention", None)
    monkeypatch.setattr(L, "cuda_capability", lambda device=None: (9, 0))
    A.clear_caches()
    assert "sageattention" in L.probe_sage() and "sageattention" in L.probe_sage_fp8()
    _gpu(monkeypatch, (9, 0))
    name, error = _decide("cuda", "int8", requested="sage")
    assert name is None and "sageattention" in error


# ------------------------------------------------------------------- argument mapping and numerics


@pytest.mark.parametrize("backend, precision", [("sage", "int8"), ("sage_fp8", "fp8"), ("fa3_fp8", "fp8"),
                                                ("npu_int8", "int8")])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_through_the_documented_contract_matches_dense(monkeypatch, backend, precision, dtype):
    _fakes(monkeypatch)
    _on_cpu(monkeypatch, backend)
    q, k, v = _qkv(dtype=dtype)
    ref = reference_attention(q, k, v, scale=0.11)
    t = lambda x: x.transpose(1, 2)  # noqa: E731
    for layout, args in (("BSND", (q, k, v)), ("BNSD", tuple(t(x) for x in (q, k, v)))):
        out, lse = attention(*args, layout=layout, scale=0.11, precision=precision, backend=backend, return_lse=True)
        out = out if layout == "BSND" else t(out)
        assert out.dtype == dtype and out.shape == q.shape
        cos_min, l1_max = BOUNDS[backend]
        assert cosine(out, ref) >= cos_min and rel_l1(out, ref) <= l1_max, (cosine(out, ref), rel_l1(out, ref))
        # log-sum-exp of the original (unsmoothed) logits, (B, N, S): what Ring attention merges with
        assert lse.shape == (1, 4, q.shape[1]) and lse.dtype == torch.float32
        assert (lse.double() - reference_lse(q, k, scale=0.11)).abs().max() < 0.05
    plain = attention(q, k, v, scale=0.11, precision=precision, backend=backend)
    assert cosine(plain, ref) >= BOUNDS[backend][0]


@pytest.mark.parametrize("arch, name, accum", [((8, 9), "sageattn_qk_int8_pv_fp8_cuda", "fp32+fp32"),
                                               ((9, 0), "sageattn_qk_int8_pv_fp8_cuda_sm90", "fp32+fp32")])
def test_sage_calls_the_documented_function_for_the_gpu(monkeypatch, arch, name, accum):
    calls = []
    _fakes(monkeypatch, arch, calls)
    _on_cpu(monkeypatch, "sage", "sage_fp8")
    q, k, v = _qkv()
    attention(q, k, v, precision="fp8")
    attention(q, k, v, precision="int8")
    assert calls == [(name, dict(tensor_layout="NHD", sm_scale=64 ** -0.5, pv_accum_dtype=accum, smooth_k=True)),
                     ("sageattn_qk_int8_pv_fp16_cuda", dict(tensor_layout="NHD", sm_scale=64 ** -0.5,
                                                            pv_accum_dtype="fp32", smooth_k=True))]


def test_fa3_fp8_descales_are_per_batch_and_kv_head(monkeypatch):
    seen = {}
    fake = make_flash_attn_interface_fp8()
    inner = fake.flash_attn_func

    def spy(q, k, v, **kw):
        seen.update(dtype=q.dtype, **{n: kw[n] for n in ("q_descale", "k_descale", "v_descale")})
        return inner(q, k, v, **kw)

    fake.flash_attn_func = spy
    _fakes(monkeypatch)
    monkeypatch.setitem(sys.modules, "flash_attn_interface", fake)
    _on_cpu(monkeypatch, "fa3_fp8")
    q, k, v = _qkv(b=2)
    v[1, :, 1] *= 40  # one (batch, KV head) with a much larger range: its own descale factor
    out = attention(q, k, v, precision="fp8")
    assert seen["dtype"] == torch.float8_e4m3fn
    assert all(seen[n].shape == (2, 2) and seen[n].dtype == torch.float32 for n in ("q_descale", "k_descale",
                                                                                   "v_descale"))
    vd = seen["v_descale"]
    assert float(vd[1, 1]) > 20 * max(float(vd[0, 0]), float(vd[0, 1]), float(vd[1, 0]))
    assert cosine(out, reference_attention(q, k, v)) >= BOUNDS["fa3_fp8"][0]


def test_npu_int8_passes_the_full_quantization_factors(monkeypatch):
    seen = {}
    fake = make_torch_npu()
    inner = fake.npu_fused_infer_attention_score

    def spy(q, k, v, **kw):
        seen.update(dtypes=(q.dtype, k.dtype, v.dtype), **{n: kw.get(n) for n in ("dequant_scale1", "quant_scale1",
                                                                                 "dequant_scale2", "quant_scale2")})
        return inner(q, k, v, **kw)

    fake.npu_fused_infer_attention_score = spy
    _fakes(monkeypatch)
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    _on_cpu(monkeypatch, "npu_int8")
    q, k, v = _qkv(dtype=torch.float16)
    out = attention(q, k, v, precision="int8")
    assert seen["dtypes"] == (torch.int8,) * 3 and seen["quant_scale2"] is None
    assert float(seen["quant_scale1"]) == 127.0
    assert out.dtype == torch.float16 and cosine(out, reference_attention(q, k, v)) >= BOUNDS["npu_int8"][0]

