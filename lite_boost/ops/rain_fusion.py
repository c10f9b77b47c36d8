"""``rain_fusion_attention``: block-sparse attention with the ``aclnnRainFusionAttention`` contract.

Semantics (CANN ``aclnnRainFusionAttention``): the query sequence of each batch is cut into blocks
of ``block_shape[0]`` tokens and the key/value sequence into blocks of ``block_shape[1]`` tokens
(the last block of each may be partial). Query block ``i`` of head ``h`` attends with one softmax to
the union of the KV blocks listed in ``select_idx[i, h, :select_num_idx[i, h]]`` (ascending, the
rest of the row -1), of KV head ``h // (N1 // N2)``. Rows are numbered over all batches: batch b's
query blocks follow those of batches 0..b-1; KV indices are local to the batch. A row that selects
nothing outputs zeros.

Backends (chosen per call; first usable in this order unless forced):

* ``"npu"``: the Ascend operator through our csrc op (float16/bfloat16 on an NPU);
* ``"cpp"``: the CPU kernel of the compiled ``torch.ops.lite_boost.rain_fusion_attention`` (csrc/cpu:
  flash-style online softmax over the selected blocks only, fp32 accumulation; float32, float16,
  bfloat16; returns the log-sum-exp; inference only). Usable once the library is built (see
  ``lite_boost/ops/_ext.py``; it builds at first use when ``scripts/setup.sh`` has not);
* ``"sparge"`` / ``"flex_int8"`` (``precision="int8"`` on CUDA only): SpargeAttn's block-sparse
  SageAttention kernel, else compiled FlexAttention on int8-quantized Q / K
  (``lite_boost/ops/_sparse_lowp_cuda.py``);
* ``"flex"``: ``torch.compile``-d FlexAttention built from the block indices (CPU and CUDA; never
  run uncompiled; inference only; no log-sum-exp on CPU);
* ``"gather"``: pure PyTorch, gathers the selected K/V blocks per group of query blocks and runs
  the softmax in fp32; any device, autograd-capable, never materialises S x S;
* ``"reference"``: dense masked fp64 softmax (tests only; materialises the S x S mask; never
  chosen automatically).

Force a backend per call (``backend="gather"``), for a block (``with sparse_backend("gather"):``)
or for the process (environment variable ``LITE_BOOST_SPARSE_BACKEND``). A forced backend that
cannot run raises :class:`SparseBackendError` saying why and listing the usable ones.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from . import _ext, _sparse_lowp_cuda, _sparse_npu
from ._flex import FLEX
from ._errors import SparseBackendError
from ._override import BackendOverride
from ._sparse_kernels import dense_masked_attention, gather_attention
from .precision import check_precision, cpu_precision_reason

__all__ = [
    "SparseBackendError",
    "SPARSE_BACKENDS",
    "ENV_VAR",
    "rain_fusion_attention",
    "sparse_backend",
    "select_sparse_backend",
    "available_sparse_backends",
    "backend_report",
]

logger = logging.getLogger("lite_boost.sparse")

ENV_VAR = "LITE_BOOST_SPARSE_BACKEND"
SPARSE_BACKENDS = ("npu", "cpp", "sparge", "flex_int8", "flex", "gather", "reference")
_AUTO_ORDER = ("npu", "cpp", "sparge", "flex_int8", "flex", "gather")
LAYOUTS = ("TND", "BNSD")
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Per-call argument > ``with sparse_backend(...)`` > LITE_BOOST_SPARSE_BACKEND.
_OVERRIDE = BackendOverride(SPARSE_BACKENDS, ENV_VAR, "sparse_backend(...)")


# --------------------------------------------------------------------------------------------- #
# Validation and normalisation                                                                   #
# --------------------------------------------------------------------------------------------- #


@dataclass(frozen=True)
class _Problem:
    """A validated call: per-batch sequence lengths and the select arrays."""

    q_layout: str
    kv_layout: str
    q_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]
    n1: int
    n2: int
    block_shape: tuple[int, int]
    scale: float
    inner_precise: int
    precision: str = "auto"


def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).replace("torch.", "")


def _check_layout(name: str, value) -> str:
    if not isinstance(value, str) or value.upper() not in LAYOUTS:
        raise ValueError(f"{name} must be one of {list(LAYOUTS)}, got {value!r}")
    return value.upper()


def _check_lengths(name: str, value, batch: int | None, total: int | None, layout: str, seq: int | None):
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    if not isinstance(value, (list, tuple)) or not all(
        isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in value
    ):
        raise ValueError(f"{name} must be a list of non-negative ints (per-batch lengths), got {value!r}")
    value = tuple(value)
    if layout == "TND" and sum(value) != total:
        raise ValueError(f"{name} must sum to the TND token count {total} (per-batch lengths), got sum {sum(value)}")
    if layout == "BNSD":
        if len(value) != batch:
            raise ValueError(f"{name} must have one entry per batch ({batch}), got {len(value)}")
        if any(x != seq for x in value):
            raise ValueError(
                f"{name} must equal the BNSD sequence length {seq} for every batch; use layout 'TND' "
                f"for variable lengths, got {list(value)}"
            )
    return value


def _validate(query, key, value, select_idx, select_num_idx, block_shape, attn_mask, actual_seq_lengths,
              actual_seq_lengths_kv, block_table, q_input_layout, kv_input_layout, num_key_value_heads,
              mask_type, scale_value, inner_precise, block_size, check_select=True) -> _Problem:
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in _DTYPES:
            raise TypeError(f"{name} dtype must be one of float32, float16, bfloat16, got {_dtype_name(t.dtype)}")
    if not (query.dtype == key.dtype == value.dtype):
        raise TypeError(
            f"query, key and value must share one dtype, got {_dtype_name(query.dtype)}, "
            f"{_dtype_name(key.dtype)}, {_dtype_name(value.dtype)}"
        )
    if not (query.device == key.device == value.device):
        raise ValueError(f"query, key and value must be on one device, got {query.device}, {key.device}, {value.device}")
    ql = _check_layout("q_input_layout", q_input_layout)
    kl = _check_layout("kv_input_layout", kv_input_layout)
    qr, kr = (3 if ql == "TND" else 4), (3 if kl == "TND" else 4)
    if query.dim() != qr:
        raise ValueError(f"query must be rank {qr} for q_input_layout={ql!r}, got shape {tuple(query.shape)}")
    for name, t in (("key", key), ("value", value)):
        if t.dim() != kr:
            raise ValueError(f"{name} must be rank {kr} for kv_input_layout={kl!r}, got shape {tuple(t.shape)}")
    if key.shape[:-1] != value.shape[:-1]:
        raise ValueError(f"key and value must match except in the last axis, got {tuple(key.shape)} and {tuple(value.shape)}")
    if query.shape[-1] != key.shape[-1]:
        raise ValueError(f"query and key head dims differ: {query.shape[-1]} vs {key.shape[-1]}")
    n1 = query.shape[1]
    n2 = key.shape[1]
    if n1 == 0 or n2 == 0 or n1 % n2:
        raise ValueError(f"query heads ({n1}) must be a positive multiple of key/value heads ({n2})")
    if num_key_value_heads is not None and num_key_value_heads != n2:
        raise ValueError(f"num_key_value_heads={num_key_value_heads} does not match the key/value tensors ({n2} heads)")
    # sequence lengths per batch
    if ql == "BNSD":
        qb = query.shape[0]
        q_lens = _check_lengths("actual_seq_lengths", actual_seq_lengths, qb, None, "BNSD", query.shape[2]) or (query.shape[2],) * qb
    else:
        q_lens = _check_lengths("actual_seq_lengths", actual_seq_lengths, None, query.shape[0], "TND", None) or (query.shape[0],)
    if kl == "BNSD":
        kb = key.shape[0]
        kv_lens = _check_lengths("actual_seq_lengths_kv", actual_seq_lengths_kv, kb, None, "BNSD", key.shape[2]) or (key.shape[2],) * kb
    else:
        given = actual_seq_lengths_kv
        if given is None and kl == ql == "TND" and actual_seq_lengths is not None and sum(actual_seq_lengths) == key.shape[0]:
            given = actual_seq_lengths  # self-attention varlen: kv lengths default to q lengths
        kv_lens = _check_lengths("actual_seq_lengths_kv", given, None, key.shape[0], "TND", None) or (key.shape[0],)
    if len(q_lens) != len(kv_lens):
        raise ValueError(f"query has {len(q_lens)} batches but key/value have {len(kv_lens)}")
    if (not isinstance(block_shape, (list, tuple, torch.Size)) or len(block_shape) != 2
            or not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in block_shape)):
        raise ValueError(f"block_shape must be two positive ints [q_block, kv_block], got {block_shape!r}")
    bq, bk = int(block_shape[0]), int(block_shape[1])
    if attn_mask is not None:
        raise ValueError("attn_mask is not supported by aclnnRainFusionAttention; pass None")
    if block_table is not None or block_size != 0:
        raise ValueError("paged attention is not supported: block_table must be None and block_size 0, "
                         f"got block_table={'a tensor' if block_table is not None else None}, block_size={block_size!r}")
    if mask_type != 0:
        raise ValueError(f"mask_type must be 0 (no mask), got {mask_type!r}")
    if inner_precise not in (0, 1) or isinstance(inner_precise, bool):
        raise ValueError(f"inner_precise must be 0 (fp32 softmax) or 1 (fp16 softmax), got {inner_precise!r}")
    if scale_value is None:
        scale = query.shape[-1] ** -0.5
    elif isinstance(scale_value, bool) or not isinstance(scale_value, (int, float)) or not (
            math.isfinite(scale_value) and scale_value > 0):
        raise ValueError(f"scale_value must be a positive finite number or None (= head_dim ** -0.5), got {scale_value!r}")
    else:
        scale = float(scale_value)
    # select arrays
    nqb = [math.ceil(x / bq) for x in q_lens]
    nkb = [math.ceil(x / bk) for x in kv_lens]
    rows = sum(nqb)
    for name, t, rank in (("select_idx", select_idx, 3), ("select_num_idx", select_num_idx, 2)):
        if not isinstance(t, torch.Tensor) or t.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"{name} must be an int64 (or int32) tensor, got "
                            f"{_dtype_name(t.dtype) if isinstance(t, torch.Tensor) else type(t).__name__}")
        if t.dim() != rank:
            raise ValueError(f"{name} must be rank {rank}, got shape {tuple(t.shape)}")
        if t.device != query.device:
            raise ValueError(f"{name} must be on the query's device {query.device}, got {t.device}")
    if tuple(select_idx.shape[:2]) != (rows, n1):
        raise ValueError(
            f"select_idx must have shape [total query blocks={rows}, heads={n1}, max kv blocks], got "
            f"{tuple(select_idx.shape)} (query blocks per batch: {nqb} for block_shape[0]={bq})"
        )
    if tuple(select_num_idx.shape) != (rows, n1):
        raise ValueError(f"select_num_idx must have shape [{rows}, {n1}], got {tuple(select_num_idx.shape)}")
    if check_select and select_idx.numel():
        _check_select(select_idx, select_num_idx, nqb, nkb)
    return _Problem(ql, kl, tuple(q_lens), tuple(kv_lens), n1, n2, (bq, bk), scale, int(inner_precise))


def _check_select(select_idx, select_num, nqb, nkb):
    m = select_idx.shape[-1]
    num = select_num.long()
    idx = select_idx.long()
    if bool((num < 0).any()) or bool((num > m).any()):
        bad = torch.nonzero((num < 0) | (num > m))[0].tolist()
        raise ValueError(f"select_num_idx values must be in [0, {m}]; select_num_idx{bad} = {num[tuple(bad)].item()}")
    limit = torch.repeat_interleave(torch.tensor(nkb, device=idx.device), torch.tensor(nqb, device=idx.device))
    pos = torch.arange(m, device=idx.device)
    valid = pos < num[..., None]
    out_of_range = valid & ((idx < 0) | (idx >= limit[:, None, None]))
    if bool(out_of_range.any()):
        r, h, j = torch.nonzero(out_of_range)[0].tolist()
        raise ValueError(
            f"select_idx[{r}, {h}, {j}] = {idx[r, h, j].item()} is out of range: KV block indices of this "
            f"batch must be in [0, {limit[r].item()})"
        )
    if bool((~valid & (idx != -1)).any()):
        r, h, j = torch.nonzero(~valid & (idx != -1))[0].tolist()
        raise ValueError(
            f"select_idx[{r}, {h}, {j}] = {idx[r, h, j].item()} must be -1: entries past "
            f"select_num_idx[{r}, {h}] = {num[r, h].item()} are padding"
        )
    if m > 1:
        unsorted = valid[..., 1:] & (idx[..., 1:] <= idx[..., :-1])
        if bool(unsorted.any()):
            r, h, j = torch.nonzero(unsorted)[0].tolist()
            raise ValueError(
                f"select_idx row [{r}, {h}] must be strictly ascending before the -1 padding, got "
                f"{idx[r, h, j].item()} then {idx[r, h, j + 1].item()}"
            )


# --------------------------------------------------------------------------------------------- #
# Backends                                                                                       #
# --------------------------------------------------------------------------------------------- #


def _segments(t: torch.Tensor, layout: str, lens: Sequence[int]):
    """Per-batch (N, L, D) views."""
    if layout == "BNSD":
        return [t[b] for b in range(t.shape[0])]
    out, start = [], 0
    for n in lens:
        out.append(t[start:start + n].transpose(0, 1))
        start += n
    return out


def _run_segments(kernel, query, key, value, select_idx, select_num, p: _Problem, need_lse):
    qs = _segments(query, p.q_layout, p.q_lens)
    ks = _segments(key, p.kv_layout, p.kv_lens)
    vs = _segments(value, p.kv_layout, p.kv_lens)
    out = torch.empty(query.shape[:-1] + value.shape[-1:], dtype=query.dtype, device=query.device)
    lse = torch.empty(query.shape[:-1], dtype=torch.float32, device=query.device) if need_lse else None
    outs = _segments(out, p.q_layout, p.q_lens)
    lses = _segments(lse.unsqueeze(-1), p.q_layout, p.q_lens) if need_lse else None
    row = 0
    for b, (qb, kb, vb) in enumerate(zip(qs, ks, vs)):
        n = math.ceil(p.q_lens[b] / p.block_shape[0])
        o, l = kernel(qb, kb, vb, select_idx[row:row + n], select_num[row:row + n], p.block_shape, p.scale, need_lse)
        outs[b].copy_(o)
        if need_lse:
            lses[b].copy_(l.unsqueeze(-1))
        row += n
    return out, lse


def _run_gather(query, key, value, select_idx, select_num, p, need_lse):
    return _run_segments(gather_attention, query, key, value, select_idx, select_num, p, need_lse)


def _run_reference(query, key, value, select_idx, select_num, p, need_lse):
    return _run_segments(dense_masked_attention, query, key, value, select_idx, select_num, p, need_lse)


def _run_flex(query, key, value, select_idx, select_num, p, need_lse):
    uniform = p.q_layout == p.kv_layout == "BNSD" or (
        len(set(p.q_lens)) == 1 and len(set(p.kv_lens)) == 1 and p.q_lens[0] > 0 and p.kv_lens[0] > 0)
    if not uniform:
        def one(qb, kb, vb, si, sn, block_shape, scale, need):
            if qb.shape[1] == 0 or kb.shape[1] == 0 or si.shape[-1] == 0:
                return gather_attention(qb, kb, vb, si, sn, block_shape, scale, need)
            o, l = FLEX(qb[None], kb[None], vb[None], si.permute(1, 0, 2)[None], sn.t()[None], block_shape, scale, need)
            return o[0], (l[0] if need else None)

        return _run_segments(one, query, key, value, select_idx, select_num, p, need_lse)
    b = len(p.q_lens)

    def bnsd(t, layout, lens):
        return t if layout == "BNSD" else t.view(b, lens[0], *t.shape[1:]).transpose(1, 2)

    q4, k4, v4 = bnsd(query, p.q_layout, p.q_lens), bnsd(key, p.kv_layout, p.kv_lens), bnsd(value, p.kv_layout, p.kv_lens)
    nqb = select_idx.shape[0] // b
    si = select_idx.view(b, nqb, p.n1, -1).permute(0, 2, 1, 3)
    sn = select_num.view(b, nqb, p.n1).permute(0, 2, 1)
    out, lse = FLEX(q4, k4, v4, si, sn, p.block_shape, p.scale, need_lse)
    if p.q_layout == "TND":
        out = out.transpose(1, 2).reshape(query.shape[:-1] + value.shape[-1:])
        lse = lse.transpose(1, 2).reshape(query.shape[:-1]) if need_lse else None
    return out, lse


def _run_cpp(query, key, value, select_idx, select_num, p, need_lse):
    out, lse = torch.ops.lite_boost.rain_fusion_attention(
        query, key, value, select_idx, select_num, list(p.block_shape), None, list(p.q_lens), list(p.kv_lens), None,
        p.q_layout, p.kv_layout, p.n2, 0, p.scale, p.inner_precise, 0, return_lse=need_lse, precision=p.precision)
    return out, (lse if need_lse else None)


def _run_npu(query, key, value, select_idx, select_num, p, need_lse):
    call = _sparse_npu.aclnn_arguments(query, key, value, select_idx, select_num, p.block_shape, p.q_lens,
                                       p.kv_lens, p.q_layout, p.kv_layout, p.n2, p.scale, p.inner_precise)
    return _sparse_npu.launch(call), None


@dataclass(frozen=True)
class _Context:
    device_type: str
    dtype: torch.dtype
    need_lse: bool
    needs_grad: bool
    block_shape: tuple[int, int]
    n1: int
    n2: int
    inner_precise: int
    precision: str = "auto"
    head_dim: int | None = None


def _full_precision_only(c: _Context) -> str | None:
    if c.precision != "auto":
        return f"runs in the input dtype only (precision={c.precision!r} asked)"
    return None


def _reject_npu(c: _Context) -> str | None:
    if c.device_type != "npu" and _sparse_npu.probe(c.device_type) is not None:
        return _sparse_npu.probe(c.device_type)  # "wrong device" first: the most useful reason
    why = _sparse_npu.contract_violation(c.dtype, c.n1, c.n2, c.inner_precise)
    if why:
        return why
    if c.precision != "auto":
        return f"the Ascend operator runs in the input dtype only (precision={c.precision!r} asked)"
    if c.need_lse:
        return "the Ascend operator does not return softmax_lse"
    if c.needs_grad:
        return "the Ascend operator is inference-only (inputs require grad)"
    return _sparse_npu.probe(c.device_type)


def _reject_cpp(c: _Context) -> str | None:
    if c.device_type != "cpu":
        return f"wrong device: needs cpu, got {c.device_type}"
    if c.needs_grad:
        return "the C++ kernel is inference-only (inputs require grad)"
    if c.precision != "auto":
        return cpu_precision_reason(c.precision)
    return _ext.cpu_kernel_reason("rain_fusion_attention")


def _reject_flex(c: _Context) -> str | None:
    if c.device_type not in ("cpu", "cuda"):
        return f"wrong device: needs cpu or cuda, got {c.device_type}"
    if c.needs_grad:
        return "compiled FlexAttention is used for inference only (inputs require grad)"
    if _full_precision_only(c):
        return _full_precision_only(c)
    if c.need_lse and c.device_type == "cpu":
        return "compiled FlexAttention on CPU cannot return softmax_lse"
    if c.device_type == "cuda" and any(x % 128 for x in c.block_shape):
        return f"block_shape {list(c.block_shape)} not accepted: FlexAttention on CUDA needs multiples of 128"
    return FLEX.probe(c.device_type)


def _reject_any(c: _Context) -> str | None:
    return _full_precision_only(c)


# ------------------------------------------------------------ CUDA int8 kernels (_sparse_lowp_cuda.py)


def _int8_only(c: _Context) -> str | None:
    if c.precision != "int8":
        return f"computes in int8 only (precision={c.precision!r} asked; pass precision='int8')"
    return None


def _reject_sparge(c: _Context) -> str | None:
    return _int8_only(c) or _sparse_lowp_cuda.sparge_reason(c.device_type, c.dtype, c.block_shape, c.need_lse,
                                                             c.needs_grad, c.head_dim)


def _reject_flex_int8(c: _Context) -> str | None:
    return _int8_only(c) or _sparse_lowp_cuda.flex_int8_reason(c.device_type, c.dtype, c.block_shape, c.need_lse,
                                                                c.needs_grad)


def _run_sparge(query, key, value, select_idx, select_num, p, need_lse):
    return _run_segments(_sparse_lowp_cuda.sparge_kernel, query, key, value, select_idx, select_num, p, need_lse)


def _run_flex_int8(query, key, value, select_idx, select_num, p, need_lse):
    return _run_segments(_sparse_lowp_cuda.flex_int8_kernel, query, key, value, select_idx, select_num, p, need_lse)


@dataclass(frozen=True)
class _Backend:
    name: str
    rejects: Callable[[_Context], str | None]
    run: Callable
    description: str


_BACKENDS = {
    b.name: b
    for b in (
        _Backend("npu", _reject_npu, _run_npu, "aclnnRainFusionAttention via torch.ops.lite_boost (Ascend)"),
        _Backend("cpp", _reject_cpp, _run_cpp, "torch.ops.lite_boost C++ block-sparse flash kernel (CPU)"),
        _Backend("sparge", _reject_sparge, _run_sparge, "SpargeAttn block_sparse_sage2_attn_cuda: int8 Q/K, 16-bit "
                 "or FP8 P/V, block-sparse in one kernel (CUDA, precision int8)"),
        _Backend("flex_int8", _reject_flex_int8, _run_flex_int8, "torch.compile(flex_attention) on int8-quantized "
                 "Q/K (CUDA, precision int8, where SpargeAttn is absent)"),
        _Backend("flex", _reject_flex, _run_flex, "torch.compile(flex_attention) from block indices (CPU/CUDA)"),
        _Backend("gather", _reject_any, _run_gather, "pure PyTorch gather of selected blocks, fp32 softmax"),
        _Backend("reference", _reject_any, _run_reference, "dense masked fp64 softmax (tests only)"),
    )
}


def _check_backend_name(name, argument: str) -> str:
    return _OVERRIDE.check(name, argument)


def _choose(c: _Context, backend) -> tuple[str, str]:
    requested, how = _OVERRIDE.requested(backend)
    if requested is not None:
        why = _BACKENDS[requested].rejects(c)
        if why is not None:
            usable = [n for n in SPARSE_BACKENDS if _BACKENDS[n].rejects(c) is None]
            raise SparseBackendError(
                f"sparse attention backend {requested!r} ({how}) cannot run this call "
                f"({c.device_type}/{_dtype_name(c.dtype)}): {why}. Usable backends: {usable}"
            )
        return requested, how
    skipped = []
    for name in _AUTO_ORDER:
        why = _BACKENDS[name].rejects(c)
        if why is None:
            return name, "automatic" + (f" (skipped {'; '.join(skipped)})" if skipped else "")
        skipped.append(f"{name}: {why}")
    raise SparseBackendError("no sparse attention backend can run this call: " + "; ".join(skipped))


def select_sparse_backend(query: torch.Tensor, key: torch.Tensor | None = None, *, block_shape=(128, 128),
                          return_lse: bool = False, inner_precise: int = 0, backend: str | None = None,
                          heads_axis: int = 1, precision: str = "auto") -> str:
    """Name of the backend ``rain_fusion_attention`` would use for these tensors."""
    key = query if key is None else key
    c = _Context(query.device.type, query.dtype, return_lse,
                 torch.is_grad_enabled() and (query.requires_grad or key.requires_grad),
                 tuple(block_shape), query.shape[heads_axis], key.shape[heads_axis], inner_precise,
                 check_precision(precision))
    return _choose(c, backend)[0]


def available_sparse_backends(device="cpu", dtype=torch.float32, precision: str = "auto") -> dict[str, str | None]:
    """Map backend name -> None if usable for a plain inference call on ``device``/``dtype`` at ``precision``,
    else why not."""
    c = _Context(torch.device(device).type, dtype, False, False, (128, 128), 1, 1, 0, check_precision(precision))
    return {n: _BACKENDS[n].rejects(c) for n in SPARSE_BACKENDS}


def backend_report(device="cpu", dtype=torch.float32) -> list[tuple[str, str, str]]:
    """(name, "usable" or "off: why", description) per backend for a plain inference call."""
    usable = available_sparse_backends(device, dtype)
    return [(n, "usable" if usable[n] is None else f"off: {usable[n]}", _BACKENDS[n].description)
            for n in SPARSE_BACKENDS]


def sparse_backend(name: str | None):
    """Force a block-sparse backend inside a ``with`` block (``None`` restores automatic choice)."""
    return _OVERRIDE.force(name)


def _dispatch(query, key, value, select_idx, select_num, p: _Problem, return_lse: bool, backend):
    c = _Context(query.device.type, query.dtype, return_lse,
                 torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)),
                 p.block_shape, p.n1, p.n2, p.inner_precise, p.precision, query.shape[-1])
    name, how = _choose(c, backend)
    logger.debug("rain_fusion_attention: backend %r (%s)", name, how)
    if name == "flex":
        try:
            out, lse = _run_flex(query, key, value, select_idx, select_num, p, return_lse)
        except Exception as exc:  # compile failure: never silent, never wrong
            if not how.startswith("automatic"):
                raise SparseBackendError(f"compiled FlexAttention failed ({how}): {exc}") from exc
            reason = f"compiled FlexAttention failed on {c.device_type}: {exc.__class__.__name__}: {str(exc)[:300]}"
            FLEX.disable(c.device_type, reason)
            logger.warning("lite_boost sparse attention: %s; falling back to 'gather'", reason)
            name = "gather"
        else:
            return out, lse, name
    out, lse = _BACKENDS[name].run(query, key, value, select_idx, select_num, p, return_lse)
    return out, lse, name


# --------------------------------------------------------------------------------------------- #
# Public entry point                                                                             #
# --------------------------------------------------------------------------------------------- #


def rain_fusion_attention(query, key, value, select_idx, select_num_idx, block_shape, attn_mask=None,
                          actual_seq_lengths=None, actual_seq_lengths_kv=None, block_table=None,
                          q_input_layout="TND", kv_input_layout="TND", num_key_value_heads=None, mask_type=0,
                          scale_value=None, inner_precise=0, block_size=0, *, return_lse: bool = False,
                          backend: str | None = None, precision: str = "auto"):
    """Block-sparse attention with the semantics of CANN ``aclnnRainFusionAttention``.

    Args:
        query: (T, N1, D) for ``q_input_layout="TND"`` (batches packed, lengths in
            ``actual_seq_lengths``) or (B, N1, S, D) for "BNSD". float32, float16 or bfloat16.
        key, value: (T, N2, D) / (B, N2, S, D) in ``kv_input_layout``; N1 % N2 == 0 (GQA).
        select_idx: int64 [total query blocks over all batches, N1, max kv blocks]: the KV blocks
            each query block attends to, ascending, then -1 padding.
        select_num_idx: int64 [total query blocks, N1]: how many entries of each row are valid.
        block_shape: [q_block, kv_block] tokens; sequence tails may be partial blocks.
        attn_mask, block_table: must be None (unsupported by the contract); mask_type must be 0,
            block_size 0.
        actual_seq_lengths, actual_seq_lengths_kv: per-batch lengths (not cumulative). TND: they
            split the packed tokens (None = one batch; kv lengths default to the q lengths when
            the token counts agree). BNSD: None or all equal to S.
        num_key_value_heads: None = taken from ``key`` (checked against it when given).
        scale_value: softmax scale; None = D ** -0.5.
        inner_precise: 0 = fp32 softmax (required for bfloat16 on Ascend), 1 = fp16 softmax on
            Ascend; the CPU/CUDA backends always accumulate in fp32.
        return_lse: also return the natural-log log-sum-exp of each query row (fp32). Restricts
            the choice to backends that produce it ("cpp", "gather", "reference", "flex" on CUDA).
        backend: force "npu", "cpp", "sparge", "flex_int8", "flex", "gather" or "reference" (None =
            context manager, env var, automatic).
        precision: "auto" (the input dtype) or "int8": Q K^T on int8 dot products after smoothing
            K by its mean over each (batch, KV head)'s tokens (per-row query scales, per-KV-block key
            scales), fp32 softmax, P V in bf16 (fp32 where the CPU has no bf16 dot products); the
            log-sum-exp is that of the unquantized scores' shift-corrected softmax. "int8" runs on the
            "cpp" backend (CPU with int8 dot products) and, on CUDA, on "sparge" (SpargeAttn; no
            log-sum-exp) or "flex_int8" (FlexAttention on int8-quantized Q / K); "fp8" has no kernel
            here. The other backends run "auto" only, and "sparge" / "flex_int8" "int8" only.

    Returns:
        ``(out, softmax_lse)``: ``out`` in the query's layout and dtype (rows that select nothing
        are 0); ``softmax_lse`` is None unless ``return_lse``, else fp32 shaped like the query
        without its last axis ((T, N1) or (B, N1, S)), -inf for rows that select nothing.

    Raises:
        ValueError: (or TypeError) naming the argument, before any kernel runs, for bad layouts,
            shapes, dtypes, heads, select arrays (out of range, unsorted, bad padding) or
            unsupported contract options.
        SparseBackendError: if a forced backend cannot run.
    """
    p = _validate(query, key, value, select_idx, select_num_idx, block_shape, attn_mask, actual_seq_lengths,
                  actual_seq_lengths_kv, block_table, q_input_layout, kv_input_layout, num_key_value_heads,
                  mask_type, scale_value, inner_precise, block_size)
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be True or False, got {return_lse!r}")
    p = dataclasses.replace(p, precision=check_precision(precision))
    out, lse, _ = _dispatch(query, key, value, select_idx, select_num_idx, p, return_lse, backend)
    return out, lse
