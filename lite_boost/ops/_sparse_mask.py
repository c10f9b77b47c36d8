"""Block selection for rf_v2: score block pairs, keep the top k per query block, add forced blocks.

Two scorers (``selector``), both a pure fp32 function of the (reordered) q and k, deterministic,
so every rank that sees the same tensors builds the same mask:

* ``"reference"``: RainFusion 2.0 / MindSpore Lite: mean-pool Q and K per block and rank KV blocks
  by the pooled logit (the pooled softmax is monotone per row, so this is its order).
* ``"subblock"``: estimated attention mass. Each query block is summarised by ``q_reps`` sub-block
  means and each key block by ``k_reps`` sub-block means plus their per-channel variance, with the
  4 keys farthest from their sub-block mean taken out as representatives of their own (so that a
  few outstanding keys, e.g. attention sinks, are not averaged away); a softmax
  over all key representatives (each weighted by its token count and corrected by the Gaussian
  term ``0.5 * scale^2 * sum_d q_d^2 var_d``) estimates, per query representative, the share of
  its attention that falls into each key block; the shares of a query block's representatives are
  summed (weighted by their token counts). Mean pooling of a whole block averages away the keys a
  query actually attends to; several representatives and the variance term keep them.

Budget (``budget``):

* ``"reference"`` (the reference rule): the top ``keep = ceil((1 - sparsity) * kv_blocks)`` blocks
  by score, then the forced blocks (text, first frame, diagonal) added on top of them.
* ``"total"``: forced blocks count toward ``keep``: a row keeps exactly ``max(keep, forced)`` blocks,
  a hard compute cap.

Ranking is a stable descending sort (ties go to the lower block index), so a row never keeps more
than its budget because of ties.
"""

from __future__ import annotations

import math

import torch

__all__ = ["pool_blocks", "sub_block_stats", "block_scores", "select_blocks", "forced_blocks", "SELECTORS",
           "BUDGETS"]

SELECTORS = ("subblock", "reference")
BUDGETS = ("reference", "total")


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


