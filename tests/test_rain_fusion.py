"""rain_fusion_attention: every backend against independent references.

Oracles: the dense-masked fp64 reference backend (a token mask built from the block list), an
explicit per-row loop computing softmax over the listed blocks (``_loop_reference`` below) and the
executable specification of the aclnn contract (tests/aclnn_spec.py).
"""

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lite_boost.ops import rain_fusion as rf
from lite_boost.ops import _sparse_npu
from lite_boost.ops.rain_fusion import SparseBackendError, rain_fusion_attention, sparse_backend

from aclnn_spec import AclnnError, aclnn_rain_fusion_attention


# --------------------------------------------------------------------------------------------- #
# helpers                                                                                        #
# --------------------------------------------------------------------------------------------- #


def random_selection(gen, rows, heads, n_kv_blocks, density, width=None):
    """Random valid (select_idx, select_num): ascending indices then -1; density 0 / 1 = empty / full rows."""
    width = n_kv_blocks if width is None else width
    pick = torch.rand(rows, heads, n_kv_blocks, generator=gen) < density
    num = pick.sum(-1)
    order = torch.where(pick, torch.arange(n_kv_blocks), n_kv_blocks + torch.arange(n_kv_blocks)).sort(-1).values
    idx = torch.where(order >= n_kv_blocks, torch.full_like(order, -1), order)
    if width > n_kv_blocks:
        idx = torch.nn.functional.pad(idx, (0, width - n_kv_blocks), value=-1)
    return idx[..., :width].contiguous(), num


