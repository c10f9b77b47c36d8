"""The Ascend C++ translation (csrc/npu/aclnn_translate.cpp) run on CPU against the aclnn test double.

The double (tests/aclnn_double/aclnn_double.cpp) defines the aclnn entry points with their documented
signatures, validates every argument against the operator documents, checks the two-phase protocol
and computes the documented result in fp32. What the tests compare against is independent of the
code under test: lite_boost's ``reference`` rain-fusion backend (an fp64 dense masked attention) and
PyTorch SDPA. The double's own strictness is checked through the ``*_unchecked`` entry points, which
skip the translation's checks and hand the arguments to the double as given.
"""

import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import importlib

from lite_boost.ops import _sparse_npu
from lite_boost.ops.rain_fusion import rain_fusion_attention

from _aclnn_double import load
from test_rain_fusion import batched_selection, make_tnd

A = importlib.import_module("lite_boost.ops.attention")  # the module (lite_boost.ops.attention is also a function)

ROOT = Path(__file__).resolve().parents[1]
RF_GWS = "aclnnRainFusionAttentionGetWorkspaceSize"
PFA_GWS = "aclnnPromptFlashAttentionV3GetWorkspaceSize"


@pytest.fixture(scope="module")
def dbl():
    try:
        return load()
    except Exception as exc:  # noqa: BLE001 - no compiler on this machine
        if __import__("os").environ.get("LITE_BOOST_REQUIRE_EXT"):
            raise
        pytest.skip(f"the aclnn double could not be built: {exc.__class__.__name__}: {str(exc)[:300]}")


@pytest.fixture
def ops(dbl):
    dbl.clear_events()
    yield dbl
    assert dbl.live_handles() == 0, "aclTensor / aclIntArray handles leaked"


def rf_ref(q, k, v, idx, num, block, **kw):
    out, _ = rain_fusion_attention(q.float(), k.float(), v.float(), idx, num, block, backend="reference", **kw)
    return out.double()


def tol(dtype):
    return dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=4e-3, rtol=4e-3)


# --------------------------------------------------------------------------------------------- #
# aclnnRainFusionAttention                                                                       #
# --------------------------------------------------------------------------------------------- #


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_rain_fusion_tnd_varlen_gqa_tail_blocks(ops, dtype):
    gen = torch.Generator().manual_seed(11)
    lens_q, lens_kv = [40, 17, 33], [25, 48, 9]  # partial tail blocks everywhere
    q, k, v = make_tnd(gen, lens_q, lens_kv, 4, 2, 16, dtype)
    idx, num = batched_selection(gen, lens_q, lens_kv, 4, 16, 8, 0.5)
    kw = dict(actual_seq_lengths=lens_q, actual_seq_lengths_kv=lens_kv, scale_value=0.3)
    out, lse = ops.rain_fusion_attention(q, k, v, idx, num, [16, 8], num_key_value_heads=2, **kw)
    assert out.dtype == dtype and out.shape == q.shape and lse.numel() == 0
    torch.testing.assert_close(out.double(), rf_ref(q, k, v, idx, num, [16, 8], **kw), **tol(dtype))


