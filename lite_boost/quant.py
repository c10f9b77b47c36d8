"""Quantized Linear layers for boosted transformers: torchao on CPU and CUDA, torch_npu's W8A8 on Ascend.

``BoostConfig(quant=QuantConfig(method, include, exclude, keep_original))`` names a method and which
Linear layers it applies to; this module validates that against the model and the device, replaces
the selected layers' weights and keeps what ``unboost`` needs to put the original weights back. It
knows no model: it takes a transformer and module-name patterns; a model family only declares its
default patterns (``ModelFamily.quant_patterns``, fnmatch, e.g. Wan's ``"blocks.*"``).

| method | weights | activations | runs on | through |
|---|---|---|---|---|
| ``int8_dynamic`` | int8, per output channel | int8, per token, dynamic | CPU, CUDA | torchao ``Int8DynamicActivationInt8WeightConfig`` |
| ``int8_weight_only`` | int8, per output channel | full precision | CPU, CUDA | torchao ``Int8WeightOnlyConfig`` |
| ``fp8`` | float8_e4m3, per output channel | float8_e4m3, per token, dynamic | CUDA sm89+ (bfloat16 model) | torchao ``Float8DynamicActivationFloat8WeightConfig(PerRow)`` |
| ``w8a8_npu`` | int8, per output channel | int8, per token (``npu_dynamic_quant``) | Ascend (float16 / bfloat16 model) | ``torch_npu.npu_quant_matmul`` (:mod:`lite_boost.ops.quant_npu`) |

What stays as it was: the module tree (every layer is still an ``nn.Linear``; torchao replaces its
``weight`` by a tensor subclass, the W8A8 path by int8 data plus a ``weight_scale`` buffer and an
instance ``forward``), the layers not selected (embeddings, norms, the final projection and the
modulation tables are not blocks' Linear layers), the rest of the state dict. torch.compile traces
the quantized layers without a graph break. lite_boost does not change torch / inductor global
settings (torchao's ``set_inductor_config`` is off; call
``torchao.quantization.utils.recommended_inductor_config_setter()`` yourself for its GPU tuning).

``unboost`` restores the original weights bit for bit: with ``keep_original=True`` (default) the
original ``Parameter`` objects are kept (on the CPU, as they are; on an accelerator as a host copy,
so the device memory saving stays). ``save_pretrained`` of a quantized model writes those original
weights (the quantization is a runtime boost, re-applied after loading, like every other boost).
With ``keep_original=False`` the originals are freed: ``unboost``, re-boosting with another config
and ``save_pretrained`` then refuse with a :class:`QuantError` that says so.
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
import importlib
import logging
import re
import warnings
from dataclasses import dataclass, field
from typing import Iterable, Mapping

import torch
from torch import nn

__all__ = [
    "QUANT_METHOD_INFO",
    "QuantError",
    "QuantPlan",
    "QuantState",
    "method_problem",
    "usable_methods",
    "plan_quant",
    "check_quant_support",
    "quantize_model",
    "install_quant",
    "check_uninstall_quant",
    "uninstall_quant",
    "quant_state",
]

logger = logging.getLogger("lite_boost.quant")

STATE_KEY = "quant"


class QuantError(RuntimeError):
    """A quantized model cannot do what was asked (unboost / save without the original weights)."""


def _config_error(msg: str):
    from .config import ConfigError

    return ConfigError(msg)


@dataclass(frozen=True)
class QuantMethodInfo:
    """One quantization method as lite_boost offers it."""

    name: str
    summary: str
    library: str  # "torchao" or "torch_npu"
    devices: str  # where it runs, in words (error messages)
    dtypes: tuple[torch.dtype, ...] | None = None  # model dtypes it accepts (None: any floating dtype)


QUANT_METHOD_INFO: dict[str, QuantMethodInfo] = {
    m.name: m
    for m in (
        QuantMethodInfo("int8_dynamic", "int8 weights (per output channel) x int8 activations (per token, dynamic)",
                        "torchao", "CPU or CUDA"),
        QuantMethodInfo("int8_weight_only", "int8 weights (per output channel), full-precision activations",
                        "torchao", "CPU or CUDA"),
        QuantMethodInfo("fp8", "float8_e4m3 weights (per output channel) x float8_e4m3 activations (per token, dynamic)",
                        "torchao", "a CUDA GPU with FP8 tensor cores (sm89+)", (torch.bfloat16,)),
        QuantMethodInfo("w8a8_npu", "int8 weights (per output channel) x int8 activations (per token) on "
                        "torch_npu.npu_quant_matmul", "torch_npu", "an Ascend NPU (torch_npu)",
                        (torch.float16, torch.bfloat16)),
    )
}


# ----------------------------------------------------------------------------------- libraries
def _import(name: str):
    """Import an optional package or return why it cannot be imported (a str)."""
    try:
        if importlib.util.find_spec(name) is None:
            return f"{name} is not installed"
    except (ImportError, ValueError) as exc:
        return f"{name} cannot be located ({exc.__class__.__name__}: {exc})"
    try:
        if name == "torchao":
            # torchao logs a warning for each CUDA-only extension a CPU build of torch cannot load
            quiet = logging.getLogger("torchao")
            level = quiet.level
            quiet.setLevel(logging.ERROR)
            try:
                return importlib.import_module(name)
            finally:
                quiet.setLevel(level)
        return importlib.import_module(name)
    except (ImportError, RuntimeError, OSError) as exc:
        return f"{name} is installed but failed to import ({exc.__class__.__name__}: {exc})"


def _torchao():
    mod = _import("torchao")
    if isinstance(mod, str):
        raise _config_error(f"quantization through torchao needs torchao >= 0.18: {mod} "
                            "(pip install 'lite-boost[quant]', which never changes the installed torch)")
    import torchao.quantization  # noqa: F401

    return mod


def _torch_npu():
    mod = _import("torch_npu")
    if isinstance(mod, str):
        return mod
    missing = [op for op in ("npu_dynamic_quant", "npu_quant_matmul") if not hasattr(mod, op)]
    if missing:
        return f"torch_npu {getattr(mod, '__version__', '?')} has no {', '.join(missing)}"
    return mod


def _torchao_config(method: str):
    _torchao()
    from torchao.quantization import (
        Float8DynamicActivationFloat8WeightConfig,
        Int8DynamicActivationInt8WeightConfig,
        Int8WeightOnlyConfig,
        PerRow,
    )

    if method == "int8_dynamic":
        return Int8DynamicActivationInt8WeightConfig(set_inductor_config=False)
    if method == "int8_weight_only":
        return Int8WeightOnlyConfig(set_inductor_config=False)
    if method == "fp8":
        return Float8DynamicActivationFloat8WeightConfig(granularity=PerRow(), set_inductor_config=False)
    raise AssertionError(method)


# ----------------------------------------------------------------------------------- devices
def method_problem(method: str, device: torch.device | str) -> str | None:
    """Why ``method`` cannot run on ``device`` (a short reason), or None when it can."""
    device = torch.device(device)
    info = QUANT_METHOD_INFO[method]
    if info.library == "torchao":
        mod = _import("torchao")
        if isinstance(mod, str):
            return f"{mod} (pip install 'lite-boost[quant]')"
    if method in ("int8_dynamic", "int8_weight_only"):
        return None if device.type in ("cpu", "cuda") else f"it runs on {info.devices}, not on {device.type}"
    if method == "fp8":
        if device.type != "cuda":
            return f"it needs {info.devices}, not {device.type}"
        cap = torch.cuda.get_device_capability(device)
        if cap < (8, 9):
            return f"it needs FP8 tensor cores (sm89+), {torch.cuda.get_device_name(device)} is sm{cap[0]}{cap[1]}"
        return None
    if method == "w8a8_npu":
        if device.type != "npu":
            return f"it needs {info.devices}, not {device.type}"
        npu = _torch_npu()
        return npu if isinstance(npu, str) else None
    raise AssertionError(method)


def usable_methods(device: torch.device | str) -> list[str]:
    """The quantization methods that can run on ``device``."""
    return [m for m in QUANT_METHOD_INFO if method_problem(m, device) is None]


# ----------------------------------------------------------------------------------- selection
def _is_quantized(weight) -> bool:
    return type(weight) not in (torch.Tensor, nn.Parameter) or not weight.dtype.is_floating_point


def _shape_problem(method: str, module: nn.Linear) -> str | None:
    k, n = module.in_features, module.out_features
    if method == "fp8" and (k % 16 or n % 16):
        return f"FP8 matmuls need in/out features divisible by 16, got {k} x {n}"
    if method == "w8a8_npu":
        from .ops.quant_npu import w8a8_shape_problem

        return w8a8_shape_problem(k, n)
    return None


@dataclass(frozen=True)
class QuantPlan:
    """What quantizing one model will do, decided (and validated) before anything is touched."""

    method: str
    layers: tuple[str, ...]  # Linear modules to quantize
    skipped: Mapping[str, str]  # selected Linear modules left in full precision -> why
    device: torch.device
    dtype: torch.dtype


def _names(patterns) -> str:
    return ", ".join(repr(p) for p in patterns)


def plan_quant(model: nn.Module, config, default_include: Iterable[str] | None = None,
               device: torch.device | str | None = None) -> QuantPlan:
    """Validate ``config`` (a QuantConfig) against ``model`` and the device; returns the plan, changes nothing.

    ``default_include``: the adapter's patterns, used when ``config.include`` is None. ``device``:
    where the model will run (default: where its selected weights are). Raises ConfigError naming
    the problem: a pattern that matches no Linear layer, nothing left to quantize, a layer already
    quantized, mixed devices or dtypes, a method the device or dtype cannot run.
    """
    method = config.method
    adapters = _adapter_internal(model)  # a loaded LoRA's own layers stay as they are (their base layer is quantized)
    linears = {name: mod for name, mod in model.named_modules() if isinstance(mod, nn.Linear) and name not in adapters}
    if not linears:
        raise _config_error(f"quantization was requested but {type(model).__name__} has no nn.Linear layer")
    include = tuple(config.include) if config.include is not None else tuple(default_include or ())
    if not include:
        raise _config_error(f"{type(model).__name__} declares no default layers to quantize; pass "
                            "QuantConfig(include=[...]) with regular expressions over its module names")
    examples = list(linears)[:6]
    for pat in include:
        if not any(re.fullmatch(pat, n) for n in linears):
            raise _config_error(f"quant include pattern {pat!r} matches no nn.Linear of {type(model).__name__} "
                                f"(patterns match whole module names, e.g. {examples})")
    for pat in config.exclude:
        if not any(re.fullmatch(pat, n) for n in linears):
            raise _config_error(f"quant exclude pattern {pat!r} matches no nn.Linear of {type(model).__name__} "
                                f"(patterns match whole module names, e.g. {examples})")
    chosen = [n for n in linears if any(re.fullmatch(p, n) for p in include)
              and not any(re.fullmatch(p, n) for p in config.exclude)]
    if not chosen:
        raise _config_error(f"quant include {_names(include)} minus exclude {_names(config.exclude)} leaves no layer "
                            f"of {type(model).__name__} to quantize")
    prior = quant_state(model)  # a previous boost's quantization: boost restores it before re-applying
    ours = prior.originals if prior is not None else {}
    for n in chosen:
        w = linears[n].weight
        if _is_quantized(w) and n not in ours:
            raise _config_error(f"layer {n!r} of {type(model).__name__} already holds a quantized weight "
                                f"({type(w).__name__}, {w.dtype}); load the model in full precision or leave "
                                "BoostConfig.quant unset")
    devices = {linears[n].weight.device for n in chosen}
    dtypes = {prior.restored_dtype(linears[n]) if n in ours else linears[n].weight.dtype for n in chosen}
    if len(devices) > 1 or len(dtypes) > 1:
        raise _config_error(f"the layers to quantize are on several devices / dtypes ({sorted(map(str, devices))}, "
                            f"{sorted(map(str, dtypes))}); move the model to one device and dtype first")
    current = devices.pop()
    dtype = dtypes.pop()
    device = torch.device(device) if device is not None else current
    if current.type == "meta" or device.type == "meta":
        raise _config_error("cannot quantize weights on the meta device; load the weights first")
    why = method_problem(method, device)
    if why is not None:
        usable = usable_methods(device)
        raise _config_error(f"quant method {method!r} cannot run on {device} ({why}); methods that can run on "
                            f"{device.type}: {usable or 'none'}")
    info = QUANT_METHOD_INFO[method]
    if info.dtypes is not None and dtype not in info.dtypes:
        raise _config_error(f"quant method {method!r} needs a {' or '.join(str(d).replace('torch.', '') for d in info.dtypes)} "
                            f"model, got {str(dtype).replace('torch.', '')}; load it with torch_dtype= one of those")
    if method == "int8_dynamic" and device.type == "cpu":
        _warn_slow_int8(type(model).__name__)
    skipped = {n: why for n in chosen if (why := _shape_problem(method, linears[n])) is not None}
    layers = tuple(n for n in chosen if n not in skipped)
    if not layers:
        raise _config_error(f"quant method {method!r} can run none of the selected layers: "
                            f"{dict(list(skipped.items())[:3])}")
    return QuantPlan(method, layers, skipped, device, dtype)


def _warn_slow_int8(model_name: str) -> None:
    """int8_dynamic on a CPU without int8 dot products: correct, and its int8 products run as exact fp32 GEMMs
    (:func:`exact_int8_cpu`) instead of ``torch._int_mm``'s generic loop, so it runs somewhat slower than fp32
    (the quantization steps on top of an fp32 GEMM), not faster; the weights are 4x smaller."""
    from .errors import PerformanceWarning
    from .ops.precision import cpu_int8_dot_reason

    why = cpu_int8_dot_reason()
    if why is not None:
        warnings.warn(f"quant method 'int8_dynamic' on {model_name} will run slower than fp32 on this CPU: {why}, so "
                      "its int8 products run as exact fp32 GEMMs (the same result as torchao's int8 matmul) with "
                      "the activation quantization on top; it still saves 4x weight memory, as 'int8_weight_only' "
                      "does", PerformanceWarning, stacklevel=4)


def _adapter_internal(model: nn.Module) -> set[str]:
    """Names of the modules inside peft adapter layers of ``model`` (a LoRA's ``lora_A`` / ``lora_B`` ...): the
    adapter's layers, not the model's; the layer they wrap is the adapter layer's ``base_layer``."""
    names = set()
    for name, module in model.named_modules():
        for attr in getattr(module, "adapter_layer_names", None) or ():
            sub = getattr(module, attr, None)
            if isinstance(sub, nn.Module):
                prefix = f"{name}.{attr}" if name else attr
                names.update(f"{prefix}.{n}" if n else prefix for n, _ in sub.named_modules())
    return names


def _layer(model: nn.Module, name: str) -> nn.Linear:
    """The quantized Linear ``name`` of ``model``, found again after a LoRA (peft) wrapped it (``name`` is then its
    adapter layer, whose ``base_layer`` it is) or was unloaded (``name`` ended in ``.base_layer``)."""
    try:
        mod = model.get_submodule(name)
    except AttributeError:
        if not name.endswith(".base_layer"):
            raise
        return _layer(model, name[: -len(".base_layer")])
    while not isinstance(mod, nn.Linear) and isinstance(getattr(mod, "base_layer", None), nn.Module):
        mod = mod.base_layer
    return mod


# ----------------------------------------------------------------------------------- state
@dataclass
class _Original:
    weight: torch.Tensor | None  # the original Parameter (same object) or its host copy; None = not kept
    requires_grad: bool
    same_object: bool
    extra_repr: object = None  # the instance extra_repr before torchao set one (None: there was none)
    had_extra_repr: bool = False


@dataclass
class QuantState:
    """What quantization changed on one model (``state.extras['quant']`` of a boosted model)."""

    config: object  # QuantConfig
    plan: QuantPlan
    originals: dict[str, _Original] = field(default_factory=dict)
    save_patch: object = None  # the instance save_pretrained lite_boost installed
    prior_save: object = None  # an instance save_pretrained that was there before (restored on removal)
    had_prior_save: bool = False

    @property
    def layers(self) -> tuple[str, ...]:
        return self.plan.layers

    @property
    def restorable(self) -> bool:
        return all(o.weight is not None for o in self.originals.values())

    def check_restorable(self, what: str = "unboost") -> None:
        if not self.restorable:
            raise QuantError(
                f"cannot {what}: the {len(self.originals)} quantized layers' full-precision weights were not kept "
                "(QuantConfig(keep_original=False)); reload the model (e.g. from_pretrained) instead, or quantize "
                "with keep_original=True (the default)"
            )

    def weight_bytes(self, model: nn.Module) -> tuple[int, int]:
        """(bytes of the original weights, bytes of the quantized weights incl. scales) of the quantized layers."""
        before = after = 0
        for name in self.layers:
            mod = _layer(model, name)
            before += mod.in_features * mod.out_features * self.plan.dtype.itemsize
            after += _tensor_bytes(mod.weight) + sum(b.nbytes for n, b in mod.named_buffers(recurse=False)
                                                     if n == "weight_scale")
        return before, after

    def summary(self, model: nn.Module) -> str:
        before, after = self.weight_bytes(model)
        text = (f"{self.plan.method} on {len(self.layers)} Linear layers, their weights {after / 2**20:.1f} MiB "
                f"instead of {before / 2**20:.1f} MiB ({after / max(before, 1):.2f}x)")
        if self.plan.skipped:
            text += f"; {len(self.plan.skipped)} left in full precision ({next(iter(self.plan.skipped.values()))})"
        return text

    # -- restoring
    def restored_dtype(self, mod: nn.Linear) -> torch.dtype:
        """The dtype a restored weight gets: the layer's bias dtype (it follows ``model.to(dtype)``)."""
        return mod.bias.dtype if mod.bias is not None else self.plan.dtype

    def _restored_weight(self, mod: nn.Linear, orig: _Original) -> nn.Parameter:
        device = mod.weight.device
        dtype = self.restored_dtype(mod)
        w = orig.weight
        if orig.same_object and w.device == device and w.dtype == dtype:
            return w
        return nn.Parameter(w.detach().to(device=device, dtype=dtype), requires_grad=orig.requires_grad)

    def _put_back(self, model: nn.Module, name: str, orig: _Original) -> None:
        mod = _layer(model, name)
        mod.weight = self._restored_weight(mod, orig)
        mod.__dict__.pop("forward", None)  # the W8A8 / CPU int8-dynamic instance forward
        if "weight_scale" in mod._buffers:
            del mod._buffers["weight_scale"]
        if "extra_repr" in mod.__dict__:
            del mod.__dict__["extra_repr"]
        if orig.had_extra_repr:
            mod.extra_repr = orig.extra_repr

    def restore(self, model: nn.Module) -> None:
        """Put the original weights back (bit-identical when dtype and device did not change)."""
        self.check_restorable()
        for name, orig in self.originals.items():
            self._put_back(model, name, orig)
        self.originals.clear()

    @contextlib.contextmanager
    def original_weights(self, model: nn.Module):
        """Temporarily swap the original weights in (e.g. to save them); the quantized ones come back after."""
        self.check_restorable("save the original weights")
        swapped = {}
        try:
            for name, orig in self.originals.items():
                mod = _layer(model, name)
                swapped[name] = mod.weight
                mod._parameters["weight"] = self._restored_weight(mod, orig)
            yield model
        finally:
            for name, weight in swapped.items():
                _layer(model, name)._parameters["weight"] = weight


def _tensor_bytes(t: torch.Tensor) -> int:
    flatten = getattr(type(t), "__tensor_flatten__", None)
    if flatten is None or type(t) in (torch.Tensor, nn.Parameter):
        return t.numel() * t.element_size()
    names, _ = t.__tensor_flatten__()
    return sum(_tensor_bytes(getattr(t, n)) for n in names if getattr(t, n, None) is not None)


# ----------------------------------------------------------------------------------- applying
def _w8a8_forward(module: nn.Linear, torch_npu, x: torch.Tensor) -> torch.Tensor:
    from .ops.quant_npu import w8a8_linear

    return w8a8_linear(torch_npu, x, module.weight, module.weight_scale, module.bias)


def _quantize_w8a8(model: nn.Module, names: tuple[str, ...]) -> None:
    from .ops.quant_npu import quantize_weight_per_channel

    npu = _torch_npu()
    if isinstance(npu, str):
        raise _config_error(f"quant method 'w8a8_npu': {npu}")
    for name in names:
        mod = model.get_submodule(name)
        q, scale = quantize_weight_per_channel(mod.weight)
        mod.weight = nn.Parameter(q, requires_grad=False)
        mod.register_buffer("weight_scale", scale)
        mod.forward = functools.partial(_w8a8_forward, mod, npu)


def exact_int8_cpu(device: torch.device | str) -> bool:
    """Whether int8_dynamic Linear layers on ``device`` compute through :func:`lite_boost.ops.quant_int8.int8_linear`
    (exact int8 products as fp32 GEMMs) instead of torchao's eager path: a CPU without int8 dot products, where
    ``torch._int_mm`` has no fast kernel."""
    from .ops.quant_int8 import int8_mm_path

    return int8_mm_path(device) == "fp32"  # only a CPU's path is ever "fp32"


def _int8_dynamic_forward(module: nn.Linear, spec, x: torch.Tensor) -> torch.Tensor:
    from .ops.quant_int8 import int8_linear

    w = module.weight
    return int8_linear(x, w.qdata, w.scale, w.zero_point, module.bias, spec)


def _route_int8_dynamic(mods: Mapping[str, nn.Linear]) -> None:
    """Instance ``forward`` of each int8-dynamic Linear: the same arithmetic as torchao's ``Int8Tensor`` Linear (bit
    for bit), its int8 products as exact fp32 GEMMs; the weight stays torchao's tensor (state_dict, saving, LoRA
    and weight sharding see no difference). ``_put_back`` drops the instance forward again."""
    from .ops.quant_int8 import int8_spec

    for mod in mods.values():
        spec = int8_spec(mod.weight)
        if spec is not None and spec.dynamic and spec.mapping == "SYMMETRIC":
            mod.forward = functools.partial(_int8_dynamic_forward, mod, spec)


def _save_pretrained(model, state: QuantState, *args, **kwargs):
    """Instance ``save_pretrained`` of a quantized model: writes the original full-precision weights."""
    with state.original_weights(model):
        prior = state.prior_save if state.had_prior_save else functools.partial(type(model).save_pretrained, model)
        return prior(*args, **kwargs)


def quantize_model(model: nn.Module, config, plan: QuantPlan) -> QuantState:
    """Quantize ``plan.layers`` of ``model`` in place; returns the state that undoes it."""
    mods = {n: model.get_submodule(n) for n in plan.layers}
    originals = {}
    for n, mod in mods.items():
        had = "extra_repr" in mod.__dict__
        originals[n] = _Original(mod.weight, mod.weight.requires_grad, True, mod.__dict__.get("extra_repr"), had)
    state = QuantState(config, plan, originals)
    try:
        if plan.method == "w8a8_npu":
            _quantize_w8a8(model, plan.layers)
        else:
            from torchao.quantization import quantize_

            wanted = set(plan.layers)
            quantize_(model, _torchao_config(plan.method), filter_fn=lambda m, fqn: fqn in wanted)
        missed = [n for n, mod in mods.items() if mod.weight is originals[n].weight]
        if missed:
            raise RuntimeError(f"quantization left {len(missed)} selected layers unchanged, e.g. {missed[:3]}")
        if plan.method == "int8_dynamic" and exact_int8_cpu(plan.device):
            _route_int8_dynamic(mods)
    except BaseException:
        for n, orig in originals.items():  # nothing half-quantized is left behind
            if mods[n].weight is not orig.weight:
                state._put_back(model, n, orig)
        raise
    if not config.keep_original:
        for orig in originals.values():
            orig.weight = None
    elif plan.device.type != "cpu":  # keep a host copy: the device memory saving stays
        for orig in originals.values():
            orig.weight = orig.weight.detach().to("cpu", copy=True)
            orig.same_object = False
    if hasattr(model, "save_pretrained"):
        state.had_prior_save = "save_pretrained" in model.__dict__
        state.prior_save = model.__dict__.get("save_pretrained")
        state.save_patch = functools.partial(_refusing_save if not config.keep_original else _save_pretrained,
                                             model, state)
        model.__dict__["save_pretrained"] = state.save_patch
    logger.info("lite_boost quantization: %s", state.summary(model))
    return state


def _refusing_save(model, state: QuantState, *args, **kwargs):
    state.check_restorable("save_pretrained a quantized model")


# ----------------------------------------------------------------------------------- families
def family_patterns(family) -> tuple[str, ...]:
    """A family's default layers (``ModelFamily.quant_patterns``, fnmatch) as regular expressions."""
    return tuple(fnmatch.translate(p) for p in getattr(family, "quant_patterns", ()) or ())


_LOOKUP = object()  # check_quant_support's family argument when the caller has not resolved it


def _family_of(target, family=_LOOKUP):
    from .registry import family_of, names_where

    if family is _LOOKUP:
        family = family_of(target)
    if family is None or not family.supports("quant"):
        why = family.features["quant"] if family is not None else "its adapter is not a model family"
        raise _config_error(f"quantization (BoostConfig.quant) is not supported for {type(target).__name__} ({why}); "
                            f"models with it: {names_where(lambda f: f.supports('quant'))}")
    return family


def check_quant_support(target, quant_config, *, device: torch.device | str | None = None, family=_LOOKUP,
                        models=None) -> list[QuantPlan]:
    """Validate ``quant_config`` for every transformer of ``target`` (a pipeline or a model); changes nothing.

    Runs before anything is modified (and, under ParallelManager, before any collective). ``family`` /
    ``models``: the target's family and transformers when the caller (the planner) resolved them already.
    Returns one plan per transformer, in their order.
    """
    if quant_config is None:
        return []
    family = _family_of(target, family)
    models = family.transformers_of(target) if models is None else models
    return [plan_quant(m, quant_config, family_patterns(family), device) for m in models]


def install_quant(model: nn.Module, boost_state, plan: QuantPlan | None = None) -> None:
    """Quantize ``model`` as ``boost_state.config.quant`` asks (if at all); the state goes to its extras.

    ``plan``: the model's QuantPlan from the planner (else it is planned here).
    """
    cfg = boost_state.config.quant
    if cfg is None:
        return
    if plan is None:
        plan = plan_quant(model, cfg, family_patterns(boost_state.family))
    boost_state.extras[STATE_KEY] = quantize_model(model, cfg, plan)


def check_uninstall_quant(boost_state) -> None:
    """Raise QuantError (before anything is undone) when the quantized weights cannot be restored."""
    state = boost_state.extras.get(STATE_KEY)
    if state is not None:
        state.check_restorable()


def uninstall_quant(model: nn.Module, boost_state) -> None:
    state = boost_state.extras.get(STATE_KEY)
    if state is None:
        return
    state.restore(model)
    if state.save_patch is not None and model.__dict__.get("save_pretrained") is state.save_patch:
        del model.__dict__["save_pretrained"]
        if state.had_prior_save:
            model.__dict__["save_pretrained"] = state.prior_save
    del boost_state.extras[STATE_KEY]


def quant_state(model) -> QuantState | None:
    """The QuantState of a boosted, quantized model (or None)."""
    state = getattr(model, "_lite_boost", None)
    extras = getattr(state, "extras", None)
    return extras.get(STATE_KEY) if isinstance(extras, dict) else None
