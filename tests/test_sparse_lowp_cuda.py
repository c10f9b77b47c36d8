"""CUDA block-sparse int8 kernels (SpargeAttn, FlexAttention on int8-quantized Q / K) against the block-sparse
contract (a dense masked fp64 reference) through SpargeAttn's documented API (tests/lowp_specs.py)."""

import importlib
import sys

import pytest
import torch

from attention_specs import reference_attention
from lowp_specs import cosine, make_spas_sage_attn, rel_l1

S = importlib.import_module("lite_boost.ops._sparse_lowp_cuda")
O = importlib.import_module("lite_boost.ops._optional")


@pytest.fixture(autouse=True)
def _fresh():
    O.import_optional.cache_clear()
    yield
    O.import_optional.cache_clear()


def _case(n1=4, n2=2, lq=300, lk=280, d=48, block=(128, 128), dtype=torch.bfloat16, seed=0, empty_row=True):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n1, lq, d, generator=g).to(dtype)
    k = (torch.randn(n2, lk, d, generator=g) + 0.5).to(dtype)
    v = torch.randn(n2, lk, d, generator=g).to(dtype)
    nqb, nkb = -(-lq // block[0]), -(-lk // block[1])
    idx = torch.full((nqb, n1, nkb), -1, dtype=torch.int64)
    num = torch.zeros(nqb, n1, dtype=torch.int64)
    for i in range(nqb):
        for h in range(n1):
            chosen = sorted(torch.randperm(nkb, generator=g)[: 1 + (i + h) % nkb].tolist())
            idx[i, h, : len(chosen)] = torch.tensor(chosen)
            num[i, h] = len(chosen)
    if empty_row:
        idx[0, 1] = -1
        num[0, 1] = 0
    return q, k, v, idx, num


def _reference(q, k, v, idx, num, block, scale):
    """fp64 masked attention from the select arrays; rows selecting nothing are 0 (the contract)."""
    n1, lq, _ = q.shape
    lk = k.shape[1]
    allowed = torch.zeros(n1, lq, lk, dtype=torch.bool)
    for i in range(idx.shape[0]):
        for h in range(n1):
            for j in idx[i, h, : num[i, h]].tolist():
                allowed[h, i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]] = True
    rows = allowed.any(-1)  # (N1, Lq): rows selecting something (the others are computed unmasked, then zeroed)
    full = reference_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], scale,
                               allowed=(allowed | ~rows[..., None])[None])
    return torch.where(rows[..., None], full[0].transpose(0, 1), torch.zeros((), dtype=torch.float64))


