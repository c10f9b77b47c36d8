"""One planning step: "can this config run on this target?" answered once, into a frozen :class:`Plan`.

``boost``, ``ParallelManager``, ``BoostManager`` and the ``lite-boost`` command all call :func:`make_plan`
(the command, before any model is built, with ``target=None``: the family's data alone). It coerces the
config once, looks the family up once, resolves the mesh degrees once and then runs every feature's
``resolve`` function of :data:`STEPS` in order. Each raises (``ConfigError``, ``UnsupportedModelError``,
``PlanError``, ``TypeError``) naming the option and the allowed values, before anything is modified and
before any collective; each returns what its applier needs, kept in ``Plan.parts[name]``. The appliers
(:func:`lite_boost.api.apply_plan`, the family's generated boost functions, ``parallelize``) execute the
plan without checking again.

A feature is one function here plus one line in :data:`STEPS`::

    def _resolve_offload(draft: Draft):
        if draft.config.offload is None:            # (the feature's config field)
            return None
        ...                                          # raise ConfigError naming the option, or
        return OffloadPlan(...)                      # what the applier needs

    STEPS = (..., Step("offload", _resolve_offload), ...)

and the applier reads ``plan.parts["offload"]``. ``draft`` holds what earlier steps resolved (``family``,
``models``, ``world_size``, the degrees, ``parts``); ``draft.target is None`` when planning on paper
(the command line, before launching): a step that needs the instance returns early then.

The family is a named :class:`~lite_boost.adapter.ModelFamily` or any record with the same reading
interface (a generic record for any diffusers transformer slots in the same way): ``name``,
``features`` / ``supports(feature)``, ``check_config(config, model=None, option=None)``,
``is_pipeline(target)``, ``transformers_of(target)``, ``check_model(model)``, ``pipeline``
(a :class:`~lite_boost.parallel.plan.PipelinePlan`), ``sharding``, ``cache``, ``quant_patterns``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Mapping

from .config import BoostConfig, ConfigError
from .parallel.plan import PlanError
from .registry import UnsupportedModelError, families, lookup, names_where

__all__ = ["Plan", "Step", "Draft", "STEPS", "make_plan", "check_one_process", "check_weight_sharding",
           "memory_plan", "auto_layout",
           "tensor_parallel_plan", "planner_features", "PlanError", "ConfigError", "UnsupportedModelError",
           "DEFAULT_OPTION_NAMES", "PLANNER_ERRORS", "EXIT_CODES", "exit_code"]

# How the planner names an option in its refusals (the command line passes its flags instead).
DEFAULT_OPTION_NAMES = {
    "sparse": "sparse (BoostConfig.sparse)",
    "cache": "cache (BoostConfig.cache)",
    "quant": "quant (BoostConfig.quant)",
}


# The planner's refusals and the command line's exit status for each (most specific first: PlanError and
# UnsupportedModelError are TypeErrors, ConfigError is a ValueError).
EXIT_CODES: tuple[tuple[type, int], ...] = ((UnsupportedModelError, 3), (PlanError, 4), (ConfigError, 2))
PLANNER_ERRORS = tuple(cls for cls, _ in EXIT_CODES)


def exit_code(exc: BaseException) -> int:
    """The command line's exit status for a planner error (1 for anything else)."""
    return next((code for cls, code in EXIT_CODES if isinstance(exc, cls)), 1)


