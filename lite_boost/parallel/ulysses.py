"""Ulysses sequence-parallel attention around any inner attention function.

Each rank holds a contiguous, equally sized shard of the token sequence (the global sequence padded at
its end to a multiple of the degree). ``UlyssesAttention(attn_fn, comm)`` turns an inner
``attn_fn(q, k, v) -> out`` working on (B, S, H, D) tensors into the sequence-parallel equivalent:

1. one packed all_to_all moves q, k and v from sequence shards to head shards (uneven head splits
   when the head count does not divide the degree);
2. the padded suffix is dropped, so the inner function sees exactly the real sequence for this rank's
   heads (dense or sparse attention; no mask, padded keys never take part);
3. one all_to_all moves the output back to sequence shards.

The inner function is called once per rank with the full sequence, so anything that needs the whole
sequence (block-sparse masks, token grids) works unchanged.

Under USP (Ulysses around Ring attention, :mod:`lite_boost.parallel.ring`) the sequence group is
``ring x ulysses`` and this wrapper runs over the Ulysses sub-group: after the all_to_all a rank
holds super-chunk ``ring_rank`` (``ulysses_degree`` consecutive shards) for its heads, not the whole
sequence. With ``chunk=True`` the super-chunk is handed to the inner (ring) function as it is, padded
rows included (the ring trims each chunk to its valid length ``clamp(S - i * L, 0, L)`` and still
relays the padded buffer), instead of being trimmed to the global sequence length.

Joint attention (MMDiT blocks, :mod:`lite_boost.ops.joint`): ``wrapper(q, k, v, joint=JointTokens(...))``
takes the sharded image / video stream as ``q, k, v`` and the text stream, replicated on every rank,
as ``joint``. Only the sharded stream goes through the all_to_all; each rank hands the inner function
its own heads of the text (a slice, no communication), and the text output of every rank's heads is
put back together with one all_gather over heads (none for a keys-only joint stream). Exchanging the
replicated text as if it were sharded would place each text key P times in the joint sequence and bias
the softmax by log P.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..ops.joint import JointTokens
from .comm import Communicator, head_split, shard_length

__all__ = ["UlyssesAttention", "SequenceShardInfo"]


class SequenceShardInfo:
    """Mutable description of the sequence currently sharded over a communicator.

    ``seq_len`` is the real (unpadded) number of tokens; ``shard_len`` the tokens each rank holds.
    The sharding hooks set it at the start of a forward pass; the attention wrapper and the gather
    read it. One object per boosted model (never shared across models).
    """

    __slots__ = ("seq_len", "shard_len", "degree")

    def __init__(self, degree: int = 1):
        self.degree = degree
        self.seq_len: int | None = None
        self.shard_len: int | None = None

    def set(self, seq_len: int) -> None:
        self.seq_len = int(seq_len)
        self.shard_len = shard_length(self.seq_len, self.degree)

    def clear(self) -> None:
        self.seq_len = None
        self.shard_len = None

    def __repr__(self) -> str:
        return f"SequenceShardInfo(seq_len={self.seq_len}, shard_len={self.shard_len}, degree={self.degree})"


class UlyssesAttention:
    """Sequence-parallel wrapper: ``UlyssesAttention(attn_fn, comm)(q, k, v)``.

    Args:
        attn_fn: inner attention ``attn_fn(q, k, v, **kwargs) -> out`` on (B, S, H, D) tensors,
            returning (B, S, H, D). It receives the whole (unpadded) sequence for this rank's heads.
        comm: Communicator over the sequence-parallel group.
        shard_info: SequenceShardInfo giving the real sequence length, or None when every shard is
            full (``size * S_local`` real tokens).
        chunk: True when ``comm`` is the Ulysses sub-group of a larger sequence group (USP): the inner
            function then receives this group's padded super-chunk (``size * S_local`` rows) and
            trims it itself; False (default) = the whole sequence, trimmed to its real length.

    ``q``, ``k``, ``v`` passed to the wrapper are this rank's (B, S_local, H, D) shards with S_local
    equal on every rank. Extra keyword arguments are forwarded to ``attn_fn`` unchanged. The wrapper
    itself has no rank-dependent control flow around its collectives.

    With ``joint`` (a :class:`~lite_boost.ops.joint.JointTokens` of the replicated text stream, all H
    heads, identical on every rank) the call returns ``(out, joint_out)``: ``attn_fn`` receives
    ``joint.heads(...)`` for this rank's heads and must return ``(out, joint_out)`` for them, and the
    joint output of all heads is reassembled with one all_gather (B, T, H, D) on every rank.
    """

    def __init__(self, attn_fn: Callable[..., torch.Tensor], comm: Communicator,
                 shard_info: SequenceShardInfo | None = None, *, chunk: bool = False):
        if not callable(attn_fn):
            raise TypeError(f"attn_fn must be callable, got {type(attn_fn).__name__}")
        if not isinstance(comm, Communicator):
            raise TypeError(f"comm must be a lite_boost.parallel.comm.Communicator, got {type(comm).__name__}")
        self.attn_fn = attn_fn
        self.comm = comm
        self.shard_info = shard_info
        self.chunk = bool(chunk)

    def __repr__(self) -> str:
        return (f"UlyssesAttention(degree={self.comm.size}{', chunk' if self.chunk else ''}, "
                f"attn_fn={getattr(self.attn_fn, '__name__', self.attn_fn)!r})")

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, joint: JointTokens | None = None,
                 **kwargs):
        if q.ndim != 4:
            raise ValueError(f"UlyssesAttention expects (B, S, H, D) tensors, got q of shape {tuple(q.shape)}")
        if joint is not None:
            joint.check(q, v)
            kwargs["joint"] = joint
        comm = self.comm
        if comm.size == 1:
            return self.attn_fn(q, k, v, **kwargs)
        B, s, H, D = q.shape
        seq_len = None
        if self.shard_info is not None and self.shard_info.seq_len is not None:
            seq_len = None if self.chunk else self.shard_info.seq_len  # USP: the ring trims each chunk
            if self.shard_info.shard_len != s:
                raise RuntimeError(
                    f"UlyssesAttention got {s} local tokens but the sharded sequence has "
                    f"{self.shard_info.shard_len} per rank ({self.shard_info})"
                )
        qh, kh, vh = comm.qkv_to_heads(q, k, v, seq_len=seq_len)
        heads = head_split(H, comm.size)
        h_me = heads[comm.rank]
        joint_out = None
        if joint is not None:
            h0 = sum(heads[: comm.rank])
            kwargs["joint"] = joint.heads(h0, h0 + h_me)
        if h_me > 0:
            res = self.attn_fn(qh, kh, vh, **kwargs)
            out, joint_out = res if joint is not None else (res, None)
            expected = qh.shape[:3] + (vh.shape[-1],)
            if tuple(out.shape) != tuple(expected):
                raise RuntimeError(
                    f"inner attn_fn returned shape {tuple(out.shape)}, expected (B, S, H, D) = {tuple(expected)}"
                )
        else:  # fewer heads than ranks: this rank has nothing to attend, it still joins every exchange
            out = qh.new_empty(qh.shape[:3] + (vh.shape[-1],))
            if joint is not None:
                joint_out = joint.v.new_empty(joint.v.shape[:2] + (0, joint.v.shape[-1]))
        out = comm.heads_to_seq(out.to(q.dtype), H, s)
        if joint is None:
            return out
        if joint.keys_only:  # no joint rows to reassemble (the same on every rank: no collective)
            return out, joint.q.new_empty(joint.q.shape[:3] + (joint.v.shape[-1],))
        # text rows of every rank's heads -> (B, T, H, D) on every rank (one all_gather over heads)
        joint_out = comm.all_gather_uneven(joint_out.to(joint.q.dtype).contiguous(), 2, sizes=heads,
                                           op="joint_heads")
        return out, joint_out
