import dataclasses
import importlib
import logging
import sys

import pytest
import torch

from lite_boost.ops import AttentionBackendError, attention, attention_backend, select_backend

from attention_specs import make_flash_attn, make_flash_attn_interface, make_torch_npu, reference_attention

# the module (``lite_boost.ops.attention`` the attribute is the function of the same name)
A = importlib.import_module("lite_boost.ops.attention")


@pytest.fixture(autouse=True)
def _fresh_caches(monkeypatch):
    monkeypatch.delenv(A.ENV_VAR, raising=False)
    A.clear_caches()
    yield
    A.clear_caches()


def _qkv(b=2, s=37, n=4, d=32, nk=None, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    nk = nk or n
    q = torch.randn(b, s, n, d, generator=g).to(dtype)
    k = torch.randn(b, s + 5, nk, d, generator=g).to(dtype)
    v = torch.randn(b, s + 5, nk, d, generator=g).to(dtype)
    return q, k, v


@pytest.mark.parametrize("nk", [4, 2, 1])
def test_sdpa_matches_reference_both_layouts_and_gqa(nk):
    q, k, v = _qkv(nk=nk)
    ref = reference_attention(q, k, v)
    out = attention(q, k, v)
    assert out.dtype == q.dtype and out.shape == q.shape
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    t = lambda x: x.transpose(1, 2)  # noqa: E731
    out_bnsd = attention(t(q), t(k), t(v), layout="BNSD")
    torch.testing.assert_close(t(out_bnsd).double(), ref, atol=1e-5, rtol=1e-5)
    scaled = attention(q, k, v, scale=0.3)
    torch.testing.assert_close(scaled.double(), reference_attention(q, k, v, scale=0.3), atol=1e-5, rtol=1e-5)


def test_cpu_auto_choice_is_sdpa_and_logged_once(caplog):
    q, k, v = _qkv()
    with caplog.at_level(logging.INFO, logger="lite_boost.attention"):
        assert select_backend(q) == "sdpa"
        attention(q, k, v)
        attention(q, k, v)
    msgs = [r.getMessage() for r in caplog.records if r.name == "lite_boost.attention"]
    assert len(msgs) == 1, msgs
    assert "'sdpa'" in msgs[0] and "fa3: wrong device" in msgs[0]


@pytest.mark.parametrize(
    "args, kwargs, exc, fragment",
    [
        ((torch.zeros(2, 3, 4),) * 3, {}, ValueError, "q must be a rank-4 tensor"),
        ((torch.zeros(1, 3, 2, 8), torch.zeros(1, 3, 2, 8), torch.zeros(1, 3, 2, 4)), {}, ValueError, "share the head dim"),
        ((torch.zeros(1, 3, 2, 8), torch.zeros(1, 3, 2, 8).half(), torch.zeros(1, 3, 2, 8)), {}, TypeError, "share one dtype"),
        ((torch.zeros(1, 3, 3, 8), torch.zeros(1, 3, 2, 8), torch.zeros(1, 3, 2, 8)), {}, ValueError, "multiple of key/value heads"),
        ((torch.zeros(1, 3, 2, 8), torch.zeros(1, 4, 2, 8), torch.zeros(1, 3, 2, 8)), {}, ValueError, "same sequence length"),
        ((torch.zeros(1, 3, 2, 8),) * 3, {"layout": "BHSD"}, ValueError, r"layout must be one of \['BSND', 'BNSD'\]"),
        ((torch.zeros(1, 3, 2, 8),) * 3, {"scale": -1.0}, ValueError, "scale must be a positive number"),
        ((torch.zeros(1, 3, 2, 8),) * 3, {"backend": "triton"}, ValueError, r"backend must be one of \['fa3', 'fa2', 'npu', 'sdpa', 'sage', 'sage_fp8', 'fa3_fp8', 'npu_int8', 'cpu_int8'\]"),
        ((torch.zeros(1, 3, 2, 8, dtype=torch.int64),) * 3, {}, TypeError, "floating-point"),
    ],
)
def test_bad_input(args, kwargs, exc, fragment):
    with pytest.raises(exc, match=fragment):
        attention(*args, **kwargs)


def test_forcing_an_unavailable_backend_says_why_and_lists_usable_ones():
    q, k, v = _qkv()
    with pytest.raises(AttentionBackendError) as info:
        attention(q, k, v, backend="fa2")
    msg = str(info.value)
    assert "'fa2' (requested by the call) is unavailable" in msg
    assert "wrong device: needs cuda, got cpu" in msg and "Usable backends for this call: ['sdpa'" in msg


def test_forcing_reports_not_installed_and_bad_dtype(monkeypatch):
    q, k, v = _qkv()
    cpu_fa2 = dataclasses.replace(A.BACKENDS["fa2"], devices=("cpu",))
    monkeypatch.setitem(A.BACKENDS, "fa2", cpu_fa2)
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # as if not installed
    with pytest.raises(AttentionBackendError, match="unsupported dtype float32"):
        attention(q, k, v, backend="fa2")
    with pytest.raises(AttentionBackendError, match="flash_attn"):
        attention(q.half(), k.half(), v.half(), backend="fa2")


def test_context_manager_and_env_var(monkeypatch):
    q, k, v = _qkv()
    with attention_backend("fa3"):
        with pytest.raises(AttentionBackendError, match=r"forced by attention_backend\(\.\.\.\)"):
            attention(q, k, v)
        # the per-call argument wins over the context manager
        torch.testing.assert_close(attention(q, k, v, backend="sdpa").double(), reference_attention(q, k, v),
                                   atol=1e-5, rtol=1e-5)
    assert select_backend(q) == "sdpa"
    monkeypatch.setenv(A.ENV_VAR, "npu")
    with pytest.raises(AttentionBackendError, match=f"forced by {A.ENV_VAR}"):
        attention(q, k, v)
    monkeypatch.setenv(A.ENV_VAR, "SDPA")
    assert select_backend(q) == "sdpa"
    monkeypatch.setenv(A.ENV_VAR, "fast")
    with pytest.raises(ValueError, match=f"environment variable {A.ENV_VAR} must be one of"):
        attention(q, k, v)
    with pytest.raises(ValueError, match="name must be one of"):
        with attention_backend("cudnn"):
            pass


def _usable_on_cpu(monkeypatch, name, module_name, fake):
    monkeypatch.setitem(sys.modules, module_name, fake)
    spec = A.BACKENDS[name]
    monkeypatch.setitem(A.BACKENDS, name, dataclasses.replace(spec, devices=spec.devices + ("cpu",), probe=lambda: None))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_auto_order_prefers_fa3_then_fa2_then_npu_with_contract_specs(monkeypatch, dtype):
    q, k, v = _qkv(nk=2, dtype=dtype)
    ref = reference_attention(q, k, v)
    tol = dict(atol=2e-2, rtol=2e-2)
    _usable_on_cpu(monkeypatch, "npu", "torch_npu", make_torch_npu())
    A.clear_caches()
    assert select_backend(q, k) == "npu"
    torch.testing.assert_close(attention(q, k, v).double(), ref, **tol)
    _usable_on_cpu(monkeypatch, "fa2", "flash_attn", make_flash_attn())
    A.clear_caches()
    assert select_backend(q, k) == "fa2"
    torch.testing.assert_close(attention(q, k, v).double(), ref, **tol)
    _usable_on_cpu(monkeypatch, "fa3", "flash_attn_interface", make_flash_attn_interface())
    A.clear_caches()
    assert select_backend(q, k) == "fa3"
    torch.testing.assert_close(attention(q, k, v).double(), ref, **tol)
    # fp32 is outside every fast backend's dtypes: automatic choice falls back to SDPA
    assert select_backend(q.float(), k.float()) == "sdpa"
    # a forced backend still runs through the dispatcher, in the BNSD layout too
    t = lambda x: x.transpose(1, 2)  # noqa: E731
    out = attention(t(q), t(k), t(v), layout="BNSD", backend="npu", scale=0.2)
    torch.testing.assert_close(t(out).double(), reference_attention(q, k, v, scale=0.2), **tol)


def test_head_dim_limits_are_declared(monkeypatch):
    _usable_on_cpu(monkeypatch, "fa2", "flash_attn", make_flash_attn())
    A.clear_caches()
    q = torch.zeros(1, 4, 2, 264, dtype=torch.float16)
    assert select_backend(q) == "sdpa"  # 264 > 256: FA2 declines, SDPA takes it
    with pytest.raises(AttentionBackendError, match="unsupported head dim 264: needs <= 256"):
        select_backend(q, backend="fa2")


def test_available_backends_and_report():
    avail = A.available_backends("cpu", torch.float32, 128)
    assert avail["sdpa"] is None and "wrong device" in avail["fa2"]
    rows = dict((n, (s, d)) for n, s, d in A.backend_report())
    assert rows["sdpa"][0] == "installed"
    assert set(rows) == {"fa3", "fa2", "npu", "sdpa", "sage", "sage_fp8", "fa3_fp8", "npu_int8",
                         "cpu_int8"}


def test_import_is_light_and_never_touches_optional_packages():
    import subprocess

    code = (
        "import sys, lite_boost, lite_boost.ops, lite_boost.config\n"
        "bad = [m for m in ('flash_attn', 'flash_attn_interface', 'torch_npu', 'diffusers') if m in sys.modules]\n"
        "assert not bad, bad\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
