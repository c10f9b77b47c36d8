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
  that the adapter's position-embedding cache calls to serve only this rank's rows;
* ``split_kv_processors`` (optional): attribute of that state listing processors whose ``attn_fn(q, k, v)``
  takes queries every rank holds whole and keys / values of the split sequence (wrapped in
  :class:`~lite_boost.parallel.split_kv.SplitKeysAttention`: this rank's keys, merged over the group).

Sequence layout: the sequence is padded at its end to a multiple of the degree and each rank holds
``ceil(S / P)`` consecutive tokens; :class:`~lite_boost.parallel.ulysses.SequenceShardInfo` carries
the real length from the split hooks to the attention wrapper and the gather hook.

A sequence may start with a head every rank holds whole (``SplitInput(tail=...)``,
``GatherOutput(tail=True)``): only its last part, the sharded stream, is split and gathered.

Module paths may contain ``*`` for a ``ModuleList`` index (``"transformer_blocks.*"``): the rule then
applies at every matching module, for tensors a model passes unsharded to every block (Qwen-Image's
per-token ``modulate_index``).

Text streams: with ``text="replicate"`` (the default) the text tokens of joint attention stay whole
on every rank and only the image / video stream is split; the attention wrapper slices the text to
its heads (:mod:`lite_boost.ops.joint`). ``text="shard"`` declares that the plan splits the text
arguments too (as diffusers' own plans do), for families whose processors attend the text as part of
the sharded stream.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass, field
from typing import Callable

import torch

from .comm import Communicator, shard_length
from .ulysses import SequenceShardInfo, UlyssesAttention

__all__ = [
    "SplitInput",
    "SplitOutput",
    "GatherOutput",
    "ShardingPlan",
    "CfgPlan",
    "CFG_KINDS",
    "PipelinePlan",
    "PlanError",
    "RankArg",
    "SequenceParallelHooks",
    "TEXT_POLICIES",
]

TEXT_POLICIES = ("replicate", "shard")
# "separate": two transformer calls per step named by cache_context (Wan, Qwen-Image, Flux true CFG);
# "batched": one call with cond and uncond stacked on the batch (LTX, CogVideoX); "guider": one call per
# condition of the pipeline's diffusers guider, named by the guider (HunyuanVideo-1.5); "none": no CFG.
CFG_KINDS = ("separate", "batched", "guider", "none")


class PlanError(TypeError):
    """A model or pipeline cannot be parallelised (no plan, or the plan does not fit the model)."""


@dataclass(frozen=True)
class SplitInput:
    """Split input ``arg`` (keyword name) of ``module`` along ``dim`` before the module runs.

    ``module`` may contain ``*`` (every matching module). A tuple or list of tensors (RoPE tables a
    pipeline passes in, as CogVideoX's ``image_rotary_emb``) has each element split. ``ndim``: split
    only when the tensor has this many dims (e.g. per-token timesteps), else pass. ``defines_length``:
    this tensor's ``dim`` is the sequence (sets / checks the sequence length). ``broadcast``: a size-1
    ``dim`` broadcasts over the sequence and passes unsplit (one timestep per sample given as (B, 1),
    as LTXConditionPipeline does without a condition, next to (B, S) per-token timesteps).
    ``tail``: ``tail(boost_state) -> int | None``: only the last ``tail`` entries of ``dim`` are the
    sharded stream (split, and the sequence length when ``defines_length``); the entries before them
    are a head every rank holds whole and keeps in front of its shard (Qwen-Image 2.1's text and
    condition images ahead of the target image in one sequence). None (or a callable returning None):
    the whole ``dim`` is split.
    """

    module: str
    arg: str
    dim: int
    ndim: int | None = None
    defines_length: bool = True
    broadcast: bool = False
    tail: Callable[[object], int | None] | None = None


@dataclass(frozen=True)
class SplitOutput:
    """Split the tensor output(s) of ``module`` along ``dim``.

    ``index``: for a tuple output, split only that element (None: every element). Outputs whose
    ``dim`` already has the shard length (e.g. served pre-sliced by a cache), and outputs that are
    not tensors or tuples of tensors, pass through unchanged.
    """

    module: str
    dim: int
    index: int | None = None


@dataclass(frozen=True)
class RankArg:
    """Replace a scalar argument by a rank-dependent value before ``module`` runs.

    ``fn(value, start, stop) -> value``: [start, stop) is this rank's token range of the global
    sequence (``stop`` may pass the real length: padding). Example (HunyuanVideo-I2V, the first
    ``first_frame_num_tokens`` tokens are modulated differently)::

        RankArg("transformer_blocks.*", "first_frame_num_tokens",
                lambda n, start, stop: max(0, min(n - start, stop - start)))

    ``optional``: modules whose ``forward`` has no argument ``arg`` are left alone instead of
    failing the plan check (a model variant whose blocks lack it: HunyuanVideo's text-to-video blocks
    take no ``num_tokens``, its image-to-video token-replace blocks do).
    """

    module: str
    arg: str
    fn: Callable[[object, int, int], object]
    optional: bool = False


@dataclass(frozen=True)
class GatherOutput:
    """All-gather the tensor output of ``module`` along ``dim`` and drop the padding.

    ``tail``: only the last ``shard_len`` entries of ``dim`` are this rank's shard and are gathered;
    the entries before them (a replicated head, see :attr:`SplitInput.tail`) stay in front unchanged.
    """

    module: str
    dim: int
    tail: bool = False


@dataclass(frozen=True)
class ShardingPlan:
    """Where a model's token sequence is split and gathered (see the module docstring)."""

    split_inputs: tuple[SplitInput, ...]
    gather_outputs: tuple[GatherOutput, ...]
    split_outputs: tuple[SplitOutput, ...] = ()
    state_attr: str = "_lite_boost"
    attention_processors: str = "self_attention_processors"
    rope_range: str | None = None
    rank_args: tuple[RankArg, ...] = ()
    text: str = "replicate"
    split_kv_processors: str | None = None

    def __post_init__(self):
        if not self.split_inputs or not self.gather_outputs:
            raise PlanError("a ShardingPlan needs at least one split input and one gather output")
        if self.text not in TEXT_POLICIES:
            raise PlanError(f"ShardingPlan.text must be one of {list(TEXT_POLICIES)}, got {self.text!r}")


@dataclass(frozen=True)
class CfgPlan:
    """How a pipeline runs classifier-free guidance.

    kind: one of :data:`CFG_KINDS`. "separate": cond and uncond are two transformer calls, named
        ``cond`` / ``uncond`` by ``cache_context``; with cfg degree 2 each cfg rank computes one and
        the results are exchanged (``by_call_order``: the same two calls without context names).
        "guider": the pipeline's diffusers guider (attribute ``guider``) runs one call per condition
        inside ``cache_context(<its identifier>)``; CFG runs a step when the guider has exactly the
        two conditions ``cond`` / ``uncond`` (ClassifierFreeGuidance: ``pred_cond`` /
        ``pred_uncond``; it may switch CFG off for some steps); guiders with more predictions are
        refused before any collective. "batched": one call inside
        ``cache_context(cond)`` with the two branches stacked on the batch; with cfg degree 2 each
        cfg rank runs its half of the batch arguments ``batch_args`` and the output is gathered on
        the batch. "none": no CFG.
    flag: pipeline attribute that is truthy when CFG runs this call, or None when the pipeline
        keeps it in a local variable (then ``encodes``: CFG runs iff the pipeline method ``encodes``
        ran twice since ``call_start`` last ran, once for the prompt and once for the negative
        prompt, as in Qwen-Image's pipelines). Not used by the "guider" kind.
    guider: "guider" kind: the pipeline attribute holding the diffusers guider.
    cond / uncond: the ``cache_context`` names of the two passes (batched: ``cond`` names the call).
    batch_args: batched kind: the forward arguments that carry the two branches on dim 0.
    output_shape: separate kind: ``output_shape(model, args, kwargs) -> shape`` of the transformer
        output, so the rank that defers a pass can return a placeholder of the right shape (needed
        when the pipeline takes a view of the output, e.g. slices the target tokens, before the
        exchange fills it); None = an empty placeholder resized at the exchange.
    by_call_order: separate kind, for pipelines that name neither pass (no ``cache_context``, as
        Flux's Img2Img / Inpaint / Kontext pipelines and HunyuanVideo's I2V pipeline): while CFG
        runs, the transformer calls alternate cond, uncond (cond first), counted from the start of
        each pipeline call (``call_start``, which is then required).
    """

    flag: str | None = "do_classifier_free_guidance"
    cond: str = "cond"
    uncond: str = "uncond"
    kind: str = "separate"
    encodes: str | None = None
    call_start: str | None = None
    batch_args: tuple[str, ...] = ()
    output_shape: Callable | None = None
    by_call_order: bool = False
    guider: str | None = None

    def __post_init__(self):
        if self.kind not in CFG_KINDS:
            raise PlanError(f"CfgPlan.kind must be one of {list(CFG_KINDS)}, got {self.kind!r}")
        if self.kind == "guider":
            if not self.guider:
                raise PlanError("CfgPlan(kind='guider') needs guider= (the pipeline attribute holding the guider)")
        elif self.kind != "none" and self.flag is None and not (self.encodes and self.call_start):
            raise PlanError("CfgPlan needs a pipeline flag attribute, or encodes= and call_start= method names")
        if self.kind == "batched" and not self.batch_args:
            raise PlanError("CfgPlan(kind='batched') needs batch_args (the forward arguments holding both branches)")
        if self.by_call_order and (self.kind != "separate" or not self.call_start):
            raise PlanError("CfgPlan(by_call_order=True) needs kind='separate' and call_start= (the pipeline method "
                            "that starts every call, where the order is reset)")


@dataclass(frozen=True)
class PipelinePlan:
    """A pipeline's parallel layout: which attributes hold transformers, CFG, latent preparation.

    without_cfg: class names of the family's pipelines that run no classifier-free guidance at all
    (guidance-distilled variants such as Flux's Control / Fill pipelines): ``cfg`` does not apply
    to them, so cfg degree 2 is refused for them (subclasses included).
    cfg_by_pipeline: (pipeline class name, CfgPlan) pairs for pipelines of the family that run their
    guidance another way than ``cfg`` says (Qwen-Image 2.1's modular pipelines: a guider), subclasses
    included; the first match along the class's MRO applies.
    """

    transformers: tuple[str, ...] = ("transformer",)
    cfg: CfgPlan | None = field(default_factory=CfgPlan)
    prepare_latents: str | None = "prepare_latents"
    without_cfg: tuple[str, ...] = ()
    cfg_by_pipeline: tuple[tuple[str, CfgPlan], ...] = ()

    def cfg_for(self, pipe) -> CfgPlan | None:
        """The CFG plan that applies to ``pipe`` (None for a pipeline listed in ``without_cfg``)."""
        mro = [cls.__name__ for cls in type(pipe).__mro__]
        if any(name in self.without_cfg for name in mro):
            return None
        own = dict(self.cfg_by_pipeline)
        return next((own[name] for name in mro if name in own), self.cfg)


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
            (default: Ulysses over ``comm``; ``parallel.manager`` adds Ring / USP from the mesh).

    The processors the plan's ``split_kv_processors`` lists (queries whole, keys / values split) get their
    ``attn_fn`` wrapped in :class:`~lite_boost.parallel.split_kv.SplitKeysAttention` over ``comm``.
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
    def _modules(self, path: str) -> list[torch.nn.Module]:
        """The module at ``path``, or every module matching it when it contains ``*``."""
        if "*" in path:
            pattern = re.compile(r"\.".join(r"\d+" if p == "*" else re.escape(p) for p in path.split(".")))
            found = [m for name, m in self.model.named_modules() if pattern.fullmatch(name)]
        else:
            try:
                found = [self.model.get_submodule(path) if path else self.model]
            except AttributeError:
                found = []
        if not found:
            raise PlanError(
                f"sharding plan of {type(self.model).__name__} names module {path!r}, which this instance lacks"
            )
        return found

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
        if plan.split_kv_processors is not None and not all(
                hasattr(p, "attn_fn") for p in getattr(state, plan.split_kv_processors, None) or ()):
            raise PlanError(f"boost state of {type(self.model).__name__} has processors without attn_fn in "
                            f"{plan.split_kv_processors!r}")
        for s in (*plan.split_inputs, *plan.rank_args):
            for mod in self._modules(s.module):
                if _arg_index(mod, s.arg) is None and not getattr(s, "optional", False):
                    raise PlanError(f"module {s.module!r} ({type(mod).__name__}).forward has no argument {s.arg!r}")
        for g in (*plan.gather_outputs, *plan.split_outputs):
            self._modules(g.module)
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

    @staticmethod
    def _replace_arg(module: torch.nn.Module, name: str, fn):
        """A pre-hook replacing argument ``name`` (keyword or positional) by ``fn(value)`` (None = keep)."""
        index = _arg_index(module, name)

        def pre_hook(mod, args, kwargs):
            if name in kwargs:
                new = fn(kwargs[name])
                if new is not None:
                    return args, {**kwargs, name: new}
            elif index is not None and index < len(args):
                new = fn(args[index])
                if new is not None:
                    return args[:index] + (new,) + args[index + 1:], kwargs
            return None

        return pre_hook

    def _split_tail(self, x: torch.Tensor, spec: SplitInput, tail: int | None) -> torch.Tensor:
        """Split ``x``, or only its last ``tail`` entries of ``spec.dim`` (the head kept in front)."""
        dim = spec.dim % x.ndim
        if tail is None:
            return self._split(x, dim, spec.defines_length)
        if not 0 <= tail <= x.shape[dim]:
            raise RuntimeError(f"split of {spec.arg!r} at {spec.module!r}: the sharded tail has {tail} entries, "
                               f"the tensor {x.shape[dim]} along dim {dim}")
        head = x.shape[dim] - tail
        part = self._split(x.narrow(dim, head, tail), dim, spec.defines_length)
        return torch.cat([x.narrow(dim, 0, head), part], dim=dim) if head else part

    def _make_split_input(self, spec: SplitInput, module: torch.nn.Module):
        def fits(x):
            return (isinstance(x, torch.Tensor) and (spec.ndim is None or x.ndim == spec.ndim)
                    and not (spec.broadcast and x.ndim and x.shape[spec.dim] == 1))

        def split(x):
            tail = spec.tail(self._state) if spec.tail is not None else None
            if fits(x):
                return self._split_tail(x, spec, tail)
            if type(x) in (tuple, list) and x and all(fits(t) for t in x):  # e.g. (cos, sin) passed in
                return type(x)(self._split_tail(t, spec, tail) for t in x)
            return None

        return self._replace_arg(module, spec.arg, split)

    def _make_rank_arg(self, spec: RankArg, module: torch.nn.Module):
        def replace(value):
            if value is None or self.info.shard_len is None:
                return None
            start = self.comm.rank * self.info.shard_len
            return spec.fn(value, start, start + self.info.shard_len)

        return self._replace_arg(module, spec.arg, replace)

    def _make_split_output(self, spec: SplitOutput):
        def one(t):
            d = spec.dim % t.ndim
            if self.info.shard_len is not None and t.shape[d] == self.info.shard_len:
                return t
            return self.comm.shard(t, d)

        def hook(mod, args, out):
            if isinstance(out, torch.Tensor):
                return one(out) if spec.index in (None, 0) else None
            if type(out) not in (tuple, list) or not out:
                return None
            if spec.index is not None:
                if spec.index >= len(out) or not isinstance(out[spec.index], torch.Tensor):
                    return None
                return type(out)(one(t) if i == spec.index else t for i, t in enumerate(out))
            if all(isinstance(t, torch.Tensor) for t in out):
                return type(out)(one(t) for t in out)
            return None

        return hook

    def _make_gather(self, spec: GatherOutput):
        def hook(mod, args, out):
            if not isinstance(out, torch.Tensor):
                raise PlanError(f"gather output of {spec.module!r} expects a tensor, got {type(out).__name__}")
            if not spec.tail or self.info.shard_len is None:
                return self.comm.gather(out, spec.dim, self.info.seq_len)
            dim = spec.dim % out.ndim
            head = out.shape[dim] - self.info.shard_len
            gathered = self.comm.gather(out.narrow(dim, head, self.info.shard_len), dim, self.info.seq_len)
            return torch.cat([out.narrow(dim, 0, head), gathered], dim=dim) if head else gathered

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
            for mod in self._modules(spec.module):
                self._handles.append(mod.register_forward_pre_hook(self._make_split_input(spec, mod), with_kwargs=True))
        for spec in plan.rank_args:
            for mod in self._modules(spec.module):
                if _arg_index(mod, spec.arg) is not None:  # (optional rank args skip modules without it)
                    self._handles.append(mod.register_forward_pre_hook(self._make_rank_arg(spec, mod),
                                                                       with_kwargs=True))
        for spec in plan.split_outputs:
            for mod in self._modules(spec.module):
                self._handles.append(mod.register_forward_hook(self._make_split_output(spec)))
        for spec in plan.gather_outputs:
            for mod in self._modules(spec.module):
                self._handles.append(mod.register_forward_hook(self._make_gather(spec)))
        for proc in getattr(self._state, plan.attention_processors):
            self._wrapped.append((proc, proc.attn_fn))
            proc.attn_fn = self.wrap_attention(proc.attn_fn, self.info)
        if plan.split_kv_processors is not None:
            from .split_kv import SplitKeysAttention

            for proc in getattr(self._state, plan.split_kv_processors, None) or ():
                self._wrapped.append((proc, proc.attn_fn))
                proc.attn_fn = SplitKeysAttention(proc.attn_fn, self.comm, self.info)
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
