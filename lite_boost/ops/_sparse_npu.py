"""Ascend backend of rain_fusion_attention: translation to the ``aclnnRainFusionAttention`` call.

The CANN operator (two-phase aclnn API) is reached through a compiled torch op registered as
``torch.ops.lite_boost.rain_fusion_attention`` (csrc/npu, built only where CANN is found) whose
arguments are the aclnn arguments in the documented order. This module only decides those
arguments (:func:`aclnn_arguments`) and launches the op; the translation is tested on any machine
against a pure-PyTorch executable specification of the documented contract (tests/aclnn_spec.py).

The op's schema (csrc/ops.cpp; arguments in aclnn order, outputs aside)::

    lite_boost::rain_fusion_attention(Tensor query, Tensor key, Tensor value, Tensor select_idx,
        Tensor select_num_idx, int[] block_shape, Tensor? atten_mask=None, int[]? actual_seq_lengths=None,
        int[]? actual_seq_lengths_kv=None, Tensor? block_table=None, str q_input_layout="TND",
        str kv_input_layout="TND", int? num_key_value_heads=None, int mask_type=0,
        float? scale_value=None, int inner_precise=0, int block_size=0, *, bool return_lse=False,
        str precision="auto") -> (Tensor attention_out, Tensor softmax_lse)

Its PrivateUse1 kernel (csrc/npu/aclnn_translate.cpp) repeats every check below in C++ and is
tested on CPU against an aclnn test double (tests/test_aclnn_double.py).

Contract points the translation enforces: q/k/v FLOAT16 or BFLOAT16 of one dtype; layouts "TND"
or "BNSD"; ``actualSeqLengths`` / ``actualSeqLengthsKv`` are per-batch lengths (not cumulative) and
are required for both layouts; ``selectIdx``/``selectNumIdx`` INT64; ``blockShape`` [q, kv] > 0;
attenMask, blockTable and softmaxLse unsupported (null); maskType 0; innerPrecise 0 (fp32
softmax, the only value allowed for BFLOAT16) or 1; GQA with N1 % N2 == 0 and G = N1 / N2 < 128
dividing 128.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch

__all__ = ["AclnnCall", "aclnn_arguments", "probe", "launch", "contract_violation"]

_DTYPES = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class AclnnCall:
    """Arguments of ``aclnnRainFusionAttentionGetWorkspaceSize`` in documented order (outputs aside)."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    selectIdx: torch.Tensor
    selectNumIdx: torch.Tensor
    blockShape: list
    attenMaskOptional: None
    actualSeqLengthsOptional: list
    actualSeqLengthsKvOptional: list
    blockTableOptional: None
    qInputLayout: str
    kvInputLayout: str
    numKeyValueHeads: int
    maskType: int
    scaleValue: float
    innerPrecise: int
    blockSize: int

    def as_args(self) -> tuple:
        return (self.query, self.key, self.value, self.selectIdx, self.selectNumIdx, self.blockShape,
                self.attenMaskOptional, self.actualSeqLengthsOptional, self.actualSeqLengthsKvOptional,
                self.blockTableOptional, self.qInputLayout, self.kvInputLayout, self.numKeyValueHeads,
                self.maskType, self.scaleValue, self.innerPrecise, self.blockSize)


def contract_violation(dtype: torch.dtype, n1: int, n2: int, inner_precise: int) -> str | None:
    """Why these arguments are outside the aclnn contract, or None."""
    if dtype not in _DTYPES:
        return f"aclnnRainFusionAttention accepts float16/bfloat16 inputs only, got {str(dtype).replace('torch.', '')}"
    if dtype == torch.bfloat16 and inner_precise != 0:
        return "inner_precise must be 0 (fp32 softmax) for bfloat16 inputs on Ascend"
    g = n1 // n2
    if g >= 128 or 128 % g:
        return f"query heads / key-value heads = {g} must be < 128 and divide 128 on Ascend"
    return None


def aclnn_arguments(query, key, value, select_idx, select_num_idx, block_shape, q_lens, kv_lens,
                    q_layout, kv_layout, num_kv_heads, scale, inner_precise) -> AclnnCall:
    """Translate validated rain_fusion_attention arguments into the aclnn call."""
    return AclnnCall(
        query=query.contiguous(),
        key=key.contiguous(),
        value=value.contiguous(),
        selectIdx=select_idx.to(torch.int64).contiguous(),
        selectNumIdx=select_num_idx.to(torch.int64).contiguous(),
        blockShape=[int(block_shape[0]), int(block_shape[1])],
        attenMaskOptional=None,
        actualSeqLengthsOptional=[int(x) for x in q_lens],
        actualSeqLengthsKvOptional=[int(x) for x in kv_lens],
        blockTableOptional=None,
        qInputLayout=q_layout,
        kvInputLayout=kv_layout,
        numKeyValueHeads=int(num_kv_heads),
        maskType=0,
        scaleValue=float(scale),
        innerPrecise=int(inner_precise),
        blockSize=0,
    )


def _op():
    """``torch.ops.lite_boost.rain_fusion_attention`` when its Ascend kernel (csrc/npu) is built, else None."""
    from . import _ext_npu

    if _ext_npu.npu_kernel_reason("rain_fusion_attention") is not None:
        return None
    return torch.ops.lite_boost.rain_fusion_attention


def _not_built_reason() -> str:
    from . import _ext_npu

    why = _ext_npu.npu_kernel_reason("rain_fusion_attention")
    return f"the lite_boost csrc NPU op (torch.ops.lite_boost.rain_fusion_attention) is unavailable: {why}"


def probe(device_type: str) -> str | None:
    """None if the Ascend kernel can run on ``device_type``, else why not."""
    if device_type != "npu":
        return f"wrong device: needs npu, got {device_type}"
    try:
        importlib.import_module("torch_npu")
    except (ImportError, RuntimeError, OSError) as exc:
        return f"torch_npu is not importable ({exc.__class__.__name__}: {exc})"
    try:
        if not torch.npu.is_available():  # type: ignore[attr-defined]
            return "torch_npu is installed but no Ascend NPU is visible"
    except Exception as exc:  # noqa: BLE001 - any failure means "not usable"
        return f"torch.npu.is_available() failed ({exc})"
    if _op() is None:
        return _not_built_reason()
    return None


def launch(call: AclnnCall) -> torch.Tensor:
    """Run the aclnn operator; returns attentionOut (same shape and dtype as the query)."""
    op = _op()
    if op is None:
        raise RuntimeError("torch.ops.lite_boost.rain_fusion_attention is not available")
    out, _ = op(*call.as_args())  # (attention_out, softmax_lse); the Ascend kernel leaves softmax_lse empty
    return out
