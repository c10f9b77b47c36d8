"""The compiled operator library (csrc/): torch.ops.lite_boost.rain_fusion_attention and prompt_flash_attention.

The CPU kernels are checked against independent references: the dense masked fp64 oracle of the
Python API (``backend="reference"``) for the block-sparse op, and the executable specification of
``npu_prompt_flash_attention`` (tests/attention_specs.py) plus an fp64 masked softmax for the dense op.
When the library cannot be built the kernel tests skip, except under ``LITE_BOOST_REQUIRE_EXT=1``
(CI), where a missing library fails the first test instead.
"""

from __future__ import annotations

import functools
import math
import os
import subprocess
import sys
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lite_boost.ops import _ext
from lite_boost.ops import rain_fusion as rf
from lite_boost.ops.rain_fusion import SparseBackendError, rain_fusion_attention

from attention_specs import make_torch_npu, reference_attention


@pytest.fixture(scope="module")
def lib():
    st_ = _ext.load()  # raises under LITE_BOOST_REQUIRE_EXT=1 when the library cannot be built
    if not st_.loaded:
        pytest.skip(f"lite_boost operator library unavailable: {st_.reason}")
    return torch.ops.lite_boost


# --------------------------------------------------------------------------------------------- #
# helpers                                                                                        #
# --------------------------------------------------------------------------------------------- #


def _selection(gen, q_lens, kv_lens, bq, bk, heads, mode):
    """select_idx / select_num over all batches. mode: random, zero, one, all, mixed (per-row choice)."""
    nkb = [math.ceil(x / bk) for x in kv_lens]
    width = max(nkb + [1])
    idx_parts, num_parts = [], []
    for lq, n in zip(q_lens, nkb):
        rows = math.ceil(lq / bq)
        if mode == "mixed":
            kind = torch.randint(0, 4, (rows, heads), generator=gen)
        else:
            kind = torch.full((rows, heads), {"zero": 0, "one": 1, "all": 2, "random": 3}[mode])
        density = torch.rand(rows, heads, 1, generator=gen)
        pick = torch.rand(rows, heads, max(n, 1), generator=gen)[..., :n] < density
        one = torch.zeros(rows, heads, n, dtype=torch.bool)
        if n:
            one.scatter_(2, torch.randint(0, n, (rows, heads, 1), generator=gen), True)
        keep = torch.where((kind == 0)[..., None], torch.zeros_like(pick), pick)
        keep = torch.where((kind == 1)[..., None], one, keep)
        keep = torch.where((kind == 2)[..., None], torch.ones_like(pick), keep)
        idx, num = _keep_to_selection(keep, width)
        idx_parts.append(idx)
        num_parts.append(num)
    return torch.cat(idx_parts), torch.cat(num_parts)


def _keep_to_selection(keep, width):
    """A (rows, heads, n) bool block mask -> (select_idx padded with -1 to ``width``, select_num), ascending."""
    n = keep.shape[-1]
    ar = torch.arange(n)
    order = torch.where(keep, ar, n + ar).sort(-1).values
    idx = torch.where(order >= n, torch.full_like(order, -1), order)
    return torch.nn.functional.pad(idx, (0, width - n), value=-1), keep.sum(-1)


def _problem(gen, layout, q_lens, kv_lens, n2, g, d, dv, dtype):
    n1 = n2 * g
    if layout == "TND":
        q = torch.randn(sum(q_lens), n1, d, generator=gen)
        k = torch.randn(sum(kv_lens), n2, d, generator=gen)
        v = torch.randn(sum(kv_lens), n2, dv, generator=gen)
    else:
        q = torch.randn(len(q_lens), n1, q_lens[0], d, generator=gen)
        k = torch.randn(len(kv_lens), n2, kv_lens[0], d, generator=gen)
        v = torch.randn(len(kv_lens), n2, kv_lens[0], dv, generator=gen)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _op_call(lib, q, k, v, idx, num, bs, layout, q_lens, kv_lens, scale=None, return_lse=True):
    lens = dict(actual_seq_lengths=q_lens, actual_seq_lengths_kv=kv_lens) if layout == "TND" else {}
    return lib.rain_fusion_attention(q, k, v, idx, num, list(bs), q_input_layout=layout, kv_input_layout=layout,
                                     num_key_value_heads=k.shape[1], scale_value=scale, return_lse=return_lse, **lens)


def _reference(q, k, v, idx, num, bs, layout, q_lens, kv_lens, scale=None):
    lens = dict(actual_seq_lengths=q_lens, actual_seq_lengths_kv=kv_lens) if layout == "TND" else {}
    return rain_fusion_attention(q, k, v, idx, num, bs, q_input_layout=layout, kv_input_layout=layout,
                                 scale_value=scale, return_lse=True, backend="reference", **lens)


@st.composite
def sparse_cases(draw):
    layout = draw(st.sampled_from(["TND", "BNSD"]))
    bq = draw(st.sampled_from([8, 16, 32]))
    bk = draw(st.sampled_from([8, 16, 32]))
    batch = draw(st.integers(1, 3))
    if layout == "TND":
        q_lens = draw(st.lists(st.integers(1, 80), min_size=batch, max_size=batch))
        kv_lens = draw(st.lists(st.integers(1, 80), min_size=batch, max_size=batch))
    else:
        q_lens = [draw(st.integers(1, 80))] * batch
        kv_lens = [draw(st.integers(1, 80))] * batch
    return dict(layout=layout, bs=(bq, bk), q_lens=q_lens, kv_lens=kv_lens, n2=draw(st.sampled_from([1, 2])),
                g=draw(st.sampled_from([1, 2, 3])), d=draw(st.sampled_from([24, 64, 128])),
                dv_same=draw(st.booleans()), mode=draw(st.sampled_from(["random", "zero", "one", "all", "mixed"])),
                scale=draw(st.sampled_from([None, 0.07])), seed=draw(st.integers(0, 2**31 - 1)))


