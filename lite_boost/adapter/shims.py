"""Pieces the family shims share (``lite_boost/models/<family>.py``), one of each.

* :func:`call_arg`: an argument of a transformer (or module) call, by keyword or by position.
* :func:`packed_output_shape`: the output shape of a transformer call on packed (B, S, C) tokens
  (a ``CfgPlan(output_shape=...)``).
* :func:`patch_size`, :func:`patch_grid`, :func:`video_token_grid`: the latent token grid
  arithmetic (a config's or a RoPE module's patch sizes; the grid of a 5-D latent).
* :func:`norm_qk`: a diffusers attention module's optional q / k norms (image or added text stream).
* :class:`CachedRope`: the base of a family's RoPE shim (the instance ``forward`` that serves the
  cached fp32 tables from :attr:`BoostState.rope_cache`).
* :data:`SEA_CACHE_WHY_NOT`, :func:`separate_passes_why_not`: the reasons a step-cache method does
  not fit a family, worded once.
* :func:`tensor_keys`, :func:`raster_grid`: cache keys for the caller's position-id tensors (identity and
  version, never their values) and the (images, h, w) grid those ids describe (eager code only), for the
  families whose RoPE module and token grid only see position ids (Flux, Flux.2).

Shape arithmetic only, no torch.distributed, nothing of any one family: every function here runs
in traced code as it is, except :func:`raster_grid` and :class:`TensorKeys` (eager only: they read ids).
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Hashable, Sequence

import torch

__all__ = ["call_arg", "packed_output_shape", "patch_size", "patch_grid", "video_token_grid", "norm_qk", "CachedRope",
           "SEA_CACHE_WHY_NOT", "separate_passes_why_not", "TensorKeys", "tensor_keys", "raster_grid"]


# ------------------------------------------------------------------------------------------- arguments
def call_arg(args: Sequence[Any], kwargs: dict, name: str, index: int | None = None):
    """The argument ``name`` of a call: ``kwargs[name]``, else ``args[index]``, else None (not passed)."""
    if name in kwargs:
        return kwargs[name]
    if index is not None and len(args) > index:
        return args[index]
    return None


def packed_output_shape(model, args, kwargs) -> tuple[int, ...]:
    """The output (B, tokens, ``proj_out.out_features``) of a transformer call on packed (B, S, C)
    ``hidden_states``: what a ``CfgPlan(output_shape=...)`` of such a model returns."""
    hidden = call_arg(args, kwargs, "hidden_states", 0)
    return (*hidden.shape[:2], model.proj_out.out_features)


# ------------------------------------------------------------------------------------------ patch grid
def patch_size(source) -> tuple[int, int, int] | None:
    """(pt, ph, pw) from ``source.patch_size`` (int, (h, w) or (t, h, w)) and ``source.patch_size_t``.

    ``source`` is a model config or a module that keeps its patch sizes (a RoPE module); None when it
    names no patch size in one of those forms. A missing or None ``patch_size_t`` counts as 1.
    """
    p = getattr(source, "patch_size", None) if source is not None else None
    if p is None:
        return None
    if isinstance(p, int) and not isinstance(p, bool):
        ph = pw = p
        pt = getattr(source, "patch_size_t", None) or 1
    elif isinstance(p, (list, tuple)) and len(p) in (2, 3) and all(isinstance(x, int) for x in p):
        pt, ph, pw = (1, *p) if len(p) == 2 else p
        if len(p) == 2:
            pt = getattr(source, "patch_size_t", None) or 1
    else:
        return None
    return (int(pt), int(ph), int(pw))


def patch_grid(sizes: Sequence[int], patch: Sequence[int]) -> tuple[int, int, int]:
    """The token grid (frames, height, width) // (pt, ph, pw) of latent sizes cut into patches
    (floor division, as a strided patch embedding counts)."""
    f, h, w = sizes
    pt, ph, pw = patch
    return (f // pt, h // ph, w // pw)


def video_token_grid(frames_dim: int = 2, name: str = "hidden_states") -> Callable:
    """A family's ``token_grid(model, args, kwargs)`` for a 5-D latent input, patch sizes from the config.

    frames_dim: 2 for (B, C, F, H, W) latents (Wan, HunyuanVideo), 1 for (B, F, C, H, W) (CogVideoX).
    name: the argument holding the latents (first positional argument, or this keyword).
    The grid is None when the call has no 5-D latent or the config no patch size (the call runs dense).
    """
    if frames_dim not in (1, 2):
        raise ValueError(f"frames_dim must be 1 (B, F, C, H, W) or 2 (B, C, F, H, W), got {frames_dim!r}")

    def token_grid(model, args, kwargs):
        hidden = call_arg(args, kwargs, name, 0)
        patch = patch_size(getattr(model, "config", None))
        if not isinstance(hidden, torch.Tensor) or hidden.dim() != 5 or patch is None:
            return None
        return patch_grid((hidden.shape[frames_dim], *hidden.shape[-2:]), patch)

    token_grid.__doc__ = (f"Latent token grid (frames, height, width) of a call: the patch grid of its 5-D "
                          f"``{name}`` ({'(B, F, C, H, W)' if frames_dim == 1 else '(B, C, F, H, W)'}).")
    return token_grid


# --------------------------------------------------------------------------------------------- q/k norms
def norm_qk(attn, q: torch.Tensor, k: torch.Tensor, added: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k through the attention module's q / k norms where it has them (``norm_q`` / ``norm_k``, or
    ``norm_added_q`` / ``norm_added_k`` for the added text stream with ``added=True``)."""
    nq, nk = (attn.norm_added_q, attn.norm_added_k) if added else (attn.norm_q, attn.norm_k)
    if nq is not None:
        q = nq(q)
    if nk is not None:
        k = nk(k)
    return q, k


