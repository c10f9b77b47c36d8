"""Block-level offload to host memory (``BoostConfig.offload``), on diffusers' group-offloading hooks.

``diffusers.hooks.apply_group_offloading(offload_type="block_level")`` does the work: each block of a
layer stack (a ``ModuleList`` such as Wan's ``blocks`` or a text encoder's ``encoder.block``) is a
group that its first module uploads to the compute device when it is called and its last module
drops again after it ran; with ``use_stream`` (CUDA, NPU, XPU) the group that runs next is uploaded on a
side stream while the current one computes (diffusers traces the call order on the first call).

What lite_boost adds around it:

* :func:`layer_stacks` finds the layer stacks of any module (the transformer itself for diffusers
  transformers; ``encoder`` for T5 / UMT5, ``text_model.encoder`` for CLIP, ``model.layers`` for a
  decoder-only text encoder). Each stack is offloaded on its own, one level deep (diffusers' nested
  ``block_modules`` cannot trace a side stream's order through more than one level); what lies
  outside every stack (a CLIP text model's embeddings and final norm: small) goes to the compute device.
* :func:`offload_module` keeps an :class:`OffloadRecord` on the instance (``module._lite_boost_offload``)
  with the home device of the weights, the groups and a count of uploads;
  :func:`remove_offload` takes the hooks off and puts the weights back home (``unboost``).
* :func:`check_offload_support` refuses, before anything is modified, an onload device that is not
  there, a side stream on the CPU, and a target that is already offloaded by diffusers / accelerate
  (``enable_model_cpu_offload``, ``enable_sequential_cpu_offload``, ``enable_group_offload``: they
  keep working on a boosted pipeline without ``BoostConfig.offload``, in either order), and
  ``tp_degree > 1`` (not built).

Under ``ParallelManager`` with ``fsdp_degree > 1`` these hooks are not used on what FSDP shards: FSDP2's own
``CPUOffloadPolicy`` keeps the shards in host memory (:func:`lite_boost.parallel.shard.shard_weights`,
:func:`fsdp_cpu_offload_units` counts its units); ``disk_path``, ``num_blocks_per_group`` > 1 and an
onload device other than the rank's are refused there.

On the CPU (onload device = offload device = cpu) the hooks run and count their uploads but move
nothing; ``disk_path`` makes the weights really leave memory between uses there too.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Iterable

import torch
from torch import nn

from .config import BoostConfig, ConfigError, OffloadConfig

__all__ = ["OffloadRecord", "RECORD_ATTR", "check_offload_support", "existing_offload", "layer_stacks",
           "offload_module", "offload_pipeline", "offload_record", "fsdp_cpu_offload_units", "offload_summary", "reapply_user_offload", "remove_offload", "restore_pipeline",
           "resolve_onload_device", "stream_device"]

logger = logging.getLogger("lite_boost.offload")

RECORD_ATTR = "_lite_boost_offload"
PIPELINE_ATTR = "_lite_boost_offload_moved"  # pipeline: {component name: home device} of the modules moved whole
# diffusers' hook names (diffusers.hooks.group_offloading): the group hook and the two that trace the call order.
_GROUP_HOOK = "group_offloading"
_HOOK_NAMES = ("layer_execution_tracker", "lazy_prefetch_group_offloading", _GROUP_HOOK)
# Device types with streams diffusers' hooks can upload on.
STREAM_DEVICE_TYPES = ("cuda", "npu", "xpu")


@dataclass
class OffloadRecord:
    """What :func:`offload_module` did to one module (``module._lite_boost_offload``)."""

    config: OffloadConfig
    onload_device: torch.device
    use_stream: bool
    stacks: tuple[str, ...]  # module paths offloaded block by block ("" = the module itself)
    home: torch.device  # where the weights were before
    moved: dict = field(default_factory=dict)  # tensor -> its home device, for weights outside every stack
    groups: list = field(default_factory=list)  # diffusers' ModuleGroup objects
    onloads: int = 0  # group uploads so far

    @property
    def blocks(self) -> int:
        """Groups of blocks (the groups of what lies outside the blocks not counted)."""
        return sum(1 for g in self.groups if g.onload_leader is not None and any(g.onload_leader is m for m in g.modules))


# ------------------------------------------------------------------------------------------ devices
def stream_device(device: torch.device) -> bool:
    """True where diffusers' hooks can upload on a side stream."""
    return device.type in STREAM_DEVICE_TYPES


