"""Sequence (Ulysses) and CFG parallelism applied to boosted models: the generic half of ``ParallelManager``.

``lite_boost.ParallelManager`` (``lite_boost.api``; re-exported as ``lite_boost.parallel.ParallelManager``)
looks the target's family up, validates everything before any collective, boosts the target, then
calls :func:`parallelize` here with the family's plans. Nothing here knows any model:

1. ``initialize_usp`` creates the cfg x sequence mesh;
2. for each transformer, :func:`parallelize` executes the declarative
   :class:`~lite_boost.parallel.plan.ShardingPlan` with generic hooks: tokens split after patch
   embedding, each rank's RoPE rows, Ulysses around every self / joint attention ``attn_fn`` (one
   packed all_to_all each way), gather after the output projection;
3. with cfg degree 2 and a pipeline that calls the transformer once per branch ("separate" CFG),
   the conditional pass runs on cfg rank 0 and the unconditional pass on cfg rank 1 at the same
   time; the two results are exchanged with one all_gather at the end of the second call. The
   pipeline still makes both calls; the rank that does not own a pass returns a placeholder the
   exchange fills in place (the pipeline only combines the two after the second call). The passes
   are named by ``cache_context`` ("separate"), by the pipeline's guider ("guider") or by their order
   (``CfgPlan.by_call_order``: cond, then uncond). A pipeline that batches the two branches ("batched" CFG) has each
   cfg rank run its half of the batch, and the output is gathered on the batch;
4. the latents prepared by the pipeline are broadcast from rank 0, so every rank starts from the same
   noise even without a generator;
5. the pipeline's VAE decode / encode is spread over the ranks where a parallel-VAE adapter exists;
6. with ``tp_degree`` > 1 each transformer's planned Linear layers are split over the tp group, with
   ``fsdp_degree`` > 1 its blocks (and the text encoders) are sharded with FSDP2 over the fsdp group
   (:mod:`lite_boost.parallel.shard`), with ``config.offload`` under FSDP2's ``CPUOffloadPolicy``.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from ..config import BoostConfig, ConfigError
from .groups import ParallelMesh, init_mesh
from .plan import PipelinePlan, PlanError, SequenceParallelHooks

__all__ = ["initialize_usp", "parallelize", "unparallelize", "PlanError", "parallel_state", "check_vae", "check_cfg"]

logger = logging.getLogger("lite_boost.parallel")

_PIPE_ATTR = "_lite_boost_parallel"
_MODEL_KEY = "parallel"


def initialize_usp(config=None, *, init_method: str | None = None, device=None) -> ParallelMesh:
    """Initialise torch.distributed from the torchrun environment and build the cfg x sequence mesh.

    ``config``: a ParallelConfig, a BoostConfig (its ``parallel`` part is used), a mapping or None.
    Reuses an existing default process group. Returns the :class:`ParallelMesh` (pass it to
    ``ParallelManager(..., mesh=mesh)`` to share it between several targets).
    """
    boost_cfg = BoostConfig.coerce(config)
    return init_mesh(boost_cfg.parallel, init_method=init_method, device=device)


# ------------------------------------------------------------------------------------------ CFG
def _first_tensor(out) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    sample = getattr(out, "sample", None)
    if isinstance(sample, torch.Tensor):
        return sample
    raise PlanError(f"CFG parallelism needs a tensor model output, got {type(out).__name__}")


def _wrap_like(kwargs, tensor):
    if kwargs.get("return_dict", True):
        from diffusers.models.modeling_outputs import Transformer2DModelOutput

        return Transformer2DModelOutput(sample=tensor)
    return (tensor,)


def _expose_signature(wrapper, inner) -> None:
    """Give an instance ``forward`` wrapper the wrapped forward's signature, name and docstring: pipelines
    inspect ``transformer.forward`` to decide which inputs to pass (diffusers' modular denoise steps keep only
    the fields the signature names), so a bare ``(*args, **kwargs)`` would silently drop arguments."""
    try:
        wrapper.__signature__ = inspect.signature(inner)
    except (TypeError, ValueError):  # no signature to expose (a builtin): inspect falls back to __call__
        wrapper.__signature__ = None
    for attr in ("__name__", "__qualname__", "__doc__"):
        value = getattr(inner, attr, None)
        if value is not None:
            setattr(wrapper, attr, value)


class _CfgActive:
    """Whether the pipeline runs CFG in its current call: ``CfgPlan.flag``, the encode counter, or the guider.

    Without a flag attribute (the pipeline keeps the decision in a local variable), the pipeline's
    ``call_start`` method (called once at the start of every pipeline call) resets a counter and its
    ``encodes`` method (once per prompt) counts: two encodes = prompt and negative prompt = CFG.
    ``on_start`` callbacks also run at ``call_start`` (the pass order of ``CfgPlan.by_call_order``).
    The "guider" kind asks the pipeline's guider at every call (it may switch CFG off for some steps).
    """

    def __init__(self, pipe, plan):
        self.pipe = pipe
        self.plan = plan
        self.encodes = 0
        self.on_start: list = []

    def __call__(self) -> bool:
        if self.plan.kind == "guider":
            return self.guider_conditions() == 2
        if self.plan.flag is not None:
            return bool(getattr(self.pipe, self.plan.flag, False))
        return self.encodes >= 2

    def guider_conditions(self) -> int:
        """The number of conditions (transformer calls) the pipeline's guider runs this step."""
        guider = getattr(self.pipe, self.plan.guider, None)
        if guider is None:
            return 1
        n = int(guider.num_conditions)
        if n > 2:  # the same on every rank, before any collective of this call
            raise PlanError(f"CFG parallelism splits two conditions ({self.plan.cond!r}, {self.plan.uncond!r}); the "
                            f"pipeline's {type(guider).__name__} runs {n} this step")
        return n

    def install(self, patched: list, priors: dict) -> None:
        """Wrap the pipeline's ``call_start`` / ``encodes`` methods on the instance (names into ``patched``, an
        instance attribute replaced into ``priors``: e.g. the boost's own ``call_start`` wrapper, put back later)."""
        if self.plan.kind == "guider":
            return
        wrap = [] if self.plan.flag is not None else [(self.plan.encodes, self._count)]
        if self.plan.flag is None or self.plan.by_call_order:
            wrap.insert(0, (self.plan.call_start, self._reset))
        for name, action in wrap:
            if name in self.pipe.__dict__:
                priors.setdefault(name, self.pipe.__dict__[name])
            inner = getattr(self.pipe, name)

            def wrapper(*args, _inner=inner, _action=action, **kwargs):
                _action()
                return _inner(*args, **kwargs)

            object.__setattr__(self.pipe, name, wrapper)
            patched.append(name)

    def _reset(self):
        self.encodes = 0
        for fn in self.on_start:
            fn()

    def _count(self):
        self.encodes += 1


