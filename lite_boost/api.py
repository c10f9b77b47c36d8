"""The public entry points: ``boost``, ``unboost`` and ``ParallelManager`` ("boost, then parallelise").

This module composes the layers below it: the registry finds the target's family, the adapter
layer boosts it, ``lite_boost.parallel`` distributes it. ``lite_boost.ParallelManager`` and
``lite_boost.parallel.ParallelManager`` are this function (the latter is the one import from
``lite_boost.parallel`` up to this module, declared in the import contracts).
"""

from __future__ import annotations

from typing import Any, Mapping

from .config import BoostConfig, ConfigError
from .registry import families, family_of, lookup, names_where

__all__ = ["boost", "unboost", "is_boosted", "ParallelManager", "auto_layout", "memory_plan"]


def boost(target, config=None):
    """Patch a supported diffusers pipeline or model in place for faster inference and return it.

    ``config`` may be a :class:`BoostConfig`, a :class:`SparseConfig` / :class:`ParallelConfig` /
    :class:`CacheConfig` / :class:`QuantConfig`, a mapping with the same keys, or None (defaults:
    automatic attention backend, dense attention, no step caching, full-precision weights).
    The config is validated and the target's class looked up before anything is modified (a feature
    the target's family lacks raises ``ConfigError`` naming the option). Boosting again with the same
    config is a no-op; with another config the previous boost is replaced.
    """
    config = BoostConfig.coerce(config)
    check_one_process(config)
    return _boost(target, config)


def check_one_process(config: BoostConfig) -> None:
    """ConfigError with the launch hint when ``config.parallel`` asks for more than one process: ``boost`` runs
    in the calling process only (``ParallelManager`` under torchrun is what spreads a pipeline over several)."""
    p = config.parallel
    need = p.processes_needed()
    if need <= 1:
        return
    asked = ", ".join(f"{n}={getattr(p, n)}" for n in ("cfg_degree", "tp_degree", "fsdp_degree", "sequence_degree",
                                                       "ulysses_degree", "ring_degree", "world_size")
                      if getattr(p, n) not in (None, 1))
    raise ConfigError(
        f"parallel {asked} needs {need} processes, but boost() runs in this one process. Launch {need} processes "
        f"(torchrun --nproc_per_node {need} your_script.py, or lite-boost generate --nproc {need}) and call "
        "lite_boost.ParallelManager(pipe, config) in each, or drop the parallel degrees for one process"
    )


def _boost(target, config: BoostConfig):
    """``boost`` without the one-process check (``ParallelManager`` boosts each rank's copy with this)."""
    fn = lookup(target)
    family = family_of(fn)
    if family is not None:
        family.check_config(config)
    if config.cache is not None:
        from .cache import check_cache_support

        check_cache_support(target, config.cache)  # method / model fit, before anything is modified
    if config.quant is not None:
        from .quant import check_quant_support

        check_quant_support(target, config.quant)  # layers, device, dtype: before anything is modified
    if config.offload is not None:
        from .offload import check_offload_support

        check_offload_support(target, config)  # onload device, streams, no other offloading in place
    return fn(target, config)


def unboost(target):
    """Restore the original diffusers processors, modules and (quantized) weights of a boosted target; returns it.

    A target ``ParallelManager`` distributed is unparallelized first (sharded weights are gathered back: then a
    collective, to call on every rank)."""
    fn = lookup(target)
    undo = getattr(fn, "unboost", None)
    if undo is None:
        raise TypeError(f"the adapter for {type(target).__name__} does not support unboost")
    from .parallel.manager import unparallelize

    unparallelize(target)
    return undo(target)


def is_boosted(target) -> bool:
    """True if ``target`` (a model or pipeline) carries a lite_boost patch."""
    if getattr(target, "_lite_boost", None) is not None:
        return True
    family = family_of(target)
    attrs = family.pipeline.transformers if family is not None else ("transformer", "transformer_2")
    return any(getattr(getattr(target, n, None), "_lite_boost", None) is not None for n in attrs)


# ------------------------------------------------------------------------------------------ parallel
def _layout(target, fn, family, sequence_degree: int):
    """(pipeline plan or None, transformers, their sharding plans); PlanError when a plan is missing."""
    from .parallel.plan import PlanError, ShardingPlan

    pplan = family.pipeline if (family is not None and family.is_pipeline(target)) else None
    models = family.transformers_of(target) if family is not None else [target]
    if pplan is not None and not models:
        raise PlanError(f"{type(target).__name__} has none of {list(pplan.transformers)} set")
    plans = []
    for model in models:
        plan = getattr(family_of(model), "sharding", None)
        if sequence_degree > 1 and not isinstance(plan, ShardingPlan):
            with_plans = names_where(lambda f: isinstance(f.sharding, ShardingPlan))
            raise PlanError(
                f"{type(model).__name__} has no sequence-parallel sharding plan; models with a plan: {with_plans}. "
                "Declare one as ModelFamily(sharding=ShardingPlan(...)) in its adapter."
            )
        plans.append(plan)
    return pplan, models, plans


