"""Block selection for rf_v2: score block pairs, keep the top k per query block, add forced blocks.

Two scorers (``selector``), both a pure fp32 function of the (reordered) q and k, deterministic,
so every rank that sees the same tensors builds the same mask:

* ``"reference"``: RainFusion 2.0 / MindSpore Lite: mean-pool Q and K per block and rank KV blocks
  by the pooled logit (the pooled softmax is monotone per row, so this is its order).
* ``"subblock"``: estimated attention mass. Each query block is summarised by ``q_reps`` sub-block
  means and each key block by ``k_reps`` sub-block means plus their variance (mean over channels),
  with the 4 keys farthest from their sub-block mean taken out as representatives of their own (so
  that a few outstanding keys, e.g. attention sinks, are not averaged away); a softmax over all key
  representatives (each weighted by its token count and corrected by the isotropic Gaussian term
  ``0.5 * scale^2 * |q|^2 * var``) estimates, per query representative, the share of its attention
  that falls into each key block; the shares of a query block's representatives are summed
  (weighted by their token counts). Mean pooling of a whole block averages away the keys a query
  actually attends to; several representatives and the variance term keep them.

  Cost: one (Sq * q_reps / block) x (Skv * (k_reps + 4) / block) product of width D + 2 and its
  softmax, computed in chunks of query blocks (bounded buffers, ``_CHUNK_ELEMS``); the key summary
  streams over the keys in bounded chunks too and never materialises an S x D fp32 copy.

Budget (``budget``):

* ``"reference"`` (the reference rule): the top ``keep = ceil((1 - sparsity) * kv_blocks)`` blocks
  by score, then the forced blocks (text, first frame, diagonal) added on top of them.
* ``"total"``: forced blocks count toward ``keep``: a row keeps exactly ``max(keep, forced)`` blocks,
  a hard compute cap.

Ranking is a stable descending sort (ties go to the lower block index), so a row never keeps more
than its budget because of ties.
"""

from __future__ import annotations

import functools
import math

import torch

__all__ = ["pool_blocks", "query_summary", "key_summary", "subblock_scores", "block_scores", "select_blocks",
           "forced_blocks", "SELECTORS", "BUDGETS"]

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


def block_scores(q: torch.Tensor, k: torch.Tensor, block: int, scale: float, selector: str = "reference",
                 q_reps: int = 32, k_reps: int = 8, variance: bool = True, k_outliers: int = 4):
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
    probs = subblock_scores(q, k, block, scale, q_reps, k_reps, k_outliers, variance)
    return probs, probs


_CHUNK_ELEMS = 1 << 19  # fp32 elements of one working chunk (2 MiB): bounds the scoring buffers


@functools.lru_cache(maxsize=None)
def _onednn_linear():
    """``torch.ops.mkldnn._linear_pointwise`` when PyTorch was built with oneDNN, else None.

    fp32 ``x @ w.T`` on oneDNN's own kernels: on a 2-core AMD EPYC (AVX-512) 3.8x faster than the MKL
    sgemm that ``torch.matmul`` calls for the scorer's (rows x (D + 2)) x ((D + 2) x cols) product,
    the same fp32 arithmetic (the sum order of a GEMM differs, as between any two BLAS builds)."""
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._linear_pointwise.default
    except (AttributeError, RuntimeError):  # private operator gone: plain matmul
        return None


