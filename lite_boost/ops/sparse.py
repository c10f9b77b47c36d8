"""``sparse_attention``: dense attention or RainFusion 2.0 ("rf_v2") block-sparse attention.

The rf_v2 path, per call:

1. reorder the tokens so each block of ``block_size`` tokens is a compact piece of the
   (t, h, w) latent grid (see :mod:`._sparse_layout`; text tokens move behind the video);
2. score block pairs in fp32 (``selector``): ``"reference"`` = RainFusion 2.0's mean-pooled Q/K
   logits; ``"subblock"`` (default) = estimated attention mass from several sub-block
   representatives per block, outlying keys kept apart, a key-variance correction (see
   :mod:`._sparse_mask`);
3. per batch element and head, keep the top ``ceil((1 - sparsity) * kv_blocks)`` KV blocks per
   query block by score (ties never over-select), then add the forced blocks: blocks holding text
   or, with ``keep_sink``, first-frame tokens are forced on in both directions (every query
   attends to them, their queries attend to everything); ``keep_recent`` forces each query
   block's own (diagonal) KV block. ``budget="reference"`` (default, the reference rule) adds the
   forced blocks on top of the top-k; ``budget="total"`` counts them toward it (hard cap);
4. run :func:`rain_fusion_attention` on the reordered tensors and undo the reordering.

Heads are processed in groups so that the reordered copies stay a small fraction of the inputs.
A computed :class:`BlockSelection` can be returned (``return_stats=True``) and passed back
(``selection=``) to reuse a mask across denoising steps.

Improvements over the reference implementation, each selectable: real (t, h, w) windows with exact
handling of grids the window does not divide (``window=(wt, wh, ww)``; ``None`` = the reference
8x8 order, ``"raster"`` = no reordering); one mask per batch element; ``latent_shape_k`` honoured;
text blocks found per token, so a video length that is not a multiple of the block size cannot
misalign them; a dense fallback below ``min_seq_len``; the effective sparsity reported; a better
block scorer at the same block budget (``selector="subblock"``).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from . import rain_fusion as _rf
from ._checks import check_qkv_tensors
from ._sparse_layout import token_order
from ._sparse_mask import BUDGETS, SELECTORS, block_scores, forced_blocks, select_blocks
from .lse import merge_partial, start_partial
from .precision import check_precision

__all__ = ["sparse_attention", "SparseStats", "BlockSelection", "SPARSE_TYPES", "INPUT_LAYOUTS", "SELECTORS",
           "BUDGETS", "DEFAULT_SELECTOR_REPS"]

SPARSE_TYPES = (None, "rf_v2")
INPUT_LAYOUTS = ("BNSD", "BSND", "BSH")
_EXTRAS = ("window", "min_seq_len", "selection", "return_stats", "backend", "head_chunk", "budget", "selector",
           "selector_reps", "ring")
DEFAULT_SELECTOR_REPS = (32, 8)  # "subblock": representatives per query block, per key block
_MEMORY_FRACTION = 0.125  # reordered copies (q, k, v, out) per head group, relative to the inputs


@dataclass(frozen=True)
class BlockSelection:
    """A block mask computed by rf_v2, reusable for later calls with the same shapes.

    select_idx (B * q_blocks, N, M) int64 and select_num (B * q_blocks, N) int64 follow the
    rain_fusion_attention contract, in the reordered token order described by ``signature``.
    """

    select_idx: torch.Tensor
    select_num: torch.Tensor
    signature: tuple


@dataclass(frozen=True)
class SparseStats:
    """What one sparse_attention call did.

    path: "sparse" or "dense"; reason: why (e.g. "sparse_type=None", "seq_len < min_seq_len");
    backend: rain_fusion backend used (None on the dense path); sparsity: requested;
    effective_sparsity: fraction of (query, key) token pairs skipped, over batch and heads
    (forced rows and columns included); q_blocks / kv_blocks per batch element; selection: the
    mask (reusable via ``selection=``), None on the dense path; reused: the mask came from
    ``selection=``; selector / budget: how the mask was chosen (None on the dense path).
    """

    path: str
    reason: str
    backend: str | None
    sparsity: float
    effective_sparsity: float
    q_blocks: int = 0
    kv_blocks: int = 0
    selection: BlockSelection | None = None
    reused: bool = False
    selector: str | None = None
    budget: str | None = None


# --------------------------------------------------------------------------------------------- #
# Validation                                                                                     #
# --------------------------------------------------------------------------------------------- #


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_shape3(name, value):
    if value is None:
        return None
    if isinstance(value, torch.Size):
        value = tuple(value)
    if not isinstance(value, (tuple, list)) or len(value) != 3 or not all(_is_int(x) and x > 0 for x in value):
        raise ValueError(f"{name} must be None or three positive ints (t, h, w), got {value!r}")
    return tuple(int(x) for x in value)


def _to_bnsd(q, k, v, layout, head_num):
    """Validate tensors for ``layout`` and return BNSD views plus a function mapping BNSD output back."""
    check_qkv_tensors(q, k, v)
    if not _is_int(head_num) or head_num < 1:
        raise ValueError(f"head_num must be a positive int, got {head_num!r}")
    rank = 3 if layout == "BSH" else 4
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != rank:
            raise ValueError(f"{name} must be rank {rank} for input_layout={layout!r}, got shape {tuple(t.shape)}")
    if layout == "BSH":
        if q.shape[-1] % head_num:
            raise ValueError(f"head_num={head_num} does not divide the hidden size {q.shape[-1]} of q (layout BSH)")
        d = q.shape[-1] // head_num
        if k.shape[-1] % d or v.shape[-1] % d:
            raise ValueError(f"k/v hidden sizes {k.shape[-1]}, {v.shape[-1]} are not multiples of head_dim {d} (layout BSH)")
        q4, k4, v4 = (t.unflatten(-1, (-1, d)).transpose(1, 2) for t in (q, k, v))
    elif layout == "BSND":
        q4, k4, v4 = (t.transpose(1, 2) for t in (q, k, v))
    else:
        q4, k4, v4 = q, k, v
    if q4.shape[1] != head_num:
        raise ValueError(
            f"head_num={head_num} is inconsistent with q, which has {q4.shape[1]} heads in layout {layout} "
            f"(shape {tuple(q.shape)})"
        )
    if not (q4.shape[0] == k4.shape[0] == v4.shape[0]):
        raise ValueError(f"q, k and v must share the batch size, got {q4.shape[0]}, {k4.shape[0]}, {v4.shape[0]}")
    if k4.shape[:3] != v4.shape[:3]:
        raise ValueError(f"k and v must have the same batch, heads and length, got {tuple(k.shape)} and {tuple(v.shape)}")
    if q4.shape[-1] != k4.shape[-1]:
        raise ValueError(f"q and k head dims differ: {q4.shape[-1]} vs {k4.shape[-1]}")
    if q4.shape[1] % k4.shape[1]:
        raise ValueError(f"query heads ({q4.shape[1]}) must be a multiple of key/value heads ({k4.shape[1]})")

    def back(out4):
        if layout == "BNSD":
            return out4
        out = out4.transpose(1, 2)
        return out.flatten(2) if layout == "BSH" else out

    return q4, k4, v4, back


def _check_float(name, value, lo, hi, lo_open=False, hi_open=False):
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok:
        ok = (value > lo if lo_open else value >= lo) and (value < hi if hi_open else value <= hi)
    if not ok:
        interval = f"{'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
        raise ValueError(f"{name} must be a number in {interval}, got {value!r}")
    return float(value)


# --------------------------------------------------------------------------------------------- #
# Paths                                                                                          #
# --------------------------------------------------------------------------------------------- #


def _dense(q4, k4, v4, scale, attn_mask, is_causal, precision="auto"):
    if attn_mask is None and not is_causal:
        from .attention import attention

        return attention(q4, k4, v4, layout="BNSD", scale=scale, precision=precision)
    gqa = {"enable_gqa": True} if q4.shape[1] != k4.shape[1] else {}
    return F.scaled_dot_product_attention(q4, k4, v4, attn_mask=attn_mask, is_causal=is_causal, scale=scale, **gqa)


def _reorder(x: torch.Tensor, order: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """``x[:, :, order]`` of (B, H, S, D) ``x``; into ``out`` (B, H, len(order), D) when given, one
    row gather per (batch, head) slice (each a plain 2-D gather of contiguous rows)."""
    if out is None:
        return x.index_select(2, order)
    for bi in range(x.shape[0]):
        for hi in range(x.shape[1]):
            torch.index_select(x[bi, hi], 0, order, out=out[bi, hi])
    return out


def _head_chunk(n2: int, requested) -> int:
    if requested is not None:
        return requested
    target = max(1, int(n2 * _MEMORY_FRACTION))
    return max(c for c in range(1, target + 1) if n2 % c == 0)


def sparse_attention(q, k, v, attn_mask=None, scale=None, is_causal=False, head_num=1, input_layout="BNSD",
                     inner_precise=0, sparse_type=None, txt_len=0, block_size=128, latent_shape_q=None,
                     latent_shape_k=None, keep_sink=True, keep_recent=True, cdf_threshold=1.0, sparsity=0.0,
                     precision="auto", **extras: Any):
    """Attention over (q, k, v), dense or RainFusion 2.0 block-sparse.

    Args:
        q, k, v: "BNSD" (B, N, S, D), "BSND" (B, S, N, D) or "BSH" (B, S, N * D) per
            ``input_layout``; k/v may have fewer heads (GQA) and, with ``latent_shape_k``, another
            length. float32/float16/bfloat16 on the sparse path.
        attn_mask, is_causal: dense path only (passed to PyTorch SDPA).
        scale: softmax scale, None = head_dim ** -0.5.
        head_num: query heads; must match the tensors.
        inner_precise: 0 = fp32 softmax, 1 = fp16 softmax (Ascend only; CPU/CUDA always fp32).
        sparse_type: None = dense attention (``lite_boost.ops.attention``), "rf_v2" = block-sparse.
        txt_len: text tokens at the start of q and k (kept dense, moved behind the video).
        block_size: tokens per block (query and key).
        latent_shape_q, latent_shape_k: (t, h, w) video grids of q and k (product = sequence
            length minus ``txt_len``). ``latent_shape_k`` None = same as q.
        keep_sink: force first-frame blocks on in both directions (grids with t > 1).
        keep_recent: force each query block's diagonal KV block.
        cdf_threshold: in (0, 1]; below 1 a row keeps fewer blocks once they hold this fraction
            of its estimated attention mass (never more than the sparsity budget).
        sparsity: in [0, 1): each query block keeps the top ``ceil((1 - sparsity) * kv_blocks)``
            KV blocks by score, plus the forced blocks (``budget`` says whether on top or within).
        precision: "auto" (the input dtype) or "int8" (int8 Q K^T after smoothing K, fp32 softmax,
            16-bit P V; see :mod:`lite_boost.ops.precision`), on the sparse kernel and on the dense
            paths (where dense attention at "int8" is the same kernel with every block selected);
            not with ``attn_mask`` / ``is_causal``. The block selection does not depend on it.
        **extras: ``window`` ((wt, wh, ww) with volume block_size, None = reference 8x8 order,
            "raster"); ``min_seq_len`` (dense below this query length, default 0);
            ``selection`` (a BlockSelection to reuse); ``return_stats`` (also return a
            SparseStats); ``backend`` (rain_fusion backend); ``head_chunk`` (KV heads per group);
            ``budget`` ("reference" = forced blocks on top of the top-k, default; "total" = forced
            blocks count toward it); ``selector`` ("subblock" = estimated attention mass,
            default; "reference" = RainFusion 2.0 mean-pooled scores); ``selector_reps``
            ((q_reps, k_reps) representatives per query / key block for "subblock", each in
            [1, block_size], default (32, 8) capped at block_size); ``ring`` (Ring attention, below).

    Ring attention (``ring=`` the :class:`lite_boost.parallel.ring.RingAttention` of the call, or any
    object with its ``size``, ``rank``, ``seq_len``, ``relay``, ``attention``, ``all_gather`` and
    ``exchange_rows``): q, k, v are this rank's chunk of ``L`` rows of a self-attention over the
    ``ring.seq_len`` tokens that ``latent_shape_q`` describes (chunk ``i`` = rows ``[i L, (i + 1) L)``,
    the real ones first). The block selection is exactly the one-process selection: the chunks are
    first exchanged into the reordered token order, cut at block boundaries (rank ``i`` then holds
    reordered blocks ``[i m, (i + 1) m)``, ``m = ceil(blocks / size)``); the key blocks are gathered once
    for scoring (skipped when ``selection=`` is reused); each rank selects for its own query blocks;
    the selection is split per K/V chunk and the ring runs the kernel (with its log-sum-exp) chunk by
    chunk, skipping chunks none of this rank's rows selects (still relayed); the merged output goes
    back to the original rows. The dense fallbacks run as dense Ring attention. Backends: those that
    return the log-sum-exp ("cpp", "gather", "reference", "flex" on CUDA).

    Returns:
        The attention output in the input layout and dtype, or ``(out, SparseStats)`` with
        ``return_stats=True``.
    """
    unknown = sorted(set(extras) - set(_EXTRAS))
    if unknown:
        raise TypeError(f"sparse_attention got unexpected keyword argument(s) {unknown}; accepted extras: {list(_EXTRAS)}")
    if not isinstance(input_layout, str) or input_layout.upper() not in INPUT_LAYOUTS:
        raise ValueError(f"input_layout must be one of {list(INPUT_LAYOUTS)}, got {input_layout!r}")
    layout = input_layout.upper()
    if sparse_type not in SPARSE_TYPES:
        raise ValueError(f"sparse_type must be one of {list(SPARSE_TYPES)}, got {sparse_type!r}")
    q4, k4, v4, back = _to_bnsd(q, k, v, layout, head_num)
    ring = extras.get("ring")
    if ring is not None:
        if q4.shape[2] != k4.shape[2] or latent_shape_k is not None:
            raise ValueError("sparse_attention(ring=...) is self-attention over one sequence: q, k, v must be chunks "
                             f"of one length (got {q4.shape[2]}, {k4.shape[2]}) and latent_shape_k None")
        if attn_mask is not None or is_causal:
            raise ValueError("sparse_attention(ring=...) supports neither attn_mask nor is_causal")
        if not _is_int(ring.seq_len) or not 0 < ring.seq_len <= q4.shape[2] * ring.size:
            raise ValueError(f"ring.seq_len={ring.seq_len!r} does not fit {ring.size} chunks of {q4.shape[2]} rows")
    if scale is not None:
        scale = _check_float("scale", scale, 0.0, math.inf, lo_open=True, hi_open=True)
    if inner_precise not in (0, 1) or isinstance(inner_precise, bool):
        raise ValueError(f"inner_precise must be 0 (fp32 softmax) or 1 (fp16 softmax), got {inner_precise!r}")
    sparsity = _check_float("sparsity", sparsity, 0.0, 1.0, hi_open=True)
    return_stats = extras.get("return_stats", False)
    if not isinstance(return_stats, bool):
        raise TypeError(f"return_stats must be True or False, got {return_stats!r}")
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be True or False, got {is_causal!r}")
    precision = check_precision(precision)
    if precision != "auto" and (attn_mask is not None or is_causal):
        raise ValueError(f"precision={precision!r} supports neither attn_mask nor is_causal; pass precision='auto'")

    def finish(out4, stats):
        out = back(out4)
        return (out, stats) if return_stats else out

    if ring is not None:
        def dense(*_):  # dense Ring attention of the chunk (exact, merged through the log-sum-exp)
            from .attention import attention

            kernel = lambda a, b_, c_: attention(a, b_, c_, layout="BSND", scale=scale, return_lse=True,  # noqa: E731
                                                 precision=precision)
            return ring.attention(kernel, q4.transpose(1, 2), k4.transpose(1, 2), v4.transpose(1, 2)).transpose(1, 2)
    else:
        def dense(*args):
            return _dense(*args, precision=precision)
    if sparse_type is None:
        if extras.get("selection") is not None:
            raise ValueError("selection= is only meaningful with sparse_type='rf_v2'")
        return finish(dense(q4, k4, v4, scale, attn_mask, is_causal),
                      SparseStats("dense", "sparse_type=None", None, sparsity, 0.0))

    # ---- rf_v2: validate everything before any work ----
    if attn_mask is not None or is_causal:
        raise ValueError("sparse_type='rf_v2' supports neither attn_mask nor is_causal (full bidirectional attention)")
    if q4.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"sparse_type='rf_v2' needs float32, float16 or bfloat16 inputs, got {q4.dtype}")
    if not _is_int(block_size) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    sq, skv = (q4.shape[2], k4.shape[2]) if ring is None else (ring.seq_len, ring.seq_len)
    if not _is_int(txt_len) or not (0 <= txt_len <= min(sq, skv)):
        raise ValueError(f"txt_len must be an int in [0, {min(sq, skv)}] (text tokens at the start of q and k), got {txt_len!r}")
    lq = _check_shape3("latent_shape_q", latent_shape_q)
    lk = _check_shape3("latent_shape_k", latent_shape_k)
    if lq is None:
        raise ValueError("latent_shape_q (t, h, w) is required for sparse_type='rf_v2'")
    if math.prod(lq) != sq - txt_len:
        raise ValueError(f"latent_shape_q {lq} has {math.prod(lq)} tokens but q has {sq} - txt_len {txt_len} = {sq - txt_len} video tokens")
    if lk is None:
        if skv != sq:
            raise ValueError(f"latent_shape_k is required when k's length ({skv}) differs from q's ({sq})")
        lk = lq
    if math.prod(lk) != skv - txt_len:
        raise ValueError(f"latent_shape_k {lk} has {math.prod(lk)} tokens but k has {skv} - txt_len {txt_len} = {skv - txt_len} video tokens")
    for name, val in (("keep_sink", keep_sink), ("keep_recent", keep_recent)):
        if not isinstance(val, bool):
            raise TypeError(f"{name} must be True or False, got {val!r}")
    cdf_threshold = _check_float("cdf_threshold", cdf_threshold, 0.0, 1.0, lo_open=True)
    window = extras.get("window")
    if window is not None and window != "raster":
        w = _check_shape3("window", window)
        if math.prod(w) != block_size:
            raise ValueError(f"window volume must equal block_size={block_size}, got {w} (volume {math.prod(w)}); "
                             "or pass None (reference 8x8 order) or 'raster'")
        window = w
    budget = extras.get("budget", "reference")
    if not isinstance(budget, str) or budget not in BUDGETS:
        raise ValueError(f"budget must be one of {list(BUDGETS)} ('reference': forced blocks on top of the "
                         f"top-k, 'total': forced blocks count toward it), got {budget!r}")
    selector = extras.get("selector", "subblock")
    if not isinstance(selector, str) or selector not in SELECTORS:
        raise ValueError(f"selector must be one of {list(SELECTORS)}, got {selector!r}")
    reps = extras.get("selector_reps")
    if reps is None:  # the default, capped by the block size
        reps = tuple(min(r, block_size) for r in DEFAULT_SELECTOR_REPS)
    if (not isinstance(reps, (tuple, list)) or len(reps) != 2
            or not all(_is_int(r) and 1 <= r <= block_size for r in reps)):
        raise ValueError(f"selector_reps must be two ints (q_reps, k_reps) in [1, block_size={block_size}], "
                         f"got {reps!r}")
    min_seq_len = extras.get("min_seq_len", 0)
    if not _is_int(min_seq_len) or min_seq_len < 0:
        raise ValueError(f"min_seq_len must be a non-negative int, got {min_seq_len!r}")
    n1, n2 = q4.shape[1], k4.shape[1]
    chunk = extras.get("head_chunk")
    if chunk is not None and (not _is_int(chunk) or chunk < 1 or n2 % chunk):
        raise ValueError(f"head_chunk must be a positive divisor of the key/value heads ({n2}), got {chunk!r}")
    backend = extras.get("backend")
    if backend is not None:
        _rf._check_backend_name(backend, "backend")
    b = q4.shape[0]
    nqb, nkb = math.ceil(sq / block_size), math.ceil(skv / block_size)
    signature = (b, n1, n2, sq, skv, block_size, lq, lk, window, txt_len)
    if ring is not None:  # the one-process signature, then where this rank's rows are
        signature = signature + (("ring", ring.size, ring.rank, q4.shape[2]),)
    selection = extras.get("selection")
    if selection is not None:
        if not isinstance(selection, BlockSelection):
            raise TypeError(f"selection must be a BlockSelection (from SparseStats.selection), got {type(selection).__name__}")
        if selection.signature != signature:
            raise ValueError(
                "selection was computed for another call shape: (batch, heads, kv heads, q len, kv len, block_size, "
                f"latent_shape_q, latent_shape_k, window, txt_len) = {selection.signature}, this call has {signature}"
            )
    keep = max(1, math.ceil((1.0 - sparsity) * nkb))
    if sq < min_seq_len or (keep >= nkb and selection is None):
        reason = f"seq_len {sq} < min_seq_len {min_seq_len}" if sq < min_seq_len else "sparsity keeps every block"
        return finish(dense(q4, k4, v4, scale, None, False), SparseStats("dense", reason, None, sparsity, 0.0, nqb, nkb))
    # backend choice is validated now, before the work starts
    be = _rf.select_sparse_backend(q4, k4, block_shape=(block_size, block_size), inner_precise=inner_precise,
                                   backend=backend, return_lse=ring is not None, precision=precision)
    scale_v = scale if scale is not None else q4.shape[-1] ** -0.5

    # ---- reorder, select, run ----
    dev = q4.device
    oq = token_order(lq, window, txt_len)
    ok = oq if (lk == lq and skv == sq) else token_order(lk, window, txt_len)
    perm_q, perm_k = oq.perm.to(dev), ok.perm.to(dev)
    inv_q = oq.inv.to(dev)
    forced_q = forced_blocks(oq.is_text | (oq.is_sink if keep_sink else torch.zeros_like(oq.is_sink)), block_size).to(dev)
    forced_kv = forced_blocks(ok.is_text | (ok.is_sink if keep_sink else torch.zeros_like(ok.is_sink)), block_size).to(dev)
    diagonal = (torch.arange(nqb, device=dev) * nkb // nqb) if keep_recent else None
    q_tok = torch.full((nqb,), block_size, device=dev)
    q_tok[-1] = sq - (nqb - 1) * block_size
    kv_tok = torch.full((nkb,), block_size, device=dev)
    kv_tok[-1] = skv - (nkb - 1) * block_size

    g = n1 // n2
    c = _head_chunk(n2, chunk)
    if ring is not None:
        select = _Selector(block_size, scale_v, selector, reps, keep, forced_q, forced_kv, diagonal, cdf_threshold,
                           q_tok, kv_tok, budget, g, c)
        out4, selection_out, pairs, rows = _ring_rf_v2(q4, k4, v4, ring, (lq, window, txt_len), select, selection,
                                                       signature, be, inner_precise, precision)
        effective = 1.0 - pairs / (b * n1 * rows * skv) if rows else 0.0
        stats = SparseStats("sparse", "rf_v2", be, sparsity, effective, nqb, nkb, selection_out, selection is not None,
                            selector, budget)
        return finish(out4, stats)
    out4 = torch.empty(q4.shape[:-1] + v4.shape[-1:], dtype=q4.dtype, device=dev)
    # inference: the reordered copies go into buffers reused by every head group, one 2-D row gather per
    # (batch, head) slice (~2.5x a fresh index_select along axis 2); with autograd, differentiable copies
    grad = torch.is_grad_enabled() and (q4.requires_grad or k4.requires_grad or v4.requires_grad)
    bufs = None if grad else tuple(
        torch.empty((b, h, s_, t.shape[-1]), dtype=t.dtype, device=dev) for h, s_, t in
        ((c * g, sq, q4), (c, skv, k4), (c, skv, v4)))
    idx_parts, num_parts, pairs = [], [], 0.0
    for h0 in range(0, n2, c):
        hq, hk = slice(h0 * g, (h0 + c) * g), slice(h0, h0 + c)
        qc = _reorder(q4[:, hq], perm_q, None if grad else bufs[0])
        kc = _reorder(k4[:, hk], perm_k, None if grad else bufs[1])
        if selection is None:  # scored before v is copied: the scoring buffers never meet the kernel's
            score, probs = block_scores(qc, kc, block_size, scale_v, selector, reps[0], reps[1])
            si, sn, pr = select_blocks(score, probs, keep, forced_q, forced_kv, diagonal, cdf_threshold, q_tok,
                                       kv_tok, budget)
            del score, probs
            idx_parts.append(si)
            num_parts.append(sn)
            pairs += pr
        else:
            si, sn = selection.select_idx[:, hq], selection.select_num[:, hq]
        vc = _reorder(v4[:, hk], perm_k, None if grad else bufs[2])
        problem = _rf._Problem("BNSD", "BNSD", (sq,) * b, (skv,) * b, c * g, c, (block_size, block_size), scale_v,
                               inner_precise, precision)
        oc, _, be = _rf._dispatch(qc, kc, vc, si, sn, problem, False, backend)
        del qc, kc, vc
        if grad:
            out4[:, hq].index_copy_(2, perm_q, oc)
        else:  # a gather by the inverse order straight into place (~3x index_copy_)
            _reorder(oc, inv_q, out4[:, hq])
        del oc
    del bufs
    if selection is None:
        m = max(p.shape[-1] for p in idx_parts)
        select_idx = torch.cat([F.pad(p, (0, m - p.shape[-1]), value=-1) for p in idx_parts], dim=1)
        selection_out = BlockSelection(select_idx, torch.cat(num_parts, dim=1), signature)
        effective = 1.0 - pairs / (b * n1 * sq * skv)
    else:
        selection_out = selection
        si = selection.select_idx.view(b, nqb, n1, -1)
        valid = torch.arange(si.shape[-1], device=dev) < selection.select_num.view(b, nqb, n1, 1)
        kv_sel = torch.where(valid, kv_tok[si.clamp_min(0)], torch.zeros_like(si, dtype=kv_tok.dtype)).sum(-1)
        pairs = float((kv_sel.to(torch.float32) * q_tok.view(1, nqb, 1)).sum())
        effective = 1.0 - pairs / (b * n1 * sq * skv)
    stats = SparseStats("sparse", "rf_v2", be, sparsity, effective, nqb, nkb, selection_out, selection is not None,
                        selector, budget)
    return finish(out4, stats)


# --------------------------------------------------------------------------------------------- #
# Ring attention (sparse_attention(..., ring=...))                                               #
# --------------------------------------------------------------------------------------------- #


@dataclass(frozen=True)
class _Selector:
    """The selection parameters of one call (global, identical on every rank)."""

    block: int
    scale: float
    selector: str
    reps: tuple
    keep: int
    forced_q: torch.Tensor
    forced_kv: torch.Tensor
    diagonal: torch.Tensor | None
    cdf_threshold: float
    q_tok: torch.Tensor
    kv_tok: torch.Tensor
    budget: str
    group: int  # query heads per KV head
    head_chunk: int  # KV heads scored at once (as the one-process path does)

    def rows(self, qp: torch.Tensor, k_full: torch.Tensor, row0: int):
        """Selection of query blocks ``row0 ..`` (reordered q rows ``qp`` (B, N1, n, D), block-aligned)
        over every key block (``k_full`` (B, N2, S, D), reordered). Returns (idx, num, kept pairs)."""
        nrows = -(-qp.shape[2] // self.block)
        rows = slice(row0, row0 + nrows)
        diag = None if self.diagonal is None else self.diagonal[rows]
        idx_parts, num_parts, pairs = [], [], 0.0
        n2, c, g = k_full.shape[1], self.head_chunk, self.group
        for h0 in range(0, n2, c):
            qc, kc = qp[:, h0 * g:(h0 + c) * g], k_full[:, h0:h0 + c]
            score, probs = block_scores(qc, kc, self.block, self.scale, self.selector, self.reps[0], self.reps[1])
            si, sn, pr = select_blocks(score, probs, self.keep, self.forced_q[rows], self.forced_kv, diag,
                                       self.cdf_threshold, self.q_tok[rows], self.kv_tok, self.budget)
            idx_parts.append(si)
            num_parts.append(sn)
            pairs += pr
        m = max(p.shape[-1] for p in idx_parts)
        idx = torch.cat([F.pad(p, (0, m - p.shape[-1]), value=-1) for p in idx_parts], dim=1)
        return idx, torch.cat(num_parts, dim=1), pairs


@functools.lru_cache(maxsize=32)
def _ring_routes(order: tuple, seq_len: int, chunk: int, pchunk: int, size: int, rank: int):
    """Row routes between the original chunks (``chunk`` rows per rank) and the reordered ones
    (``pchunk`` rows per rank, block aligned). Returns (send_idx, send_counts, recv_pos, recv_counts):
    this rank sends its local rows ``send_idx`` (grouped by destination, ``send_counts`` each, in
    reordered position order) and places the rows it receives at its reordered positions
    ``recv_pos`` (grouped by source, ``recv_counts`` each). The way back swaps the two.
    ``order``: the (latent shape, window, txt_len) of the token order."""
    perm = token_order(*order).perm
    pos = torch.arange(seq_len)
    src = perm // chunk  # owner (original order) of the token at each reordered position
    dst = pos // pchunk  # owner (reordered order)
    mine = torch.nonzero(src == rank).flatten()  # reordered positions of my tokens, ascending
    send_idx = perm[mine] - rank * chunk
    send_counts = torch.bincount(dst[mine], minlength=size).tolist()
    here = torch.nonzero(dst == rank).flatten()  # my reordered positions, ascending
    order = torch.sort(src[here], stable=True).indices  # grouped by source, each group ascending
    recv_pos = here[order] - rank * pchunk
    recv_counts = torch.bincount(src[here], minlength=size).tolist()
    return send_idx, send_counts, recv_pos, recv_counts


def _split_selection(idx: torch.Tensor, num: torch.Tensor, lo: int, hi: int):
    """The part of a selection inside key blocks [lo, hi), renumbered from 0: (idx, num)."""
    valid = torch.arange(idx.shape[-1], device=idx.device) < num[..., None]
    inside = valid & (idx >= lo) & (idx < hi)
    n = inside.sum(-1)
    m = int(n.max()) if n.numel() else 0
    big = hi - lo
    local = torch.sort(torch.where(inside, idx - lo, torch.full_like(idx, big)), dim=-1).values[..., :m]
    return torch.where(local >= big, torch.full_like(local, -1), local), n.to(torch.int64)


def _ring_rf_v2(q4, k4, v4, ring, order, select: _Selector, selection, signature, backend, inner_precise,
                precision="auto"):
    """Block-sparse Ring attention of this rank's chunk (see ``sparse_attention``'s ``ring``).

    Returns (out (B, N1, L, D) BNSD with zero padded rows, BlockSelection of this rank's rows, kept
    token pairs, reordered query rows of this rank)."""
    b, n1, chunk, d = q4.shape
    n2, dv = k4.shape[1], v4.shape[-1]
    size, rank, seq_len, block = ring.size, ring.rank, ring.seq_len, select.block
    nb = -(-seq_len // block)
    pchunk = -(-nb // size) * block  # reordered rows per rank: whole blocks
    per = pchunk // block
    prow = max(0, min(pchunk, seq_len - rank * pchunk))  # my real reordered rows
    if n1 != n2 or d != dv:
        raise ValueError(f"sparse_attention(ring=...) needs as many KV heads as query heads ({n1} vs {n2}) and one "
                         f"head dim for q, k and v ({d} vs {dv})")
    send_idx, send_counts, recv_pos, recv_counts = _ring_routes(order, seq_len, chunk, pchunk, size, rank)
    dev = q4.device
    send_idx, recv_pos = send_idx.to(dev), recv_pos.to(dev)
    # -- original chunks -> reordered chunks (one all_to_all of q, k, v rows)
    qkv = torch.stack([q4, k4, v4])
    rows = qkv.index_select(3, send_idx).permute(3, 0, 1, 2, 4).contiguous()  # (n, 3, B, N, D)
    got = ring.exchange_rows(rows, send_counts, recv_counts, op="ring_sparse_order")
    buf = qkv.new_zeros((3, b, n1, pchunk, d))
    buf.index_copy_(3, recv_pos, got.permute(1, 2, 3, 0, 4))
    qp = buf[0, :, :, :prow].contiguous()
    kv = (buf[1], buf[2])
    # -- selection for my query blocks (the key blocks gathered once for scoring, unless reused)
    if selection is not None:
        idx, num, pairs = selection.select_idx, selection.select_num, None
    else:
        keys = ring.all_gather(kv[0], op="ring_sparse_keys")  # (r, B, N, pchunk, D)
        k_full = torch.cat([keys[j, :, :, :max(0, min(pchunk, seq_len - j * pchunk))] for j in range(size)], dim=2)
        del keys
        if prow:
            idx, num, pairs = select.rows(qp, k_full, rank * per)
        else:
            idx = torch.empty((0, n1, 0), dtype=torch.int64, device=dev)
            num = torch.empty((0, n1), dtype=torch.int64, device=dev)
            pairs = 0.0
        del k_full
    if pairs is None:  # reused: count the kept pairs of my rows
        nrows = idx.shape[0] // b if b else 0
        valid = torch.arange(idx.shape[-1], device=dev) < num[..., None]
        kv_sel = torch.where(valid, select.kv_tok[idx.clamp_min(0)], torch.zeros_like(idx)).sum(-1)
        q_tok = select.q_tok[rank * per: rank * per + nrows].repeat(b)
        pairs = float((kv_sel.to(torch.float32) * q_tok.view(-1, 1)).sum())
    # -- the ring: chunk j of the reordered keys holds key blocks [j per, (j + 1) per)
    acc: list = []

    def step(j, chunk_kv):
        vk = max(0, min(pchunk, seq_len - j * pchunk))
        if vk == 0 or prow == 0:
            return
        si, sn = _split_selection(idx, num, j * per, (j + 1) * per)
        if not bool((sn > 0).any()):  # none of my rows selects a block of this chunk: skip (still relayed)
            return
        o, lse = _rf.rain_fusion_attention(
            qp, chunk_kv[0][:, :, :vk], chunk_kv[1][:, :, :vk], si, sn, [block, block], q_input_layout="BNSD",
            kv_input_layout="BNSD", scale_value=select.scale, inner_precise=inner_precise, return_lse=True,
            backend=backend, precision=precision)
        if not acc:
            acc.extend(start_partial(o, lse))
        else:
            merge_partial(acc[0], acc[1], o, lse)

    ring.relay(kv, step)
    outp = q4.new_zeros((b, n1, prow, dv))
    if acc:
        outp.copy_(acc[0])
    # -- reordered rows -> original rows (the exchange back)
    back_rows = outp.index_select(2, recv_pos).permute(2, 0, 1, 3).contiguous()  # (m, B, N, D)
    home = ring.exchange_rows(back_rows, recv_counts, send_counts, op="ring_sparse_order")
    out4 = q4.new_zeros((b, n1, chunk, dv))
    out4.index_copy_(2, send_idx, home.permute(1, 2, 0, 3))
    return out4, BlockSelection(idx, num, signature), pairs, prow
