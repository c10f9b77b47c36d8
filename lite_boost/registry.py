"""The model registry: which lite_boost adapter boosts which diffusers class.

Neutral ground between the per-family adapters, which register into it (``lite_boost.models``),
and the code that looks a target up (``lite_boost.api``, the parallel VAE's adapter lookup). It
imports no other lite_boost module; the built-in adapters are imported by name
(:data:`BUILTIN_ADAPTERS`) the first time a lookup needs them, so the registry never depends on
the adapters statically (the import contracts in ``pyproject.toml`` check it).

``SUPPORTED_MODELS`` maps a class name to a boost function ``boost(target, config) -> target``.
Lookup walks the target's class hierarchy, so user subclasses of a supported class work too. A
family described with :class:`lite_boost.adapter.ModelFamily` registers its two generated boost
functions (transformer and pipeline) with :func:`register_family`; each carries ``.family``, the
description that ``ParallelManager``, step caching and ``lite-boost models`` read. A plain
function registered with :func:`register_model` boosts, and has no other capability (the parallel-VAE
adapters register here too, through ``lite_boost.parallel.vae.register_vae_adapter``)::

    @register_model("MyVideoTransformer")
    def boost_my_model(target, config):
        ...
        return target
"""

from __future__ import annotations

import importlib
import types
from typing import Callable, Iterable, TypeVar

__all__ = [
    "BUILTIN_ADAPTERS",
    "SUPPORTED_MODELS",
    "UnsupportedModelError",
    "add_vae_adapter",
    "families",
    "family_of",
    "load_builtin_adapters",
    "lookup",
    "names_where",
    "register_fallback",
    "register_family",
    "register_model",
    "supported_model_names",
    "vae_adapter_class",
    "vae_adapter_names",
]

BoostFn = Callable[..., object]
F = TypeVar("F", bound=BoostFn)

# Modules whose import registers the built-in adapters (model families and parallel-VAE adapters, then the
# generic path for classes no family registers).
BUILTIN_ADAPTERS = ("lite_boost.models", "lite_boost.adapter.generic")

# Filled at import by the adapters' ``register_family`` / ``register_model`` calls.
SUPPORTED_MODELS: dict[str, BoostFn] = {}
_FAMILIES: dict[str, object] = {}  # family name -> description, in registration order
# name -> (boost function or None for a target no family registers, why not or None): consulted in order
_FALLBACKS: dict[str, tuple[Callable[[object], BoostFn | None], Callable[[object], str | None]]] = {}
# name -> takes_over(target): the fallback takes a target even though a family registered its class
_TAKEOVERS: dict[str, Callable[[object], bool]] = {}
_LOADED: list[bool] = [False]  # the built-in adapters were imported (a list: no rebinding of a global)
# VAE class name -> its parallel-VAE adapter class (``lite_boost.parallel.vae.register_vae_adapter``)
_VAE_ADAPTERS: dict[str, type] = {}


class UnsupportedModelError(TypeError):
    """The object's class (and none of its bases) has a registered lite_boost adapter."""


def register_model(*class_names: str, replace: bool = False) -> Callable[[F], F]:
    """Register the decorated ``boost_xxx(target, config)`` for each of ``class_names``."""
    if not class_names or not all(isinstance(n, str) and n for n in class_names):
        raise ValueError(f"register_model needs one or more class names (non-empty str), got {class_names!r}")

    def deco(fn: F) -> F:
        if not callable(fn):
            raise TypeError(f"register_model decorates a callable, got {type(fn).__name__}")
        for name in class_names:
            if name in SUPPORTED_MODELS and SUPPORTED_MODELS[name] is not fn and not replace:
                raise ValueError(f"a boost function is already registered for {name!r}; pass replace=True")
        for name in class_names:
            SUPPORTED_MODELS[name] = fn
        return fn

    return deco


def register_family(family, *, replace: bool = False):
    """Register a :class:`~lite_boost.adapter.ModelFamily`: its transformer and pipeline classes.

    The family's ``boost_transformer`` is registered for ``family.transformers`` and its
    ``boost_pipeline`` for ``family.pipelines``. Returns the family.
    """
    name = getattr(family, "name", None)
    if not isinstance(name, str) or not name:
        raise TypeError(f"register_family expects a ModelFamily, got {type(family).__name__}")
    if name in _FAMILIES and _FAMILIES[name] is not family and not replace:
        raise ValueError(f"a model family named {name!r} is already registered; pass replace=True")
    register_model(*family.transformers, replace=replace)(family.boost_transformer)
    if family.pipelines:
        register_model(*family.pipelines, replace=replace)(family.boost_pipeline)
    _FAMILIES[name] = family
    return family