@dataclass(frozen=True)
class Plan:
    """What one boost / parallel call will do, decided and validated before anything is touched.

    target_class: the target's class name (the family's pipeline class on paper).
    config: the coerced :class:`BoostConfig` (under ParallelManager an unset ``offload.onload_device`` is
        the rank's device here).
    boost_fn: the registered boost function (None on paper).
    family: the named family or generic record behind it (None for a plain ``register_model`` function).
    pipeline: the family's :class:`~lite_boost.parallel.plan.PipelinePlan` when the target is one of its
        pipelines, else None.
    models: the transformers the boost touches (empty on paper).
    parallel: planned for ``ParallelManager`` (mesh, sharding, CFG, VAE resolved) or for ``boost``.
    world_size, cfg_degree, ulysses_degree, ring_degree: the mesh (all 1 for ``boost``).
    device: the caller's ``device`` argument (ParallelManager; None: from LOCAL_RANK).
    rank_device: the device the model will be moved to and run on, for the device-dependent checks
        (None: it stays where it is).
    mesh: the caller's existing ``ParallelMesh``, or None (the applier creates it from the degrees).
    parts: feature name -> what its step resolved (see :data:`STEPS`), read-only.
    """

    target_class: str
    config: BoostConfig
    boost_fn: Callable | None
    family: Any
    pipeline: Any
    models: tuple
    parallel: bool
    world_size: int
    cfg_degree: int
    ulysses_degree: int
    ring_degree: int
    device: Any
    rank_device: Any
    mesh: Any
    parts: Mapping[str, Any]

    @property
    def sequence_degree(self) -> int:
        return self.ulysses_degree * self.ring_degree

    @property
    def degrees(self) -> tuple[int, int, int]:
        """(cfg_degree, ulysses_degree, ring_degree), as ``ParallelConfig.resolve_mesh`` gives them."""
        return self.cfg_degree, self.ulysses_degree, self.ring_degree

    def part(self, name: str, model=None):
        """``parts[name]``; with ``model``, the entry of a per-model part (a tuple aligned with ``models``)."""
        value = self.parts.get(name)
        if model is None or value is None:
            return value
        for m, v in zip(self.models, value):
            if m is model:
                return v
        return None

    def __repr__(self) -> str:
        fam = getattr(self.family, "name", None)
        return (f"Plan({self.target_class}, family={fam!r}, world_size={self.world_size}, "
                f"cfg x ulysses x ring = {self.cfg_degree} x {self.ulysses_degree} x {self.ring_degree}, "
                f"parts={sorted(k for k, v in self.parts.items() if v is not None)})")


@dataclass
class Draft:
    """The plan while the steps run (private to one :func:`make_plan` call)."""

    target: Any
    config: BoostConfig
    parallel: bool
    option: Callable[[str], str]
    mesh: Any = None
    device: Any = None
    move_to_device: bool = True
    target_class: str = ""
    boost_fn: Callable | None = None
    family: Any = None
    pipeline: Any = None
    models: tuple = ()
    world_size: int = 1
    cfg_degree: int = 1
    ulysses_degree: int = 1
    ring_degree: int = 1
    rank_device: Any = None
    mesh_error: ConfigError | None = None  # degrees that do not fit the world: raised after the family checks
    parts: dict = field(default_factory=dict)

    @property
    def sequence_degree(self) -> int:
        return self.ulysses_degree * self.ring_degree

    @property
    def on_paper(self) -> bool:
        return self.target is None


@dataclass(frozen=True)
class Step:
    """One planning step: ``resolve(draft) -> part`` (None: nothing to do); raises to refuse."""

    name: str
    resolve: Callable[[Draft], Any]


# ------------------------------------------------------------------------------------------ helpers
def feature_error(family, feature: str, option: str) -> ConfigError:
    """The refusal of a feature the family lacks (:func:`lite_boost.adapter.family.feature_error`)."""
    from .adapter.family import feature_error as error

    return error(family, feature, option)


def _rank_device(draft: Draft, move: bool | None = None):
    """The device this rank's model will run on, for checks made before the mesh exists (None: where it is).

    ``move``: whether the model goes to the rank's device (default ``draft.move_to_device``)."""
    import torch

    if not draft.parallel or not (draft.move_to_device if move is None else move):
        return None
    if draft.mesh is not None:
        dev = draft.mesh.device
    elif draft.device is not None:
        dev = torch.device(draft.device)
    else:
        from .parallel.groups import default_device, read_torchrun_env

        dev = default_device(read_torchrun_env()[1])
    return None if dev.type == "cpu" else dev


# ------------------------------------------------------------------------------------------ memory planner
_LOOKUP = object()  # memory_plan / auto_layout's family argument when the caller has not looked it up


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


def _default_backend(device) -> str | None:
    """The backend ParallelConfig(backend=None) picks for ``device`` (else the rank's default device)."""
    import torch

    from .parallel.groups import backend_for_device, default_device, read_torchrun_env

    dev = torch.device(device) if device is not None else default_device(read_torchrun_env()[1])
    try:
        return backend_for_device(dev)
    except ConfigError:  # a device type with no known backend: the planner's accelerator assumption
        return None


