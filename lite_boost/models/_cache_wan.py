"""Step caching for Wan: which of diffusers' cache hooks apply, Wan's defaults, install / uninstall.

``install_cache(transformer, state)`` turns ``state.config.cache`` into diffusers' config object and
calls ``transformer.enable_cache(...)`` (diffusers' own hooks, on this instance), then attaches a
:class:`~lite_boost.cache.CacheRuntime` (fresh cache state per pipeline call, decision log, current
timestep for Pyramid Attention Broadcast). ``uninstall_cache`` removes both.

Why these methods and defaults on Wan:

* FasterCache is not offered: it approximates the unconditional branch from a batch that holds
  both branches, and Wan's pipelines call the transformer once per branch (batch 1 each).
* TaylorSeer's default module patterns (``^blocks.*attn``) match no Wan module (Wan names them
  ``attn1`` / ``attn2``); the Wan default predicts each block's self-attention, cross-attention and
  feed-forward outputs instead (``^blocks\\.\\d+\\.(attn1|attn2|ffn)$``).
* SeaCache builds its indicator from text-to-video latents (``in_channels == out_channels``); on
  image-to-video Wan it would silently run uncached, so it is refused there.
"""

from __future__ import annotations

from ..cache import CacheAdapter, CacheRuntime, build_diffusers_config
from ..config import ConfigError

__all__ = ["WAN_CACHE_ADAPTER", "install_cache", "uninstall_cache"]

_KEY = "cache"


def _check(model, method: str, params: dict) -> None:
    cfg = getattr(model, "config", None)
    if method == "sea_cache" and cfg is not None and cfg.in_channels != cfg.out_channels:
        raise ConfigError(
            f"cache method 'sea_cache' needs a text-to-video Wan transformer (in_channels == out_channels), got "
            f"in_channels={cfg.in_channels}, out_channels={cfg.out_channels}; use first_block_cache, mag_cache, "
            "taylorseer_cache or pyramid_attention_broadcast for image-to-video"
        )
    if getattr(model, "_cache_config", None) is not None and getattr(model, "_lite_boost", None) is None:
        raise ConfigError(
            f"{type(model).__name__} already has a diffusers cache enabled ({type(model._cache_config).__name__}); "
            "call transformer.disable_cache() first, or leave BoostConfig.cache unset"
        )


WAN_CACHE_ADAPTER = CacheAdapter(
    methods=("first_block_cache", "mag_cache", "taylorseer_cache", "pyramid_attention_broadcast", "sea_cache"),
    defaults={"taylorseer_cache": {"cache_identifiers": (r"^blocks\.\d+\.(attn1|attn2|ffn)$",)}},
    check=_check,
    why_not={"faster_cache": "it needs cond and uncond batched into one transformer call; Wan calls them separately"},
)


def install_cache(transformer, state) -> None:
    """Enable ``state.config.cache`` (if any) on ``transformer`` with diffusers' hooks."""
    cfg = state.config.cache
    if cfg is None:
        return
    _check(transformer, cfg.method, dict(cfg.params))
    runtime = CacheRuntime(transformer, cfg.method, probe_module=transformer.patch_embedding)
    dcfg = build_diffusers_config(cfg.method, cfg.params, defaults=WAN_CACHE_ADAPTER.defaults.get(cfg.method),
                                  current_timestep_callback=runtime.current_timestep)
    transformer.enable_cache(dcfg)
    try:
        runtime.attach()
    except Exception:
        transformer.disable_cache()
        raise
    state.extras[_KEY] = runtime


def uninstall_cache(transformer, state) -> None:
    runtime = state.extras.pop(_KEY, None)
    if runtime is None:
        return
    runtime.detach()
    if getattr(transformer, "_cache_config", None) is not None:
        transformer.disable_cache()


def cache_runtime(transformer) -> CacheRuntime | None:
    """The CacheRuntime of a boosted, cached transformer (or None)."""
    state = getattr(transformer, "_lite_boost", None)
    extras = getattr(state, "extras", None)
    return extras.get(_KEY) if isinstance(extras, dict) else None