# --------------------------------------------------------------------------------------------- #
# rain_fusion_attention CPU kernel vs the reference                                              #
# --------------------------------------------------------------------------------------------- #


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=sparse_cases())
def test_cpu_kernel_matches_reference_fp32(lib, case):
    gen = torch.Generator().manual_seed(case["seed"])
    dv = case["d"] if case["dv_same"] else 40
    q, k, v = _problem(gen, case["layout"], case["q_lens"], case["kv_lens"], case["n2"], case["g"], case["d"], dv,
                       torch.float32)
    idx, num = _selection(gen, case["q_lens"], case["kv_lens"], *case["bs"], q.shape[1], case["mode"])
    out, lse = _op_call(lib, q, k, v, idx, num, case["bs"], case["layout"], case["q_lens"], case["kv_lens"],
                        case["scale"])
    ref, ref_lse = _reference(q, k, v, idx, num, case["bs"], case["layout"], case["q_lens"], case["kv_lens"],
                              case["scale"])
    assert out.shape == ref.shape and out.dtype == torch.float32
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)  # -inf where nothing is selected


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float16, 3e-3)])
@pytest.mark.parametrize("layout", ["TND", "BNSD"])
def test_cpu_kernel_half_dtypes(lib, dtype, tol, layout):
    gen = torch.Generator().manual_seed(3)
    q_lens, kv_lens = ([70, 33], [45, 90]) if layout == "TND" else ([70, 70], [90, 90])
    q, k, v = _problem(gen, layout, q_lens, kv_lens, 2, 2, 64, 64, dtype)
    idx, num = _selection(gen, q_lens, kv_lens, 16, 16, 4, "mixed")
    out, lse = _op_call(lib, q, k, v, idx, num, (16, 16), layout, q_lens, kv_lens)
    ref, ref_lse = _reference(q, k, v, idx, num, (16, 16), layout, q_lens, kv_lens)  # fp64 of the same inputs
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-4)


def test_cpu_kernel_larger_blocks_and_long_runs(lib):
    """128-token blocks, head dim 128, runs of consecutive blocks longer than one tile, strided input."""
    gen = torch.Generator().manual_seed(4)
    q_lens = kv_lens = [1000]
    base = torch.randn(1, 1000, 3, 128, generator=gen)  # BSND storage viewed as BNSD (strided)
    q = base.transpose(1, 2)
    k = torch.randn(1, 1, 1000, 128, generator=gen)
    v = torch.randn(1, 1, 1000, 128, generator=gen)
    idx, num = _selection(gen, q_lens, kv_lens, 128, 128, 3, "mixed")
    idx[0, 0], num[0, 0] = torch.arange(8), 8  # one run of 8 blocks (> 512 tokens): split into tiles
    out, lse = _op_call(lib, q, k, v, idx, num, (128, 128), "BNSD", q_lens, kv_lens)
    ref, ref_lse = _reference(q, k, v, idx, num, (128, 128), "BNSD", q_lens, kv_lens)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)


def _kernel_env(monkeypatch, **values):
    """Set each LITE_BOOST_RF_<NAME> tunable of the CPU kernel to its value, or unset it for None (the default)."""
    for name, value in values.items():
        if value is None:
            monkeypatch.delenv(f"LITE_BOOST_RF_{name}", raising=False)
        else:
            monkeypatch.setenv(f"LITE_BOOST_RF_{name}", value)


