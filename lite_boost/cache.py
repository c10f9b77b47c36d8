"""Step caching through diffusers' cache hooks: the offered methods, their validated parameters, and
the per-model runtime that lite_boost attaches next to the hooks.

lite_boost does not re-implement any caching method. ``BoostConfig(cache=CacheConfig(method, ...))``
names one of diffusers' hooks (``diffusers.hooks``) and its parameters; the model adapter turns it
into the diffusers config object and calls ``transformer.enable_cache(...)`` on every transformer of
the pipeline. What lite_boost adds around the hooks:

* validation before anything is touched: an unknown method or parameter, a value out of range, or a
  model without a cache adapter raises :class:`~lite_boost.config.ConfigError` naming the accepted
  values (diffusers would fail at the first step, or silently do nothing);
* a fresh cache state at the start of every pipeline call (diffusers' Wan pipelines never reset the
  hooks, so a second call, or a warm-up call, would start from the previous call's residuals);
* a log of the data-dependent decisions (First-Block Cache) and work counters for reports;
* under :func:`~lite_boost.parallel.ParallelManager`, rank-consistent decisions
  (:mod:`lite_boost.parallel.cache`).

| method | decision | diffusers config |
|---|---|---|
| ``first_block_cache`` | data: relative change of the first block's residual vs ``threshold`` | FirstBlockCacheConfig |
| ``mag_cache`` | fixed: accumulated error of calibrated ``mag_ratios`` | MagCacheConfig |
| ``taylorseer_cache`` | fixed: full compute every ``cache_interval`` steps, Taylor prediction between | TaylorSeerCacheConfig |
| ``pyramid_attention_broadcast`` | fixed: attention reused by timestep range and block skip range | PyramidAttentionBroadcastConfig |
| ``sea_cache`` | data: spectral indicator of the (replicated) input latents vs ``threshold`` | SeaCacheConfig |

This module imports neither diffusers nor torch.distributed at import time.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from .errors import ConfigError, check_regexes

__all__ = [
    "CACHE_METHODS",
    "CacheParam",
    "CacheMethod",
    "CacheAdapter",
    "CacheRuntime",
    "validate_cache_params",
    "parse_cache_spec",
    "build_diffusers_config",
    "check_cache_support",
    "check_not_cached",
    "count_block_work",
    "step_count_problem",
]


def _error(msg: str):
    return ConfigError(msg)


# ------------------------------------------------------------------------------------ parameters
@dataclass(frozen=True)
class CacheParam:
    """One parameter of a cache method, with the checks lite_boost applies before diffusers sees it.

    kind: "float", "int", "bool", "choice", "pair" (two numbers lo < hi), "floats" (non-empty list of
    positive numbers), "regexes" (list of regular expressions).
    """

    name: str
    kind: str
    default: Any = None
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False  # lo itself is excluded
    allow_none: bool = False
    choices: tuple = ()
    help: str = ""

    def describe(self) -> str:
        if self.kind == "choice":
            return f"{self.name} in {list(self.choices)}"
        if self.kind in ("float", "int"):
            lo = "" if self.lo is None else (f"> {self.lo}" if self.lo_open else f">= {self.lo}")
            hi = "" if self.hi is None else f"<= {self.hi}"
            rng = " and ".join(x for x in (lo, hi) if x)
            return f"{self.name} ({self.kind}{', ' + rng if rng else ''}{', or None' if self.allow_none else ''})"
        return f"{self.name} ({self.kind}{', or None' if self.allow_none else ''})"

    def check(self, method: str, value: Any) -> Any:
        where = f"cache {method}.{self.name}"
        if value is None:
            if self.allow_none:
                return None
            raise _error(f"{where} must not be None; accepted: {self.describe()}")
        k = self.kind
        if k == "bool":
            if not isinstance(value, bool):
                raise _error(f"{where} must be True or False, got {value!r}")
            return value
        if k == "choice":
            if value not in self.choices or isinstance(value, bool) != any(isinstance(c, bool) for c in self.choices if c == value):
                raise _error(f"{where} must be one of {list(self.choices)}, got {value!r}")
            return value
        if k in ("float", "int"):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or (k == "int" and not isinstance(value, int)):
                raise _error(f"{where} must be {'an integer' if k == 'int' else 'a number'}, got {value!r}; "
                             f"accepted: {self.describe()}")
            if isinstance(value, float) and not math.isfinite(value):
                raise _error(f"{where} must be finite, got {value!r}")
            if self.lo is not None and (value < self.lo or (self.lo_open and value == self.lo)):
                raise _error(f"{where} out of range: got {value!r}; accepted: {self.describe()}")
            if self.hi is not None and value > self.hi:
                raise _error(f"{where} out of range: got {value!r}; accepted: {self.describe()}")
            return float(value) if k == "float" else int(value)
        if k == "pair":
            try:
                lo, hi = value
            except (TypeError, ValueError):
                raise _error(f"{where} must be two numbers (low, high), got {value!r}") from None
            for x in (lo, hi):
                if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
                    raise _error(f"{where} must be two finite numbers (low, high), got {value!r}")
            if not lo < hi:
                raise _error(f"{where} needs low < high, got {value!r}")
            return (lo, hi)
        if k == "floats":
            if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
                raise _error(f"{where} must be a list of positive numbers, got {value!r}")
            vals = list(value.tolist() if hasattr(value, "tolist") else value)
            if not vals or any(isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x <= 0
                               for x in vals):
                raise _error(f"{where} must be a non-empty list of positive finite numbers, got {value!r}")
            return tuple(float(x) for x in vals)
        if k == "regexes":
            return check_regexes(where, value if isinstance(value, str) else list(value))
        raise AssertionError(k)


@dataclass(frozen=True)
class CacheMethod:
    """A diffusers cache method as lite_boost offers it."""

    name: str
    diffusers_config: str  # class name in diffusers.hooks
    params: tuple[CacheParam, ...]
    data_dependent: bool  # the skip decision depends on the activations (needs a group-wide statistic)
    per_branch_state: bool  # keeps one state per cache_context ("cond" / "uncond")
    summary: str = ""
    check: Callable[[dict], None] | None = None  # cross-parameter rule

    @property
    def param_names(self) -> list[str]:
        return [p.name for p in self.params]


def _check_mag(params: dict) -> None:
    if params.get("mag_ratios") is None and not params.get("calibrate", False):
        raise _error("cache mag_cache needs mag_ratios (calibrated per model and scheduler) or calibrate=True "
                     "(one uncached run that prints the ratios)")


_F = CacheParam
CACHE_METHODS: dict[str, CacheMethod] = {
    m.name: m
    for m in (
        CacheMethod(
            "first_block_cache", "FirstBlockCacheConfig",
            (_F("threshold", "float", 0.05, lo=0.0, help="skip the other blocks while the first block's residual "
                "changes by less than this (relative L1)"),),
            data_dependent=True, per_branch_state=True,
            summary="First-Block Cache: skip blocks 1..N-1 while block 0's residual barely changes"),
        CacheMethod(
            "mag_cache", "MagCacheConfig",
            (_F("threshold", "float", 0.06, lo=0.0),
             _F("max_skip_steps", "int", 3, lo=0),
             _F("retention_ratio", "float", 0.2, lo=0.0, hi=1.0),
             _F("num_inference_steps", "int", 28, lo=1, help="must equal the pipeline call's steps"),
             _F("mag_ratios", "floats", None, allow_none=True),
             _F("calibrate", "bool", False)),
            data_dependent=False, per_branch_state=True, check=_check_mag,
            summary="MagCache: skip steps while the calibrated magnitude-ratio error stays below threshold"),
        CacheMethod(
            "taylorseer_cache", "TaylorSeerCacheConfig",
            (_F("cache_interval", "int", 5, lo=1),
             _F("disable_cache_before_step", "int", 3, lo=0),
             _F("disable_cache_after_step", "int", None, lo=0, allow_none=True),
             _F("max_order", "int", 1, lo=0),
             _F("taylor_factors_dtype", "choice", "bfloat16", choices=("float32", "bfloat16", "float16")),
             _F("use_lite_mode", "bool", False),
             _F("cache_identifiers", "regexes", None, allow_none=True),
             _F("skip_predict_identifiers", "regexes", None, allow_none=True)),
            data_dependent=False, per_branch_state=True,
            summary="TaylorSeer: full compute every cache_interval steps, Taylor-extrapolated outputs between"),
        CacheMethod(
            "pyramid_attention_broadcast", "PyramidAttentionBroadcastConfig",
            (_F("spatial_attention_block_skip_range", "int", None, lo=1, allow_none=True),
             _F("cross_attention_block_skip_range", "int", None, lo=1, allow_none=True),
             _F("spatial_attention_timestep_skip_range", "pair", (100, 800)),
             _F("cross_attention_timestep_skip_range", "pair", (100, 800))),
            data_dependent=False, per_branch_state=False,
            summary="Pyramid Attention Broadcast: reuse attention outputs inside a timestep range"),
        CacheMethod(
            "sea_cache", "SeaCacheConfig",
            (_F("threshold", "float", 0.25, lo=0.0),
             _F("residual_order", "choice", 1, choices=(0, 1)),
             _F("retention_steps", "int", 1, lo=0),
             _F("cache_end_steps", "int", 1, lo=0),
             _F("max_consecutive_cached", "int", 2, lo=0),
             _F("power_exp", "float", 3.0, lo=0.0, lo_open=True)),
            data_dependent=True, per_branch_state=True,
            summary="SeaCache: skip the block stack while a spectral indicator of the input latents barely changes"),
    )
}


def _unknown_method(method) -> Exception:
    return _error(f"unknown cache method {method!r}; accepted methods: {sorted(CACHE_METHODS)}")


def validate_cache_params(method: str, params: Mapping[str, Any] | None) -> dict[str, Any]:
    """Check ``params`` against ``method``'s accepted parameters; returns the normalised dict.

    Only the parameters given are returned (defaults are filled in later, by the model adapter and
    diffusers), so a config compares equal to another that names the same settings.
    """
    if not isinstance(method, str) or method not in CACHE_METHODS:
        raise _unknown_method(method)
    spec = CACHE_METHODS[method]
    if params is None:
        params = {}
    if not isinstance(params, Mapping):
        raise _error(f"cache params must be a mapping of parameter -> value, got {type(params).__name__}")
    by_name = {p.name: p for p in spec.params}
    unknown = sorted(set(params) - set(by_name))
    if unknown:
        raise _error(f"unknown parameter(s) {unknown} for cache method {method!r}; accepted: "
                     f"{[p.describe() for p in spec.params]}")
    out = {name: by_name[name].check(method, value) for name, value in params.items()}
    if spec.check is not None:
        spec.check(out)
    return out


def _parse_value(text: str):
    t = text.strip()
    low = t.lower()
    if low in ("none", "null"):
        return None
    if low in ("true", "yes", "on"):
        return True
    if low in ("false", "no", "off"):
        return False
    if "/" in t:
        return [_parse_value(x) for x in t.split("/")]
    for conv in (int, float):
        try:
            return conv(t)
        except ValueError:
            pass
    return t


def parse_cache_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """``"METHOD[:PARAM=VALUE,...]"`` -> (method, params). Lists and pairs use ``/``: ``mag_ratios=1/0.98/0.97``."""
    if not isinstance(spec, str) or not spec.strip():
        raise _error(f"cache spec must be 'METHOD[:PARAM=VALUE,...]' with METHOD in {sorted(CACHE_METHODS)}, got {spec!r}")
    method, _, rest = spec.strip().partition(":")
    method = method.strip().replace("-", "_")
    if method not in CACHE_METHODS:
        raise _unknown_method(method)
    params: dict[str, Any] = {}
    for item in filter(None, (x.strip() for x in rest.split(","))):
        name, eq, value = item.partition("=")
        if not eq or not name.strip():
            raise _error(f"cache parameter {item!r} must be PARAM=VALUE; accepted for {method}: "
                         f"{CACHE_METHODS[method].param_names}")
        params[name.strip()] = _parse_value(value)
    return method, params


# ------------------------------------------------------------------------------------ adapters
@dataclass(frozen=True)
class CacheAdapter:
    """What a model family declares about step caching (``ModelFamily(cache=CacheAdapter(...))``).

    methods: the cache methods that work on this model.
    defaults: per-method parameter defaults that replace diffusers' where the model needs it.
    check: optional ``check(model, method, params)`` raising ConfigError for an unsuitable model.
    why_not: method -> reason, for methods that do not work on this model (error messages).
    probe_module: path of a child module that runs once per transformer call before the blocks
        (e.g. the patch embedding): a context-only diffusers hook there learns the current
        ``cache_context`` for methods that keep no per-context state (Pyramid Attention Broadcast).
    refuse_pipelines: pipeline class name -> why no method applies to it (e.g. a pipeline that
        calls the transformer without ``cache_context``, which diffusers' stateful hooks need);
        subclasses included. A bare transformer is not refused.
    timestep_scale: the pipeline's timestep is the transformer's ``timestep`` argument times this
        (Flux pipelines pass t / 1000: 1000); the current timestep Pyramid Attention Broadcast
        compares with its timestep ranges is on the pipeline's scale, as with diffusers alone.
    name_calls: the family's pipelines call the transformer without ``cache_context``, cond then
        uncond (``CfgPlan(by_call_order=True)``): a boosted pipeline names each call ``cond`` /
        ``uncond`` by that order (:func:`lite_boost.adapter.cache.install_call_names`, on the
        instances), as diffusers' Wan pipelines name theirs.
    """

    methods: tuple[str, ...]
    defaults: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    check: Callable[[Any, str, dict], None] | None = None
    why_not: Mapping[str, str] = field(default_factory=dict)
    probe_module: str | None = None
    refuse_pipelines: Mapping[str, str] = field(default_factory=dict)
    timestep_scale: float = 1.0
    name_calls: bool = False


def check_not_cached(model) -> None:
    """ConfigError when ``model`` already has a diffusers cache that lite_boost did not enable."""
    if getattr(model, "_cache_config", None) is not None and getattr(model, "_lite_boost", None) is None:
        raise _error(
            f"{type(model).__name__} already has a diffusers cache enabled ({type(model._cache_config).__name__}); "
            "call transformer.disable_cache() first, or leave BoostConfig.cache unset"
        )


_LOOKUP = object()  # check_cache_support's family argument when the caller has not resolved it


def check_cache_support(target, cache_config, *, cfg_degree: int = 1, family=_LOOKUP) -> CacheAdapter | None:
    """Raise ConfigError unless ``target``'s family supports ``cache_config.method``; returns its adapter.

    ``cfg_degree`` > 1 (CFG parallelism) additionally needs, for a pipeline that makes separate cond and
    uncond calls, a method that keeps one state per branch (each cfg rank runs one of the two calls);
    for a pipeline that batches cond and uncond (CfgPlan kind "batched"; one call per step, its batch
    split over the cfg ranks), a method whose decisions do not depend on the activations (each cfg rank
    holds half of the batch): a state shared by the branches is then fine, as each rank's one call per
    step keeps and reuses its half of what the one-process call does (Pyramid Attention Broadcast
    decides from the timestep and its call counter only). Runs before anything is modified (and, under
    ParallelManager, before any collective). ``family``: the target's family when the caller (the planner)
    has looked it up already (None: a plain boost function), else it is looked up here.
    """
    if cache_config is None:
        return None
    spec = CACHE_METHODS[cache_config.method]
    from .registry import family_of, lookup, names_where

    if family is _LOOKUP:
        family = family_of(lookup(target))
    batched = getattr(getattr(getattr(family, "pipeline", None), "cfg", None), "kind", None) == "batched"
    if cfg_degree > 1 and not spec.per_branch_state and not batched:
        per_branch = sorted(n for n, m in CACHE_METHODS.items() if m.per_branch_state)
        raise _error(f"cache method {spec.name!r} keeps one state shared by the cond and uncond passes, which CFG "
                     f"parallelism runs on different ranks (outputs would differ from one process); with "
                     f"cfg_degree={cfg_degree} use one of {per_branch}")
    adapter = getattr(family, "cache", None)
    if not isinstance(adapter, CacheAdapter):
        with_cache = names_where(lambda f: isinstance(getattr(f, "cache", None), CacheAdapter))
        raise _error(f"step caching was requested but {type(target).__name__} has no cache adapter; models with one: "
                     f"{with_cache}. Declare ModelFamily(cache=CacheAdapter(...)) in its adapter.")
    method = cache_config.method
    refused = next((c.__name__ for c in type(target).__mro__ if c.__name__ in adapter.refuse_pipelines), None)
    if refused is not None:
        others = [p for p in getattr(family, "pipelines", ()) if p not in adapter.refuse_pipelines]
        raise _error(f"step caching (cache method {method!r}) is not supported for {type(target).__name__} "
                     f"({adapter.refuse_pipelines[refused]}); pipelines of its family with step caching: {others}")
    if method not in adapter.methods:
        why = adapter.why_not.get(method)
        raise _error(f"cache method {method!r} is not supported for {type(target).__name__}"
                     f"{' (' + why + ')' if why else ''}; supported: {list(adapter.methods)}")
    if cfg_degree > 1 and spec.data_dependent and batched:
        fixed = [n for n in adapter.methods if not CACHE_METHODS[n].data_dependent]
        raise _error(f"cache method {method!r} decides from the activations of the whole batch, and "
                     f"{type(target).__name__} batches cond and uncond, which CFG parallelism splits over the cfg "
                     f"ranks (each would decide on its half, unlike one process); with cfg_degree={cfg_degree} use "
                     f"one of {fixed}")
    for model in family.transformers_of(target):
        check_not_cached(model)
        if adapter.check is not None:
            adapter.check(model, method, dict(cache_config.params))
    return adapter


def build_diffusers_config(method: str, params: Mapping[str, Any], *, defaults: Mapping[str, Any] | None = None,
                           current_timestep_callback: Callable[[], float] | None = None):
    """The diffusers config object for ``method`` (adapter defaults, then the user's parameters)."""
    import torch
    import diffusers.hooks as hooks

    spec = CACHE_METHODS[method]
    kwargs = {**dict(defaults or {}), **dict(params)}
    if method == "taylorseer_cache" and "taylor_factors_dtype" in kwargs:
        kwargs["taylor_factors_dtype"] = getattr(torch, kwargs["taylor_factors_dtype"])
    for name in ("cache_identifiers", "skip_predict_identifiers"):
        if kwargs.get(name) is not None:
            kwargs[name] = list(kwargs[name])
    if method == "mag_cache" and kwargs.get("mag_ratios") is not None:
        kwargs["mag_ratios"] = list(kwargs["mag_ratios"])
    if method == "pyramid_attention_broadcast":
        if kwargs.get("spatial_attention_block_skip_range") is None and kwargs.get("cross_attention_block_skip_range") is None:
            kwargs["spatial_attention_block_skip_range"] = 2  # what diffusers falls back to (with a warning)
        kwargs["current_timestep_callback"] = current_timestep_callback
    return getattr(hooks, spec.diffusers_config)(**kwargs)


# ------------------------------------------------------------------------------------ runtime
def _first_block_hook_class():
    from diffusers.hooks.first_block_cache import FBCHeadBlockHook

    return FBCHeadBlockHook


def iter_diffusers_hooks(model):
    """(module name, hook name, hook) of every diffusers hook registered in ``model``'s tree."""
    for name, module in model.named_modules():
        registry = getattr(module, "_diffusers_hook", None)
        if registry is None:
            continue
        for hook_name in list(registry._hook_order):
            yield name, hook_name, registry.hooks[hook_name]


class CacheCollectiveError(RuntimeError):
    """A collective of a rank-consistent cache decision failed or timed out (names it and the group)."""


def gather_named(comm, out, inp, op: str, what: str):
    """``comm.all_gather_into`` whose failure (a dead peer, the group's timeout) names the collective."""
    import time

    t0 = time.monotonic()
    try:
        return comm.all_gather_into(out, inp, op=op)
    except Exception as exc:  # noqa: BLE001 - re-raised with context
        raise CacheCollectiveError(
            f"all_gather '{op}' of the {what} failed in the sequence group (size {comm.size}, this rank "
            f"{comm.rank}) after {time.monotonic() - t0:.1f}s: {exc}"
        ) from exc


@dataclass
class CacheDecision:
    """One data-dependent decision: which branch, which call of it, the statistic, compute or reuse."""

    context: str | None
    call: int
    statistic: float | None
    compute: bool


class FirstBlockDecision:
    """Replacement of a First-Block-Cache head hook's ``_should_compute_remaining_blocks`` (per instance).

    Single process (``comm`` None or of size 1): calls diffusers' own test and records it. With a
    sequence-parallel communicator: the statistic ``mean|r - r_prev| / mean|r_prev|`` is computed from
    per-rank sums over the real (unpadded) tokens of each shard, gathered over the group and summed
    in rank order, so every rank takes the same decision, equal to the single-process one up to
    floating-point reassociation. Padding rows never enter the sums.
    """

    def __init__(self, hook, log: list, comm=None, info=None, seq_dim: int = 1):
        self.hook = hook
        self.original = hook.__dict__.get("_should_compute_remaining_blocks")
        self.bound = type(hook)._should_compute_remaining_blocks.__get__(hook)
        self.log = log
        self.comm = comm
        self.info = info
        self.seq_dim = seq_dim
        self.calls: dict = {}

    def _context(self):
        ctx = self.hook.state_manager._context
        return None if ctx is None else ctx.name

    def _real(self, x):
        info = self.info
        if info is None or info.seq_len is None or self.comm is None:
            return x
        n = x.shape[self.seq_dim]
        real = max(0, min(n, info.seq_len - self.comm.rank * info.shard_len))
        return x if real == n else x.narrow(self.seq_dim, 0, real)

    def __call__(self, residual):
        import torch

        name = self._context()
        call = self.calls.get(name, 0)
        self.calls[name] = call + 1
        if self.comm is None or self.comm.size == 1:
            compute = self.bound(residual)  # diffusers' own test
            prev = self.hook.state_manager.get_state().head_block_residual
            stat = None if prev is None else float((residual - prev).abs().mean() / prev.abs().mean())
            self.log.append(CacheDecision(name, call, stat, bool(compute)))
            return compute
        state = self.hook.state_manager.get_state()
        prev = state.head_block_residual
        if prev is None:  # first call of this branch: identical on every rank, no collective needed
            self.log.append(CacheDecision(name, call, None, True))
            return True
        cur, prev = self._real(residual), self._real(prev)
        local = torch.stack([(cur - prev).abs().sum(dtype=torch.float64), prev.abs().sum(dtype=torch.float64)])
        everyone = local.new_empty((self.comm.size, 2))
        gather_named(self.comm, everyone, local.reshape(1, 2), "cache_decision",
                     f"First-Block-Cache statistic ({name!r} branch, call {call})")
        num = den = 0.0
        for r in range(self.comm.size):  # fixed order: bit-identical on every rank
            num += float(everyone[r, 0])
            den += float(everyone[r, 1])
        stat = num / den if den > 0 else math.inf
        compute = stat > self.hook.threshold
        self.log.append(CacheDecision(name, call, stat, compute))
        return compute


def step_count_problem(method: str, cfg, steps: int, timesteps=None) -> tuple[str | None, bool]:
    """Why diffusers' cache hook ``cfg`` (the config object the model runs, e.g. ``model._cache_config``) of
    ``method`` would skip nothing in a run of ``steps`` denoising steps (``timesteps``: the scheduler's, for the
    timestep-ranged methods), or would compute wrong results; returns (reason or None, wrong: True when the run
    would compute wrongly rather than just unaccelerated)."""
    get = functools.partial(getattr, cfg)
    where = f"cache {method}"
    if method == "mag_cache" and not get("calibrate", False) and get("num_inference_steps", steps) != steps:
        return (f"{where}: num_inference_steps={get('num_inference_steps')} but this run has {steps} steps (MagCache "
                f"indexes its mag_ratios by step and restarts after num_inference_steps); pass "
                f"num_inference_steps={steps} with mag_ratios calibrated for {steps} steps "
                f"(CacheConfig(method='mag_cache', params={{'calibrate': True, 'num_inference_steps': {steps}}}) "
                "prints them)"), True
    if steps < 2:
        return f"{where}: a run of {steps} step computes every step (a cache reuses an earlier step's work)", False
    if method == "mag_cache" and not get("calibrate", False):
        keep = int(get("retention_ratio", 0.2) * steps + 0.5)
        if max(keep, 1) >= steps:
            return (f"{where}: retention_ratio={get('retention_ratio')} keeps the first {keep} of {steps} steps "
                    "uncached, so nothing is skipped; lower retention_ratio"), False
    if method == "taylorseer_cache":
        before, interval, after = get("disable_cache_before_step", 3), get("cache_interval", 5), \
            get("disable_cache_after_step", None)
        end = steps if after is None else min(steps, after)
        if interval < 2 or before >= end:
            return (f"{where}: with disable_cache_before_step={before}, cache_interval={interval}, "
                    f"disable_cache_after_step={after} every one of the {steps} steps is computed, nothing is "
                    f"predicted; lower disable_cache_before_step below {end} (and cache_interval >= 2)"), False
    if method == "sea_cache":
        first, end = max(get("retention_steps", 1), 1), steps - get("cache_end_steps", 1)
        if first >= end:
            return (f"{where}: retention_steps={get('retention_steps')} and cache_end_steps={get('cache_end_steps')} "
                    f"leave no step of {steps} that may be cached; lower them"), False
    if method == "pyramid_attention_broadcast" and timesteps is not None:
        ranges = [(k, r) for k in ("spatial", "temporal", "cross")
                  if get(f"{k}_attention_block_skip_range", None) not in (None, 1)
                  and (r := get(f"{k}_attention_timestep_skip_range", None)) is not None]
        later = [float(t) for t in list(timesteps)[1:]]  # the first call always computes
        if not any(lo < t < hi for _, (lo, hi) in ranges for t in later):
            shown = ", ".join(f"{t:.0f}" for t in later)
            return (f"{where}: none of this run's timesteps after the first ({shown}) lies in a "
                    f"*_attention_timestep_skip_range with a block skip range >= 2 "
                    f"({', '.join(f'{k}: {r}' for k, r in ranges) or 'none set'}), so no attention output is reused; "
                    "widen the timestep ranges for a few-step schedule"), False
    return None, False


def _wrap_decision(fn):
    import torch

    return torch.compiler.disable(fn)


def mag_calibration_spec(ratios_by_branch: Mapping[str | None, list[float]], steps: int) -> str:
    """The ``mag_cache`` spec to paste (``--cache`` / ``{"cache": ...}``) from calibrated ratios of each CFG branch:
    MagCacheConfig takes one list for every branch, so the branches' ratios are averaged step by step."""
    lists = [list(r) for r in ratios_by_branch.values() if r]
    n = min(len(r) for r in lists)
    mean = [sum(r[i] for r in lists) / len(lists) for i in range(n)]
    return f"mag_cache:num_inference_steps={steps},mag_ratios=" + "/".join(f"{x:.4f}".rstrip("0").rstrip(".")
                                                                         for x in mean)


class MagCalibration:
    """Replacement of a MagCache tail hook's ``_advance_step`` in calibration mode (per instance).

    diffusers prints each branch's ratio list at the end of a calibrated run (two lists with CFG, neither
    usable as typed). This keeps diffusers' step logic, takes each branch's ratios before diffusers resets
    them, and prints ONE line once every branch has finished: the ``mag_cache`` spec to paste.
    ``spec`` holds the last such line's spec (None before the first calibrated run ends).
    """

    def __init__(self, hook):
        self.hook = hook
        self.original = type(hook)._advance_step.__get__(hook)
        self.done: dict = {}
        self.spec: str | None = None

    def __call__(self, state):
        import contextlib
        import io

        cfg = self.hook.config
        if not cfg.calibrate or state.step_index + 1 < cfg.num_inference_steps:
            return self.original(state)
        ctx = self.hook.state_manager._context
        self.done[None if ctx is None else ctx.name] = list(state.calibration_ratios)
        with contextlib.redirect_stdout(io.StringIO()):  # diffusers' own two-line print per branch
            out = self.original(state)
        if len(self.done) >= len(self.hook.state_manager._state_cache):
            self.spec = mag_calibration_spec(self.done, cfg.num_inference_steps)
            branches = [n for n in self.done if n is not None]
            print(f"MagCache calibrated over {cfg.num_inference_steps} steps"
                  + (f" (mean of the {' / '.join(branches)} branches)" if len(branches) > 1 else "")
                  + f"; paste: {self.spec}", flush=True)
            self.done = {}
        return out


_PROBE_HOOK = "lite_boost_cache_context"


class _ContextProbe:
    """A diffusers hook that does nothing but receive the ``cache_context`` diffusers sets."""

    _is_stateful = True

    def __new__(cls):
        from diffusers.hooks.hooks import BaseState, ModelHook, StateManager

        class _NoState(BaseState):
            def reset(self, *args, **kwargs):
                pass

        class ContextProbe(ModelHook):
            _is_stateful = True

            def __init__(self):
                super().__init__()
                self.state_manager = StateManager(_NoState)

            def reset_state(self, module):  # keep the context: a reset happens inside a call
                return module

        return ContextProbe()


class CacheRuntime:
    """What lite_boost attaches to one cached transformer (kept in its boost state).

    * a forward pre-hook (registered at boost time, so it runs before any sequence-parallel split)
      that records the current timestep and starts a fresh cache state at the first call of every
      new generation (a branch's ``step_index`` or timestep not decreasing = new pipeline call);
    * the decision log of data-dependent methods (``decisions``);
    * ``current_timestep()`` for Pyramid Attention Broadcast.
    """

    def __init__(self, model, method: str, probe_module=None, timestep_scale: float = 1.0):
        self.model = model
        self.method = method
        self.timestep_scale = float(timestep_scale)  # transformer timestep argument -> the pipeline's timestep
        # a child module where a context-only diffusers hook learns the current cache_context (some
        # methods, e.g. Pyramid Attention Broadcast, keep no per-context state to read it from)
        self.probe_module = probe_module
        self.timestep: float | None = None
        self.decisions: list[CacheDecision] = []
        self.generations = 0
        self._last: dict = {}
        self._handle = None
        self.decision_makers: list[FirstBlockDecision] = []
        self.mag_calibration: MagCalibration | None = None  # MagCache with calibrate=True
        self._probe = None

    # -- lifecycle
    def attach(self) -> "CacheRuntime":
        from diffusers.hooks.hooks import HookRegistry

        if self.probe_module is not None:
            self._probe = _ContextProbe()
            HookRegistry.check_if_exists_or_initialize(self.probe_module).register_hook(self._probe, _PROBE_HOOK)
            HookRegistry.check_if_exists_or_initialize(self.model).invalidate_child_registries_cache()
        pre = _wrap_decision(self._pre_forward)
        self._handle = self.model.register_forward_pre_hook(pre, with_kwargs=True)
        cls = _first_block_hook_class()
        for _, _, hook in iter_diffusers_hooks(self.model):
            if isinstance(hook, cls):
                dec = FirstBlockDecision(hook, self.decisions)
                hook._should_compute_remaining_blocks = _wrap_decision(dec)
                self.decision_makers.append(dec)
            elif getattr(hook, "is_tail", False) and getattr(getattr(hook, "config", None), "calibrate", False) \
                    and type(hook).__name__ == "MagCacheBlockHook":
                self.mag_calibration = MagCalibration(hook)
                hook._advance_step = self.mag_calibration
        return self

    def detach(self) -> None:
        from diffusers.hooks.hooks import HookRegistry

        if self._probe is not None:
            HookRegistry.check_if_exists_or_initialize(self.probe_module).remove_hook(_PROBE_HOOK, recurse=False)
            HookRegistry.check_if_exists_or_initialize(self.model).invalidate_child_registries_cache()
            self._probe = None
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        for dec in self.decision_makers:
            dec.hook.__dict__.pop("_should_compute_remaining_blocks", None)
        self.decision_makers.clear()
        if self.mag_calibration is not None:
            self.mag_calibration.hook.__dict__.pop("_advance_step", None)
            self.mag_calibration = None

    @property
    def first_block_decisions(self) -> list[FirstBlockDecision]:
        return list(self.decision_makers)

    def current_timestep(self) -> float:
        if self.timestep is None:
            raise RuntimeError("no transformer call seen yet: the current timestep is unknown")
        return self.timestep

    # -- per call
    def _context(self):
        if self._probe is not None:
            return self._probe.state_manager._context
        for _, _, hook in iter_diffusers_hooks(self.model):
            sm = getattr(hook, "state_manager", None)
            if sm is not None and getattr(sm, "_context", None) is not None:
                return sm._context
        return None

    def _pre_forward(self, module, args, kwargs):
        import torch

        t = kwargs.get("timestep", args[1] if len(args) > 1 else None)
        if isinstance(t, torch.Tensor):
            t = float(t.detach().max()) if t.numel() else 0.0
        self.timestep = None if t is None else float(t) * self.timestep_scale
        ctx = self._context()
        key = None if ctx is None else ctx.name
        step = None if ctx is None else ctx.step_index
        # Within one generation a branch sees strictly increasing step indices (strictly decreasing
        # timesteps when the pipeline gives no step index); anything else starts a new generation.
        pos = ("step", int(step)) if step is not None else ("t", -(self.timestep or 0.0))
        last = self._last.get(key)
        if last is not None and last[0] == pos[0] and pos[1] <= last[1]:
            self._new_generation(ctx)
        self._last[key] = pos
        return None

    def _new_generation(self, ctx) -> None:
        from diffusers.hooks.hooks import HookRegistry, _set_cache_context

        HookRegistry.check_if_exists_or_initialize(self.model).reset_stateful_hooks(recurse=True)
        if ctx is not None:
            _set_cache_context(self.model, ctx)  # reset clears the context diffusers set for this call
        self._last.clear()
        for dec in self.decision_makers:
            dec.calls.clear()
        self.generations += 1

    def reset_log(self) -> None:
        self.decisions.clear()


# ------------------------------------------------------------------------------------ counters
class count_block_work:
    """Context manager counting how much transformer work really ran (for reports, not for speed).

    Counts transformer calls, computed feed-forwards of the last block and computed self-attentions
    (a cache that skips blocks, or predicts / reuses module outputs, lowers the latter two).
    ``blocks``: the attribute holding the block list; ``ffn`` / ``attn``: child names in a block.
    """

    def __init__(self, models, blocks: str = "blocks", ffn: str = "ffn", attn: str = "attn1"):
        self.models = [m for m in models if m is not None]
        self.blocks, self.ffn, self.attn = blocks, ffn, attn
        self.calls = self.ffn_runs = self.attn_runs = 0
        self.attn_total_per_call = 0
        self._handles = []

    @staticmethod
    def _leaf(module):
        # the first leaf module inside: it runs only when the module really computes (a cache hook
        # that replaces the module's forward still triggers hooks on the module itself)
        return next((m for m in module.modules() if not list(m.children())), module)

    def __enter__(self):
        for m in self.models:
            blocks = getattr(m, self.blocks)
            self._handles.append(m.register_forward_pre_hook(lambda *a: self._bump("calls")))
            ffn = self._leaf(getattr(blocks[-1], self.ffn))
            self._handles.append(ffn.register_forward_pre_hook(lambda *a: self._bump("ffn_runs")))
            for b in blocks:
                attn = self._leaf(getattr(b, self.attn))
                self._handles.append(attn.register_forward_pre_hook(lambda *a: self._bump("attn_runs")))
            self.attn_total_per_call = len(blocks)
        return self

    def _bump(self, name):
        setattr(self, name, getattr(self, name) + 1)

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def summary(self) -> str:
        full = self.ffn_runs
        return (f"{self.calls - full} of {self.calls} transformer calls reused cached blocks; "
                f"self-attention computed {self.attn_runs} of {self.calls * self.attn_total_per_call} times")
