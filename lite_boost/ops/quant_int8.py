"""torchao's int8 Linear (``Int8Tensor`` weights) from its stored plain tensors, as graph-safe custom ops.

A weight that is kept as its inner tensors (int8 ``qdata``, per-output-row ``scale``, ``zero_point``)
rather than as torchao's ``Int8Tensor`` (FSDP shards those tensors; tensor parallelism splits them) is
computed here without building the tensor subclass inside a traced graph: Dynamo cannot construct an
``Int8Tensor`` that carries its activation settings (``QuantizeTensorToInt8Kwargs``). Each op is opaque
to Dynamo / Inductor and runs torchao's own eager code, so its output equals the ``Int8Tensor`` Linear
of one process bit for bit.

* :func:`int8_linear`: the whole Linear (int8 dynamic activations, or weight-only) of a full weight.
* :func:`int8_act_absmax` / :func:`int8_partial_mm` / :func:`int8_finish`: the int8-dynamic Linear in
  three steps for a weight whose input features are split (tensor parallelism's row-wise layers): the
  caller reduces the per-token absmax (MAX) and the int32 partial products (SUM, exact) between them.
* :func:`exact_int8_mm`: int8 x int8 -> int32, exact, at fp32 GEMM speed on a CPU without int8 dot
  products (VNNI / AMX), where ``torch._int_mm`` takes a generic loop (about 200x slower than the fp32 GEMM
  on an AVX2-only AMD EPYC): the products go through fp32 GEMMs over slices of at most
  :data:`EXACT_FP32_K` input features, whose sums are integers below 2**24 and therefore exact, and the
  slices' int32 results are added. :func:`int8_dynamic_linear` is torchao's int8-dynamic Linear on it.

Nothing here knows torch.distributed or a model; torchao is imported when an op runs.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["Int8Spec", "int8_spec", "int8_linear", "int8_act_absmax", "int8_partial_mm", "int8_finish",
           "int8_weight_only_mm", "exact_int8_mm", "int8_dynamic_linear", "int8_mm_path", "EXACT_FP32_K"]

_NS = "lite_boost_graph"

# |a * b| <= 128 * 128 = 2**14 for int8 a, b, so a sum of at most 1024 such products, and every partial sum on the
# way, is an integer of magnitude <= 2**24: exactly representable in fp32, whatever order the GEMM adds in.
EXACT_FP32_K = 1024


class Int8Spec(tuple):
    """(block_size, dtype, dynamic, mapping, reduce_range) of an ``Int8Tensor``: what rebuilding it needs besides
    its tensors. ``dynamic``: its activations are quantized per token (int8_dynamic), else weight-only."""

    __slots__ = ()

    def __new__(cls, block_size, dtype, dynamic, mapping, reduce_range):
        return super().__new__(cls, (list(block_size), dtype, bool(dynamic), str(mapping), bool(reduce_range)))

    block_size = property(lambda self: self[0])
    dtype = property(lambda self: self[1])
    dynamic = property(lambda self: self[2])
    mapping = property(lambda self: self[3])
    reduce_range = property(lambda self: self[4])


def int8_spec(weight) -> Int8Spec | None:
    """The :class:`Int8Spec` of a torchao ``Int8Tensor`` these ops compute (per-row int8 weights; activations
    per token or none, no static activation scales, no pre-scaling), else None."""
    if type(weight).__name__ != "Int8Tensor" or not hasattr(weight, "qdata"):
        return None
    if any(getattr(weight, n, None) is not None for n in ("act_quant_scale", "act_quant_zero_point", "act_pre_scale")):
        return None
    qdata, block = weight.qdata, list(weight.block_size)
    if qdata.ndim != 2 or block != [1, qdata.shape[1]]:
        return None
    kw = weight.act_quant_kwargs
    if kw is None:
        return Int8Spec(block, weight.dtype, False, "SYMMETRIC", bool(weight.reduce_range))
    if type(kw.granularity).__name__ != "PerRow":
        return None
    return Int8Spec(block, weight.dtype, True, kw.mapping_type.name, bool(kw.reduce_range))


def _rebuild(qdata, scale, zero_point, block_size, dtype, dynamic, mapping, reduce_range):
    from torchao.quantization import Int8Tensor, MappingType, PerRow
    from torchao.quantization.quantize_.workflows.int8.int8_tensor import QuantizeTensorToInt8Kwargs

    kwargs = QuantizeTensorToInt8Kwargs(PerRow(), MappingType[mapping], reduce_range) if dynamic else None
    return Int8Tensor(qdata, scale, list(block_size), dtype, zero_point=zero_point, act_quant_kwargs=kwargs,
                      reduce_range=reduce_range)


def _out_shape(x: torch.Tensor, n: int):
    return tuple(x.shape[:-1]) + (n,)


# ------------------------------------------------------------------------------ exact int8 products
def int8_mm_path(device: torch.device | str) -> str:
    """How :func:`exact_int8_mm` computes on ``device``: "int_mm" (``torch._int_mm``: CUDA, or a CPU with AMX),
    "u8s8" (a CPU with VNNI and no AMX: the activations shifted to uint8, as torchao does there) or "fp32"
    (a CPU without int8 dot products: exact fp32 GEMMs over slices of the input features)."""
    if torch.device(device).type != "cpu":
        return "int_mm"
    from .precision import _cpu_flags, cpu_int8_dot_reason

    if cpu_int8_dot_reason() is not None:
        return "fp32"
    return "int_mm" if "amx_int8" in _cpu_flags() else "u8s8"


def _fp32_int8_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    out = None
    for k0 in range(0, a.shape[1], EXACT_FP32_K):
        part = torch.mm(a[:, k0:k0 + EXACT_FP32_K].float(), b[k0:k0 + EXACT_FP32_K].float()).to(torch.int32)
        out = part if out is None else out.add_(part)
    if out is None:  # no input features
        out = a.new_zeros((a.shape[0], b.shape[1]), dtype=torch.int32)
    return out


def exact_int8_mm(a: torch.Tensor, b: torch.Tensor, path: str | None = None) -> torch.Tensor:
    """``a @ b`` for int8 ``a`` (M, K) and ``b`` (K, N) as exact int32 sums, on the fastest exact path of the
    device (:func:`int8_mm_path`; ``path`` forces one of "int_mm", "u8s8", "fp32")."""
    if a.dtype != torch.int8 or b.dtype != torch.int8 or a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"exact_int8_mm: needs int8 (M, K) @ (K, N), got {a.dtype} {tuple(a.shape)} @ {b.dtype} "
                         f"{tuple(b.shape)}")
    path = int8_mm_path(a.device) if path is None else path
    if path == "fp32":
        return _fp32_int8_mm(a, b)
    if path == "u8s8":  # (a + 128) @ b - 128 * colsum(b): uint8 x int8 is what VNNI multiplies
        c = torch._int_mm((a.to(torch.int32) + 128).to(torch.uint8), b.contiguous())
        return c.sub_(b.sum(dim=0, keepdim=True, dtype=torch.int32) * 128)
    if path == "int_mm":
        if a.device.type == "cpu":
            return torch._int_mm(a.contiguous(), b.contiguous())
        from torchao.kernel.intmm import safe_int_mm

        return safe_int_mm(a, b)
    raise ValueError(f"exact_int8_mm: path must be one of ['int_mm', 'u8s8', 'fp32'], got {path!r}")


# ------------------------------------------------------------------------------ the whole Linear
@torch.library.custom_op(f"{_NS}::int8_linear", mutates_args=())
def _int8_linear_op(x: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor, zero_point: Optional[torch.Tensor],
                    bias: Optional[torch.Tensor], block_size: list[int], dtype: torch.dtype, dynamic: bool,
                    mapping: str, reduce_range: bool) -> torch.Tensor:
    if dynamic and mapping == "SYMMETRIC" and int8_mm_path(x.device) == "fp32":
        # torchao's eager path would call torch._int_mm's generic loop here: the same arithmetic, exact products
        return int8_dynamic_linear(x, qdata, scale, bias, Int8Spec(block_size, dtype, dynamic, mapping, reduce_range))
    weight = _rebuild(qdata, scale, zero_point, block_size, dtype, dynamic, mapping, reduce_range)
    return torch.nn.functional.linear(x, weight, bias)


@_int8_linear_op.register_fake
def _(x, qdata, scale, zero_point, bias, block_size, dtype, dynamic, mapping, reduce_range):
    return x.new_empty(_out_shape(x, qdata.shape[0]))


def int8_linear(x: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None,
                bias: torch.Tensor | None, spec: Int8Spec) -> torch.Tensor:
    """``F.linear(x, Int8Tensor(qdata, scale, zero_point, ...), bias)`` with no tensor subclass in the graph (on a
    CPU without int8 dot products, symmetric int8-dynamic runs as :func:`int8_dynamic_linear`: same result)."""
    return _int8_linear_op(x, qdata, scale, zero_point, bias, spec.block_size, spec.dtype, spec.dynamic, spec.mapping,
                           spec.reduce_range)


# ------------------------------------------------------------------------------ split input features
def int8_act_absmax(x: torch.Tensor) -> torch.Tensor:
    """Per-token absmax of ``x`` (shape ``x.shape[:-1] + (1,)``, float32): max(-min(x, 0), max(x, 0)), as
    torchao's symmetric ``choose_qparams_affine`` takes it (the max of slices' absmax is the whole row's)."""
    xf = x.float() if x.dtype != torch.float32 else x
    return xf.abs().amax(dim=-1, keepdim=True)


