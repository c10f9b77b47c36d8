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
    see the gathered full input and keep their band of the output; GroupNorms take their statistics over
    every band (one small all-gather each, :mod:`.norms`); the call's output bands are
    gathered at the end. Each rank keeps the causal cache of its own band only, so the temporal
    loop, the frame bookkeeping and the VAE's own spatial tiling (each tile is split the same way)
    are the model's own code, untouched. Each band's convolution runs with the CPU kernel PyTorch
    would pick for the full frame (oneDNN rather than the im2col kernel a shorter band falls back to).

``"exact"`` by whole clips (a VAE whose adapter names a per-clip method, :meth:`VAEAdapter.clip_method`)
    A VAE that already cuts its input into independent temporal clips (nothing carried from clip to clip)
    and assembles their outputs itself: the clips are spread over the ranks, each rank runs its own, three
    all-gathers (a header, the shapes, the outputs) give every rank every clip output, and every rank runs the
    VAE's own assembly on them (:mod:`.clips`). Exact: each clip is the stock computation.

Trade-off: chunked sends only the decoded video (one collective) and scales to any rank count, but
its seams are approximate and every non-first chunk recomputes ``overlap`` warm-up frames; exact
pays one small collective per convolution per frame (a row of activations each way) and needs at
least one latent row per rank, but its output is the sequential output.

What is model-specific (how a frame range maps to video frames, which method to wrap, which modules
need halos) lives in a per-model :class:`VAEAdapter` registered with :func:`register_vae_adapter`
(``lite_boost.models.wan_vae`` registers Wan's). This package knows no model.

One module per job: :mod:`.adapter` (the adapter API, its registry, the modes), :mod:`.chunks`
(chunk planning and the chunked run), :mod:`.spatial` (the exact mode's row bands and halos), :mod:`.clips`
(the exact mode by whole independent clips), :mod:`.norms` (GroupNorm over row bands),
:mod:`.collectives` (the collectives and their errors), :mod:`.runner` (install / dispatch / remove).
"""

from .adapter import (VAE_GATHER, VAE_MODES, SpatialLayout, UnsupportedVAEError, VAEAdapter, check_vae_mode,
                      register_vae_adapter, vae_adapter_for)
from .chunks import Chunk, ChunkPlan, plan_chunks
from .clips import ClipPlan, plan_clips
from .collectives import VAECollectiveError
from .norms import distributed_group_norm
from .runner import ParallelVAE, parallel_vae_state, parallelize_vae, unparallelize_vae
from .spatial import split_rows

__all__ = [
    "VAE_MODES",
    "VAE_GATHER",
    "Chunk",
    "ChunkPlan",
    "ClipPlan",
    "ParallelVAE",
    "SpatialLayout",
    "UnsupportedVAEError",
    "VAEAdapter",
    "VAECollectiveError",
    "check_vae_mode",
    "distributed_group_norm",
    "parallel_vae_state",
    "parallelize_vae",
    "plan_chunks",
    "plan_clips",
    "register_vae_adapter",
    "split_rows",
    "unparallelize_vae",
    "vae_adapter_for",
]
