"""Merging partial attention results through their log-sum-exp (the combine step of Ring attention).

Attention of a query row over a key set split into parts ``K_1 .. K_n`` is the softmax-weighted mix
of the per-part results: with ``o_i`` the attention output over ``K_i`` and ``l_i`` its natural-log
log-sum-exp (``log sum_k exp(q.k * scale)``),

    lse = log(sum_i exp(l_i)),   out = sum_i exp(l_i - lse) * o_i.

:func:`merge_partial` folds one part into a running ``(out, lse)`` pair, in fp32, with the max-based
form: ``m = max(l_acc, l_new)`` (0 when both are -inf), weights ``exp(l - m)``, a guarded
denominator. A part with no keys (an all-padding chunk, a block-sparse row that selects nothing in
this part) has ``lse = -inf`` and ``out = 0`` and leaves the running result unchanged; two empty parts
stay empty (``out = 0``, ``lse = -inf``). The sigmoid form most Ring implementations use,
``out - sigmoid(l_new - l_acc) * (out - o_new)``, gives NaN in both cases.

Layout: ``out`` is any (..., D) tensor and ``lse`` has ``out.shape[:-1]``; callers pass the lse view
that matches their output layout (e.g. ``lse.transpose(1, 2)`` of a (B, H, S) lse for a (B, S, H, D)
output). No torch.distributed here: the caller decides where the parts come from.
"""

from __future__ import annotations

import torch

__all__ = ["merge_partial", "start_partial", "merge_partials"]


def start_partial(out: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A running ``(out, lse)`` accumulator (fp32, fresh tensors) initialised with the first part."""
    if lse.shape != out.shape[:-1]:
        raise ValueError(f"lse must have out.shape[:-1] = {tuple(out.shape[:-1])}, got {tuple(lse.shape)}")
    acc = out.to(torch.float32, copy=True)
    acc_lse = lse.to(torch.float32, copy=True)
    acc.masked_fill_(torch.isneginf(acc_lse)[..., None], 0.0)  # a row without keys: out 0, whatever was written
    return acc, acc_lse


def merge_partial(acc: torch.Tensor, acc_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Fold the part ``(out, lse)`` into the fp32 accumulator ``(acc, acc_lse)`` in place (-inf safe).

    ``acc`` (..., D) and ``acc_lse`` (...) are fp32 (see :func:`start_partial`); ``out`` may have any
    float dtype and ``lse`` any layout of the same shape as ``acc_lse`` (strided views are fine).
    """
    if lse.shape != acc_lse.shape or out.shape != acc.shape:
        raise ValueError(f"part shapes out {tuple(out.shape)} / lse {tuple(lse.shape)} do not match the "
                         f"accumulator {tuple(acc.shape)} / {tuple(acc_lse.shape)}")
    lse = lse.to(torch.float32)
    m = torch.maximum(acc_lse, lse)
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)  # both empty: exp(-inf - 0) = 0, no NaN
    w_acc = torch.exp(acc_lse - m)
    w_new = torch.exp(lse - m)
    den = w_acc + w_new
    safe = torch.where(den > 0, den, torch.ones_like(den))
    acc.mul_((w_acc / safe)[..., None])
    # a part's rows without keys carry exp(-inf) = 0 weight: whatever the kernel wrote there is ignored
    part = out.to(torch.float32) * (w_new / safe)[..., None]
    acc.add_(torch.where((w_new > 0)[..., None], part, torch.zeros_like(part)))
    acc_lse.copy_(torch.where(den > 0, m + torch.log(safe), torch.full_like(m, float("-inf"))))


def merge_partials(parts) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge an iterable of ``(out, lse)`` parts in the given order; returns the fp32 ``(out, lse)``."""
    acc = None
    for out, lse in parts:
        if acc is None:
            acc = start_partial(out, lse)
        else:
            merge_partial(acc[0], acc[1], out, lse)
    if acc is None:
        raise ValueError("merge_partials needs at least one part")
    return acc