def _gemm_nt(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """fp32 (M, K) x (N, K) -> (M, N) = a @ b.T, contiguous."""
    lin = _onednn_linear() if a.device.type == "cpu" and torch.backends.mkldnn.enabled else None
    if lin is not None:
        try:
            return lin(a, b, None, "none", [], "")
        except RuntimeError:  # a shape or build oneDNN rejects: the same product on BLAS
            pass
    return a @ b.t()


def _runs(block: int, reps: int, device):
    """Token p of a block belongs to run ``p * reps // block``: (run (block,) int64, onehot (reps, block) fp32)."""
    run = torch.arange(block, device=device) * reps // block
    onehot = (run[None, :] == torch.arange(reps, device=device)[:, None]).to(torch.float32)
    return run, onehot


def _block_chunks(x: torch.Tensor, block: int, per_block: int):
    """Yield (j0, xb (B, H, nbc, block, D) fp32, valid (nbc, block) bool) over runs of whole blocks of
    axis 2 of ``x``, at most ``_CHUNK_ELEMS`` fp32 elements each (the short last block zero-padded)."""
    b, h, s, d = x.shape
    nb = -(-s // block)
    step = max(1, _CHUNK_ELEMS // max(1, b * h * block * per_block))
    for j0 in range(0, nb, step):
        j1 = min(nb, j0 + step)
        xc = x[:, :, j0 * block: min(s, j1 * block)].to(torch.float32)
        pad = (j1 - j0) * block - xc.shape[2]
        valid = torch.ones((j1 - j0) * block, dtype=torch.bool, device=x.device)
        if pad:
            xc = torch.nn.functional.pad(xc, (0, 0, 0, pad))
            valid[-pad:] = False
        yield j0, xc.view(b, h, j1 - j0, block, d), valid.view(j1 - j0, block)


def _run_sums(xb: torch.Tensor, onehot: torch.Tensor) -> torch.Tensor:
    """Sums over the runs of each block: xb (..., block, C) -> (..., reps, C). Runs of equal length
    (reps divides block) are a reshape and a sum; otherwise a product with the run indicator."""
    reps, block = onehot.shape
    if block % reps == 0:
        return xb.unflatten(-2, (reps, block // reps)).sum(-2)
    return torch.matmul(onehot, xb)


def query_summary(q: torch.Tensor, block: int, reps: int, extra: int = 0):
    """Sub-block means of q (B, H, S, D): (mean (B, H, nb, reps, D + extra), count (nb, reps)), fp32;
    the ``extra`` trailing columns are left for the caller (uninitialised)."""
    b, h, s, d = q.shape
    nb = -(-s // block)
    run, onehot = _runs(block, reps, q.device)
    mean = torch.empty(b, h, nb, reps, d + extra, dtype=torch.float32, device=q.device)
    count = torch.empty(nb, reps, dtype=torch.float32, device=q.device)
    for j0, xb, valid in _block_chunks(q, block, d):
        n = valid.to(torch.float32) @ onehot.t()  # (nbc, reps)
        j1 = j0 + xb.shape[2]
        mean[:, :, j0:j1, :, :d] = _run_sums(xb, onehot).div_(n.clamp_min(1)[..., None])
        count[j0:j1] = n
    return mean, count


def key_summary(k: torch.Tensor, block: int, reps: int, outliers: int, variance: bool):
    """Key representatives of k (B, H, S, D), per block: ``reps`` sub-block means, then the
    ``outliers`` keys farthest from their sub-block mean taken out as representatives of their own.

    Returns fp32 (mean (B, H, nb, r, D), count (B, H, nb, r), var (B, H, nb, r) or None) with
    r = reps + outliers; var = the mean per-channel variance of each representative's keys (0 for
    the single outlying keys). Works through the keys in bounded chunks of whole blocks.
    """
    b, h, s, d = k.shape
    nb = -(-s // block)
    m = min(outliers, block)
    run, onehot = _runs(block, reps, k.device)
    equal = block % reps == 0
    r = reps + m
    mean = torch.empty(b, h, nb, r, d, dtype=torch.float32, device=k.device)
    count = torch.empty(b, h, nb, r, dtype=torch.float32, device=k.device)
    var = torch.empty(b, h, nb, r, dtype=torch.float32, device=k.device) if variance else None
    for j0, xb, valid in _block_chunks(k, block, d):
        j1 = j0 + xb.shape[2]
        nbc = j1 - j0
        n = (valid.to(torch.float32) @ onehot.t()).expand(b, h, nbc, reps)  # tokens per run
        total = _run_sums(xb, onehot)  # (b, h, nbc, reps, d) run sums
        sq = torch.linalg.vector_norm(xb, dim=-1).square_()  # (b, h, nbc, block) |k|^2
        if m:
            mu = total / n.clamp_min(1)[..., None]
            # |k - mu_run|^2 = |k|^2 - 2 k.mu_run + |mu_run|^2, without a (block x d) temporary
            if equal:  # k.mu of its own run only
                dot = torch.einsum("bhnrld,bhnrd->bhnrl", xb.unflatten(-2, (reps, block // reps)), mu)
                dot = dot.reshape(b, h, nbc, block)
            else:
                dot = torch.matmul(xb, mu.transpose(-1, -2))  # (b, h, nbc, block, reps)
                idx = run.view(1, 1, 1, block, 1).expand(b, h, nbc, block, 1)
                dot = dot.gather(-1, idx)[..., 0]
            dev = sq - 2 * dot + mu.square().sum(-1).index_select(-1, run)
            dev = dev.masked_fill(~valid, -math.inf)
            top = torch.topk(dev, m, dim=-1, sorted=True).indices  # (b, h, nbc, m)
            is_tok = valid.expand(b, h, nbc, block).gather(-1, top).to(torch.float32)  # padding is never one
            out = torch.gather(xb, 3, top[..., None].expand(b, h, nbc, m, d))
            r_of = run[top]
            n = n.clone().scatter_add_(-1, r_of, -is_tok)
            total.scatter_add_(3, r_of[..., None].expand(b, h, nbc, m, d), -out * is_tok[..., None])
        denom = n.clamp_min(1)
        mean[:, :, j0:j1, :reps] = total.div_(denom[..., None])
        count[:, :, j0:j1, :reps] = n
        if variance:
            ssq = _run_sums(sq[..., None], onehot)[..., 0]  # (b, h, nbc, reps) run sums of |k|^2
            if m:
                ssq.scatter_add_(-1, r_of, -sq.gather(-1, top) * is_tok)
            v_ = (ssq / denom - mean[:, :, j0:j1, :reps].square().sum(-1)).clamp_min_(0).div_(d)
            var[:, :, j0:j1, :reps] = v_
            var[:, :, j0:j1, reps:] = 0
        if m:
            mean[:, :, j0:j1, reps:] = out
            count[:, :, j0:j1, reps:] = is_tok
    return mean, count, var


def subblock_scores(q, k, block, scale, q_reps, k_reps, k_outliers=4, variance=True):
    """The "subblock" estimate of each query block's attention distribution over key blocks:
    (B, N1, nqb, nkb) fp32, rows sum to 1. See the module docstring."""
    b, n1, sq_, d = q.shape
    n2 = k.shape[1]
    g = n1 // n2
    q_reps, k_reps = min(q_reps, block), min(k_reps, block)
    nqb, nkb = -(-sq_ // block), -(-k.shape[2] // block)
    km, kn, kv = key_summary(k, block, k_reps, k_outliers, variance)
    rk = km.shape[3]
    # key columns rep-major (column = rep * nkb + block): the per-block sum adds contiguous rows
    # every representative logit in one product: [scale q, |q|^2, 1] . [k, 0.5 scale^2 var, log n]
    # (a key representative stands for n tokens; log 0 = -inf drops the empty runs of a short block)
    cols = [km]
    if variance:
        cols.append(kv.mul(0.5 * scale * scale)[..., None])
    cols.append(torch.log(kn)[..., None])
    ka = torch.cat(cols, -1).transpose(2, 3).reshape(b, n2, rk * nkb, -1)
    kd = ka.shape[-1]
    qa, qn = query_summary(q, block, q_reps, kd - d)  # (b, n1, nqb, q_reps, kd), (nqb, q_reps)
    # each representative's share of its query block: the weights of the per-block sum of its distribution
    w = (qn / qn.sum(-1, keepdim=True).clamp_min(1))[:, None, :]  # (nqb, 1, q_reps)
    if variance:
        qa[..., d] = torch.linalg.vector_norm(qa[..., :d], dim=-1).square_()
    qa[..., :d] *= scale
    qa[..., -1] = 1.0
    probs = torch.empty(b, n1, nqb, nkb, dtype=torch.float32, device=q.device)
    step = max(1, _CHUNK_ELEMS // max(1, q_reps * rk * nkb))  # query blocks per chunk (one head)
    for bi in range(b):
        for hi in range(n1):
            keys = ka[bi, hi // g]  # (rk * nkb, kd): GQA heads share their key head's representatives
            for i0 in range(0, nqb, step):
                i1 = min(nqb, i0 + step)
                logits = _gemm_nt(qa[bi, hi, i0:i1].reshape((i1 - i0) * q_reps, kd), keys)
                p = torch.softmax(logits, dim=-1).view(i1 - i0, q_reps, rk * nkb)
                # weighted sum over the query block's representatives, then over each block's key reps
                probs[bi, hi, i0:i1] = torch.bmm(w[i0:i1], p).view(i1 - i0, rk, nkb).sum(1)
    return probs


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
    k = min(keep, nkb)
    if cdf_threshold < 1.0:  # rows stop early: a rank per block against a count per row
        p = probs if probs is not None else torch.softmax(score, dim=-1)
        cum = torch.cumsum(torch.gather(p, -1, order), dim=-1)
        count = torch.minimum(torch.full_like(cum[..., 0], k, dtype=torch.int64), ((cum < cdf_threshold).sum(-1) + 1))
        rank = torch.empty_like(order)
        rank.scatter_(-1, order, torch.arange(nkb, device=dev).expand_as(order))
        mask = rank < count[..., None]
    else:  # the first k of the order
        mask = torch.zeros_like(forced).scatter_(-1, order[..., :k], True)
    mask |= forced
    if bool(forced_q.any()):
        mask[:, :, forced_q] = True
    num = mask.sum(-1)
    m = int(num.max()) if num.numel() else 0
    # ascending kept indices, then -1: each kept block goes to its position among the kept (column m
    # collects the others and is cut off)
    pos = torch.where(mask, torch.cumsum(mask, -1, dtype=torch.int64) - 1, m)
    idx = torch.full(mask.shape[:-1] + (m + 1,), -1, dtype=torch.int64, device=dev)
    idx.scatter_(-1, pos, torch.arange(nkb, device=dev).expand_as(pos))
    idx = idx[..., :m]
    kv_sel = (mask.to(torch.float32) * kv_tokens.to(torch.float32)).sum(-1)
    pairs = float((kv_sel * q_tokens.to(torch.float32).view(1, 1, nqb)).sum())
    select_idx = idx.permute(0, 2, 1, 3).reshape(b * nqb, n1, m)
    select_num = num.permute(0, 2, 1).reshape(b * nqb, n1).to(torch.int64)
    return select_idx.to(torch.int64), select_num, pairs
