"""``ParallelManager(target, config)``: sequence (Ulysses) and CFG parallelism under torchrun.

    # torchrun --nproc_per_node 4 generate.py
    pipe = ParallelManager(pipe, {"parallel": {"cfg_degree": 2}})   # cfg 2 x sequence 2
    video = pipe(prompt=...).frames[0]                              # the call is unchanged

What it does, on the instances only (never on classes):

1. validates the config and the target (adapter and sharding plan present, degrees fit the world
   size) before any collective, then creates the cfg x sequence mesh (``initialize_usp``);
2. boosts the target with the single-process adapter (``lite_boost.boost``);
3. for each transformer, executes the adapter's declarative :class:`~lite_boost.parallel.plan.ShardingPlan`
   with generic hooks: tokens split after patch embedding, each rank's RoPE rows, Ulysses around every
   self-attention ``attn_fn`` (one packed all_to_all each way), gather after the output projection;
4. for a pipeline with cfg degree 2, the conditional pass runs on cfg rank 0 and the unconditional
   pass on cfg rank 1 at the same time; the two results are exchanged with one all_gather at the end
   of the second call. The pipeline still makes both calls; the rank that does not own a pass returns
   a placeholder the exchange fills in place (the pipeline only combines the two after the second call);
5. the latents prepared by the pipeline are broadcast from rank 0, so every rank starts from the same
   noise even without a generator.

With a world size of 1 this is exactly ``lite_boost.boost(target, config)``.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from ..config import BoostConfig, ConfigError
from .groups import ParallelMesh, init_mesh
from .plan import PipelinePlan, PlanError, SequenceParallelHooks, ShardingPlan

__all__ = ["ParallelManager", "initialize_usp", "unparallelize", "PlanError", "parallel_state"]

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


# ------------------------------------------------------------------------------------------ plans
def _lookup(target):
    from ..models import lookup

    return lookup(target)


def _sharding_plan(model) -> ShardingPlan:
    from ..models import SUPPORTED_MODELS, UnsupportedModelError

    try:
        fn = _lookup(model)
    except UnsupportedModelError as exc:
        raise PlanError(str(exc)) from None
    plan = getattr(fn, "sharding_plan", None)
    if not isinstance(plan, ShardingPlan):
        with_plans = sorted(n for n, f in SUPPORTED_MODELS.items() if isinstance(getattr(f, "sharding_plan", None), ShardingPlan))
        raise PlanError(
            f"{type(model).__name__} has no sequence-parallel sharding plan; models with a plan: {with_plans}. "
            "Declare one as `<boost fn>.sharding_plan = ShardingPlan(...)` in its adapter."
        )
    return plan


def _resolve_target(target):
    """Return (pipeline plan or None, [(attr name, transformer)]) after checking every plan."""
    fn = _lookup(target)  # UnsupportedModelError (a TypeError) for unknown classes
    pplan = getattr(fn, "pipeline_plan", None)
    if isinstance(pplan, PipelinePlan):
        models = [(n, getattr(target, n, None)) for n in pplan.transformers]
        models = [(n, m) for n, m in models if m is not None]
        if not models:
            raise PlanError(f"{type(target).__name__} has none of {list(pplan.transformers)} set")
    else:
        models = [("", target)]
    for _, m in models:
        _sharding_plan(m)
    return (pplan if isinstance(pplan, PipelinePlan) else None), models


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


class _CfgForward:
    """Instance ``forward`` of a transformer that splits the cond / uncond passes over the cfg group."""

    def __init__(self, model, pipe, plan, mesh: ParallelMesh):
        self.model = model
        self.pipe = pipe
        self.plan = plan
        self.mesh = mesh
        self.inner = model.forward  # bound method (or an earlier instance wrapper)
        self.context: str | None = None
        self.pending: torch.Tensor | None = None  # cond result (rank 0) or placeholder (rank 1)
        self.calls = {"computed": 0, "deferred": 0}

    def _active(self) -> bool:
        return self.context in (self.plan.cond, self.plan.uncond) and bool(getattr(self.pipe, self.plan.flag, False))

    def __call__(self, *args, **kwargs):
        if not self._active():
            self.calls["computed"] += 1
            return self.inner(*args, **kwargs)
        mine = self.mesh.cfg.rank  # 0 owns cond, 1 owns uncond
        if self.context == self.plan.cond:
            if mine == 0:
                self.calls["computed"] += 1
                out = self.inner(*args, **kwargs)
                self.pending = _first_tensor(out)
                return out
            self.calls["deferred"] += 1
            hs = kwargs.get("hidden_states", args[0] if args else None)
            dtype = hs.dtype if isinstance(hs, torch.Tensor) else torch.float32
            device = hs.device if isinstance(hs, torch.Tensor) else self.mesh.device
            self.pending = torch.empty(0, dtype=dtype, device=device)
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
        both = local.new_empty((2,) + tuple(local.shape))
        self.mesh.cfg.all_gather_into(both, local.unsqueeze(0).contiguous(), op="cfg_exchange")
        cond, uncond = both[0], both[1]
        if mine == 1:
            placeholder = self.pending
            placeholder.resize_(cond.shape)
            placeholder.copy_(cond)
        self.pending = None
        return _wrap_like(kwargs, uncond)


def _patch_cache_context(model, cfg_forward: _CfgForward):
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

    def remove(self, model):
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


# ------------------------------------------------------------------------------------------ VAE
def _check_vae(target, config: BoostConfig, mesh: ParallelMesh | None):
    """The parallel-VAE adapter of ``target.vae`` when the VAE will run parallel, else None.

    Raises (UnsupportedVAEError, ConfigError) before any collective. The world size comes from the
    given mesh, an existing default process group or the torchrun environment.
    """
    vae = getattr(target, "vae", None)
    mode = config.parallel.vae_parallel
    if vae is None or mode == "off":
        return None
    if mesh is not None:
        if not isinstance(mesh, ParallelMesh):
            return None  # ParallelManager rejects the mesh argument itself
        world = mesh.world_size
    elif torch.distributed.is_available() and torch.distributed.is_initialized():
        world = torch.distributed.get_world_size()
    else:
        from .groups import read_torchrun_env

        world = read_torchrun_env()[2]
    if world == 1:
        return None
    from .vae import vae_adapter_for

    return vae_adapter_for(vae)


def _install_vae(vae, adapter, config: BoostConfig, mesh: ParallelMesh) -> None:
    from .vae import parallelize_vae

    p = config.parallel
    runner = parallelize_vae(vae, mesh.world, mode=p.vae_parallel, overlap=p.vae_overlap,
                             chunk_size=p.vae_chunk_size, gather=p.vae_gather, timeout_s=p.timeout_s, adapter=adapter)
    logger.info("lite_boost parallel VAE: %s", runner)


def _rank_device(target, mesh, device, move_to_device):
    """The device this rank's model will run on (for checks made before the mesh exists)."""
    if not move_to_device:
        return None  # where its weights are now
    if mesh is not None and isinstance(mesh, ParallelMesh):
        dev = mesh.device
    elif device is not None:
        dev = torch.device(device)
    else:
        from .groups import default_device, read_torchrun_env

        dev = default_device(read_torchrun_env()[1])
    return None if dev.type == "cpu" else dev


