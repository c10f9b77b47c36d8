"""Executable specification of CANN ``aclnnRainFusionAttention`` (pure PyTorch, slow, explicit).

Written from the operator document (ops-transformer, attention/rain_fusion_attention/docs), not
from lite_boost's code: it checks what the contract requires of the arguments and computes the
documented result with plain loops, so it serves both as the stand-in for the NPU operator when
testing lite_boost's argument translation and as an independent oracle.

Contract, as documented:
* query/key/value FLOAT16 or BFLOAT16, one dtype; layouts "TND" (T, N, D) or "BNSD" (B, N, S, D);
* selectIdx INT64 [QBlockNum over all batches, headNum, maxKvBlockNum], valid indices first in
  ascending order, then -1; selectNumIdx INT64 [QBlockNum, headNum];
* blockShape at least two elements [X (q), Y (kv)], each > 0; blocks = ceil(len / size);
* attenMask, blockTable: unsupported (null); softmaxLse unsupported; maskType 0 = no mask;
* actualSeqLengths / actualSeqLengthsKv: per-batch lengths, required for TND and BNSD;
* innerPrecise 0 (fp32 softmax) or 1 (fp16 softmax); BFLOAT16 requires 0;
* N1 >= N2, N1 % N2 == 0, G = N1 / N2 < 128 and 128 % G == 0; numKeyValueHeads = N2;
* attentionOut: same dtype and shape as query.
"""

from __future__ import annotations

import math

import torch


class AclnnError(ValueError):
    """ACLNN_ERR_PARAM_NULLPTR / ACLNN_ERR_PARAM_INVALID."""


def aclnn_rain_fusion_attention(query, key, value, selectIdx, selectNumIdx, blockShape, attenMaskOptional,
                                actualSeqLengthsOptional, actualSeqLengthsKvOptional, blockTableOptional,
                                qInputLayout, kvInputLayout, numKeyValueHeads, maskType, scaleValue,
                                innerPrecise, blockSize):
    for t in (query, key, value, selectIdx, selectNumIdx):
        if t is None:
            raise AclnnError("ACLNN_ERR_PARAM_NULLPTR")
    if query.dtype not in (torch.float16, torch.bfloat16) or not (query.dtype == key.dtype == value.dtype):
        raise AclnnError("query/key/value dtype must be one of FLOAT16, BFLOAT16 and equal")
    if qInputLayout not in ("TND", "BNSD") or kvInputLayout not in ("TND", "BNSD"):
        raise AclnnError("layout must be TND or BNSD")
    if not isinstance(blockShape, list) or len(blockShape) < 2 or min(blockShape[:2]) <= 0:
        raise AclnnError("blockShape invalid")
    if innerPrecise not in (0, 1) or (query.dtype == torch.bfloat16 and innerPrecise != 0):
        raise AclnnError("innerPrecise invalid")
    if attenMaskOptional is not None or blockTableOptional is not None or maskType != 0 or blockSize != 0:
        raise AclnnError("mask / paged attention unsupported")
    if selectIdx.dtype != torch.int64 or selectNumIdx.dtype != torch.int64:
        raise AclnnError("selectIdx / selectNumIdx must be INT64")
    if actualSeqLengthsOptional is None or actualSeqLengthsKvOptional is None:
        raise AclnnError("qSeqlen / kvSeqlen are required for TND and BNSD")
    n1 = query.shape[1]
    n2 = key.shape[1]
    if numKeyValueHeads != n2 or n1 < n2 or n1 % n2:
        raise AclnnError("head numbers invalid")
    g = n1 // n2
    if not (g < 128 and 128 % g == 0):
        raise AclnnError("G must be < 128 and divide 128")
    bx, by = blockShape[0], blockShape[1]
    q_lens, kv_lens = list(actualSeqLengthsOptional), list(actualSeqLengthsKvOptional)
    if len(q_lens) != len(kv_lens):
        raise AclnnError("batch mismatch")

    def seq(t, layout, b, lens):
        if layout == "BNSD":
            return t[b, :, : lens[b]]
        start = sum(lens[:b])
        return t[start:start + lens[b]].transpose(0, 1)

    total_q_blocks = sum(math.ceil(n / bx) for n in q_lens)
    if tuple(selectIdx.shape[:2]) != (total_q_blocks, n1) or tuple(selectNumIdx.shape) != (total_q_blocks, n1):
        raise AclnnError("selectIdx / selectNumIdx shape")
    out = torch.zeros_like(query)
    row = 0
    for b in range(len(q_lens)):
        qb, kb, vb = seq(query, qInputLayout, b, q_lens), seq(key, kvInputLayout, b, kv_lens), seq(value, kvInputLayout, b, kv_lens)
        ob = seq(out, qInputLayout, b, q_lens)
        n_kv_blocks = math.ceil(kv_lens[b] / by)
        for i in range(math.ceil(q_lens[b] / bx)):
            for h in range(n1):
                num = int(selectNumIdx[row, h])
                blocks = [int(x) for x in selectIdx[row, h, :num]]
                if blocks != sorted(set(blocks)) or any(not (0 <= x < n_kv_blocks) for x in blocks):
                    raise AclnnError("selectIdx row invalid")
                if any(int(x) != -1 for x in selectIdx[row, h, num:]):
                    raise AclnnError("selectIdx padding must be -1")
                if not blocks:
                    continue
                cols = torch.cat([torch.arange(x * by, min((x + 1) * by, kv_lens[b])) for x in blocks])
                qi = qb[h, i * bx:(i + 1) * bx].float()
                s = qi @ kb[h // g, cols].float().t() * scaleValue
                p = torch.softmax(s, dim=-1)
                if innerPrecise == 1:
                    p = p.half().float()
                ob[h, i * bx:(i + 1) * bx] = (p @ vb[h // g, cols].float()).to(query.dtype)
            row += 1
    return out