class _CfgForward:
    """Instance ``forward`` of a transformer that splits the cond / uncond passes over the cfg group."""

    def __init__(self, model, active: _CfgActive, plan, mesh: ParallelMesh):
        self.model = model
        self.active = active
        self.plan = plan
        self.mesh = mesh
        self.inner = model.forward  # bound method (or an earlier instance wrapper)
        self.context: str | None = None
        self.pending: torch.Tensor | None = None  # cond result (rank 0) or placeholder (rank 1)
        self.calls = {"computed": 0, "deferred": 0}
        self.order = 0  # CfgPlan.by_call_order: CFG calls seen since the pipeline call started
        _expose_signature(self, self.inner)

    def reset_order(self) -> None:
        self.order = 0
        self.pending = None

    def _pass(self) -> str | None:
        """The CFG pass this call computes (``plan.cond`` / ``plan.uncond``), or None (no CFG split)."""
        if not self.active():
            return None
        if self.plan.by_call_order:
            self.order += 1
            return self.plan.cond if self.order % 2 else self.plan.uncond
        return self.context if self.context in (self.plan.cond, self.plan.uncond) else None

    def _placeholder(self, args, kwargs) -> torch.Tensor:
        hs = kwargs.get("hidden_states", args[0] if args else None)
        dtype = hs.dtype if isinstance(hs, torch.Tensor) else torch.float32
        device = hs.device if isinstance(hs, torch.Tensor) else self.mesh.device
        shape = self.plan.output_shape(self.model, args, kwargs) if self.plan.output_shape is not None else (0,)
        return torch.empty(shape, dtype=dtype, device=device)

    def __call__(self, *args, **kwargs):
        which = self._pass()
        if which is None:
            self.calls["computed"] += 1
            return self.inner(*args, **kwargs)
        mine = self.mesh.cfg.rank  # 0 owns cond, 1 owns uncond
        if which == self.plan.cond:
            if mine == 0:
                self.calls["computed"] += 1
                out = self.inner(*args, **kwargs)
                self.pending = _first_tensor(out)
                return out
            self.calls["deferred"] += 1
            # filled in place at the exchange; with the output's shape known (CfgPlan.output_shape)
            # the pipeline may take views of it (e.g. slice the target tokens) before that
            self.pending = self._placeholder(args, kwargs)
            return _wrap_like(kwargs, self.pending)
        # uncond pass: exchange
        if self.pending is None:
            raise RuntimeError("CFG parallel: unconditional pass without a preceding conditional pass")
        if mine == 1:
            self.calls["computed"] += 1
            local = _first_tensor(self.inner(*args, **kwargs))
        else:
            self.calls["deferred"] += 1
            local = self.pending
        cond_shape = tuple(self.pending.shape)  # rank 1: the placeholder's (CfgPlan.output_shape)
        uncond_shape = (tuple(local.shape) if mine == 1 or self.plan.output_shape is None
                        else tuple(self.plan.output_shape(self.model, args, kwargs)))
        if cond_shape != uncond_shape and self.plan.output_shape is not None:
            # outputs of different lengths (Qwen-Image 2.1 returns its text rows too): one uneven gather
            sizes = [math.prod(cond_shape), math.prod(uncond_shape)]
            flat = self.mesh.cfg.all_gather_uneven(local.reshape(-1).contiguous(), 0, sizes=sizes, op="cfg_exchange")
            cond, uncond = flat[:sizes[0]].view(cond_shape), flat[sizes[0]:].view(uncond_shape)
        else:
            both = local.new_empty((2,) + tuple(local.shape))
            self.mesh.cfg.all_gather_into(both, local.unsqueeze(0).contiguous(), op="cfg_exchange")
            cond, uncond = both[0], both[1]
        if mine == 1:
            placeholder = self.pending
            if placeholder.shape != cond.shape:
                placeholder.resize_(cond.shape)
            placeholder.copy_(cond)
        self.pending = None
        return _wrap_like(kwargs, uncond)