def _accelerator() -> torch.device | None:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    npu = getattr(torch, "npu", None)
    try:
        if npu is not None and npu.is_available():
            return torch.device("npu", npu.current_device())
    except (RuntimeError, AttributeError):  # a half-installed torch_npu
        pass
    return None


def _device_available(device: torch.device) -> str | None:
    """None when ``device`` can be used, else why not."""
    if device.type == "cpu":
        return None
    mod = getattr(torch, device.type, None)
    try:
        ok = mod is not None and mod.is_available()
        count = mod.device_count() if ok else 0
    except (RuntimeError, AttributeError):
        ok, count = False, 0
    if not ok:
        return f"no {device.type} device is available here"
    if device.index is not None and device.index >= count:
        return f"{device.type} has {count} device(s) here (indices 0..{count - 1})"
    return None


def _home(module: nn.Module) -> torch.device:
    for t in module.parameters():
        return t.device
    for t in module.buffers():
        return t.device
    return torch.device("cpu")


def resolve_onload_device(config: OffloadConfig, module: nn.Module | None = None) -> torch.device:
    """The device blocks compute on: the config's, else the module's accelerator, else this host's, else cpu."""
    if config.onload_device is not None:
        return torch.device(config.onload_device)
    if module is not None:
        home = _home(module)
        if home.type != "cpu" and home.type != "meta":
            return home
    return _accelerator() or torch.device("cpu")


def _use_stream(config: OffloadConfig, device: torch.device) -> bool:
    return stream_device(device) if config.use_stream is None else config.use_stream


# ------------------------------------------------------------------------------------------ checks
def existing_offload(module: nn.Module) -> str | None:
    """How ``module`` is already offloaded by diffusers or accelerate (not by lite_boost), or None."""
    from diffusers.hooks.group_offloading import _is_group_offload_enabled

    if getattr(module, RECORD_ATTR, None) is not None:
        return None
    if any(getattr(m, RECORD_ATTR, None) is not None for m in module.modules()):
        return None
    if _is_group_offload_enabled(module):
        return "diffusers group offloading (enable_group_offload / apply_group_offloading)"
    for m in module.modules():
        hook = getattr(m, "_hf_hook", None)
        if hook is not None and type(hook).__name__ in ("CpuOffload", "AlignDevicesHook", "SequentialHook",
                                                        "UserCpuOffloadHook"):
            return f"accelerate's {type(hook).__name__} hook (enable_model_cpu_offload / enable_sequential_cpu_offload)"
    return None


def _modules_of(target) -> list[tuple[str, nn.Module]]:
    if isinstance(target, nn.Module):
        return [("", target)]
    comps = getattr(target, "components", None)
    if isinstance(comps, dict):
        return [(n, m) for n, m in comps.items() if isinstance(m, nn.Module)]
    return []


