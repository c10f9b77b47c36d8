"""Executable specifications for the quantization tests.

* ``make_torch_npu_quant()``: a fake ``torch_npu`` with ``npu_dynamic_quant`` and ``npu_quant_matmul``
  implemented from their documented contracts in pure PyTorch (fp64 arithmetic), checking the
  argument rules the documentation states (dtypes, shapes, which dtype combinations are allowed).
  It lets the W8A8 path (``lite_boost.ops.quant_npu``) run on a CPU: a transposed weight, a missing
  per-token scale or a bias of a refused dtype gives an error or a wrong answer here.
* ``reference_linear(weight, bias, x, scheme)``: the reference the torchao layers are compared with,
  written from torchao's documented quantization scheme (symmetric int8, per output channel for
  weights, per token for activations, ``scale = max|x| / 127.5``, ``q = round(x * (1 / scale))``
  clamped to [-128, 127], in float32), with an fp64 matmul.
"""

import torch

from attention_specs import _module

INT8_MIN, INT8_MAX = -128, 127


def make_torch_npu_quant():
    """torch_npu.npu_dynamic_quant / npu_quant_matmul as documented (Atlas A2/A3, int8 inputs)."""
    calls = {"npu_dynamic_quant": 0, "npu_quant_matmul": 0}

    def npu_dynamic_quant(x, *, smooth_scales=None, group_index=None, dst_type=None):
        calls["npu_dynamic_quant"] += 1
        if x.dtype not in (torch.float16, torch.bfloat16):
            raise TypeError(f"npu_dynamic_quant: x must be float16 or bfloat16, got {x.dtype}")
        if x.dim() < 2:
            raise ValueError("npu_dynamic_quant: x must have more than 1 dimension")
        if group_index is not None or dst_type not in (None, torch.int8):
            raise NotImplementedError("spec covers int8 output without MoE groups")
        xf = x.double()
        if smooth_scales is not None:
            if smooth_scales.shape != (x.shape[-1],):
                raise ValueError("smooth_scales must be 1-D with x's last dimension")
            xf = xf * smooth_scales.double()
        scale = xf.abs().amax(dim=-1) / 127.0  # rowMax(|x|) / DTYPE_MAX
        y = torch.round(xf / scale.clamp_min(1e-300).unsqueeze(-1)).clamp(-128, 127).to(torch.int8)
        return y, scale.float()

    def npu_quant_matmul(x1, x2, scale, *, offset=None, pertoken_scale=None, bias=None, output_dtype=None,
                         group_sizes=None, **kwargs):
        calls["npu_quant_matmul"] += 1
        if x1.dtype != torch.int8 or x2.dtype != torch.int8:
            raise TypeError(f"npu_quant_matmul: spec covers int8 x1/x2, got {x1.dtype}, {x2.dtype}")
        if not (2 <= x1.dim() <= 6 and 2 <= x2.dim() <= 6):
            raise ValueError("npu_quant_matmul: x1 and x2 must have 2 to 6 dimensions")
        if x1.shape[-1] > 65535 or x2.shape[-1] > 65535:
            raise ValueError("npu_quant_matmul: the last dimension of x1 and of x2 must not exceed 65535")
        k, n = x2.shape[-2], x2.shape[-1]
        if x1.shape[-1] != k:
            raise ValueError(f"npu_quant_matmul: x1 (..., {x1.shape[-1]}) and x2 ({k}, {n}) do not multiply")
        if scale.dim() != 1 or scale.shape[0] not in (1, n):
            raise ValueError(f"npu_quant_matmul: scale must be 1-D of size 1 or n={n}, got {tuple(scale.shape)}")
        if pertoken_scale is not None:
            m = x1.reshape(-1, k).shape[0]
            if pertoken_scale.dtype != torch.float32 or pertoken_scale.shape != (m,):
                raise ValueError(f"npu_quant_matmul: pertoken_scale must be float32 of shape (m,)=({m},), got "
                                 f"{pertoken_scale.dtype} {tuple(pertoken_scale.shape)}")
        # the documented dtype combinations with int8 x1/x2 (Atlas A2/A3 table)
        if output_dtype == torch.bfloat16:
            ok = (scale.dtype in (torch.float32, torch.bfloat16) and offset is None
                  and (bias is None or bias.dtype in (torch.int32, torch.bfloat16, torch.float32)))
        elif output_dtype == torch.float16 and pertoken_scale is not None:
            ok = (scale.dtype == torch.float32 and offset is None
                  and (bias is None or bias.dtype in (torch.int32, torch.float32)))
        else:
            raise NotImplementedError("spec covers bfloat16 / float16 output with a per-token scale")
        if not ok:
            raise TypeError(f"npu_quant_matmul: unsupported combination scale={scale.dtype}, bias="
                            f"{None if bias is None else bias.dtype}, offset={offset is not None}, output={output_dtype}")
        if bias is not None and bias.shape != (n,):
            raise ValueError(f"npu_quant_matmul: spec covers a 1-D bias (n,), got {tuple(bias.shape)}")
        acc = x1.double() @ x2.double()  # exact: int8 x int8 products summed in fp64
        if bias is not None and bias.dtype == torch.int32:
            acc = acc + bias.double()
        out = acc * scale.double()
        if pertoken_scale is not None:
            out = out * pertoken_scale.double().reshape(x1.shape[:-1] + (1,))
        if bias is not None and bias.dtype != torch.int32:
            out = out + bias.double()
        return out.to(output_dtype)

    mod = _module("torch_npu", npu_dynamic_quant=npu_dynamic_quant, npu_quant_matmul=npu_quant_matmul)
    mod.calls = calls
    return mod


# ------------------------------------------------------------------------------- torchao reference
def _sym_int8(x, dim):
    """torchao's symmetric int8 scheme along ``dim``, in float32 as torchao computes it: scale = max|x| / 127.5
    (at least float32's eps), q = clamp(round(x * (1 / scale)), -128, 127). Returns fp64 (q, scale)."""
    x = x.float()
    scale = (x.abs().amax(dim=dim, keepdim=True) / ((INT8_MAX - INT8_MIN) / 2)).clamp_min(torch.finfo(torch.float32).eps)
    q = torch.round(x * (1.0 / scale)).clamp(INT8_MIN, INT8_MAX)
    return q.double(), scale.double()


def reference_linear(weight, bias, x, scheme):
    """The fp64 result of one Linear under ``scheme``: "int8_dynamic" (int8 weight per output channel x
    int8 activation per token) or "int8_weight_only" (int8 weight, activation in full precision)."""
    wq, ws = _sym_int8(weight.detach(), dim=1)
    xd = x.double()
    if scheme == "int8_dynamic":
        xq, xs = _sym_int8(x, dim=-1)
        xd = xq * xs
    y = xd @ (wq * ws).t()
    return y if bias is None else y + bias.detach().double()
