"""The generic path: any diffusers transformer whose attention goes through diffusers' dispatcher.

About forty of diffusers' transformer classes compute attention through
``diffusers.models.attention_dispatch.dispatch_attention_fn``: their processors project, normalise and
rotate q / k themselves and pass ``backend=self._attention_backend`` to the dispatcher, which looks the
backend up in ``_AttentionBackendRegistry``. The generic path boosts those models without any code that
knows the model:

* one attention backend per boosted model is registered in diffusers' registry (its own ``register``
  decorator) under a backend name of its own (``lite_boost_<n>``): an instance of diffusers'
  ``AttentionBackendName`` made for this model only, so ``dispatch_attention_fn`` accepts it, while the
  enum itself (its members, ``set_attention_backend``'s choices) and every other model are untouched;
* the model's processors get that name in their ``_attention_backend`` attribute (the per-module slot
  ``set_attention_backend`` writes), the previous values kept for ``unboost``;
* the backend function (:class:`GenericAttention`, the per-model context) runs lite_boost's dense dispatch
  (``lite_boost.ops.attention``: FA3 -> FA2 -> Ascend -> SDPA) and, where asked and the layout is known,
  block-sparse attention over the latent token grid; calls it does not take over (a dense float mask,
  causal attention, dropout, diffusers' own context parallelism) go to diffusers' native backend, which is
  what the stock model runs;
* quantization defaults to the Linear layers of the blocks the model names in ``_repeated_blocks``; step
  caching uses diffusers' own hooks where they find the model's blocks / attention layers.

A named family (:mod:`lite_boost.models`) wins over the generic path: the registry consults it only for
classes no family registered. ``GenericAttention.self_attn_fn`` / ``cross_attn_fn`` are the slots where
sequence parallelism (or any other wrapper) plugs in, in the ``attn_fn`` protocol of the family processors.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import re
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch

from ..cache import CACHE_METHODS, CacheAdapter
from ..config import BoostConfig, ConfigError
from ..ops.attention import attention
from ..ops.rope import RopeCache
from ..parallel.plan import PipelinePlan
from ..quant import check_uninstall_quant, install_quant, uninstall_quant
from ..registry import UnsupportedModelError, family_of, lookup, register_fallback
from .boost import STATE_ATTR, BoostState, check_attention_precision
from .cache import install_cache, uninstall_cache
from .family import FEATURES
from .generic_parallel import cp_plan_of, key_padding_mask as _key_padding_mask, plan_gap, sequence_plan
from .controlnet import boost_controlnets, unboost_controlnets
from .loaders import AFTER_SWAP_KEY, install_loader_guards, install_pipeline_guards, uninstall_loader_guards, uninstall_pipeline_guards
from .steps import attach_step_check, detach_step_check
from .generic_sparse import SPARSE_CACHE_METHODS, install_generic_sparse, latent_grid, uninstall_generic_sparse
from .processor import DenseAttention
from .shims import SEA_CACHE_WHY_NOT, patch_size

__all__ = ["GENERIC", "class_family", "GenericAttention", "GenericFamily", "attention_problem", "boost_generic", "class_problem",
           "generic_family", "generic_pipeline_family", "installed_transformer_classes", "repeated_block_patterns",
           "unboost_generic", "PIPELINE_TRANSFORMERS"]

GENERIC = "generic"
# Where a diffusers pipeline keeps its transformers (Wan2.2 and a few others have a second one).
PIPELINE_TRANSFORMERS = ("transformer", "transformer_2")
BACKEND_PREFIX = "lite_boost_"
_TRANSFORMERS = "diffusers.models.transformers."
_NUMBERS = itertools.count()  # backend names: one per boosted model, never reused in a process


# ----------------------------------------------------------------------------------------------- #
# Does a model's attention go through diffusers' dispatcher?                                      #
# ----------------------------------------------------------------------------------------------- #


@functools.lru_cache(maxsize=None)
def _processor_dispatches(proc_cls: type) -> bool:
    """True when ``proc_cls`` hands attention to ``dispatch_attention_fn`` with the module's backend and leaves
    the backend open (a processor class that names one, e.g. a causal processor built for the flex backend's
    block masks, keeps it)."""
    if getattr(proc_cls, "_attention_backend", None) is not None:
        return False
    try:
        src = inspect.getsource(proc_cls)
    except (OSError, TypeError):
        return False
    return "dispatch_attention_fn(" in src and "backend=self._attention_backend" in src.replace(" ", "")


def _attention_modules(model) -> list[tuple[str, torch.nn.Module]]:
    """(name, module) of every diffusers attention module (one with a ``processor``) of ``model``."""
    return [(n, m) for n, m in model.named_modules() if hasattr(m, "set_processor") and hasattr(m, "processor")]


def _dispatching(model) -> tuple[list[tuple[str, object]], list[str]]:
    """([(module name, processor)] that go through the dispatcher, [names of those that do not])."""
    ours, others = [], []
    for name, module in _attention_modules(model):
        proc = module.processor
        if _processor_dispatches(type(proc)):
            ours.append((name, proc))
        else:
            others.append(f"{name} ({type(proc).__name__})")
    return ours, others


def attention_problem(model) -> str | None:
    """Why the generic path cannot take ``model`` (an instance), or None."""
    from diffusers import ModelMixin

    if not isinstance(model, ModelMixin):
        return f"{type(model).__name__} is not a diffusers model (ModelMixin)"
    ours, others = _dispatching(model)
    if not ours:
        shown = ", ".join(others[:3]) + (" ..." if len(others) > 3 else "")
        return ("its attention does not go through diffusers' dispatch_attention_fn with the module's backend "
                + (f"(processors: {shown})" if others else "(no diffusers attention module)"))
    return None


@functools.lru_cache(maxsize=None)
def class_problem(cls: type) -> str | None:
    """Why the generic path cannot take models of class ``cls`` (read from the code, no instance), or None.

    Looks at the attention processors the class's module (and the transformer modules it takes classes
    from) defines or imports, and the default processors of its attention classes: at least one must hand attention to ``dispatch_attention_fn`` with the
    module's backend. The boost itself checks the processors of the instance.
    """
    from diffusers import ModelMixin
    from diffusers.models.attention import AttentionModuleMixin

    if not (isinstance(cls, type) and issubclass(cls, ModelMixin)):
        return f"{getattr(cls, '__name__', cls)!r} is not a diffusers model class"
    mod = sys.modules.get(cls.__module__)
    # the class's module and the transformer modules it takes blocks from (HunyuanVideo-Framepack, Wan-VACE)
    modules = {mod} if mod is not None else set()
    for obj in list(vars(mod).values()) if mod is not None else ():
        if isinstance(obj, type) and issubclass(obj, torch.nn.Module) and obj.__module__.startswith(_TRANSFORMERS):
            modules.add(sys.modules.get(obj.__module__))
    candidates = set()
    for obj in (o for m in modules if m is not None for o in vars(m).values()):
        if not isinstance(obj, type):
            continue
        if issubclass(obj, AttentionModuleMixin):
            candidates.update(p for p in (getattr(obj, "_default_processor_cls", None),
                                          *(getattr(obj, "_available_processors", None) or ())) if p is not None)
        elif "Processor" in obj.__name__ and callable(getattr(obj, "__call__", None)):
            candidates.add(obj)
    if any(_processor_dispatches(p) for p in candidates if isinstance(p, type)):
        return None
    return "its attention does not go through diffusers' dispatch_attention_fn with the module's backend"


def installed_transformer_classes() -> dict[str, type]:
    """Every diffusers transformer model class of the installed package (``diffusers.models.transformers``)."""
    import diffusers.models.transformers as transformers
    from diffusers import ModelMixin

    out = {}
    for name in sorted(dir(transformers)):
        if name.startswith("_"):
            continue
        try:
            obj = getattr(transformers, name)
        except Exception:  # noqa: BLE001 - a class whose optional dependency is missing
            continue
        if isinstance(obj, type) and issubclass(obj, ModelMixin):
            out[name] = obj
    return out


# ----------------------------------------------------------------------------------------------- #
# Facts read from the model                                                                        #
# ----------------------------------------------------------------------------------------------- #


def _pattern(name: str) -> str:
    """An ``fnmatch`` pattern for the children of ``name`` and of its siblings that differ only in list indices."""
    return ".".join("*" if p.isdigit() else p for p in name.split(".")) + ".*"


def repeated_block_patterns(model) -> tuple[str, ...]:
    """``fnmatch`` patterns over module names (``ModelFamily.quant_patterns``) selecting the layers inside the
    blocks the model names in ``_repeated_blocks`` (outermost such blocks, list indices generalised)."""
    names = set(getattr(model, "_repeated_blocks", None) or ())
    out, covered = [], []
    for name, module in model.named_modules():
        if type(module).__name__ not in names or any(name.startswith(c + ".") for c in covered):
            continue
        covered.append(name)
        pat = _pattern(name)
        if pat not in out:
            out.append(pat)
    return tuple(out)


def _block_lists(model) -> list[tuple[str, torch.nn.ModuleList]]:
    from diffusers.hooks._common import _ALL_TRANSFORMER_BLOCK_IDENTIFIERS

    return [(n, m) for n, m in model.named_children()
            if n in _ALL_TRANSFORMER_BLOCK_IDENTIFIERS and isinstance(m, torch.nn.ModuleList)]


def _cache_problems(model) -> dict[str, str]:
    """cache method -> why diffusers' hook does not fit ``model`` (methods missing from the dict fit)."""
    from diffusers.hooks._helpers import TransformerBlockRegistry

    problems: dict[str, str] = {}
    if not callable(getattr(model, "enable_cache", None)):
        return {m: f"{type(model).__name__} has no enable_cache (diffusers' CacheMixin)" for m in CACHE_METHODS}
    lists = _block_lists(model)
    blocks = [b for _, lst in lists for b in lst]
    unregistered = sorted({type(b).__name__ for b in blocks
                           if not _registered(TransformerBlockRegistry, type(b))})
    if len(blocks) < 2:
        why = "diffusers' block hooks find fewer than two transformer blocks in it"
    elif unregistered:
        why = f"diffusers' block hooks do not know its block class(es) {unregistered}"
    else:
        why = None
    if why is not None:
        problems["first_block_cache"] = problems["mag_cache"] = why
    attn = [n for n, _ in _attention_modules(model)]
    from diffusers.hooks._common import _SPATIAL_TRANSFORMER_BLOCK_IDENTIFIERS

    if not any(re.search(i, n) for n in attn for i in _SPATIAL_TRANSFORMER_BLOCK_IDENTIFIERS):
        problems["pyramid_attention_broadcast"] = "diffusers' hook finds no attention layer in its transformer blocks"
    if not any(n == "proj_out" for n, _ in model.named_modules()):
        problems["taylorseer_cache"] = "diffusers' default TaylorSeer layers (proj_out) are missing; pass cache_identifiers"
    problems["sea_cache"] = SEA_CACHE_WHY_NOT
    return problems


