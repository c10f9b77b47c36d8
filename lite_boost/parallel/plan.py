"""Declarative sharding plans and the generic hooks that execute them.

A model adapter describes *where* its sequence is split and gathered with a :class:`ShardingPlan`
(module paths, argument names, dimensions); this module turns the plan into removable PyTorch
forward hooks on those module boundaries. Nothing here knows any particular model.

Contract with the adapter (all names come from the plan):

* ``state_attr``: the attribute of the model holding the adapter's boost state;
* ``attention_processors``: attribute of that state listing the self-attention processors, each
  with a replaceable ``attn_fn(q, k, v)`` on (B, S, H, D) tensors (wrapped in
  :class:`~lite_boost.parallel.ulysses.UlyssesAttention`);
* ``rope_range`` (optional): attribute of the state holding ``Callable[[seq_len], (start, stop)]``
  that the adapter's position-embedding cache calls to serve only this rank's rows.

Sequence layout: the sequence is padded at its end to a multiple of the degree and each rank holds
``ceil(S / P)`` consecutive tokens; :class:`~lite_boost.parallel.ulysses.SequenceShardInfo` carries
the real length from the split hooks to the attention wrapper and the gather hook.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch

from .comm import Communicator, shard_length
from .ulysses import SequenceShardInfo, UlyssesAttention

__all__ = [
    "SplitInput",
    "SplitOutput",
    "GatherOutput",
    "ShardingPlan",
    "CfgPlan",
    "PipelinePlan",
    "PlanError",
    "SequenceParallelHooks",
]


class PlanError(TypeError):
    """A model or pipeline cannot be parallelised (no plan, or the plan does not fit the model)."""


@dataclass(frozen=True)
class SplitInput:
    """Split input ``arg`` (keyword name) of ``module`` along ``dim`` before the module runs.

    ``ndim``: split only when the tensor has this many dims (e.g. per-token timesteps), else pass.
    ``defines_length``: this tensor's ``dim`` is the sequence (sets / checks the sequence length).
    """

    module: str
    arg: str
    dim: int
    ndim: int | None = None
    defines_length: bool = True


@dataclass(frozen=True)
class SplitOutput:
    """Split the tensor output(s) of ``module`` along ``dim`` (tuples of tensors: every element).

    Outputs whose ``dim`` already has the shard length (e.g. served pre-sliced by a cache), and
    outputs that are not tensors or tuples of tensors, pass through unchanged.
    """

    module: str
    dim: int


@dataclass(frozen=True)
class GatherOutput:
    """All-gather the tensor output of ``module`` along ``dim`` and drop the padding."""

    module: str
    dim: int


@dataclass(frozen=True)
class ShardingPlan:
    """Where a model's token sequence is split and gathered (see the module docstring)."""

    split_inputs: tuple[SplitInput, ...]
    gather_outputs: tuple[GatherOutput, ...]
    split_outputs: tuple[SplitOutput, ...] = ()
    state_attr: str = "_lite_boost"
    attention_processors: str = "self_attention_processors"
    rope_range: str | None = None

    def __post_init__(self):
        if not self.split_inputs or not self.gather_outputs:
            raise PlanError("a ShardingPlan needs at least one split input and one gather output")


@dataclass(frozen=True)
class CfgPlan:
    """How a pipeline runs classifier-free guidance.

    flag: pipeline attribute that is truthy when CFG runs this call (both passes follow).
    cond / uncond: names the pipeline gives the two transformer calls via ``cache_context(name)``.
    """

    flag: str = "do_classifier_free_guidance"
    cond: str = "cond"
    uncond: str = "uncond"


@dataclass(frozen=True)
class PipelinePlan:
    """A pipeline's parallel layout: which attributes hold transformers, CFG, latent preparation."""

    transformers: tuple[str, ...] = ("transformer",)
    cfg: CfgPlan | None = field(default_factory=CfgPlan)
    prepare_latents: str | None = "prepare_latents"


