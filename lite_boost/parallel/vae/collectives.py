"""The parallel VAE's collectives on one Communicator: equal-size gather, halo exchange, uneven row gather.

Every failure is re-raised as :class:`VAECollectiveError` naming the collective, the group, the rank
and how long it ran.
"""

from __future__ import annotations

import contextlib
import time
from typing import Sequence

import torch
import torch.distributed as dist

from ..comm import Communicator

__all__ = ["VAECollectiveError"]


class VAECollectiveError(RuntimeError):
    """A collective of the parallel VAE failed or timed out; the message names it and the group."""


class _Collectives:
    """The runner's collectives on one Communicator, each failure re-raised naming op, group and time."""

    def __init__(self, comm: Communicator, timeout_s: float | None, group_name: str = "world"):
        self.comm = comm
        self.timeout_s = timeout_s
        self.group_name = group_name

    @contextlib.contextmanager
    def _guard(self, op: str):
        t0 = time.monotonic()
        try:
            yield
        except Exception as exc:  # noqa: BLE001 - gloo/nccl raise RuntimeError or DistBackendError
            raise VAECollectiveError(
                f"parallel VAE collective {op!r} in group {self.group_name!r} (size {self.comm.size}, "
                f"rank {self.comm.rank}) failed after {time.monotonic() - t0:.1f}s "
                f"(timeout {self.timeout_s}s): {type(exc).__name__}: {exc}"
            ) from exc

    def gather_equal(self, buf: torch.Tensor, to_all: bool, root: int = 0,
                     op: str = "vae_gather") -> torch.Tensor | None:
        """Stack equal-size ``buf`` of every rank (P, *buf.shape) on every rank or only on ``root``.
        ``op``: the name the all-gather is counted and reported under."""
        comm = self.comm
        if comm.size == 1:
            return buf.unsqueeze(0)
        buf = buf.contiguous()
        if to_all:
            flat = buf.reshape(1, -1)
            out = flat.new_empty((comm.size, flat.shape[1]))
            with self._guard(op):
                comm.all_gather_into(out, flat, op=op)
            return out.view((comm.size,) + tuple(buf.shape))
        nbytes = buf.numel() * buf.element_size()
        is_root = comm.rank == root
        out = buf.new_empty((comm.size,) + tuple(buf.shape)) if is_root else None
        comm._record("vae_gather_root", 0 if is_root else nbytes, nbytes * (comm.size - 1) if is_root else 0)
        dst = dist.get_global_rank(comm.group, root) if comm.group is not None else root
        with self._guard("vae_gather_root"):
            dist.gather(buf, list(out.unbind(0)) if is_root else None, dst=dst, group=comm.group)
        return out

    def halo(self, tensors: Sequence[torch.Tensor], dim: int, before: int, after: int, wait: bool = True,
             edge: str = "zeros"):
        """For each tensor, the last ``before`` rows (along ``dim``) of the previous rank and the first
        ``after`` rows of the next one (at the ends of the band order: zeros, with ``edge="replicate"``
        copies of the tensor's own first / last row, with ``edge="reflect"`` its rows next to the edge
        mirrored, as ``F.pad(mode="reflect")``). One packed all_to_all.

        ``wait=False`` starts the exchange and returns ``finish()``, which waits for it and returns the
        result: the caller computes what needs no halo in between."""
        comm = self.comm
        P, r = comm.size, comm.rank
        dtype = tensors[0].dtype
        if edge not in ("zeros", "replicate", "reflect"):
            raise ValueError(f"halo edge must be one of ['zeros', 'replicate', 'reflect'], got {edge!r}")
        if any(t.dtype != dtype for t in tensors):
            raise ValueError("halo exchange needs tensors of one dtype")
        for t in tensors:
            if t.shape[dim] < max(before, after) + (edge == "reflect"):
                raise ValueError(f"a band of {t.shape[dim]} rows is thinner than its halo ({before}, {after})")
        tops = [t.narrow(dim, 0, after) for t in tensors] if after else []  # the previous rank's "next" rows
        bots = [t.narrow(dim, t.shape[dim] - before, before) for t in tensors] if before else []
        n_top = sum(t.numel() for t in tops)
        n_bot = sum(t.numel() for t in bots)
        in_splits, out_splits, send_parts = [0] * P, [0] * P, []
        if r > 0:  # destinations in rank order: previous rank first
            in_splits[r - 1], out_splits[r - 1] = n_top, n_bot
            send_parts += [t.reshape(-1) for t in tops]
        if r < P - 1:
            in_splits[r + 1], out_splits[r + 1] = n_bot, n_top
            send_parts += [t.reshape(-1) for t in bots]
        ref = tensors[0]
        send = torch.cat(send_parts) if send_parts else ref.new_empty(0)
        recv = ref.new_empty(sum(out_splits))
        work = None
        if P > 1 and (n_top or n_bot):
            if wait:
                with self._guard("vae_halo"):
                    comm.all_to_all_single(recv, send, out_splits, in_splits, op="vae_halo")
            else:
                es = send.element_size()
                comm._record("vae_halo", send.numel() * es, recv.numel() * es)
                with self._guard("vae_halo"):
                    work = dist.all_to_all_single(recv, send, out_splits, in_splits, group=comm.group,
                                                  async_op=True)

        def fill(t, shape, row):  # the rows beyond the image edge
            if edge == "reflect":  # top: rows k .. 1, bottom: rows n - 2 .. n - 1 - k
                k = shape[dim]
                return t.narrow(dim, 1 if row == 0 else t.shape[dim] - 1 - k, k).flip(dim)
            return t.narrow(dim, row, 1).expand(shape) if edge == "replicate" else t.new_zeros(shape)

        def finish():
            if work is not None:
                with self._guard("vae_halo"):
                    work.wait()
            from_prev = recv[: out_splits[r - 1]] if r > 0 else None
            from_next = recv[(out_splits[r - 1] if r > 0 else 0):] if r < P - 1 else None
            result, o_prev, o_next = [], 0, 0
            for i, t in enumerate(tensors):
                prev = nxt = None
                if before:
                    shape, n = bots[i].shape, bots[i].numel()
                    prev = from_prev[o_prev:o_prev + n].view(shape) if from_prev is not None else fill(t, shape, 0)
                    o_prev += n
                if after:
                    shape, n = tops[i].shape, tops[i].numel()
                    nxt = (from_next[o_next:o_next + n].view(shape) if from_next is not None
                           else fill(t, shape, t.shape[dim] - 1))
                    o_next += n
                result.append((prev, nxt))
            return result

        return finish() if wait else finish

    def gather_rows(self, x: torch.Tensor, dim: int, sizes: list[int]) -> torch.Tensor:
        """All-gather uneven bands along ``dim`` (sizes known on every rank) into the full tensor."""
        if self.comm.size == 1:
            return x
        with self._guard("vae_gather_rows"):
            return self.comm.all_gather_uneven(x, dim, sizes=sizes)
