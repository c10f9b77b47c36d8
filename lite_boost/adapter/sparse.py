"""Block-sparse self-attention for boosted transformers of any family, on a step / layer schedule.

``install_sparse`` replaces the ``attn_fn`` of every self / joint attention processor by a
:class:`ScheduledSparseAttention` (cross-attention never calls ``attn_fn`` and stays dense) and adds
a forward pre-hook on the transformer that records, before every call, the latent token grid (the
family's ``token_grid``) and the denoising step (:class:`~lite_boost.schedule.StepTracker`). Each
attention call then asks the :class:`~lite_boost.schedule.SparseSchedule` whether to run dense,
reuses its block mask while ``mask_reuse_steps`` allows (one mask per layer and CFG branch), and
otherwise runs ``lite_boost.ops.sparse_attention``.

Joint attention (``attn_fn(q, k, v, joint=JointTokens(...))``) runs as the reference does: the text
tokens go in front of the image tokens (``txt_len``; attention does not depend on the key order, so
this holds for [image, text] families too) and are kept dense in both directions; the image tokens
get the block mask. A family whose model packs its text (and other streams) into the self-attention
sequence itself declares the grid as the sequence's tail: ``token_grid`` returns ``(t, h, w, lead)``
and the ``lead`` rows in front run as that text does. Padded text (a key-padding mask, as
HunyuanVideo's text padded to 256 tokens): when every sample of the batch pads the same tokens,
the padded ones are left out of the sparse call (they are never attended as keys) and their query
rows run dense against the real keys, as in dense attention; masks that differ within the batch
run the call dense (the block-sparse kernel takes none).
A keys-only joint stream (no joint queries, :attr:`~lite_boost.ops.joint.JointTokens.keys_only`) takes
its keys as stand-in text queries, whose rows are dropped.

Under ``torch.compile`` all of that stays eager: the step tracking and each attention call are
opaque custom ops of the graph (``torch.ops.lite_boost_graph.sparse_*``), so the schedule, the
mask-reuse decision and the mask building (data-dependent, with ``.item()``) never become graph
breaks or guards. The step index lives only in Python state read by those ops: one compiled graph
serves every denoising step, dense or sparse, and every layer (the layer index enters the graph as a
tensor, not as a specialised constant).
"""

from __future__ import annotations

import itertools
import logging
import math
import weakref
from dataclasses import dataclass, field

import torch

from ..config import SparseConfig
from ..ops.joint import JointTokens
from ..ops.sparse import BlockSelection, SparseStats, sparse_attention
from ..schedule import SparseSchedule, StepTracker
from .shims import call_arg

__all__ = ["SparseState", "ScheduledSparseAttention", "SparseEvent", "install_sparse", "uninstall_sparse",
           "attach_pipeline", "STATE_KEY"]

logger = logging.getLogger("lite_boost.adapter.sparse")

STATE_KEY = "sparse"


@dataclass
class SparseEvent:
    """One attention call: what ran and why (kept for the last generation only)."""

    generation: int
    step: int
    call: int
    layer: int
    path: str  # "sparse" or "dense"
    reason: str
    reused: bool = False
    effective_sparsity: float = 0.0
    backend: str | None = None  # rain_fusion kernel of a sparse call


