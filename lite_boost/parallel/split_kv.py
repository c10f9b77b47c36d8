"""Attention from queries every rank holds whole to keys / values of the split token sequence.

Some models attend a short stream that every rank keeps whole to the long, sequence-parallel one: LTX-2's
video-to-audio cross-attention takes its queries from the audio tokens (replicated) and its keys / values
from the video tokens (split over the sequence group). ``SplitKeysAttention(attn_fn, comm, info)(q, k, v)``
computes it exactly without moving the long stream:

1. each rank attends the whole query set to its own valid key rows (padding rows of the last shards
   dropped; a rank without valid rows contributes nothing), keeping the log-sum-exp of every row;
2. one all_gather of the (small) partial outputs and log-sum-exps over the group;
3. every rank merges the parts in rank order (:func:`lite_boost.ops.lse.merge_partials`), so all ranks
   hold the same result, bit for bit.

The traffic is ``size x`` the query stream's output, independent of the split sequence's length.
"""

from __future__ import annotations

import torch

from ..ops.lse import merge_partials
from .comm import Communicator
from .ulysses import SequenceShardInfo

__all__ = ["SplitKeysAttention"]


class SplitKeysAttention:
    """``attn_fn`` wrapper: whole queries (B, Sq, H, D), this rank's shard of keys / values (B, s, H, D).

    Args:
        attn_fn: the inner attention; its ``lse_attention(q, k, v) -> (out, lse (B, H, Sq))`` is used when it
            has one, else exact fp32 math.
        comm: Communicator of the sequence group the keys are split over.
        shard_info: the real length of the split sequence (padding rows past it are never attended).
    """

    def __init__(self, attn_fn, comm: Communicator, shard_info: SequenceShardInfo | None = None):
        if not callable(attn_fn):
            raise TypeError(f"attn_fn must be callable, got {type(attn_fn).__name__}")
        self.attn_fn = attn_fn
        self.comm = comm
        self.shard_info = shard_info

    def __repr__(self) -> str:
        return f"SplitKeysAttention(degree={self.comm.size}, attn_fn={self.attn_fn!r})"

    def _partial(self, q, k, v):
        kernel = getattr(self.attn_fn, "lse_attention", None)
        if callable(kernel):
            return kernel(q, k, v)
        from .ring import masked_partial

        return masked_partial(q, k, v, torch.ones(k.shape[:2], dtype=torch.bool, device=k.device), kernel=None)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        comm = self.comm
        if comm.size == 1:
            return self.attn_fn(q, k, v)
        s = k.shape[1]
        seq_len = self.shard_info.seq_len if self.shard_info is not None else None
        valid = s if seq_len is None else max(0, min(s, seq_len - comm.rank * s))
        B, sq, H = q.shape[:3]
        if valid > 0:
            out, lse = self._partial(q, k[:, :valid], v[:, :valid])
            lse = lse.to(torch.float32)
        else:  # nothing but padding here: weight 0 in the merge
            out = q.new_zeros(q.shape[:3] + (v.shape[-1],))
            lse = torch.full((B, H, sq), float("-inf"), dtype=torch.float32, device=q.device)
        outs = comm.gather(out.to(q.dtype).unsqueeze(0).contiguous(), 0, op="split_kv_out")
        lses = comm.gather(lse.unsqueeze(0).contiguous(), 0, op="split_kv_lse")
        merged, _ = merge_partials((outs[i], lses[i].transpose(1, 2)) for i in range(comm.size))
        return merged.to(q.dtype)