@pytest.mark.parametrize("dtype,inner_precise", [(torch.float16, 0), (torch.float16, 1), (torch.bfloat16, 0)])
def test_rain_fusion_bnsd_empty_rows_and_strided_query(ops, dtype, inner_precise):
    gen = torch.Generator().manual_seed(12)
    b, n1, n2, s, d = 2, 4, 1, 45, 32
    q = torch.randn(b, s, n1, d, generator=gen).to(dtype).transpose(1, 2)  # BNSD view of BSND: strided
    k = torch.randn(b, n2, s, d, generator=gen).to(dtype)
    v = torch.randn(b, n2, s, d, generator=gen).to(dtype)
    idx, num = batched_selection(gen, [s] * b, [s] * b, n1, 16, 16, 0.4)
    num[0, 0] = 0  # a query block that selects nothing: the contract says 0, aclnn leaves it unspecified
    idx[0, 0] = -1
    kw = dict(q_input_layout="BNSD", kv_input_layout="BNSD")
    out, _ = ops.rain_fusion_attention(q, k, v, idx, num, [16, 16], inner_precise=inner_precise, **kw)
    assert not q.is_contiguous() and torch.isfinite(out).all()
    assert (out[0, 0, :16] == 0).all()
    torch.testing.assert_close(out.double(), rf_ref(q, k, v, idx, num, [16, 16], **kw), **tol(dtype))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_rain_fusion_random_cases(ops, data):
    """TND varlen and BNSD, GQA, tail blocks, empty/one/all-block rows, batch > 1: translation + double vs reference."""
    layout = data.draw(st.sampled_from(["TND", "BNSD"]))
    batch = data.draw(st.integers(1, 3))
    if layout == "TND":
        lens_q = data.draw(st.lists(st.integers(0, 40), min_size=batch, max_size=batch))
        lens_kv = data.draw(st.lists(st.integers(1, 40), min_size=batch, max_size=batch))
    else:
        lens_q = [data.draw(st.integers(1, 40))] * batch
        lens_kv = [data.draw(st.integers(1, 40))] * batch
    n2 = data.draw(st.sampled_from([1, 2]))
    n1 = n2 * data.draw(st.sampled_from([1, 2, 4]))
    d = data.draw(st.sampled_from([8, 24]))
    bq, bk = data.draw(st.sampled_from([4, 8, 16])), data.draw(st.sampled_from([4, 8, 16]))
    density = data.draw(st.sampled_from([0.0, 0.3, 1.0]))
    dtype = data.draw(st.sampled_from([torch.float16, torch.bfloat16]))
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    q, k, v = make_tnd(gen, lens_q, lens_kv, n1, n2, d, dtype)
    kw = dict(actual_seq_lengths=lens_q, actual_seq_lengths_kv=lens_kv)
    if layout == "BNSD":
        q, k, v = (t.view(batch, -1, *t.shape[1:]).transpose(1, 2) for t in (q, k, v))
        kw = dict(q_input_layout="BNSD", kv_input_layout="BNSD")
    idx, num = batched_selection(gen, lens_q, lens_kv, n1, bq, bk, density)
    out, _ = ops.rain_fusion_attention(q, k, v, idx, num, [bq, bk], **kw)
    torch.testing.assert_close(out.double(), rf_ref(q, k, v, idx, num, [bq, bk], **kw), **tol(dtype))


def test_rain_fusion_two_phase_protocol(ops):
    gen = torch.Generator().manual_seed(13)
    q, k, v = make_tnd(gen, [24], [24], 2, 2, 8, torch.float16)
    idx, num = batched_selection(gen, [24], [24], 2, 8, 8, 1.0)
    ops.rain_fusion_attention(q, k, v, idx, num, [8, 8])
    ev = list(ops.events())
    calls = [e for e in ev if not e.startswith("acl") or e.startswith("aclnn")]
    m = re.fullmatch(rf"{RF_GWS} -> (\d+)", calls[1])
    assert calls[0] == RF_GWS and m, calls
    ws = int(m.group(1))
    assert ws == 1024 + 16 * 3 * 2  # the double asks for 1 KiB + 16 B per (query block, head)
    assert calls[2:] == [f"glue.workspace {ws}", "glue.stream", "glue.launch aclnnRainFusionAttention",
                         f"aclnnRainFusionAttention workspace={ws}", "aclnnRainFusionAttention done"]
    # every handle was created before phase one and destroyed only after the launch, once
    first_gws, done = ev.index(RF_GWS), ev.index("aclnnRainFusionAttention done")
    created = [i for i, e in enumerate(ev) if e.startswith("aclCreate")]
    destroyed = [i for i, e in enumerate(ev) if e.startswith("aclDestroy")]
    assert len(created) == len(destroyed) == 9  # q, k, v, idx, num, out + block_shape and both lengths
    assert max(created) < first_gws and min(destroyed) > done