@pytest.mark.parametrize("prefetch", [None, "0", "64", "100000"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_cpu_kernel_k_copy_prefetch_settings(lib, monkeypatch, prefetch, dtype, tol):
    """Scattered blocks (several runs per tile, so K is copied) give the reference result whatever the copy's
    prefetch distance (LITE_BOOST_RF_PREFETCH: default, off, less than one row, more than the block)."""
    _kernel_env(monkeypatch, PREFETCH=prefetch)
    gen = torch.Generator().manual_seed(5)
    q_lens, kv_lens = [96, 40], [300, 200]
    q, k, v = _problem(gen, "TND", q_lens, kv_lens, 2, 2, 64, 64, dtype)  # TND: K rows strided by heads
    idx, num = _selection(gen, q_lens, kv_lens, 32, 32, 4, "random")
    idx[0, 0, :4], idx[0, 0, 4:], num[0, 0] = torch.tensor([0, 2, 5, 9]), -1, 4  # four runs, tail block last
    out, lse = _op_call(lib, q, k, v, idx, num, (32, 32), "TND", q_lens, kv_lens)
    ref, ref_lse = _reference(q, k, v, idx, num, (32, 32), "TND", q_lens, kv_lens)
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-4)


def _paired_selection(gen, q_lens, kv_lens, bq, bk, heads):
    """Selections where neighbouring query blocks (2p, 2p + 1) mostly share their blocks, as real video masks do.

    Per (pair, head) one of: identical lists; a shared part of at least 3/4 plus one own block each; one list
    a superset of the other; one block selecting nothing; little overlap (below the kernel's pairing bar).
    """
    nkb = [math.ceil(x / bk) for x in kv_lens]
    width = max(nkb)
    idx_parts, num_parts = [], []
    for lq, n in zip(q_lens, nkb):
        rows = math.ceil(lq / bq)
        keep = torch.zeros(rows, heads, n, dtype=torch.bool)
        for p in range(0, rows, 2):
            for h in range(heads):
                kind = int(torch.randint(0, 5, (1,), generator=gen))
                perm = torch.randperm(n, generator=gen)
                shared = perm[: max(1, min(n - 2, 3 + int(torch.randint(0, n, (1,), generator=gen)) // 2))]
                keep[p, h, shared] = True
                if p + 1 < rows:
                    keep[p + 1, h, shared] = True
                    if kind == 1 and n >= len(shared) + 2:  # one own block each
                        keep[p, h, perm[len(shared)]] = True
                        keep[p + 1, h, perm[len(shared) + 1]] = True
                    elif kind == 2 and n > len(shared):  # superset
                        keep[p + 1, h, perm[len(shared)]] = True
                    elif kind == 3:  # second block selects nothing
                        keep[p + 1, h] = False
                    elif kind == 4:  # little overlap: below the pairing bar
                        keep[p + 1, h] = False
                        keep[p + 1, h, perm[-1]] = True
                        keep[p + 1, h, perm[0]] = True
        idx, num = _keep_to_selection(keep, width)
        idx_parts.append(idx)
        num_parts.append(num)
    return torch.cat(idx_parts), torch.cat(num_parts)


@pytest.mark.parametrize("pair", [None, "0"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 3e-3)])
@pytest.mark.parametrize("layout", ["TND", "BNSD"])
def test_cpu_kernel_paired_query_blocks(lib, monkeypatch, pair, dtype, tol, layout):
    """Neighbouring query blocks that share most of their blocks run the shared ones as one taller tile (default)
    or each on its own (LITE_BOOST_RF_PAIR=0); both match the reference. Odd block counts leave the last block
    unpaired, partial tail blocks sit inside a pair, GQA heads share K/V."""
    _kernel_env(monkeypatch, PAIR=pair)
    gen = torch.Generator().manual_seed(8)
    q_lens, kv_lens = ([150, 77], [200, 130]) if layout == "TND" else ([150, 150], [200, 200])
    q, k, v = _problem(gen, layout, q_lens, kv_lens, 2, 2, 64, 64, dtype)
    idx, num = _paired_selection(gen, q_lens, kv_lens, 16, 16, 4)
    out, lse = _op_call(lib, q, k, v, idx, num, (16, 16), layout, q_lens, kv_lens)
    ref, ref_lse = _reference(q, k, v, idx, num, (16, 16), layout, q_lens, kv_lens)
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(lse, ref_lse, atol=1e-4 if dtype != torch.float32 else 1e-5, rtol=1e-4)


def test_without_lse_returns_empty_and_same_output(lib):
    gen = torch.Generator().manual_seed(5)
    q, k, v = _problem(gen, "BNSD", [40], [40], 1, 2, 24, 24, torch.float32)
    idx, num = _selection(gen, [40], [40], 8, 8, 2, "random")
    out, lse = _op_call(lib, q, k, v, idx, num, (8, 8), "BNSD", [40], [40], return_lse=False)
    out2, _ = _op_call(lib, q, k, v, idx, num, (8, 8), "BNSD", [40], [40])
    assert lse.shape == (0,) and lse.dtype == torch.float32
    torch.testing.assert_close(out, out2, atol=0, rtol=0)


def test_int32_select_arrays_and_case_insensitive_layout(lib):
    gen = torch.Generator().manual_seed(6)
    q, k, v = _problem(gen, "TND", [30], [30], 1, 1, 24, 24, torch.float32)
    idx, num = _selection(gen, [30], [30], 8, 8, 1, "random")
    out, _ = lib.rain_fusion_attention(q, k, v, idx.int(), num.int(), [8, 8], q_input_layout="tnd",
                                       kv_input_layout="tnd")
    ref, _ = _reference(q, k, v, idx, num, (8, 8), "TND", [30], [30])
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_python_api_uses_the_cpp_backend_automatically_on_cpu(lib):
    gen = torch.Generator().manual_seed(7)
    q, k, v = _problem(gen, "TND", [50, 20], [50, 20], 2, 1, 64, 64, torch.float32)
    idx, num = _selection(gen, [50, 20], [50, 20], 16, 16, 2, "random")
    assert rf.select_sparse_backend(q, k) == "cpp"
    assert rf.select_sparse_backend(q, k, return_lse=True) == "cpp"  # the C++ kernel returns the lse
    out, lse = rain_fusion_attention(q, k, v, idx, num, [16, 16], actual_seq_lengths=[50, 20], return_lse=True)
    ref, ref_lse = _reference(q, k, v, idx, num, (16, 16), "TND", [50, 20], [50, 20])
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)
    # inference-only: with grad the automatic choice moves on, a forced cpp is refused with the reason
    qg = q.clone().requires_grad_(True)
    assert rf.select_sparse_backend(qg, k) == "gather"
    with pytest.raises(SparseBackendError, match="inference-only"):
        rf.select_sparse_backend(qg, k, backend="cpp")


# --------------------------------------------------------------------------------------------- #
# bad input: the kernel checks every argument with the Python API's messages                     #
# --------------------------------------------------------------------------------------------- #


def _good_args():
    gen = torch.Generator().manual_seed(8)
    q, k, v = _problem(gen, "TND", [20, 12], [20, 12], 1, 2, 8, 8, torch.float32)
    idx, num = _selection(gen, [20, 12], [20, 12], 8, 8, 2, "all")
    return dict(query=q, key=k, value=v, select_idx=idx, select_num_idx=num, block_shape=[8, 8],
                actual_seq_lengths=[20, 12], actual_seq_lengths_kv=[20, 12], q_input_layout="TND",
                kv_input_layout="TND")


def _bad(name):
    a = _good_args()
    idx, num = a["select_idx"].clone(), a["select_num_idx"].clone()
    if name == "select_idx dtype":
        a["select_idx"] = idx.float()
    elif name == "select_num dtype":
        a["select_num_idx"] = num.to(torch.int16)
    elif name == "out of range":
        idx[1, 0, 2] = 7
        a["select_idx"] = idx
    elif name == "out of range, second batch":
        idx[4, 1, 1] = 2  # batch 1 has 2 kv blocks
        a["select_idx"] = idx
    elif name == "unsorted":
        idx[0, 1, :2] = torch.tensor([1, 0])
        a["select_idx"] = idx
    elif name == "bad padding":
        num[2, 0] = 1
        a["select_num_idx"] = num
    elif name == "count above width":
        num[0, 0] = 9
        a["select_num_idx"] = num
    elif name == "negative count":
        num[3, 1] = -1
        a["select_num_idx"] = num
    elif name == "select shape":
        a["select_idx"] = idx[:-1]
    elif name == "select_num shape":
        a["select_num_idx"] = num[:, :1]
    elif name == "mismatched heads":
        a["key"] = torch.randn(32, 3, 8)
        a["value"] = torch.randn(32, 3, 8)
    elif name == "num_key_value_heads":
        a["num_key_value_heads"] = 2
    elif name == "unknown layout":
        a["q_input_layout"] = "BSND"
    elif name == "wrong rank":
        a["query"] = a["query"][None]
    elif name == "qkv dtype":
        a["query"] = a["query"].double()
    elif name == "mixed dtype":
        a["key"] = a["key"].half()
    elif name == "head dim":
        a["key"] = torch.randn(32, 1, 16)
        a["value"] = torch.randn(32, 1, 16)
    elif name == "kv shape":
        a["value"] = torch.randn(31, 1, 8)
    elif name == "lengths sum":
        a["actual_seq_lengths"] = [20, 11]
    elif name == "negative length":
        a["actual_seq_lengths_kv"] = [-1, 33]
    elif name == "batches":
        a["actual_seq_lengths_kv"] = [32]
    elif name == "block_shape":
        a["block_shape"] = [8, 0]
    elif name == "atten_mask":
        a["attn_mask"] = torch.ones(2, 2, dtype=torch.bool)
    elif name == "block_table":
        a["block_table"] = torch.zeros(1, 1, dtype=torch.int32)
    elif name == "mask_type":
        a["mask_type"] = 1
    elif name == "inner_precise":
        a["inner_precise"] = 2
    elif name == "scale":
        a["scale_value"] = -1.0
    else:
        raise AssertionError(name)
    return a


BAD = ["select_idx dtype", "select_num dtype", "out of range", "out of range, second batch", "unsorted",
       "bad padding", "count above width", "negative count", "select shape", "select_num shape",
       "mismatched heads", "num_key_value_heads", "unknown layout", "wrong rank", "qkv dtype", "mixed dtype",
       "head dim", "kv shape", "lengths sum", "negative length", "batches", "block_shape", "atten_mask",
       "block_table", "mask_type", "inner_precise", "scale"]


@pytest.mark.parametrize("name", BAD)
def test_bad_input_same_error_as_python_api(lib, name):
    a = _bad(name)
    with pytest.raises((TypeError, ValueError)) as py_err:
        rain_fusion_attention(**a, backend="gather")
    op_args = dict(a)
    if "attn_mask" in op_args:
        op_args["atten_mask"] = op_args.pop("attn_mask")
    with pytest.raises(type(py_err.value)) as cpp_err:
        lib.rain_fusion_attention(**op_args)
    py_msg, cpp_msg = str(py_err.value), str(cpp_err.value).splitlines()[0]
    if name == "scale":  # Python prints the float repr (-1.0), C++ the shortest form (-1)
        py_msg = py_msg.replace("-1.0", "-1")
    assert cpp_msg == py_msg


def test_bad_input_is_rejected_before_any_work(lib):
    """A wrong entry in the last row fails before the output is written (nothing partial escapes)."""
    a = _bad("unsorted")
    with pytest.raises(ValueError, match="strictly ascending"):
        lib.rain_fusion_attention(**a)


# --------------------------------------------------------------------------------------------- #
# prompt_flash_attention CPU kernel                                                              #
# --------------------------------------------------------------------------------------------- #

FULL = 2147483647


@pytest.mark.parametrize("layout", ["BSND", "BNSD", "BSH"])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2)])
@pytest.mark.parametrize("band", [(FULL, FULL), (5, 3)])
def test_prompt_flash_attention_matches_the_npu_spec(lib, layout, heads, band):
    n, nk = heads
    gen = torch.Generator().manual_seed(9)
    q = torch.randn(2, 37, n, 32, generator=gen).half()
    k = torch.randn(2, 29, nk, 32, generator=gen).half()
    v = torch.randn(2, 29, nk, 32, generator=gen).half()

    def to(t):
        return {"BSND": t, "BNSD": t.transpose(1, 2).contiguous(), "BSH": t.flatten(2)}[layout]

    kw = dict(num_heads=n, num_key_value_heads=nk, input_layout=layout, scale_value=0.2, pre_tokens=band[0],
              next_tokens=band[1])
    out = lib.prompt_flash_attention(to(q), to(k), to(v), **kw)
    spec = make_torch_npu().npu_prompt_flash_attention(to(q), to(k), to(v), **kw)
    assert out.shape == spec.shape and out.dtype == torch.float16
    defined = ~spec.isnan()  # the spec leaves rows with no admissible key undefined (NaN); we return 0
    assert (band != (FULL, FULL)) == (not bool(defined.all()))
    torch.testing.assert_close(out.float()[defined], spec.float()[defined], atol=2e-3, rtol=2e-3)
    assert not out[~defined].any()


