"""diffusers' loaders and processor swaps on a boosted model: what keeps working, what is refused.

LoRA layers (peft, through ``load_lora_weights`` / ``load_lora_adapter``) wrap a model's Linear layers and
leave its attention processors alone, so they work on a boosted model as on a stock one, loaded before or
after boosting: the family processors and the generic path call the projection modules, whichever layer
sits there. ``set_adapters``, ``fuse_lora`` / ``unfuse_lora``, ``unload_lora_weights`` likewise. What
cannot work is refused here, on the boosted instance, before anything changes, with a :class:`LoaderError`
naming the boost option and what to do:

* ``fuse_lora`` / ``unfuse_lora`` with ``BoostConfig.quant``: fusing adds the LoRA delta to a weight that
  is now an int8 / fp8 tensor (peft cannot re-quantize lite_boost's weights). Fuse before boosting, or
  unboost, fuse, boost again. Unfused LoRA layers on quantized base layers run (full-precision LoRA
  branch over the quantized base).
* a processor swap (``set_attn_processor``, ``set_default_attn_processor``, an IP-Adapter's
  ``_load_ip_adapter_weights``, a ``fuse_qkv_projections`` that ends in ``set_attn_processor``, as CogVideoX's
  does: refused before the projections are fused) on a model boosted by a named family: its attention runs
  lite_boost's processor shims, which a swap would drop silently (and unboost would then drop the user's processors).
  On the generic path the swap is taken: the new processors go through lite_boost's attention backend
  as the old ones did (diffusers' processors keep doing the projections, norms and RoPE). An IP-Adapter
  loaded *before* boosting is taken that way: the generic path claims a model whose processors carry weights
  (``lite_boost.registry`` ``takes_over``), so Flux with an IP-Adapter is boosted generically. One attention
  module's own ``set_processor`` is not guarded (diffusers' tests and Flux2KleinKVPipeline call it): that layer
  then runs the processor it was given, unboosted (Flux.2 hands such layers diffusers' own RoPE tables).
* ``load_lora_weights`` / ``load_lora_adapter`` / ``fuse_lora`` on a model whose weights ParallelManager split
  (tensor parallelism, FSDP2): the LoRA's layers are made for whole weights. Load LoRAs before ParallelManager.
* ``set_attention_backend`` / ``reset_attention_backend``: lite_boost chose the backend
  (``BoostConfig.attention_backend``); a second choice would silently switch lite_boost off (generic path) or
  be ignored (family processors).

The guards are instance attributes of the boosted model (and pipeline), removed by ``unboost``; diffusers'
classes are untouched.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from ..errors import LoaderError

__all__ = ["AFTER_SWAP_KEY", "LoaderError", "install_loader_guards", "uninstall_loader_guards", "install_pipeline_guards",
           "uninstall_pipeline_guards"]

GUARDS_KEY = "loader_guards"
AFTER_SWAP_KEY = "after_processor_swap"  # state.extras: fn(model, state) run after a processor swap was taken
_PIPELINE_TRANSFORMERS = ("transformer", "transformer_2")
_MODEL_METHODS = ("load_lora_adapter", "fuse_lora", "unfuse_lora", "set_attn_processor", "set_attention_backend",
                  "reset_attention_backend", "_load_ip_adapter_weights", "fuse_qkv_projections")
_PIPELINE_METHODS = ("load_lora_weights", "fuse_lora", "unfuse_lora", "load_ip_adapter")


def _state(model):
    return getattr(model, "_lite_boost", None)


def _who(model, state) -> str:
    family = getattr(state.family, "name", "?")
    path = "the generic path" if family == "generic" else f"the {family} family"
    return f"{type(model).__name__} is boosted by lite_boost ({path})"


def _sharded(state) -> bool:
    """Whether ParallelManager split this model's weights (tensor parallelism / FSDP2: ``extras['parallel']``)."""
    return bool(getattr(state.extras.get("parallel"), "weights", None))


def _check_sharded(model, what: str) -> None:
    state = _state(model)
    if state is None or not _sharded(state):
        return
    raise LoaderError(
        f"{what} on {type(model).__name__}: ParallelManager split its weights over the ranks "
        "(parallel.tp_degree / parallel.fsdp_degree), and a LoRA's layers are made for the whole weights. Load "
        "(and, for tensor parallelism, fuse and unload) LoRAs before ParallelManager, or call "
        "lite_boost.parallel.unparallelize(pipe) first (a collective: on every rank)")


