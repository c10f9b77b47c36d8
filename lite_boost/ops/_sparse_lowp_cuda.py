"""Block-sparse attention at int8 precision on CUDA: SpargeAttn, else FlexAttention on int8-quantized Q / K.

Two kernels for the ``rain_fusion_attention`` contract (a per-head list of selected KV blocks for each
query block); both take one batch segment as the other block-sparse kernels do:
``kernel(q (N1, Lq, D), k (N2, Lk, D), v, select_idx (nqb, N1, M), select_num (nqb, N1), block_shape,
scale, need_lse) -> (out (N1, Lq, D), lse or None)``.

* ``sparge``: SpargeAttn's ``spas_sage_attn.block_sparse_sage2_attn_cuda(q, k, v, mask_id=...,
  scale=..., smooth_k=True, tensor_layout="HND")``: sparse and SageAttention-quantized in one kernel
  (int8 Q / K with K smoothed by its mean, 16-bit or FP8 P V; the package chooses by GPU). Its mask
  has one 0/1 entry per head and block of 128 query x 64 key tokens (64 x 128 on sm90), so each of
  our selected blocks is spread over the package's blocks: ``block_shape`` must be a multiple of its
  block in each axis (128 x 128, our default, is on every GPU). Documented limits handled here: the
  query must have >= 128 rows (shorter ones are padded with zero rows, whose outputs are dropped),
  head_dim 64 or 128 (smaller ones are zero-padded with the scale passed explicitly; above 128
  refused); float32 inputs run in bfloat16; GQA runs with the KV heads repeated (the package's mask
  is per query head). No log-sum-exp (Ring attention cannot use it). Rows that select nothing are
  set to 0, as the contract says (the package leaves them unspecified).
* ``flex_int8``: where SpargeAttn is absent, compiled FlexAttention on the same block mask with Q and
  K quantized to int8 (symmetric, per head and block of ``block_shape`` tokens, K smoothed by its
  mean first) and dequantized (fake quantization): the numerics of int8 Q K^T with a 16-bit P V,
  not its speed. Returns the log-sum-exp where FlexAttention does (CUDA). Block multiples of 128
  on CUDA, as for ``flex``.

Both are inference only.
"""

from __future__ import annotations

import torch

from ._flex import FLEX
from ._lowp import fake_quant_int8_blocks, kernel_dtype
from ._optional import cuda_capability, import_optional, module_or_none

__all__ = ["sparge_blocks", "sparge_reason", "sparge_kernel", "flex_int8_reason", "flex_int8_kernel", "block_map"]

SPARGE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def sparge_blocks(device=None) -> tuple[int, int]:
    """SpargeAttn's mask block (query tokens, key tokens): 64 x 128 on sm90, 128 x 64 elsewhere."""
    return (64, 128) if cuda_capability(device) == (9, 0) else (128, 64)


def sparge_reason(device_type: str, dtype: torch.dtype, block_shape, need_lse: bool = False,
                  needs_grad: bool = False, head_dim: int | None = None) -> str | None:
    """Why ``sparge_kernel`` cannot run such a call, or None."""
    if device_type != "cuda":
        return f"wrong device: needs cuda, got {device_type}"
    if dtype not in SPARGE_DTYPES:
        return f"unsupported dtype {str(dtype).replace('torch.', '')}: accepts float16, bfloat16, float32"
    if need_lse:
        return "SpargeAttn's block_sparse_sage2_attn_cuda returns no log-sum-exp (needed by Ring attention)"
    if needs_grad:
        return "SpargeAttn is used for inference only (inputs require grad)"
    if head_dim is not None and head_dim > 128:
        return f"unsupported head dim {head_dim}: SpargeAttn takes 64 or 128 (smaller ones are padded)"
    mod = import_optional("spas_sage_attn")
    if isinstance(mod, str):
        return mod
    if not hasattr(mod, "block_sparse_sage2_attn_cuda"):
        return "spas_sage_attn has no block_sparse_sage2_attn_cuda (needs a SpargeAttn release with it)"
    cap = cuda_capability()
    if cap is None:
        return "CUDA is not available"
    if cap < (8, 0):
        return f"SpargeAttn needs compute capability >= 8.0, found sm{cap[0]}{cap[1]}"
    bq, bk = sparge_blocks()
    if block_shape[0] % bq or block_shape[1] % bk:
        return (f"block_shape {list(block_shape)} is not a multiple of SpargeAttn's {bq} x {bk} mask blocks on "
                f"this GPU (use multiples of 128)")
    return None


def block_map(select_idx: torch.Tensor, select_num: torch.Tensor, n_kv_blocks: int) -> torch.Tensor:
    """(nqb, N1, M) indices + (nqb, N1) counts -> bool (N1, nqb, n_kv_blocks): selected blocks."""
    nqb, n1, m = select_idx.shape
    valid = torch.arange(m, device=select_idx.device) < select_num[..., None].long()
    idx = torch.where(valid, select_idx.long(), torch.full_like(select_idx, n_kv_blocks, dtype=torch.long))
    out = torch.zeros(nqb, n1, n_kv_blocks + 1, dtype=torch.bool, device=select_idx.device)
    out.scatter_(2, idx, True)
    return out[..., :n_kv_blocks].permute(1, 0, 2)