def memory_plan(target, config: BoostConfig | Mapping | Any, world_size: int, *, device=None, family=_LOOKUP):
    """The memory planner's :class:`~lite_boost.memory.MemoryPlan` for ``target`` on ``world_size`` ranks: the
    real module's parameter counts (every transformer of a pipeline, its text encoder), the shape of
    ``parallel.layout_shape`` (else the family's reference), ``parallel.device_memory`` (else the device's)."""
    import dataclasses

    from .config import ParallelConfig
    from .memory import DEFAULT_SHAPE, ModelDims, plan_layouts, token_count

    config = BoostConfig.coerce(config)
    par = config.parallel
    if family is _LOOKUP:
        family = getattr(lookup(target), "family", None)
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
    available, switches = planner_features(family, is_pipe=is_pipe, model=models[0])
    return plan_layouts(dims, world_size, token_count(dims, *shape), memory, shape=shape, available=available,
                        backend=par.backend or _default_backend(device), **switches)


def planner_features(family, *, is_pipe: bool = True, model=None) -> tuple[dict, dict]:
    """(available, switches) for :func:`lite_boost.memory.plan_layouts`: what this installation can apply of each
    planned feature (ParallelConfig's fields, the family's CFG), and which layouts the model can take at all
    (Ring / Ulysses beyond the heads only with sequence parallelism; tensor parallelism only with a plan: the
    family record's, else the model's diffusers ``_tp_plan``; a family-less target without a model is given
    the benefit of the doubt)."""
    import dataclasses

    from .config import ParallelConfig

    fields = {f.name for f in dataclasses.fields(ParallelConfig)}
    if model is not None:
        tp_plan = tensor_parallel_plan(model, family) is not None
    elif family is not None:  # no module at hand (lite-boost plan --family): the record's, else diffusers' class plan
        import diffusers

        tp_plan = family.tensor_parallel is not None or any(
            getattr(getattr(diffusers, name, None), "_tp_plan", None) is not None for name in family.transformers)
    else:
        tp_plan = True
    available = {"tp": "tp_degree" in fields, "fsdp": "fsdp_degree" in fields,
                 "cfg": is_pipe and (family is None or family.supports("cfg_parallel")), "offload": True}
    switches = {"ring": family is None or family.supports("sequence_parallel"), "tp": bool(tp_plan)}
    return available, switches


def auto_layout(target, config: BoostConfig | Mapping | Any, world_size: int, *, device=None,
                family=_LOOKUP) -> BoostConfig:
    """``config`` with ``parallel.layout="auto"`` resolved: the planner's recommendation (the fitting layout
    that moves least; with ``offload`` set, the fitting offload layout) written into its degrees and offload.
    ConfigError naming the smallest layout when none fits."""
    import dataclasses
    import logging

    from .config import OffloadConfig, ParallelConfig
    from .memory import format_plan

    config = BoostConfig.coerce(config)
    if family is _LOOKUP:
        family = getattr(lookup(target), "family", None)
    plan = memory_plan(target, config, world_size, device=device, family=family)
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


# ------------------------------------------------------------------------------------------ steps
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