def test_prompt_flash_attention_actual_lengths_and_defaults(lib):
    gen = torch.Generator().manual_seed(10)
    q = torch.randn(2, 3, 20, 16, generator=gen)
    k = torch.randn(2, 1, 24, 16, generator=gen)
    v = torch.randn(2, 1, 24, 16, generator=gen)
    out = lib.prompt_flash_attention(q, k, v, num_heads=3, num_key_value_heads=1, input_layout="BNSD",
                                     scale_value=0.25, pre_tokens=FULL, next_tokens=FULL,
                                     actual_seq_lengths=[20, 11], actual_seq_lengths_kv=[24, 7])
    for b, (lq, lk) in enumerate([(20, 24), (11, 7)]):
        ref = reference_attention(q[b:b + 1, :, :lq].transpose(1, 2), k[b:b + 1, :, :lk].transpose(1, 2),
                                  v[b:b + 1, :, :lk].transpose(1, 2), 0.25).transpose(1, 2)
        torch.testing.assert_close(out[b:b + 1, :, :lq], ref.float(), atol=1e-5, rtol=1e-5)
        assert not out[b, :, lq:].any()  # rows past the actual length are zero
    # torch_npu's defaults: scale_value 1.0, pre_tokens 2147473647, next_tokens 0 (a causal band), BSH
    qh = torch.randn(1, 9, 2 * 8, generator=gen)
    out = lib.prompt_flash_attention(qh, qh, qh, num_heads=2)
    spec = make_torch_npu().npu_prompt_flash_attention(qh.half(), qh.half(), qh.half(), num_heads=2)
    torch.testing.assert_close(out, spec.float(), atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("kw,match", [
    (dict(input_layout="TND"), "input_layout must be one of"),
    (dict(num_heads=3), "num_heads=3 does not match"),
    (dict(num_key_value_heads=3), "num_key_value_heads=3 does not match"),
    (dict(actual_seq_lengths=[5]), "one entry per batch"),
    (dict(actual_seq_lengths_kv=[9, 1]), r"entries must be in \[0, 8\]"),
])
def test_prompt_flash_attention_bad_input(lib, kw, match):
    q = torch.randn(2, 8, 2, 16)
    args = dict(num_heads=2, input_layout="BSND")
    args.update(kw)
    with pytest.raises(ValueError, match=match):
        lib.prompt_flash_attention(q, q, q, **args)
    with pytest.raises(TypeError, match="dtype must be one of"):
        lib.prompt_flash_attention(q.double(), q.double(), q.double(), num_heads=2, input_layout="BSND")


# --------------------------------------------------------------------------------------------- #
# operator registration: opcheck, FakeTensor, torch.compile                                      #
# --------------------------------------------------------------------------------------------- #


def test_opcheck_rain_fusion_attention(lib):
    gen = torch.Generator().manual_seed(11)
    for layout, q_lens in (("BNSD", [24, 24]), ("TND", [24, 9])):
        q, k, v = _problem(gen, layout, q_lens, q_lens, 1, 2, 16, 16, torch.float32)
        idx, num = _selection(gen, q_lens, q_lens, 8, 8, 2, "mixed")
        lens = dict(actual_seq_lengths=q_lens) if layout == "TND" else {}
        for return_lse in (False, True):
            torch.library.opcheck(lib.rain_fusion_attention.default, (q, k, v, idx, num, [8, 8]),
                                  dict(q_input_layout=layout, kv_input_layout=layout, scale_value=0.3,
                                       return_lse=return_lse, **lens))


def test_opcheck_prompt_flash_attention(lib):
    q = torch.randn(2, 12, 4, 16)
    kv = torch.randn(2, 10, 2, 16)
    for layout, args in (("BSND", (q, kv, kv)), ("BNSD", (q.transpose(1, 2).contiguous(),) + (kv.transpose(1, 2).contiguous(),) * 2),
                         ("BSH", (q.flatten(2), kv.flatten(2), kv.flatten(2)))):
        torch.library.opcheck(lib.prompt_flash_attention.default, args,
                              dict(num_heads=4, num_key_value_heads=2, input_layout=layout, scale_value=0.25,
                                   pre_tokens=FULL, next_tokens=FULL))


def test_fake_tensor_shapes(lib):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(3, 5, 100, 64)
        k = torch.empty(3, 1, 90, 64)
        v = torch.empty(3, 1, 90, 48)
        idx = torch.empty(3 * 7, 5, 6, dtype=torch.long)
        num = torch.empty(3 * 7, 5, dtype=torch.long)
        out, lse = lib.rain_fusion_attention(q, k, v, idx, num, [16, 16], q_input_layout="BNSD",
                                             kv_input_layout="BNSD", return_lse=True)
        assert out.shape == (3, 5, 100, 48) and lse.shape == (3, 5, 100) and lse.dtype == torch.float32
        o = lib.prompt_flash_attention(torch.empty(2, 7, 4 * 8), torch.empty(2, 9, 2 * 8), torch.empty(2, 9, 2 * 6),
                                       num_heads=4, num_key_value_heads=2)
        assert o.shape == (2, 7, 4 * 6)


def test_torch_compile_fullgraph_matches_eager(lib):
    gen = torch.Generator().manual_seed(12)
    q, k, v = _problem(gen, "BNSD", [40], [40], 2, 1, 16, 16, torch.float32)
    idx, num = _selection(gen, [40], [40], 8, 8, 2, "mixed")

    def f(q, k, v, idx, num):
        out, lse = lib.rain_fusion_attention(q, k, v, idx, num, [8, 8], q_input_layout="BNSD",
                                             kv_input_layout="BNSD", scale_value=0.3, return_lse=True)
        dense = lib.prompt_flash_attention(q, k, v, num_heads=2, num_key_value_heads=2, input_layout="BNSD",
                                           scale_value=0.3, pre_tokens=FULL, next_tokens=FULL)
        return out * 2 + dense, lse.clamp_min(-100.0)

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True)
    got, want = compiled(q, k, v, idx, num), f(q, k, v, idx, num)
    torch.testing.assert_close(got[0], want[0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got[1], want[1], atol=1e-6, rtol=1e-6)


# --------------------------------------------------------------------------------------------- #
# the library missing: fallback, one warning, CI strictness                                      #
# --------------------------------------------------------------------------------------------- #


def test_simulated_missing_library_falls_back(monkeypatch):
    monkeypatch.delenv(_ext.REQUIRE_ENV, raising=False)
    monkeypatch.setattr(_ext, "load", lambda: _ext.ExtStatus(False, "simulated: no C++ compiler"))
    q = torch.randn(1, 2, 32, 8)
    assert "simulated: no C++ compiler" in rf.available_sparse_backends("cpu")["cpp"]
    assert rf.select_sparse_backend(q) in ("flex", "gather")
    with pytest.raises(SparseBackendError, match="not built.*simulated"):
        rf.select_sparse_backend(q, backend="cpp")
    gen = torch.Generator().manual_seed(13)
    idx, num = _selection(gen, [32], [32], 8, 8, 2, "random")
    assert rf.select_sparse_backend(q, return_lse=True) == "gather"
    out, _ = rain_fusion_attention(q, q, q, idx, num, [8, 8], q_input_layout="BNSD", kv_input_layout="BNSD",
                                   return_lse=True)  # lse: skips compiling flex here (the subprocess test runs auto)
    ref, _ = _reference(q, q, q, idx, num, (8, 8), "BNSD", [32], [32])
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_loader_without_compiler_warns_and_ci_requires(monkeypatch):
    monkeypatch.setattr(_ext, "_compiler", lambda: None)
    monkeypatch.delenv(_ext.REQUIRE_ENV, raising=False)
    monkeypatch.delenv(_ext.DISABLE_ENV, raising=False)
    with pytest.warns(RuntimeWarning, match="no C\\+\\+ compiler found.*Python backends serve"):
        st_ = _ext.load.__wrapped__()  # the uncached loader: this process's loaded library stays as is
    assert not st_.loaded and "no C++ compiler" in st_.reason
    monkeypatch.setenv(_ext.REQUIRE_ENV, "1")
    with pytest.raises(RuntimeError, match="LITE_BOOST_REQUIRE_EXT=1.*no C\\+\\+ compiler"):
        _ext.load.__wrapped__()
    monkeypatch.setenv(_ext.DISABLE_ENV, "0")
    monkeypatch.delenv(_ext.REQUIRE_ENV)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert "disabled" in _ext.load.__wrapped__().reason  # disabling on purpose is not warned about


def test_fresh_process_without_compiler(tmp_path):
    """A fresh interpreter with no compiler and an empty cache: import works, one warning, Python backends serve."""
    code = (
        "import warnings, torch, lite_boost\n"
        "from lite_boost.ops import rain_fusion as rf\n"
        "q = torch.randn(1, 1, 16, 8)\n"
        "idx = torch.tensor([[[0, 1]], [[1, -1]]]); num = torch.tensor([[2], [1]])\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    for _ in range(3):\n"
        "        out, _ = rf.rain_fusion_attention(q, q, q, idx, num, [8, 8], q_input_layout='BNSD', kv_input_layout='BNSD')\n"
        "msgs = [str(x.message) for x in w if 'operator library' in str(x.message)]\n"
        "assert len(msgs) == 1 and 'no C++ compiler' in msgs[0], msgs\n"
        "print('backend', rf.select_sparse_backend(q, return_lse=True), rf.available_sparse_backends()['cpp'])\n"
    )
    env = dict(os.environ, CXX="lite-boost-no-such-compiler", LITE_BOOST_EXT_DIR=str(tmp_path))
    env.pop(_ext.REQUIRE_ENV, None)
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "backend gather" in res.stdout and "not built" in res.stdout
    assert not any(tmp_path.iterdir()) or not list(tmp_path.rglob("*.so"))  # nothing was built


def test_env_report_lists_the_library(lib):
    from lite_boost.cli import env_report

    report = env_report()
    assert "### operator library (csrc: torch.ops.lite_boost)" in report
    assert "- rain_fusion_attention: kernels for CPU, Meta" in report
    assert "| cpp | usable |" in report


def test_backend_choice_traces_without_graph_breaks(lib):
    """Selecting the cpp backend inside a compiled region reads the library status as a constant."""
    q = torch.randn(1, 2, 16, 8)

    def f(q):
        return q * (2.0 if rf.select_sparse_backend(q) == "cpp" else 3.0)

    explained = torch._dynamo.explain(f)(q)
    assert explained.graph_break_count == 0
    torch.testing.assert_close(torch.compile(f, backend="eager", fullgraph=True)(q), q * 2.0)


@pytest.mark.parametrize("gemm", [None, "blas", "no-onednn"])
@pytest.mark.parametrize("layout", ["TND", "BNSD"])
def test_cpu_kernel_fp32_gemm_paths(lib, monkeypatch, gemm, layout):
    """fp32 runs its GEMMs on oneDNN's brgemm (default: S = Q K^T from one transposed copy of K, the scale in
    the softmax), on the BLAS sgemm (LITE_BOOST_RF_GEMM=blas), or with oneDNN switched off (brgemm's own BLAS
    fallback): each matches the fp64 reference, with a custom scale, GQA, scattered and consecutive runs,
    partial tail blocks, ragged TND batches, strided query rows and several KV tiles per row."""
    _kernel_env(monkeypatch, GEMM="blas" if gemm == "blas" else None)
    gen = torch.Generator().manual_seed(11)
    q_lens, kv_lens = ([150, 77], [260, 130]) if layout == "TND" else ([150, 150], [260, 260])
    q, k, v = _problem(gen, layout, q_lens, kv_lens, 2, 4, 64, 48, torch.float32)
    if layout == "BNSD":  # strided query rows: BSND storage viewed as BNSD
        q = q.transpose(1, 2).contiguous().transpose(1, 2)
    idx, num = _paired_selection(gen, q_lens, kv_lens, 16, 16, 8)
    _kernel_env(monkeypatch, KV_TILE="64")  # several tiles per row: the online softmax rescales
    monkeypatch.setattr(torch.backends.mkldnn, "enabled", gemm != "no-onednn")
    out, lse = _op_call(lib, q, k, v, idx, num, (16, 16), layout, q_lens, kv_lens, scale=0.3)
    ref, ref_lse = _reference(q, k, v, idx, num, (16, 16), layout, q_lens, kv_lens, scale=0.3)
    torch.testing.assert_close(out, ref.float(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("half_gemm,gemm", [(None, None), ("1", None), ("0", None), ("0", "blas")])
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float16, 3e-3)])
@pytest.mark.parametrize("layout", ["TND", "BNSD"])
def test_cpu_kernel_16bit_gemm_paths(lib, monkeypatch, half_gemm, gemm, dtype, tol, layout):
    """16-bit inputs run MKL's 16-bit GEMMs in place (LITE_BOOST_RF_HALF_GEMM=1; the default on CPUs with AMX)
    or are widened to fp32 tiles for the fp32 GEMMs (=0; the default elsewhere), on oneDNN's brgemm or on BLAS
    (LITE_BOOST_RF_GEMM=blas): each matches the fp64 reference within the input dtype's rounding."""
    _kernel_env(monkeypatch, HALF_GEMM=half_gemm, GEMM=gemm, KV_TILE="64")
    gen = torch.Generator().manual_seed(12)
    q_lens, kv_lens = ([150, 77], [260, 130]) if layout == "TND" else ([150, 150], [260, 260])
    q, k, v = _problem(gen, layout, q_lens, kv_lens, 2, 2, 64, 48, dtype)
    idx, num = _paired_selection(gen, q_lens, kv_lens, 16, 16, 4)
    out, lse = _op_call(lib, q, k, v, idx, num, (16, 16), layout, q_lens, kv_lens)
    ref, ref_lse = _reference(q, k, v, idx, num, (16, 16), layout, q_lens, kv_lens)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-4)


