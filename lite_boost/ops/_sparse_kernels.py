"""Pure-PyTorch block-sparse attention kernels (no compiler needed).

Both work on one batch element ("segment") at a time, in a head-major view:
q (N1, Sq, D), k/v (N2, Skv, D), ``select_idx`` (q_blocks, N1, M) and ``select_num`` (q_blocks, N1)
already validated. Query block i of head h attends to the union of KV blocks
``select_idx[i, h, :select_num[i, h]]`` of KV head ``h // (N1 // N2)``; a row with nothing
selected gives output 0 and log-sum-exp -inf (never NaN).

* :func:`gather_attention` gathers the selected K/V blocks of a group of query blocks and runs
  the softmax on them in fp32; memory is bounded by ``budget`` elements per step (no S x S).
* :func:`dense_masked_attention` is the test oracle: a dense (N1, Sq, Skv) mask, fp64 softmax.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

__all__ = ["gather_attention", "dense_masked_attention", "block_mask_dense"]

_NEG_INF = float("-inf")


def _pad_seq(x: torch.Tensor, multiple_len: int) -> torch.Tensor:
    pad = multiple_len - x.shape[1]
    return F.pad(x, (0, 0, 0, pad)) if pad else x


def gather_attention(q, k, v, select_idx, select_num, block_shape, scale, need_lse=True,
                     budget: int = 1 << 24):
    """Block-sparse attention of one segment by gathering the selected blocks (fp32 softmax).

    Returns ``(out (N1, Sq, Dv) in q.dtype, lse (N1, Sq) fp32 or None)``.
    """
    n1, sq, d = q.shape
    n2, skv, _ = k.shape
    dv = v.shape[-1]
    bq, bk = block_shape
    nqb, nkb = math.ceil(sq / bq), math.ceil(skv / bk)
    g = n1 // n2
    out = torch.zeros(n1 * nqb, bq, dv, dtype=q.dtype, device=q.device)
    lse = torch.full((n1 * nqb, bq), _NEG_INF, dtype=torch.float32, device=q.device) if need_lse else None
    if nqb == 0 or nkb == 0 or select_idx.shape[-1] == 0:
        return out.view(n1, nqb * bq, dv)[:, :sq], (lse.view(n1, -1)[:, :sq] if need_lse else None)
    qp = _pad_seq(q, nqb * bq).reshape(n1 * nqb, bq, d)
    kp = _pad_seq(k, nkb * bk).reshape(n2 * nkb, bk, d)
    vp = _pad_seq(v, nkb * bk).reshape(n2 * nkb, bk, dv)
    # rows r = h * nqb + i
    counts = select_num.t().reshape(-1)
    idx = select_idx.permute(1, 0, 2).reshape(n1 * nqb, -1)
    offs = torch.arange(bk, device=q.device)
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    for m in counts.unique().tolist():
        if m == 0:
            continue
        rows_all = torch.nonzero(counts == m).flatten()
        per_row = m * bk * (bq + 2 * max(d, dv))
        step = max(1, budget // per_row)
        for start in range(0, rows_all.numel(), step):
            rows = rows_all[start:start + step]
            blk = idx[rows, :m]
            flat = (rows // nqb // g)[:, None] * nkb + blk
            kc = kp[flat].reshape(rows.numel(), m * bk, d)
            vc = vp[flat].reshape(rows.numel(), m * bk, dv)
            qc = qp[rows]
            s = torch.bmm(qc.float(), kc.float().transpose(1, 2)).mul_(scale)
            valid = (blk[:, :, None] * bk + offs) < skv
            if not bool(valid.all()):
                s.masked_fill_(~valid.reshape(rows.numel(), 1, m * bk), _NEG_INF)
            l = torch.logsumexp(s, dim=-1)
            p = torch.exp(s - l[..., None]) if grad else s.sub_(l[..., None]).exp_()
            out[rows] = torch.bmm(p, vc.float()).to(q.dtype)
            if need_lse:
                lse[rows] = l
    out = out.view(n1, nqb * bq, dv)[:, :sq]
    return out, (lse.view(n1, nqb * bq)[:, :sq] if need_lse else None)


def block_mask_dense(select_idx, select_num, block_shape, sq, skv) -> torch.Tensor:
    """(N1, Sq, Skv) bool token mask of one segment's block selection (for tests and the oracle)."""
    nqb, n1, m = select_idx.shape
    bq, bk = block_shape
    nkb = math.ceil(skv / bk)
    blocks = torch.zeros(nqb, n1, nkb + 1, dtype=torch.bool, device=select_idx.device)
    keep = torch.arange(m, device=select_idx.device) < select_num[..., None]
    target = torch.where(keep, select_idx, torch.full_like(select_idx, nkb))
    blocks.scatter_(2, target, True)
    blocks = blocks[..., :nkb].permute(1, 0, 2)  # (N1, nqb, nkb)
    mask = blocks.repeat_interleave(bq, dim=1)[:, :sq].repeat_interleave(bk, dim=2)[:, :, :skv]
    return mask


def dense_masked_attention(q, k, v, select_idx, select_num, block_shape, scale, need_lse=True):
    """Oracle: materialise the token mask and run a masked softmax in fp64."""
    n1, sq, _ = q.shape
    n2, skv, _ = k.shape
    g = n1 // n2
    mask = block_mask_dense(select_idx, select_num, block_shape, sq, skv)
    kk = k.double().repeat_interleave(g, dim=0)
    vv = v.double().repeat_interleave(g, dim=0)
    s = torch.matmul(q.double(), kk.transpose(1, 2)) * scale
    s = s.masked_fill(~mask, _NEG_INF)
    lse = torch.logsumexp(s, dim=-1)
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    p = torch.exp(s - safe[..., None])
    out = torch.matmul(p, vv).to(q.dtype)
    return out, (lse.float() if need_lse else None)