def _registered(registry, cls) -> bool:
    try:
        registry.get(cls)
        return True
    except ValueError:
        return False


# ----------------------------------------------------------------------------------------------- #
# The record                                                                                       #
# ----------------------------------------------------------------------------------------------- #


@dataclass(frozen=True)
class GenericFamily:
    """What the generic path offers one transformer class (the duck type of ``ModelFamily`` that ``boost``,
    the checks and ``lite-boost models`` read).

    Built from a model instance (:func:`generic_family`): the features follow from its data (processors,
    ``_repeated_blocks``, diffusers' hook support, patch size); ``unsupported`` says why a feature is off.
    """

    model_class: str
    dispatch_sites: int = 0
    other_sites: tuple[str, ...] = ()
    quant_patterns: tuple[str, ...] = ()
    patch: tuple[int, int, int] | None = None
    cache: CacheAdapter | None = None
    unsupported: dict = field(default_factory=dict)
    name: str = GENERIC
    joint: str = "unknown"
    pipelines: tuple[str, ...] = ()
    pipeline: PipelinePlan = field(default_factory=lambda: PipelinePlan(transformers=PIPELINE_TRANSFORMERS))
    sharding: object = None
    notes: str = ""
    output: str | None = None  # what the command line reads of a family record: see GenericPipelineFamily
    cfg_argument: str | None = "guidance_scale"
    tiny: Mapping = field(default_factory=dict)

    @property
    def transformers(self) -> tuple[str, ...]:
        return (self.model_class,)

    @property
    def features(self) -> dict[str, str | None]:
        return {f: self.unsupported.get(f) for f in FEATURES}

    def supports(self, feature: str) -> bool:
        if feature not in FEATURES:
            raise ValueError(f"unknown feature {feature!r}; features: {list(FEATURES)}")
        return self.features[feature] is None

    def check_config(self, config: BoostConfig, model=None, *, option=None) -> None:
        """ConfigError, naming the option, when ``config`` asks for a feature the generic path lacks here.

        ``option(key) -> str``: how the option is named (default the BoostConfig field)."""
        name = option or (lambda key: f"{key} (BoostConfig.{key})")

        def refuse(option, feature):
            raise ConfigError(f"{option} is not supported for {self.model_class} on lite_boost's generic path "
                              f"({self.features[feature]})")

        sparse = config.sparse is not None and config.sparse.sparse_type is not None
        if sparse and not self.supports("sparse"):
            refuse(name("sparse"), "sparse")
        if config.cache is not None and not self.supports("step_cache"):
            refuse(name("cache"), "step_cache")
        if sparse and config.cache is not None and config.cache.method not in SPARSE_CACHE_METHODS:
            raise ConfigError(f"cache method {config.cache.method!r} with {name('sparse')} is not supported for "
                              f"{self.model_class} on the generic path (it skips single attention layers, which "
                              f"would shift the grid calls' layer order); with sparse use one of {list(SPARSE_CACHE_METHODS)}")
        if config.quant is not None and config.quant.include is None and not self.supports("quant"):
            refuse(f"{name('quant')} without include patterns", "quant")

    def check_model(self, model) -> None:
        """Nothing more to check: the record was read from this model (:func:`generic_family`)."""

    def is_pipeline(self, target) -> bool:
        return False

    def transformers_of(self, target) -> list:
        return [target]

    def describe(self) -> dict:
        return {"family": self.name, "pipelines": [], "transformers": [self.model_class], "joint": self.joint,
                "cfg": "none", "cache_methods": list(self.cache.methods) if self.cache is not None else [],
                "quant_patterns": list(self.quant_patterns), "features": self.features, "notes": self.notes}


