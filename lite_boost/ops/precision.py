"""Low-precision attention: which ``precision`` a device can run, and the CPU implementation.

``precision`` (the keyword of :func:`lite_boost.ops.attention`, :func:`lite_boost.ops.sparse_attention`
and :func:`lite_boost.ops.rain_fusion_attention`, and ``BoostConfig(attention={"precision": ...})``):

* ``"auto"``: the input dtype's own arithmetic (the default, unchanged behaviour);
* ``"int8"``: Q K^T on int8 dot products after K is smoothed by its mean over the tokens (which
  shifts every score of a query row by the same amount, so the softmax is unchanged; the
  log-sum-exp gets the shift back), the softmax in fp32, P V in 16 bits (SageAttention's recipe);
* ``"fp8"``: FP8 attention where the device has it.

On the CPU, ``"int8"`` runs inside the C++ kernel of ``torch.ops.lite_boost.rain_fusion_attention``
(oneDNN's u8 x s8 brgemm on AVX512-VNNI / AVX-VNNI / AMX-INT8, P V on the bf16 brgemm where the CPU
has AVX512-BF16 / AMX-BF16, fp32 elsewhere): per-row query scales, per-KV-block key scales made once
per call. Dense int8 attention is the same kernel with every block selected (:func:`cpu_attention`).
``"fp8"`` has no CPU kernel.
"""

from __future__ import annotations

import functools
import math

import torch

from ..config import ATTENTION_PRECISIONS
from ._lowp import PRECISIONS, check_precision

__all__ = ["PRECISIONS", "DENSE_BLOCK", "check_precision", "cpu_precision_reason", "cpu_int8_reason",
           "cpu_int8_dot_reason", "cpu_attention"]

assert PRECISIONS == ATTENTION_PRECISIONS
DENSE_BLOCK = 128  # query / key block of dense int8 attention on the CPU kernel (all blocks selected)
_INT8_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")
_INT8_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@functools.lru_cache(maxsize=1)
def _cpu_flags() -> frozenset:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_int8_dot_reason() -> str | None:
    """None when this CPU has int8 dot-product instructions (VNNI or AMX), else why int8 GEMMs are slow here."""
    if not _cpu_flags() & set(_INT8_FLAGS):
        return f"the CPU has no int8 dot-product instructions (none of {list(_INT8_FLAGS)} in /proc/cpuinfo)"
    return None


def cpu_int8_reason() -> str | None:
    """None when the CPU kernel's int8 mode can run here, else why not."""
    from . import _ext

    why = _ext.cpu_kernel_reason("rain_fusion_attention")
    if why is not None:
        return why
    if not torch.backends.mkldnn.is_available():
        return "PyTorch was built without oneDNN (mkldnn), whose brgemm runs the int8 GEMMs"
    return cpu_int8_dot_reason()


def cpu_precision_reason(precision: str) -> str | None:
    """None when the CPU kernels run attention at ``precision``, else why not."""
    precision = check_precision(precision)
    if precision == "auto":
        return None
    if precision == "fp8":
        return "the CPU kernels have no FP8 attention (no FP8 dot products on this path); use 'int8' or 'auto'"
    return cpu_int8_reason()


def _all_blocks(batch: int, heads: int, sq: int, skv: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    nqb, nkb = math.ceil(sq / DENSE_BLOCK), math.ceil(skv / DENSE_BLOCK)
    idx = torch.arange(nkb, device=device).expand(batch * nqb, heads, nkb)
    num = torch.full((batch * nqb, heads), nkb, dtype=torch.int64, device=device)
    return idx, num


def cpu_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: str, scale: float | None,
                  return_lse: bool, precision: str):
    """Dense attention on the CPU kernel at ``precision`` ("int8"): every KV block selected.

    q, k, v are already validated rank-4 tensors in ``layout`` ("BSND" or "BNSD"); k / v may have
    fewer heads (GQA). Returns ``out`` in the input layout, or ``(out, lse (B, N, S) fp32)``.
    """
    if precision == "fp8":
        raise ValueError("precision='fp8' cannot run on the CPU: " + cpu_precision_reason("fp8"))
    if q.dtype not in _INT8_DTYPES:
        raise TypeError(f"precision={precision!r} needs float32, float16 or bfloat16 inputs, got {q.dtype}")
    if not torch.compiler.is_compiling():
        why = cpu_int8_reason()
        if why is not None:
            raise ValueError(f"precision={precision!r} cannot run on this CPU: {why}")
    if layout == "BSND":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    b, n1, sq, _ = q.shape
    if return_lse and (sq == 0 or k.shape[2] == 0):
        raise ValueError(f"attention(return_lse=True) needs at least one query and one key, got q length {sq}, "
                         f"k length {k.shape[2]}")
    idx, num = _all_blocks(b, n1, sq, k.shape[2], q.device)
    out, lse = torch.ops.lite_boost.rain_fusion_attention(
        q, k, v, idx, num, [DENSE_BLOCK, DENSE_BLOCK], None, None, None, None, "BNSD", "BNSD", k.shape[1], 0,
        scale, 0, 0, return_lse=return_lse, precision=precision)
    if layout == "BSND":
        out = out.transpose(1, 2)
    return (out, lse) if return_lse else out
