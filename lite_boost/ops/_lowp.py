"""Quantization pieces shared by the low-precision attention paths (no kernels, plain PyTorch).

The recipe is SageAttention's: subtract from K its mean over the tokens (per batch and KV head;
every logit of a query row moves by the same amount, so the softmax is unchanged and only the
log-sum-exp shifts by ``scale * q . mean(k)``), then quantize Q and K symmetrically (int8 with
scale ``amax / 127``, or float8 e4m3 with scale ``amax / 448``) over blocks of tokens.
"""

from __future__ import annotations

import torch

__all__ = ["PRECISIONS", "check_precision", "smooth_k", "lse_shift", "int8_per_tensor", "fp8_per_kv_head",
           "fake_quant_int8_blocks", "KERNEL_DTYPES", "kernel_dtype"]

PRECISIONS = ("auto", "int8", "fp8")
INT8_MAX = 127.0
FP8_E4M3_MAX = 448.0
KERNEL_DTYPES = (torch.float16, torch.bfloat16)


def check_precision(value, argument: str = "precision") -> str:
    """Normalised precision name, or a ValueError naming ``argument`` and the accepted values."""
    if not isinstance(value, str) or value.lower() not in PRECISIONS:
        raise ValueError(f"{argument} must be one of {list(PRECISIONS)}, got {value!r}")
    return value.lower()


def kernel_dtype(dtype: torch.dtype) -> torch.dtype:
    """The 16-bit dtype a low-precision kernel is fed: the input's own, bfloat16 for float32 inputs."""
    return dtype if dtype in KERNEL_DTYPES else torch.bfloat16


def smooth_k(k: torch.Tensor, seq_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(k - mean_k, mean_k): the mean over the tokens (``seq_dim``), kept as a size-1 axis, in k's dtype."""
    km = k.float().mean(dim=seq_dim, keepdim=True)
    return (k.float() - km).to(k.dtype), km.to(k.dtype)


def lse_shift(q: torch.Tensor, km: torch.Tensor, scale: float) -> torch.Tensor:
    """``scale * q . mean(k)`` per query row, float32 (B, N, S), for BSND q and (B, 1, Nk, D) km.

    What smoothing removed from every logit of a row: the kernel's log-sum-exp of the smoothed
    logits plus this is the log-sum-exp of the original ones.
    """
    g = q.shape[2] // km.shape[2]
    kmq = km.float().repeat_interleave(g, dim=2)  # (B, 1, N, D)
    return torch.einsum("bsnd,bznd->bns", q.float(), kmq).mul_(scale)


def int8_per_tensor(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 tensor, float32 scale of shape (1,)): symmetric per-tensor quantization, x ~ q * scale."""
    scale = x.detach().abs().amax().float().clamp_min(torch.finfo(torch.float32).tiny) / INT8_MAX
    q = torch.round(x.float() / scale).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale.reshape(1)


def fp8_per_kv_head(x: torch.Tensor, kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """BSND ``x`` -> (float8_e4m3fn tensor, float32 descale (B, kv_heads)), x ~ x8 * descale.

    One scale per batch and KV head; the query heads of a GQA group share their KV head's scale
    (the (batch, num_heads_k) descale shape FlashAttention-3 documents).
    """
    b, s, n, d = x.shape
    g = n // kv_heads
    amax = x.detach().float().abs().reshape(b, s, kv_heads, g, d).amax(dim=(1, 3, 4))  # (B, Hk)
    descale = amax.clamp_min(torch.finfo(torch.float32).tiny) / FP8_E4M3_MAX
    per_head = descale.repeat_interleave(g, dim=1)[:, None, :, None]  # (B, 1, N, 1)
    x8 = (x.float() / per_head).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return x8, descale


def fake_quant_int8_blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """(N, L, D) ``x`` quantized to int8 per head and block of ``block`` tokens, then dequantized (x's dtype)."""
    n, length, d = x.shape
    nb = -(-length // block)
    pad = nb * block - length
    xf = torch.nn.functional.pad(x.float(), (0, 0, 0, pad)).reshape(n, nb, block, d)
    scale = xf.abs().amax(dim=(2, 3), keepdim=True).clamp_min(torch.finfo(torch.float32).tiny) / INT8_MAX
    xq = torch.round(xf / scale).clamp_(-INT8_MAX, INT8_MAX)
    return (xq * scale).reshape(n, nb * block, d)[:, :length].to(x.dtype)