def generic_family(model) -> GenericFamily:
    """The generic record of a model instance; UnsupportedModelError when its attention is not dispatched."""
    why = attention_problem(model)
    if why is not None:
        raise UnsupportedModelError(f"lite_boost cannot boost {type(model).__name__}: {why}, and no model family "
                                    "is registered for it (lite-boost models lists what each class gets)")
    ours, others = _dispatching(model)
    problems = _cache_problems(model)
    methods = tuple(m for m in CACHE_METHODS if m not in problems)
    cache = CacheAdapter(methods=methods, why_not=problems) if methods else None
    patch = patch_size(getattr(model, "config", None))
    splan = sequence_plan(model)
    unsupported = {
        "cfg_parallel": "no pipeline plan on the generic path",
        "parallel_vae": "no parallel-VAE adapter on the generic path",
    }
    if splan is None:
        unsupported["sequence_parallel"] = f"{type(model).__name__} carries no _cp_plan (diffusers' context-parallel plan)"
    elif (gap := plan_gap(model)) is not None:
        unsupported["sequence_parallel"] = gap
    if patch is None:
        unsupported["sparse"] = "no patch size in the model config: the latent token grid is unknown"
    patterns = repeated_block_patterns(model)
    if not patterns:
        unsupported["quant"] = "the model names no _repeated_blocks (pass QuantConfig(include=[...]))"
    if cache is None:
        unsupported["step_cache"] = "; ".join(sorted(set(problems.values())))
    notes = (f"{len(others)} attention module(s) not through the dispatcher stay stock: {', '.join(others[:3])}"
             if others else "")
    return GenericFamily(model_class=type(model).__name__, dispatch_sites=len(ours), other_sites=tuple(others),
                         quant_patterns=patterns, patch=patch, cache=cache, unsupported=unsupported, notes=notes,
                         sharding=splan)