@pytest.mark.parametrize("arch", [(8, 9), (9, 0)])
@pytest.mark.parametrize("lq", [300, 70])
def test_sparge_through_its_documented_api_matches_the_block_sparse_reference(monkeypatch, arch, lq):
    calls = []
    monkeypatch.setitem(sys.modules, "spas_sage_attn", make_spas_sage_attn(arch, calls))
    monkeypatch.setattr(S, "cuda_capability", lambda device=None: arch)
    q, k, v, idx, num = _case(lq=lq)
    out, lse = S.sparge_kernel(q, k, v, idx, num, (128, 128), 0.13)
    ref = _reference(q, k, v, idx, num, (128, 128), 0.13)
    assert lse is None and out.shape == q.shape and out.dtype == q.dtype
    assert bool(out[1, :128].eq(0).all())  # the row block that selects nothing: zeros, as the contract says
    assert cosine(out, ref) >= 0.9995 and rel_l1(out, ref) <= 0.03, (cosine(out, ref), rel_l1(out, ref))
    # the package's own mask granularity: 128 x 64 blocks (64 x 128 on sm90), at least 128 query rows
    bq, bk = (64, 128) if arch == (9, 0) else (128, 64)
    rows = max(lq, 128)
    assert calls == [dict(scale=0.13, smooth_k=True, tensor_layout="HND", shape=(1, 4, -(-rows // bq), -(-280 // bk)))]


def test_sparge_float32_and_head_dim_128(monkeypatch):
    monkeypatch.setitem(sys.modules, "spas_sage_attn", make_spas_sage_attn((8, 0)))
    monkeypatch.setattr(S, "cuda_capability", lambda device=None: (8, 0))
    q, k, v, idx, num = _case(n2=4, d=128, dtype=torch.float32, empty_row=False)
    out, _ = S.sparge_kernel(q, k, v, idx, num, (128, 128), 128 ** -0.5)
    ref = _reference(q, k, v, idx, num, (128, 128), 128 ** -0.5)
    assert out.dtype == torch.float32 and cosine(out, ref) >= 0.9995 and rel_l1(out, ref) <= 0.03


def test_sparge_refusals(monkeypatch):
    bf = torch.bfloat16
    assert S.sparge_reason("cpu", bf, (128, 128)) == "wrong device: needs cuda, got cpu"
    assert "log-sum-exp" in S.sparge_reason("cuda", bf, (128, 128), need_lse=True)
    assert "unsupported head dim 192" in S.sparge_reason("cuda", bf, (128, 128), head_dim=192)
    monkeypatch.setitem(sys.modules, "spas_sage_attn", None)
    assert "spas_sage_attn" in S.sparge_reason("cuda", bf, (128, 128))
    O.import_optional.cache_clear()
    monkeypatch.setitem(sys.modules, "spas_sage_attn", make_spas_sage_attn((9, 0)))
    monkeypatch.setattr(S, "cuda_capability", lambda device=None: (9, 0))
    assert S.sparge_reason("cuda", bf, (128, 128)) is None
    assert "not a multiple of SpargeAttn's 64 x 128" in S.sparge_reason("cuda", bf, (128, 64))
    monkeypatch.setattr(S, "cuda_capability", lambda device=None: (7, 5))
    assert "compute capability >= 8.0" in S.sparge_reason("cuda", bf, (128, 128))


def test_flex_int8_refusals():
    assert "wrong device: needs cuda, got cpu" in S.flex_int8_reason("cpu", torch.float16, (128, 128))
    assert "multiples of 128" in S.flex_int8_reason("cuda", torch.float16, (64, 128))
    assert "inference only" in S.flex_int8_reason("cuda", torch.float16, (128, 128), needs_grad=True)


def test_flex_int8_kernel_matches_the_block_sparse_reference():
    """The kernel is device-agnostic: compiled FlexAttention on CPU runs the same code as on CUDA."""
    if S.FLEX.probe("cpu") is not None:
        pytest.skip(S.FLEX.probe("cpu"))
    q, k, v, idx, num = _case(n2=4, lq=256, lk=256, d=32, dtype=torch.float32, empty_row=False)
    out, _ = S.flex_int8_kernel(q, k, v, idx, num, (128, 128), 0.2)
    ref = _reference(q, k, v, idx, num, (128, 128), 0.2)
    assert cosine(out, ref) >= 0.9995 and rel_l1(out, ref) <= 0.03, (cosine(out, ref), rel_l1(out, ref))
    assert rel_l1(out, ref) > 1e-4  # Q and K really went through int8 (fp32 alone is ~1e-7 off)


@pytest.mark.parametrize("kernel", [S.sparge_kernel, S.flex_int8_kernel])
def test_empty_segments_give_zeros_without_calling_a_kernel(monkeypatch, kernel):
    monkeypatch.setitem(sys.modules, "spas_sage_attn", None)  # would fail if called
    monkeypatch.setattr(S, "FLEX", None)
    q, k, v = torch.randn(2, 0, 32), torch.randn(1, 5, 32), torch.randn(1, 5, 32)
    out, _ = kernel(q, k, v, torch.zeros(0, 2, 1, dtype=torch.int64), torch.zeros(0, 2, dtype=torch.int64),
                    (128, 128), 0.1)
    assert out.shape == (2, 0, 32)
    q = torch.randn(2, 7, 32)
    out, _ = kernel(q, k[:, :0], v[:, :0], torch.zeros(1, 2, 0, dtype=torch.int64),
                    torch.zeros(1, 2, dtype=torch.int64), (128, 128), 0.1)
    assert bool(out.eq(0).all()) and out.shape == (2, 7, 32)


# ------------------------------------------------------------------- wiring into rain_fusion_attention

RF = importlib.import_module("lite_boost.ops.rain_fusion")


def _cuda_with_sparge(monkeypatch, arch=(8, 9)):
    monkeypatch.setitem(sys.modules, "spas_sage_attn", make_spas_sage_attn(arch))
    monkeypatch.setattr(S, "cuda_capability", lambda device=None: arch)
    monkeypatch.setattr(S.FLEX, "probe", lambda device_type: None)  # triton present


def test_rain_fusion_order_for_int8_on_cuda(monkeypatch):
    _cuda_with_sparge(monkeypatch)
    usable = RF.available_sparse_backends("cuda", torch.bfloat16, precision="int8")
    assert usable["sparge"] is None and usable["flex_int8"] is None
    assert "precision='int8'" in usable["flex"] and "precision='int8'" in usable["gather"]
    c = RF._Context("cuda", torch.bfloat16, False, False, (128, 128), 4, 4, 0, "int8", 64)
    assert RF._choose(c, None)[0] == "sparge"
    # Ring needs the log-sum-exp: SpargeAttn returns none, FlexAttention on int8 Q / K does
    c_lse = RF._Context("cuda", torch.bfloat16, True, False, (128, 128), 4, 4, 0, "int8", 64)
    assert RF._choose(c_lse, None)[0] == "flex_int8"
    # a head dim above SpargeAttn's 128 goes to FlexAttention too
    assert RF._choose(RF._Context("cuda", torch.bfloat16, False, False, (128, 128), 4, 4, 0, "int8", 192),
                      None)[0] == "flex_int8"
    # precision "auto" never picks an int8 kernel; forcing one says to pass precision='int8'
    auto = RF._Context("cuda", torch.bfloat16, False, False, (128, 128), 4, 4, 0, "auto", 64)
    assert RF._choose(auto, None)[0] == "flex"
    with pytest.raises(RF.SparseBackendError, match=r"'sparge' .* computes in int8 only .*pass precision='int8'"):
        RF._choose(auto, "sparge")
    # without SpargeAttn: FlexAttention on int8 Q / K, and the reason is reported
    monkeypatch.setitem(sys.modules, "spas_sage_attn", None)
    O.import_optional.cache_clear()
    assert RF._choose(c, None) == ("flex_int8", "automatic (skipped npu: wrong device: needs npu, got cuda; cpp: wrong "
                                   "device: needs cpu, got cuda; sparge: spas_sage_attn is not installed)")


def test_npu_block_sparse_refuses_int8_as_cann_documents_no_quantized_mode():
    c = RF._Context("npu", torch.float16, False, False, (128, 128), 4, 4, 0, "int8", 64)
    assert "input dtype only" in RF._BACKENDS["npu"].rejects(c)
    assert "wrong device" in RF._BACKENDS["sparge"].rejects(c)


@pytest.mark.parametrize("layout", ["TND", "BNSD"])
def test_rain_fusion_attention_runs_sparge_per_batch(monkeypatch, layout):
    """The public entry point through the SpargeAttn spec (device check lifted: the spec runs on CPU)."""
    _cuda_with_sparge(monkeypatch, (9, 0))
    monkeypatch.setattr(S, "sparge_reason", lambda *a, **k: None)
    g = torch.Generator().manual_seed(3)
    lens = [200, 130] if layout == "TND" else [200, 200]
    n1, n2, d = 4, 2, 64
    if layout == "TND":
        q, k, v = (torch.randn(sum(lens), n, d, generator=g).bfloat16() for n in (n1, n2, n2))
    else:
        q, k, v = (torch.randn(2, n, 200, d, generator=g).bfloat16() for n in (n1, n2, n2))
    nqb = sum(-(-x // 128) for x in lens)
    idx = torch.tensor([[0, 1]] * n1 * nqb).view(nqb, n1, 2)
    idx[0, 0, 1] = -1
    num = (idx >= 0).sum(-1)
    kw = dict(actual_seq_lengths=lens, actual_seq_lengths_kv=lens, q_input_layout=layout, kv_input_layout=layout)
    out, lse = RF.rain_fusion_attention(q, k, v, idx, num, [128, 128], backend="sparge", precision="int8", **kw)
    ref, _ = RF.rain_fusion_attention(q.float(), k.float(), v.float(), idx, num, [128, 128],
                                      backend="reference", **kw)
    assert lse is None and out.dtype == torch.bfloat16
    assert cosine(out, ref) >= 0.9995 and rel_l1(out, ref) <= 0.03, (cosine(out, ref), rel_l1(out, ref))