# --------------------------------------------------------------------------------------------- #
# precision="int8": int8 Q K^T after smoothing K, fp32 softmax, 16-bit P V                       #
# --------------------------------------------------------------------------------------------- #

# Error bounds of the int8 mode against the fp64 reference (relative L1 of the output, largest output error,
# largest log-sum-exp error). Keys carry a per-channel mean 4x their spread, as DiT keys do: without the
# smoothing the per-block key scales would be set by that mean and every bound below is exceeded several times.
INT8_REL_L1, INT8_MAX_ABS, INT8_LSE = 1.3e-2, 4e-2, 2.5e-2


def _int8_problem(gen, layout, q_lens, kv_lens, n2, g, d, dv, dtype):
    q, k, v = _problem(gen, layout, q_lens, kv_lens, n2, g, d, dv, torch.float32)
    k = k + 4.0 * torch.randn(d, generator=gen)  # a per-channel offset shared by every token
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _int8_errors(out, lse, ref, ref_lse):
    """(relative L1, largest abs error, largest lse error over rows that select something); also checks the
    rows that select nothing: output 0, lse -inf, as the reference."""
    ref, out = ref.double(), out.double()
    empty = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse), empty)
    assert bool((out[empty] == 0).all())
    diff = (out - ref).abs()
    return ((diff.sum() / ref.abs().sum()).item(), diff.max().item(),
            (lse[~empty].double() - ref_lse[~empty].double()).abs().max().item())


