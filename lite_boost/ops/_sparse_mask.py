"""Block selection for rf_v2: mean-pool Q and K per block, score, keep exactly the top k blocks.

All scoring is fp32 whatever the input dtype. Selection is deterministic: blocks are ranked by a
stable descending sort of the pooled score (the softmax is monotone per row, so this is the order
of the pooled attention probabilities; ties go to the lower block index), so a row never gets
more than its budget because of ties.
"""

from __future__ import annotations

import torch

__all__ = ["pool_blocks", "select_blocks", "forced_blocks"]


def pool_blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """Mean over each block of ``block`` tokens along axis 2 of (B, H, S, D), fp32, valid tokens only."""
    b, h, s, d = x.shape
    nfull = s // block
    parts = []
    if nfull:
        parts.append(x[:, :, : nfull * block].reshape(b, h, nfull, block, d).sum(3, dtype=torch.float32) / block)
    tail = s - nfull * block
    if tail:
        parts.append(x[:, :, nfull * block:].sum(2, keepdim=True, dtype=torch.float32) / tail)
    return torch.cat(parts, dim=2) if len(parts) > 1 else parts[0]


def forced_blocks(flags: torch.Tensor, block: int) -> torch.Tensor:
    """(n_blocks,) bool: block contains at least one flagged token (flags: (S,) bool)."""
    s = flags.numel()
    nb = -(-s // block)
    padded = torch.zeros(nb * block, dtype=torch.bool, device=flags.device)
    padded[:s] = flags
    return padded.view(nb, block).any(1)


def select_blocks(pq: torch.Tensor, pk: torch.Tensor, scale: float, keep: int, forced_q: torch.Tensor,
                  forced_kv: torch.Tensor, diagonal: torch.Tensor | None, cdf_threshold: float,
                  q_tokens: torch.Tensor, kv_tokens: torch.Tensor):
    """Choose KV blocks per (batch, head, query block).

    pq (B, N1, nqb, D) and pk (B, N2, nkb, D) pooled fp32; ``keep`` = blocks per row (budget,
    forced blocks included); ``forced_q`` (nqb,) rows that attend to every block; ``forced_kv``
    (nkb,) blocks every row attends to; ``diagonal`` (nqb,) KV block forced per row or None;
    ``cdf_threshold`` < 1 stops a row early once its kept blocks hold that much pooled mass.
    ``q_tokens``/``kv_tokens``: tokens per block (for the effective sparsity).

    Returns (select_idx (B*nqb, N1, M) int64, select_num (B*nqb, N1) int64, kept token pairs (float)).
    """
    b, n1, nqb, _ = pq.shape
    n2, nkb = pk.shape[1], pk.shape[2]
    if n1 != n2:
        pk = pk.repeat_interleave(n1 // n2, dim=1)
    logits = torch.matmul(pq, pk.transpose(-1, -2)).mul_(scale)  # (B, N1, nqb, nkb), fp32
    # the softmax is monotone per row: rank by logits; forced blocks rank first (+inf)
    prio = logits.clone() if cdf_threshold < 1.0 else logits
    if bool(forced_kv.any()):
        prio[..., forced_kv] = float("inf")
    if diagonal is not None:
        prio.scatter_(-1, diagonal.view(1, 1, nqb, 1).expand(b, n1, nqb, 1), float("inf"))
    order = torch.sort(prio, dim=-1, descending=True, stable=True).indices
    n_forced = torch.isposinf(prio).sum(-1)
    count = torch.full_like(n_forced, min(keep, nkb))
    if cdf_threshold < 1.0:
        probs = torch.softmax(logits, dim=-1)
        cum = torch.cumsum(torch.gather(probs, -1, order), dim=-1)
        n_cdf = (cum < cdf_threshold).sum(-1) + 1
        count = torch.minimum(count, n_cdf.clamp(max=nkb))
    count = torch.maximum(count, n_forced)
    if bool(forced_q.any()):
        count[:, :, forced_q] = nkb
    m = int(count.max()) if count.numel() else 0
    top = order[..., :m]
    keep_mask = torch.arange(m, device=pq.device) < count[..., None]
    idx = torch.sort(torch.where(keep_mask, top, top.new_full((), nkb)), dim=-1).values
    idx = torch.where(idx >= nkb, torch.full_like(idx, -1), idx)
    kv_sel = torch.where(idx >= 0, kv_tokens.to(torch.float32)[idx.clamp_min(0)], 0.0).sum(-1)
    pairs = float((kv_sel * q_tokens.to(torch.float32).view(1, 1, nqb)).sum())
    select_idx = idx.permute(0, 2, 1, 3).reshape(b * nqb, n1, m)
    select_num = count.permute(0, 2, 1).reshape(b * nqb, n1).to(torch.int64)
    return select_idx.to(torch.int64), select_num, pairs
