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

__all__ = ["install_cache", "uninstall_cache", "cache_runtime", "install_call_names", "uninstall_call_names",
           "call_names", "STATE_KEY"]

STATE_KEY = "cache"
_NAMES_ATTR = "_lite_boost_call_names"


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


# ----------------------------------------------------------------------------------- call names
class CallNames:
    """Names each transformer call of a pipeline that sets no ``cache_context`` (``CacheAdapter.name_calls``).

    The pipeline calls the transformer cond, then uncond while its CFG flag (``CfgPlan.flag``) is on, once per
    step otherwise, counted from its ``CfgPlan.call_start`` method (once at the start of every pipeline call),
    the order CFG parallelism splits by (``CfgPlan(by_call_order=True)``). A forward pre-hook on each
    transformer (first of its pre-hooks) sets diffusers' cache context ``cond`` / ``uncond`` for the call and a
    forward hook clears it, as ``with transformer.cache_context(name):`` around the call would; a call made
    inside the caller's own ``cache_context`` keeps it. Everything is on the instances; :meth:`remove` undoes it.
    """

    def __init__(self, pipe, plan, models):
        self.pipe = pipe
        self.plan = plan
        self.models = list(models)
        self.order = 0  # transformer calls with CFG on since call_start last ran
        self.names: list[str] = []  # the names given in the current pipeline call (tests, reports)
        self.active = True
        self._handles: list = []
        self._prior = None
        self._wrapper = None
        self._set: dict[int, bool] = {}

    def install(self) -> "CallNames":
        import torch

        name = self.plan.call_start
        self._prior = self.pipe.__dict__.get(name)
        inner = getattr(self.pipe, name)

        def call_start(*args, **kwargs):
            if self.active:
                self.order = 0
                self.names = []
            return inner(*args, **kwargs)

        object.__setattr__(self.pipe, name, call_start)
        self._wrapper = call_start
        enter, leave = torch.compiler.disable(self._enter), torch.compiler.disable(self._leave)
        for model in self.models:
            self._handles.append(model.register_forward_pre_hook(enter, prepend=True))
            self._handles.append(model.register_forward_hook(leave, always_call=True))
        return self

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        name = self.plan.call_start
        if self.pipe.__dict__.get(name) is self._wrapper:
            if self._prior is not None:
                object.__setattr__(self.pipe, name, self._prior)
            else:
                object.__delattr__(self.pipe, name)
        else:  # wrapped again on top since (by someone else): left in place, passing through
            self.active = False

    def _name(self) -> str:
        if not bool(getattr(self.pipe, self.plan.flag, False)):
            return self.plan.cond
        self.order += 1
        return self.plan.cond if self.order % 2 else self.plan.uncond

    def _enter(self, module, args):
        from diffusers.hooks.hooks import CacheContext, _set_cache_context

        runtime = cache_runtime(module)
        if runtime is not None and runtime._context() is not None:  # the caller named this call itself
            self._set[id(module)] = False
            return None
        name = self._name()
        self.names.append(name)
        _set_cache_context(module, CacheContext(name))
        self._set[id(module)] = True
        return None

    def _leave(self, module, args, output):
        from diffusers.hooks.hooks import _set_cache_context

        if self._set.pop(id(module), False):
            _set_cache_context(module, None)
        return None


def install_call_names(pipe, family, models) -> None:
    """Name ``pipe``'s transformer calls ``cond`` / ``uncond`` by their order (see :class:`CallNames`) when the
    boost config asks for a step cache and ``family.cache.name_calls``; otherwise (and first) removes old names."""
    adapter = getattr(family, "cache", None)
    models = [m for m in models if getattr(getattr(m, "_lite_boost", None), "config", None) is not None
              and m._lite_boost.config.cache is not None]
    plan = family.pipeline.cfg_for(pipe) if family.pipeline is not None else None
    old = call_names(pipe)
    if old is not None and old.active and old.plan is plan and old.models == models \
            and pipe.__dict__.get(plan.call_start) is old._wrapper:
        return  # boosted again with the same config: the names stay
    uninstall_call_names(pipe)
    if not getattr(adapter, "name_calls", False) or not models:
        return
    if plan is None or not plan.by_call_order or not plan.call_start or not plan.flag:
        raise AssertionError(f"{family.name}: CacheAdapter(name_calls=True) needs CfgPlan(by_call_order=True, "
                             "call_start=..., flag=...)")  # family data, checked by the family's tests
    object.__setattr__(pipe, _NAMES_ATTR, CallNames(pipe, plan, models).install())


def uninstall_call_names(pipe) -> None:
    names = pipe.__dict__.get(_NAMES_ATTR) if hasattr(pipe, "__dict__") else None
    if names is not None:
        names.remove()
        object.__delattr__(pipe, _NAMES_ATTR)


def call_names(pipe) -> CallNames | None:
    """The :class:`CallNames` of a boosted, cached pipeline whose family names its calls (or None)."""
    return pipe.__dict__.get(_NAMES_ATTR) if hasattr(pipe, "__dict__") else None