def check_offload_support(target, config: BoostConfig, *, device: torch.device | str | None = None) -> torch.device | None:
    """ConfigError, before anything is modified, when ``config.offload`` cannot run on ``target``.

    Returns the onload device (None when ``config.offload`` is None). ``device`` is the rank's device
    chosen by ``ParallelManager`` (used when ``offload.onload_device`` is None).
    """
    cfg = config.offload
    if cfg is None:
        return None
    if cfg.onload_device is not None:
        onload = torch.device(cfg.onload_device)
    elif device is not None:
        onload = torch.device(device)
    else:
        mods = _modules_of(target)
        onload = resolve_onload_device(cfg, mods[0][1] if mods else None)
    why = _device_available(onload)
    if why is not None:
        here = ["cpu"] + ([str(_accelerator())] if _accelerator() is not None else [])
        raise ConfigError(f"offload.onload_device={str(onload)!r}: {why}; valid onload devices here: {here}")
    if cfg.use_stream and not stream_device(onload):
        raise ConfigError(f"offload.use_stream=True needs an onload device with streams {list(STREAM_DEVICE_TYPES)}, "
                          f"got {str(onload)!r}; valid use_stream here: [None, False]")
    for name, module in _modules_of(target):
        how = existing_offload(module)
        if how is not None:
            what = f"{type(target).__name__}.{name}" if name else type(module).__name__
            raise ConfigError(f"offload (BoostConfig.offload): {what} is already offloaded by {how}; boost without "
                              "offload keeps that offloading (and stays exact), or remove it first "
                              "(pipe.remove_all_hooks() / a fresh load) to use lite_boost's offload")
    par = config.parallel
    tp = getattr(par, "tp_degree", 1)
    if isinstance(tp, int) and tp > 1:
        raise ConfigError(f"offload (BoostConfig.offload) with parallel.tp_degree={tp}: not built (the block offload "
                          "hooks move whole parameters, and a tensor-parallel weight is a DTensor whose local shard "
                          "must stay on its mesh's device). Valid: tp_degree=1 with offload, offload with "
                          "fsdp_degree > 1 (FSDP2's CPUOffloadPolicy), or tp_degree without offload")
    fsdp = getattr(par, "fsdp_degree", 1)
    if isinstance(fsdp, int) and fsdp > 1:
        # FSDP2's CPUOffloadPolicy keeps the shards in host memory and gathers unit by unit on the rank's device
        if cfg.disk_path is not None:
            raise ConfigError(f"offload.disk_path with parallel.fsdp_degree={fsdp}: FSDP2's CPUOffloadPolicy keeps "
                              "the shards in host memory, not in files; valid disk_path with fsdp_degree > 1: [None]")
        if cfg.num_blocks_per_group != 1:
            raise ConfigError(f"offload.num_blocks_per_group={cfg.num_blocks_per_group} with parallel.fsdp_degree="
                              f"{fsdp}: FSDP gathers one block per unit; valid num_blocks_per_group with "
                              "fsdp_degree > 1: [1]")
        if device is not None and cfg.onload_device is not None and not _same_device(onload, torch.device(device)):
            raise ConfigError(f"offload.onload_device={cfg.onload_device!r} with parallel.fsdp_degree={fsdp}: FSDP "
                              f"gathers the blocks on the rank's device; valid onload_device here: [None, "
                              f"{str(torch.device(device))!r}]")
    return onload


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


# ------------------------------------------------------------------------------------------ layer stacks
def layer_stacks(module: nn.Module) -> list[str]:
    """Paths of the modules whose direct children include a layer list (a ``ModuleList`` / ``Sequential``
    of two or more modules with weights), outermost first; nested stacks inside one found are skipped.
    ``[""]`` when the module itself is one (diffusers' transformers)."""
    lists = []
    for name, sub in module.named_modules():
        if not isinstance(sub, (nn.ModuleList, nn.Sequential)) or len(sub) < 2:
            continue
        if sum(1 for m in sub if any(True for _ in m.parameters())) < 2:
            continue
        if any(name.startswith(p + ".") for p in lists):
            continue
        lists.append(name)
    parents = []
    for name in lists:
        parent = name.rpartition(".")[0]
        if parent not in parents:
            parents.append(parent)
    # a stack inside another stack's leftovers is offloaded with that stack (as part of its leftover group)
    return [p for p in parents if not any(q != p and (q == "" or p.startswith(q + ".")) for q in parents)]


def _tensors(module: nn.Module) -> Iterable[torch.Tensor]:
    yield from module.parameters()
    yield from module.buffers()


