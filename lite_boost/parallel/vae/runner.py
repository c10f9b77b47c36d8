"""The parallel decode / encode of one VAE instance: install, dispatch to the mode, remove.

:func:`parallelize_vae` checks the mode against the VAE's adapter (before any collective) and installs a
:class:`ParallelVAE` on the instance (its decode / encode methods wrapped); :func:`unparallelize_vae`
removes it; :func:`parallel_vae_state` finds it.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any

import torch

from ...config import ConfigError
from ..comm import Communicator
from .adapter import VAE_GATHER, VAE_MODES, VAEAdapter, check_vae_mode, vae_adapter_for
from .chunks import ChunkPlan, _check_pos_int, plan_chunks, run_chunked
from .clips import ClipPlan, run_clips
from .collectives import _Collectives
from .spatial import _check_overlap_halo, _SpatialSplit

__all__ = ["ParallelVAE", "parallel_vae_state", "parallelize_vae", "unparallelize_vae"]

_STATE_ATTR = "_lite_boost_parallel_vae"


class ParallelVAE:
    """The parallel decode / encode of one VAE instance (what ``parallelize_vae`` installs).

    Attributes: ``mode`` ("exact" | "chunked"), ``overlap``, ``chunk_size``, ``gather`` ("all" |
    "rank0"), ``comm`` (the Communicator), ``adapter``, ``last_plan`` (the ChunkPlan of the last
    chunked call, for inspection), ``last_clips`` (the ClipPlan of the last exact call by whole clips;
    None after a one-clip call), ``calls`` (counts per kind), ``overlap_halo`` (exact mode: True =
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
        self.last_clips: ClipPlan | None = None  # exact mode by clips: the last call's ClipPlan
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
        self.adapter.check_input(inp, kind)  # on every rank, before any collective
        if self.mode == "exact":
            ad = self.adapter
            if ad.clip_method(kind) is not None:  # whole independent clips per rank (.clips)
                self.last_clips = None
                return run_clips(ad, self.coll, kind, inner, inp, args, kwargs,
                                 on_plan=lambda plan: setattr(self, "last_clips", plan))
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
        ad = self.adapter
        self.last_phases = []
        plan = plan_chunks(ad.num_units(inp, kind), self.comm.size, overlap=self.overlap_for(kind),
                           chunk_size=self.chunk_size, cost=ad.chunk_cost_fn(kind))
        self.last_plan = plan
        return run_chunked(ad, self.coll, plan, kind, inner, inp, args, kwargs, gather=self.gather,
                           phase=self._phase)


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