def tensor_parallel_plan(model):
    """The tensor-parallel plan of ``model``: its family record's, else diffusers' ``_tp_plan`` (None: none)."""
    from .parallel.shard import TensorParallelPlan

    plan = getattr(family_of(model), "tensor_parallel", None)
    return plan if plan is not None else TensorParallelPlan.from_diffusers(getattr(model, "_tp_plan", None))


def check_weight_sharding(target, models, config: BoostConfig, world_size: int, *, cfg_degree: int = 1,
                          tp_degree: int = 1, fsdp_degree: int = 1) -> list:
    """Can ``models`` be split over ``tp_degree`` / ``fsdp_degree`` ranks of ``world_size``? ConfigError naming
    the valid degrees, before any collective. Returns the models' tensor-parallel plans (one per model)."""
    from .parallel.shard import check_fsdp, check_tensor_parallel

    tp_plans = [tensor_parallel_plan(m) for m in models] if tp_degree > 1 else [None] * len(models)
    if tp_degree > 1:
        if config.quant is not None:
            raise ConfigError(f"tp_degree={tp_degree} with quant={config.quant.method!r}: torchao's quantized "
                              "weights cannot be split into DTensor shards. Valid: tp_degree=1 with quant, or "
                              "quant=None with tp_degree")
        rest = world_size // cfg_degree if world_size % cfg_degree == 0 else world_size
        candidates = [d for d in range(1, rest + 1) if rest % d == 0]
        for model, plan in zip(models, tp_plans):
            check_tensor_parallel(model, plan, tp_degree, candidates)
    check_fsdp(type(target).__name__, [(type(m).__name__, m) for m in models], fsdp_degree, config.quant)
    return tp_plans


def _device_memory(device) -> int | None:
    """Total memory of the rank's accelerator (None on the CPU)."""
    import torch

    from .parallel.groups import default_device, read_torchrun_env

    dev = torch.device(device) if device is not None else default_device(read_torchrun_env()[1])
    mod = getattr(torch, dev.type, None) if dev.type != "cpu" else None
    try:
        return int(mod.get_device_properties(dev).total_memory) if mod is not None else None
    except (RuntimeError, AttributeError):
        return None


def memory_plan(target, config: BoostConfig | Mapping | Any, world_size: int, *, device=None):
    """The memory planner's :class:`~lite_boost.memory.MemoryPlan` for ``target`` on ``world_size`` ranks: the
    real module's parameter counts (every transformer of a pipeline, its text encoder), the shape of
    ``parallel.layout_shape`` (else the family's reference), ``parallel.device_memory`` (else the device's)."""
    import dataclasses

    from .config import ParallelConfig
    from .memory import DEFAULT_SHAPE, ModelDims, plan_layouts, token_count

    config = BoostConfig.coerce(config)
    par = config.parallel
    family = family_of(lookup(target))
    models = family.transformers_of(target) if family is not None else [target]
    is_pipe = family is not None and family.is_pipeline(target)
    text_encoder = getattr(target, "text_encoder", None) if is_pipe else None
    first = next(models[0].parameters())
    extras = {}
    if family is not None:
        cfg = family.pipeline.cfg
        extras = dict(joint_text=family.joint != "cross", cfg_batched=getattr(cfg, "kind", None) == "batched")
    dims = ModelDims.from_module(models[0], text_encoder=text_encoder, dtype_bytes=first.element_size(), **extras)
    if len(models) > 1:  # e.g. Wan2.2's two experts: both resident, one runs per call
        dims = dataclasses.replace(dims, blocks_params=dims.blocks_params * len(models),
                                   blocks_linear_params=dims.blocks_linear_params * len(models),
                                   other_params=dims.other_params * len(models))
    shape = par.layout_shape or tuple((getattr(family, "reference", None) or {}).get("shape", DEFAULT_SHAPE))
    memory = par.device_memory if par.device_memory is not None else _device_memory(device)
    if memory is None:
        raise ConfigError("layout='auto' needs parallel.device_memory (e.g. '24GiB') on the CPU: there is no device "
                          "memory to read")
    fields = {f.name for f in dataclasses.fields(ParallelConfig)}
    sequence_ok = family is None or family.supports("sequence_parallel")
    available = {"tp": "tp_degree" in fields, "fsdp": "fsdp_degree" in fields,
                 "cfg": is_pipe and family.supports("cfg_parallel"), "offload": True}
    return plan_layouts(dims, world_size, token_count(dims, *shape), memory, shape=shape, available=available,
                        ring=sequence_ok)