@pytest.mark.parametrize("change,exc,match", [
    (dict(dtype=torch.float32), TypeError, "float16/bfloat16 inputs only"),
    (dict(q_input_layout="BSH"), ValueError, r"q_input_layout must be one of \['TND', 'BNSD'\]"),
    (dict(kv_input_layout="NTD"), ValueError, "kv_input_layout must be one of"),
    (dict(dtype=torch.bfloat16, inner_precise=1), ValueError, "inner_precise must be 0 .fp32 softmax. for bfloat16"),
    (dict(inner_precise=2), ValueError, "inner_precise must be 0 .fp32 softmax. or 1"),
    (dict(heads=(6, 2)), ValueError, "= 3 must be < 128 and divide 128"),
    (dict(heads=(4, 3)), ValueError, r"query heads \(4\) must be a positive multiple of key/value heads \(3\)"),
    (dict(num_key_value_heads=1), ValueError, r"num_key_value_heads=1 does not match the key/value tensors \(2 heads\)"),
    (dict(idx_dtype=torch.float32), TypeError, r"select_idx must be an int64 \(or int32\) tensor, got float32"),
    (dict(idx_shape=True), ValueError, r"select_idx must have shape \[total query blocks=6, heads=4, max kv blocks\], got \(5, 4, 3\)"),
    (dict(out_of_range=True), ValueError, "is out of range: KV block indices of this batch must be in"),
    (dict(unsorted=True), ValueError, "must be strictly ascending before the -1 padding"),
    (dict(bad_padding=True), ValueError, "must be -1: entries past select_num_idx"),
    (dict(num_too_big=True), ValueError, r"select_num_idx values must be in \[0, "),
    (dict(atten_mask=True), ValueError, "not supported by aclnnRainFusionAttention"),
    (dict(block_size=16), ValueError, "paged attention is not supported"),
    (dict(mask_type=1), ValueError, "mask_type must be 0"),
    (dict(return_lse=True), ValueError, "does not produce softmax_lse"),
    (dict(value_dim=8), ValueError, r"value head dim \(8\) must equal the query's \(16\)"),
    (dict(cumulative=True), ValueError, "must sum to the TND token count 37"),
    (dict(block_shape=[0, 8]), ValueError, "block_shape must be two positive ints"),
    (dict(scale_value=-1.0), ValueError, "scale_value must be a positive finite number"),
])
def test_rain_fusion_bad_arguments_raise_before_any_acl_call(ops, change, exc, match):
    gen = torch.Generator().manual_seed(14)
    lens = [20, 17]
    n1, n2 = change.get("heads", (4, 2))
    dtype = change.get("dtype", torch.float16)
    q, k, v = make_tnd(gen, lens, lens, n1, n2, 16, dtype)
    if "value_dim" in change:
        v = v[..., : change["value_dim"]]
    idx, num = batched_selection(gen, lens, lens, n1, 8, 8, 0.7)
    num[0, 0], idx[0, 0] = 2, torch.tensor([0, 1, -1])
    if change.get("idx_dtype"):
        idx = idx.to(change["idx_dtype"])
    if change.get("idx_shape"):
        idx = idx[:-1]
    if change.get("out_of_range"):
        idx[0, 0, 1] = 3
    if change.get("unsorted"):
        idx[0, 0, :2] = torch.tensor([1, 0])
    if change.get("bad_padding"):
        idx[0, 0, 2] = 2
    if change.get("num_too_big"):
        num[0, 0] = 4
    kw = dict(actual_seq_lengths=[20, 37] if change.get("cumulative") else lens)
    for key in ("q_input_layout", "kv_input_layout", "inner_precise", "num_key_value_heads", "block_size",
                "mask_type", "return_lse", "scale_value"):
        if key in change:
            kw[key] = change[key]
    if change.get("atten_mask"):
        kw["atten_mask"] = torch.zeros(37, 37, dtype=torch.bool)
    with pytest.raises(exc, match=match):
        ops.rain_fusion_attention(q, k, v, idx, num, change.get("block_shape", [8, 8]), **kw)
    assert list(ops.events()) == [], "a failed check must come before any acl object or aclnn call"


