"""Block-sparse self-attention on the generic path, where the layout is known from the model's data.

A generic model's block-sparse attention needs the latent token grid and the self-attention calls that
run over exactly that grid. Both come from data, decided once per transformer call:

* the grid: the model config's patch size (``patch_size``, ``patch_size_t``) and the call's
  ``hidden_states`` shape, (B, C, F, H, W) or (B, C, H, W) (a forward pre-hook on the transformer);
  packed (B, S, C) inputs have no grid to read and are refused at boost time unless a family declares it;
* which calls: a self-attention call (q and k of one length, no mask) whose length equals the grid's
  token count is over the grid; every other call (cross-attention, a text refiner, joint text + image
  attention) runs dense. Under ``torch.compile`` this is shape arithmetic done while tracing.

A model none of whose self-attention calls runs over exactly the grid (text concatenated into the
sequence, several streams) is refused with a ConfigError naming it after its first call.

The grid calls are numbered in call order within each transformer call (the layer index of the
schedule's ``dense_layers`` and of the block-mask reuse); the schedule, the mask reuse and the kernel
are :class:`~lite_boost.adapter.sparse.ScheduledSparseAttention`'s. The start of a transformer call (step
tracking, which reads the timestep's value, and the reset of the call order) is a forward pre-hook that
``torch.compile`` leaves eager; under ``torch.compile`` each grid call is an opaque custom op
(``torch.ops.lite_boost_graph.generic_sparse_attention``), so no decision becomes a graph break or a guard.
"""

from __future__ import annotations

import logging
import math

import torch

from ..config import ConfigError
from ..schedule import SparseSchedule
from .shims import call_arg, patch_grid
from .sparse import _HANDLES, _STATES, STATE_KEY, ScheduledSparseAttention, SparseState, _arg_index, uninstall_sparse

__all__ = ["GenericSparse", "install_generic_sparse", "latent_grid", "uninstall_generic_sparse", "SPARSE_CACHE_METHODS"]

logger = logging.getLogger("lite_boost.adapter.generic")

# Step caches that skip whole trailing blocks keep the call order of the grid calls (the layer index);
# caches that skip single attention layers would shift it.
SPARSE_CACHE_METHODS = ("first_block_cache", "mag_cache")


def latent_grid(patch: tuple[int, int, int] | None, hidden_states) -> tuple[int, int, int] | None:
    """The latent token grid (t, h, w) of an image (B, C, H, W) or video (B, C, F, H, W) input, or None
    (a packed (B, S, C) input, no patch size, or sizes the patch does not divide)."""
    if patch is None or not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() not in (4, 5):
        return None
    pt, ph, pw = patch
    video = hidden_states.dim() == 5
    f = hidden_states.shape[2] if video else 1
    h, w = hidden_states.shape[-2:]
    if (video and f % pt) or h % ph or w % pw:
        return None
    return patch_grid((f, h, w), (pt if video else 1, ph, pw))