def _count_onloads(group, record: OffloadRecord) -> None:
    """Count the group's uploads (instance attribute: diffusers' ModuleGroup class is left alone)."""
    inner = group.onload_

    @torch.compiler.disable()
    def onload_():
        record.onloads += 1
        inner()

    group.onload_ = onload_


def _groups(module: nn.Module) -> list:
    seen, out = set(), []
    for m in module.modules():
        registry = getattr(m, "_diffusers_hook", None)
        hook = registry.get_hook(_GROUP_HOOK) if registry is not None else None
        if hook is not None and id(hook.group) not in seen:
            seen.add(id(hook.group))
            out.append(hook.group)
    return out


def offload_module(module: nn.Module, config: OffloadConfig, device: torch.device | None = None) -> OffloadRecord:
    """Offload ``module``'s layer stacks block by block (diffusers' hooks); returns the record it keeps."""
    from diffusers.hooks import apply_group_offloading

    old = getattr(module, RECORD_ATTR, None)
    if old is not None:
        return old
    onload = torch.device(device) if device is not None else resolve_onload_device(config, module)
    use_stream = _use_stream(config, onload)
    stacks = layer_stacks(module)
    record = OffloadRecord(config=config, onload_device=onload, use_stream=use_stream,
                           stacks=tuple(stacks) or ("",), home=_home(module))
    if stacks != [""]:  # weights outside every stack: to the compute device, whole
        inside = {id(t) for p in stacks for t in _tensors(module.get_submodule(p))}
        for t in _tensors(module):
            if id(t) not in inside and t not in record.moved:
                record.moved[t] = t.device
                t.data = t.data.to(onload)
    for path in record.stacks:
        target = module.get_submodule(path) if path else module
        apply_group_offloading(target, onload_device=onload, offload_device=torch.device(config.offload_device),
                               offload_type="block_level", num_blocks_per_group=config.num_blocks_per_group,
                               non_blocking=use_stream, use_stream=use_stream, record_stream=config.record_stream,
                               low_cpu_mem_usage=config.low_cpu_mem_usage, offload_to_disk_path=config.disk_path)
    record.groups = _groups(module)
    for group in record.groups:
        _count_onloads(group, record)
    setattr(module, RECORD_ATTR, record)
    logger.info("offload: %s, %d group(s) of %s on %s (side stream: %s)", type(module).__name__, len(record.groups),
                list(record.stacks), onload, use_stream)
    return record


def reapply_user_offload(module: nn.Module) -> None:
    """Re-apply the user's own diffusers group offloading of ``module`` (not lite_boost's) after its weight
    tensors were swapped (quantization, unboost), so its hooks hold the new tensors (diffusers' own recipe)."""
    if getattr(module, RECORD_ATTR, None) is not None:
        return
    from diffusers.hooks.group_offloading import _is_group_offload_enabled, _maybe_remove_and_reapply_group_offloading

    if _is_group_offload_enabled(module):
        _maybe_remove_and_reapply_group_offloading(module)


def offload_record(module) -> OffloadRecord | None:
    return getattr(module, RECORD_ATTR, None)


def offload_summary(target) -> str:
    """One line: what is offloaded, where it computes, uploads so far (``lite-boost generate``'s summary)."""
    parts, fsdp = [], []
    for name, module in _modules_of(target):
        record = offload_record(module)
        if record is not None:
            parts.append(f"{name or type(module).__name__} ({record.blocks} block groups, {record.onloads} uploads)")
        elif units := fsdp_cpu_offload_units(module):
            fsdp.append(f"{name or type(module).__name__} ({units} FSDP units)")
    if fsdp:
        parts_text = f"; {', '.join(parts)} offloaded block by block" if parts else ""
        return ("offload: FSDP2 CPUOffloadPolicy, shards in host memory, each unit's shards copied to "
                f"{_fsdp_device(target)} for its all-gather: {', '.join(fsdp)}{parts_text}")
    if not parts:
        return "offload: off (weights where they were put)"
    first = next(r for r in (offload_record(m) for _, m in _modules_of(target)) if r is not None)
    how = "next block uploaded on a side stream" if first.use_stream else "each block uploaded when it runs"
    return f"offload: host memory -> {first.onload_device}, {how}: {', '.join(parts)}"