def batched_selection(gen, q_lens, kv_lens, heads, bq, bk, density):
    m = max(math.ceil(n / bk) for n in kv_lens) or 1
    parts = [random_selection(gen, math.ceil(lq / bq), heads, math.ceil(lk / bk), density, m)
             for lq, lk in zip(q_lens, kv_lens)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def _loop_reference(q_seq, k_seq, v_seq, idx, num, bq, bk, scale):
    """One batch, head-major (N, L, D): explicit loop over query blocks and heads, fp64."""
    n1, lq, _ = q_seq.shape
    g = n1 // k_seq.shape[0]
    out = torch.zeros(n1, lq, v_seq.shape[-1], dtype=torch.float64)
    for i in range(math.ceil(lq / bq)):
        for h in range(n1):
            blocks = idx[i, h, : num[i, h]].tolist()
            if not blocks:
                continue
            cols = torch.cat([torch.arange(b * bk, min((b + 1) * bk, k_seq.shape[1])) for b in blocks])
            s = q_seq[h, i * bq:(i + 1) * bq].double() @ k_seq[h // g, cols].double().t() * scale
            out[h, i * bq:(i + 1) * bq] = torch.softmax(s, -1) @ v_seq[h // g, cols].double()
    return out


def make_tnd(gen, lens_q, lens_kv, n1, n2, d, dtype=torch.float32):
    q = torch.randn(sum(lens_q), n1, d, generator=gen).to(dtype)
    k = torch.randn(sum(lens_kv), n2, d, generator=gen).to(dtype)
    v = torch.randn(sum(lens_kv), n2, d, generator=gen).to(dtype)
    return q, k, v


# --------------------------------------------------------------------------------------------- #
# kernels vs references                                                                          #
# --------------------------------------------------------------------------------------------- #


def test_reference_backend_matches_explicit_loop():
    gen = torch.Generator().manual_seed(1)
    lens = [37, 70]
    q, k, v = make_tnd(gen, lens, lens, 4, 2, 8)
    idx, num = batched_selection(gen, lens, lens, 4, 16, 12, 0.5)
    out, lse = rain_fusion_attention(q, k, v, idx, num, [16, 12], actual_seq_lengths=lens, backend="reference",
                                     return_lse=True)
    start, row = 0, 0
    for n in lens:
        nqb = math.ceil(n / 16)
        seg = slice(start, start + n)
        exp = _loop_reference(q[seg].transpose(0, 1), k[seg].transpose(0, 1), v[seg].transpose(0, 1),
                              idx[row:row + nqb], num[row:row + nqb], 16, 12, 8 ** -0.5)
        torch.testing.assert_close(out[seg].transpose(0, 1).double(), exp, atol=1e-6, rtol=1e-6)
        start, row = start + n, row + nqb


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    layout=st.sampled_from(["TND", "BNSD"]),
    n2=st.integers(1, 2),
    group=st.sampled_from([1, 2, 3]),
    bq=st.sampled_from([4, 8, 16]),
    bk=st.sampled_from([4, 8, 12]),
    density=st.sampled_from([0.0, 0.3, 0.7, 1.0]),
    d=st.sampled_from([4, 8]),
    seed=st.integers(0, 2**31 - 1),
)
def test_gather_matches_dense_masked_reference(data, layout, n2, group, bq, bk, density, d, seed):
    gen = torch.Generator().manual_seed(seed)
    n1 = n2 * group
    if layout == "TND":
        batches = data.draw(st.integers(1, 3))
        lens_q = data.draw(st.lists(st.integers(0, 40), min_size=batches, max_size=batches))
        lens_kv = data.draw(st.lists(st.integers(1, 40), min_size=batches, max_size=batches))
        q, k, v = make_tnd(gen, lens_q, lens_kv, n1, n2, d)
        kw = dict(actual_seq_lengths=lens_q, actual_seq_lengths_kv=lens_kv)
    else:
        batches = data.draw(st.integers(1, 2))
        s_q, s_kv = data.draw(st.integers(1, 40)), data.draw(st.integers(1, 40))
        lens_q, lens_kv = [s_q] * batches, [s_kv] * batches
        q = torch.randn(batches, n1, s_q, d, generator=gen)
        k = torch.randn(batches, n2, s_kv, d, generator=gen)
        v = torch.randn(batches, n2, s_kv, d, generator=gen)
        kw = dict(q_input_layout="BNSD", kv_input_layout="BNSD")
    idx, num = batched_selection(gen, lens_q, lens_kv, n1, bq, bk, density)
    ref, ref_lse = rain_fusion_attention(q, k, v, idx, num, [bq, bk], backend="reference", return_lse=True, **kw)
    out, lse = rain_fusion_attention(q, k, v, idx, num, [bq, bk], backend="gather", return_lse=True, **kw)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    torch.testing.assert_close(lse.nan_to_num(0, 0, 0), ref_lse.nan_to_num(0, 0, 0), atol=1e-5, rtol=1e-5)
    assert not torch.isnan(out).any()


def test_empty_rows_give_zero_output_and_minus_inf_lse():
    gen = torch.Generator().manual_seed(3)
    q, k, v = make_tnd(gen, [20], [20], 2, 2, 8)
    idx, num = batched_selection(gen, [20], [20], 2, 8, 8, 1.0)
    idx[1, 0] = -1
    num[1, 0] = 0
    out, lse = rain_fusion_attention(q, k, v, idx, num, [8, 8], backend="gather", return_lse=True)
    assert torch.all(out[8:16, 0] == 0) and torch.all(torch.isneginf(lse[8:16, 0]))
    assert torch.isfinite(out).all() and torch.isfinite(lse[:8]).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_extremes_no_nan(dtype):
    gen = torch.Generator().manual_seed(4)
    q, k, v = make_tnd(gen, [64], [64], 2, 1, 16)
    q, k = (q * 40).to(dtype), (k * 40).to(dtype)  # logits far beyond the half-precision exp range
    v = v.to(dtype)
    idx, num = batched_selection(gen, [64], [64], 2, 16, 16, 0.5)
    ref, _ = rain_fusion_attention(q, k, v, idx, num, [16, 16], backend="reference")
    out, _ = rain_fusion_attention(q, k, v, idx, num, [16, 16], backend="gather")
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


# --------------------------------------------------------------------------------------------- #
# compiled FlexAttention (few shapes: each compiles)                                             #
# --------------------------------------------------------------------------------------------- #

needs_flex = pytest.mark.skipif(rf.FLEX.probe("cpu") is not None, reason=str(rf.FLEX.probe("cpu")))


@needs_flex
@pytest.mark.slow  # two FlexAttention compiles (fp32, bf16): ~20 s on 2 cores with a cold cache
def test_flex_bnsd_gqa_tails_empty_and_full_rows():
    gen = torch.Generator().manual_seed(5)
    b, n1, n2, s, d = 2, 4, 2, 200, 16
    q = torch.randn(b, n1, s, d, generator=gen)
    k = torch.randn(b, n2, s, d, generator=gen)
    v = torch.randn(b, n2, s, d, generator=gen)
    idx, num = batched_selection(gen, [s] * b, [s] * b, n1, 32, 32, 0.5)
    idx[0, 0], num[0, 0] = -1, 0  # empty row
    idx[1, 1], num[1, 1] = torch.arange(idx.shape[-1]), idx.shape[-1]  # full row
    kw = dict(q_input_layout="BNSD", kv_input_layout="BNSD")
    ref, _ = rain_fusion_attention(q, k, v, idx, num, [32, 32], backend="reference", **kw)
    out, lse = rain_fusion_attention(q, k, v, idx, num, [32, 32], backend="flex", **kw)
    assert lse is None
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert torch.all(out[0, 0, :32] == 0)
    # same shapes in bf16 (second compile), fp32 accumulation inside
    outh, _ = rain_fusion_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), idx, num, [32, 32], backend="flex", **kw)
    refh, _ = rain_fusion_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), idx, num, [32, 32], backend="reference", **kw)
    torch.testing.assert_close(outh.float(), refh.float(), atol=2e-2, rtol=2e-2)