def _check_fuse(model, what: str) -> None:
    _check_sharded(model, what)
    state = _state(model)
    if state is None or state.config.quant is None:
        return
    raise LoaderError(
        f"{what} on {type(model).__name__}: its Linear layers are quantized by lite_boost "
        f"(BoostConfig.quant={state.config.quant.method!r}), and a LoRA cannot be fused into (or out of) a "
        "quantized weight. Unfused LoRA layers do run on the quantized model. To fuse: fuse before boosting "
        "(pipe.load_lora_weights(...); pipe.fuse_lora(); pipe.unload_lora_weights(); then lite_boost.boost(pipe, "
        "config)), or call lite_boost.unboost(pipe) first, fuse / unfuse, and boost again")


def _is_family(state) -> bool:
    return getattr(state.family, "name", None) != "generic"


def _check_processor_swap(model, what: str) -> None:
    state = _state(model)
    if state is None or not _is_family(state):
        return
    raise LoaderError(
        f"{what}: {_who(model, state)}, whose attention runs lite_boost's processors; replacing them would "
        "switch lite_boost off in those layers without a word (and unboost would then drop your processors). "
        "Call lite_boost.unboost(...) first and set the processors on the stock model")


def _check_ip_adapter(model, what: str) -> None:
    state = _state(model)
    if state is None or not _is_family(state):
        return
    raise LoaderError(
        f"{what}: {_who(model, state)}, whose attention runs lite_boost's processors, and an IP-Adapter's "
        "processors carry weights of their own (image key / value projections) that those do not reproduce. Load "
        "the IP-Adapter before boosting: lite_boost then boosts the model on its generic path (diffusers' "
        "IP-Adapter processors, their attention through lite_boost's backend), equal to stock. Or call "
        "lite_boost.unboost(pipe), load the IP-Adapter and boost again")


@functools.lru_cache(maxsize=None)
def _fuse_swaps_processors(cls: type) -> bool:
    """Whether ``cls.fuse_qkv_projections`` ends in a processor swap (CogVideoX and other older models fuse the
    projections, then ``set_attn_processor`` diffusers' fused processors; newer ones only fuse the projections)."""
    import inspect

    try:
        return "set_attn_processor(" in inspect.getsource(cls.fuse_qkv_projections)
    except (OSError, TypeError):
        return False


def _check_fuse_qkv(model, what: str) -> None:
    """Refuse, before the projections are fused, a fusion whose last step is a refused processor swap."""
    state = _state(model)
    if state is not None and _is_family(state) and _fuse_swaps_processors(type(model)):
        _check_processor_swap(model, f"{what} (which swaps in diffusers' fused attention processors)")


def _call(model, name, prior, args, kwargs):
    if prior is not None:
        return prior(*args, **kwargs)
    return getattr(type(model), name)(model, *args, **kwargs)


def _guarded(method: str, check: Callable[[Any, str], None], what: str | None = None):
    """The guard of ``method``: ``check(model, what)`` (raises before anything changes), then the method."""
    def guard(model, prior, *args, **kwargs):
        check(model, what or method)
        return _call(model, method, prior, args, kwargs)
    return guard


def _check_processor_count(model, processor) -> None:
    """A dict of processors must name every attention layer: the bad argument is reported before any refusal."""
    if not isinstance(processor, dict):
        return
    layers = len(model.attn_processors)
    if len(processor) != layers:
        raise ValueError(f"set_attn_processor: the number of processors in the dict ({len(processor)}) does not match "
                         f"the number of attention layers of {type(model).__name__} ({layers}); pass one processor "
                         "per layer (the keys of model.attn_processors) or a single processor for all of them")


def _set_attn_processor(model, prior, *args, **kwargs):
    if args or "processor" in kwargs:
        _check_processor_count(model, args[0] if args else kwargs["processor"])
    _check_processor_swap(model, "set_attn_processor")
    out = _call(model, "set_attn_processor", prior, args, kwargs)
    state = _state(model)
    after = state.extras.get(AFTER_SWAP_KEY) if state is not None else None
    if after is not None:  # the generic path: the new processors go through lite_boost's backend too
        after(model, state)
    return out