class _BatchedCfgForward:
    """Instance ``forward`` for pipelines that batch cond and uncond: each cfg rank runs its half.

    Inside ``cache_context(plan.cond)`` with CFG on, every argument of ``plan.batch_args`` is split
    on dim 0 into the cfg degree's equal parts (cfg rank r takes part r: rank 0 the first branch,
    rank 1 the second), and the output is all-gathered on dim 0 so every rank returns the whole batch.
    """

    def __init__(self, model, active: _CfgActive, plan, mesh: ParallelMesh):
        self.model = model
        self.active = active
        self.plan = plan
        self.mesh = mesh
        self.inner = model.forward
        self.context: str | None = None
        self.calls = {"computed": 0, "split": 0}
        _expose_signature(self, self.inner)
        try:
            params = list(inspect.signature(self.inner).parameters)
        except (TypeError, ValueError):
            params = []
        self.index = {name: params.index(name) for name in plan.batch_args if name in params}

    def _half(self, x, name):
        if not isinstance(x, torch.Tensor) or x.ndim == 0:
            return x
        n = self.mesh.cfg_degree
        if x.shape[0] % n:
            raise RuntimeError(f"batched CFG: argument {name!r} has batch {x.shape[0]}, not a multiple of the cfg "
                               f"degree {n}")
        part = x.shape[0] // n
        return x.narrow(0, self.mesh.cfg.rank * part, part)

    def _arg(self, args, kwargs, name):
        if name in kwargs:
            return kwargs[name]
        i = self.index.get(name, len(args))
        return args[i] if i < len(args) else None

    def __call__(self, *args, **kwargs):
        lead = self._arg(args, kwargs, self.plan.batch_args[0]) if self.plan.batch_args else None
        # a batch the cfg ranks cannot share (CFG off in this call: batch 1): the whole call on every rank
        # (the same decision everywhere: every rank holds the same arguments)
        odd = isinstance(lead, torch.Tensor) and lead.ndim > 0 and lead.shape[0] % self.mesh.cfg_degree != 0
        if self.context != self.plan.cond or odd or not self.active():
            self.calls["computed"] += 1
            return self.inner(*args, **kwargs)
        self.calls["split"] += 1
        args = list(args)
        for name in self.plan.batch_args:
            if name in kwargs:
                kwargs[name] = self._half(kwargs[name], name)
            elif self.index.get(name, len(args)) < len(args):
                args[self.index[name]] = self._half(args[self.index[name]], name)
        out = self.inner(*args, **kwargs)
        several = _tensor_fields(out)
        if several is not None:  # e.g. LTX-2's (video, audio): every tensor gathered, the output type kept
            return several(self._gather)
        return _wrap_like(kwargs, self._gather(_first_tensor(out)))

    def _gather(self, local: torch.Tensor) -> torch.Tensor:
        local = local.contiguous()
        both = local.new_empty((self.mesh.cfg_degree,) + tuple(local.shape))
        self.mesh.cfg.all_gather_into(both, local.unsqueeze(0), op="cfg_exchange")
        return both.flatten(0, 1)