@needs_flex
@pytest.mark.slow
def test_flex_tnd_varlen_matches_reference():
    gen = torch.Generator().manual_seed(6)
    lens_q, lens_kv = [70, 45], [50, 90]
    q, k, v = make_tnd(gen, lens_q, lens_kv, 2, 1, 16)
    idx, num = batched_selection(gen, lens_q, lens_kv, 2, 32, 16, 0.4)
    kw = dict(actual_seq_lengths=lens_q, actual_seq_lengths_kv=lens_kv)
    ref, _ = rain_fusion_attention(q, k, v, idx, num, [32, 16], backend="reference", **kw)
    out, _ = rain_fusion_attention(q, k, v, idx, num, [32, 16], backend="flex", **kw)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------------------------- #
# Ascend argument translation vs the executable aclnn contract                                   #
# --------------------------------------------------------------------------------------------- #


@pytest.fixture
def fake_npu(monkeypatch):
    """The NPU backend with the executable specification standing in for the operator."""
    calls = []

    def launch(call):
        calls.append(call)
        return aclnn_rain_fusion_attention(*call.as_args())

    monkeypatch.setattr(_sparse_npu, "probe", lambda device_type: None)
    monkeypatch.setattr(_sparse_npu, "launch", launch)
    return calls


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_npu_translation_tnd_varlen_gqa(fake_npu, dtype):
    gen = torch.Generator().manual_seed(7)
    lens_q, lens_kv = [40, 17, 33], [25, 48, 9]
    q, k, v = make_tnd(gen, lens_q, lens_kv, 4, 2, 16, dtype)
    idx, num = batched_selection(gen, lens_q, lens_kv, 4, 16, 8, 0.5)
    kw = dict(actual_seq_lengths=lens_q, actual_seq_lengths_kv=lens_kv, scale_value=0.3)
    out, lse = rain_fusion_attention(q, k, v, idx, num, [16, 8], backend="npu", **kw)
    ref, _ = rain_fusion_attention(q, k, v, idx, num, [16, 8], backend="reference", **kw)
    assert lse is None and out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.float(), ref.float(), atol=1e-2, rtol=1e-2)
    call = fake_npu[0]
    assert call.actualSeqLengthsOptional == lens_q and call.actualSeqLengthsKvOptional == lens_kv
    assert call.numKeyValueHeads == 2 and call.selectIdx.dtype == torch.int64


def test_npu_translation_bnsd_defaults(fake_npu):
    gen = torch.Generator().manual_seed(8)
    q = torch.randn(2, 2, 50, 16, generator=gen).half()
    k = torch.randn(2, 2, 50, 16, generator=gen).half()
    v = torch.randn(2, 2, 50, 16, generator=gen).half()
    idx, num = batched_selection(gen, [50, 50], [50, 50], 2, 16, 16, 0.6)
    kw = dict(q_input_layout="BNSD", kv_input_layout="BNSD")
    with sparse_backend("npu"):
        out, _ = rain_fusion_attention(q, k, v, idx, num, [16, 16], **kw)
    ref, _ = rain_fusion_attention(q, k, v, idx, num, [16, 16], backend="reference", **kw)
    torch.testing.assert_close(out.float(), ref.float(), atol=1e-2, rtol=1e-2)
    call = fake_npu[0]
    # the contract requires the per-batch lengths for BNSD too, and a D^-0.5 scale by default
    assert call.actualSeqLengthsOptional == [50, 50] and call.scaleValue == pytest.approx(16 ** -0.5)