@pytest.mark.parametrize("case,status,match", [
    ("cumulative", 161002, "per-batch lengths summing to T=37"),
    ("lowercase", 161002, "qInputLayout must be TND or BNSD, got tnd"),
    ("float32", 161002, "query dtype must be FLOAT16 or BFLOAT16"),
    ("no_lengths", 161001, "actualSeqLengths and actualSeqLengthsKv are required"),
    ("bf16_fp16_softmax", 161002, "innerPrecise must be 0 for BFLOAT16"),
    ("unsorted", 161002, "not ascending"),
    ("mask", 161002, "attenMask is not supported"),
    ("kv_heads", 161002, "numKeyValueHeads 1 differs from the key's 2 heads"),
    ("int32_idx", None, None),  # the translation converts int32 indices: accepted
])
def test_the_double_itself_enforces_the_contract(ops, case, status, match):
    """Unchecked entry: arguments reach the double untouched, its status surfaces as a RuntimeError."""
    gen = torch.Generator().manual_seed(15)
    lens = [20, 17]
    dtype = {"float32": torch.float32, "bf16_fp16_softmax": torch.bfloat16}.get(case, torch.float16)
    q, k, v = make_tnd(gen, lens, lens, 2, 2, 8, dtype)
    idx, num = batched_selection(gen, lens, lens, 2, 8, 8, 1.0)
    kw = dict(actual_seq_lengths=lens, actual_seq_lengths_kv=lens)
    if case == "cumulative":
        kw = dict(actual_seq_lengths=[20, 37], actual_seq_lengths_kv=[20, 37])
    if case == "no_lengths":
        kw = {}
    if case == "lowercase":
        kw.update(q_input_layout="tnd")
    if case == "bf16_fp16_softmax":
        kw.update(inner_precise=1)
    if case == "unsorted":
        idx[1, 1, :2] = idx[1, 1, :2].flip(0)
    if case == "int32_idx":
        idx, num = idx.int(), num.int()
    if case == "mask":
        kw.update(atten_mask=torch.zeros(37, 37, dtype=torch.bool))
    if case == "kv_heads":
        kw.update(num_key_value_heads=1)
    if status is None:
        out, _ = ops.rain_fusion_attention_unchecked(q, k, v, idx, num, [8, 8], scale_value=0.35, **kw)
        torch.testing.assert_close(out.double(), rf_ref(q, k, v, idx, num, [8, 8], scale_value=0.35, **kw), **tol(dtype))
        return
    name = {161001: "ACLNN_ERR_PARAM_NULLPTR", 161002: "ACLNN_ERR_PARAM_INVALID"}[status]
    with pytest.raises(RuntimeError, match=rf"{RF_GWS} returned {status} \({name}\): .*{match}"):
        ops.rain_fusion_attention_unchecked(q, k, v, idx, num, [8, 8], **kw)
    assert not any(e.startswith("glue.") for e in ops.events()), "nothing may be launched after a failed phase one"


@pytest.mark.parametrize("entry,status", [(RF_GWS, 161002), ("aclnnRainFusionAttention", 361001)])
def test_aclnn_failures_surface_and_release_everything(ops, entry, status):
    gen = torch.Generator().manual_seed(16)
    q, k, v = make_tnd(gen, [16], [16], 2, 2, 8, torch.float16)
    idx, num = batched_selection(gen, [16], [16], 2, 8, 8, 1.0)
    ops.fail_next(entry, status)
    with pytest.raises(RuntimeError, match=rf"{entry} returned {status} .*injected failure of {entry}"):
        ops.rain_fusion_attention(q, k, v, idx, num, [8, 8])
    # `ops` asserts on teardown that no aclTensor / aclIntArray outlived the failed call


# --------------------------------------------------------------------------------------------- #
# aclnnPromptFlashAttentionV3                                                                    #
# --------------------------------------------------------------------------------------------- #


def sdpa_bnsd(q, k, v, scale):
    gqa = q.shape[1] != k.shape[1]
    return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), scale=scale, enable_gqa=gqa)