def _tensor_fields(out):
    """For an output of several tensors (a tuple, or a diffusers output with several tensor fields):
    ``rebuild(fn)`` giving the same output type with ``fn`` applied to every tensor; else None."""
    if isinstance(out, (tuple, list)) and len(out) > 1 and all(isinstance(t, torch.Tensor) for t in out):
        return lambda fn: type(out)(fn(t) for t in out)
    if hasattr(out, "to_tuple") and hasattr(out, "keys"):
        fields = dict(out.items())
        if sum(isinstance(v, torch.Tensor) for v in fields.values()) > 1:
            return lambda fn: type(out)(**{k: fn(v) if isinstance(v, torch.Tensor) else v for k, v in fields.items()})
    return None


def _patch_cache_context(model, cfg_forward):
    inner = model.cache_context

    @contextlib.contextmanager
    def cache_context(name, *args, **kwargs):
        prev = cfg_forward.context
        cfg_forward.context = name
        try:
            with inner(name, *args, **kwargs):
                yield
        finally:
            cfg_forward.context = prev

    model.cache_context = cache_context


# ------------------------------------------------------------------------------------------ state
@dataclass
class _ModelParallel:
    mesh: ParallelMesh
    hooks: SequenceParallelHooks | None = None
    cfg: _CfgForward | None = None
    patched: list = field(default_factory=list)  # instance attributes we set (to delete on restore)
    priors: dict = field(default_factory=dict)  # instance attributes we replaced (e.g. a diffusers hook's forward)
    cache: Any = None  # RankConsistentCache (step-cache decisions made once per sequence group)
    weights: list = field(default_factory=list)  # FsdpShards / TensorParallelShards (collective to undo)

    def remove(self, model):
        for shards in reversed(self.weights):
            shards.remove()
        self.weights.clear()
        if self.cache is not None:
            self.cache.remove()
            self.cache = None
        if self.hooks is not None:
            self.hooks.remove()
        for name in self.patched:
            if name in self.priors:
                setattr(model, name, self.priors[name])
            elif name in model.__dict__:
                delattr(model, name)
        self.patched.clear()
        self.priors.clear()


@dataclass
class _PipelineParallel:
    mesh: ParallelMesh
    config: BoostConfig
    models: list
    patched: list = field(default_factory=list)
    priors: dict = field(default_factory=dict)  # instance attributes we replaced (put back on removal)
    weights: list = field(default_factory=list)  # FsdpShards of the text encoders


def parallel_state(model):
    """The parallel state ParallelManager attached to a model (or None)."""
    state = getattr(model, "_lite_boost", None)
    extras = getattr(state, "extras", None)
    return extras.get(_MODEL_KEY) if isinstance(extras, dict) else None