def test_npu_refuses_what_the_contract_forbids(fake_npu):
    gen = torch.Generator().manual_seed(9)
    q, k, v = make_tnd(gen, [16], [16], 2, 2, 8)
    idx, num = batched_selection(gen, [16], [16], 2, 8, 8, 1.0)
    with pytest.raises(SparseBackendError, match="float16/bfloat16"):
        rain_fusion_attention(q, k, v, idx, num, [8, 8], backend="npu")
    with pytest.raises(SparseBackendError, match="inner_precise must be 0"):
        rain_fusion_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), idx, num, [8, 8], inner_precise=1, backend="npu")
    with pytest.raises(SparseBackendError, match="softmax_lse"):
        rain_fusion_attention(q.half(), k.half(), v.half(), idx, num, [8, 8], backend="npu", return_lse=True)
    assert not fake_npu  # nothing reached the operator


def test_aclnn_spec_rejects_cumulative_lengths():
    """The spec is strict: a translation passing cumulative lengths (FA-style) would fail here."""
    gen = torch.Generator().manual_seed(10)
    q, k, v = make_tnd(gen, [16, 16], [16, 16], 1, 1, 8, torch.float16)
    idx, num = batched_selection(gen, [16, 16], [16, 16], 1, 8, 8, 1.0)
    args = [q, k, v, idx, num, [8, 8], None, [16, 32], [16, 32], None, "TND", "TND", 1, 0, 0.3, 0, 0]
    with pytest.raises((AclnnError, IndexError, RuntimeError)):
        aclnn_rain_fusion_attention(*args)


def test_npu_backend_off_without_an_npu():
    assert "needs npu" in _sparse_npu.probe("cpu")
    assert rf.available_sparse_backends("cpu", torch.float16)["npu"] is not None
    with pytest.raises(SparseBackendError, match="needs npu"):
        rf.select_sparse_backend(torch.zeros(1, 1, 8, 8, dtype=torch.float16), backend="npu")


# --------------------------------------------------------------------------------------------- #
# selection of the backend                                                                       #
# --------------------------------------------------------------------------------------------- #


def test_backend_override_order(monkeypatch):
    q = torch.zeros(1, 1, 8, 8)
    monkeypatch.setenv(rf.ENV_VAR, "gather")
    assert rf.select_sparse_backend(q) == "gather"
    with sparse_backend("reference"):
        assert rf.select_sparse_backend(q) == "reference"
        assert rf.select_sparse_backend(q, backend="gather") == "gather"
    monkeypatch.setenv(rf.ENV_VAR, "bogus")
    with pytest.raises(ValueError, match=rf.ENV_VAR):
        rf.select_sparse_backend(q)
    monkeypatch.delenv(rf.ENV_VAR)
    cpp = rf.available_sparse_backends("cpu")["cpp"] is None  # the C++ kernel comes first once built
    expected = "cpp" if cpp else "flex" if rf.FLEX.probe("cpu") is None else "gather"
    assert rf.select_sparse_backend(q) == expected
    # flex on CPU has no lse; the C++ kernel has
    assert rf.select_sparse_backend(q, return_lse=True) == ("cpp" if cpp else "gather")
    with pytest.raises(ValueError, match="backend must be one of"):
        rf.select_sparse_backend(q, backend="triton")


def test_forced_flex_with_grad_is_refused():
    q = torch.zeros(1, 1, 8, 8, requires_grad=True)
    with pytest.raises(SparseBackendError, match="inference only"):
        rf.select_sparse_backend(q, backend="flex")
    assert rf.select_sparse_backend(q) == "gather"


def test_gather_backend_supports_autograd():
    gen = torch.Generator().manual_seed(11)
    q, k, v = make_tnd(gen, [24], [24], 1, 1, 8)
    q.requires_grad_(True)
    idx, num = batched_selection(gen, [24], [24], 1, 8, 8, 0.6)
    out, _ = rain_fusion_attention(q, k, v, idx, num, [8, 8])
    out.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