def _nothing_to_compute(q, k, v, select_idx, need_lse):
    """Zeros (and -inf log-sum-exp) for a segment without queries, keys or selected blocks, else None."""
    if q.shape[1] and k.shape[1] and select_idx.shape[-1]:
        return None
    out = torch.zeros(q.shape[:-1] + v.shape[-1:], dtype=q.dtype, device=q.device)
    return out, (torch.full(q.shape[:-1], float("-inf"), device=q.device) if need_lse else None)


def _pad_last(x: torch.Tensor, size: int) -> torch.Tensor:
    return x if x.shape[-1] == size else torch.nn.functional.pad(x, (0, size - x.shape[-1]))


def sparge_kernel(q, k, v, select_idx, select_num, block_shape, scale, need_lse=False):
    """One batch segment through SpargeAttn (see the module docstring)."""
    if need_lse:
        raise ValueError("sparge_kernel cannot return the log-sum-exp")
    empty = _nothing_to_compute(q, k, v, select_idx, False)
    if empty is not None:
        return empty
    fn = module_or_none("spas_sage_attn").block_sparse_sage2_attn_cuda
    n1, lq, d = q.shape
    lk = k.shape[1]
    if d > 128:
        raise ValueError(f"SpargeAttn takes head_dim 64 or 128 (smaller ones padded), got {d}")
    bq, bk = block_shape
    sq_blk, sk_blk = sparge_blocks(q.device)
    dt = q.dtype
    kd = kernel_dtype(dt)
    dpad = 64 if d <= 64 else 128
    rows = max(lq, 128)  # the package needs at least 128 query rows; extra zero rows are dropped
    g = n1 // k.shape[0]
    qh = torch.nn.functional.pad(_pad_last(q.to(kd), dpad), (0, 0, 0, rows - lq))[None]
    kh = _pad_last(k.to(kd), dpad).repeat_interleave(g, dim=0)[None]
    vh = _pad_last(v.to(kd), dpad).repeat_interleave(g, dim=0)[None]
    sel = block_map(select_idx, select_num, -(-lk // bk))  # (N1, nqb, nkb) at our granularity
    qi = (torch.arange(-(-rows // sq_blk), device=q.device) * sq_blk // bq).clamp_max(sel.shape[1] - 1)
    ki = torch.arange(-(-lk // sk_blk), device=q.device) * sk_blk // bk
    mask = sel[:, qi][:, :, ki][None].contiguous()  # (1, N1, rows / sq_blk, lk / sk_blk)
    out = fn(qh, kh, vh, mask_id=mask, scale=scale, smooth_k=True, tensor_layout="HND")
    out = out[0, :, :lq, :d]
    empty = (select_num.t() == 0).repeat_interleave(bq, dim=1)[:, :lq]  # (N1, Lq): rows selecting nothing
    return torch.where(empty[..., None], torch.zeros((), dtype=out.dtype, device=out.device), out).to(dt), None


def flex_int8_reason(device_type: str, dtype: torch.dtype, block_shape, need_lse: bool = False,
                     needs_grad: bool = False) -> str | None:
    """Why ``flex_int8_kernel`` cannot run such a call, or None."""
    if device_type != "cuda":
        return f"wrong device: needs cuda, got {device_type} (the CPU int8 path is the C++ kernel)"
    if dtype not in SPARGE_DTYPES:
        return f"unsupported dtype {str(dtype).replace('torch.', '')}: accepts float16, bfloat16, float32"
    if needs_grad:
        return "compiled FlexAttention is used for inference only (inputs require grad)"
    if any(x % 128 for x in block_shape):
        return f"block_shape {list(block_shape)} not accepted: FlexAttention on CUDA needs multiples of 128"
    return FLEX.probe(device_type)


def flex_int8_kernel(q, k, v, select_idx, select_num, block_shape, scale, need_lse=False):
    """One batch segment: int8 fake-quantized Q / K (K smoothed) through compiled FlexAttention."""
    empty = _nothing_to_compute(q, k, v, select_idx, need_lse)
    if empty is not None:
        return empty
    km = k.float().mean(dim=1, keepdim=True)
    qd = fake_quant_int8_blocks(q, block_shape[0])
    # smoothing moves every logit of a row by q . mean(k): adding the mean back after quantization keeps
    # the logits (and the log-sum-exp) those of the original K, with the smoothed K's quantization error
    kd = (fake_quant_int8_blocks((k.float() - km).to(k.dtype), block_shape[1]).float() + km).to(k.dtype)
    o, lse = FLEX(qd[None], kd[None], v[None], select_idx.permute(1, 0, 2)[None], select_num.t()[None],
                  block_shape, scale, need_lse)
    return o[0], (lse[0] if need_lse else None)