def _broadcast_latents(pipe, name: str, mesh: ParallelMesh):
    inner = getattr(pipe, name)

    def prepare(*args, **kwargs):
        out = inner(*args, **kwargs)
        tensors = [out] if isinstance(out, torch.Tensor) else [t for t in (out if isinstance(out, (tuple, list)) else ()) if isinstance(t, torch.Tensor)]
        for t in tensors:
            buf = t if t.is_contiguous() else t.contiguous()
            mesh.world.broadcast(buf, 0, op="latents")
            if buf is not t:
                t.copy_(buf)
        return out

    object.__setattr__(pipe, name, prepare)


def check_cfg(target, pipeline_plan: PipelinePlan | None, cfg_degree: int) -> None:
    """ConfigError, before any collective, when CFG parallelism cannot split ``target``'s guidance.

    The "guider" kind needs the pipeline's guider to produce exactly the plan's two predictions
    (cond, uncond): guiders with a third (perturbed-attention, skip-layer guidance) are refused.
    """
    cfg_plan = pipeline_plan.cfg_for(target) if pipeline_plan is not None else None
    if cfg_degree < 2 or cfg_plan is None or cfg_plan.kind != "guider":
        return
    guider = getattr(target, cfg_plan.guider, None)
    predictions = list(getattr(guider, "_input_predictions", None) or [])
    if guider is None or predictions != [cfg_plan.cond, cfg_plan.uncond]:
        what = "no guider" if guider is None else f"a {type(guider).__name__} predicting {predictions}"
        raise ConfigError(f"cfg_degree={cfg_degree} splits the guider's two predictions {[cfg_plan.cond, cfg_plan.uncond]} "
                          f"over two ranks; {type(target).__name__}.{cfg_plan.guider} is {what}. Valid cfg_degree "
                          "here: [1] (or use a two-prediction guider such as ClassifierFreeGuidance)")


# ------------------------------------------------------------------------------------------ VAE
def world_size_of(mesh: ParallelMesh | None) -> int:
    """The world size of ``mesh``, an existing default process group or the torchrun environment."""
    if isinstance(mesh, ParallelMesh):
        return mesh.world_size
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    from .groups import read_torchrun_env

    return read_torchrun_env()[2]


def check_vae(target, config: BoostConfig, mesh: ParallelMesh | None, *, unsupported: str | None = None,
              world_size: int | None = None):
    """The parallel-VAE adapter of ``target.vae`` when the VAE will run parallel, else None.

    ``unsupported``: why the target's family has no parallel VAE; then ``vae_parallel=None`` (auto)
    leaves the VAE on every rank (logged) and an explicit mode raises. ``world_size``: when the caller (the
    planner) knows it. Raises (UnsupportedVAEError, ConfigError) before any collective.
    """
    vae = getattr(target, "vae", None)
    mode = config.parallel.vae_parallel
    if vae is None or mode == "off" or (mesh is not None and not isinstance(mesh, ParallelMesh)):
        return None  # (ParallelManager rejects a bad mesh argument itself)
    if (world_size if world_size is not None else world_size_of(mesh)) == 1:
        return None
    if unsupported is not None and mode is None:
        logger.info("lite_boost parallel VAE: off for %s (%s); every rank runs the VAE", type(vae).__name__,
                    unsupported)
        return None
    from .vae import check_vae_mode, vae_adapter_for

    adapter = vae_adapter_for(vae)
    check_vae_mode(adapter, mode)
    return adapter


def _install_vae(vae, adapter, config: BoostConfig, mesh: ParallelMesh) -> None:
    from .vae import parallelize_vae

    p = config.parallel
    runner = parallelize_vae(vae, mesh.world, mode=p.vae_parallel, overlap=p.vae_overlap,
                             chunk_size=p.vae_chunk_size, gather=p.vae_gather, timeout_s=p.timeout_s, adapter=adapter)
    logger.info("lite_boost parallel VAE: %s", runner)


# ------------------------------------------------------------------------------------------ apply
def _sequence_attention(mesh: ParallelMesh):
    """The sequence-parallel wrapper factory ``(attn_fn, shard_info) -> wrapper`` of ``mesh``: Ulysses alone
    (ring_degree 1), Ring alone (ulysses_degree 1) or USP (Ulysses over the contiguous ranks around Ring
    over the strided ones); see :mod:`lite_boost.parallel.ring`."""
    from .ring import sequence_parallel_attention

    def wrap(attn_fn, shard_info):
        return sequence_parallel_attention(attn_fn, mesh.ulysses, mesh.ring, shard_info,
                                           rotate_method=mesh.rotate_method)

    return wrap


