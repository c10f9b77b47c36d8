"""Sequence parallelism on the generic path: execute a diffusers ``_cp_plan`` with lite_boost's Ulysses / Ring.

diffusers' transformers that support its context parallelism carry a ``_cp_plan``: for module names
(``""`` = the model, ``"blocks.*"`` = every block) a ``ContextParallelInput`` says which forward argument
(or, with ``split_output=True``, which output) is split along which dimension, and a
``ContextParallelOutput`` says which output is gathered. Their attention processors mark the calls that
see the split sequence by passing ``parallel_config=self._parallel_config`` to ``dispatch_attention_fn``
(cross-attention to a whole text passes None).

:class:`GenericSequencePlan` executes such a plan on a model boosted on the generic path, with lite_boost's
own collectives instead of diffusers' ``ContextParallelConfig`` / device mesh:

* splits are ``tensor_split`` shards (any token count: rank r holds ``ceil`` or ``floor(S / P)`` tokens, no
  padding tokens ever enter the model, so a processor may concatenate several split streams, as Flux.2
  concatenates text and image);
* every processor's ``_parallel_config`` is set to a marker object of this model; the model's
  :class:`~lite_boost.adapter.generic.GenericAttention` sends exactly the calls carrying the marker to
  :class:`SequenceParallelAttention`:

  - self-attention (q, k and v of the same length on every rank): one tiny all_gather of the local
    lengths, then the tokens are moved to the equal, suffix-padded shards of
    :mod:`lite_boost.parallel.comm` (one all_to_all, skipped when the lengths are already equal) and
    lite_boost's Ulysses (uneven head counts), Ring or Ulysses x Ring run on them; the result goes back
    the same way;
  - attention to a split sequence of another length (split text keys, a split key-padding mask): the
    keys, values and mask are all-gathered and the local queries attend to all of them;

* each ``ContextParallelOutput`` all-gathers its output in rank order (uneven lengths).

Nothing changes for the one-process forward; ``remove()`` restores the processors and removes the hooks.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch

from ..config import ConfigError
from ..parallel.comm import shard_length
from ..parallel.plan import PlanError
from ..parallel.ulysses import SequenceShardInfo
from .boost import STATE_ATTR

__all__ = ["PLAN_GAPS", "plan_gap", "fitted_plan", "key_bias", "GenericSequencePlan", "key_padding_mask", "SequenceParallelAttention", "cp_plan_of", "sequence_plan", "NO_PLAN_HELP"]

NO_PLAN_HELP = (
    "Supply one before ParallelManager, either as diffusers' context-parallel plan on the instance "
    "(model._cp_plan = {'': {'hidden_states': ContextParallelInput(split_dim=1, expected_dims=3)}, "
    "'proj_out': ContextParallelOutput(gather_dim=1, expected_dims=3)}, from diffusers.models._modeling_parallel; "
    "the processors must pass parallel_config=self._parallel_config to dispatch_attention_fn for the attention "
    "over the split sequence), or as a ModelFamily(sharding=ShardingPlan(...)) record (the adapter guide)")


# diffusers plans known not to cover every tensor their model splits, by class: the generic path refuses sequence
# parallelism with the reason while the model uses the class's own plan (an instance plan the user supplies wins)
PLAN_GAPS = MappingProxyType({
    "LTX2VideoTransformer3DModel": (
        "diffusers' _cp_plan of LTX2VideoTransformer3DModel splits the video tokens and the RoPE tables of 'rope', "
        "but not those of 'cross_attn_rope' that the audio-video cross-attention applies to the same video tokens "
        "(the shapes disagree on every rank), nor does it say how the unsplit audio stream meets the split video"),
})


def plan_gap(model) -> str | None:
    """Why the class's own ``_cp_plan`` cannot run ``model`` (a model instance or class), or None."""
    cls = model if isinstance(model, type) else type(model)
    why = PLAN_GAPS.get(cls.__name__)
    if why is None or getattr(model, "_cp_plan", None) is not getattr(cls, "_cp_plan", None):
        return None
    return why


def cp_plan_of(model) -> dict | None:
    """The diffusers ``_cp_plan`` of ``model`` (instance attribute first, then the class), or None."""
    plan = getattr(model, "_cp_plan", None)
    return plan if isinstance(plan, dict) and plan else None


