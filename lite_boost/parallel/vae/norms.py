"""GroupNorm over a row-split tensor: each rank holds a band of rows, the statistics are the whole tensor's.

Each rank computes, per (sample, group), the element count, the mean and the (biased) variance of its band in
fp32 (``torch.var_mean``, robust to a large mean); ONE all-gather of those small ``(3, B, G)`` buffers (fp64)
gives every rank every band's, which are merged exactly (Chan et al.: ``mean = sum(n_i m_i) / N``,
``var = sum(n_i (v_i + (m_i - mean)^2)) / N``, in fp64) into the whole tensor's mean and variance. Each rank
then normalises its band in fp32 as ``(x - mean) * (rstd * gamma) + beta`` (subtracting the mean first: no
cancellation when the mean is large against the spread) and casts back to the input dtype. Bands of any
(uneven) heights; a rank's band must not be empty. Model-agnostic: a :class:`~.adapter.SpatialLayout` lists
the ``nn.GroupNorm`` modules that get it (``group_norm``).
"""

from __future__ import annotations

import torch

from ..comm import Communicator
from .collectives import _Collectives

__all__ = ["distributed_group_norm"]


def _check(x: torch.Tensor, num_groups: int, weight, bias) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() < 3:
        raise ValueError(f"distributed_group_norm: x must be a (B, C, ...) tensor with a spatial dim, got "
                         f"{type(x).__name__}{tuple(x.shape) if isinstance(x, torch.Tensor) else ''}")
    if not isinstance(num_groups, int) or num_groups < 1 or x.shape[1] % num_groups:
        raise ValueError(f"distributed_group_norm: num_groups={num_groups!r} must be a positive int dividing the "
                         f"{x.shape[1]} channels")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and tuple(t.shape) != (x.shape[1],):
            raise ValueError(f"distributed_group_norm: {name} must have shape ({x.shape[1]},), got {tuple(t.shape)}")
    if x.numel() == 0:
        raise ValueError(f"distributed_group_norm: empty band {tuple(x.shape)} (every rank needs at least one row)")


def _group_norm(x: torch.Tensor, num_groups: int, weight, bias, eps: float, coll: _Collectives) -> torch.Tensor:
    """GroupNorm of ``x`` (this rank's band) with the statistics of every rank's band (see the module doc)."""
    _check(x, num_groups, weight, bias)
    B, C = x.shape[0], x.shape[1]
    G = num_groups
    xg = x.reshape(B, G, -1).float()
    var, mean = torch.var_mean(xg, dim=-1, correction=0)  # (B, G) fp32, this band
    local = torch.stack([torch.full_like(mean, float(xg.shape[-1])), mean, var]).double()  # (3, B, G)
    st = coll.gather_equal(local, to_all=True, op="vae_group_norm")  # (P, 3, B, G)
    n, m, v = st[:, 0], st[:, 1], st[:, 2]
    total = n.sum(0)
    g_mean = (n * m).sum(0) / total
    g_var = (n * (v + (m - g_mean) ** 2)).sum(0) / total
    mean32, var32 = g_mean.float(), g_var.float()
    rstd = torch.rsqrt(var32 + eps)  # (B, G)
    scale = rstd.unsqueeze(-1).expand(B, G, C // G)  # (B, G, C/G)
    if weight is not None:
        scale = scale * weight.float().view(G, C // G)
    y = (xg - mean32.unsqueeze(-1)).reshape(B, G, C // G, -1) * scale.unsqueeze(-1)
    if bias is not None:
        y = y + bias.float().view(1, G, C // G, 1)
    return y.reshape(x.shape).to(x.dtype)


def distributed_group_norm(x: torch.Tensor, num_groups: int, weight: torch.Tensor | None = None,
                           bias: torch.Tensor | None = None, eps: float = 1e-5, *, comm: Communicator,
                           timeout_s: float | None = None) -> torch.Tensor:
    """``F.group_norm`` of the tensor whose row bands (any dim from 2 on split across ranks, e.g. rows) the ranks
    of ``comm`` hold, returned as this rank's band. One all-gather of ``3 * B * num_groups`` fp64 numbers; the
    arguments are checked before it (a ValueError naming the argument)."""
    return _group_norm(x, num_groups, weight, bias, eps, _Collectives(comm, timeout_s))