def auto_layout(target, config: BoostConfig | Mapping | Any, world_size: int, *, device=None) -> BoostConfig:
    """``config`` with ``parallel.layout="auto"`` resolved: the planner's recommendation (the fitting layout
    that moves least; with ``offload`` set, the fitting offload layout) written into its degrees and offload.
    ConfigError naming the smallest layout when none fits."""
    import dataclasses
    import logging

    from .config import OffloadConfig, ParallelConfig
    from .memory import format_plan

    config = BoostConfig.coerce(config)
    plan = memory_plan(target, config, world_size, device=device)
    family = family_of(lookup(target))
    sequence_ok = family is None or family.supports("sequence_parallel")

    def allowed(e):
        lay = e.layout
        return (e.fits and (lay.sequence == 1 or sequence_ok) and (lay.offload or config.offload is None)
                and (lay.tp == 1 or plan_has(e, "tp")) and (lay.fsdp == 1 or plan_has(e, "fsdp"))
                and (lay.cfg == 1 or plan_has(e, "cfg")))

    fields = {f.name for f in dataclasses.fields(ParallelConfig)}

    def plan_has(e, what):
        if what == "cfg":
            return family is not None and family.is_pipeline(target) and family.supports("cfg_parallel")
        return f"{what}_degree" in fields

    chosen = next((e for e in plan.rows if allowed(e)), None)
    if chosen is None:
        smallest = min(plan.rows, key=lambda e: e.total)
        raise ConfigError(f"layout='auto': no layout of {world_size} rank(s) fits device_memory="
                          f"{plan.device_memory / 2**30:.2f} GiB for {type(target).__name__} at {plan.tokens} tokens; "
                          f"the smallest, {smallest.layout.label()}, needs {smallest.total / 2**30:.2f} GiB per rank "
                          "(lite-boost plan shows every layout)")
    degrees = {k: v for k, v in chosen.layout.parallel_fields().items() if k in fields}
    parallel = dataclasses.replace(config.parallel, layout="manual", device_memory=None, layout_shape=None, **degrees)
    offload = config.offload if config.offload is not None else (OffloadConfig() if chosen.layout.offload else None)
    logging.getLogger("lite_boost.api").info("layout='auto': %s\n%s", chosen.layout.label(), format_plan(plan))
    return config.replace(parallel=parallel, offload=offload)


def _rank_device(mesh, device, move_to_device):
    """The device this rank's model will run on, for checks made before the mesh exists (None: where it is)."""
    import torch

    if not move_to_device:
        return None
    if mesh is not None:
        dev = mesh.device
    elif device is not None:
        dev = torch.device(device)
    else:
        from .parallel.groups import default_device, read_torchrun_env

        dev = default_device(read_torchrun_env()[1])
    return None if dev.type == "cpu" else dev


