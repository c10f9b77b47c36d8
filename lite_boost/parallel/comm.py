"""Collectives for sequence parallelism: packed q/k/v all_to_all, uneven splits, sequence gathers.

Shapes follow the (B, S, H, D) layout of the attention processors. A sequence of ``S`` tokens is cut
into ``P`` equal shards of ``ceil(S / P)`` tokens; the last shard(s) are padded at the end, so every
rank holds the same shape and the padding is a suffix of the global sequence. After the q/k/v
exchange a rank holds the whole sequence for its heads and simply drops the padded suffix, so padded
keys never take part in attention (no mask needed) and padded queries are never computed.

Heads are split unevenly when ``H % P != 0``: rank ``r`` owns ``H // P + (r < H % P)`` consecutive
heads (possibly zero when ``H < P``); the all_to_all uses per-rank split sizes.

Every collective goes through a :class:`Communicator`, which also counts collectives and the bytes
each rank sends to other ranks (benchmarks compare that count with the Ulysses lower bound). A
communicator of size 1 turns every operation into a local no-op, so the same code runs unchanged in
one process. A collective that fails (a dead peer) or times out (a stalled peer, after the group's
``timeout_s``) raises :class:`CollectiveError` naming the operation, the group (its name and global
ranks) and the seconds spent waiting.

Ring attention moves K/V point to point: :meth:`Communicator.ring_shift_start` posts one
``batch_isend_irecv`` (send to the next rank of the group, receive from the previous one) and returns
a handle whose ``wait()`` completes it; in between the caller computes (the double buffer lives in
:mod:`lite_boost.parallel.ring`).

Under ``torch.compile`` the Ulysses exchange and the sequence gather trace: inside a traced region
they are issued as functional collectives (``torch.distributed._functional_collectives``, as in
diffusers' context parallelism), which dynamo records in the graph and inductor schedules, on the same
process group and therefore with the same timeout; eagerly they stay the in-place ``torch.distributed``
calls. Collectives issued inside a compiled graph are not counted in :class:`CommStats` (counting them
would make the counter a guard that recompiles at every call).
"""

from __future__ import annotations

import datetime
import math
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

__all__ = [
    "CollectiveError",
    "CommStats",
    "Communicator",
    "RingShift",
    "head_split",
    "shard_length",
    "pad_dim",
]


def head_split(num_heads: int, degree: int) -> list[int]:
    """Heads per rank: ``num_heads // degree`` each, the first ``num_heads % degree`` ranks one more."""
    if num_heads < 0 or degree < 1:
        raise ValueError(f"head_split needs num_heads >= 0 and degree >= 1, got {num_heads}, {degree}")
    base, extra = divmod(num_heads, degree)
    return [base + (1 if r < extra else 0) for r in range(degree)]