def fsdp_cpu_offload_units(module) -> int:
    """How many FSDP2 units of ``module`` keep their shards in host memory (``CPUOffloadPolicy``; 0: none)."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    n = 0
    for m in module.modules() if isinstance(module, nn.Module) else ():
        get = getattr(m, "_get_fsdp_state", None)
        group = get()._fsdp_param_group if get is not None else None
        n += group is not None and isinstance(group.offload_policy, CPUOffloadPolicy)
    return n


def _fsdp_device(target) -> str:
    for _, module in _modules_of(target):
        for m in module.modules():
            get = getattr(m, "_get_fsdp_state", None)
            if get is not None:
                return str(get()._device)
    return "?"


def remove_offload(module: nn.Module) -> None:
    """Take lite_boost's offload hooks off ``module`` and put its weights back where they were."""
    from diffusers.hooks import HookRegistry

    record = getattr(module, RECORD_ATTR, None)
    if record is None:
        return
    for path in record.stacks:
        target = module.get_submodule(path) if path else module
        registry = HookRegistry.check_if_exists_or_initialize(target)
        for name in _HOOK_NAMES:
            registry.remove_hook(name, recurse=True)
    for group in record.groups:
        group.__dict__.pop("onload_", None)
        if group.offload_to_disk_path is not None and group._is_offloaded_to_disk:
            group.onload_()  # the weights are in the files: read them back
    for t, home in record.moved.items():
        t.data = t.data.to(home)
    for t in _tensors(module):
        if t.device != record.home:
            t.data = t.data.to(record.home)
    delattr(module, RECORD_ATTR)


# ------------------------------------------------------------------------------------------ pipelines
def offload_pipeline(pipe, config: OffloadConfig | None, transformers: Iterable[str],
                     device: torch.device | None = None) -> None:
    """The pipeline's text / image encoders offloaded like its transformers (``config.text_encoder``), its
    other modules (the VAE) moved to ``device`` whole; the transformers themselves are the caller's.
    ``config`` None (or another config than before) first undoes what an earlier call did."""
    skip = set(transformers)
    restore_pipeline(pipe, skip=skip, keep=config, device=device)
    if config is None:
        return
    moved = dict(getattr(pipe, PIPELINE_ATTR, None) or {})
    for name, module in _modules_of(pipe):
        if name in skip or getattr(module, RECORD_ATTR, None) is not None:
            continue
        if config.text_encoder and "encoder" in name and name != "vae":
            offload_module(module, config, device)
        elif name not in moved:
            moved[name] = _home(module)
            module.to(device)
    if moved:
        setattr(pipe, PIPELINE_ATTR, moved)


def restore_pipeline(pipe, *, skip: Iterable[str] = (), keep: OffloadConfig | None = None,
                     device: torch.device | None = None) -> None:
    """Undo :func:`offload_pipeline` for the components not in ``skip`` (except what ``keep`` on
    ``device`` would do again the same way)."""
    moved = dict(getattr(pipe, PIPELINE_ATTR, None) or {})
    for name, module in _modules_of(pipe):
        if name in skip:
            continue
        record = getattr(module, RECORD_ATTR, None)
        if record is not None and (keep is None or record.config != keep or record.onload_device != device):
            remove_offload(module)
        if name in moved and (keep is None or device is None or _home(module) != device):
            module.to(moved.pop(name))
    if moved:
        setattr(pipe, PIPELINE_ATTR, moved)
    elif hasattr(pipe, PIPELINE_ATTR):
        delattr(pipe, PIPELINE_ATTR)