def class_family(cls: type, pipeline_class: str | None = None) -> GenericFamily:
    """The generic record of a transformer class, read from its code and config signature (no instance, no
    weights): what ``lite-boost models`` lists and the CLI checks before loading a pipeline. The boost reads
    the instance itself (:func:`generic_family`)."""
    why = class_problem(cls)
    if why is not None:
        raise UnsupportedModelError(f"lite_boost cannot boost {cls.__name__}: {why}, and no model family is "
                                    "registered for it")
    from diffusers.models.cache_utils import CacheMixin

    try:
        params = inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):
        params = {}
    unsupported = {
        "cfg_parallel": "no pipeline plan on the generic path",
        "parallel_vae": "no parallel-VAE adapter on the generic path",
    }
    if not cp_plan_of(cls):
        unsupported["sequence_parallel"] = f"{cls.__name__} carries no _cp_plan (diffusers' context-parallel plan)"
    elif (gap := plan_gap(cls)) is not None:
        unsupported["sequence_parallel"] = gap
    if "patch_size" not in params:
        unsupported["sparse"] = "no patch size in the model config: the latent token grid is unknown"
    if not getattr(cls, "_repeated_blocks", None):
        unsupported["quant"] = "the model names no _repeated_blocks (pass QuantConfig(include=[...]))"
    cache = None
    if issubclass(cls, CacheMixin):
        cache = CacheAdapter(methods=tuple(m for m in CACHE_METHODS if m != "sea_cache"),
                             why_not={"sea_cache": SEA_CACHE_WHY_NOT})
    else:
        unsupported["step_cache"] = f"{cls.__name__} has no enable_cache (diffusers' CacheMixin)"
    return GenericFamily(model_class=cls.__name__, cache=cache, unsupported=unsupported,
                         pipelines=(pipeline_class,) if pipeline_class else (),
                         quant_patterns=tuple(f"{b} blocks" for b in getattr(cls, "_repeated_blocks", None) or ()),
                         notes="block hooks (first_block_cache, mag_cache) where diffusers' hooks know its blocks; "
                               "sparse where its inputs are (B, C, [F,] H, W) latents (checked at boost / first call)")