@dataclass
class SparseState:
    """Sparse-attention state of one boosted transformer (in ``BoostState.extras['sparse']``)."""

    config: SparseConfig
    schedule: SparseSchedule
    token_grid: object = None  # the family's token_grid(model, args, kwargs) -> (t, h, w) | None
    timestep_index: int | None = None  # position of ``timestep`` in the model's forward signature
    tracker: StepTracker = field(default_factory=StepTracker)
    grid: tuple[int, int, int] | None = None
    lead: int = 0  # rows in front of the grid in a packed self-attention sequence (kept dense)
    masks: dict = field(default_factory=dict)  # (layer, call) -> (step computed, BlockSelection)
    events: list = field(default_factory=list)  # SparseEvent of the current generation
    hook: object = None
    timestep_hook: object = None
    record_events: bool = True
    handle: int = -1  # key of this state in _STATES (set by install_sparse)
    layers: dict = field(default_factory=dict)  # layer index -> ScheduledSparseAttention

    def set_grid(self, grid) -> None:
        """Record a family's token grid: (t, h, w), (t, h, w, lead) or None."""
        grid = tuple(int(g) for g in grid) if grid else None
        self.grid, self.lead = (grid[:3], grid[3]) if grid is not None and len(grid) == 4 else (grid, 0)

    def grid_arg(self) -> list[int]:
        """The grid as a graph op argument: [t, h, w] ([t, h, w, lead] with a lead), [] without one."""
        if self.grid is None:
            return []
        return [*self.grid, self.lead] if self.lead else list(self.grid)

    def observe(self, grid, timestep) -> None:
        """Start of a transformer call: record the latent grid and advance the step tracker."""
        self.set_grid(grid)
        previous = self.tracker.generation
        self.tracker.observe(timestep if timestep is not None else 0)
        if self.tracker.generation != previous:
            self.masks.clear()
            self.events.clear()

    def pre_forward(self, module, args, kwargs):
        grid = self.token_grid(module, args, kwargs)
        if torch.compiler.is_compiling():
            # Traced: only the grid (shape arithmetic, a constant of the graph) is recorded here; the
            # step tracker reads the timestep's value, so it runs in an opaque op on the timestep's
            # path into the timestep embedder (see timestep_pre_forward), ordered before every block.
            self.set_grid(grid)
            return None
        timestep = call_arg(args, kwargs, "timestep", self.timestep_index)
        self.observe(grid, timestep)
        return None

    def timestep_pre_forward(self, module, args, kwargs):
        """Pre-hook of the timestep embedder: under tracing, route the timestep through the observe op."""
        if not torch.compiler.is_compiling():
            return None  # eager: pre_forward already observed this call
        timestep = args[0] if args else kwargs.get("timestep")
        if not isinstance(timestep, torch.Tensor):
            return None
        timestep = torch.ops.lite_boost_graph.sparse_observe(timestep, self.handle, self.grid_arg())
        if args:
            return (timestep,) + tuple(args[1:]), kwargs
        return args, {**kwargs, "timestep": timestep}

    def mean_effective_sparsity(self) -> float:
        """Average effective sparsity over the recorded attention calls (dense calls count as 0)."""
        if not self.events:
            return 0.0
        return sum(e.effective_sparsity for e in self.events) / len(self.events)


