"""Cached fp32 rotary position embedding for (frames, height, width) token grids.

diffusers' ``WanRotaryPosEmbed.forward`` rebuilds the full (1, S, 1, D) cos and sin tables at every
transformer call, and the attention processor rotates q and k with an ``empty_like`` plus two
strided writes. Here the table for a grid is built once, kept as a complex64 tensor of shape
(1, L, 1, D/2) (one unit phasor per interleaved pair) in a bounded LRU :class:`RopeCache`, and the
rotation is one complex multiply over q or k, computed in fp32 whatever the input dtype.

Pairs are interleaved, as in Wan: channels (2i, 2i+1) of a head form the complex number
x[2i] + j x[2i+1], rotated by angle pos * theta ** (-2i / dim) of its axis. The head dim is split
into t/h/w parts like diffusers: h = w = 2 * (D // 6), t = D - h - w.

Families whose RoPE module builds its own tables convert them once into the same cached form:
:func:`phasors_from_complex` (complex tables, e.g. Qwen-Image's) and :func:`phasors_from_cos_sin`
(interleaved real cos / sin tables, e.g. HunyuanVideo's or Flux's), each serving a row range with
identity rows past the sequence end; :meth:`RopeCache.get_or_build` keeps them under any key.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import NamedTuple, Sequence

import torch

__all__ = ["RotaryEmbedding", "RopeCache", "apply_rotary_emb", "rope_tables", "rotate", "axis_dims",
           "phasors_from_complex", "phasors_from_cos_sin"]


class RotaryEmbedding(NamedTuple):
    """Rotation phasors for a contiguous slice [start, stop) of a flattened token grid.

    freqs: complex64 tensor (1, stop - start, 1, head_dim / 2). Rows at or past ``seq_len``
        (padding added to make equal sequence shards) hold 1 + 0j, the identity rotation.
    """

    freqs: torch.Tensor
    start: int
    stop: int
    seq_len: int


def axis_dims(head_dim: int) -> tuple[int, int, int]:
    """(t, h, w) channel split of a head, as in diffusers' WanRotaryPosEmbed."""
    if not isinstance(head_dim, int) or head_dim <= 0 or head_dim % 2:
        raise ValueError(f"head_dim must be a positive even integer, got {head_dim!r}")
    h = w = 2 * (head_dim // 6)
    t = head_dim - h - w
    if t <= 0 or t % 2:
        raise ValueError(f"head_dim={head_dim} leaves no even temporal part (t={t}, h={h}, w={w})")
    return t, h, w


def _axis_phasors(n: int, dim: int, theta: float, device) -> torch.Tensor:
    # Same arithmetic as diffusers' get_1d_rotary_pos_embed(freqs_dtype=float64): angles in float64,
    # cos / sin rounded to float32. Identical tables, so boosted and stock outputs agree bit-for-bit
    # in the tables and only differ by the rounding of the multiply itself.
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device=device)[: dim // 2] / dim))
    ang = torch.outer(torch.arange(n, dtype=torch.float64, device=device), inv)
    return torch.complex(ang.cos().float(), ang.sin().float())


def rope_tables(grid: Sequence[int], head_dim: int, *, theta: float = 10000.0, device=None,
                start: int = 0, stop: int | None = None) -> RotaryEmbedding:
    """Build the phasors of a (frames, height, width) grid for tokens [start, stop) (no caching).

    Tokens are in raster order (frame-major, then row, then column) like Wan's patch embedding.
    ``stop`` may exceed the token count; the extra rows are identity rotations (padding).
    """
    grid = _check_grid(grid)
    f, h, w = grid
    seq_len = f * h * w
    start, stop = _check_range(start, stop, seq_len)
    td, hd, wd = axis_dims(head_dim)
    device = torch.device(device) if device is not None else torch.device("cpu")
    out = torch.ones(stop - start, head_dim // 2, dtype=torch.complex64, device=device)
    valid_stop = min(stop, seq_len)
    if valid_stop > start:
        idx = torch.arange(start, valid_stop, device=device)
        fi, rem = idx // (h * w), idx % (h * w)
        hi, wi = rem // w, rem % w
        t_tab = _axis_phasors(f, td, theta, device)
        h_tab = _axis_phasors(h, hd, theta, device)
        w_tab = _axis_phasors(w, wd, theta, device)
        out[: valid_stop - start] = torch.cat([t_tab[fi], h_tab[hi], w_tab[wi]], dim=-1)
    return RotaryEmbedding(out.view(1, stop - start, 1, head_dim // 2), start, stop, seq_len)


def phasors_from_complex(freqs: torch.Tensor, start: int = 0, stop: int | None = None) -> RotaryEmbedding:
    """Rows [start, stop) of complex tables ``freqs`` (S, D/2) as a RotaryEmbedding (1, n, 1, D/2).

    Rows at or past S (padding of an equal sequence shard) are identity rotations. The values are
    ``freqs`` rounded to complex64 (no new arithmetic), so rotating with them equals a complex
    multiply with the model's own tables.
    """
    if freqs.dim() != 2 or not freqs.is_complex():
        raise ValueError(f"freqs must be a complex (S, D/2) tensor, got {freqs.dtype} {tuple(freqs.shape)}")
    seq_len = freqs.shape[0]
    start, stop = _check_range(start, stop, seq_len)
    freqs = freqs.to(torch.complex64)
    rows = freqs[start:min(stop, seq_len)]
    if stop > seq_len:
        pad = torch.ones(stop - max(start, seq_len), freqs.shape[1], dtype=torch.complex64, device=freqs.device)
        rows = torch.cat([rows, pad])
    return RotaryEmbedding(rows.reshape(1, stop - start, 1, freqs.shape[1]).contiguous(), start, stop, seq_len)


def phasors_from_cos_sin(cos: torch.Tensor, sin: torch.Tensor, start: int = 0,
                         stop: int | None = None) -> RotaryEmbedding:
    """Interleaved real tables ``cos``, ``sin`` (S, D) (each value repeated for its pair) as phasors.

    The same conversion as :func:`apply_rotary_emb`: pair i takes ``cos[:, 2i]`` and ``sin[:, 2i + 1]``.
    """
    if cos.shape != sin.shape or cos.dim() != 2 or cos.shape[-1] % 2:
        raise ValueError(f"cos / sin must both be (S, D) with D even, got {tuple(cos.shape)} and {tuple(sin.shape)}")
    return phasors_from_complex(torch.complex(cos[:, 0::2].float(), sin[:, 1::2].float()), start, stop)


class RopeCache:
    """Bounded LRU of RoPE tables keyed by (grid, head_dim, theta, device, start, stop).

    One cache per boosted model (not a process-wide global): layers, denoising steps and CFG passes
    of that model reuse the same tensors. Thread-safe. Inside a graph traced by ``torch.compile``
    ``get`` bypasses the cache and builds the tables in the graph; with diffusers' regional
    compilation (``compile_repeated_blocks``) the RoPE module runs eagerly and the cache serves it.
    """

    def __init__(self, maxsize: int = 8):
        if isinstance(maxsize, bool) or not isinstance(maxsize, int) or maxsize < 1:
            raise ValueError(f"maxsize must be a positive integer, got {maxsize!r}")
        self.maxsize = maxsize
        self._data: OrderedDict = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(self, grid: Sequence[int], head_dim: int, *, theta: float = 10000.0, device=None,
            start: int = 0, stop: int | None = None) -> RotaryEmbedding:
        """The (t, h, w) grid tables of :func:`rope_tables`, cached."""
        grid = _check_grid(grid)
        device = torch.device(device) if device is not None else torch.device("cpu")
        key = (grid, int(head_dim), float(theta), str(device), int(start), stop)
        return self.get_or_build(key, lambda: rope_tables(grid, head_dim, theta=theta, device=device,
                                                          start=start, stop=stop))

    def get_or_build(self, key, build):
        """The entry under ``key`` (hashable), built by ``build()`` on a miss.

        Inside a graph traced by ``torch.compile`` the cache is bypassed: ``build()`` runs in the graph
        (the tables are a pure function of constants of the graph; no lock, no Python-side cache state
        for dynamo to guard on).
        """
        if torch.compiler.is_compiling():
            return build()
        with self._lock:
            hit = self._data.get(key)
            if hit is not None:
                self._data.move_to_end(key)
                self.hits += 1
                return hit
        tables = build()
        with self._lock:
            self.misses += 1
            self._data[key] = tables
            self._data.move_to_end(key)
            while len(self._data) > self.maxsize:
                self._data.popitem(last=False)
        return tables

    def clear(self) -> None:
        with self._lock:
            self._data.clear()

    def __getstate__(self) -> dict:
        # copies and pickles of a boosted model (copy.deepcopy, torch.save of the module) start with an empty
        # cache and a lock of their own: a lock cannot be copied, and the tables rebuild on first use
        state = dict(self.__dict__)
        state["_data"], state["hits"], state["misses"] = OrderedDict(), 0, 0
        del state["_lock"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._data)

    def __repr__(self) -> str:
        return f"RopeCache(size={len(self)}/{self.maxsize}, hits={self.hits}, misses={self.misses})"


# fp32 scratch per chunk on the non-fused path: small enough to stay in cache and to be served by
# the allocator without fresh page faults (a whole-tensor fp32 copy of q at 480p is 200 MB).
_CHUNK_BYTES = 4 << 20


def rotate(x: torch.Tensor, freqs: torch.Tensor, *, inplace: bool = False) -> torch.Tensor:
    """Rotate interleaved pairs of ``x`` (B, S, N, D) by complex64 ``freqs`` of shape (1, S, 1, D/2).

    Arithmetic is fp32 (complex64) whatever ``x.dtype``; the result has ``x.dtype``. With
    ``inplace=True`` the rotation overwrites ``x`` (use it only on tensors you own): an fp32
    contiguous tensor takes one fused complex multiply, other dtypes or strides go through a small
    fp32 scratch buffer chunk by chunk along the sequence, so no full-size temporary is allocated.
    """
    if x.dim() != 4:
        raise ValueError(f"x must be (B, S, N, D), got shape {tuple(x.shape)}")
    if x.shape[-1] % 2:
        raise ValueError(f"the last axis of x must be even (interleaved pairs), got {x.shape[-1]}")
    if freqs.dtype != torch.complex64:
        raise TypeError(f"freqs must be complex64, got {freqs.dtype}")
    if freqs.dim() != 4 or freqs.shape[1] != x.shape[1] or freqs.shape[-1] * 2 != x.shape[-1]:
        raise ValueError(
            f"freqs must have shape (1, S={x.shape[1]}, 1, D/2={x.shape[-1] // 2}), got {tuple(freqs.shape)}"
        )
    half = x.shape[-1] // 2
    if torch.compiler.is_compiling():
        # Traced: real arithmetic on (cos, sin) views of the phasors, which inductor fuses with the
        # surrounding norm into one kernel (complex multiplies are not lowered; they would run as a
        # separate, unfused aten kernel). In-place has no meaning in a functional graph.
        cos_sin = torch.view_as_real(freqs)
        cos, sin = cos_sin[..., 0], cos_sin[..., 1]
        x1, x2 = x.float().unflatten(-1, (half, 2)).unbind(-1)
        return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2).to(x.dtype)
    if not inplace:
        x = x.clone(memory_format=torch.contiguous_format)
    if x.dtype == torch.float32 and x.is_contiguous():
        torch.view_as_complex(x.view(*x.shape[:-1], half, 2)).mul_(freqs)
        return x
    seq = x.shape[1]
    per_token = max(1, x.numel() // max(seq, 1))
    chunk = min(seq, max(1, _CHUNK_BYTES // (4 * per_token)))
    # One scratch buffer per call, reused by every chunk: a fresh multi-MB allocation per chunk can
    # page-fault on every call once the allocator has trimmed its heap.
    scratch = torch.empty((x.shape[0], chunk) + tuple(x.shape[2:]), dtype=torch.float32, device=x.device)
    for s0 in range(0, seq, chunk):
        xs = x[:, s0 : s0 + chunk]
        xf = scratch[:, : xs.shape[1]]
        xf.copy_(xs)
        torch.view_as_complex(xf.view(*xf.shape[:-1], half, 2)).mul_(freqs[:, s0 : s0 + chunk])
        xs.copy_(xf)
    return x


def apply_rotary_emb(x: torch.Tensor, freqs_cos: torch.Tensor, freqs_sin: torch.Tensor) -> torch.Tensor:
    """Drop-in for diffusers' Wan processor rotation with its (1, S, 1, D) cos / sin tables.

    ``x`` is (B, S, N, D); the result equals diffusers' (fp32 arithmetic, output in ``x.dtype``).
    """
    if x.dim() != 4:
        raise ValueError(f"x must be (B, S, N, D), got shape {tuple(x.shape)}")
    if freqs_cos.shape != freqs_sin.shape or freqs_cos.shape[-1] != x.shape[-1]:
        raise ValueError(
            f"freqs_cos / freqs_sin must both have shape (1, S, 1, D={x.shape[-1]}), "
            f"got {tuple(freqs_cos.shape)} and {tuple(freqs_sin.shape)}"
        )
    freqs = torch.complex(freqs_cos[..., 0::2].float(), freqs_sin[..., 1::2].float())
    return rotate(x, freqs)


def _check_grid(grid) -> tuple[int, int, int]:
    try:
        g = tuple(int(v) for v in grid)
    except TypeError:
        raise ValueError(f"grid must be (frames, height, width) positive ints, got {grid!r}") from None
    if len(g) != 3 or any(v < 1 for v in g):
        raise ValueError(f"grid must be (frames, height, width) positive ints, got {grid!r}")
    return g


def _check_range(start, stop, seq_len) -> tuple[int, int]:
    stop = seq_len if stop is None else stop
    if not (isinstance(start, int) and isinstance(stop, int)) or start < 0 or stop < start:
        raise ValueError(f"start/stop must satisfy 0 <= start <= stop, got start={start!r}, stop={stop!r}")
    return start, stop
