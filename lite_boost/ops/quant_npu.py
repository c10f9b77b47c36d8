"""W8A8 linear layers on Ascend: int8 weights (per output channel) x int8 activations (per token).

Two documented torch_npu operators do the work; this module only prepares their arguments:

* ``torch_npu.npu_dynamic_quant(x, *, smooth_scales=None, group_index=None, dst_type=None)
  -> (y, scale)``: per-token symmetric dynamic quantization, ``scale = rowMax(|x|) / 127``,
  ``y = round(x / scale)`` as int8, ``scale`` float32 with ``x``'s shape minus its last dimension;
  ``x`` float16 or bfloat16, at least 2-D.
* ``torch_npu.npu_quant_matmul(x1, x2, scale, *, offset=None, pertoken_scale=None, bias=None,
  output_dtype=None) -> out``: ``out = (x1 @ x2) * scale * pertoken_scale + bias`` for a floating
  ``bias`` (an int32 ``bias`` is added before scaling); x1 (m, k) and x2 (k, n) int8, ``scale`` (n,)
  or (1,), ``pertoken_scale`` (m,) float32; the last dimensions of x1 and x2 at most 65,535. With a
  per-token scale, Atlas A2/A3 accept ``output_dtype`` bfloat16 (``scale`` float32 or bfloat16,
  ``bias`` int32 / bfloat16 / float32) or float16 (``scale`` float32, ``bias`` int32 / float32).

The weight is quantized once, symmetric per output channel (``scale = rowMax(|W|) / 127``), and kept
as (n, k) int8; ``x2`` is its transpose (a view), which the operator accepts. Nothing here imports
torch_npu at module import; the caller passes the module (tests pass an executable specification
of the two contracts, ``tests/quant_specs.py``).
"""

from __future__ import annotations

import torch

__all__ = ["W8A8_DTYPES", "MAX_K", "quantize_weight_per_channel", "w8a8_linear", "w8a8_shape_problem"]

W8A8_DTYPES = (torch.float16, torch.bfloat16)  # activations npu_dynamic_quant accepts
MAX_K = 65535  # npu_quant_matmul: last dimension of x1 and of x2


def w8a8_shape_problem(in_features: int, out_features: int) -> str | None:
    """Why a Linear of this shape cannot run on the W8A8 operators, or None."""
    if in_features > MAX_K or out_features > MAX_K:
        return f"npu_quant_matmul needs in/out features <= {MAX_K}, got {in_features} x {out_features}"
    return None


def quantize_weight_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, k) floating weight -> (int8 (n, k), float32 scale (n,)), symmetric per output channel."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / 127.0
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def w8a8_linear(torch_npu, x: torch.Tensor, weight_int8: torch.Tensor, weight_scale: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, W, bias)`` with W = ``weight_int8 * weight_scale[:, None]``, activations quantized per token."""
    if x.dtype not in W8A8_DTYPES:
        raise TypeError(f"W8A8 linear needs float16 or bfloat16 activations (npu_dynamic_quant), got {x.dtype}")
    lead = x.shape[:-1]
    x2d = x.reshape(-1, x.shape[-1])
    xq, x_scale = torch_npu.npu_dynamic_quant(x2d)
    if bias is not None:
        # bfloat16 output takes a bfloat16 bias; float16 output does not take a float16 one (float32 then)
        bias = bias.to(torch.bfloat16 if x.dtype == torch.bfloat16 else torch.float32)
    out = torch_npu.npu_quant_matmul(xq, weight_int8.t(), weight_scale.float(), pertoken_scale=x_scale.reshape(-1),
                                     bias=bias, output_dtype=x.dtype)
    return out.reshape(*lead, weight_int8.shape[0])