def _modules(model, path: str) -> list[torch.nn.Module]:
    if path == "":
        return [model]
    if "*" in path:
        pattern = re.compile(r"\.".join(r"\d+" if p == "*" else re.escape(p) for p in path.split(".")))
        return [m for name, m in model.named_modules() if pattern.fullmatch(name)]
    try:
        return [model.get_submodule(path)]
    except AttributeError:
        return []


def _past_depth(model, path: str) -> tuple[int, int] | None:
    """(atom position, list length) where ``path`` indexes a ModuleList past its end, else None."""
    mod = model
    for i, atom in enumerate(path.split(".") if path else []):
        if isinstance(mod, torch.nn.ModuleList) and atom.isdigit():
            if int(atom) >= len(mod):
                return i, len(mod)
            mod = mod[int(atom)]
        elif atom in getattr(mod, "_modules", {}):
            mod = mod._modules[atom]
        else:
            return None
    return None


def fitted_plan(model, plan: dict) -> dict:
    """``plan`` without the entries of an enumeration that runs past the instance's depth: diffusers plans that
    list every block of the released model (Helios: ``blocks.0.attn1`` .. ``blocks.39.attn1``) name modules a
    smaller config lacks. An entry is dropped only when the plan enumerates every index the instance has, so a
    wrong name stays (and is refused by the check)."""
    keep = {}
    for path, entry in plan.items():
        past = None if _modules(model, path) else _past_depth(model, path)
        if past is not None:
            pos, length = past
            atoms = path.split(".")
            listed = {p.split(".")[pos] for p in plan
                      if len(p.split(".")) == len(atoms)
                      and all(a == b for j, (a, b) in enumerate(zip(p.split("."), atoms)) if j != pos)}
            if {str(i) for i in range(length)} <= listed:
                continue
        keep[path] = entry
    return keep