def _arg_index(module: torch.nn.Module, arg: str) -> int | None:
    try:
        params = list(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return None
    return params.index(arg) if arg in params else None


class SequenceParallelHooks:
    """Apply a ShardingPlan to one model instance; ``remove()`` restores it exactly.

    Args:
        model: the model instance (already boosted by its adapter).
        plan: its ShardingPlan.
        comm: Communicator of the sequence-parallel group.
        wrap_attention: ``(attn_fn, shard_info) -> wrapper`` for each self-attention ``attn_fn``
            (default: Ulysses over ``comm``; the mesh's ``sequence_attention`` adds Ring / USP).
    """

    def __init__(self, model: torch.nn.Module, plan: ShardingPlan, comm: Communicator, wrap_attention=None):
        self.model = model
        self.plan = plan
        self.comm = comm
        self.wrap_attention = wrap_attention or (lambda fn, info: UlyssesAttention(fn, comm, info))
        self.info = SequenceShardInfo(comm.size)
        self._handles = []
        self._wrapped = []  # (processor, original attn_fn)
        self._state = None
        self._old_rope_range = None
        self._check()

    # -------------------------------------------------------------- validation (no collectives)
    def _module(self, path: str) -> torch.nn.Module:
        try:
            return self.model.get_submodule(path) if path else self.model
        except AttributeError:
            raise PlanError(
                f"sharding plan of {type(self.model).__name__} names module {path!r}, which this instance lacks"
            ) from None

    def _check(self) -> None:
        plan = self.plan
        state = getattr(self.model, plan.state_attr, None)
        if state is None:
            raise PlanError(f"{type(self.model).__name__} is not boosted (no {plan.state_attr!r} state); "
                            "boost it before applying a sharding plan")
        procs = getattr(state, plan.attention_processors, None)
        if not procs or not all(hasattr(p, "attn_fn") for p in procs):
            raise PlanError(f"boost state of {type(self.model).__name__} has no processors with attn_fn in "
                            f"{plan.attention_processors!r}")
        for s in plan.split_inputs:
            mod = self._module(s.module)
            if _arg_index(mod, s.arg) is None:
                raise PlanError(f"module {s.module!r} ({type(mod).__name__}).forward has no argument {s.arg!r}")
        for g in (*plan.gather_outputs, *plan.split_outputs):
            self._module(g.module)
        self._state = state

    # -------------------------------------------------------------- hooks
    def _split(self, x: torch.Tensor, dim: int, defines_length: bool) -> torch.Tensor:
        dim = dim % x.ndim
        if defines_length:
            n = x.shape[dim]
            if self.info.seq_len is None:
                self.info.set(n)
            elif self.info.seq_len != n:
                raise RuntimeError(f"sequence length changed within one forward: {self.info.seq_len} -> {n}")
        return self.comm.shard(x, dim)

    def _make_split_input(self, spec: SplitInput, module: torch.nn.Module):
        index = _arg_index(module, spec.arg)

        def pre_hook(mod, args, kwargs):
            if spec.arg in kwargs:
                x = kwargs[spec.arg]
                if isinstance(x, torch.Tensor) and (spec.ndim is None or x.ndim == spec.ndim):
                    kwargs = dict(kwargs)
                    kwargs[spec.arg] = self._split(x, spec.dim, spec.defines_length)
                    return args, kwargs
            elif index is not None and index < len(args):
                x = args[index]
                if isinstance(x, torch.Tensor) and (spec.ndim is None or x.ndim == spec.ndim):
                    args = list(args)
                    args[index] = self._split(x, spec.dim, spec.defines_length)
                    return tuple(args), kwargs
            return None

        return pre_hook

    def _make_split_output(self, spec: SplitOutput):
        def hook(mod, args, out):
            def one(t):
                d = spec.dim % t.ndim
                if self.info.shard_len is not None and t.shape[d] == self.info.shard_len:
                    return t
                return self.comm.shard(t, d)

            if isinstance(out, torch.Tensor):
                return one(out)
            if type(out) in (tuple, list) and out and all(isinstance(t, torch.Tensor) for t in out):
                return type(out)(one(t) for t in out)
            return None

        return hook

    def _make_gather(self, spec: GatherOutput):
        def hook(mod, args, out):
            if not isinstance(out, torch.Tensor):
                raise PlanError(f"gather output of {spec.module!r} expects a tensor, got {type(out).__name__}")
            return self.comm.gather(out, spec.dim, self.info.seq_len)

        return hook

    def _root_pre(self, mod, args, kwargs):
        self.info.clear()
        return None

    def _rope_range(self, seq_len: int) -> tuple[int, int]:
        s = shard_length(seq_len, self.comm.size)
        return self.comm.rank * s, (self.comm.rank + 1) * s

    def apply(self) -> "SequenceParallelHooks":
        plan = self.plan
        # clear the shard info at the start of every forward (registered first: runs first)
        self._handles.append(self.model.register_forward_pre_hook(self._root_pre, with_kwargs=True))
        for spec in plan.split_inputs:
            mod = self._module(spec.module)
            self._handles.append(mod.register_forward_pre_hook(self._make_split_input(spec, mod), with_kwargs=True))
        for spec in plan.split_outputs:
            self._handles.append(self._module(spec.module).register_forward_hook(self._make_split_output(spec)))
        for spec in plan.gather_outputs:
            self._handles.append(self._module(spec.module).register_forward_hook(self._make_gather(spec)))
        for proc in getattr(self._state, plan.attention_processors):
            self._wrapped.append((proc, proc.attn_fn))
            proc.attn_fn = self.wrap_attention(proc.attn_fn, self.info)
        if plan.rope_range is not None and hasattr(self._state, plan.rope_range):
            self._old_rope_range = getattr(self._state, plan.rope_range)
            setattr(self._state, plan.rope_range, self._rope_range)
        return self

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for proc, fn in self._wrapped:
            proc.attn_fn = fn
        self._wrapped.clear()
        if self.plan.rope_range is not None and self._state is not None and hasattr(self._state, self.plan.rope_range):
            setattr(self._state, self.plan.rope_range, self._old_rope_range)
        self.info.clear()