class ScheduledSparseAttention:
    """``attn_fn`` of one self / joint attention layer: (B, S, H, D) -> (B, S, H, D).

    With ``joint`` it returns ``(out, joint_out)`` like every function of the protocol
    (:mod:`lite_boost.ops.joint`); ``dense_fn`` (the function it replaced) serves the dense calls.
    """

    def __init__(self, layer_idx: int, state: SparseState, dense_fn):
        self.layer_idx = layer_idx
        self.state = state
        self.dense_fn = dense_fn
        # (state handle, layer) as a tensor: traced code passes it to the op as a graph input, so the
        # blocks of one model (and of two models) share one compiled graph instead of one per layer.
        self._key = torch.tensor([state.handle, layer_idx], dtype=torch.int64)

    def __repr__(self) -> str:
        c = self.state.config
        return (f"ScheduledSparseAttention(layer={self.layer_idx}, {c.sparse_type}, sparsity={c.sparsity}, "
                f"dense={self.dense_fn!r})")

    def _record(self, path, reason, reused=False, eff=0.0, backend=None):
        st = self.state
        if st.record_events:
            st.events.append(SparseEvent(st.tracker.generation, st.tracker.step, st.tracker.call, self.layer_idx,
                                         path, reason, reused, eff, backend))

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, joint: JointTokens | None = None):
        if torch.compiler.is_compiling():
            grid = self.state.grid_arg()
            if joint is None:
                return torch.ops.lite_boost_graph.sparse_attention(q, k, v, self._key, grid)
            return tuple(torch.ops.lite_boost_graph.sparse_joint_attention(
                q, k, v, joint.q, joint.k, joint.v, joint.key_mask, joint.first, self._key, grid))
        return self.run(q, k, v, joint)

    def _dense(self, q, k, v, joint, why, ring=None):
        self._record("dense", why)
        if ring is not None:
            return ring.attention(self.dense_fn, q, k, v, joint=joint)
        return self.dense_fn(q, k, v) if joint is None else self.dense_fn(q, k, v, joint=joint)

    def ring_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring):
        """Under Ring attention (lite_boost.parallel.ring): q, k, v are this rank's chunk (eager)."""
        return self.run(q, k, v, ring=ring)

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, joint: JointTokens | None = None, ring=None):
        """The eager body: schedule, mask reuse, sparse_attention (or the dense function)."""
        st, cfg = self.state, self.state.config
        tr = st.tracker
        why = st.schedule.dense_reason(tr.step, tr.total, self.layer_idx)
        grid, lead = st.grid, st.lead
        n = q.shape[1] if ring is None else ring.seq_len  # the whole sequence's length
        if why is None and (grid is None or math.prod(grid) + lead != n or k.shape[1] != q.shape[1]):
            why = f"sequence length {n} does not match the latent grid {grid}" + (f" behind {lead} rows" if lead else "")
        if why is None and lead and joint is not None:
            why = "a packed sequence (rows in front of the grid) with a joint stream"
        padded = None  # (real, padded) text token indices when the padded ones are left out
        if why is None and joint is not None and joint.key_mask is not None:
            if bool(joint.key_mask.all()):  # nothing padded (a mask of ones): the same attention without it
                joint = joint._replace(key_mask=None)
            else:
                padded = _padding_split(joint.key_mask)
                if padded is None:
                    why = "the text has a key-padding mask (the block-sparse kernel takes none)"
        if why is not None:
            return self._dense(q, k, v, joint, why, ring)
        txt = lead  # packed rows in front of the grid: kept dense like text
        keys_only = joint is not None and joint.keys_only
        if keys_only:  # the joint keys stand in as their own queries; those rows are dropped
            joint = joint._replace(q=joint.k)
        whole = joint
        if joint is not None:  # text in front, kept dense by sparse_attention (txt_len)
            joint.check(q, v)
            if padded is not None:  # only the real text tokens take part in the sparse call
                joint = JointTokens(*(x.index_select(1, padded[0]) for x in joint[:3]), None, joint.first)
            txt = joint.length
            n += txt
            q, k, v = (torch.cat([j, x], dim=1) for j, x in ((joint.q, q), (joint.k, k), (joint.v, v)))
        key = (self.layer_idx, tr.call)
        cached = st.masks.get(key)
        selection = None
        if cached is not None and st.schedule.reuse(tr.step, cached[0]):
            sel: BlockSelection = cached[1]
            if sel.signature[:5] == (q.shape[0], q.shape[2], k.shape[2], n, n) \
                    and sel.signature[6] == grid and sel.signature[9] == txt:
                selection = sel
        out, stats = sparse_attention(
            q, k, v, head_num=q.shape[2], input_layout="BSND", sparse_type=cfg.sparse_type, txt_len=txt,
            block_size=cfg.block_size, latent_shape_q=grid, keep_sink=cfg.keep_sink, keep_recent=cfg.keep_recent,
            cdf_threshold=cfg.cdf_threshold, sparsity=cfg.sparsity, window=cfg.window,
            min_seq_len=cfg.min_seq_len, selection=selection, return_stats=True, backend=cfg.backend,
            budget=cfg.budget, selector=cfg.selector, selector_reps=cfg.selector_reps,
            precision=getattr(self.dense_fn, "precision", "auto"), **({} if ring is None else {"ring": ring}),
        )
        stats: SparseStats
        if stats.selection is not None and selection is None:
            st.masks[key] = (tr.step, stats.selection)
        self._record(stats.path, stats.reason, stats.reused, stats.effective_sparsity, stats.backend)
        if joint is None:
            return out
        if keys_only:
            return out[:, txt:], out[:, :0]
        if padded is None:
            return out[:, txt:], out[:, :txt]
        # padded text queries attend every real key (text and image), dense, as in dense attention
        real, pad = padded
        text_out = out.new_empty(whole.q.shape[:3] + (out.shape[-1],))
        text_out.index_copy_(1, real, out[:, :txt])
        text_out.index_copy_(1, pad, self.dense_fn(whole.q.index_select(1, pad), k, v).to(out.dtype))
        return out[:, txt:], text_out


def _padding_split(key_mask: torch.Tensor):
    """(real, padded) token indices of a (B, T) key mask that every sample shares, else None."""
    first = key_mask[0]
    if key_mask.shape[0] > 1 and not bool((key_mask == first).all()):
        return None
    return first.nonzero().squeeze(1), (~first).nonzero().squeeze(1)


