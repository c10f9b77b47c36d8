"""Per-model adapters and the registry that ``boost`` / ``ParallelManager`` look targets up in.

``SUPPORTED_MODELS`` maps a class name to a ``boost_xxx(target, config) -> target`` function.
Lookup walks the target's class hierarchy, so user subclasses of a supported class work too.
New models register with the ``register_model`` decorator::

    @register_model("MyVideoTransformer")
    def boost_my_model(target, config):
        ...
        return target
"""

from __future__ import annotations

from typing import Callable, TypeVar

__all__ = ["SUPPORTED_MODELS", "UnsupportedModelError", "register_model", "lookup", "supported_model_names"]

BoostFn = Callable[..., object]
F = TypeVar("F", bound=BoostFn)

# Filled once, at import, by the ``register_model`` decorators of the adapter modules below.
SUPPORTED_MODELS: dict[str, BoostFn] = {}


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
            SUPPORTED_MODELS[name] = fn
        return fn

    return deco


def supported_model_names() -> list[str]:
    return sorted(SUPPORTED_MODELS)


def lookup(target: object) -> BoostFn:
    """The boost function for ``target``'s class or its nearest registered base class."""
    for cls in type(target).__mro__:
        fn = SUPPORTED_MODELS.get(cls.__name__)
        if fn is not None:
            return fn
    raise UnsupportedModelError(
        f"lite_boost has no adapter for {type(target).__name__}; supported classes: {supported_model_names()}. "
        "Register one with lite_boost.models.register_model."
    )


from . import wan  # noqa: E402,F401  (registers the Wan adapters)
from . import wan_vae  # noqa: E402,F401  (registers the Wan parallel-VAE adapter)
