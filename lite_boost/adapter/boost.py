"""The generic boost: install a family's processors, cached RoPE, sparse attention and step cache.

Everything here works from a :class:`~lite_boost.adapter.family.ModelFamily` description; nothing
knows a particular model. What ``boost_model(family, model, config)`` changes, on the instance only
(never on diffusers' classes):

* every module matching one of the family's attention sites gets the site's processor (diffusers'
  ``set_processor``), the original kept for ``unboost``;
* the family's RoPE module gets an instance ``forward`` serving the cached fp32 tables (when the
  family's ``matches`` check says the cached tables reproduce the module's);
* block-sparse attention (``config.sparse``) and diffusers' step-cache hooks (``config.cache``);
* quantized Linear layers (``config.quant``, :mod:`lite_boost.quant`): the family's default
  ``quant_patterns`` or the config's own patterns; the original weights are kept for ``unboost``;
* block-level offload to host memory (``config.offload``, :mod:`lite_boost.offload`): diffusers'
  group-offloading hooks on the blocks (and, for a pipeline, on its text encoders);
* with a family ``call_args`` / ``call_context``: a forward pre-hook rewriting the call's arguments
  and recording the context as ``BoostState.call`` for the duration of each call (a forward hook
  that always runs clears it again);
* ``model._lite_boost`` holds the :class:`BoostState`.

Without ``config.quant`` the weights, the module tree and ``state_dict`` are untouched, so ``.to()``,
``.eval()`` and ``save_pretrained`` keep working (with it, see :mod:`lite_boost.quant`), and boosting
twice with the same config is a no-op.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..config import BoostConfig
from ..errors import ConfigError
from ..ops.attention import precision_reason
from ..ops.precision import PRECISIONS
from ..offload import offload_module, offload_pipeline, reapply_user_offload, remove_offload, resolve_onload_device
from ..ops.rope import RopeCache
from ..quant import check_uninstall_quant, install_quant, uninstall_quant
from .cache import install_call_names, install_cache, uninstall_call_names, uninstall_cache
from .loaders import install_loader_guards, install_pipeline_guards, uninstall_loader_guards, uninstall_pipeline_guards
from .processor import DenseAttention, LiteBoostProcessor
from .steps import attach_step_check, detach_step_check
from .sparse import attach_pipeline, install_sparse, uninstall_sparse

__all__ = ["BoostState", "boost_model", "unboost_model", "boost_pipeline", "unboost_pipeline", "match_sites",
           "STATE_ATTR"]

STATE_ATTR = "_lite_boost"


@dataclass
class BoostState:
    """Everything lite_boost attached to one transformer instance (``model._lite_boost``)."""

    config: BoostConfig
    rope_cache: RopeCache
    processors: dict[str, LiteBoostProcessor] = field(default_factory=dict)
    original_processors: dict[str, object] = field(default_factory=dict)
    rope_patched: bool = False
    grid: tuple[int, int, int] | None = None  # latent token grid of the latest forward (set by the RoPE shim)
    # Token range [start, stop) of the RoPE tables served for a sequence of the given length; set by
    # sequence parallelism so each rank gets its slice (stop may pass seq_len: padding rows).
    rope_range: Callable[[int], tuple[int, int]] | None = None
    extras: dict = field(default_factory=dict)  # per-feature state (sparse schedule, step cache, parallel plan)
    family: object = None  # the ModelFamily that boosted the model
    # The family's call_context of the transformer call in progress (None outside a call); set by a
    # forward pre-hook registered before every other lite_boost hook, so it sees the caller's arguments.
    call: object = None
    hooks: list = field(default_factory=list)  # handles of the hooks boost_model registered itself
    extra_ropes: list = field(default_factory=list)  # paths of the family's further RoPE modules given a forward

    @property
    def self_attention_processors(self) -> list[LiteBoostProcessor]:
        """Processors whose ``attn_fn`` sees the token sequence (roles "self" and "joint")."""
        return [p for p in self.processors.values() if p.is_self_attention]

    @property
    def cross_attention_processors(self) -> list[LiteBoostProcessor]:
        return [p for p in self.processors.values() if p.role == "cross"]

    @property
    def split_kv_processors(self) -> list[LiteBoostProcessor]:
        """Processors whose keys / values are the token sequence and whose queries are whole (role "split_kv")."""
        return [p for p in self.processors.values() if p.role == "split_kv"]

    def serve_range(self, seq_len: int) -> tuple[int, int]:
        """The RoPE rows [start, stop) to serve for a sequence of ``seq_len`` tokens (this rank's slice)."""
        return self.rope_range(seq_len) if self.rope_range is not None else (0, seq_len)


def _site_pattern(path: str) -> re.Pattern:
    parts = [r"(\d+)" if p == "*" else re.escape(p) for p in path.split(".")]
    return re.compile(r"\.".join(parts))


def match_sites(family, model) -> list[tuple[str, object, object, int]]:
    """(name, module, site, layer index) of every module matching an attention site, in module order.

    The layer index is the number matched by the site path's first ``*`` (0 when it has none) plus
    the site's ``layer_offset``. Raises TypeError when a site matches nothing or a matched module has
    no ``set_processor``.
    """
    patterns = [(site, _site_pattern(site.path)) for site in family.attention]
    offsets = {site.path: site.offset(model) for site in family.attention}
    found, seen = [], set()
    for name, module in model.named_modules():
        for site, pattern in patterns:
            m = pattern.fullmatch(name)
            if m is None:
                continue
            if not hasattr(module, "set_processor"):
                raise TypeError(f"{name} ({type(module).__name__}) is not a diffusers attention module with "
                                f"set_processor (attention site {site.path!r} of the {family.name} family)")
            found.append((name, module, site, (int(m.group(1)) if m.groups() else 0) + offsets[site.path]))
            seen.add(site.path)
            break
    missing = [s.path for s in family.attention if s.path not in seen]
    if missing:
        raise TypeError(f"{type(model).__name__} does not look like a {family.name} transformer "
                        f"({' / '.join(family.transformers)}): no module matches the attention site(s) {missing}")
    return found


def check_model(family, model) -> list:
    """Raise TypeError unless ``model`` has the family's attention sites and RoPE module; returns the sites.

    An attention processor that holds weights of its own (an IP-Adapter processor is an ``nn.Module``
    with its key / value projections) is refused: the shim would drop those weights from the module
    tree and the adapter's effect with them.
    """
    sites = match_sites(family, model)
    state = getattr(model, STATE_ATTR, None)
    for name, module, _, _ in sites:
        proc = state.original_processors.get(name) if state is not None else module.processor
        if isinstance(proc, torch.nn.Module) and any(True for _ in proc.parameters()):
            raise TypeError(f"{name} of {type(model).__name__} has a {type(proc).__name__} processor with weights of its "
                            f"own (an IP-Adapter?); lite_boost's {family.name} processors do not reproduce it: unload "
                            "it (e.g. pipe.unload_ip_adapter()) before boosting")
    for source in (family.rope, *family.ropes):
        if source is None:
            continue
        try:
            model.get_submodule(source.module)
        except AttributeError:
            raise TypeError(f"{type(model).__name__} does not look like a {family.name} transformer: no RoPE "
                            f"module {source.module!r}") from None
    return sites


def check_attention_precision(config: BoostConfig, model) -> None:
    """ConfigError naming ``attention.precision`` and the values this model's device can run, unless it runs
    ``config.attention.precision``. Before anything is modified."""
    precision = config.attention.precision
    if precision == "auto":
        return
    param = next(iter(model.parameters()), None)
    device = param.device.type if param is not None else "cpu"
    dtype = param.dtype if param is not None else torch.float32
    why = precision_reason(device, precision, dtype)
    if why is not None:
        usable = [p for p in PRECISIONS if precision_reason(device, p, dtype) is None]
        raise ConfigError(f"attention.precision={precision!r} cannot run on {device}: {why}. attention.precision "
                          f"must be one of {usable} here (allowed values: {list(PRECISIONS)})")


def boost_model(family, model, config: BoostConfig | None = None, onload_device=None, *, plan=None):
    """Boost one transformer of ``family`` in place and return it (idempotent for an equal config).

    ``onload_device``: where offloaded blocks compute (``config.offload``; None = resolved from the
    config and the model, :func:`lite_boost.offload.resolve_onload_device`). ``plan``: a
    :class:`lite_boost.plan.Plan` that validated this model already (its config and quantization are used and
    nothing is checked again); without one, the model and config are checked here."""
    if plan is None:
        config = BoostConfig.coerce(config)
        sites = check_model(family, model)
        family.check_config(config, model)
        check_attention_precision(config, model)
    else:
        config = plan.config
        sites = match_sites(family, model)
    state = getattr(model, STATE_ATTR, None)
    if state is not None:
        if state.config == config and state.family is family:
            return model
        unboost_model(model)
    if config.offload is not None and onload_device is None:
        onload_device = resolve_onload_device(config.offload, model)

    state = BoostState(config=config, rope_cache=RopeCache(config.rope_cache_size), family=family)
    # first: on failure it leaves the model as it was
    install_quant(model, state, plan.part("quant", model) if plan is not None else None)
    if config.quant is not None:
        reapply_user_offload(model)  # the user's own group offloading follows the new weight tensors
    for name, module, site, layer in sites:
        proc = site.processor(layer, site.role, config.attention_backend)
        if proc.is_self_attention and isinstance(proc.attn_fn, DenseAttention):
            proc.attn_fn.precision = config.attention.precision
        proc.text_first = family.joint != "image_first"
        proc.state = state
        state.original_processors[name] = module.processor
        state.processors[name] = proc
        module.set_processor(proc)
    if family.call_context is not None or family.call_args is not None:
        _install_call_hooks(model, state, family.call_args, family.call_context)
    if family.rope is not None:
        rope = model.get_submodule(family.rope.module)
        if family.rope.matches is None or family.rope.matches(rope):
            rope.forward = family.rope.forward(rope, state)
            state.rope_patched = True
    for source in family.ropes:  # a model with several RoPE modules (LTX-2: video, audio, cross-attention)
        rope = model.get_submodule(source.module)
        if source.matches is None or source.matches(rope):
            rope.forward = source.forward(rope, state)
            state.extra_ropes.append(source.module)
    install_sparse(model, state)  # block-sparse self-attention when config.sparse asks for it
    # before the step cache: a skipped block is then not uploaded either. Under FSDP (ParallelManager,
    # fsdp_degree > 1) FSDP2's CPUOffloadPolicy keeps the shards on the host instead: no block hooks here
    if config.offload is not None and config.parallel.fsdp_degree <= 1:
        offload_module(model, config.offload, onload_device)
    install_cache(model, state, checked=plan is not None)  # diffusers' step-cache hooks when config.cache asks
    install_loader_guards(model, state)  # what diffusers' loaders may do to the boosted instance
    setattr(model, STATE_ATTR, state)
    return model


def unboost_model(model):
    """Undo :func:`boost_model`: original processors, RoPE forward and weights back; returns the model."""
    state = getattr(model, STATE_ATTR, None)
    if state is None:
        return model
    check_uninstall_quant(state)  # QuantError before anything is undone when the weights were not kept
    uninstall_loader_guards(model, state)
    detach_step_check(model, state)
    uninstall_cache(model, state)
    remove_offload(model)  # weights back home (before the quantized weights are swapped back)
    for name, proc in state.original_processors.items():
        model.get_submodule(name).set_processor(proc)
    family = state.family
    if state.rope_patched and family is not None and family.rope is not None:
        rope = model.get_submodule(family.rope.module)
        if "forward" in rope.__dict__:
            del rope.forward
    for path in state.extra_ropes:
        rope = model.get_submodule(path)
        if "forward" in rope.__dict__:
            del rope.forward
    state.extra_ropes.clear()
    uninstall_sparse(model, state)
    uninstall_quant(model, state)
    if state.config.quant is not None:
        reapply_user_offload(model)
    for handle in state.hooks:
        handle.remove()
    state.hooks.clear()
    state.call = None
    delattr(model, STATE_ATTR)
    return model


def _install_call_hooks(model, state: BoostState, call_args, call_context) -> None:
    """Rewrite each call's arguments (``call_args``) and record ``call_context`` as ``state.call`` while it runs."""
    def enter(module, args, kwargs):
        new = call_args(module, args, kwargs) if call_args is not None else None
        if new is not None:
            args, kwargs = new
        state.call = call_context(module, args, kwargs) if call_context is not None else None
        return new

    def leave(module, args, kwargs, output):
        state.call = None

    state.hooks.append(model.register_forward_pre_hook(enter, with_kwargs=True))
    state.hooks.append(model.register_forward_hook(leave, with_kwargs=True, always_call=True))


def pipeline_transformers(family, pipe) -> list[tuple[str, object]]:
    """(attribute, transformer) of every transformer the pipeline holds (``family.pipeline.transformers``)."""
    found = [(n, getattr(pipe, n, None)) for n in family.pipeline.transformers]
    found = [(n, m) for n, m in found if m is not None]
    if not found:
        raise ValueError(f"{type(pipe).__name__} has none of {list(family.pipeline.transformers)} set; nothing to boost")
    return found


def boost_pipeline(family, pipe, config: BoostConfig | None = None, onload_device=None, *, plan=None):
    """Boost every transformer of a pipeline of ``family`` (checked first, then boosted); with
    ``config.offload`` its text encoders are offloaded too and its other modules go to the onload device.
    ``plan``: a :class:`lite_boost.plan.Plan` of this pipeline (its transformers and config are used,
    nothing is checked again)."""
    if plan is None:
        config = BoostConfig.coerce(config)
        transformers = [m for _, m in pipeline_transformers(family, pipe)]
        for module in transformers:
            check_model(family, module)
            family.check_config(config, module)
    else:
        config, transformers = plan.config, plan.models
    if config.offload is not None and onload_device is None:
        onload_device = resolve_onload_device(config.offload, transformers[0])
    for module in transformers:
        boost_model(family, module, config, onload_device, plan=plan)
        attach_pipeline(module, pipe)  # the sparse schedule follows pipe.scheduler's step
        attach_step_check(module, pipe)  # sparse / cache settings that do nothing at a run's step count: said
    from ..parallel.manager import fsdp_offloaded_encoders  # (FSDP2's CPUOffloadPolicy keeps those on the host)

    offload_pipeline(pipe, config.offload, tuple(family.pipeline.transformers) + tuple(fsdp_offloaded_encoders(pipe, config)),
                     onload_device)
    install_call_names(pipe, family, transformers)  # cond / uncond names for a pipeline that sets none (step caches)
    install_pipeline_guards(pipe)
    return pipe


def unboost_pipeline(family, pipe):
    uninstall_call_names(pipe)
    for _, module in pipeline_transformers(family, pipe):
        unboost_model(module)
    offload_pipeline(pipe, None, family.pipeline.transformers)
    uninstall_pipeline_guards(pipe)
    return pipe