def shard_length(seq_len: int, degree: int) -> int:
    """Tokens per rank after padding ``seq_len`` to a multiple of ``degree``."""
    return -(-seq_len // degree)


def pad_dim(x: torch.Tensor, dim: int, length: int, value: float = 0.0) -> torch.Tensor:
    """Pad ``x`` at the end of ``dim`` up to ``length`` (no copy when already that long)."""
    dim = dim % x.ndim
    cur = x.shape[dim]
    if cur == length:
        return x
    if cur > length:
        raise ValueError(f"cannot pad dim {dim} of size {cur} down to {length}")
    shape = list(x.shape)
    shape[dim] = length - cur
    return torch.cat([x, x.new_full(shape, value)], dim=dim)


@dataclass
class CommStats:
    """Counts of collectives issued and bytes sent to other ranks, by operation name."""

    calls: dict = field(default_factory=dict)
    bytes_sent: dict = field(default_factory=dict)
    bytes_received: dict = field(default_factory=dict)

    def record(self, op: str, sent: int, received: int) -> None:
        self.calls[op] = self.calls.get(op, 0) + 1
        self.bytes_sent[op] = self.bytes_sent.get(op, 0) + int(sent)
        self.bytes_received[op] = self.bytes_received.get(op, 0) + int(received)

    def reset(self) -> None:
        self.calls.clear()
        self.bytes_sent.clear()
        self.bytes_received.clear()

    @property
    def total_calls(self) -> int:
        return sum(self.calls.values())

    @property
    def total_bytes_sent(self) -> int:
        return sum(self.bytes_sent.values())


class CollectiveError(RuntimeError):
    """A collective failed or timed out; the message names the operation, the group and the wait."""


class RingShift:
    """A posted ring exchange (:meth:`Communicator.ring_shift_start`); ``wait()`` completes it."""

    __slots__ = ("comm", "works", "op", "t0", "recv")

    def __init__(self, comm: "Communicator", works, op: str, t0: float, recv):
        self.comm, self.works, self.op, self.t0, self.recv = comm, works, op, t0, recv

    def wait(self):
        """Block until the chunk has arrived (and ours has left); returns the receive buffer."""
        comm = self.comm
        timeout = datetime.timedelta(seconds=comm.timeout_s) if comm.timeout_s else None
        try:
            for work in self.works:
                if timeout is None:
                    work.wait()
                else:
                    work.wait(timeout)
        except Exception as exc:  # noqa: BLE001 - re-raised with the collective, group and time
            raise comm.error(self.op, self.t0, exc) from exc
        self.works = ()
        return self.recv


class Communicator:
    """Collectives over one process group (or a trivial group of size 1).

    Args:
        group: the torch.distributed ProcessGroup, or None for the default group (size > 1) / no
            communication (size 1).
        size, rank: the group size and this rank's index in it.
        owns_group: whether the mesh created ``group`` (and destroys it).
        stats: optional CommStats to record collectives into (``enable_stats()`` creates one).
        name: what the group is for ("sequence", "ulysses", "ring", "cfg", "world"; in error messages).
        ranks: the group's global ranks in group order (None: 0 .. size-1, the default group).
        timeout_s: how long a point-to-point wait may block (None: the process group's own timeout).
    """

    def __init__(self, group, size: int, rank: int, owns_group: bool = False, stats: CommStats | None = None,
                 name: str = "group", ranks=None, timeout_s: float | None = None):
        if size < 1 or not (0 <= rank < size):
            raise ValueError(f"invalid communicator size={size} rank={rank}")
        ranks = tuple(range(size)) if ranks is None else tuple(int(r) for r in ranks)
        if len(ranks) != size:
            raise ValueError(f"communicator of size {size} got {len(ranks)} global ranks {list(ranks)}")
        self.group = group
        self.size = size
        self.rank = rank
        self.owns_group = owns_group
        self.stats = stats
        self.name = name
        self.ranks = ranks
        self.timeout_s = timeout_s

    def __repr__(self) -> str:
        return f"Communicator({self.name!r}, size={self.size}, rank={self.rank}, ranks={list(self.ranks)})"

    def describe(self) -> str:
        """'<name> group (global ranks [...], this rank i of n)' for messages."""
        return f"{self.name} group (global ranks {list(self.ranks)}, this rank {self.rank} of {self.size})"

    def error(self, op: str, t0: float, exc: BaseException) -> CollectiveError:
        """The CollectiveError for ``op`` started at ``time.monotonic() == t0`` that failed with ``exc``."""
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return CollectiveError(f"collective '{op}' on the {self.describe()} failed after "
                               f"{time.monotonic() - t0:.1f}s: {type(exc).__name__}: {first}")

    def _call(self, op: str, fn, *args, **kwargs):
        t0 = time.monotonic()
        try:
            return fn(*args, **kwargs)
        except CollectiveError:
            raise
        except Exception as exc:  # noqa: BLE001 - a dead or stalled peer: name what was waited for
            raise self.error(op, t0, exc) from exc

    def enable_stats(self) -> CommStats:
        """Start counting collectives on this communicator; returns the CommStats."""
        if self.stats is None:
            self.stats = CommStats()
        return self.stats

    def _record(self, op: str, sent: int, received: int) -> None:
        if self.stats is not None and not torch.compiler.is_compiling():
            self.stats.record(op, sent, received)

    @property
    def _funcol_group(self):
        return self.group if self.group is not None else dist.group.WORLD

    def exchange(self, inp: torch.Tensor, output_split_sizes: list[int], input_split_sizes: list[int],
                 op: str = "all_to_all") -> torch.Tensor:
        """All_to_all of a 1-D ``inp`` along dim 0 with explicit splits; returns a new tensor.

        Traced by ``torch.compile``: one functional ``all_to_all_single`` in the graph. Eager: the
        in-place ``dist.all_to_all_single`` into a fresh buffer (counted in the stats).
        """
        if self.size == 1:
            return inp.clone()
        if torch.compiler.is_compiling():
            return funcol.all_to_all_single(inp, output_split_sizes, input_split_sizes, group=self._funcol_group)
        out = inp.new_empty((sum(output_split_sizes),) + tuple(inp.shape[1:]))
        return self.all_to_all_single(out, inp, output_split_sizes, input_split_sizes, op=op)

    # ------------------------------------------------------------------ primitives
    def all_to_all_single(self, output, inp, output_split_sizes=None, input_split_sizes=None, op="all_to_all"):
        """``dist.all_to_all_single`` with counting of bytes that leave this rank."""
        if self.size == 1:
            output.copy_(inp)
            return output
        es = inp.element_size()
        row_in = inp[0].numel() if inp.ndim > 1 else 1
        row_out = output[0].numel() if output.ndim > 1 else 1
        self_in = (input_split_sizes[self.rank] if input_split_sizes is not None else inp.shape[0] // self.size) * row_in
        self_out = (output_split_sizes[self.rank] if output_split_sizes is not None else output.shape[0] // self.size) * row_out
        self._record(op, (inp.numel() - self_in) * es, (output.numel() - self_out) * es)
        self._call(op, dist.all_to_all_single, output, inp, output_split_sizes, input_split_sizes, group=self.group)
        return output

    def all_gather_into(self, output: torch.Tensor, inp: torch.Tensor, op="all_gather") -> torch.Tensor:
        """Gather equal-size ``inp`` from every rank into ``output`` (concatenated along dim 0)."""
        if self.size == 1:
            output.copy_(inp.reshape(output.shape))
            return output
        es = inp.element_size()
        self._record(op, inp.numel() * es * (self.size - 1), inp.numel() * es * (self.size - 1))
        fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        self._call(op, fn, output, inp.contiguous(), group=self.group)
        return output

    def broadcast(self, tensor: torch.Tensor, src: int = 0, op="broadcast") -> torch.Tensor:
        """Broadcast ``tensor`` in place from group rank ``src``."""
        if self.size == 1:
            return tensor
        sent = tensor.numel() * tensor.element_size() * (self.size - 1) if self.rank == src else 0
        self._record(op, sent, 0 if self.rank == src else tensor.numel() * tensor.element_size())
        src_global = dist.get_global_rank(self.group, src) if self.group is not None else src
        self._call(op, dist.broadcast, tensor, src=src_global, group=self.group)
        return tensor

    def barrier(self) -> None:
        if self.size > 1:
            self._call("barrier", dist.barrier, group=self.group)

    # ------------------------------------------------------------------ ring (point to point)
    @property
    def next_rank(self) -> int:
        """Group rank this rank sends to in a ring exchange."""
        return (self.rank + 1) % self.size

    @property
    def prev_rank(self) -> int:
        """Group rank this rank receives from in a ring exchange."""
        return (self.rank - 1) % self.size

    def ring_shift_start(self, send, recv, op: str = "ring_kv") -> RingShift:
        """Post: ``send`` to the next rank, ``recv`` filled by the previous one (one batch_isend_irecv).

        ``send`` / ``recv``: a tensor or a tuple of tensors (e.g. K and V: one batch, no packing copy),
        pairwise of one shape and dtype, contiguous, the same on every rank. Returns a
        :class:`RingShift`; call ``wait()`` before reading ``recv`` or writing ``send``. Size 1: a
        local copy.
        """
        sends = (send,) if isinstance(send, torch.Tensor) else tuple(send)
        recvs = (recv,) if isinstance(recv, torch.Tensor) else tuple(recv)
        if len(sends) != len(recvs) or any(a.shape != b.shape or a.dtype != b.dtype for a, b in zip(sends, recvs)):
            raise ValueError(f"ring shift needs send and recv tensors of one shape and dtype each, got "
                             f"{[(tuple(a.shape), a.dtype) for a in sends]} and {[(tuple(b.shape), b.dtype) for b in recvs]}")
        if not all(t.is_contiguous() for t in sends + recvs):
            raise ValueError("ring shift needs contiguous send and recv buffers")
        t0 = time.monotonic()
        if self.size == 1:
            for a, b in zip(sends, recvs):
                b.copy_(a)
            return RingShift(self, (), op, t0, recv)
        nbytes = sum(t.numel() * t.element_size() for t in sends)
        self._record(op, nbytes, nbytes)
        nxt, prev = self.ranks[self.next_rank], self.ranks[self.prev_rank]
        ops = [dist.P2POp(dist.isend, t, peer=nxt, group=self.group) for t in sends]
        ops += [dist.P2POp(dist.irecv, t, peer=prev, group=self.group) for t in recvs]
        works = self._call(op, dist.batch_isend_irecv, ops)
        return RingShift(self, works, op, t0, recv)

    def ring_shift_traced(self, send: torch.Tensor) -> torch.Tensor:
        """The ring exchange as a functional collective (for code traced by ``torch.compile``).

        One ``all_to_all_single`` in which this rank sends everything to the next rank and receives
        everything from the previous one (the rotation PyTorch's context parallelism traces);
        returns the received tensor (same shape), waited for at its first use.
        """
        if self.size == 1:
            return send.clone()
        n = send.numel()
        out_splits = [n if r == self.prev_rank else 0 for r in range(self.size)]
        in_splits = [n if r == self.next_rank else 0 for r in range(self.size)]
        flat = send.reshape(-1)
        if torch.compiler.is_compiling():
            got = funcol.all_to_all_single(flat, out_splits, in_splits, group=self._funcol_group)
        else:
            got = self.all_to_all_single(torch.empty_like(flat), flat, out_splits, in_splits, op="ring_kv")
        return got.view(send.shape)

    # ------------------------------------------------------------------ sequence helpers
    def shard(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's equal shard of ``x`` along ``dim`` (padded with zeros at the global end). Local."""
        if self.size == 1:
            return x
        dim = dim % x.ndim
        s = shard_length(x.shape[dim], self.size)
        start = self.rank * s
        stop = min(start + s, x.shape[dim])
        part = x.narrow(dim, min(start, x.shape[dim]), max(stop - start, 0))
        return pad_dim(part, dim, s).contiguous() if part.shape[dim] != s else part.contiguous()

    def gather(self, x: torch.Tensor, dim: int, length: int | None = None, op: str = "gather") -> torch.Tensor:
        """All-gather equal shards along ``dim`` and drop the padding beyond ``length``."""
        if self.size == 1:
            return x if length is None else x.narrow(dim % x.ndim, 0, length)
        dim = dim % x.ndim
        moved = x.movedim(dim, 0).contiguous()
        if torch.compiler.is_compiling():
            out = funcol.all_gather_tensor(moved, 0, group=self._funcol_group)
        else:
            out = moved.new_empty((self.size * moved.shape[0],) + tuple(moved.shape[1:]))
            self.all_gather_into(out, moved, op=op)
        if length is not None:
            out = out[:length]
        return out.movedim(0, dim)

    def all_gather_uneven(self, x: torch.Tensor, dim: int, sizes: list[int] | None = None,
                          op: str = "gather") -> torch.Tensor:
        """Concatenate tensors of different lengths along ``dim`` from all ranks (in rank order).

        ``sizes`` (the length on every rank) avoids one extra small collective when known.
        """
        if self.size == 1:
            return x
        dim = dim % x.ndim
        if sizes is None:
            n = torch.tensor([x.shape[dim]], dtype=torch.int64, device=x.device)
            all_n = n.new_empty(self.size)
            self.all_gather_into(all_n, n, op="gather_sizes")
            sizes = [int(v) for v in all_n.tolist()]
        if len(sizes) != self.size or sizes[self.rank] != x.shape[dim]:
            raise ValueError(f"sizes={sizes} inconsistent with group size {self.size} / local length {x.shape[dim]}")
        m = max(sizes)
        padded = pad_dim(x, dim, m)
        full = self.gather(padded, dim, op=op)
        parts = [full.narrow(dim, r * m, sizes[r]) for r in range(self.size)]
        return torch.cat(parts, dim=dim)

    # ------------------------------------------------------------------ Ulysses exchange
    def qkv_to_heads(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_len: int | None = None):
        """Sequence-shard -> head-shard for q, k and v with ONE packed all_to_all.

        Input: q, k, v of shape (B, s, H, D) holding this rank's ``s`` tokens (equal on every rank)
        and all H heads. Output: (B, L, h_r, D) each, the whole sequence for this rank's heads, where
        ``L = seq_len`` (the padded suffix dropped) or ``size * s`` when ``seq_len`` is None.
        q, k and v must share B, s, H and D.
        """
        if q.shape != k.shape or q.shape != v.shape:
            raise ValueError(
                f"qkv_to_heads needs q, k, v of one shape (B, S_local, H, D); got {tuple(q.shape)}, "
                f"{tuple(k.shape)}, {tuple(v.shape)}"
            )
        B, s, H, D = q.shape
        P = self.size
        if seq_len is not None and not (0 < seq_len <= P * s and shard_length(seq_len, P) == s):
            raise ValueError(f"seq_len={seq_len} is inconsistent with {P} shards of {s} tokens")
        if P == 1:
            if seq_len is not None and seq_len != s:
                return q[:, :seq_len], k[:, :seq_len], v[:, :seq_len]
            return q, k, v
        heads = head_split(H, P)
        h_me = heads[self.rank]
        unit = 3 * B * s * D
        # pack [rank j][q|k|v][B, s, h_j, D] with one copy per tensor slice (no stacked temporary)
        send = q.new_empty(unit * H)
        offset = h0 = 0
        for h in heads:
            dst = send[offset : offset + unit * h].view(3, B, s, h, D)
            for i, x in enumerate((q, k, v)):
                dst[i].copy_(x[:, :, h0 : h0 + h])
            offset += unit * h
            h0 += h
        recv = self.exchange(send, [unit * h_me] * P, [unit * h for h in heads], op="qkv_to_heads")
        full = recv.view(P, 3, B, s, h_me, D).permute(1, 2, 0, 3, 4, 5).reshape(3, B, P * s, h_me, D)
        if seq_len is not None and seq_len != P * s:
            full = full[:, :, :seq_len]
        return full[0], full[1], full[2]

    def heads_to_seq(self, out: torch.Tensor, num_heads: int, shard_len: int) -> torch.Tensor:
        """Head-shard -> sequence-shard (the inverse exchange, one all_to_all).

        Input: (B, L, h_r, D) attention output for this rank's heads over L <= size * shard_len tokens.
        Output: (B, shard_len, num_heads, D) for this rank's tokens (padded rows are zeros).
        """
        P = self.size
        if P == 1:
            return out
        B, L, h_me, D = out.shape
        heads = head_split(num_heads, P)
        if h_me != heads[self.rank]:
            raise ValueError(f"rank {self.rank} holds {h_me} heads, expected {heads[self.rank]} of {num_heads}")
        s = shard_len
        if L != P * s:
            out = pad_dim(out, 1, P * s)
        send = out.reshape(B, P, s, h_me, D).transpose(0, 1).reshape(-1)
        unit = B * s * D
        recv = self.exchange(send, [unit * h for h in heads], [unit * h_me] * P, op="heads_to_seq")
        parts = recv.split([unit * h for h in heads])
        return torch.cat([p.view(B, s, h, D) for p, h in zip(parts, heads)], dim=2)


def ulysses_lower_bound_bytes(batch: int, seq_len: int, heads: int, head_dim: int, degree: int,
                              element_size: int = 4) -> int:
    """Bytes one rank must send per self-attention under Ulysses (q, k, v out + output back).

    Each rank holds S/P tokens of all heads and must end with all tokens of H/P heads: it keeps
    1/P of its q/k/v and sends the rest, then the same for the output (4 tensors in all).
    """
    if degree == 1:
        return 0
    per_tensor = batch * seq_len * heads * head_dim * element_size / degree * (degree - 1) / degree
    return int(math.ceil(4 * per_tensor))
