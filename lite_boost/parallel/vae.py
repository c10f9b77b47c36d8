"""Parallel decode / encode for causal video VAEs: a model-agnostic runner and its two modes.

A causal video VAE (Wan's ``AutoencoderKLWan`` is the one with an adapter today) runs its decoder
one latent frame at a time, carrying a causal feature cache from frame to frame; the encoder does
the same over groups of video frames. This module spreads that work over the ranks of a
:class:`~lite_boost.parallel.comm.Communicator` in one of two ways:

``"chunked"`` (the reference's temporal chunks, approximate)
    The latent frames are cut into contiguous chunks (:func:`plan_chunks`). A chunk ``[start,
    stop)`` that does not start at frame 0 first warms a fresh causal cache on the ``overlap``
    preceding latent frames (its first warm-up frame plays the role of frame 0), drops that warm-up
    output, then decodes its own frames. The chunk starting at frame 0 runs exactly like the
    sequential decode (bit-identical); the others differ from it only by what the cache forgot,
    which the seam study in docs/benchmarks/vae.md measures on a trained VAE. Each rank concatenates its
    chunks, pads them to the longest rank's length and ONE all_gather (or gather to rank 0) of
    those equal-size buffers assembles the video in frame order. Every rank takes part in the
    collective even when it owns no chunk, so fewer chunks than ranks never hang.

``"exact"`` (spatial split with halo exchange; equal to the sequential result up to fp32 rounding)
    Every call of the VAE's decoder (encoder) network is split by rows: each rank runs the network
    on its horizontal band of the input. Before every convolution with a spatial extent the ranks
    swap the boundary rows the kernel needs (one packed all_to_all per convolution, carrying the
    input and its causal cache together); modules that mix all positions (the mid-block attention)
    see the gathered full input and keep their band of the output; the call's output bands are
    gathered at the end. Each rank keeps the causal cache of its own band only, so the temporal
    loop, the frame bookkeeping and the VAE's own spatial tiling (each tile is split the same way)
    are the model's own code, untouched. Each band's convolution runs with the CPU kernel PyTorch
    would pick for the full frame (oneDNN rather than the im2col kernel a shorter band falls back to).

Trade-off: chunked sends only the decoded video (one collective) and scales to any rank count, but
its seams are approximate and every non-first chunk recomputes ``overlap`` warm-up frames; exact
pays one small collective per convolution per frame (a row of activations each way) and needs at
least one latent row per rank, but its output is the sequential output.

What is model-specific (how a frame range maps to video frames, which method to wrap, which modules
need halos) lives in a per-model :class:`VAEAdapter` registered with :func:`register_vae_adapter`
(``lite_boost.models.wan_vae`` registers Wan's). This module knows no model.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.distributed as dist

from ..config import ConfigError
from .comm import Communicator, pad_dim

__all__ = [
    "VAE_MODES",
    "VAE_GATHER",
    "Chunk",
    "ChunkPlan",
    "ParallelVAE",
    "SpatialLayout",
    "UnsupportedVAEError",
    "VAEAdapter",
    "VAECollectiveError",
    "check_vae_mode",
    "parallel_vae_state",
    "parallelize_vae",
    "plan_chunks",
    "register_vae_adapter",
    "split_rows",
    "unparallelize_vae",
    "vae_adapter_for",
]

logger = logging.getLogger("lite_boost.parallel.vae")

VAE_MODES = ("exact", "chunked", "off")
VAE_GATHER = ("all", "rank0")
_STATE_ATTR = "_lite_boost_parallel_vae"


# ------------------------------------------------------------------------------------------ errors
class UnsupportedVAEError(TypeError):
    """The VAE's class (and none of its bases) has a registered parallel-VAE adapter."""


class VAECollectiveError(RuntimeError):
    """A collective of the parallel VAE failed or timed out; the message names it and the group."""


# ------------------------------------------------------------------------------------------ registry
# class name -> adapter class; filled at import by ``register_vae_adapter`` decorators (models/).
_ADAPTERS: dict[str, type] = {}


def register_vae_adapter(*class_names: str, replace: bool = False):
    """Class decorator: register a :class:`VAEAdapter` subclass for the named VAE classes."""
    if not class_names or not all(isinstance(n, str) and n for n in class_names):
        raise ValueError(f"register_vae_adapter needs one or more class names, got {class_names!r}")

    def deco(cls):
        for name in class_names:
            if name in _ADAPTERS and _ADAPTERS[name] is not cls and not replace:
                raise ValueError(f"a parallel-VAE adapter is already registered for {name!r}; pass replace=True")
            _ADAPTERS[name] = cls
        return cls

    return deco


def _load_builtin_adapters() -> None:
    from ..registry import load_builtin_adapters as load  # importing the adapters registers them

    load()


def vae_adapter_for(vae) -> "VAEAdapter":
    """The adapter instance for ``vae`` (its class or nearest registered base), or UnsupportedVAEError."""
    _load_builtin_adapters()
    for cls in type(vae).__mro__:
        adapter_cls = _ADAPTERS.get(cls.__name__)
        if adapter_cls is not None:
            return adapter_cls(vae)
    raise UnsupportedVAEError(
        f"lite_boost has no parallel-VAE adapter for {type(vae).__name__}; VAE classes with one: "
        f"{sorted(_ADAPTERS)}. Set ParallelConfig(vae_parallel='off') to leave this VAE sequential, or "
        "register an adapter with lite_boost.parallel.vae.register_vae_adapter."
    )


