"""The public entry points: ``boost``, ``unboost`` and ``ParallelManager`` ("boost, then parallelise").

This module composes the layers below it: the registry finds the target's family, the adapter
layer boosts it, ``lite_boost.parallel`` distributes it. ``lite_boost.ParallelManager`` and
``lite_boost.parallel.ParallelManager`` are this function (the latter is the one import from
``lite_boost.parallel`` up to this module, declared in the import contracts).
"""

from __future__ import annotations

from typing import Any, Mapping

from .config import BoostConfig
from .plan import (Plan, auto_layout, check_one_process, check_weight_sharding, make_plan, memory_plan,
                   tensor_parallel_plan)
from .registry import family_of, lookup

__all__ = ["boost", "unboost", "is_boosted", "ParallelManager", "auto_layout", "memory_plan", "apply_plan",
           "apply_parallel_plan", "check_one_process", "check_weight_sharding", "tensor_parallel_plan"]


def boost(target, config=None):
    """Patch a supported diffusers pipeline or model in place for faster inference and return it.

    ``config`` may be a :class:`BoostConfig`, a :class:`SparseConfig` / :class:`ParallelConfig` /
    :class:`CacheConfig` / :class:`QuantConfig`, a mapping with the same keys, or None (defaults:
    automatic attention backend, dense attention, no step caching, full-precision weights).
    The config is validated and the target's class looked up before anything is modified (a feature
    the target's family lacks raises ``ConfigError`` naming the option): :func:`lite_boost.plan.make_plan`.
    Boosting again with the same config is a no-op; with another config the previous boost is replaced.
    """
    return apply_plan(target, make_plan(target, config))


def apply_plan(target, plan: Plan):
    """Boost ``target`` as ``plan`` (from :func:`lite_boost.plan.make_plan` for this target) says; returns it."""
    if plan.family is not None:
        return plan.boost_fn(target, plan.config, plan=plan)
    return plan.boost_fn(target, plan.config)  # a plain register_model function: it checks for itself


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
    plan = make_plan(target, config, parallel=True, mesh=mesh, device=device, move_to_device=move_to_device)
    return apply_parallel_plan(target, plan, init_method=init_method)


def apply_parallel_plan(target, plan: Plan, *, init_method: str | None = None):
    """Create the mesh (unless the plan carries one), boost and parallelise ``target`` as ``plan`` says."""
    from .parallel.groups import init_mesh
    from .parallel.manager import parallelize, unparallelize

    config = plan.config
    mesh = plan.mesh
    if mesh is None:
        mesh = init_mesh(config.parallel, init_method=init_method, device=plan.device, degrees=plan.degrees)
    unparallelize(target)
    # with offload the blocks compute on this rank's device (the plan's onload device); the weights stay on the host
    move = (plan.rank_device is not None and config.offload is None and mesh.device.type != "cpu"
            and hasattr(target, "to"))
    if move and config.quant is not None:
        target.to(mesh.device)  # quantize where the model will run (the FP8 / W8A8 kernels check the device)
    apply_plan(target, plan)
    if move and config.quant is None:
        target.to(mesh.device)
    reoffload = None
    if config.offload is not None and mesh.fsdp_degree > 1:
        # FSDP2's CPUOffloadPolicy keeps these weights on the host (parallelize): lite_boost's block offload hooks
        # (left by an earlier unparallelize, or a boost that saw no fsdp_degree) must not manage them as well
        import torch

        from .offload import offload_module, remove_offload
        from .parallel.manager import fsdp_offloaded_encoders

        for module in list(plan.models) + [getattr(target, n) for n in fsdp_offloaded_encoders(target, config,
                                                                                                 mesh.fsdp_degree)]:
            remove_offload(module)
        onload = torch.device(config.offload.onload_device or mesh.device)

        def reoffload(module):  # unparallelize: the full weights back on the host, offloaded block by block again
            offload_module(module, config.offload, onload)

    return parallelize(target, list(plan.models), list(plan.parts["sharding"]), plan.pipeline, config, mesh,
                       vae_adapter=plan.parts["vae"], tp_plans=list(plan.parts["weights"]), reoffload=reoffload)