def install_sparse(transformer, boost_state) -> None:
    """Route self / joint attention of a boosted transformer through sparse_attention if configured.

    Needs the family's ``token_grid``; ``timestep_module`` (optional) names the child whose first
    argument is the timestep, where the compiled graph advances the step tracker.
    """
    cfg = boost_state.config.sparse
    if cfg is None or cfg.sparse_type is None:
        return
    family = boost_state.family
    state = SparseState(cfg, SparseSchedule(cfg), token_grid=family.token_grid,
                        timestep_index=_arg_index(transformer, "timestep"))
    state.handle = next(_HANDLES)
    _STATES[state.handle] = state
    for proc in boost_state.self_attention_processors:
        proc.attn_fn = state.layers[proc.layer_idx] = ScheduledSparseAttention(proc.layer_idx, state, proc.attn_fn)
    state.hook = transformer.register_forward_pre_hook(state.pre_forward, with_kwargs=True)
    if family.timestep_module:
        embedder = transformer.get_submodule(family.timestep_module)
        state.timestep_hook = embedder.register_forward_pre_hook(state.timestep_pre_forward, with_kwargs=True)
    boost_state.extras[STATE_KEY] = state


def uninstall_sparse(transformer, boost_state) -> None:
    """Remove the pre-hooks (processors are restored by unboost)."""
    state = boost_state.extras.pop(STATE_KEY, None)
    if state is None:
        return
    for hook in (state.hook, state.timestep_hook):
        if hook is not None:
            hook.remove()
    _STATES.pop(state.handle, None)


def attach_pipeline(transformer, pipeline) -> None:
    """Let the transformer's step tracker follow ``pipeline.scheduler`` (dense_steps_last needs the total)."""
    boost_state = getattr(transformer, "_lite_boost", None)
    state = boost_state.extras.get(STATE_KEY) if boost_state is not None else None
    if state is not None:
        state.tracker.attach(pipeline)


def _arg_index(model, name: str) -> int | None:
    import inspect

    try:
        params = list(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return None
    return params.index(name) if name in params else None


# --------------------------------------------------------------------------------------- graph ops
# Custom-op arguments are tensors and scalars, so an op reaches its SparseState through an integer
# handle. The table holds weak references only: it owns no state and an entry vanishes with its model.
_HANDLES = itertools.count()
_STATES: "weakref.WeakValueDictionary[int, SparseState]" = weakref.WeakValueDictionary()


def _state(handle: int) -> SparseState:
    state = _STATES.get(int(handle))
    if state is None:
        raise RuntimeError(f"lite_boost sparse attention: no boosted model with handle {int(handle)} "
                           "(the model was unboosted or freed after this graph was compiled)")
    return state


def _layer(key: torch.Tensor, grid: list[int]) -> ScheduledSparseAttention:
    handle, layer = (int(x) for x in key.tolist())
    state = _state(handle)
    fn = state.layers.get(layer)
    if fn is None:
        raise RuntimeError(f"lite_boost sparse attention: layer {layer} has no sparse attention function")
    if grid:
        state.set_grid(grid)
    return fn


@torch.library.custom_op("lite_boost_graph::sparse_observe", mutates_args=())
def _observe_op(timestep: torch.Tensor, handle: int, grid: list[int]) -> torch.Tensor:
    _state(handle).observe(grid, timestep)
    return timestep.clone()


@_observe_op.register_fake
def _(timestep, handle, grid):
    return torch.empty_like(timestep)


@torch.library.custom_op("lite_boost_graph::sparse_attention", mutates_args=())
def _attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key: torch.Tensor,
                  grid: list[int]) -> torch.Tensor:
    return _layer(key, grid).run(q, k, v).contiguous()


@_attention_op.register_fake
def _(q, k, v, key, grid):
    return q.new_empty(q.shape[:3] + (v.shape[-1],))


@torch.library.custom_op("lite_boost_graph::sparse_joint_attention", mutates_args=())
def _joint_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, jq: torch.Tensor, jk: torch.Tensor,
                        jv: torch.Tensor, key_mask: torch.Tensor | None, first: bool, key: torch.Tensor,
                        grid: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    out, joint_out = _layer(key, grid).run(q, k, v, JointTokens(jq, jk, jv, key_mask, first))
    # the two are usually slices of one joint output: a custom op's outputs may not alias each other
    return out.clone(memory_format=torch.contiguous_format), joint_out.clone(memory_format=torch.contiguous_format)


@_joint_attention_op.register_fake
def _(q, k, v, jq, jk, jv, key_mask, first, key, grid):
    return q.new_empty(q.shape[:3] + (v.shape[-1],)), jq.new_empty(jq.shape[:3] + (jv.shape[-1],))
