"""The ControlNet model of a diffusers ControlNet pipeline (FluxControlNetPipeline, QwenImageControlNetPipeline, ...).

A ControlNet is a second transformer (the first blocks of the base model's architecture, with a zero-initialised
projection per block) whose per-block residuals the pipeline hands to the transformer. Its attention goes through
diffusers' dispatcher like the transformer's, so :func:`boost_controlnets` boosts it on the generic path with the
pipeline's attention settings only (``attention_backend``, ``attention``): dense attention through lite_boost's
dispatch, equal to stock. Sparse attention, step caches and quantization stay on the transformers (a ControlNet's
blocks are not the denoiser's: a step cache would skip the wrong work). A ControlNet the generic path cannot take
(attention outside diffusers' dispatcher) runs stock, and so does one sharing modules with the transformer. Under ``ParallelManager`` each rank runs the ControlNet
on the whole sequence; the transformer's sharding plan splits its residuals with the image tokens.
"""

from __future__ import annotations

from ..config import BoostConfig

__all__ = ["CONTROLNET_ATTRS", "controlnet_config", "pipeline_controlnets", "boost_controlnets",
           "unboost_controlnets"]

CONTROLNET_ATTRS = ("controlnet",)  # where diffusers' ControlNet pipelines keep the model (or its Multi wrapper)


def controlnet_config(config: BoostConfig) -> BoostConfig:
    """What a ControlNet takes of the pipeline's config: the attention settings."""
    return BoostConfig(attention_backend=config.attention_backend, rope_cache_size=config.rope_cache_size,
                       attention=config.attention)


def pipeline_controlnets(pipe) -> list[tuple[str, object]]:
    """(attribute, model) of the ControlNet models a pipeline holds (diffusers ``ModelMixin`` instances)."""
    from diffusers import ModelMixin

    return [(a, m) for a in CONTROLNET_ATTRS if isinstance(m := getattr(pipe, a, None), ModelMixin)]


def _boost_fn(model):
    from ..registry import UnsupportedModelError, lookup

    try:
        return lookup(model)
    except UnsupportedModelError:
        return None  # attention outside diffusers' dispatcher: the ControlNet runs stock


def _shares_modules(model, transformers) -> bool:
    theirs = {id(m) for t in transformers for m in t.modules()}
    return any(id(m) in theirs for m in model.modules())


def boost_controlnets(pipe, config: BoostConfig, transformers=()) -> list:
    """Boost the pipeline's ControlNet model(s) with ``controlnet_config(config)``; returns those boosted.

    A ControlNet that shares modules with one of ``transformers`` (Z-Image's ControlNet reuses the transformer's
    refiner blocks) is left as it is: the shared attention layers run the transformer's boost already, and a
    second boost would take them away from it."""
    cfg = controlnet_config(config)
    done = []
    try:
        for _, model in pipeline_controlnets(pipe):
            fn = _boost_fn(model)
            if fn is not None and _shares_modules(model, transformers):
                continue
            if fn is not None:
                fn(model, cfg)
                done.append(model)
    except BaseException:
        for model in done:
            _boost_fn(model).unboost(model)
        raise
    return done


def unboost_controlnets(pipe) -> None:
    for _, model in pipeline_controlnets(pipe):
        if getattr(model, "_lite_boost", None) is not None:
            _boost_fn(model).unboost(model)