# --------------------------------------------------------------------------------------------- #
# bad input: clear errors before any kernel runs                                                  #
# --------------------------------------------------------------------------------------------- #


def _good():
    gen = torch.Generator().manual_seed(12)
    q, k, v = make_tnd(gen, [20, 12], [20, 12], 2, 1, 8)
    idx, num = batched_selection(gen, [20, 12], [20, 12], 2, 8, 8, 1.0)
    return dict(query=q, key=k, value=v, select_idx=idx, select_num_idx=num, block_shape=[8, 8],
                actual_seq_lengths=[20, 12])


def _with(**changes):
    kw = _good()
    for name, fn in changes.items():
        kw[name] = fn(kw) if callable(fn) else fn
    return kw


def _unsorted(kw):
    idx = kw["select_idx"].clone()
    idx[0, 0, :2] = torch.tensor([1, 0])
    return idx


def _out_of_range(kw):
    idx = kw["select_idx"].clone()
    idx[4, 0, 1] = 2  # batch 1 (12 tokens) has only 2 KV blocks
    return idx


def _bad_padding(kw):
    num = kw["select_num_idx"].clone()
    num[0, 0] = 1
    return num


BAD = [
    (dict(q_input_layout="BSH"), ValueError, "q_input_layout must be one of"),
    (dict(kv_input_layout="tnd "), ValueError, "kv_input_layout"),
    (dict(query=lambda kw: kw["query"][None]), ValueError, "query must be rank 3"),
    (dict(key=lambda kw: kw["key"].double()), TypeError, "key dtype"),
    (dict(value=lambda kw: kw["value"].half()), TypeError, "share one dtype"),
    (dict(num_key_value_heads=2), ValueError, "num_key_value_heads=2"),
    (dict(key=torch.zeros(32, 4, 8), value=torch.zeros(32, 4, 8)), ValueError, "multiple of key/value heads"),
    (dict(actual_seq_lengths=[20, 11]), ValueError, "actual_seq_lengths must sum"),
    (dict(actual_seq_lengths=[20, -12]), ValueError, "actual_seq_lengths must be a list"),
    (dict(block_shape=[8]), ValueError, "block_shape"),
    (dict(block_shape=[8, 0]), ValueError, "block_shape"),
    (dict(select_idx=_unsorted), ValueError, "strictly ascending"),
    (dict(select_idx=_out_of_range), ValueError, "out of range"),
    (dict(select_num_idx=_bad_padding), ValueError, "must be -1"),
    (dict(select_num_idx=lambda kw: kw["select_num_idx"] + 5), ValueError, "select_num_idx values"),
    (dict(select_idx=lambda kw: kw["select_idx"][:-1]), ValueError, "select_idx must have shape"),
    (dict(select_idx=lambda kw: kw["select_idx"].float()), TypeError, "select_idx must be an int64"),
    (dict(attn_mask=torch.ones(1, dtype=torch.bool)), ValueError, "attn_mask"),
    (dict(block_table=torch.zeros(1, 1, dtype=torch.int32)), ValueError, "paged attention"),
    (dict(block_size=128), ValueError, "paged attention"),
    (dict(mask_type=1), ValueError, "mask_type"),
    (dict(scale_value=-1.0), ValueError, "scale_value"),
    (dict(inner_precise=2), ValueError, "inner_precise"),
]


@pytest.mark.parametrize("changes,exc,match", BAD, ids=[m for _, _, m in BAD])
def test_bad_input_raises_before_any_kernel(monkeypatch, changes, exc, match):
    def boom(*a, **k):
        raise AssertionError("a kernel ran before validation finished")

    for name in ("_run_gather", "_run_reference", "_run_flex", "_run_npu"):
        monkeypatch.setattr(rf, name, boom)
    monkeypatch.setattr(rf, "_BACKENDS", {n: rf._Backend(n, b.rejects, boom, b.description)
                                          for n, b in rf._BACKENDS.items()})
    with pytest.raises(exc, match=match):
        rain_fusion_attention(**_with(**changes))


def test_good_call_passes_validation():
    out, _ = rain_fusion_attention(**_good(), backend="gather")
    assert out.shape == (32, 2, 8)
