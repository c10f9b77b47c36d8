"""Step caching on a boosted transformer: the family's cache adapter turned into diffusers' hooks.

``install_cache(model, state)`` turns ``state.config.cache`` into diffusers' config object (with
the family's per-method defaults) and calls ``model.enable_cache(...)`` (diffusers' own hooks, on
this instance), then attaches a :class:`~lite_boost.cache.CacheRuntime` (fresh cache state per
pipeline call, decision log, current timestep for Pyramid Attention Broadcast). ``uninstall_cache``
removes both. Which methods a family offers, and why not the others, is data in its
:class:`~lite_boost.cache.CacheAdapter`; :func:`lite_boost.cache.check_cache_support` validates a
request against it before anything is modified.
"""

from __future__ import annotations

from ..cache import CacheAdapter, CacheRuntime, build_diffusers_config, check_not_cached

__all__ = ["install_cache", "uninstall_cache", "cache_runtime", "STATE_KEY"]

STATE_KEY = "cache"


def install_cache(model, state, *, checked: bool = False) -> None:
    """Enable ``state.config.cache`` (if any) on ``model`` with diffusers' hooks.

    ``checked``: the planner validated the request for this model already (``check_cache_support``).
    """
    cfg = state.config.cache
    if cfg is None:
        return
    adapter: CacheAdapter = state.family.cache
    if not checked:
        check_not_cached(model)
        if adapter.check is not None:
            adapter.check(model, cfg.method, dict(cfg.params))
    probe = model.get_submodule(adapter.probe_module) if adapter.probe_module else None
    runtime = CacheRuntime(model, cfg.method, probe_module=probe, timestep_scale=adapter.timestep_scale)
    dcfg = build_diffusers_config(cfg.method, cfg.params, defaults=adapter.defaults.get(cfg.method),
                                  current_timestep_callback=runtime.current_timestep)
    model.enable_cache(dcfg)
    try:
        runtime.attach()
    except Exception:
        model.disable_cache()
        raise
    state.extras[STATE_KEY] = runtime


def uninstall_cache(model, state) -> None:
    runtime = state.extras.pop(STATE_KEY, None)
    if runtime is None:
        return
    runtime.detach()
    if getattr(model, "_cache_config", None) is not None:
        model.disable_cache()


def cache_runtime(model) -> CacheRuntime | None:
    """The CacheRuntime of a boosted, cached transformer (or None)."""
    state = getattr(model, "_lite_boost", None)
    extras = getattr(state, "extras", None)
    return extras.get(STATE_KEY) if isinstance(extras, dict) else None