# ----------------------------------------------------------------------------------------------- #
# The attention backend                                                                            #
# ----------------------------------------------------------------------------------------------- #


def _native():
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

    return _AttentionBackendRegistry._backends[AttentionBackendName.NATIVE]


class GenericAttention:
    """The per-model attention context: the function diffusers' dispatcher calls for one boosted model.

    ``dispatch_attention_fn`` hands it (B, S, H, D) q / k / v and the call's options. Self-attention
    (q and k of one length, no mask) goes to ``self_attn_fn`` (``attn_fn(q, k, v)`` protocol: dense
    dispatch, wrapped by block-sparse attention or sequence parallelism); attention to another sequence,
    or with a key-padding mask, to ``cross_attn_fn(q, k, v, key_mask)``; anything else (a float or per-query
    mask, causal attention, dropout, diffusers' own context parallelism) to diffusers' native backend, as
    on the stock model.
    """

    def __init__(self, model_class: str, backend: str | None = None):
        self.model_class = model_class
        self.backend = backend
        self.self_attn_fn: Callable[..., torch.Tensor] = DenseAttention(backend)
        self.cross_attn_fn: Callable[..., torch.Tensor] = self._cross
        self.name = None  # the backend name registered in diffusers (set by register)
        self.sparse = None  # GenericSparse when block-sparse attention is on
        self.extras: dict[str, Any] = {}  # per-feature state of other wrappers (e.g. sequence parallelism)

    def _cross(self, q, k, v, key_mask=None):
        return attention(q, k, v, layout="BSND", backend=self.backend, key_mask=key_mask)

    def __call__(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                 enable_gqa=False, _parallel_config=None):
        sp = self.extras.get("sequence_parallel")
        if sp is not None and _parallel_config is sp.marker:  # a call over the split sequence (a _cp_plan)
            return sp(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
        native = (_parallel_config is not None or dropout_p or is_causal
                  or query.dim() != 4 or query.shape[-1] != key.shape[-1] or key.shape[-1] != value.shape[-1]
                  or (key.shape[2] != query.shape[2] and query.shape[2] % key.shape[2]))
        key_mask = None
        if not native and attn_mask is not None:
            key_mask = _key_padding_mask(attn_mask, query, key)
            native = key_mask is None
        if native:
            return _native()(query=query, key=key, value=value, attn_mask=attn_mask, dropout_p=dropout_p,
                             is_causal=is_causal, scale=scale, enable_gqa=enable_gqa,
                             _parallel_config=_parallel_config)
        if key_mask is None and query.shape[1] == key.shape[1]:
            if self.sparse is not None:
                return self.sparse(query, key, value, self.self_attn_fn)
            return self.self_attn_fn(query, key, value)
        return self.cross_attn_fn(query, key, value, key_mask)

    def backend_fn(self):
        """The function registered in diffusers' registry (its signature names the arguments it takes)."""
        ctx = self

        def lite_boost_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False, _parallel_config=None):
            return ctx(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, _parallel_config)

        return lite_boost_attention

    def register(self):
        """Register this context as a diffusers attention backend of its own; returns the backend name."""
        from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

        value = f"{BACKEND_PREFIX}{next(_NUMBERS)}"
        # An instance of the enum's class that is not one of its members: dispatch_attention_fn takes it as
        # a backend name as it is, the enum (its members, set_attention_backend's choices) stays as it was.
        name = str.__new__(AttentionBackendName, value)
        name._value_, name._name_ = value, value.upper()
        _AttentionBackendRegistry.register(name)(self.backend_fn())
        self.name = name
        return name

    def unregister(self) -> None:
        from diffusers.models.attention_dispatch import _AttentionBackendRegistry

        if self.name is None:
            return
        for table in (_AttentionBackendRegistry._backends, _AttentionBackendRegistry._constraints,
                      _AttentionBackendRegistry._supported_arg_names):
            table.pop(self.name, None)
        _AttentionBackendRegistry._supports_context_parallel.discard(self.name.value)
        self.name = None

    def __deepcopy__(self, memo):
        raise TypeError(
            f"copy.deepcopy of a {self.model_class} boosted on lite_boost's generic path is not supported: its "
            "attention is a diffusers attention backend registered for that one model instance, which a copy "
            "would share. Copy the model before boosting and boost the copy, or unboost, copy, and boost both")

    def __repr__(self) -> str:
        return f"GenericAttention({self.model_class}, {self.name and self.name.value}, self={self.self_attn_fn!r})"