def _params(module) -> list[str]:
    try:
        return list(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return []


def _check_plan(model, plan: dict) -> None:
    """PlanError when ``plan`` does not fit ``model`` (module names, argument names, entry types)."""
    from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

    name = type(model).__name__
    for path, entry in plan.items():
        mods = _modules(model, path)
        if not mods:
            raise PlanError(f"the _cp_plan of {name} names module {path!r}, which this instance lacks")
        if isinstance(entry, dict):
            for key, spec in entry.items():
                specs = spec if isinstance(spec, (list, tuple)) else [spec]
                if not all(isinstance(s, ContextParallelInput) for s in specs):
                    raise PlanError(f"_cp_plan[{path!r}][{key!r}] of {name} must be a ContextParallelInput (or a "
                                    f"list of them), got {spec!r}")
                if isinstance(key, int):
                    if not all(s.split_output for s in specs):
                        raise PlanError(f"_cp_plan[{path!r}][{key}] of {name}: an output index needs "
                                        "ContextParallelInput(split_output=True)")
                    continue
                for m in mods:
                    if key not in _params(m):
                        raise PlanError(f"_cp_plan[{path!r}] of {name} splits argument {key!r}, which "
                                        f"{type(m).__name__}.forward does not take")
        else:
            specs = entry if isinstance(entry, (list, tuple)) else [entry]
            if not all(s is None or isinstance(s, ContextParallelOutput) for s in specs):
                raise PlanError(f"_cp_plan[{path!r}] of {name} must be a dict of ContextParallelInput or "
                                f"ContextParallelOutput(s), got {entry!r}")


@dataclass(frozen=True)
class GenericSequencePlan:
    """A diffusers ``_cp_plan`` as a lite_boost sequence-parallel plan (``install`` executes it)."""

    model_class: str
    plan: Any = field(compare=False, repr=False)  # the diffusers plan dict
    source: str = "_cp_plan"

    def check(self, model, config=None) -> None:
        """PlanError / ConfigError before any collective when the plan or ``config`` cannot run on ``model``."""
        _check_plan(model, fitted_plan(model, self.plan))
        if config is None:
            return
        if config.sparse is not None and config.sparse.sparse_type is not None:
            raise ConfigError(f"sparse (BoostConfig.sparse) with sequence parallelism is not supported for "
                              f"{self.model_class} on the generic path (a _cp_plan may concatenate several split "
                              "streams, so the latent token grid is not known per rank); use sparse=None or one rank")
        if config.cache is not None:
            raise ConfigError(f"cache (BoostConfig.cache) with sequence parallelism is not supported for "
                              f"{self.model_class} on the generic path yet (the step-cache decision is not made "
                              "rank-consistent for a _cp_plan); use cache=None or one rank")

    def install(self, model, mesh) -> "_Installed":
        """Execute the plan on ``model`` (boosted on the generic path) over ``mesh``'s sequence group."""
        return _Installed(model, fitted_plan(model, self.plan), mesh).apply()


def sequence_plan(model) -> GenericSequencePlan | None:
    plan = cp_plan_of(model)
    return GenericSequencePlan(type(model).__name__, plan) if plan is not None else None


# ----------------------------------------------------------------------------------------------- attention
def key_padding_mask(attn_mask, q: torch.Tensor, k: torch.Tensor):
    """A boolean mask that only pads keys ((B, S_k), (B, 1, S_k), (B, 1, 1, S_k)) as (B, S_k) bool, else None."""
    if attn_mask is None or attn_mask.dtype != torch.bool:
        return None
    b, s_k = q.shape[0], k.shape[1]
    m = attn_mask
    if m.dim() == 2 and m.shape == (b, s_k):
        return m
    if m.dim() in (3, 4) and m.shape[-1] == s_k and all(d == 1 for d in m.shape[1:-1]) and m.shape[0] in (1, b):
        return m.reshape(m.shape[0], s_k).expand(b, s_k)
    return None


def key_bias(attn_mask, q: torch.Tensor, k: torch.Tensor):
    """A float mask that only biases keys, (B or 1, H or 1, 1, S_k) (an additive padding bias such as LTX-2's
    ``(1 - mask) * -10000``), as it is, else None."""
    if attn_mask is None or not attn_mask.is_floating_point() or attn_mask.dim() != 4:
        return None
    b, n, one, s_k = attn_mask.shape
    if s_k != k.shape[1] or one != 1 or b not in (1, q.shape[0]) or n not in (1, q.shape[2]):
        return None
    return attn_mask


class _Marker:
    """The processors' ``_parallel_config`` while a model runs sequence parallel: marks the attention calls
    over the split sequence (diffusers' processors pass it on to the dispatcher only for those)."""

    context_parallel_config = None
    tensor_parallel_config = None

    def __repr__(self) -> str:
        return "lite_boost sequence parallel"


def _rows(x: torch.Tensor) -> torch.Tensor:
    """(B, L, ...) -> (L, B * ...) contiguous rows."""
    return x.transpose(0, 1).reshape(x.shape[1], -1)


def _overlap(a0: int, a1: int, b0: int, b1: int) -> int:
    return max(0, min(a1, b1) - max(a0, b0))


class SequenceParallelAttention:
    """The attention of the calls over the split sequence (see the module docstring)."""

    def __init__(self, ctx, mesh):
        from ..parallel.ring import sequence_parallel_attention

        self.ctx = ctx
        self.mesh = mesh
        self.comm = mesh.sequence
        self.marker = _Marker()
        self.info = SequenceShardInfo(self.comm.size)
        self.wrapper = sequence_parallel_attention(ctx.self_attn_fn, mesh.ulysses, mesh.ring, self.info,
                                                   rotate_method=mesh.rotate_method)

    def __call__(self, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if dropout_p or is_causal or q.dim() != 4 or scale is not None and scale != q.shape[-1] ** -0.5:
            raise RuntimeError(f"{self.ctx.model_class}: sequence-parallel attention takes neither dropout, causal "
                               "attention nor a custom scale (the processor asked for one)")
        key_mask = key_padding_mask(attn_mask, q, k) if attn_mask is not None else None
        bias = key_bias(attn_mask, q, k) if key_mask is None else None
        if attn_mask is not None and key_mask is None and bias is None:
            raise RuntimeError(f"{self.ctx.model_class}: sequence-parallel attention takes no attention mask other "
                               f"than a boolean key-padding mask or a float bias over the keys only, (B, 1 or H, 1, "
                               f"S_k) (got {tuple(attn_mask.shape)} {attn_mask.dtype})")
        comm = self.comm
        n = torch.tensor([q.shape[1], k.shape[1]], dtype=torch.int64, device=q.device)
        every = n.new_empty(2 * comm.size)
        comm.all_gather_into(every, n, op="sp_lengths")
        lengths = every.view(comm.size, 2).tolist()
        lq, lk = [a for a, _ in lengths], [b for _, b in lengths]
        if k.shape[2] != q.shape[2]:  # grouped-query attention: every query head its key / value head
            k = k.repeat_interleave(q.shape[2] // k.shape[2], dim=2)
            v = v.repeat_interleave(q.shape[2] // v.shape[2], dim=2)
        if lq == lk and key_mask is None and bias is None:
            return self._self(q, k, v, lq)
        return self._gathered(q, k, v, key_mask, lk, bias)

    # self-attention over the split sequence: Ulysses / Ring / USP on balanced shards
    def _self(self, q, k, v, counts: list[int]) -> torch.Tensor:
        comm = self.comm
        P, r = comm.size, comm.rank
        S = sum(counts)
        s = shard_length(S, P)
        even = all(c == s for c in counts)
        B, _, H, D = q.shape
        if not even:
            off = [sum(counts[:i]) for i in range(P)]
            send = [_overlap(off[r], off[r] + counts[r], t * s, min((t + 1) * s, S)) for t in range(P)]
            recv = [_overlap(off[u], off[u] + counts[u], r * s, min((r + 1) * s, S)) for u in range(P)]
            packed = torch.cat([_rows(q), _rows(k), _rows(v)], dim=1)
            unit = packed.shape[1]
            got = comm.exchange(packed.reshape(-1), [c * unit for c in recv], [c * unit for c in send],
                                op="sp_balance").view(sum(recv), unit)
            if got.shape[0] < s:
                got = torch.cat([got, got.new_zeros(s - got.shape[0], unit)])
            wq, wk = B * H * D, B * k.shape[2] * k.shape[3]
            q = got[:, :wq].reshape(s, B, H, D).transpose(0, 1)
            k = got[:, wq:wq + wk].reshape(s, B, k.shape[2], k.shape[3]).transpose(0, 1)
            v = got[:, wq + wk:].reshape(s, B, v.shape[2], v.shape[3]).transpose(0, 1)
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        self.info.set(S)
        try:
            out = self.wrapper(q, k, v)
        finally:
            self.info.clear()
        if even:
            return out
        dv = out.shape[-1]
        mine = max(0, min(s, S - r * s))
        rows = _rows(out[:, :mine])
        unit = B * H * dv
        back = comm.exchange(rows.reshape(-1), [c * unit for c in send], [c * unit for c in recv],
                             op="sp_unbalance").view(counts[r], B, H, dv)
        return back.transpose(0, 1).contiguous()

    # attention to another split sequence: gather keys, values (and the key mask)
    def _gathered(self, q, k, v, key_mask, lk: list[int], bias=None) -> torch.Tensor:
        comm = self.comm
        k = comm.all_gather_uneven(k.contiguous(), 1, sizes=lk, op="sp_keys")
        v = comm.all_gather_uneven(v.contiguous(), 1, sizes=lk, op="sp_values")
        if key_mask is not None:
            key_mask = comm.all_gather_uneven(key_mask.to(torch.uint8).contiguous(), 1, sizes=lk,
                                              op="sp_key_mask").bool()
        if bias is not None:
            bias = comm.all_gather_uneven(bias.contiguous(), 3, sizes=lk, op="sp_key_bias")
        if q.shape[1] == 0:
            return q.new_empty(q.shape[:3] + (v.shape[-1],))
        if bias is not None:  # an additive bias: SDPA, as diffusers' native backend runs it on one rank
            out = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=bias.to(q.dtype))
            return out.transpose(1, 2)
        return self.ctx.cross_attn_fn(q, k, v, key_mask)


# ----------------------------------------------------------------------------------------------- hooks
class _Installed:
    """The hooks and processor markers of one model; ``remove()`` restores it."""

    info = None  # (no SequenceShardInfo for the step-cache helpers: cache is refused with a _cp_plan)

    def __init__(self, model, plan: dict, mesh):
        self.model = model
        self.plan = plan
        self.mesh = mesh
        self.comm = mesh.sequence
        self._handles: list = []
        self._procs: list = []
        self.attention: SequenceParallelAttention | None = None

    # splitting / gathering
    def _split(self, x, spec):
        if not isinstance(x, torch.Tensor) or (spec.expected_dims is not None and x.dim() != spec.expected_dims):
            return x
        return x.tensor_split(self.comm.size, dim=spec.split_dim)[self.comm.rank]

    def _pre_hook(self, module, entry: dict):
        params = _params(module)
        names = [(key, spec) for key, spec in entry.items()
                 if isinstance(key, str) and not (not isinstance(spec, (list, tuple)) and spec.split_output)]

        def hook(mod, args, kwargs):
            args = list(args)
            for key, spec in names:
                if key in kwargs:
                    val, where = kwargs[key], None
                else:
                    i = params.index(key)
                    if i >= len(args):
                        continue
                    val, where = args[i], i
                if val is None:
                    continue
                if isinstance(spec, (list, tuple)):
                    if not isinstance(val, (list, tuple)) or len(val) != len(spec):
                        raise PlanError(f"_cp_plan entry {key!r} of {type(mod).__name__} expects {len(spec)} tensors")
                    val = type(val)(x if s.split_output else self._split(x, s) for x, s in zip(val, spec))
                else:
                    val = self._split(val, spec)
                if where is None:
                    kwargs[key] = val
                else:
                    args[where] = val
            return tuple(args), kwargs

        return hook

    def _output_hook(self, entry: dict):
        outs = {key: spec for key, spec in entry.items() if isinstance(key, int)}

        def hook(mod, args, out):
            single = isinstance(out, torch.Tensor)
            items = [out] if single else list(out)
            for i, spec in outs.items():
                if i < len(items):
                    items[i] = self._split(items[i], spec)
            return items[0] if single else type(out)(items)

        return hook

    def _gather_hook(self, entry):
        specs = list(entry) if isinstance(entry, (list, tuple)) else [entry]

        def hook(mod, args, out):
            single = isinstance(out, torch.Tensor)
            items = [out] if single else list(out)
            for i, spec in enumerate(specs):
                if spec is not None and i < len(items) and isinstance(items[i], torch.Tensor):
                    items[i] = self.comm.all_gather_uneven(items[i].contiguous(), spec.gather_dim, op="sp_gather")
            return items[0] if single else type(out)(items)

        return hook

    def apply(self) -> "_Installed":
        state = getattr(self.model, STATE_ATTR, None)
        extras = getattr(state, "extras", None)
        ctx = extras.get("generic") if isinstance(extras, dict) else None
        if ctx is None:
            raise PlanError(f"{type(self.model).__name__} is not boosted on the generic path; boost it first")
        self.attention = SequenceParallelAttention(ctx, self.mesh)
        try:
            for path, entry in self.plan.items():
                for m in _modules(self.model, path):
                    if isinstance(entry, dict):
                        if any(isinstance(k, str) for k in entry):
                            self._handles.append(m.register_forward_pre_hook(self._pre_hook(m, entry),
                                                                             with_kwargs=True))
                        if any(isinstance(k, int) for k in entry):
                            self._handles.append(m.register_forward_hook(self._output_hook(entry)))
                    else:
                        self._handles.append(m.register_forward_hook(self._gather_hook(entry)))
            for proc, _ in extras.get("generic_backends", ()):  # the processors that go through the dispatcher
                self._procs.append((proc, proc.__dict__.get("_parallel_config", _ABSENT)))
                proc._parallel_config = self.attention.marker
            ctx.extras["sequence_parallel"] = self.attention
        except BaseException:
            self.remove()
            raise
        return self

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for proc, previous in self._procs:
            if previous is _ABSENT:
                proc.__dict__.pop("_parallel_config", None)
            else:
                proc._parallel_config = previous
        self._procs.clear()
        if self.attention is not None:
            self.attention.ctx.extras.pop("sequence_parallel", None)
            self.attention = None


_ABSENT = object()