class GenericSparse:
    """The sparse part of a :class:`~lite_boost.adapter.generic.GenericAttention` (one per boosted model)."""

    def __init__(self, model_class: str, state: SparseState, patch, context):
        self.model_class = model_class
        self.context = context  # the GenericAttention whose self_attn_fn serves the dense calls
        self.state = state
        self.patch = patch
        self.counter = 0  # grid calls so far in the current transformer call
        self.calls_seen = 0  # grid calls in the first complete transformer call (None once checked)
        self.checked = False
        self.transformer_calls = 0
        self.other_lengths: set[int] = set()
        self._key = torch.tensor([state.handle], dtype=torch.int64)

    # -------------------------------------------------------------- per transformer call
    def start_call(self, grid, timestep) -> None:
        """Eager start of a transformer call: check the previous call's layout, reset, advance the tracker."""
        if self.transformer_calls == 1:
            self.check_layout()
        self.transformer_calls += 1
        self.counter = 0
        self.state.observe(grid, timestep)

    def check_layout(self) -> None:
        """After the first transformer call: ConfigError unless some self-attention ran over the grid."""
        if self.checked:
            return
        self.checked = True
        if self.calls_seen:
            if self.other_lengths:
                logger.info("lite_boost generic sparse: %s self-attention over %s tokens (not the latent grid) runs "
                            "dense", self.model_class, sorted(self.other_lengths))
            return
        grid = self.state.grid
        seen = f"its self-attention ran over {sorted(self.other_lengths)} tokens" if self.other_lengths else \
            "it ran no self-attention"
        where = (f"the latent grid {grid} has {math.prod(grid)} tokens and {seen} (text concatenated into the "
                 "sequence, or several streams)" if grid else
                 f"its hidden_states give no latent grid (packed (B, S, C) tokens, or sizes the patch size does not "
                 f"divide); {seen}")
        raise ConfigError(
            f"block-sparse attention (BoostConfig.sparse) is not supported for {self.model_class} on the generic "
            f"path: it needs self-attention over exactly the latent token grid, and {where}. Boost it without "
            "sparse, or declare its layout in a model family (lite_boost.adapter.ModelFamily with token_grid)")

    def pre_forward(self, module, args, kwargs):
        return _pre_forward(self, args, kwargs)

    def post_forward(self, module, args, kwargs, output):
        _post_forward(self)

    # -------------------------------------------------------------- per attention call
    def __call__(self, q, k, v, dense_fn):
        grid = self.state.grid
        if grid is None or q.shape[1] != math.prod(grid):
            if not torch.compiler.is_compiling():
                self.other_lengths.add(int(q.shape[1]))
            return dense_fn(q, k, v)
        if torch.compiler.is_compiling():
            return torch.ops.lite_boost_graph.generic_sparse_attention(q, k, v, self._key, list(grid))
        return self.run(q, k, v, dense_fn)

    def run(self, q, k, v, dense_fn=None):
        index = self.counter
        self.counter += 1
        if not self.checked:
            self.calls_seen += 1
        layer = self.state.layers.get(index)
        if layer is None:
            layer = self.state.layers[index] = ScheduledSparseAttention(index, self.state, dense_fn or self.context.self_attn_fn)
        return layer.run(q, k, v)


@torch.compiler.disable
def _pre_forward(sparse: GenericSparse, args, kwargs):
    """Start of a transformer call (always eager: it reads the timestep's value and resets the call order)."""
    hidden = call_arg(args, kwargs, "hidden_states", 0)
    timestep = call_arg(args, kwargs, "timestep", sparse.state.timestep_index)
    sparse.start_call(latent_grid(sparse.patch, hidden), timestep)


@torch.compiler.disable
def _post_forward(sparse: GenericSparse) -> None:
    """End of a transformer call (eager): after the first one, check that the layout was the grid's."""
    if sparse.transformer_calls == 1:
        sparse.check_layout()


def install_generic_sparse(model, boost_state, ctx) -> None:
    """Turn on block-sparse attention over the latent grid for a model boosted on the generic path."""
    cfg = boost_state.config.sparse
    if cfg is None or cfg.sparse_type is None:
        return
    family = boost_state.family
    if family.patch is None:
        raise ConfigError(f"sparse (BoostConfig.sparse) is not supported for {family.model_class} on the generic path "
                          f"({family.features['sparse']})")
    state = SparseState(cfg, SparseSchedule(cfg), token_grid=None, timestep_index=_arg_index(model, "timestep"))
    state.handle = next(_HANDLES)
    _STATES[state.handle] = state
    sparse = GenericSparse(family.model_class, state, family.patch, ctx)
    state.generic = sparse
    state.hook = model.register_forward_pre_hook(sparse.pre_forward, with_kwargs=True)
    state.timestep_hook = model.register_forward_hook(sparse.post_forward, with_kwargs=True)
    ctx.sparse = sparse
    boost_state.extras[STATE_KEY] = state


def uninstall_generic_sparse(model, boost_state, ctx) -> None:
    uninstall_sparse(model, boost_state)  # the same hooks and handle as the family path
    if ctx is not None:
        ctx.sparse = None


def _generic(handle: int) -> GenericSparse:
    state = _STATES.get(int(handle))
    if state is None or getattr(state, "generic", None) is None:
        raise RuntimeError(f"lite_boost generic sparse attention: no boosted model with handle {int(handle)} "
                           "(the model was unboosted or freed after this graph was compiled)")
    return state.generic


@torch.library.custom_op("lite_boost_graph::generic_sparse_attention", mutates_args=())
def _attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key: torch.Tensor,
                  grid: list[int]) -> torch.Tensor:
    sparse = _generic(int(key[0]))
    if grid:
        sparse.state.grid = tuple(grid)
    return sparse.run(q, k, v).contiguous()


@_attention_op.register_fake
def _(q, k, v, key, grid):
    return q.new_empty(q.shape[:3] + (v.shape[-1],))