# ------------------------------------------------------------------------------------------ adapter API
@dataclass
class SpatialLayout:
    """Which modules of one network (decoder or encoder) the exact mode hooks, and how.

    root: the network module; each of its calls is split by rows (dim -2) and gathered after.
    unit: the root input's rows per band must be a multiple of this (the network's spatial
        downsampling factor, so every band stays aligned at every resolution).
    halo: modules with a symmetric spatial kernel (stride 1, zero padding ``p`` rows each side):
        every tensor argument gets ``p`` neighbour rows each side, the output is trimmed by ``p``.
        With ``unpad``, a convolution of row stride ``s`` > 1 (kernel ``2p + 1``) fits too
        when every band is a multiple of ``s`` rows at its input (``unit``): the band plus ``p`` rows
        each side, unpadded, yields exactly the band's output rows; such modules always take the
        hook path (``overlap_halo`` does not apply).
    bottom_halo: stride-2 convolutions fed by an explicit (0, 1, 0, 1) zero pad: the padded last
        row is replaced by the next band's first row.
    gather: modules that mix all positions (attention): they see the gathered input and keep their
        band of the output (computed redundantly on every rank; keep these small).
    unpad: ``unpad(module) -> undo`` sets a halo module's row padding to 0 for the duration of the
        call (and returns what restores it). With it the halo rows (zeros at the image edges) stand
        in for the padding, so a convolution computes exactly its band (no extra rows to trim), and
        ``pairs`` can share one exchange. Without it each halo output is trimmed.
    pairs: ``(first, second)`` halo modules with only row-local, zero-preserving operations between
        them (norm without bias, SiLU, dropout in eval), the second fed by the first only: ONE
        exchange of ``rows(first) + rows(second)`` rows before the first replaces the two, the first
        computes ``rows(second)`` extra rows each side (zero beyond the image edge, as the second's
        padding would be), and the second reads them (its causal cache, stored by the model from its
        input, carries them too). Needs ``unpad`` and bands of at least that many rows (else the two
        exchange separately).
    replicate: halo modules whose row padding replicates the edge row (``F.pad(mode="replicate")``)
        instead of adding zeros: at the image's top and bottom edges their halo rows are copies of the
        band's edge row (with ``unpad`` they then stand in for that padding exactly). Not for ``pairs``.
    band_random: modules that draw random tensors shaped like their input's frame (``torch.randn`` /
        ``torch.rand`` with the rows at dim -2, e.g. a decoder's noise injection): in a split call such
        a draw of the band's rows draws the whole frame's (the same random stream as one process, given
        the same generator state on every rank) and keeps this rank's rows.
    """

    root: torch.nn.Module
    unit: int = 1
    halo: list = field(default_factory=list)  # [(module, rows)]
    bottom_halo: list = field(default_factory=list)  # [module]
    gather: list = field(default_factory=list)  # [module]
    unpad: Callable[[torch.nn.Module], Callable[[], None]] | None = None
    pairs: list = field(default_factory=list)  # [(first, second)]
    replicate: list = field(default_factory=list)  # [halo module]
    band_random: list = field(default_factory=list)  # [module]


class VAEAdapter:
    """What the runner needs to know about one VAE class (subclass per model, in ``models/``).

    The frame axis is dim 2 of inputs and outputs (B, C, T, H, W). ``kind`` is "decode" or "encode".
    """

    decode_method = "_decode"  # instance method wrapped for decode (called per batch slice)
    encode_method = "_encode"
    modes = ("exact", "chunked")  # the parallel modes this VAE supports (:func:`check_vae_mode`)
    default_overlap = 1  # chunked-mode warm-up latent frames when the config leaves it None (decode)
    default_encode_overlap = 1  # the same for encode

    def __init__(self, vae):
        self.vae = vae

    # frame bookkeeping
    def num_units(self, inp: torch.Tensor, kind: str) -> int:
        """Number of latent frames the call covers (the unit chunks are made of)."""
        raise NotImplementedError

    def out_frames(self, start: int, stop: int, kind: str) -> int:
        """Output frames of the latent-frame range [start, stop)."""
        raise NotImplementedError

    def out_shape(self, inp: torch.Tensor, kind: str) -> tuple[int, ...]:
        """Shape of the whole call's output tensor."""
        raise NotImplementedError

    # running
    def run_chunk(self, inner: Callable, inp: torch.Tensor, chunk: "Chunk", kind: str) -> torch.Tensor:
        """Output frames of ``chunk`` (warm-up done and dropped) with ``inner`` = the wrapped method."""
        raise NotImplementedError

    def unwrap(self, out, kind: str) -> torch.Tensor:
        """The tensor inside the wrapped method's return value."""
        return out

    def row_local_tail(self, inp: torch.Tensor, kind: str) -> bool:
        """True when the wrapped method does nothing but row-local work around its network calls for
        this input (e.g. no spatial tiling): exact mode then gathers the final output once instead of
        each network call's output. Default False (gather per call)."""
        return False

    def wrap(self, tensor: torch.Tensor, kind: str, *args, **kwargs):
        """Build the wrapped method's return value around ``tensor``."""
        return tensor

    def spatial_layout(self, kind: str) -> SpatialLayout:
        raise NotImplementedError

    # planning
    def chunk_cost(self, warm_start: int, start: int, stop: int, kind: str) -> float:
        """Compute of one chunk run (warm-up on [warm_start, start), then [start, stop)) in units of one
        later latent frame; the chunked plan balances the ranks by it. Default: one unit per frame."""
        return float(stop - warm_start)

    def chunk_cost_fn(self, kind: str) -> Callable[[int, int, int], float]:
        return lambda w, s, e: self.chunk_cost(w, s, e, kind)