def sub_block_stats(x: torch.Tensor, block: int, reps: int, variance: bool = False):
    """Split every block of ``block`` tokens (axis 2 of (B, H, S, D)) into ``reps`` near-equal runs.

    Token p of a block belongs to run ``p * reps // block`` (the last block may be short, so some of
    its runs may be empty). Returns fp32 (mean (B, H, nb * reps, D), count (nb * reps,), var or None),
    var the per-channel variance of each run (B, H, nb * reps, D); empty runs have count 0 and mean 0.
    """
    b, h, s, d = x.shape
    reps = min(reps, block)
    nb = -(-s // block)
    dev = x.device
    if block % reps == 0:
        # runs are plain sub-blocks of block // reps tokens; the short last block has fewer runs
        sub = block // reps
        nfull = s // sub
        tail = s - nfull * sub
        sums, sqs = [], []
        if nfull:
            xs = x[:, :, : nfull * sub].reshape(b, h, nfull, sub, d)
            sums.append(xs.sum(3, dtype=torch.float32))
            if variance:
                sqs.append(xs.to(torch.float32).square().sum(3))
        if tail:
            xt = x[:, :, nfull * sub:].to(torch.float32)
            sums.append(xt.sum(2, keepdim=True))
            if variance:
                sqs.append((xt * xt).sum(2, keepdim=True))
        count = torch.full((nfull + (1 if tail else 0),), float(sub), device=dev)
        if tail:
            count[-1] = tail
        missing = nb * reps - count.numel()
        total = torch.cat(sums, 2) if len(sums) > 1 else sums[0]
        sq = (torch.cat(sqs, 2) if len(sqs) > 1 else sqs[0]) if variance else None
        if missing:
            count = torch.cat([count, count.new_zeros(missing)])
            total = torch.nn.functional.pad(total, (0, 0, 0, missing))
            sq = torch.nn.functional.pad(sq, (0, 0, 0, missing)) if variance else None
    else:
        pad = nb * block - s
        xf = x.to(torch.float32)
        if pad:
            xf = torch.nn.functional.pad(xf, (0, 0, 0, pad))
        run = torch.arange(block, device=dev) * reps // block  # (block,)
        onehot = (run[None, :] == torch.arange(reps, device=dev)[:, None]).to(torch.float32)  # (reps, block)
        valid = torch.ones(nb * block, device=dev)
        if pad:
            valid[s:] = 0
        count = (valid.view(nb, 1, block) * onehot).sum(-1).reshape(nb * reps)
        xb = xf.view(b, h, nb, block, d)
        total = torch.matmul(onehot, xb).reshape(b, h, nb * reps, d)
        sq = torch.matmul(onehot, xb * xb).reshape(b, h, nb * reps, d) if variance else None
    denom = count.clamp_min(1).view(1, 1, -1, 1)
    mean = total / denom
    var = (sq / denom - mean * mean).clamp_min_(0) if variance else None
    return mean, count, var


def block_scores(q: torch.Tensor, k: torch.Tensor, block: int, scale: float, selector: str = "reference",
                 q_reps: int = 16, k_reps: int = 8, variance: bool = True, max_elems: int = 1 << 24,
                 k_outliers: int = 4):
    """Score every (query block, key block) pair of reordered q (B, N1, Sq, D) and k (B, N2, Skv, D).

    Returns (score, probs), both fp32 (B, N1, nqb, nkb): ``score`` ranks the key blocks of a row
    (higher = keep first), ``probs`` is the row's estimated distribution of attention over key
    blocks (sums to 1; used by ``cdf_threshold``). See the module docstring for the two selectors.
    """
    b, n1 = q.shape[:2]
    n2 = k.shape[1]
    if selector == "reference":
        pq, pk = pool_blocks(q, block), pool_blocks(k, block)
        if n1 != n2:
            pk = pk.repeat_interleave(n1 // n2, dim=1)
        logits = torch.matmul(pq, pk.transpose(-1, -2)).mul_(scale)
        return logits, torch.softmax(logits, dim=-1)
    if selector != "subblock":
        raise ValueError(f"selector must be one of {list(SELECTORS)}, got {selector!r}")
    nqb, nkb = -(-q.shape[2] // block), -(-k.shape[2] // block)
    qm, qn, _ = sub_block_stats(q, block, q_reps)
    km, kn, kv = sub_block_stats(k, block, k_reps, variance=variance)
    rq, rk = qm.shape[2] // nqb, km.shape[2] // nkb
    log_n = torch.log(kn).view(1, 1, -1, 1).expand(b, n2, -1, 1)
    if k_outliers:
        km, log_n, kv, rk = _split_outliers(k, block, km, kn, kv, rk, min(k_outliers, block))
    # one matmul gives every representative logit: [scale q, q^2, 1] . [k, 0.5 scale^2 var, log n]
    # (each key representative stands for n tokens; log 0 = -inf for the empty runs of a short block)
    qa = [qm * scale, qm * qm] if variance else [qm * scale]
    ka = [km, kv.mul_(0.5 * scale * scale)] if variance else [km]
    qa = torch.cat(qa + [torch.ones_like(qm[..., :1])], -1)
    ka = torch.cat(ka + [log_n], -1)
    if n1 != n2:
        ka = ka.repeat_interleave(n1 // n2, dim=1)
    ka_t = ka.transpose(-1, -2)
    mass = torch.empty(b, n1, nqb * rq, nkb, dtype=torch.float32, device=q.device)
    chunk = max(1, max_elems // (b * n1 * ka.shape[2]))  # bounds the logits buffer
    for r0 in range(0, nqb * rq, chunk):
        logits = torch.matmul(qa[:, :, r0:r0 + chunk], ka_t)
        logits.sub_(logits.amax(-1, keepdim=True)).exp_()
        m = logits.view(*logits.shape[:-1], nkb, rk).sum(-1)
        mass[:, :, r0:r0 + chunk] = m.div_(m.sum(-1, keepdim=True))
    w = (qn / qn.view(nqb, rq).sum(-1).clamp_min(1).repeat_interleave(rq)).view(1, 1, nqb * rq, 1)
    probs = mass.mul_(w).view(b, n1, nqb, rq, nkb).sum(3)
    return probs, probs


def _split_outliers(k, block, km, kn, kv, rk, m):
    """Take the ``m`` keys of each block farthest from their run mean out of the runs as their own
    representatives (count 1, variance 0): a few keys that stand out (sinks) are not averaged away."""
    b, h, s, d = k.shape
    nkb = km.shape[2] // rk
    pad = nkb * block - s
    kp = k.to(torch.float32)
    if pad:
        kp = torch.nn.functional.pad(kp, (0, 0, 0, pad))
    kp = kp.view(b, h, nkb, block, d)
    run = torch.arange(block, device=k.device) * rk // block
    mean = km.view(b, h, nkb, rk, d)
    dev = (kp - mean.index_select(3, run)).square_().sum(-1)  # (b, h, nkb, block)
    if pad:
        valid = (torch.arange(nkb * block, device=k.device) < s).view(nkb, block)
        dev = dev.masked_fill(~valid, -1.0)
    top = torch.sort(dev, dim=-1, descending=True, stable=True).indices[..., :m]  # (b, h, nkb, m)
    is_tok = (torch.gather(dev, -1, top) >= 0).to(torch.float32)  # padding is never an outlier
    out = torch.gather(kp, 3, top[..., None].expand(b, h, nkb, m, d))
    r_of = run[top]  # (b, h, nkb, m)
    n = kn.view(1, 1, nkb, rk).expand(b, h, nkb, rk).clone()
    n.scatter_add_(-1, r_of, -is_tok)
    total = mean * kn.view(1, 1, nkb, rk, 1)
    total.scatter_add_(3, r_of[..., None].expand(b, h, nkb, m, d), -out * is_tok[..., None])
    denom = n.clamp_min(1)[..., None]
    new_mean = total / denom
    parts_m = [new_mean, out]
    if kv is not None:
        sq = (kv.view(b, h, nkb, rk, d) + mean * mean) * kn.view(1, 1, nkb, rk, 1)
        sq.scatter_add_(3, r_of[..., None].expand(b, h, nkb, m, d), -(out * out) * is_tok[..., None])
        new_var = (sq / denom - new_mean * new_mean).clamp_min_(0)
        kv = torch.cat([new_var, torch.zeros_like(out)], 3).view(b, h, nkb * (rk + m), d)
    km = torch.cat(parts_m, 3).view(b, h, nkb * (rk + m), d)
    log_n = torch.log(torch.cat([n, is_tok], -1)).view(b, h, nkb * (rk + m), 1)
    return km, log_n, kv, rk + m


def forced_blocks(flags: torch.Tensor, block: int) -> torch.Tensor:
    """(n_blocks,) bool: block contains at least one flagged token (flags: (S,) bool)."""
    s = flags.numel()
    nb = -(-s // block)
    padded = torch.zeros(nb * block, dtype=torch.bool, device=flags.device)
    padded[:s] = flags
    return padded.view(nb, block).any(1)


def select_blocks(score: torch.Tensor, probs: torch.Tensor | None, keep: int, forced_q: torch.Tensor,
                  forced_kv: torch.Tensor, diagonal: torch.Tensor | None, cdf_threshold: float,
                  q_tokens: torch.Tensor, kv_tokens: torch.Tensor, budget: str = "reference"):
    """Choose KV blocks per (batch, head, query block) from ``score`` (B, N1, nqb, nkb).

    ``keep``: blocks per row chosen by score; ``budget`` says whether the forced blocks come on top
    ("reference") or count toward ``keep`` ("total"); ``forced_q`` (nqb,) rows that attend to
    every block; ``forced_kv`` (nkb,) blocks every row attends to; ``diagonal`` (nqb,) KV block
    forced per row or None; ``cdf_threshold`` < 1 stops the chosen part of a row early once it
    holds that much of ``probs`` (the row's estimated attention distribution over blocks).
    ``q_tokens``/``kv_tokens``: tokens per block (for the effective sparsity).

    Returns (select_idx (B*nqb, N1, M) int64, select_num (B*nqb, N1) int64, kept token pairs (float)).
    """
    if budget not in BUDGETS:
        raise ValueError(f"budget must be one of {list(BUDGETS)}, got {budget!r}")
    b, n1, nqb, nkb = score.shape
    dev = score.device
    forced = forced_kv.view(1, 1, 1, nkb).expand(b, n1, nqb, nkb).clone()
    if diagonal is not None:
        forced.scatter_(-1, diagonal.view(1, 1, nqb, 1).expand(b, n1, nqb, 1), True)
    if budget == "total":  # forced blocks rank first and use up the budget
        prio = score.masked_fill(forced, float("inf"))
    else:
        prio = score
    order = torch.sort(prio, dim=-1, descending=True, stable=True).indices
    count = torch.full(score.shape[:-1], min(keep, nkb), dtype=torch.int64, device=dev)
    if cdf_threshold < 1.0:
        p = probs if probs is not None else torch.softmax(score, dim=-1)
        cum = torch.cumsum(torch.gather(p, -1, order), dim=-1)
        n_cdf = (cum < cdf_threshold).sum(-1) + 1
        count = torch.minimum(count, n_cdf.clamp(max=nkb))
    rank = torch.empty_like(order)
    rank.scatter_(-1, order, torch.arange(nkb, device=dev).expand_as(order))
    chosen = rank < count[..., None]
    mask = chosen | forced
    if bool(forced_q.any()):
        mask[:, :, forced_q] = True
    num = mask.sum(-1)
    m = int(num.max()) if num.numel() else 0
    ar = torch.arange(nkb, device=dev)
    idx = torch.sort(torch.where(mask, ar, nkb), dim=-1).values[..., :m]
    idx = torch.where(idx >= nkb, torch.full_like(idx, -1), idx)
    kv_sel = (mask.to(torch.float32) * kv_tokens.to(torch.float32)).sum(-1)
    pairs = float((kv_sel * q_tokens.to(torch.float32).view(1, 1, nqb)).sum())
    select_idx = idx.permute(0, 2, 1, 3).reshape(b * nqb, n1, m)
    select_num = num.permute(0, 2, 1).reshape(b * nqb, n1).to(torch.int64)
    return select_idx.to(torch.int64), select_num, pairs
