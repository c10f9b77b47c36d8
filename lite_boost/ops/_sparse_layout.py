"""Token orders for block-sparse attention on a (frames, height, width) latent grid.

A block-sparse kernel skips whole blocks of ``block_size`` consecutive tokens, so the sequence is
first reordered so that each block holds tokens that are close in space and time. Three orders:

* ``"raster"``: the grid in its natural (t, h, w) order.
* ``"reference"`` (``window=None``): the MindIE-SD / MindSpore Lite rf_v2 order: each frame cut into
  8x8 spatial windows (raster order of windows), the rows/columns left over appended in raster
  order; frame 0 stays raster when h or w is not a multiple of 8.
* a window ``(wt, wh, ww)`` with ``wt * wh * ww == block_size``: real spatio-temporal windows.
  Frame 0 (the "sink" frame, when there is more than one frame) is its own temporal slab; the
  other frames are cut into slabs of ``wt`` frames, each slab into ``wh x ww`` tiles. Every full
  window holds exactly ``block_size`` tokens and comes first, so full windows and blocks coincide;
  the partial windows of grids that the window does not divide (tiles at the right/bottom edge, a
  last short slab) follow, packed in slab/tile order so a block holds a few neighbouring partial
  windows; the frame-0 slab comes last. Nothing is padded: the order is an exact permutation.

Text tokens (a prefix of ``txt_len`` tokens in the input) are moved behind the video tokens.
All functions return CPU int64 tensors and are cached (bounded LRU): they depend only on shapes.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

__all__ = ["TokenOrder", "token_order", "video_order"]

_REF_TILE = 8  # the reference implementation's spatial window edge


class TokenOrder(NamedTuple):
    """A sequence permutation and the token classes in permuted order.

    perm: (S,) int64, ``x_perm = x[perm]`` (gather along the sequence axis).
    inv: (S,) int64, ``x = x_perm[inv]``.
    is_text: (S,) bool, token is one of the ``txt_len`` text tokens (in permuted order).
    is_sink: (S,) bool, token is a video token of frame 0 of a multi-frame grid (permuted order).
    """

    perm: torch.Tensor
    inv: torch.Tensor
    is_text: torch.Tensor
    is_sink: torch.Tensor


def _raster(shape):
    t, h, w = shape
    return torch.arange(t * h * w, dtype=torch.int64)


def _reference(shape):
    t, h, w = shape
    grid = torch.arange(t * h * w, dtype=torch.int64).view(t, h, w)
    hf, wf = (h // _REF_TILE) * _REF_TILE, (w // _REF_TILE) * _REF_TILE
    aligned = hf == h and wf == w
    frames = []
    for f in range(t):
        g = grid[f]
        if f == 0 and not aligned:
            frames.append(g.reshape(-1))
            continue
        full = g[:hf, :wf].reshape(h // _REF_TILE, _REF_TILE, w // _REF_TILE, _REF_TILE)
        full = full.permute(0, 2, 1, 3).reshape(-1)
        rest_mask = torch.ones(h, w, dtype=torch.bool)
        rest_mask[:hf, :wf] = False
        frames.append(torch.cat([full, g[rest_mask]]))
    return torch.cat(frames)


def _windowed(shape, window):
    t, h, w = shape
    wt, wh, ww = window
    grid = torch.arange(t * h * w, dtype=torch.int64).view(t, h, w)
    # temporal slabs: frame 0 alone when there are several frames, then runs of wt frames
    if t > 1:
        slabs = [(0, 1, True)] + [(s, min(s + wt, t), False) for s in range(1, t, wt)]
    else:
        slabs = [(0, 1, False)]
    full, partial, sink = [], [], []
    for t0, t1, is_sink in slabs:
        for h0 in range(0, h, wh):
            for w0 in range(0, w, ww):
                idx = grid[t0:t1, h0:h0 + wh, w0:w0 + ww].reshape(-1)
                if is_sink:
                    sink.append(idx)
                elif idx.numel() == wt * wh * ww:
                    full.append(idx)
                else:
                    partial.append(idx)
    return torch.cat(full + partial + sink)


@functools.lru_cache(maxsize=64)
def video_order(shape: tuple[int, int, int], window) -> torch.Tensor:
    """Permutation of the ``t*h*w`` video tokens for ``window`` ("raster", None = reference, or (wt, wh, ww))."""
    if window == "raster":
        return _raster(shape)
    if window is None:
        return _reference(shape)
    return _windowed(shape, tuple(window))


@functools.lru_cache(maxsize=64)
def token_order(shape: tuple[int, int, int], window, txt_len: int) -> TokenOrder:
    """Full-sequence order: ``txt_len`` text tokens (input prefix) moved after the reordered video."""
    t, h, w = shape
    n_video = t * h * w
    video = video_order(shape, window) + txt_len
    perm = torch.cat([video, torch.arange(txt_len, dtype=torch.int64)])
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), dtype=torch.int64)
    is_text = torch.zeros(perm.numel(), dtype=torch.bool)
    is_text[n_video:] = True
    is_sink = torch.zeros(perm.numel(), dtype=torch.bool)
    if t > 1:
        is_sink[:n_video] = (perm[:n_video] - txt_len) < h * w
    return TokenOrder(perm, inv, is_text, is_sink)