def check_vae_mode(adapter: VAEAdapter, mode: str | None) -> None:
    """ConfigError when ``mode`` ("exact" / "chunked"; None = "exact") is not among the adapter's ``modes``."""
    mode = "exact" if mode is None else mode
    if mode in ("exact", "chunked") and mode not in adapter.modes:
        raise ConfigError(f"vae_parallel={mode!r} is not supported for {type(adapter.vae).__name__} "
                          f"({type(adapter).__name__}); valid vae_parallel here: {list(adapter.modes) + ['off']}")


# ------------------------------------------------------------------------------------------ planning
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


def split_rows(total: int, parts: int, unit: int = 1) -> list[int] | None:
    """Balanced band heights (multiples of ``unit``) summing to ``total``; None when a band would be empty."""
    if total % unit or total // unit < parts:
        return None
    base, extra = divmod(total // unit, parts)
    return [(base + (1 if r < extra else 0)) * unit for r in range(parts)]


# ------------------------------------------------------------------------------------------ collectives
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

    def gather_equal(self, buf: torch.Tensor, to_all: bool, root: int = 0) -> torch.Tensor | None:
        """Stack equal-size ``buf`` of every rank (P, *buf.shape) on every rank or only on ``root``."""
        comm = self.comm
        if comm.size == 1:
            return buf.unsqueeze(0)
        buf = buf.contiguous()
        if to_all:
            flat = buf.reshape(1, -1)
            out = flat.new_empty((comm.size, flat.shape[1]))
            with self._guard("vae_gather"):
                comm.all_gather_into(out, flat, op="vae_gather")
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
        ``after`` rows of the next one (at the ends of the band order: zeros, or with ``edge="replicate"``
        copies of the tensor's own first / last row). One packed all_to_all.

        ``wait=False`` starts the exchange and returns ``finish()``, which waits for it and returns the
        result: the caller computes what needs no halo in between."""
        comm = self.comm
        P, r = comm.size, comm.rank
        dtype = tensors[0].dtype
        if edge not in ("zeros", "replicate"):
            raise ValueError(f"halo edge must be one of ['zeros', 'replicate'], got {edge!r}")
        if any(t.dtype != dtype for t in tensors):
            raise ValueError("halo exchange needs tensors of one dtype")
        for t in tensors:
            if t.shape[dim] < max(before, after):
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


# ------------------------------------------------------------------------------------------ exact mode

def _tensor_args(args, kwargs):
    """The tensors among a call's positional and keyword arguments, in order, and a function that
    rebuilds (args, kwargs) with replacements for them."""
    idx = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    keys = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor)]
    tensors = [args[i] for i in idx] + [kwargs[k] for k in keys]

    def rebuild(new):
        a, kw = list(args), dict(kwargs)
        for j, i in enumerate(idx):
            a[i] = new[j]
        for j, k in enumerate(keys):
            kw[k] = new[len(idx) + j]
        return tuple(a), kw

    return tensors, rebuild


def _onednn_for_full_frame(module, x: torch.Tensor, weight, bias, full_rows: int) -> bool:
    """True when PyTorch would run this convolution with oneDNN on the full frame (``full_rows`` input
    rows, padding included) but picks another CPU kernel for this band-sized input.

    PyTorch's CPU heuristic chooses oneDNN or its im2col ``slow_conv3d`` / ``thnn_conv2d`` from the
    input size; a band of the full frame can fall below the threshold that the full frame is above,
    and the im2col kernels are several times slower for the VAE's 3x3(x3) convolutions (e.g. 6-10x
    for 16 channels at 240 x 416, measured). Running the band with the full frame's kernel keeps the
    exact mode from turning each rank's half of the work into more than the whole."""
    if x.device.type != "cpu" or x.dim() not in (4, 5) or getattr(module, "transposed", False):
        return False
    if not (torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled):
        return False
    select = getattr(torch._C, "_select_conv_backend", None)
    if select is None or getattr(module, "padding_mode", "zeros") != "zeros" or isinstance(module.padding, str):
        return False
    shape = list(x.shape)
    shape[-2] = full_rows
    full = x.narrow(-2, 0, 1).expand(shape)  # a view with the full frame's shape: no memory
    args = (list(module.stride), list(module.padding), list(module.dilation), False, [0] * len(module.stride),
            module.groups, None)
    try:
        onednn = torch._C._ConvBackend.Mkldnn
        return select(full, weight, bias, *args) == onednn and select(x, weight, bias, *args) != onednn
    except (RuntimeError, TypeError, AttributeError):  # private API changed: keep PyTorch's own choice
        return False


# oneDNN reorders a CPU convolution's weight into its blocked layout at every call, so each call costs
# at least that reorder, about 1.4 ms per MB of fp32 weight on one core (measured: 0.17 s for a 3x3x3
# 1024 -> 1024 convolution, 113 MB, producing one output row; 9 ms per edge strip at 256 -> 256, 7 MB).
# The overlapped exchange runs a halo convolution as three calls (inner rows + two edge strips); above
# about 1 MB the two extra calls cost more than the exchange they hide (~3 ms for a gloo all_to_all on
# a CPU host), so such convolutions take the single-call path (Wan2.2-5B's VAE: all but conv_out).
_OVERLAP_MAX_WEIGHT_BYTES_CPU = 1 << 20


def _check_overlap_halo(value) -> None:
    if not (value is True or value is False or value == "auto"):
        raise ConfigError(f"overlap_halo must be one of [True, False, 'auto'], got {value!r}")


def _conv_of(module):
    """The Conv2d / Conv3d a halo module runs: itself, or the only one inside a wrapper module (e.g. a
    causal convolution that pads, then calls its ``Conv3d``); None when there is none or several."""
    if isinstance(module, (torch.nn.Conv2d, torch.nn.Conv3d)):
        return module
    convs = [m for m in module.modules() if isinstance(m, (torch.nn.Conv2d, torch.nn.Conv3d))]
    return convs[0] if len(convs) == 1 else None


def _overlap_pays(module) -> bool:
    """Whether the overlapped (three-call) path suits this halo module ("auto" policy): always off the
    CPU, on the CPU only for weights up to ``_OVERLAP_MAX_WEIGHT_BYTES_CPU`` (a wrapper's: its conv's)."""
    weight = getattr(_conv_of(module) or module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.device.type != "cpu":
        return True
    return weight.numel() * weight.element_size() <= _OVERLAP_MAX_WEIGHT_BYTES_CPU


def _row_stride(module) -> int:
    """The row (dim -2) stride of a convolution module (1 for anything without a ``stride``)."""
    stride = getattr(module, "stride", 1)
    return stride[-2] if isinstance(stride, (tuple, list)) else int(stride)


class _FullFrameRandom(torch.overrides.TorchFunctionMode):
    """Active while a ``band_random`` module runs on a band: ``torch.randn`` / ``torch.rand`` of a shape
    with this band's rows at ``dim`` draw the full frame's rows and return this rank's."""

    FUNCS = (torch.randn, torch.rand)

    def __init__(self, band: "_Band", rank: int, dim: int):
        super().__init__()
        self.band, self.rank, self.dim = band, rank, dim

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.FUNCS and args:
            size = list(args[0]) if isinstance(args[0], (tuple, list, torch.Size)) else list(args)
            if len(size) >= -self.dim:
                rows = size[self.dim]
                sizes = self.band.sizes_like(rows, self.rank)
                size[self.dim] = sum(sizes)
                return func(size, **kwargs).narrow(self.dim, sum(sizes[: self.rank]), rows)
        return func(*args, **kwargs)


class _Band:
    """The row split of the network call in progress (None between calls): rank band sizes at root level."""

    def __init__(self):
        self.sizes: list[int] | None = None

    def sizes_like(self, rows_here: int, rank: int) -> list[int]:
        factor = Fraction(rows_here, self.sizes[rank])
        out = [s * factor for s in self.sizes]
        if any(v.denominator != 1 for v in out):
            raise RuntimeError(f"parallel VAE: band sizes {self.sizes} do not scale to {rows_here} rows on this rank")
        return [int(v) for v in out]


class _SpatialSplit:
    """Hooks that make one network run on row bands (installed for the duration of one VAE call).

    ``defer_gather``: the root returns its band (the caller gathers the method's final output once,
    valid when everything after the network calls is row-local); ``root_sizes`` then holds the band
    sizes of the split calls (None when no call was split). ``overlap_halo``: True / False for every
    halo module, or "auto" (per module, :func:`_overlap_pays`); it needs the layout's ``unpad``.
    """

    DIM = -2

    def __init__(self, layout: SpatialLayout, coll: _Collectives, defer_gather: bool = False,
                 overlap_halo: bool | str = "auto"):
        _check_overlap_halo(overlap_halo)
        self.layout = layout
        self.overlap_halo = overlap_halo if layout.unpad is not None else False
        self.patched: list = []  # (module, attribute, had an instance attribute, previous), in patch order
        self.coll = coll
        self.band = _Band()
        self.handles: list = []
        self.warned = False
        self.defer = defer_gather
        self.root_sizes: list[int] | None = None
        self.merged: dict[int, bool] = {}  # id(second of a pair) -> its input carries the halo (this call)
        self.full_rows: dict[int, int] = {}  # id(conv) -> its full-frame input rows, padding included (this call)
        self.onednn: dict[tuple, bool] = {}  # (id(conv), band input shape, full rows) -> run the band with oneDNN
        self.replicate = {id(m) for m in layout.replicate}  # halo modules with replicate row padding

    # --- root: split the input rows, gather the output rows
    def _root_forward(self, inner):
        comm, band, dim = self.coll.comm, self.band, self.DIM

        def forward(x, *args, **kwargs):
            sizes = split_rows(x.shape[dim], comm.size, self.layout.unit)
            if sizes is None:  # too few rows for every rank: every rank runs the whole call (exact)
                if not self.warned:
                    logger.warning("parallel VAE (exact): %d rows cannot give each of %d ranks a band of a multiple "
                                   "of %d rows; this call runs unsplit on every rank", x.shape[dim], comm.size,
                                   self.layout.unit)
                    self.warned = True
                if self.defer and self.root_sizes is not None:
                    raise RuntimeError("parallel VAE (exact): split and unsplit network calls in one deferred call")
                return inner(x, *args, **kwargs)
            start = sum(sizes[:comm.rank])
            band.sizes = sizes
            # halo rows replace the row padding, in split calls only (an unsplit call keeps the model's)
            undo = [self.layout.unpad(m) for m, _ in self.layout.halo] if self.layout.unpad is not None else []
            try:
                out = inner(x.narrow(dim, start, sizes[comm.rank]), *args, **kwargs)
            finally:
                band.sizes = None
                for u in reversed(undo):
                    u()
            if self.defer:
                if self.root_sizes not in (None, sizes):
                    raise RuntimeError(f"parallel VAE (exact): band sizes changed within one call ({self.root_sizes} "
                                       f"-> {sizes})")
                self.root_sizes = sizes
                return out
            return self.coll.gather_rows(out, dim, band_sizes_out(sizes, out.shape[dim], comm.rank))

        return forward

    def gather_output(self, out: torch.Tensor) -> torch.Tensor:
        """The deferred gather of the wrapped method's final (band) output."""
        if self.root_sizes is None:
            return out
        return self.coll.gather_rows(out, self.DIM, band_sizes_out(self.root_sizes, out.shape[self.DIM],
                                                                   self.coll.comm.rank))

    # --- halo convolutions
    def _halo_extent(self, module, rows, first_of, band_rows) -> tuple[int, bool]:
        """(rows to exchange, merged) for one halo module. The first of a pair (``first_of=(second_module,
        rows2)``) also carries the second's halo when every band has room for both: the same decision on
        every rank (from the global band sizes at this resolution), recorded for the second."""
        sizes = self.band.sizes_like(band_rows, self.coll.comm.rank)
        self.full_rows[id(module)] = sum(sizes) + 2 * rows
        if first_of is None:
            return rows, False
        partner, rows2 = first_of
        self.full_rows[id(partner)] = sum(sizes) + 2 * rows2
        merged = min(sizes) >= rows + rows2
        self.merged[id(partner)] = merged
        return (rows + rows2 if merged else rows), merged

    def _edge(self, module) -> str:
        return "replicate" if id(module) in self.replicate else "zeros"

    def _zero_outer_rows(self, out: torch.Tensor, rows2: int) -> None:
        """Zero the rows a merged first conv computed beyond the image edge (the second's zero padding)."""
        dim, comm = self.DIM, self.coll.comm
        if comm.rank == 0:
            out.narrow(dim, 0, rows2).zero_()
        if comm.rank == comm.size - 1:
            out.narrow(dim, out.shape[dim] - rows2, rows2).zero_()

    def _halo_hooks(self, rows, first_of: tuple | None = None, second: bool = False):
        """Pre/post hooks of one halo module. ``first_of=(second_module, rows2)``: the first of a pair;
        ``second``: the second of a pair (reads its halo from the first's wider output when merged)."""
        unpadded = self.layout.unpad is not None
        dim = self.DIM

        def pre(module, args, kwargs):
            if self.band.sizes is None:
                return None
            if second and self.merged.get(id(module)):
                return None  # the input (and the cached rows) already carry the halo
            tensors, rebuild = _tensor_args(args, kwargs)
            ext, _ = self._halo_extent(module, rows, first_of, tensors[0].shape[dim])
            halos = self.coll.halo(tensors, dim, ext, ext, edge=self._edge(module))
            return rebuild([torch.cat([p, t, n], dim=dim) for t, (p, n) in zip(tensors, halos)])

        def post(module, args, output):
            if self.band.sizes is None:
                return None
            if not unpadded:
                return output.narrow(dim, rows, output.shape[dim] - 2 * rows)
            if first_of is not None and self.merged.get(id(first_of[0])):
                self._zero_outer_rows(output, first_of[1])
            return None

        return pre, post

    def _halo_forward(self, module, orig, rows, first_of: tuple | None = None, second: bool = False):
        """Forward of an unpadded halo module that overlaps its exchange with compute: it starts the
        exchange, runs the module on its own band (the output rows that need no halo), then on the
        two thin strips at the band edges with the received rows, and concatenates (one exchange, the
        same rows as the hook path; bands of <= 2 * rows rows take the hook path's order)."""
        dim = self.DIM

        def forward(*args, **kwargs):
            if self.band.sizes is None or (second and self.merged.get(id(module))):
                return orig(*args, **kwargs)  # not split / the input already carries the halo
            tensors, rebuild = _tensor_args(args, kwargs)

            def call(ts):
                a, kw = rebuild(ts)
                return orig(*a, **kw)

            ext, merged = self._halo_extent(module, rows, first_of, tensors[0].shape[dim])
            band = tensors[0].shape[dim]
            if band > 2 * rows:
                finish = self.coll.halo(tensors, dim, ext, ext, wait=False, edge=self._edge(module))
                inner = call(tensors)  # output rows [rows, band - rows): no halo needed
                halos = finish()
                top = call([torch.cat([p, t.narrow(dim, 0, 2 * rows)], dim=dim) for t, (p, _) in zip(tensors, halos)])
                bot = call([torch.cat([t.narrow(dim, band - 2 * rows, 2 * rows), n], dim=dim)
                            for t, (_, n) in zip(tensors, halos)])
                out = torch.cat([top, inner, bot], dim=dim)
            else:
                halos = self.coll.halo(tensors, dim, ext, ext, edge=self._edge(module))
                out = call([torch.cat([p, t, n], dim=dim) for t, (p, n) in zip(tensors, halos)])
            if merged:
                self._zero_outer_rows(out, first_of[1])
            return out

        return forward

    def _bottom_pre(self, module, args):
        if self.band.sizes is None:
            return None
        x = args[0]
        # the input carries the model's one row of bottom padding
        self.full_rows[id(module)] = sum(self.band.sizes_like(x.shape[self.DIM] - 1, self.coll.comm.rank)) + 1
        (_, nxt), = self.coll.halo([x], self.DIM, 0, 1)
        if self.coll.comm.rank == self.coll.comm.size - 1:
            return None  # the last band keeps the model's own zero row
        return (torch.cat([x.narrow(self.DIM, 0, x.shape[self.DIM] - 1), nxt], dim=self.DIM),) + tuple(args[1:])

    # --- the full frame's convolution kernel for a band
    def _conv_forward(self, module, orig, halo_module):
        """``module``'s conv kernel call; ``halo_module``: the layout's module it runs in (itself, or a
        wrapper that pads, then calls it), whose full-frame rows it sees."""
        key_id = id(halo_module)

        def conv_forward(x, weight, bias):
            full = self.full_rows.get(key_id) if self.band.sizes is not None else None
            if full is not None:
                key = (id(module), tuple(x.shape), full)
                use = self.onednn.get(key)
                if use is None:
                    use = self.onednn[key] = _onednn_for_full_frame(module, x, weight, bias, full)
                if use:
                    return torch.ops.aten.mkldnn_convolution(x, weight, bias, list(module.padding),
                                                             list(module.stride), list(module.dilation), module.groups)
            return orig(x, weight, bias)

        return conv_forward

    # --- global modules: full input in, own band out
    def _gather_pre(self, module, args):
        if self.band.sizes is None:
            return None
        x = args[0]
        sizes = self.band.sizes_like(x.shape[self.DIM], self.coll.comm.rank)
        return (self.coll.gather_rows(x, self.DIM, sizes),) + tuple(args[1:])

    def _gather_post(self, module, args, output):
        if self.band.sizes is None:
            return None
        # the output covers every band: keep this rank's (band sizes scaled to this resolution)
        sizes = self.band.sizes
        factor = Fraction(output.shape[self.DIM], sum(sizes))
        rank = self.coll.comm.rank
        return output.narrow(self.DIM, int(sum(sizes[:rank]) * factor), int(sizes[rank] * factor))

    # --- modules that draw frame-shaped random tensors
    def _band_random_forward(self, orig):
        def forward(*args, **kwargs):
            if self.band.sizes is None:
                return orig(*args, **kwargs)
            with _FullFrameRandom(self.band, self.coll.comm.rank, self.DIM):
                return orig(*args, **kwargs)

        return forward

    def _patch(self, mod, name: str, make: Callable) -> None:
        """Set ``mod.<name> = make(current)`` on the instance; ``remove`` restores what was there."""
        self.patched.append((mod, name, name in mod.__dict__, mod.__dict__.get(name)))
        setattr(mod, name, make(getattr(mod, name)))

    def install(self):
        layout = self.layout
        if any(id(m) in self.replicate for pair in layout.pairs for m in pair):
            raise ValueError("parallel VAE: a halo module with replicate row padding cannot be one of "
                             "SpatialLayout.pairs (their merged exchange assumes zero padding)")
        self._patch(layout.root, "forward", self._root_forward)
        rows_of = {id(m): r for m, r in layout.halo}
        firsts, seconds = {}, set()
        if layout.unpad is not None:
            for a, b in layout.pairs:
                if id(a) in rows_of and id(b) in rows_of:
                    firsts[id(a)] = (b, rows_of[id(b)])
                    seconds.add(id(b))
        try:
            for mod, rows in layout.halo:
                # a strided convolution's output rows do not line up with its inner rows: hook path only
                if _row_stride(mod) == 1 and (self.overlap_halo is True or
                                              (self.overlap_halo == "auto" and _overlap_pays(mod))):
                    self._patch(mod, "forward", lambda orig, mod=mod, rows=rows: self._halo_forward(
                        mod, orig, rows, first_of=firsts.get(id(mod)), second=id(mod) in seconds))
                    continue
                pre, post = self._halo_hooks(rows, first_of=firsts.get(id(mod)), second=id(mod) in seconds)
                self.handles.append(mod.register_forward_pre_hook(pre, with_kwargs=True))
                self.handles.append(mod.register_forward_hook(post))
            for mod in layout.bottom_halo:
                self.handles.append(mod.register_forward_pre_hook(self._bottom_pre))
            for mod in [m for m, _ in layout.halo] + list(layout.bottom_halo):
                conv = _conv_of(mod)
                if conv is not None:
                    self._patch(conv, "_conv_forward",
                                lambda orig, conv=conv, mod=mod: self._conv_forward(conv, orig, mod))
            for mod in layout.gather:
                self.handles.append(mod.register_forward_pre_hook(self._gather_pre))
                self.handles.append(mod.register_forward_hook(self._gather_post))
            for mod in layout.band_random:
                self._patch(mod, "forward", self._band_random_forward)
        except BaseException:
            self.remove()
            raise
        return self

    def remove(self):
        for h in self.handles:
            h.remove()
        self.handles.clear()
        while self.patched:  # newest first, the root's forward last
            mod, name, had, prev = self.patched.pop()
            if had:
                setattr(mod, name, prev)
            elif name in mod.__dict__:
                delattr(mod, name)


def band_sizes_out(sizes_in: list[int], rows_out_here: int, rank: int) -> list[int]:
    factor = Fraction(rows_out_here, sizes_in[rank])
    out = [s * factor for s in sizes_in]
    if any(v.denominator != 1 for v in out):
        raise RuntimeError(f"parallel VAE: output rows {rows_out_here} do not scale the bands {sizes_in}")
    return [int(v) for v in out]


# ------------------------------------------------------------------------------------------ runner
class ParallelVAE:
    """The parallel decode / encode of one VAE instance (what ``parallelize_vae`` installs).

    Attributes: ``mode`` ("exact" | "chunked"), ``overlap``, ``chunk_size``, ``gather`` ("all" |
    "rank0"), ``comm`` (the Communicator), ``adapter``, ``last_plan`` (the ChunkPlan of the last
    chunked call, for inspection), ``calls`` (counts per kind), ``overlap_halo`` (exact mode: True =
    start each halo exchange before convolving the band's inner rows, then convolve the two edge
    strips; False = one convolution call after the exchange; "auto", the default = True where the
    two extra calls pay, per module), ``record_phases`` (chunked mode: time each call's phases into
    ``last_phases``, a list of ``{"name", "wall", "cpu", ...}`` records: one ``"chunk"`` per own
    chunk with its frame range, then ``"concat_pad"``, ``"gather"``, ``"stitch"``; off unless set, or
    unless the environment has ``LITE_BOOST_VAE_PHASES=1``).
    """

    def __init__(self, vae, adapter: VAEAdapter, comm: Communicator, *, mode: str, overlap: int | None = None,
                 chunk_size: int | None = None, gather: str = "all", timeout_s: float | None = None,
                 overlap_halo: bool | str = "auto"):
        if mode not in ("exact", "chunked"):
            raise ConfigError(f"vae_parallel must be one of ['exact', 'chunked'] to install, got {mode!r}")
        if gather not in VAE_GATHER:
            raise ConfigError(f"vae_gather must be one of {list(VAE_GATHER)}, got {gather!r}")
        if overlap is not None:
            _check_pos_int("vae_overlap", overlap)
        if chunk_size is not None:
            _check_pos_int("vae_chunk_size", chunk_size)
        _check_overlap_halo(overlap_halo)
        self.vae = vae
        self.adapter = adapter
        self.comm = comm
        self.mode = mode
        self.overlap = overlap
        self.chunk_size = chunk_size
        self.gather = gather
        self.coll = _Collectives(comm, timeout_s)
        self.inner: dict[str, Any] = {}
        self.previous: dict[str, Any] = {}
        self.last_plan: ChunkPlan | None = None
        self.calls = {"decode": 0, "encode": 0}
        # exact mode: overlap each halo exchange with the convolution of the band's inner rows (True),
        # never (False), or where the extra convolution calls pay ("auto": see _overlap_pays)
        self.overlap_halo: bool | str = overlap_halo
        # chunked mode: when True, each call's phases (per chunk, concat/pad, gather, stitch) are timed
        # into ``last_phases`` (benchmarks; env LITE_BOOST_VAE_PHASES=1 turns it on at install)
        self.record_phases = os.environ.get("LITE_BOOST_VAE_PHASES", "") not in ("", "0")
        self.last_phases: list[dict] = []

    def overlap_for(self, kind: str) -> int:
        """The warm-up of ``kind`` ("decode" / "encode"): the configured overlap or the adapter's default."""
        if self.overlap is not None:
            return self.overlap
        return self.adapter.default_overlap if kind == "decode" else self.adapter.default_encode_overlap

    def __repr__(self) -> str:
        return (f"ParallelVAE(mode={self.mode!r}, overlap={self.overlap}, chunk_size={self.chunk_size}, "
                f"gather={self.gather!r}, ranks={self.comm.size})")

    # --- install / remove on the instance
    def install(self):
        for kind, name in (("decode", self.adapter.decode_method), ("encode", self.adapter.encode_method)):
            if name in self.vae.__dict__:
                self.previous[kind] = self.vae.__dict__[name]
            self.inner[kind] = getattr(self.vae, name)
            object.__setattr__(self.vae, name, self._make(kind))
        object.__setattr__(self.vae, _STATE_ATTR, self)
        return self

    def remove(self):
        for kind, name in (("decode", self.adapter.decode_method), ("encode", self.adapter.encode_method)):
            if name in self.vae.__dict__:
                object.__delattr__(self.vae, name)
            if kind in self.previous:
                object.__setattr__(self.vae, name, self.previous[kind])
        if _STATE_ATTR in self.vae.__dict__:
            object.__delattr__(self.vae, _STATE_ATTR)

    def _make(self, kind):
        def call(inp, *args, **kwargs):
            return self.run(kind, inp, *args, **kwargs)

        call.__name__ = f"parallel_{kind}"
        return call

    # --- the calls
    def run(self, kind: str, inp: torch.Tensor, *args, **kwargs):
        self.calls[kind] += 1
        inner = self.inner[kind]
        if self.comm.size == 1:
            return inner(inp, *args, **kwargs)
        if self.mode == "exact":
            ad = self.adapter
            defer = ad.row_local_tail(inp, kind)
            split = _SpatialSplit(ad.spatial_layout(kind), self.coll, defer_gather=defer,
                                  overlap_halo=self.overlap_halo).install()
            try:
                out = inner(inp, *args, **kwargs)
            finally:
                split.remove()
            if not defer:
                return out
            return ad.wrap(split.gather_output(ad.unwrap(out, kind)), kind, *args, **kwargs)
        return self._chunked(kind, inner, inp, *args, **kwargs)

    @contextlib.contextmanager
    def _phase(self, name: str, **info):
        """Time one phase of a chunked call (wall and this thread's CPU) into ``last_phases``."""
        if not self.record_phases:
            yield
            return
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            yield
        finally:
            self.last_phases.append(dict(name=name, wall=time.perf_counter() - t0, cpu=time.thread_time() - c0,
                                         **info))

    def _chunked(self, kind, inner, inp, *args, **kwargs):
        ad, comm = self.adapter, self.comm
        self.last_phases = []
        n = ad.num_units(inp, kind)
        plan = plan_chunks(n, comm.size, overlap=self.overlap_for(kind), chunk_size=self.chunk_size,
                           cost=ad.chunk_cost_fn(kind))
        self.last_plan = plan
        full_shape = ad.out_shape(inp, kind)
        frames = {c.index: ad.out_frames(c.start, c.stop, kind) for c in plan.chunks}
        per_rank = [sum(frames[c.index] for c in plan.for_rank(r)) for r in range(comm.size)]
        width = max(per_rank)
        parts = []
        for c in plan.for_rank(comm.rank):
            with self._phase("chunk", index=c.index, warm_start=c.warm_start, start=c.start, stop=c.stop):
                out = ad.run_chunk(inner, inp, c, kind)
            if out.shape[2] != frames[c.index]:
                raise RuntimeError(f"parallel VAE: chunk {c} gave {out.shape[2]} frames, expected {frames[c.index]}")
            parts.append(out)
        buf_shape = list(full_shape)
        buf_shape[2] = width
        with self._phase("concat_pad"):
            if parts:
                local = pad_dim(torch.cat(parts, dim=2) if len(parts) > 1 else parts[0], 2, width)
            else:
                local = inp.new_zeros(buf_shape)
        if list(local.shape) != buf_shape:
            raise RuntimeError(f"parallel VAE: local buffer {tuple(local.shape)} != expected {tuple(buf_shape)}")
        to_all = self.gather == "all"
        with self._phase("gather"):
            stacked = self.coll.gather_equal(local, to_all=to_all, root=0)
        if stacked is None:  # not the root with gather="rank0": an empty (0-frame) video
            empty = list(full_shape)
            empty[2] = 0
            return ad.wrap(inp.new_empty(empty), kind, *args, **kwargs)
        with self._phase("stitch"):
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


def parallel_vae_state(vae) -> ParallelVAE | None:
    """The ParallelVAE installed on ``vae`` (or None)."""
    return getattr(vae, "__dict__", {}).get(_STATE_ATTR)


def parallelize_vae(vae, comm: Communicator, *, mode: str | None = "exact", overlap: int | None = None,
                    chunk_size: int | None = None, gather: str = "all", timeout_s: float | None = None,
                    adapter: VAEAdapter | None = None, overlap_halo: bool | str = "auto") -> ParallelVAE | None:
    """Install the parallel decode / encode on ``vae`` (instance patch; ``unparallelize_vae`` removes it).

    mode: "exact", "chunked" or "off" (None = "exact" when ``comm.size > 1``, else "off").
    overlap_halo (exact mode): True, False or "auto" (see :class:`ParallelVAE`).
    Raises UnsupportedVAEError / ConfigError before any collective. Returns the runner or None (off).
    """
    if mode is None:
        mode = "exact" if comm.size > 1 else "off"
    if mode not in VAE_MODES:
        raise ConfigError(f"vae_parallel must be one of {list(VAE_MODES)}, got {mode!r}")
    adapter = adapter or vae_adapter_for(vae)
    check_vae_mode(adapter, mode)
    unparallelize_vae(vae)
    if mode == "off":
        return None
    runner = ParallelVAE(vae, adapter, comm, mode=mode, overlap=overlap, chunk_size=chunk_size, gather=gather,
                         timeout_s=timeout_s, overlap_halo=overlap_halo)
    return runner.install()


def unparallelize_vae(vae):
    """Remove what ``parallelize_vae`` installed (no-op when nothing is). Returns ``vae``."""
    state = parallel_vae_state(vae)
    if state is not None:
        state.remove()
    return vae