@torch.library.custom_op(f"{_NS}::int8_partial_mm", mutates_args=())
def _int8_partial_mm_op(x: torch.Tensor, absmax: torch.Tensor, qdata: torch.Tensor, mapping: str,
                        reduce_range: bool) -> tuple[torch.Tensor, torch.Tensor]:
    from torchao.quantization import Int8Tensor, MappingType, PerRow
    from torchao.quantization.quant_primitives import _DTYPE_TO_QVALUE_BOUNDS

    qmin, qmax = _DTYPE_TO_QVALUE_BOUNDS[torch.int8]
    if reduce_range:
        qmin, qmax = qmin // 2, qmax // 2
    # the scale torchao's symmetric choose_qparams_affine computes from the whole row (its absmax is the only
    # value that enters it): the same arithmetic in the same dtype
    scale = absmax.to(x.dtype) / (float(qmax - qmin) / 2)
    scale = torch.clamp(scale, min=torch.finfo(torch.float32).eps).to(torch.float32)
    xq = Int8Tensor.from_hp(x, PerRow(), mapping_type=MappingType[mapping], scale=scale, reduce_range=reduce_range)
    a = xq.qdata.reshape(-1, x.shape[-1])
    c = exact_int8_mm(a, qdata.t())  # exact int32 sums, as every torchao int8 matmul path
    return c, xq.scale.reshape(-1, 1).contiguous()


