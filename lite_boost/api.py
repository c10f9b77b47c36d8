"""Single-process entry points: ``boost(target, config)`` and ``unboost(target)``."""

from __future__ import annotations

from .config import BoostConfig
from .models import lookup

__all__ = ["boost", "unboost", "is_boosted"]


def boost(target, config=None):
    """Patch a supported diffusers pipeline or model in place for faster inference and return it.

    ``config`` may be a :class:`BoostConfig`, a :class:`SparseConfig` / :class:`ParallelConfig` /
    :class:`CacheConfig` / :class:`QuantConfig`, a mapping with the same keys, or None (defaults:
    automatic attention backend, dense attention, no step caching, full-precision weights).
    The config is validated and the target's class looked up before anything is modified. Boosting
    again with the same config is a no-op; with another config the previous boost is replaced.
    """
    config = BoostConfig.coerce(config)
    fn = lookup(target)
    if config.cache is not None:
        from .cache import check_cache_support

        check_cache_support(target, config.cache)  # method / model fit, before anything is modified
    if config.quant is not None:
        from .quant import check_quant_support

        check_quant_support(target, config.quant)  # layers, device, dtype: before anything is modified
    return fn(target, config)


def unboost(target):
    """Restore the original diffusers processors, modules and (quantized) weights of a boosted target; returns it."""
    fn = lookup(target)
    undo = getattr(fn, "unboost", None)
    if undo is None:
        raise TypeError(f"the adapter for {type(target).__name__} does not support unboost")
    return undo(target)


def is_boosted(target) -> bool:
    """True if ``target`` (a model or pipeline) carries a lite_boost patch."""
    if getattr(target, "_lite_boost", None) is not None:
        return True
    return any(getattr(getattr(target, n, None), "_lite_boost", None) is not None
               for n in ("transformer", "transformer_2"))