def _check_backend_switch(model, what: str) -> None:
    state = _state(model)
    if state is not None:
        raise LoaderError(
            f"{what}: {_who(model, state)}, which chose the attention backend itself "
            f"(BoostConfig.attention_backend={state.config.attention_backend!r}). Boost with "
            "attention_backend=... to pick lite_boost's backend, or call lite_boost.unboost(...) first to use one of "
            "diffusers' backends")


_GUARDS = {"load_lora_adapter": _guarded("load_lora_adapter", _check_sharded),
           "fuse_lora": _guarded("fuse_lora", _check_fuse), "unfuse_lora": _guarded("unfuse_lora", _check_fuse),
           "set_attn_processor": _set_attn_processor,
           "set_attention_backend": _guarded("set_attention_backend", _check_backend_switch),
           "reset_attention_backend": _guarded("reset_attention_backend", _check_backend_switch),
           "_load_ip_adapter_weights": _guarded("_load_ip_adapter_weights", _check_ip_adapter, "load_ip_adapter"),
           "fuse_qkv_projections": _guarded("fuse_qkv_projections", _check_fuse_qkv)}


def _install(obj, names, guards, store: dict) -> None:
    for name in names:
        if not callable(getattr(type(obj), name, None)):
            continue
        had_prior = name in obj.__dict__
        prior = obj.__dict__.get(name)
        guard = functools.partial(guards[name], obj, prior)
        obj.__dict__[name] = guard
        store[name] = (guard, had_prior, prior)


def _uninstall(obj, store: dict) -> None:
    for name, (guard, had_prior, prior) in store.items():
        if obj.__dict__.get(name) is guard:
            del obj.__dict__[name]
            if had_prior:
                obj.__dict__[name] = prior
    store.clear()


def install_loader_guards(model, state) -> None:
    """Put the guards on a boosted model (instance attributes; ``state.extras`` keeps what to remove)."""
    store: dict = {}
    _install(model, _MODEL_METHODS, _GUARDS, store)
    state.extras[GUARDS_KEY] = store


def uninstall_loader_guards(model, state) -> None:
    _uninstall(model, state.extras.pop(GUARDS_KEY, {}))


# ------------------------------------------------------------------------------------------ pipelines
def _pipe_models(pipe):
    return [m for a in _PIPELINE_TRANSFORMERS if (m := getattr(pipe, a, None)) is not None and _state(m) is not None]


def _pipe_load_lora(pipe, prior, *args, **kwargs):
    for m in _pipe_models(pipe):  # before any component (e.g. a text encoder) takes the LoRA
        _check_sharded(m, "load_lora_weights")
    return _call(pipe, "load_lora_weights", prior, args, kwargs)


def _pipe_fuse(pipe, prior, *args, **kwargs):
    for m in _pipe_models(pipe):  # before any component (e.g. a text encoder) is fused
        _check_fuse(m, "fuse_lora")
    return _call(pipe, "fuse_lora", prior, args, kwargs)


def _pipe_unfuse(pipe, prior, *args, **kwargs):
    for m in _pipe_models(pipe):
        _check_fuse(m, "unfuse_lora")
    return _call(pipe, "unfuse_lora", prior, args, kwargs)


def _pipe_ip_adapter(pipe, prior, *args, **kwargs):
    for m in _pipe_models(pipe):  # before the image encoder is loaded into the pipeline
        _check_ip_adapter(m, "load_ip_adapter")
    return _call(pipe, "load_ip_adapter", prior, args, kwargs)


_PIPE_GUARDS = {"load_lora_weights": _pipe_load_lora, "fuse_lora": _pipe_fuse, "unfuse_lora": _pipe_unfuse,
                "load_ip_adapter": _pipe_ip_adapter}
PIPE_GUARDS_ATTR = "_lite_boost_loader_guards"


def install_pipeline_guards(pipe) -> None:
    """The pipeline-level checks (so a refusal comes before the pipeline touches any component)."""
    if PIPE_GUARDS_ATTR in pipe.__dict__:
        return
    store: dict = {}
    _install(pipe, _PIPELINE_METHODS, _PIPE_GUARDS, store)
    pipe.__dict__[PIPE_GUARDS_ATTR] = store


def uninstall_pipeline_guards(pipe) -> None:
    store = pipe.__dict__.pop(PIPE_GUARDS_ATTR, None)
    if store:
        _uninstall(pipe, store)