# ----------------------------------------------------------------------------------------------- #
# boost / unboost                                                                                  #
# ----------------------------------------------------------------------------------------------- #

CONTEXT_KEY = "generic"


def _install_backend(model, state: BoostState) -> None:
    ctx = GenericAttention(type(model).__name__, state.config.attention_backend)
    ctx.self_attn_fn.precision = state.config.attention.precision  # self-attention only, as on the family path
    name = ctx.register()
    originals: dict[int, tuple[object, object]] = {}
    for _, module in _attention_modules(model):
        proc = module.processor
        if id(proc) in originals or not _processor_dispatches(type(proc)):
            continue
        originals[id(proc)] = (proc, proc.__dict__.get("_attention_backend", _ABSENT))
        proc._attention_backend = name
    state.extras[CONTEXT_KEY] = ctx
    state.extras["generic_backends"] = list(originals.values())
    state.extras[AFTER_SWAP_KEY] = repoint_processors  # a processor swap on the boosted model keeps this backend


_ABSENT = object()


def repoint_processors(model, state: BoostState) -> None:
    """After a processor swap on a boosted model: the new processors that go through diffusers' dispatcher take
    this model's lite_boost backend too (their previous value kept for ``unboost``), as at boost time."""
    ctx = state.extras.get(CONTEXT_KEY)
    if ctx is None or ctx.name is None:
        return
    recorded = state.extras.setdefault("generic_backends", [])
    seen = {id(p) for p, _ in recorded}
    for _, module in _attention_modules(model):
        proc = module.processor
        if id(proc) in seen or not _processor_dispatches(type(proc)):
            continue
        seen.add(id(proc))
        recorded.append((proc, proc.__dict__.get("_attention_backend", _ABSENT)))
        proc._attention_backend = ctx.name


def _uninstall_backend(model, state: BoostState) -> None:
    state.extras.pop(AFTER_SWAP_KEY, None)
    for proc, previous in state.extras.pop("generic_backends", ()):
        if previous is _ABSENT:
            proc.__dict__.pop("_attention_backend", None)
        else:
            proc._attention_backend = previous
    ctx = state.extras.pop(CONTEXT_KEY, None)
    if ctx is not None:
        ctx.unregister()


def generic_context(model) -> GenericAttention | None:
    """The :class:`GenericAttention` of a model boosted on the generic path (None otherwise)."""
    state = getattr(model, STATE_ATTR, None)
    extras = getattr(state, "extras", None)
    return extras.get(CONTEXT_KEY) if isinstance(extras, dict) else None


def boost_generic(model, config: BoostConfig | None = None, *, plan=None):
    """Boost one transformer on the generic path in place and return it (idempotent for an equal config).

    ``plan``: a :class:`lite_boost.plan.Plan` of this model (its record, config and quantization are used,
    nothing is checked again)."""
    if plan is None:
        config = BoostConfig.coerce(config)
        family = generic_family(model)
        family.check_config(config, model)
        check_attention_precision(config, model)
    else:
        config, family = plan.config, plan.family
    state = getattr(model, STATE_ATTR, None)
    if state is not None:
        if state.config == config and isinstance(state.family, GenericFamily):
            return model
        lookup(model).unboost(model)
    state = BoostState(config=config, rope_cache=RopeCache(config.rope_cache_size), family=family)
    # first: on failure it leaves the model as it was
    install_quant(model, state, plan.part("quant", model) if plan is not None else None)
    try:
        _install_backend(model, state)
        install_generic_sparse(model, state, state.extras[CONTEXT_KEY])
        install_cache(model, state, checked=plan is not None)
        install_loader_guards(model, state)
    except BaseException:
        _undo(model, state)
        raise
    setattr(model, STATE_ATTR, state)
    return model


