"""The ``"chunked"`` mode: contiguous latent-frame chunks over the ranks, each warmed on preceding frames.

:func:`plan_chunks` cuts the latent frames into chunks (balanced by the adapter's cost per chunk, or
of a fixed size round-robin); :func:`run_chunked` runs this rank's chunks, pads them to the longest
rank's length and assembles the video with ONE gather (every rank takes part, chunk or not).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ...config import ConfigError
from ..comm import pad_dim
from .adapter import VAEAdapter
from .collectives import _Collectives

__all__ = ["Chunk", "ChunkPlan", "plan_chunks", "run_chunked"]


@dataclass(frozen=True)
class Chunk:
    """Latent frames [start, stop) decoded by ``rank`` after warming the cache on [warm_start, start)."""

    index: int
    rank: int
    start: int
    stop: int
    warm_start: int

    @property
    def frames(self) -> int:
        return self.stop - self.start

    @property
    def warmup(self) -> int:
        return self.start - self.warm_start


@dataclass(frozen=True)
class ChunkPlan:
    num_frames: int
    world_size: int
    overlap: int
    chunk_size: int | None
    chunks: tuple

    def for_rank(self, rank: int) -> list:
        return [c for c in self.chunks if c.rank == rank]

    def describe(self) -> str:
        parts = [f"r{c.rank}:[{c.start},{c.stop})" + (f"+warm{c.warmup}" if c.warmup else "") for c in self.chunks]
        return f"{self.num_frames} latent frames on {self.world_size} ranks: " + " ".join(parts)


def _check_pos_int(name: str, value, lo: int = 1):
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an integer, got {value!r}")
    if value < lo:
        raise ConfigError(f"{name} must be >= {lo}, got {value}")


def plan_chunks(num_frames: int, world_size: int, *, overlap: int, chunk_size: int | None = None,
                first_cost: float = 0.25, cost: Callable[[int, int, int], float] | None = None) -> ChunkPlan:
    """Cut ``num_frames`` latent frames into contiguous chunks over ``world_size`` ranks.

    ``chunk_size=None``: at most one chunk per rank, with boundaries that minimise the largest rank
    cost. ``cost(warm_start, start, stop)`` is the compute of one chunk run (warm-up included) in
    units of one later latent frame; adapters supply it (:meth:`VAEAdapter.chunk_cost`). Without it
    a chunk costs its frames plus its warm-up frames (``min(overlap, start)``), frame 0 counting
    ``first_cost`` (it yields one video frame instead of four). With a ``chunk_size``, chunks of that
    many frames go to the ranks round-robin. Either way chunk 0 starts at frame 0 on rank 0 and ranks
    beyond the number of chunks own none.
    """
    _check_pos_int("num_frames", num_frames)
    _check_pos_int("world_size", world_size)
    _check_pos_int("overlap", overlap)
    if chunk_size is not None:
        _check_pos_int("chunk_size", chunk_size)

    def warm(s):
        return max(0, s - overlap) if s else 0

    def chunk(i, rank, s, e):
        return Chunk(index=i, rank=rank, start=s, stop=e, warm_start=warm(s))

    if chunk_size is not None:
        bounds = list(range(0, num_frames, chunk_size))
        chunks = tuple(chunk(i, i % world_size, s, min(s + chunk_size, num_frames)) for i, s in enumerate(bounds))
        return ChunkPlan(num_frames, world_size, overlap, chunk_size, chunks)

    if cost is None:
        def cost(w, s, e):
            return (e - s) - (1 - first_cost if s == 0 else 0) + (s - w)

    def greedy(limit):
        out, s = [], 0
        while s < num_frames and len(out) < world_size:
            e = s + 1
            while e < num_frames and cost(warm(s), s, e + 1) <= limit:
                e += 1
            out.append((s, e))
            s = e
        return out if s >= num_frames else None

    lo, hi = 0.0, float(cost(0, 0, num_frames))
    best = greedy(hi)
    for _ in range(60):  # bisection on the largest per-rank cost
        mid = (lo + hi) / 2
        got = greedy(mid)
        if got is None:
            lo = mid
        else:
            hi, best = mid, got
    chunks = tuple(chunk(i, i, s, e) for i, (s, e) in enumerate(best))
    return ChunkPlan(num_frames, world_size, overlap, None, chunks)


def run_chunked(adapter: VAEAdapter, coll: _Collectives, plan: ChunkPlan, kind: str, inner, inp: torch.Tensor,
                args: tuple, kwargs: dict, *, gather: str, phase: Callable[..., Any] | None = None):
    """One chunked call of the wrapped method ``inner`` by ``plan``: its return value for the whole input.

    ``phase(name, **info)``: a context manager timing each phase (chunk, concat_pad, gather, stitch);
    None = untimed. ``gather``: "all" (every rank gets the video) or "rank0" (the others get 0 frames).
    """
    ad, comm = adapter, coll.comm
    if phase is None:
        def phase(name, **info):
            return contextlib.nullcontext()
    full_shape = ad.out_shape(inp, kind)
    frames = {c.index: ad.out_frames(c.start, c.stop, kind) for c in plan.chunks}
    per_rank = [sum(frames[c.index] for c in plan.for_rank(r)) for r in range(comm.size)]
    width = max(per_rank)
    parts = []
    for c in plan.for_rank(comm.rank):
        with phase("chunk", index=c.index, warm_start=c.warm_start, start=c.start, stop=c.stop):
            out = ad.run_chunk(inner, inp, c, kind)
        if out.shape[2] != frames[c.index]:
            raise RuntimeError(f"parallel VAE: chunk {c} gave {out.shape[2]} frames, expected {frames[c.index]}")
        parts.append(out)
    buf_shape = list(full_shape)
    buf_shape[2] = width
    with phase("concat_pad"):
        if parts:
            local = pad_dim(torch.cat(parts, dim=2) if len(parts) > 1 else parts[0], 2, width)
        else:
            local = inp.new_zeros(buf_shape)
    if list(local.shape) != buf_shape:
        raise RuntimeError(f"parallel VAE: local buffer {tuple(local.shape)} != expected {tuple(buf_shape)}")
    to_all = gather == "all"
    with phase("gather"):
        stacked = coll.gather_equal(local, to_all=to_all, root=0)
    if stacked is None:  # not the root with gather="rank0": an empty (0-frame) video
        empty = list(full_shape)
        empty[2] = 0
        return ad.wrap(inp.new_empty(empty), kind, *args, **kwargs)
    with phase("stitch"):
        offsets = [0] * comm.size
        pieces = []
        for c in plan.chunks:
            f = frames[c.index]
            pieces.append(stacked[c.rank].narrow(2, offsets[c.rank], f))
            offsets[c.rank] += f
        video = torch.cat(pieces, dim=2)
    if tuple(video.shape) != tuple(full_shape):
        raise RuntimeError(f"parallel VAE: stitched {tuple(video.shape)} != expected {tuple(full_shape)}")
    return ad.wrap(video, kind, *args, **kwargs)