def _resolve_mesh(draft: Draft):
    """World size and cfg x ulysses x ring degrees: from the mesh given, else the config and the world
    (``boost``: one process, every degree 1). ``parallel.layout="auto"``: the memory planner's layout first."""
    if not draft.parallel:
        if not draft.on_paper:
            check_one_process(draft.config)
        return None
    mesh = draft.mesh
    if draft.config.parallel.layout == "auto" and not draft.on_paper:
        if mesh is not None:
            raise ConfigError("layout='auto' with a mesh: the mesh already fixes the degrees; pass no mesh or use "
                              "layout='manual'")
        from .parallel.manager import world_size_of

        draft.config = auto_layout(draft.target, draft.config, world_size_of(None), device=draft.device,
                                   family=draft.family)
    if not draft.on_paper:
        draft.rank_device = _rank_device(draft)
    if mesh is not None:
        draft.config.parallel.check_world_size(mesh.world_size)
        draft.world_size = mesh.world_size
        draft.cfg_degree, draft.ulysses_degree, draft.ring_degree = mesh.cfg_degree, mesh.ulysses_degree, mesh.ring_degree
        return None
    p = draft.config.parallel
    if draft.on_paper:
        if draft.world_size > 1:  # the command line: degrees that cannot fit stop it before torchrun
            draft.cfg_degree, draft.ulysses_degree, draft.ring_degree = p.resolve_mesh(draft.world_size)
        return None
    from .parallel.manager import world_size_of

    draft.world_size = world_size_of(None)
    p.check_world_size(draft.world_size)
    try:
        draft.cfg_degree, draft.ulysses_degree, draft.ring_degree = p.resolve_mesh(draft.world_size)
    except ConfigError as exc:  # raised after the family checks (the valid degrees are named there)
        draft.mesh_error = exc
        draft.cfg_degree, draft.ulysses_degree = p.cfg_degree, max(1, draft.world_size // p.cfg_degree)
    return None


def _resolve_sparse(draft: Draft):
    """Block-sparse attention under Ring needs a self-attention (cross text) family."""
    family, config = draft.family, draft.config
    sparse_on = config.sparse is not None and config.sparse.sparse_type is not None
    if draft.ring_degree > 1 and sparse_on and family is not None and family.joint not in ("cross", "packed"):
        raise ConfigError(
            f"sparse attention with ring_degree={draft.ring_degree} is not available for {family.name} (joint text + "
            "image attention; block-sparse Ring covers self-attention families: "
            f"{[f.name for f in families() if f.joint in ('cross', 'packed') and f.features.get('sparse') is None]}). Use "
            "ulysses_degree for the sequence ranks, or sparse without ring_degree"
        )
    return config.sparse if sparse_on else None


def _resolve_sharding(draft: Draft):
    """One ShardingPlan per transformer (None where sequence parallelism is off); PlanError when one is missing."""
    if not draft.parallel:
        return None
    family, seq = draft.family, draft.sequence_degree
    if draft.on_paper:
        if seq > 1 and not family.supports("sequence_parallel"):
            raise feature_error(family, "sequence_parallel",
                                draft.option("sequence_parallel", f"sequence degree {seq}"))
        return None
    from .parallel.plan import ShardingPlan

    if draft.pipeline is not None and not draft.models:
        raise PlanError(f"{draft.target_class} has none of {list(draft.pipeline.transformers)} set")
    plans = []
    for model in draft.models:
        model_family = family  # a generic pipeline: the record of the member holding this transformer
        for attr, member in getattr(family, "members", None) or ():
            if getattr(draft.target, attr, None) is model:
                model_family = member
        plan = getattr(model_family, "sharding", None)
        if seq > 1 and getattr(model_family, "name", None) == "generic" and plan is None:
            from .adapter.generic_parallel import NO_PLAN_HELP

            raise PlanError(
                f"sequence degree {seq}: {type(model).__name__} runs on lite_boost's generic path and carries no "
                "_cp_plan (diffusers' context-parallel plan saying where its sequence is split and gathered), so "
                f"lite_boost cannot split it. {NO_PLAN_HELP}")
        if seq > 1 and callable(getattr(plan, "install", None)):
            plan.check(model, draft.config)  # a diffusers _cp_plan (generic path): fits the instance and config
        elif seq > 1 and not isinstance(plan, ShardingPlan):
            with_plans = names_where(lambda f: isinstance(f.sharding, ShardingPlan))
            raise PlanError(
                f"{type(model).__name__} has no sequence-parallel sharding plan; models with a plan: {with_plans}. "
                "Declare one as ModelFamily(sharding=ShardingPlan(...)) in its adapter."
            )
        plans.append(plan)
    return tuple(plans)


def _resolve_features(draft: Draft):
    """What the family refuses of ``config`` (sparse, cache, quant without the family's support)."""
    if draft.family is not None:
        draft.family.check_config(draft.config, option=draft.option)
    return None


def _why_generic(target) -> str:
    """Why a pipeline whose class a named family registered takes the generic path (its transformer holds
    attention processors with weights of their own, e.g. an IP-Adapter's), as a parenthesis, or ''."""
    from .registry import SUPPORTED_MODELS

    for cls in type(target).__mro__:
        if cls.__name__ in SUPPORTED_MODELS:
            return (f" (not the family registered for {cls.__name__}: its transformer holds attention processors "
                    "with weights of their own, such as an IP-Adapter's, which that family's processors do not run)")
    return ""


def _resolve_cfg(draft: Draft):
    """The pipeline's CFG plan when cfg_degree > 1 splits its two branches over the cfg ranks."""
    if not draft.parallel or draft.cfg_degree < 2:
        return None
    if draft.on_paper:
        if not draft.family.supports("cfg_parallel"):
            raise feature_error(draft.family, "cfg_parallel", draft.option("cfg_parallel"))
        return None
    cfg_plan = draft.pipeline.cfg_for(draft.target) if draft.pipeline is not None else None
    if cfg_plan is None or cfg_plan.kind == "none":
        why = None  # a registered family's own reason (MiniMax-H3: guidance-distilled)
        if draft.family is not None and getattr(draft.family, "name", None) != "generic":
            why = (getattr(draft.family, "unsupported", None) or {}).get("cfg_parallel")
        raise ConfigError(
            f"cfg_degree={draft.cfg_degree} needs a pipeline that runs classifier-free guidance; "
            f"{draft.target_class} is not one{f' ({why})' if why else ''}. Valid cfg_degree here: [1]"
        )
    if (getattr(draft.family, "name", None) == "generic" and cfg_plan.kind == "separate" and cfg_plan.flag is not None
            and not hasattr(type(draft.target), cfg_plan.flag)):
        raise ConfigError(
            f"cfg_degree={draft.cfg_degree}: {draft.target_class} runs on lite_boost's generic pipeline path"
            f"{_why_generic(draft.target)}, whose CFG "
            f"split reads the pipeline's {cfg_plan.flag!r} to know when guidance runs, and {draft.target_class} has "
            "none (it decides in a local variable), so nothing would be split. Valid cfg_degree here: [1] (use the "
            "ranks for sequence parallelism: ulysses_degree / ring_degree)")
    from .parallel.manager import check_cfg

    check_cfg(draft.target, draft.pipeline, draft.cfg_degree)
    return cfg_plan


def _resolve_vae(draft: Draft):
    """The parallel-VAE adapter of ``target.vae`` when the VAE will run parallel, else None."""
    if not draft.parallel or draft.world_size == 1:
        return None
    family, mode = draft.family, draft.config.parallel.vae_parallel
    if draft.on_paper:
        if mode in ("exact", "chunked") and not family.supports("parallel_vae"):
            raise feature_error(family, "parallel_vae", draft.option("parallel_vae"))
        return None
    from .parallel.manager import check_vae

    unsupported = family.features["parallel_vae"] if family is not None else None
    return check_vae(draft.target, draft.config, draft.mesh, unsupported=unsupported, world_size=draft.world_size)


def _resolve_cache(draft: Draft):
    """The family's cache adapter for ``config.cache`` (method, pipeline, CFG split, model checks)."""
    cache = draft.config.cache
    if cache is None:
        return None
    if draft.on_paper:
        methods = list(draft.family.cache.methods)
        if cache.method not in methods:
            raise ConfigError(f"{draft.option('cache.method')} is not available for the {draft.family.name} family; "
                              f"its step caches: {methods}")
        return draft.family.cache
    from .cache import check_cache_support

    return check_cache_support(draft.target, cache, cfg_degree=draft.cfg_degree, family=draft.family)


def _resolve_quant(draft: Draft):
    """One QuantPlan per transformer (layers, device, dtype), aligned with ``models``."""
    if draft.config.quant is None or draft.on_paper:
        return None
    from .quant import check_quant_support

    return tuple(check_quant_support(draft.target, draft.config.quant, device=draft.rank_device,
                                     family=draft.family, models=draft.models))


def _resolve_ring(draft: Draft):
    """Sparse kernels that return no log-sum-exp cannot run under Ring."""
    if not draft.parallel or draft.on_paper or draft.ring_degree == 1:
        return None
    from .parallel.ring import check_ring_support

    check_ring_support(draft.config, mesh=draft.mesh, device=draft.device, ring_degree=draft.ring_degree)
    return None


def _resolve_target(draft: Draft):
    """The boost function and the family (named, or a generic record), the pipeline plan and the transformers.

    A generic record for a class without a named family comes in here: ``lookup`` finds the boost function,
    whose ``family`` attribute is the record (named ModelFamily or generic).
    """
    if draft.on_paper:
        return None
    target = draft.target
    draft.target_class = type(target).__name__
    draft.boost_fn = lookup(target)  # UnsupportedModelError (a TypeError) naming the supported classes
    family = draft.family = getattr(draft.boost_fn, "family", None)
    if family is None:
        draft.models = (target,)
        return None
    draft.pipeline = family.pipeline if family.is_pipeline(target) else None
    draft.models = tuple(family.transformers_of(target))
    return None


def _resolve_offload(draft: Draft):
    """The onload device of ``config.offload`` (device, streams, no other offloading in place).

    Under ParallelManager the blocks compute on the rank's device: an unset ``onload_device`` becomes it in
    the plan's config.
    """
    off = draft.config.offload
    if off is None or draft.on_paper:
        return None
    from .offload import check_offload_support

    if not draft.parallel:
        return check_offload_support(draft.target, draft.config)
    rank = _rank_device(draft, move=True)
    onload = check_offload_support(draft.target, draft.config, device=rank or "cpu")
    if off.onload_device is None:
        draft.config = draft.config.replace(offload=off.replace(onload_device=str(rank or "cpu")))
    return onload


def tensor_parallel_plan(model, family=None):
    """The tensor-parallel plan of ``model``: its family record's, else diffusers' ``_tp_plan`` (None: none)."""
    from .parallel.shard import TensorParallelPlan
    from .registry import family_of

    record = family if family is not None else family_of(model)
    plan = getattr(record, "tensor_parallel", None)
    return plan if plan is not None else TensorParallelPlan.from_diffusers(getattr(model, "_tp_plan", None))


def check_weight_sharding(target, models, config: BoostConfig, world_size: int, *, cfg_degree: int = 1,
                          tp_degree: int = 1, fsdp_degree: int = 1, family=None, quant_plans=None) -> list:
    """Can ``models`` be split over ``tp_degree`` / ``fsdp_degree`` ranks of ``world_size``? ConfigError naming
    the valid degrees, before any collective. Returns the models' tensor-parallel plans (one per model).
    ``quant_plans``: the models' QuantPlans (the layers to be quantized), when ``config.quant`` is set."""
    from .parallel.shard import check_fsdp, check_tensor_parallel, check_tensor_parallel_quant

    tp_plans = [tensor_parallel_plan(m, family) for m in models] if tp_degree > 1 else [None] * len(models)
    if tp_degree > 1:
        check_tensor_parallel_quant(None, None, tp_degree, config.quant, fsdp_degree=fsdp_degree)
        rest = world_size // cfg_degree if world_size % cfg_degree == 0 else world_size
        candidates = [d for d in range(1, rest + 1) if rest % d == 0]
        for i, (model, plan) in enumerate(zip(models, tp_plans)):
            check_tensor_parallel(model, plan, tp_degree, candidates)
            qplan = quant_plans[i] if quant_plans else None
            check_tensor_parallel_quant(model, plan, tp_degree, config.quant,
                                        qplan.layers if qplan is not None else None)
    check_fsdp(type(target).__name__, [(type(m).__name__, m) for m in models], fsdp_degree, config.quant)
    return tp_plans


def _resolve_weights(draft: Draft):
    """Weight sharding: one tensor-parallel plan per transformer (None entries with tp_degree 1); the
    tp / fsdp degrees checked against the heads, widths and blocks."""
    if not draft.parallel or draft.on_paper:
        return None
    if draft.mesh is not None:
        tp, fsdp = draft.mesh.tp_degree, draft.mesh.fsdp_degree
    else:
        tp, fsdp = draft.config.parallel.tp_degree, draft.config.parallel.fsdp_degree
        if (tp > 1 or fsdp > 1) and draft.mesh_error is not None:
            raise draft.mesh_error  # weight-sharding degrees that do not fit the world first
    return tuple(check_weight_sharding(draft.target, draft.models, draft.config, draft.world_size,
                                       cfg_degree=draft.cfg_degree, tp_degree=tp, fsdp_degree=fsdp,
                                       family=draft.family, quant_plans=draft.parts.get("quant")))


def _resolve_attention(draft: Draft):
    """The attention precision (``config.attention.precision``) each transformer's device can run."""
    if draft.on_paper or draft.family is None or not hasattr(draft.config, "attention"):
        return None
    from .adapter.boost import check_attention_precision

    for model in draft.models:
        check_attention_precision(draft.config, model)
    return draft.config.attention


def _resolve_models(draft: Draft):
    """Every transformer matches its family's attention sites and RoPE module (TypeError otherwise)."""
    if draft.on_paper or draft.family is None:
        return None
    if not draft.models:
        raise ValueError(f"{draft.target_class} has none of {list(draft.pipeline.transformers)} set; nothing to boost")
    for model in draft.models:
        draft.family.check_model(model)
    return None


# The steps, in order (the order of the refusals when a config has several problems). A new feature adds
# one function above and one line here; its applier reads ``plan.parts[name]``.
STEPS: tuple[Step, ...] = (
    Step("target", _resolve_target),        # boost function, family (named or generic), pipeline plan, transformers
    Step("mesh", _resolve_mesh),            # world size, cfg x ulysses x ring degrees (layout="auto" resolved)
    Step("sparse", _resolve_sparse),        # block-sparse attention (SparseConfig or None)
    Step("sharding", _resolve_sharding),    # where each transformer's sequence is split and gathered
    Step("features", _resolve_features),    # what the family lacks
    Step("cfg", _resolve_cfg),              # CFG parallelism's plan
    Step("vae", _resolve_vae),              # the parallel-VAE adapter
    Step("cache", _resolve_cache),          # the step-cache adapter
    Step("quant", _resolve_quant),          # one QuantPlan per transformer
    Step("offload", _resolve_offload),      # the onload device of block offloading
    Step("ring", _resolve_ring),            # kernels Ring attention can merge
    Step("weights", _resolve_weights),      # tensor-parallel plans, FSDP degree
    Step("models", _resolve_models),        # the transformers match the family's record
    Step("attention", _resolve_attention),  # attention precision the devices can run
)


# ------------------------------------------------------------------------------------------ entry
def make_plan(target, config: BoostConfig | Mapping | Any = None, *, parallel: bool = False, mesh=None,
              device=None, move_to_device: bool = True, family=None, class_name: str | None = None,
              world_size: int = 1, option_names: Mapping[str, str] | None = None) -> Plan:
    """Resolve and validate everything one boost (``parallel=False``) or ParallelManager call needs.

    Args:
        target: the pipeline or transformer; None plans on paper from ``family`` (the command line,
            before any model is built: ``class_name`` and ``world_size`` say what will run).
        config: anything :meth:`BoostConfig.coerce` takes (coerced once, here).
        parallel: plan for ``ParallelManager`` (mesh degrees, sharding, CFG and VAE plans).
        mesh, device, move_to_device: ``ParallelManager``'s arguments (the mesh's degrees win; the
            device is the rank's, for the quantization checks).
        option_names: how refusals name an option (key -> text, or ``draft -> text``), e.g. the command
            line's flags; keys: ``sparse``, ``cache``, ``cache.method``, ``quant``, ``cfg_parallel``,
            ``sequence_parallel``, ``parallel_vae``.

    Raises ConfigError, UnsupportedModelError, PlanError or TypeError (a target that does not match its
    family's record) before anything is modified and before any collective.
    """
    config = config if isinstance(config, BoostConfig) else BoostConfig.coerce(config)
    names = {**DEFAULT_OPTION_NAMES, **dict(option_names or {})}

    def option(key: str, detail: str = "") -> str:
        name = names.get(key, f"{key}{' (' + detail + ')' if detail else ''}")
        return name(draft) if callable(name) else name

    if parallel and mesh is not None:
        from .parallel.groups import ParallelMesh

        if not isinstance(mesh, ParallelMesh):
            raise TypeError(f"mesh must be a ParallelMesh from initialize_usp, got {type(mesh).__name__}")
    draft = Draft(target=target, config=config, parallel=parallel, option=option, mesh=mesh, device=device,
                  move_to_device=move_to_device)
    if target is None:
        if family is None:
            raise TypeError("make_plan needs a target, or a family to plan on paper")
        draft.family, draft.target_class, draft.world_size = family, class_name or "", world_size
    for step in STEPS:
        draft.parts[step.name] = step.resolve(draft)
    if draft.mesh_error is not None:
        raise draft.mesh_error
    return Plan(target_class=draft.target_class, config=draft.config, boost_fn=draft.boost_fn, family=draft.family,
                pipeline=draft.pipeline, models=draft.models, parallel=parallel, world_size=draft.world_size,
                cfg_degree=draft.cfg_degree, ulysses_degree=draft.ulysses_degree, ring_degree=draft.ring_degree,
                device=device, rank_device=draft.rank_device, mesh=mesh,
                parts=MappingProxyType(dict(draft.parts)))