def text_encoders(target) -> list:
    """(attribute, module) of the pipeline's text encoders (``text_encoder``, ``text_encoder_2``, ...)."""
    out = []
    for name in ("text_encoder", "text_encoder_2", "text_encoder_3"):
        module = getattr(target, name, None)
        if isinstance(module, torch.nn.Module):
            out.append((name, module))
    return out


def fsdp_offload_options(config: BoostConfig, *, text_encoder: bool = False, reoffload=None) -> dict:
    """``shard_weights`` options for ``config.offload`` under FSDP: FSDP2's ``CPUOffloadPolicy`` (the shards in
    host memory, pinned on an accelerator unless ``low_cpu_mem_usage``), the next block's gather prefetched
    unless ``use_stream=False``, ``reoffload(module)`` called when the sharding is removed. Empty without
    offload (or for a text encoder with ``offload.text_encoder`` False: sharded on the device)."""
    off = config.offload
    if off is None or (text_encoder and not off.text_encoder):
        return {}
    device = torch.device(off.onload_device) if off.onload_device is not None else torch.device("cpu")
    return {"cpu_offload": True, "pin_memory": device.type != "cpu" and not off.low_cpu_mem_usage,
            "prefetch": off.use_stream is not False, "after_remove": reoffload}


def fsdp_offloaded_encoders(target, config: BoostConfig, fsdp_degree: int | None = None) -> list[str]:
    """The attributes of ``target``'s text encoders that FSDP will shard with ``CPUOffloadPolicy`` (FSDP over
    ``fsdp_degree`` ranks, default ``config.parallel.fsdp_degree``; ``fsdp_text_encoder``; ``offload.text_encoder``):
    lite_boost's block offload hooks must leave them alone."""
    from .shard import block_class_names

    fsdp = config.parallel.fsdp_degree if fsdp_degree is None else fsdp_degree
    if fsdp <= 1 or config.offload is None or not config.offload.text_encoder or not config.parallel.fsdp_text_encoder:
        return []
    return [name for name, encoder in text_encoders(target) if block_class_names(encoder)]


def _shard_model(model, state, tp_plan, mesh: ParallelMesh, config: BoostConfig, reoffload=None) -> None:
    from .shard import apply_tensor_parallel, shard_weights

    if mesh.tp_degree > 1:
        state.weights.append(apply_tensor_parallel(model, tp_plan, mesh.device_mesh("tp"), mesh.tp))
    if mesh.fsdp_degree > 1:
        state.weights.append(shard_weights(model, mesh.device_mesh("fsdp"), mesh.fsdp,
                                           **fsdp_offload_options(config, reoffload=reoffload)))