# ------------------------------------------------------------------------------------------ API
def ParallelManager(target, config: BoostConfig | Mapping | Any = None, *, mesh: ParallelMesh | None = None,
                    init_method: str | None = None, device=None, move_to_device: bool = True):
    """Make ``target`` (a Wan pipeline or transformer) run sequence / CFG parallel; returns ``target``.

    Args:
        target: a supported diffusers pipeline (``WanPipeline``, ``WanImageToVideoPipeline``, incl.
            Wan2.2 two-transformer variants) or transformer (``WanTransformer3DModel``).
        config: BoostConfig / ParallelConfig / mapping / None. ``parallel.cfg_degree`` (1 or 2) and
            ``parallel.sequence_degree`` (default world_size // cfg_degree) shape the mesh;
            ``parallel.timeout_s`` bounds every collective; ``parallel.vae_parallel`` ("exact" by default
            on more than one rank, "chunked" or "off") spreads ``target.vae``'s decode / encode over all
            ranks (:mod:`lite_boost.parallel.vae`).
        mesh: an existing mesh from ``initialize_usp`` (default: create one from the torchrun env).
        init_method: rendezvous URL when this call initialises torch.distributed (default env://).
        device: override the rank's device (default from LOCAL_RANK).
        move_to_device: move the target to the rank's device when that is not the CPU.

    Every rank must call this with the same arguments. Invalid degrees, an unsupported class or a
    model without a sharding plan raise before any collective. World size 1 = ``lite_boost.boost``.
    The patch lives on the instances; ``unparallelize(target)`` removes it.
    """
    from ..api import boost

    config = BoostConfig.coerce(config)
    pplan, models = _resolve_target(target)  # raises before any collective
    vae_adapter = _check_vae(target, config, mesh)  # unsupported VAE / bad VAE settings: before any collective
    if config.cache is not None:
        from ..cache import check_cache_support

        check_cache_support(target, config.cache, cfg_degree=mesh.cfg_degree if mesh is not None
                            else config.parallel.cfg_degree)  # method / model fit, before any collective
    if config.quant is not None:  # layers, device, dtype: before any collective (every rank quantizes alike)
        from ..quant import check_quant_support

        check_quant_support(target, config.quant, device=_rank_device(target, mesh, device, move_to_device))
    if mesh is None:
        if config.parallel.cfg_degree > 1 and (pplan is None or pplan.cfg is None):
            raise ConfigError(
                f"cfg_degree={config.parallel.cfg_degree} needs a pipeline that runs classifier-free guidance; "
                f"{type(target).__name__} is not one. Valid cfg_degree here: [1]"
            )
        mesh = init_mesh(config.parallel, init_method=init_method, device=device)
    elif not isinstance(mesh, ParallelMesh):
        raise TypeError(f"mesh must be a ParallelMesh from initialize_usp, got {type(mesh).__name__}")
    elif mesh.cfg_degree > 1 and (pplan is None or pplan.cfg is None):
        raise ConfigError(f"a mesh with cfg_degree={mesh.cfg_degree} needs a pipeline with CFG; "
                          f"{type(target).__name__} is not one")

    unparallelize(target)
    moved = False
    if config.quant is not None and move_to_device and mesh.device.type != "cpu" and hasattr(target, "to"):
        target.to(mesh.device)  # quantize where the model will run (FP8 / W8A8 kernels check the device)
        moved = True
    boost(target, config)
    if move_to_device and not moved and mesh.device.type != "cpu" and hasattr(target, "to"):
        target.to(mesh.device)

    if mesh.world_size == 1:
        return target

    for _, model in models:
        state = _ModelParallel(mesh=mesh)
        if mesh.sequence_degree > 1:
            plan = _sharding_plan(model)
            state.hooks = SequenceParallelHooks(model, plan, mesh.sequence).apply()
            runtime = model._lite_boost.extras.get("cache")
            if runtime is not None:  # data-dependent cache decisions: one statistic per sequence group
                from .cache import make_cache_rank_consistent

                seq_dim = next((s.dim for s in plan.split_inputs if s.defines_length and s.ndim is None), 1)
                try:
                    state.cache = make_cache_rank_consistent(model, mesh.sequence, state.hooks.info,
                                                             seq_dim=seq_dim, runtime=runtime)
                except Exception:
                    state.hooks.remove()
                    raise
        if mesh.cfg_degree > 1:
            cfg = _CfgForward(model, target, pplan.cfg, mesh)
            for name in ("forward", "cache_context"):
                if name in model.__dict__:  # e.g. a diffusers cache hook's forward: put it back on removal
                    state.priors[name] = model.__dict__[name]
            model.forward = cfg
            _patch_cache_context(model, cfg)
            state.cfg = cfg
            state.patched += ["forward", "cache_context"]
        model._lite_boost.extras[_MODEL_KEY] = state

    if vae_adapter is not None:
        _install_vae(target.vae, vae_adapter, config, mesh)
    if pplan is not None:
        pstate = _PipelineParallel(mesh=mesh, config=config, models=[m for _, m in models])
        if pplan.prepare_latents and hasattr(target, pplan.prepare_latents):
            _broadcast_latents(target, pplan.prepare_latents, mesh)
            pstate.patched.append(pplan.prepare_latents)
        object.__setattr__(target, _PIPE_ATTR, pstate)
    logger.info("lite_boost parallel: %s", mesh.describe())
    return target


def unparallelize(target):
    """Remove what ParallelManager added (hooks, wrappers); the target stays boosted. Returns it."""
    vae = getattr(target, "vae", None)
    if vae is not None:
        from .vae import unparallelize_vae

        unparallelize_vae(vae)
    pstate = target.__dict__.get(_PIPE_ATTR) if hasattr(target, "__dict__") else None
    if pstate is not None:
        for name in pstate.patched:
            if name in target.__dict__:
                object.__delattr__(target, name)
        object.__delattr__(target, _PIPE_ATTR)
    try:
        _, models = _resolve_target(target)
    except (PlanError, TypeError):
        return target
    for _, model in models:
        state = parallel_state(model)
        if state is not None:
            state.remove(model)
            del model._lite_boost.extras[_MODEL_KEY]
    return target