def _undo(model, state: BoostState) -> None:
    uninstall_loader_guards(model, state)
    detach_step_check(model, state)
    uninstall_generic_sparse(model, state, state.extras.get(CONTEXT_KEY))
    uninstall_cache(model, state)
    _uninstall_backend(model, state)
    uninstall_quant(model, state)


def unboost_generic(model):
    """Undo :func:`boost_generic`: the processors' backends, hooks and weights back; returns the model."""
    state = getattr(model, STATE_ATTR, None)
    if state is None:
        return model
    check_uninstall_quant(state)
    _undo(model, state)
    delattr(model, STATE_ATTR)
    return model


boost_generic.unboost = unboost_generic
boost_generic.family = None  # per model: generic_family(model)


# ----------------------------------------------------------------------------------------------- pipelines
def pipeline_transformers(pipe) -> list[tuple[str, object]]:
    """(attribute, transformer) of every transformer a diffusers pipeline holds (``transformer``, ``transformer_2``)."""
    return [(a, m) for a in PIPELINE_TRANSFORMERS if (m := getattr(pipe, a, None)) is not None]


@dataclass(frozen=True)
class GenericPipelineFamily:
    """A pipeline no family registered, whose transformers each have a boost path (named family or generic)."""

    pipeline_class: str
    members: tuple = ()  # (attribute, family record) per transformer
    name: str = GENERIC
    joint: str = "unknown"
    sharding: object = None
    notes: str = ""
    # what the command line reads of a family record (ModelFamily): what the pipeline makes is unknown here, its
    # CFG scale argument is diffusers' usual one (checked against the pipeline's signature), no built-in tiny run
    output: str | None = None
    cfg_argument: str | None = "guidance_scale"
    tiny: Mapping = field(default_factory=dict)
    pipeline: PipelinePlan = field(default_factory=lambda: PipelinePlan(transformers=PIPELINE_TRANSFORMERS))

    @property
    def pipelines(self) -> tuple[str, ...]:
        return (self.pipeline_class,)

    @property
    def transformers(self) -> tuple[str, ...]:
        return tuple(f.transformers[0] for _, f in self.members)

    @property
    def quant_patterns(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(p for _, f in self.members for p in f.quant_patterns))

    @property
    def features(self) -> dict[str, str | None]:
        out = {}
        for feat in FEATURES:
            whys = [f"{a}: {f.features[feat]}" for a, f in self.members if f.features[feat] is not None]
            out[feat] = "; ".join(whys) if whys else None
        if out["cfg_parallel"] is None:
            out["cfg_parallel"] = "no pipeline plan on the generic path"
        return out

    @property
    def cache(self) -> CacheAdapter | None:
        adapters = [f.cache for _, f in self.members]
        if any(a is None for a in adapters):
            return None
        methods = tuple(m for m in adapters[0].methods if all(m in a.methods for a in adapters))
        why = {m: r for a in adapters for m, r in a.why_not.items()}
        checks = [a.check for a in adapters if a.check is not None]

        def check(model, method, params):
            for fn in checks:
                fn(model, method, params)

        return CacheAdapter(methods=methods, why_not=why, check=check if checks else None) if methods else None

    def supports(self, feature: str) -> bool:
        return self.features[feature] is None

    def check_config(self, config: BoostConfig, model=None, *, option=None) -> None:
        for _, fam in self.members:
            fam.check_config(config, option=option)

    def check_model(self, model) -> None:
        """Each member's own check (a named family's attention sites; nothing more for a generic member)."""
        for _, fam in self.members:
            if type(model).__name__ in fam.transformers:
                fam.check_model(model)
                return

    def is_pipeline(self, target) -> bool:
        return type(target).__name__ == self.pipeline_class or hasattr(target, "components")

    def transformers_of(self, target) -> list:
        return [m for _, m in pipeline_transformers(target)]

    def describe(self) -> dict:
        return {"family": self.name, "pipelines": [self.pipeline_class], "transformers": list(self.transformers),
                "joint": self.joint, "cfg": "none", "cache_methods": list(self.cache.methods) if self.cache else [],
                "quant_patterns": list(self.quant_patterns), "features": self.features, "notes": self.notes}


def generic_pipeline_family(pipe) -> GenericPipelineFamily:
    members = pipeline_transformers(pipe)
    if not members:
        raise UnsupportedModelError(f"lite_boost has no adapter for {type(pipe).__name__} and it holds no transformer "
                                    f"({' / '.join(PIPELINE_TRANSFORMERS)}) to boost")
    fams = []
    for attr, model in members:
        fam = family_of(model)  # a named family wins
        fams.append((attr, fam if fam is not None else generic_family(model)))
    return GenericPipelineFamily(pipeline_class=type(pipe).__name__, members=tuple(fams))