def register_fallback(name: str, find: Callable[[object], BoostFn | None],
                      why_not: Callable[[object], str | None] | None = None,
                      takes_over: Callable[[object], bool] | None = None) -> None:
    """Register a path for targets whose class no family registered (the generic path).

    ``find(target)`` returns a boost function (with ``.unboost`` and ``.family``) or None; ``why_not(target)``
    says why it returns None (it goes into the lookup error). Registered families win, except for a target
    for which ``takes_over(target)`` is true (e.g. a model whose processors carry weights the family's do not
    reproduce) and ``find`` gives a function.
    """
    if not isinstance(name, str) or not name or not callable(find):
        raise TypeError("register_fallback needs a name and a callable find(target)")
    _FALLBACKS[name] = (find, why_not or (lambda target: None))
    if takes_over is not None:
        _TAKEOVERS[name] = takes_over


def add_vae_adapter(adapter_cls: type, class_names, *, replace: bool = False) -> None:
    """Record ``adapter_cls`` as the parallel-VAE adapter of the named VAE classes (what
    ``lite_boost.parallel.vae.register_vae_adapter`` does); a name taken by another adapter raises
    ValueError unless ``replace``."""
    for name in class_names:
        if name in _VAE_ADAPTERS and _VAE_ADAPTERS[name] is not adapter_cls and not replace:
            raise ValueError(f"a parallel-VAE adapter is already registered for {name!r}; pass replace=True")
        _VAE_ADAPTERS[name] = adapter_cls


def vae_adapter_class(vae_cls: type) -> type | None:
    """The parallel-VAE adapter class registered for ``vae_cls`` or its nearest registered base, or None."""
    load_builtin_adapters()
    for cls in vae_cls.__mro__:
        adapter_cls = _VAE_ADAPTERS.get(cls.__name__)
        if adapter_cls is not None:
            return adapter_cls
    return None


def vae_adapter_names() -> list[str]:
    """The VAE class names with a registered parallel-VAE adapter, sorted."""
    load_builtin_adapters()
    return sorted(_VAE_ADAPTERS)


def load_builtin_adapters() -> None:
    """Import the built-in adapters once (their import registers them)."""
    if _LOADED[0]:
        return
    _LOADED[0] = True  # set first: an adapter module that looks something up while loading does not recurse
    try:
        for module in BUILTIN_ADAPTERS:
            importlib.import_module(module)
    except BaseException:
        _LOADED[0] = False
        raise


def supported_model_names() -> list[str]:
    load_builtin_adapters()
    return sorted(SUPPORTED_MODELS)


def lookup(target: object) -> BoostFn:
    """The boost function for ``target``'s class or its nearest registered base class."""
    load_builtin_adapters()
    for name, takes_over in _TAKEOVERS.items():
        if takes_over(target) and (fn := _FALLBACKS[name][0](target)) is not None:
            return fn
    for cls in type(target).__mro__:
        fn = SUPPORTED_MODELS.get(cls.__name__)
        if fn is not None:
            return fn
    reasons = []
    for name, (find, why_not) in _FALLBACKS.items():
        fn = find(target)
        if fn is not None:
            return fn
        why = why_not(target)
        if why:
            reasons.append(f"{name} path: {why}")
    raise UnsupportedModelError(
        f"lite_boost has no adapter for {type(target).__name__}"
        + (f" ({'; '.join(reasons)})" if reasons else "")
        + f"; supported classes: {supported_model_names()}. "
        "Describe the family with lite_boost.adapter.ModelFamily and lite_boost.registry.register_family "
        "(or register a boost function with lite_boost.models.register_model)."
    )


def family_of(target_or_fn: object):
    """The family description behind a boost function or a target (None for plain boost functions)."""
    fn = target_or_fn if isinstance(target_or_fn, types.FunctionType) else None
    if fn is None:
        try:
            fn = lookup(target_or_fn)
        except UnsupportedModelError:
            return None
    return getattr(fn, "family", None)


def families() -> list:
    """The registered family descriptions, in registration order."""
    load_builtin_adapters()
    return list(_FAMILIES.values())


def names_where(predicate: Callable[[object], bool]) -> list[str]:
    """Class names whose family satisfies ``predicate``: families in registration order, names sorted in each."""
    out: list[str] = []
    for family in families():
        if predicate(family):
            out.extend(sorted(_class_names(family)))
    return out


def _class_names(family) -> Iterable[str]:
    return (*family.transformers, *family.pipelines)