def parallelize(target, models, plans, pipeline_plan: PipelinePlan | None, config: BoostConfig,
                mesh: ParallelMesh, *, vae_adapter=None, tp_plans=None, reoffload=None):
    """Apply sequence / CFG parallelism to already boosted ``models`` of ``target``; returns ``target``.

    Args:
        target: the pipeline (or the transformer itself).
        models: the boosted transformers to parallelise.
        plans: their :class:`ShardingPlan` (one per model, None where sequence parallelism is off).
        pipeline_plan: the pipeline's :class:`PipelinePlan` (None for a bare transformer).
        config: the boost config (timeouts, VAE settings).
        mesh: the cfg x sequence mesh.
        vae_adapter: the parallel-VAE adapter of ``target.vae`` (from :func:`check_vae`), or None.
        tp_plans: the models' :class:`~lite_boost.parallel.shard.TensorParallelPlan` (one per model; used with
            ``tp_degree`` > 1).
        reoffload: with ``config.offload`` and ``fsdp_degree`` > 1 (FSDP2's ``CPUOffloadPolicy``), called with
            each module FSDP sharded that way once ``unparallelize`` gathered its full weights back (the caller
            puts its block offloading back on).

    The caller validated everything before (no check here may fail half-way between collectives).
    """
    if mesh.world_size == 1:
        return target
    cfg_plan = pipeline_plan.cfg_for(target) if pipeline_plan is not None else None
    active = _CfgActive(target, cfg_plan) if cfg_plan is not None else None
    tp_plans = list(tp_plans) if tp_plans is not None else [None] * len(models)
    for model, plan, tp_plan in zip(models, plans, tp_plans):
        state = _ModelParallel(mesh=mesh)
        if mesh.sequence_degree > 1:
            if callable(getattr(plan, "install", None)):  # a plan that executes itself (a diffusers _cp_plan)
                state.hooks = plan.install(model, mesh)
            else:
                state.hooks = SequenceParallelHooks(model, plan, mesh.sequence, _sequence_attention(mesh)).apply()
            runtime = model._lite_boost.extras.get("cache")
            if runtime is not None and state.hooks.info is not None:  # data-dependent cache decisions: one statistic per sequence group
                from .cache import make_cache_rank_consistent

                seq_dim = next((s.dim for s in plan.split_inputs if s.defines_length and s.ndim is None), 1)
                try:
                    state.cache = make_cache_rank_consistent(model, mesh.sequence, state.hooks.info,
                                                             seq_dim=seq_dim, runtime=runtime)
                except Exception:
                    state.hooks.remove()
                    raise
        if mesh.cfg_degree > 1:
            cls = _BatchedCfgForward if cfg_plan.kind == "batched" else _CfgForward
            cfg = cls(model, active, cfg_plan, mesh)
            if cfg_plan.by_call_order:
                active.on_start.append(cfg.reset_order)
            for name in ("forward", "cache_context"):
                if name in model.__dict__:  # e.g. a diffusers cache hook's forward: put it back on removal
                    state.priors[name] = model.__dict__[name]
            model.forward = cfg
            _patch_cache_context(model, cfg)
            state.cfg = cfg
            state.patched += ["forward", "cache_context"]
        model._lite_boost.extras[_MODEL_KEY] = state
        _shard_model(model, state, tp_plan, mesh, config, reoffload)

    if vae_adapter is not None:
        _install_vae(target.vae, vae_adapter, config, mesh)
    if pipeline_plan is not None:
        pstate = _PipelineParallel(mesh=mesh, config=config, models=list(models))
        if mesh.fsdp_degree > 1 and config.parallel.fsdp_text_encoder:
            from .shard import block_class_names, shard_weights

            for _, encoder in text_encoders(target):
                if block_class_names(encoder):
                    pstate.weights.append(shard_weights(encoder, mesh.device_mesh("fsdp"), mesh.fsdp, root_params=True,
                                                        **fsdp_offload_options(config, text_encoder=True,
                                                                               reoffload=reoffload)))
        if pipeline_plan.prepare_latents and hasattr(target, pipeline_plan.prepare_latents):
            _broadcast_latents(target, pipeline_plan.prepare_latents, mesh)
            pstate.patched.append(pipeline_plan.prepare_latents)
        if active is not None and mesh.cfg_degree > 1:
            active.install(pstate.patched, pstate.priors)
        object.__setattr__(target, _PIPE_ATTR, pstate)
    logger.info("lite_boost parallel: %s", mesh.describe())
    return target


def unparallelize(target):
    """Remove what ParallelManager added (hooks, wrappers); the target stays boosted. Returns it."""
    vae = getattr(target, "vae", None)
    if vae is not None:
        from .vae import unparallelize_vae

        unparallelize_vae(vae)
    models = [target]
    pstate = target.__dict__.get(_PIPE_ATTR) if hasattr(target, "__dict__") else None
    if pstate is not None:
        for shards in reversed(pstate.weights):
            shards.remove()
        pstate.weights.clear()
        for name in pstate.patched:
            if name in pstate.priors:
                object.__setattr__(target, name, pstate.priors[name])
            elif name in target.__dict__:
                object.__delattr__(target, name)
        object.__delattr__(target, _PIPE_ATTR)
        models = pstate.models
    for model in models:
        state = parallel_state(model)
        if state is not None:
            state.remove(model)
            del model._lite_boost.extras[_MODEL_KEY]
    return target