# ------------------------------------------------------------------------------------------- cached RoPE
class CachedRope:
    """Base of a family's RoPE shim: the replacement ``forward`` of one RoPE module instance.

    ``RopeSource(module, forward=SubClass)`` builds it as ``SubClass(rope_module, boost_state)``;
    the subclass's ``__call__`` takes the module's own arguments and returns the tables in the cached
    form, usually through :meth:`cached` with rows ``self.state.serve_range(seq_len)``. The module's
    own forward stays reachable as :meth:`original`.
    """

    def __init__(self, rope_module, state):
        self.rope = rope_module
        self.state = state

    def original(self, *args, **kwargs):
        """The RoPE module's own (class) forward on these arguments: diffusers' tables."""
        return type(self.rope).forward(self.rope, *args, **kwargs)

    def cached(self, key: Hashable, build: Callable[[], Any]):
        """The state's cached tables under ``key``, built by ``build()`` on a miss."""
        return self.state.rope_cache.get_or_build(key, build)


# ------------------------------------------------------------------------------------ step-cache refusals
SEA_CACHE_WHY_NOT = "diffusers' SeaCache derives its indicator for Wan text-to-video and Cosmos only"


def separate_passes_why_not(caller: str) -> str:
    """Why a method that needs cond and uncond in one batch (FasterCache) does not fit ``caller``, which
    runs the two passes as separate transformer calls."""
    return f"it needs cond and uncond batched into one transformer call; {caller} calls them separately"


# ------------------------------------------------------------------------------------- position-id tensors
class TensorKeys:
    """Hashable keys for the current contents of tensors, without reading them.

    A tensor gets a serial number the first time it is seen (never reused, the entry goes with the
    tensor) and its version counter, which any in-place change bumps. Inference tensors keep no
    version counter: their key is their contents (a copy to the host).
    """

    def __init__(self):
        from torch.utils.weak import WeakIdKeyDictionary

        self._serials = WeakIdKeyDictionary()
        self._next = itertools.count()

    def __call__(self, t: torch.Tensor):
        try:
            version = t._version
        except RuntimeError:
            data = t.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes()
            return ("data", str(t.dtype), tuple(t.shape), data)
        serial = self._serials.get(t)
        if serial is None:
            serial = self._serials[t] = next(self._next)
        return (serial, version)


def tensor_keys(state) -> TensorKeys:
    """The boosted model's :class:`TensorKeys` (kept in ``state.extras``)."""
    keys = state.extras.get("tensor_keys")
    if keys is None:
        keys = state.extras["tensor_keys"] = TensorKeys()
    return keys


def raster_grid(img_ids: torch.Tensor, columns: Sequence[int] = (0, 1, 2)):
    """(images, h, w) when ``img_ids`` (N, axes) are rasters of equal-size images, else None.

    ``columns``: the id axes holding (image, row, column) (Flux: (0, 1, 2) of 3; Flux.2: (0, 1, 2) of
    (t, h, w, layer)); any other axis must be constant. Reads the ids: eager code only.
    """
    if img_ids.ndim != 2 or img_ids.shape[0] == 0 or img_ids.shape[1] <= max(columns):
        return None
    ids = img_ids.detach().to(torch.float64)
    rest = [c for c in range(ids.shape[1]) if c not in columns]
    if rest and not bool((ids[:, rest] == ids[:1, rest]).all()):
        return None
    ids = ids[:, list(columns)]
    h, w = int(ids[:, 1].max().item()) + 1, int(ids[:, 2].max().item()) + 1
    n = ids.shape[0]
    if h < 1 or w < 1 or n % (h * w):
        return None
    f = n // (h * w)
    frames = ids[:, 0].reshape(f, h * w)
    rows = torch.arange(h, dtype=ids.dtype, device=ids.device).repeat_interleave(w).repeat(f)
    cols = torch.arange(w, dtype=ids.dtype, device=ids.device).repeat(h * f)
    if not (torch.equal(ids[:, 1], rows) and torch.equal(ids[:, 2], cols)
            and bool((frames == frames[:, :1]).all())):
        return None
    return f, h, w