def _int8_refused(lib, reason):
    """On a CPU without int8 dot products the kernel's int8 mode refuses with the reason, before computing."""
    gen = torch.Generator().manual_seed(20)
    q, k, v = _problem(gen, "BNSD", [16], [16], 1, 1, 16, 16, torch.float32)
    idx, num = _selection(gen, [16], [16], 8, 8, 1, "all")
    with pytest.raises(ValueError, match=r"precision='int8' cannot run on this CPU: the CPU has no int8 dot-product "
                                         r"instructions"):
        lib.rain_fusion_attention(q, k, v, idx, num, [8, 8], q_input_layout="BNSD", kv_input_layout="BNSD",
                                  precision="int8")


@pytest.fixture
def int8_lib(lib):
    """The operator library where this CPU runs the int8 mode (VNNI / AMX); elsewhere the test checks the kernel's
    refusal and is skipped with the reason (the int8 numbers need such a CPU)."""
    from lite_boost.ops.precision import cpu_int8_dot_reason

    reason = cpu_int8_dot_reason()
    if reason is not None:
        _int8_refused(lib, reason)
        pytest.skip(f"int8 attention kernel refused as documented: {reason}")
    return lib


@pytest.mark.parametrize("pv", [None, "fp32"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", ["TND", "BNSD"])
def test_cpu_kernel_int8_matches_reference(int8_lib, monkeypatch, pv, dtype, layout):
    """precision="int8" against the fp64 reference on the same selection: ragged TND batches, GQA, paired and
    unpaired query blocks, several KV tiles per row, every input dtype; P V on the bf16 brgemm (the default
    where the CPU has AVX512-BF16) or in fp32 (LITE_BOOST_RF_INT8_PV=fp32, the path of CPUs without it)."""
    lib = int8_lib
    _kernel_env(monkeypatch, INT8_PV=pv, KV_TILE="64")
    gen = torch.Generator().manual_seed(21)
    q_lens, kv_lens = ([150, 77], [260, 130]) if layout == "TND" else ([150, 150], [260, 260])
    q, k, v = _int8_problem(gen, layout, q_lens, kv_lens, 2, 2, 64, 48, dtype)
    idx, num = _paired_selection(gen, q_lens, kv_lens, 16, 16, 4)
    lens = dict(actual_seq_lengths=q_lens, actual_seq_lengths_kv=kv_lens) if layout == "TND" else {}
    out, lse = lib.rain_fusion_attention(q, k, v, idx, num, [16, 16], q_input_layout=layout, kv_input_layout=layout,
                                         return_lse=True, precision="int8", **lens)
    ref, ref_lse = _reference(q, k, v, idx, num, (16, 16), layout, q_lens, kv_lens)
    assert out.dtype == dtype and out.shape == ref.shape
    rel, mx, lse_err = _int8_errors(out, lse, ref, ref_lse)
    assert rel < INT8_REL_L1 and mx < INT8_MAX_ABS and lse_err < INT8_LSE, (rel, mx, lse_err)


@pytest.mark.parametrize("pv", [None, "fp32"])
def test_cpu_kernel_int8_odd_shapes(int8_lib, monkeypatch, pv):
    """Odd KV blocks (the bf16 V layout pads each block to an even length), a head dim that is not a multiple of
    4 (padded for the int8 dot products), Dv != D, a custom scale, rows that select nothing, one block, or all."""
    lib = int8_lib
    _kernel_env(monkeypatch, INT8_PV=pv)
    gen = torch.Generator().manual_seed(22)
    q_lens, kv_lens = [70, 33], [121, 64]
    q, k, v = _int8_problem(gen, "TND", q_lens, kv_lens, 1, 3, 30, 40, torch.float32)
    idx, num = _selection(gen, q_lens, kv_lens, 8, 15, 3, "mixed")
    out, lse = lib.rain_fusion_attention(q, k, v, idx, num, [8, 15], actual_seq_lengths=q_lens,
                                         actual_seq_lengths_kv=kv_lens, scale_value=0.12, return_lse=True,
                                         precision="int8")
    ref, ref_lse = _reference(q, k, v, idx, num, (8, 15), "TND", q_lens, kv_lens, scale=0.12)
    rel, mx, lse_err = _int8_errors(out, lse, ref, ref_lse)
    assert rel < INT8_REL_L1 and mx < INT8_MAX_ABS and lse_err < INT8_LSE, (rel, mx, lse_err)


def test_cpu_kernel_int8_precision_argument(lib):
    """"auto" is the full-precision kernel (bit for bit the default); "int8" differs from it by quantization
    only; anything else is refused naming the argument and its values; "fp8" has no CPU kernel."""
    gen = torch.Generator().manual_seed(23)
    q, k, v = _problem(gen, "BNSD", [40], [40], 1, 2, 32, 32, torch.float32)
    idx, num = _selection(gen, [40], [40], 8, 8, 2, "all")
    call = functools.partial(lib.rain_fusion_attention, q, k, v, idx, num, [8, 8], q_input_layout="BNSD",
                             kv_input_layout="BNSD")
    assert torch.equal(call(precision="auto")[0], call()[0])
    from lite_boost.ops.precision import cpu_int8_dot_reason

    if cpu_int8_dot_reason() is None:
        assert not torch.equal(call(precision="int8")[0], call()[0])
    else:  # a CPU without int8 dot products: the int8 mode is refused with the reason
        _int8_refused(lib, cpu_int8_dot_reason())
    with pytest.raises(ValueError, match=r"precision must be one of \['auto', 'int8', 'fp8'\], got 'int4'"):
        call(precision="int4")
    with pytest.raises(ValueError, match="precision='fp8' is not supported by the CPU kernel"):
        call(precision="fp8")


def test_opcheck_rain_fusion_attention_int8(int8_lib):
    lib = int8_lib
    gen = torch.Generator().manual_seed(24)
    for layout, q_lens in (("BNSD", [24, 24]), ("TND", [24, 9])):
        q, k, v = _problem(gen, layout, q_lens, q_lens, 1, 2, 16, 16, torch.float32)
        idx, num = _selection(gen, q_lens, q_lens, 8, 8, 2, "mixed")
        lens = dict(actual_seq_lengths=q_lens) if layout == "TND" else {}
        torch.library.opcheck(lib.rain_fusion_attention.default, (q, k, v, idx, num, [8, 8]),
                              dict(q_input_layout=layout, kv_input_layout=layout, return_lse=True, precision="int8",
                                   **lens))