@_int8_partial_mm_op.register_fake
def _(x, absmax, qdata, mapping, reduce_range):
    m = x.numel() // x.shape[-1]
    return x.new_empty((m, qdata.shape[0]), dtype=torch.int32), x.new_empty((m, 1), dtype=torch.float32)


def int8_partial_mm(x: torch.Tensor, absmax: torch.Tensor, qdata: torch.Tensor, spec: Int8Spec):
    """(int32 products of the int8 ``x`` with this rank's ``qdata`` columns, per-token scale): ``x`` is quantized
    per token with the scale of the whole row's ``absmax`` (shape ``x.shape[:-1] + (1,)``)."""
    if spec.mapping != "SYMMETRIC":
        raise ValueError(f"int8_partial_mm: only symmetric activation quantization splits exactly, got {spec.mapping}")
    return _int8_partial_mm_op(x, absmax, qdata, spec.mapping, spec.reduce_range)


@torch.library.custom_op(f"{_NS}::int8_finish", mutates_args=())
def _int8_finish_op(c: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor, bias: Optional[torch.Tensor],
                    like: torch.Tensor) -> torch.Tensor:
    out_dtype = like.dtype
    inter = torch.float if x_scale.dtype == torch.half else x_scale.dtype
    y = (c.to(inter) * x_scale.to(inter)).to(out_dtype)  # torchao's int_scaled_matmul, then its output scaling
    y = (y * w_scale.flatten()).reshape(*like.shape[:-1], c.shape[-1])
    if bias is not None:
        y += bias
    return y.to(out_dtype)


@_int8_finish_op.register_fake
def _(c, x_scale, w_scale, bias, like):
    return like.new_empty(_out_shape(like, c.shape[-1]))


def int8_finish(c: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
                x: torch.Tensor) -> torch.Tensor:
    """The Linear's output from the (summed) int32 products ``c``: torchao's scaling order, then ``bias``."""
    return _int8_finish_op(c, x_scale, w_scale, bias, x)


def int8_weight_only_mm(x: torch.Tensor, qdata: torch.Tensor) -> torch.Tensor:
    """``x @ qdata.T`` in ``x``'s dtype (torchao's weight-only path before the per-row scale; a partial sum when
    ``qdata`` holds some of the input features)."""
    return torch.mm(x.reshape(-1, x.shape[-1]), qdata.t().to(x.dtype))


def int8_dynamic_linear(x: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                        spec: Int8Spec) -> torch.Tensor:
    """torchao's symmetric int8-dynamic Linear (per-token int8 activations x per-row int8 ``qdata``) with its
    products from :func:`exact_int8_mm`: equal to torchao's own Linear bit for bit, on every path."""
    if not spec.dynamic or spec.mapping != "SYMMETRIC":
        raise ValueError(f"int8_dynamic_linear: needs a symmetric int8-dynamic weight, got {spec}")
    c, x_scale = int8_partial_mm(x, int8_act_absmax(x), qdata, spec)
    return int8_finish(c, x_scale, scale, bias, x)