def boost_generic_pipeline(pipe, config: BoostConfig | None = None, *, plan=None):
    """Boost every transformer of a pipeline no family registered (each by its family, else generically).

    ``plan``: a :class:`lite_boost.plan.Plan` of this pipeline (its config is used; each transformer is
    then boosted by its own path, which checks its own record)."""
    if plan is None:
        config = BoostConfig.coerce(config)
        family = generic_pipeline_family(pipe)
        family.check_config(config)
    else:
        config = plan.config
    models = pipeline_transformers(pipe)
    boost_controlnets(pipe, config, [m for _, m in models])  # attention settings only; first: it undoes itself on failure
    try:
        for _, model in models:
            lookup(model)(model, config)
    except BaseException:
        unboost_controlnets(pipe)
        raise
    from .sparse import attach_pipeline

    for _, model in models:
        attach_pipeline(model, pipe)
        ctx = generic_context(model)
        if ctx is not None and ctx.sparse is not None:
            ctx.sparse.state.tracker.attach(pipe)
        attach_step_check(model, pipe)
    install_pipeline_guards(pipe)
    return pipe


def unboost_generic_pipeline(pipe):
    for _, model in pipeline_transformers(pipe):
        fn = lookup(model)
        fn.unboost(model)
    unboost_controlnets(pipe)
    uninstall_pipeline_guards(pipe)
    return pipe


boost_generic_pipeline.unboost = unboost_generic_pipeline


# ----------------------------------------------------------------------------------------------- registry
def _bound(fn, family):
    """``fn`` with ``.family`` / ``.unboost`` for one target (what ``lookup`` hands out)."""
    def boost(target, config=None, *, plan=None):
        return fn(target, config, plan=plan)

    boost.__name__ = boost.__qualname__ = fn.__name__
    boost.__doc__ = fn.__doc__
    boost.unboost = fn.unboost
    boost.family = family
    return boost


def _fallback(target):
    """The registry's fallback: a boost function for a target no family registered, or None."""
    try:
        from diffusers import DiffusionPipeline, ModelMixin
    except ImportError:  # pragma: no cover - diffusers is a dependency
        return None
    if isinstance(target, ModelMixin):
        if attention_problem(target) is not None:
            return None
        return _bound(boost_generic, generic_family(target))
    if isinstance(target, DiffusionPipeline) and pipeline_transformers(target):
        try:
            family = generic_pipeline_family(target)
        except UnsupportedModelError:
            return None
        return _bound(boost_generic_pipeline, family)
    return None


def _fallback_reason(target) -> str | None:
    """Why the generic path refuses ``target`` (for the registry's error message), or None."""
    try:
        from diffusers import DiffusionPipeline, ModelMixin
    except ImportError:  # pragma: no cover
        return None
    if isinstance(target, ModelMixin):
        return attention_problem(target)
    if isinstance(target, DiffusionPipeline):
        models = pipeline_transformers(target)
        if not models:
            return f"it holds no transformer ({' / '.join(PIPELINE_TRANSFORMERS)})"
        for attr, m in models:
            if family_of(m) is None and attention_problem(m) is not None:
                return f"its {attr} ({type(m).__name__}): {attention_problem(m)}"
    return None


def _holds_weighted_processor(model) -> bool:
    """An attention processor of ``model`` holds weights of its own (an IP-Adapter's key / value projections) and
    goes through diffusers' dispatcher."""
    return any(isinstance(p := m.processor, torch.nn.Module) and _processor_dispatches(type(p))
               and any(True for _ in p.parameters()) for _, m in _attention_modules(model))


def _takes_over(target) -> bool:
    """The generic path takes ``target`` although a family registered its class: a model boosted on the generic
    path now, or an unboosted one whose IP-Adapter processors (weights of their own, through diffusers'
    dispatcher) a family's processors do not reproduce; a pipeline when it takes one of its transformers."""
    try:
        from diffusers import DiffusionPipeline, ModelMixin
    except ImportError:  # pragma: no cover
        return False
    if isinstance(target, ModelMixin):
        state = getattr(target, STATE_ATTR, None)
        if state is not None:
            return isinstance(state.family, GenericFamily)
        return _holds_weighted_processor(target)
    if isinstance(target, DiffusionPipeline):
        return any(_takes_over(m) for _, m in pipeline_transformers(target))
    return False


register_fallback(GENERIC, _fallback, _fallback_reason, takes_over=_takes_over)