def ParallelManager(target, config: BoostConfig | Mapping | Any = None, *, mesh=None,
                    init_method: str | None = None, device=None, move_to_device: bool = True):
    """Make ``target`` (a supported pipeline or transformer) run sequence / CFG parallel; returns ``target``.

    Args:
        target: a supported diffusers pipeline (``lite-boost models`` lists them: Wan T2V / I2V incl.
            Wan2.2's two-transformer variants, Qwen-Image / -Edit / -Edit-Plus) or transformer.
        config: BoostConfig / ParallelConfig / mapping / None. ``parallel.cfg_degree`` (1 or 2) and
            ``parallel.sequence_degree`` (default world_size // cfg_degree) shape the mesh, split
            into ``ulysses_degree`` x ``ring_degree`` (default: all sequence ranks on Ulysses);
            ``parallel.timeout_s`` bounds every collective; ``parallel.vae_parallel`` ("exact" by default
            on more than one rank where the VAE has a parallel adapter, "chunked" or "off") spreads
            ``target.vae``'s decode / encode over all ranks (:mod:`lite_boost.parallel.vae`);
            ``offload`` keeps the weights on the host and uploads each block to the rank's device as it runs.
        mesh: an existing mesh from ``initialize_usp`` (default: create one from the torchrun env).
        init_method: rendezvous URL when this call initialises torch.distributed (default env://).
        device: override the rank's device (default from LOCAL_RANK).
        move_to_device: move the target to the rank's device when that is not the CPU.

    Every rank must call this with the same arguments. Invalid degrees, an unsupported class, a model
    without a sharding plan, a feature its family lacks (``sparse``, ``cfg_degree=2`` without CFG, a
    cache method) raise before any collective. World size 1 = ``lite_boost.boost``. The patch lives on
    the instances; ``unparallelize(target)`` removes it.
    """
    from .parallel.groups import ParallelMesh, init_mesh
    from .parallel.manager import check_cfg, check_vae, parallelize, unparallelize, world_size_of

    config = BoostConfig.coerce(config)
    if mesh is not None and not isinstance(mesh, ParallelMesh):
        raise TypeError(f"mesh must be a ParallelMesh from initialize_usp, got {type(mesh).__name__}")
    if config.parallel.layout == "auto":  # the memory planner's layout, before anything reads the degrees
        if mesh is not None:
            raise ConfigError("layout='auto' with a mesh: the mesh already fixes the degrees; pass no mesh or use "
                              "layout='manual'")
        config = auto_layout(target, config, world_size_of(None), device=device)
    fn = lookup(target)  # UnsupportedModelError (a TypeError) for unknown classes
    family = family_of(fn)
    ring_degree = 1
    tp_degree, fsdp_degree = config.parallel.tp_degree, config.parallel.fsdp_degree
    if mesh is not None:
        cfg_degree, seq_degree, ring_degree = mesh.cfg_degree, mesh.sequence_degree, mesh.ring_degree
        tp_degree, fsdp_degree = mesh.tp_degree, mesh.fsdp_degree
    else:
        world = world_size_of(None)
        try:
            cfg_degree, ulysses_degree, ring_degree = config.parallel.resolve_mesh(world)
            seq_degree = ulysses_degree * ring_degree
        except ConfigError:  # degrees that do not fit the world: init_mesh names the valid ones, after the checks
            cfg_degree, seq_degree = config.parallel.cfg_degree, max(1, world // config.parallel.cfg_degree)
    sparse_on = config.sparse is not None and config.sparse.sparse_type is not None
    if ring_degree > 1 and sparse_on and family is not None and family.joint != "cross":
        raise ConfigError(
            f"sparse attention with ring_degree={ring_degree} is not available for {family.name} (joint text + "
            "image attention; block-sparse Ring covers self-attention families: "
            f"{[f.name for f in families() if f.joint == 'cross' and f.features.get('sparse') is None]}). Use "
            "ulysses_degree for the sequence ranks, or sparse without ring_degree"
        )
    pplan, models, plans = _layout(target, fn, family, seq_degree)
    if family is not None:
        family.check_config(config)
    cfg_plan = pplan.cfg_for(target) if pplan is not None else None
    if cfg_degree > 1 and (cfg_plan is None or cfg_plan.kind == "none"):
        raise ConfigError(
            f"cfg_degree={cfg_degree} needs a pipeline that runs classifier-free guidance; "
            f"{type(target).__name__} is not one. Valid cfg_degree here: [1]"
        )
    check_cfg(target, pplan, cfg_degree)
    unsupported_vae = family.features["parallel_vae"] if family is not None else None
    vae_adapter = check_vae(target, config, mesh, unsupported=unsupported_vae)  # before any collective
    if config.cache is not None:
        from .cache import check_cache_support

        check_cache_support(target, config.cache, cfg_degree=cfg_degree)  # method / model fit
    if config.quant is not None:  # layers, device, dtype (every rank quantizes its copy of the same weights)
        from .quant import check_quant_support

        check_quant_support(target, config.quant, device=_rank_device(mesh, device, move_to_device))
    if config.offload is not None:  # onload device, streams, no other offloading in place
        from .offload import check_offload_support

        check_offload_support(target, config, device=_rank_device(mesh, device, True) or "cpu")
    from .parallel.ring import check_ring_support

    check_ring_support(config, mesh=mesh, device=device)  # kernels without lse under ring: before any collective
    if mesh is None and (tp_degree > 1 or fsdp_degree > 1):
        config.parallel.resolve_mesh(world_size_of(None))  # weight-sharding degrees that do not fit the world first
    tp_plans = check_weight_sharding(target, models, config, world_size_of(mesh), cfg_degree=cfg_degree,
                                     tp_degree=tp_degree, fsdp_degree=fsdp_degree)  # degrees vs heads / widths
    if mesh is None:
        mesh = init_mesh(config.parallel, init_method=init_method, device=device)

    unparallelize(target)
    if config.offload is not None:  # the blocks compute on this rank's device; the weights stay on the host
        if config.offload.onload_device is None:
            config = config.replace(offload=config.offload.replace(onload_device=str(mesh.device)))
        move_to_device = False
    move = move_to_device and mesh.device.type != "cpu" and hasattr(target, "to")
    if move and config.quant is not None:
        target.to(mesh.device)  # quantize where the model will run (the FP8 / W8A8 kernels check the device)
    _boost(target, config)
    if move and config.quant is None:
        target.to(mesh.device)
    return parallelize(target, models, plans, pplan, config, mesh, vae_adapter=vae_adapter, tp_plans=tp_plans)