@pytest.mark.parametrize("layout", ["BSND", "BNSD", "BSH"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_prompt_flash_vs_sdpa_gqa_scale(ops, layout, dtype):
    gen = torch.Generator().manual_seed(21)
    b, n, nk, s, sk, d = 2, 4, 2, 19, 23, 16
    q4 = torch.randn(b, n, s, d, generator=gen).to(dtype)  # BNSD
    k4 = torch.randn(b, nk, sk, d, generator=gen).to(dtype)
    v4 = torch.randn(b, nk, sk, d, generator=gen).to(dtype)
    to = {"BNSD": lambda t: t, "BSND": lambda t: t.transpose(1, 2), "BSH": lambda t: t.transpose(1, 2).flatten(2)}[layout]
    full = 2147483647
    out = ops.prompt_flash_attention(to(q4), to(k4), to(v4), num_heads=n, num_key_value_heads=nk, scale_value=0.21,
                                     input_layout=layout, pre_tokens=full, next_tokens=full)
    ref = to(sdpa_bnsd(q4, k4, v4, 0.21))
    assert out.dtype == dtype and out.shape == to(q4).shape
    torch.testing.assert_close(out.float(), ref, **tol(dtype))
    assert f"glue.workspace 512" in ops.events()  # two batches: the double asks for a workspace


def test_prompt_flash_actual_seq_lengths_and_single_batch(ops):
    gen = torch.Generator().manual_seed(22)
    n, s, d = 2, 20, 8
    q = torch.randn(3, s, n, d, generator=gen).half()
    k = torch.randn(3, s, n, d, generator=gen).half()
    v = torch.randn(3, s, n, d, generator=gen).half()
    full = 2147483647
    lq, lk = [20, 7, 0], [13, 20, 5]
    out = ops.prompt_flash_attention(q, k, v, num_heads=n, scale_value=0.3, input_layout="BSND", pre_tokens=full,
                                     next_tokens=full, actual_seq_lengths=lq, actual_seq_lengths_kv=lk)
    assert torch.isfinite(out).all()  # rows past the lengths: 0 (the double leaves NaN there)
    for i in range(3):
        ref = sdpa_bnsd(q[i:i + 1, :lq[i]].transpose(1, 2), k[i:i + 1, :lk[i]].transpose(1, 2),
                        v[i:i + 1, :lk[i]].transpose(1, 2), 0.3).transpose(1, 2)
        torch.testing.assert_close(out[i:i + 1, :lq[i]].float(), ref, **tol(torch.float16))
        assert (out[i, lq[i]:] == 0).all()
    # one batch: the double asks for no workspace and none is allocated
    ops.clear_events()
    one = ops.prompt_flash_attention(q[:1], k[:1], v[:1], num_heads=n, scale_value=0.3, input_layout="BSND",
                                     pre_tokens=full, next_tokens=full)
    torch.testing.assert_close(one.float(), sdpa_bnsd(*(t[:1].transpose(1, 2) for t in (q, k, v)), 0.3).transpose(1, 2),
                               **tol(torch.float16))
    ev = list(ops.events())
    assert f"{PFA_GWS} -> 0" in ev and not any(e.startswith("glue.workspace") for e in ev)


@pytest.mark.parametrize("change,status,match", [
    (dict(input_layout="bsnd"), 161002, "inputLayout bsnd is not modelled"),
    (dict(num_key_value_heads=1), 161002, "numKeyValueHeads must equal the key/value N for BSND"),
    (dict(actual_seq_lengths=[9, 2]), 161002, r"actualSeqLengths entries must be in \[0, 5\]"),
    (dict(num_heads=0), 161002, "numHeads must be > 0"),
])
def test_the_double_itself_enforces_the_prompt_flash_contract(ops, change, status, match):
    q = torch.zeros(2, 5, 4, 8, dtype=torch.float16)
    k = torch.zeros(2, 6, 2, 8, dtype=torch.float16)
    kw = dict(num_heads=4, num_key_value_heads=2, input_layout="BSND", pre_tokens=2147483647,
              next_tokens=2147483647)
    kw.update(change)
    with pytest.raises(RuntimeError, match=rf"{PFA_GWS} returned {status} \(ACLNN_ERR_PARAM_INVALID\): {match}"):
        ops.prompt_flash_attention_unchecked(q, k, k, **kw)
    assert not any(e.startswith("glue.") for e in ops.events())


@pytest.mark.parametrize("change,exc,match", [
    (dict(dtype=torch.float32), TypeError, "float16/bfloat16 inputs here"),
    (dict(next_tokens=0), ValueError, "pre_tokens=2147483647 / next_tokens=0 limit attention to a band"),
    (dict(input_layout="TND"), ValueError, r"input_layout must be one of \['BSH', 'BSND', 'BNSD'\]"),
    (dict(num_heads=3), ValueError, "num_heads=3 does not match the query's 4 heads"),
    (dict(num_key_value_heads=3), ValueError, "num_key_value_heads=3 does not match key heads"),
    (dict(heads=(130, 1)), ValueError, "must be <= 64"),
    (dict(heads=(257, 257)), ValueError, "num_heads=257 must be <= 256"),
    (dict(d=520), ValueError, "head dim 520 must be <= 512"),
    (dict(actual_seq_lengths=[3]), ValueError, r"actual_seq_lengths must have one entry per batch \(2\)"),
    (dict(actual_seq_lengths_kv=[3, 9]), ValueError, r"actual_seq_lengths_kv entries must be in \[0, 6\]"),
])
def test_prompt_flash_bad_arguments_raise_before_any_acl_call(ops, change, exc, match):
    n, nk = change.get("heads", (4, 2))
    d = change.get("d", 8)
    dtype = change.get("dtype", torch.float16)
    q = torch.zeros(2, 5, n, d, dtype=dtype)
    k = torch.zeros(2, 6, nk, d, dtype=dtype)
    kw = dict(num_heads=n, num_key_value_heads=nk, input_layout="BSND", pre_tokens=2147483647,
              next_tokens=2147483647, scale_value=0.5)
    kw.update({key: val for key, val in change.items() if key in kw or key.startswith("actual")})
    with pytest.raises(exc, match=match):
        ops.prompt_flash_attention(q, k, k, **kw)
    assert list(ops.events()) == []


def test_prompt_flash_non_contiguous_input_is_made_contiguous(ops):
    """The document marks non-contiguous tensors unsupported (the double refuses them): the translation copies."""
    q = torch.randn(1, 4, 6, 8).half().transpose(1, 2)  # BSND view of BNSD
    full = 2147483647
    out = ops.prompt_flash_attention(q, q, q, num_heads=4, input_layout="BSND", pre_tokens=full, next_tokens=full)
    torch.testing.assert_close(out.float(), sdpa_bnsd(*(q.transpose(1, 2),) * 3, 1.0).transpose(1, 2), **tol(torch.float16))


# --------------------------------------------------------------------------------------------- #
# The Python npu backends drive the C++ translation                                              #
# --------------------------------------------------------------------------------------------- #


@pytest.fixture
def npu_ops_are_the_double(ops, monkeypatch):
    """Route lite_boost's Python npu backends to the double's registration of the translated kernels."""
    monkeypatch.setattr(_sparse_npu, "probe", lambda device_type: None)
    monkeypatch.setattr(_sparse_npu, "_op", lambda: ops.rain_fusion_attention)
    monkeypatch.setattr(A, "_pfa_op", lambda: ops.prompt_flash_attention)
    spec = A.BACKENDS["npu"]
    monkeypatch.setitem(A.BACKENDS, "npu", spec.__class__(**{**spec.__dict__, "devices": ("cpu",),
                                                             "probe": lambda: None}))
    A.clear_caches()
    yield ops
    A.clear_caches()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_python_sparse_npu_backend_runs_the_translation(npu_ops_are_the_double, dtype):
    ops = npu_ops_are_the_double
    gen = torch.Generator().manual_seed(31)
    lens_q, lens_kv = [40, 17], [25, 48]
    q, k, v = make_tnd(gen, lens_q, lens_kv, 4, 2, 16, dtype)
    idx, num = batched_selection(gen, lens_q, lens_kv, 4, 16, 8, 0.5)
    kw = dict(actual_seq_lengths=lens_q, actual_seq_lengths_kv=lens_kv)
    out, lse = rain_fusion_attention(q, k, v, idx, num, [16, 8], backend="npu", **kw)
    assert lse is None
    torch.testing.assert_close(out.double(), rf_ref(q, k, v, idx, num, [16, 8], **kw), **tol(dtype))
    assert "aclnnRainFusionAttention done" in ops.events()


def test_python_dense_npu_backend_runs_the_translation(npu_ops_are_the_double):
    ops = npu_ops_are_the_double
    gen = torch.Generator().manual_seed(32)
    q = torch.randn(2, 33, 4, 16, generator=gen).half()
    k = torch.randn(2, 33, 2, 16, generator=gen).half()
    v = torch.randn(2, 33, 2, 16, generator=gen).half()
    out = A.attention(q, k, v, backend="npu", scale=0.2)
    ref = sdpa_bnsd(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.2).transpose(1, 2)
    torch.testing.assert_close(out.float(), ref, **tol(torch.float16))
    assert "aclnnPromptFlashAttentionV3 done" in ops.events()


# --------------------------------------------------------------------------------------------- #
# The double registers the schemas of csrc/ops.cpp                                               #
# --------------------------------------------------------------------------------------------- #


def _schemas_in_ops_cpp():
    src = (ROOT / "csrc" / "ops.cpp").read_text()
    out = {}
    for block in re.findall(r"m\.def\(\s*((?:\"(?:[^\"\\]|\\.)*\"\s*)+)\)", src):
        text = "".join(re.findall(r"\"((?:[^\"\\]|\\.)*)\"", block)).replace('\\"', '"')
        out[text.split("(", 1)[0]] = torch._C.parse_schema("lite_boost::" + text)
    return out


@pytest.mark.parametrize("name", ["rain_fusion_attention", "prompt_flash_attention"])
def test_double_schema_is_the_library_schema(dbl, name):
    lib = _schemas_in_ops_cpp()[name]
    for variant in (name, name + "_unchecked"):
        mine = getattr(dbl, variant).default._schema
        assert [(a.name, str(a.type), a.default_value, a.kwarg_only) for a in mine.arguments] == \
               [(a.name, str(a.type), a.default_value, a.kwarg_only) for a in lib.arguments]
        assert [str(r.type) for r in mine.returns] == [str(r.type) for r in lib.returns]


# --------------------------------------------------------------------------------------------- #
# The NPU build: glue compiles against torch_npu's API; build description; absence reported     #
# --------------------------------------------------------------------------------------------- #


def test_npu_glue_compiles_against_the_torch_npu_api():
    """csrc/npu/npu_kernels.cpp (never built here) must compile against torch_npu's declarations.

    tests/aclnn_double/torch_npu_api holds declaration-only copies of the two torch_npu headers it
    uses; they also declare an acl function the CANN way, so including aclnn_api.h there would clash.
    """
    import shutil
    import subprocess

    from torch.utils.cpp_extension import include_paths

    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    import hashlib

    stub = ROOT / "tests" / "aclnn_double" / "torch_npu_api"
    incs = [ROOT / "csrc" / "npu", ROOT / "csrc", stub, *include_paths()]
    cmd = [cxx, "-std=c++17", "-fsyntax-only", *[f"-I{p}" for p in incs], str(ROOT / "csrc" / "npu" / "npu_kernels.cpp")]
    # A pass is remembered per exact input (sources, stubs, torch, command): the check reruns whenever one changes.
    digest = hashlib.sha256(" ".join(cmd + [torch.__version__]).encode())
    for path in sorted([*(ROOT / "csrc" / "npu").glob("*"), *stub.rglob("*.h")]):
        digest.update(path.read_bytes() if path.is_file() else b"")
    from _aclnn_double import _cache_dir

    marker = _cache_dir().parent / f"npu_glue_syntax_ok-{digest.hexdigest()[:20]}"
    if marker.exists():
        return
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.touch()


def test_npu_build_description_and_its_absence(monkeypatch, tmp_path):
    import sys
    import types

    from lite_boost.ops import _ext_npu

    csrc = ROOT / "csrc"
    monkeypatch.delenv("ASCEND_HOME_PATH", raising=False)
    monkeypatch.delenv("ASCEND_TOOLKIT_HOME", raising=False)
    assert "CANN not found (ASCEND_HOME_PATH / ASCEND_TOOLKIT_HOME unset" in _ext_npu.npu_build_config(csrc)
    monkeypatch.setenv("ASCEND_TOOLKIT_HOME", str(tmp_path))
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # import fails like a missing package
    assert _ext_npu.npu_build_config(csrc).startswith("torch_npu is not importable (ModuleNotFoundError")
    # a torch_npu laid out as installed, with its extension helper
    root = tmp_path / "torch_npu"
    (root / "include" / "third_party" / "acl" / "inc").mkdir(parents=True)
    fake = types.ModuleType("torch_npu")
    fake.__file__ = str(root / "__init__.py")
    helper = types.ModuleType("torch_npu.utils.cpp_extension")
    helper.NpuExtension = lambda name, sources: types.SimpleNamespace(
        include_dirs=[str(root / "include")], library_dirs=[str(root / "lib")],
        libraries=["c10", "torch", "torch_cpu", "torch_python", "torch_npu"])
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    monkeypatch.setitem(sys.modules, "torch_npu.utils", types.ModuleType("torch_npu.utils"))
    monkeypatch.setitem(sys.modules, "torch_npu.utils.cpp_extension", helper)
    cfg = _ext_npu.npu_build_config(csrc)
    assert [Path(s).name for s in cfg["sources"]] == ["npu_kernels.cpp", "aclnn_translate.cpp", "opapi_loader.cpp",
                                                      "common.cpp"]
    assert all(Path(s).is_file() for s in cfg["sources"])
    assert cfg["extra_include_paths"] == [str(csrc), str(root / "include"),
                                          str(root / "include" / "third_party" / "acl" / "inc")]
    assert f"-L{root / 'lib'}" in cfg["extra_ldflags"] and "-ltorch_npu" in cfg["extra_ldflags"]
    assert "-ltorch" not in cfg["extra_ldflags"]  # cpp_extension links torch itself
    assert "-D__FILENAME__=__FILE__" in cfg["extra_cflags"]  # torch_npu's logging macros need it


def test_npu_backends_report_why_they_are_off_on_this_machine():
    from lite_boost.ops import _ext_npu

    assert not _ext_npu.has_npu_kernel("rain_fusion_attention")
    assert not _ext_npu.has_npu_kernel("prompt_flash_attention")
    assert A._pfa_op() is None and _sparse_npu._op() is None
    assert "needs npu, got cpu" in _sparse_npu.probe("cpu")
    why = _ext_npu.npu_kernel_reason("rain_fusion_attention")
    assert why.startswith(("its Ascend kernel is not built (not built: CANN not found",
                           "the lite_boost operator library is not built"))
    assert _sparse_npu._not_built_reason().endswith(why)


def test_launch_may_run_later_on_another_thread(ops):
    """torch_npu's task queue runs phase two after the op returned: the closure must own everything it uses."""
    import gc

    gen = torch.Generator().manual_seed(41)
    lens = [24, 9]
    q, k, v = make_tnd(gen, lens, lens, 2, 1, 8, torch.float16)
    idx, num = batched_selection(gen, lens, lens, 2, 8, 8, 1.0)  # every row selects blocks: no post-launch fill
    expected = rf_ref(q, k, v, idx, num, [8, 8], actual_seq_lengths=lens)
    ops.set_deferred(True)
    try:
        out, _ = ops.rain_fusion_attention(q.clone(), k.clone(), v.clone(), idx.clone(), num.clone(), [8, 8],
                                           actual_seq_lengths=lens)
        gc.collect()  # the caller's copies of the inputs are gone; only the launch closure holds them
        assert "aclnnRainFusionAttention done" not in ops.events()
        assert ops.live_handles() == 9  # arguments alive until the launch
        assert ops.run_deferred() == 1
    finally:
        ops.set_deferred(False)
        ops.run_deferred()
    torch.testing.assert_close(out.double(), expected, **tol(torch.float16))
