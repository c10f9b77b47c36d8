"""Weight sharding for inference: FSDP2 (``fully_shard``) and tensor parallelism (DTensor ``parallelize_module``).

Nothing here knows any model: what to shard is found from the model's own declarations (diffusers'
``_repeated_blocks`` / transformers' ``_no_split_modules`` name the block classes; a
:class:`TensorParallelPlan`, from the model family or diffusers' ``_tp_plan``, names the Linear layers).

FSDP2 (:func:`shard_weights`): every block, and every other child module with weights (embeddings,
output projection), gets ``fully_shard(..., reshard_after_forward=True)`` over the mesh's fsdp group,
so a rank keeps ``1 / fsdp_degree`` of each weight and holds one block's full weights (plus the
prefetched next one) at a time. The model itself is no FSDP unit (see :func:`shard_weights`). Each block
prefetches the next block's all-gather (``set_modules_to_forward_prefetch``): the gather is issued when
the current block starts, runs in the backend's background (a side stream on CUDA / NPU, gloo's worker
thread on CPU) and is waited for when the next block starts. A failed or stalled gather raises
:class:`~lite_boost.parallel.comm.CollectiveError` naming ``fsdp_all_gather[<block path>]``, the fsdp
group and the wait. The blocks keep their class names in the instance's ``_repeated_blocks``
(``fully_shard`` gives each sharded module an ``FSDP<Class>`` subclass), so diffusers'
``compile_repeated_blocks`` still finds them (the FSDP hooks are traced with the block).

Quantized weights (torchao tensor subclasses such as ``Int8Tensor`` / ``Float8Tensor``) cannot be given
to ``fully_shard`` as they are: FSDP2 splits a parameter with ``torch.chunk`` (``aten.split``), which
``Int8Tensor`` does not implement. The quantization is therefore done first, on the full weights (as
in one process), and its stored tensors are what FSDP shards: each quantized weight is replaced by its
inner plain tensors (``weight__qdata``, ``weight__scale``, ... from ``__tensor_flatten__``) registered
as frozen parameters, and a forward pre-hook of the Linear layer puts the quantized tensor back
together (``__tensor_unflatten__``) from the gathered inner tensors; a post-hook drops it again. The
int8 / float8 data travels in the all-gather as it is stored: nothing is re-quantized, and the
reassembled weight equals the one-process weight bit for bit. An ``int8_dynamic`` weight is not
reassembled at all: the Linear's instance ``forward`` is one custom op on the gathered tensors
(:func:`lite_boost.ops.quant_int8.int8_linear`), so no compiled graph builds the tensor subclass (Dynamo
cannot construct an ``Int8Tensor`` that carries its activation settings).

Tensor parallelism (:func:`apply_tensor_parallel`): the plan's "colwise" layers (q / k / v, the FFN's
first projection) keep ``1 / tp_degree`` of their output features, the "rowwise" ones (attention
output, FFN's second projection) the matching input features, followed by one all-reduce. Every
attention module above a colwise layer sees its local head count (``heads``, ``inner_dim``, ... set on
the instance, restored on removal), so the processors split heads as before. RMS norms that normalise
across all heads (``TensorParallelPlan.norms``, Wan's ``qk_norm="rms_norm_across_heads"``) become a
distributed RMS norm: the sum of squares is all-reduced over the tp group, each rank scales its own
features by its slice of the weight. A torchao ``Int8Tensor`` weight (``int8_weight_only``) is quantized
on the full weight first, then its stored int8 data and scales are split per style
(:class:`QuantizedTensorParallel`).

Both together (FSDP2 + TP): the tp plan is applied first on the "tp" dimension of one 2-D DeviceMesh
("fsdp", "tp"), then :func:`shard_weights` on its "fsdp" dimension shards the DTensor weights further.

Both are undone by :meth:`remove` (a collective: the full weights are all-gathered back).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from ..config import ConfigError
from ..ops.quant_int8 import (int8_act_absmax, int8_finish, int8_linear, int8_partial_mm, int8_spec,
                              int8_weight_only_mm)
from .comm import Communicator

__all__ = ["TensorParallelPlan", "shard_weights", "apply_tensor_parallel", "check_fsdp", "check_tensor_parallel",
           "check_tensor_parallel_quant",
           "block_class_names", "local_parameter_bytes", "FsdpShards", "PackedWeight", "QuantizedTensorParallel",
           "TensorParallelShards", "HEAD_ATTRS"]

TP_STYLES = ("colwise", "rowwise")
# attributes of an attention module that count heads or head channels: divided by tp_degree on the instance
HEAD_ATTRS = ("heads", "kv_heads", "inner_dim", "inner_kv_dim")


@dataclass(frozen=True)
class TensorParallelPlan:
    """Which Linear layers of a model tensor parallelism splits.

    layers: module path (``*`` = a ``ModuleList`` index, as in diffusers' ``_tp_plan``) -> "colwise"
        (output features split: q / k / v, FFN in) or "rowwise" (input features split, then all-reduced:
        attention out, FFN out); a torch ``ParallelStyle`` is accepted too. Paths that match no module
        (an optional layer the variant lacks, e.g. the I2V image projections of a T2V model) are skipped.
    norms: paths of RMS norms applied to a colwise layer's full output (normalising across all heads):
        computed as a distributed RMS norm over the tp group.
    """

    layers: Mapping[str, Any]
    norms: tuple[str, ...] = ()

    def __post_init__(self):
        if not self.layers:
            raise ValueError("a TensorParallelPlan needs at least one layer")
        for path, style in self.layers.items():
            if isinstance(style, str) and style not in TP_STYLES:
                raise ValueError(f"TensorParallelPlan style of {path!r} must be one of {list(TP_STYLES)} or a "
                                 f"ParallelStyle, got {style!r}")

    @classmethod
    def from_diffusers(cls, tp_plan) -> "TensorParallelPlan | None":
        """The plan of a diffusers model class's ``_tp_plan`` (None when it has none)."""
        return cls(layers=dict(tp_plan)) if tp_plan else None


def _pattern(path: str) -> re.Pattern:
    return re.compile("^" + re.escape(path).replace(r"\*", r"\d+") + "$")


def _match(model, paths) -> list[tuple[str, str, torch.nn.Module]]:
    """(plan path, module name, module) for every module of ``model`` matching one of ``paths``."""
    pats = [(p, _pattern(p)) for p in paths]
    out = []
    for name, module in model.named_modules():
        for path, pat in pats:
            if pat.match(name):
                out.append((path, name, module))
                break
    return out


def _parent(model, name: str):
    return model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def block_class_names(module) -> tuple[str, ...]:
    """The class names of ``module``'s repeated blocks (diffusers' ``_repeated_blocks``, else transformers'
    ``_no_split_modules``)."""
    names = getattr(module, "_repeated_blocks", None) or getattr(module, "_no_split_modules", None) or ()
    return tuple(n for n in names if isinstance(n, str))


def local_parameter_bytes(module) -> int:
    """Bytes of ``module``'s parameters held by this rank (the local shard of a DTensor)."""
    total = 0
    for p in module.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.numel() * local.element_size()
    return total


# ------------------------------------------------------------------------------------------ checks
def _tp_sizes(model, plan: TensorParallelPlan):
    """[(what, size)] that tp_degree must divide, for ``model`` under ``plan``."""
    sizes = []
    heads_seen = set()
    for path, name, module in _match(model, list(plan.layers)):
        style = plan.layers[path]
        weight = getattr(module, "weight", None)
        if not isinstance(module, torch.nn.Linear) and isinstance(getattr(module, "base_layer", None), torch.nn.Linear):
            raise ConfigError(f"tensor-parallel plan entry {path!r}: {name} carries an adapter (a LoRA: "
                              f"{type(module).__module__}.{type(module).__name__} around the Linear layer), which "
                              "tensor parallelism does not split. Fuse it into the weights and drop its layers first "
                              "(pipe.fuse_lora(); pipe.unload_lora_weights()), or use tp_degree=1")
        if not isinstance(module, torch.nn.Linear) or weight is None:
            raise ConfigError(f"tensor-parallel plan entry {path!r} matches {name} ({type(module).__name__}), "
                              "not a Linear layer")
        if style == "rowwise":
            sizes.append((f"the {module.in_features} input features of {name}", module.in_features))
        else:
            sizes.append((f"the {module.out_features} output features of {name}", module.out_features))
            parent = _parent(model, name)
            if id(parent) not in heads_seen and isinstance(getattr(parent, "heads", None), int):
                heads_seen.add(id(parent))
                sizes.append((f"the {parent.heads} attention heads of {name.rsplit('.', 1)[0]}", parent.heads))
    for _, name, norm in _match(model, plan.norms):
        if isinstance(norm, torch.nn.Identity):  # a variant without the norm (qk_norm=None)
            continue
        w = getattr(norm, "weight", None)
        n = w.numel() if w is not None else int(getattr(norm, "normalized_shape", (0,))[-1])
        sizes.append((f"the {n} features of {name}", n))
    return sizes


def check_tensor_parallel(model, plan: TensorParallelPlan | None, tp_degree: int, candidates) -> None:
    """ConfigError, before any collective, when ``model`` cannot be split over ``tp_degree`` ranks.

    ``candidates``: the tp degrees the world size allows (the message lists those that fit the model).
    """
    if tp_degree == 1:
        return
    name = type(model).__name__
    if plan is None:
        raise ConfigError(f"tp_degree={tp_degree}: {name} has no tensor-parallel plan (neither its family record "
                          "nor diffusers' _tp_plan); valid tp_degree: [1]")
    if any(getattr(m, "fused_projections", False) for m in model.modules()):
        raise ConfigError(f"tp_degree={tp_degree}: {name} has fused q/k/v projections (fuse_qkv_projections), "
                          "which the plan does not split; unfuse them (unfuse_qkv_projections) or use tp_degree=1")
    sizes = _tp_sizes(model, plan)
    if not sizes:
        raise ConfigError(f"tp_degree={tp_degree}: the tensor-parallel plan of {name} matches no layer; valid "
                          "tp_degree: [1]")
    bad = [(what, n) for what, n in sizes if n % tp_degree]
    if bad:
        valid = [d for d in candidates if all(n % d == 0 for _, n in sizes)]
        raise ConfigError(f"tp_degree={tp_degree} does not divide {bad[0][0]} of {name}"
                          f"{f' (and {len(bad) - 1} more)' if len(bad) > 1 else ''}; valid tp_degree for this model "
                          f"and world size: {valid}")


# quantization methods whose weights tensor parallelism splits (torchao Int8Tensor data and scales)
TP_QUANT_METHODS = ("int8_weight_only", "int8_dynamic")


def check_tensor_parallel_quant(model, plan: TensorParallelPlan | None, tp_degree: int, quant,
                                layers=None, fsdp_degree: int = 1) -> None:
    """ConfigError, before any collective, when ``quant`` (a QuantConfig) cannot be split over ``tp_degree``
    ranks: a method other than torchao's int8 ones, or a quantized layer (``layers``: the QuantPlan's layer
    names) that the plan splits with another style than "colwise" / "rowwise" (a packed projection)."""
    if tp_degree == 1 or quant is None:
        return
    if quant.method not in TP_QUANT_METHODS:
        raise ConfigError(f"tp_degree={tp_degree} with quant={quant.method!r}: tensor parallelism splits the stored "
                          f"int8 data and scales of torchao's Int8Tensor only; valid quant with tp_degree > 1: "
                          f"{list(TP_QUANT_METHODS)} or None")
    if fsdp_degree > 1:
        raise ConfigError(f"tp_degree={tp_degree} x fsdp_degree={fsdp_degree} with quant={quant.method!r}: the split "
                          "int8 data has not been run under FSDP on the 2-D mesh; valid: quant with tp_degree or "
                          "fsdp_degree alone, or quant=None with both")
    if plan is None or layers is None:
        return
    wanted = set(layers)
    for path, name, _ in _match(model, list(plan.layers)):
        style = plan.layers[path]
        if name in wanted and style not in TP_STYLES:
            raise ConfigError(f"tp_degree={tp_degree} with quant={quant.method!r}: {name} is split as {style!r} "
                              f"(tensor-parallel plan entry {path!r}), which a quantized layer cannot be (only "
                              f"{list(TP_STYLES)}); leave it unquantized (QuantConfig(exclude=[...])) or use "
                              "quant=None")


# quantization methods whose weights FSDP shards (torchao tensor subclasses, split as their inner tensors)
FSDP_QUANT_METHODS = ("int8_dynamic", "int8_weight_only", "fp8")


def check_fsdp(target_name: str, modules, fsdp_degree: int, quant) -> None:
    """ConfigError, before any collective, when the ``modules`` cannot be sharded over ``fsdp_degree`` ranks."""
    if fsdp_degree == 1:
        return
    if quant is not None and quant.method not in FSDP_QUANT_METHODS:
        raise ConfigError(f"fsdp_degree={fsdp_degree} with quant={quant.method!r}: its int8 weight and weight_scale "
                          "are read by an instance forward that FSDP has not been run with on Ascend; valid quant "
                          f"with fsdp_degree > 1: {list(FSDP_QUANT_METHODS)} or None")
    for label, module in modules:
        if not block_class_names(module):
            raise ConfigError(f"fsdp_degree={fsdp_degree}: {target_name}.{label} ({type(module).__name__}) names no "
                              "repeated block class (_repeated_blocks / _no_split_modules) to shard block by block; "
                              "valid fsdp_degree: [1]")


# ------------------------------------------------------------------------------------------ FSDP2
@dataclass
class FsdpShards:
    """What :func:`shard_weights` did to one module (to undo it)."""

    module: torch.nn.Module
    sharded: list  # FSDP units: blocks, the other children with parameters, the root
    blocks: list
    comm: Communicator
    priors: dict = field(default_factory=dict)  # instance attributes replaced (``_repeated_blocks``)
    packed: list = field(default_factory=list)  # quantized weights kept as their inner tensors
    cpu_offload: bool = False  # sharded with FSDP2's CPUOffloadPolicy: the shards live in host memory
    device: torch.device | None = None  # where the units compute (the mesh's device)
    moved: list = field(default_factory=list)  # (tensor, home device): left outside the units, moved to ``device``
    after_remove: Any = None  # called with the module once the full weights are back (``remove``)

    def remove(self) -> None:
        """All-gather the full weights back and take FSDP off (collective: every rank of the group).

        With ``cpu_offload`` the shards are uploaded to the mesh's device for the gather and the full
        weights are put back in host memory, where the shards were."""
        from torch.distributed._composable_state import _module_state_mapping
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.tensor import DTensor

        module = self.module
        full = {}
        owners = {}  # id(parameter) -> every name it is registered under (a tied embedding has two)
        for name, p in module.named_parameters(remove_duplicate=False):
            owners.setdefault(id(p), []).append(name)
        for name, p in module.named_parameters():
            if isinstance(p, DTensor):
                home = p.to_local().device
                gather = p
                if self.device is not None and home != self.device:  # a host shard: gathered on the device
                    gather = DTensor.from_local(p.to_local().to(self.device), p.device_mesh, p.placements,
                                                run_check=False, shape=p.shape, stride=p.stride())
                tensor = self.comm._call("fsdp_all_gather[unshard]", _full_tensor, gather)
                full[name] = (tensor.to(home), p.requires_grad, owners[id(p)])
        for m in self.sharded:
            state = m._get_fsdp_state()
            for handle in {id(h): h for h in (state._pre_forward_hook_handle, state._post_forward_hook_handle)}.values():
                handle.remove()
            group = state._fsdp_param_group
            if group is not None:
                for handles in (group._module_to_pre_save_state_dict_hook_handle,
                                group._module_to_pre_load_state_dict_hook_handle):
                    for h in handles.values():
                        h.remove()
            _module_state_mapping.pop(m, None)
            cls = type(m)
            if issubclass(cls, FSDPModule):
                m.__class__ = next(b for b in cls.__mro__[1:] if not issubclass(b, FSDPModule) and b is not object)
        for tensor, requires_grad, names in full.values():
            param = torch.nn.Parameter(tensor, requires_grad=requires_grad)
            for name in names:  # the same parameter on every module that shares it
                _parent(module, name).register_parameter(name.rsplit(".", 1)[-1], param)
        for name, value in self.priors.items():
            if value is None:
                module.__dict__.pop(name, None)
            else:
                setattr(module, name, value)
        for packed in self.packed:
            packed.unpack()
        for tensor, home in self.moved:
            tensor.data = tensor.data.to(home)
        self.sharded, self.packed, self.moved = [], [], []
        after, self.after_remove = self.after_remove, None
        if after is not None:
            after(module)


def _full_tensor(p) -> torch.Tensor:
    """The full tensor of DTensor ``p``; on a 2-D fsdp x tp mesh the fsdp dimension is gathered first, then the tp
    one (one all-gather each: torch will not merge the two when both shard the same dimension)."""
    from torch.distributed.tensor import Replicate

    if p.device_mesh.ndim == 2:
        p = p.redistribute(p.device_mesh, (Replicate(), p.placements[1]))
    return p.full_tensor()


PACKED_SEP = "__"  # weight -> weight__qdata, weight__scale, ...


class PackedWeight:
    """A quantized (tensor-subclass) ``weight`` of ``module`` kept as its inner plain tensors, which FSDP
    can shard; the quantized tensor is put back together from them for each call (see the module doc)."""

    def __init__(self, module: torch.nn.Module, name: str = "weight"):
        weight = getattr(module, name)
        self.module, self.name = module, name
        self.inner, self.ctx = weight.__tensor_flatten__()
        self.cls, self.size, self.stride = type(weight), weight.size(), weight.stride()
        self.requires_grad = weight.requires_grad
        del module._parameters[name]
        for key in self.inner:
            t = getattr(weight, key)
            if t.ndim == 0:  # a per-tensor scalar: FSDP shards along dim 0, so it stays whole (a buffer)
                module.register_buffer(self._key(key), t)
            else:
                module.register_parameter(self._key(key), torch.nn.Parameter(t, requires_grad=False))
        module.__dict__[name] = None
        # torchao's int8-dynamic weight: computed from the gathered tensors by a custom op, so that no graph
        # builds the tensor subclass (Dynamo cannot construct its activation settings); weight-only and
        # the others are put back together for each call
        self.spec = int8_spec(weight) if name == "weight" else None
        self.prior_forward = module.__dict__.get("forward")  # a quantization's own instance forward, put back after
        if self.spec is not None and self.spec.dynamic:
            module.forward = self._int8_forward
            self.handles = []
        else:
            self.handles = [module.register_forward_pre_hook(self._pack), module.register_forward_hook(self._drop)]

    def _key(self, key: str) -> str:
        return f"{self.name}{PACKED_SEP}{key}"

    def _assemble(self, module):
        inner = {k: getattr(module, self._key(k)) for k in self.inner}
        return self.cls.__tensor_unflatten__(inner, self.ctx, self.size, self.stride)

    def _int8_forward(self, x):
        module = self.module
        inner = {k: getattr(module, self._key(k)) for k in self.inner}
        return int8_linear(x, inner["qdata"], inner["scale"], inner.get("zero_point"), module.bias, self.spec)

    def _pack(self, module, args):
        setattr(module, self.name, self._assemble(module))  # a plain attribute: no parameter of that name

    def _drop(self, module, args, output):
        setattr(module, self.name, None)

    def unpack(self) -> None:
        """Register the quantized tensor as ``weight`` again (after FSDP's removal gathered the inner tensors)."""
        module = self.module
        for h in self.handles:
            h.remove()
        if module.__dict__.get("forward") == self._int8_forward:
            del module.__dict__["forward"]
            if self.prior_forward is not None:
                module.forward = self.prior_forward
        weight = self._assemble(module)
        for key in self.inner:
            module._parameters.pop(self._key(key), None)
            module._buffers.pop(self._key(key), None)
        module.__dict__.pop(self.name, None)
        module.register_parameter(self.name, torch.nn.Parameter(weight, requires_grad=self.requires_grad))


def _subclass_weight(module) -> bool:
    """Whether ``module.weight`` is a wrapper tensor subclass (a torchao quantized weight), not a DTensor."""
    from torch.distributed.tensor import DTensor

    w = module._parameters.get("weight") if isinstance(module, torch.nn.Module) else None
    return (w is not None and type(w) not in (torch.Tensor, torch.nn.Parameter) and not isinstance(w, DTensor)
            and hasattr(w, "__tensor_flatten__"))


def _named_errors(group, name: str, comm: Communicator) -> None:
    """Make a failed or stalled all-gather of FSDP param group ``group`` raise CollectiveError naming it."""
    op = f"fsdp_all_gather[{name or 'root'}]"
    for attr in ("unshard", "wait_for_unshard"):
        inner = getattr(group, attr)

        def wrapped(*args, _inner=inner, **kwargs):
            if torch.compiler.is_compiling():
                return _inner(*args, **kwargs)
            return comm._call(op, _inner, *args, **kwargs)

        setattr(group, attr, wrapped)


def _units(module, names):
    """(blocks, other units) of ``module``: its repeated blocks (outermost), and the direct children with
    parameters next to them (embeddings, output projections), descending into children that hold blocks."""
    blocks, others = [], []

    def walk(prefix, mod):
        for child_name, child in mod.named_children():
            path = f"{prefix}{child_name}"
            if type(child).__name__ in names:
                blocks.append((path, child))
            elif any(type(m).__name__ in names for m in child.modules()):
                walk(path + ".", child)
            elif any(True for _ in child.parameters()):
                others.append((path, child))

    walk("", module)
    # a parameter shared by two units (tied embeddings) stays whole: FSDP would split one owner only
    owners = {}
    for path, unit in blocks + others:
        for p in unit.parameters():
            owners.setdefault(id(p), set()).add(path)
    tied = {path for paths in owners.values() if len(paths) > 1 for path in paths}
    return [(p, m) for p, m in blocks if p not in tied], [(p, m) for p, m in others if p not in tied]


def shard_weights(module: torch.nn.Module, mesh, comm: Communicator, *, prefetch: bool = True,
                  root_params: bool = False, cpu_offload: bool = False, pin_memory: bool = False,
                  after_remove=None) -> FsdpShards:
    """``fully_shard`` ``module`` over ``mesh`` (a 1-D DeviceMesh of the fsdp group ``comm``; with tensor
    parallelism the "fsdp" dimension of the 2-D ("fsdp", "tp") mesh whose "tp" dimension holds the DTensor
    weights :func:`apply_tensor_parallel` made, which FSDP then shards further) unit by unit.

    Units: every repeated block, every other child holding parameters (embeddings, output projection),
    then ``module`` itself as the FSDP root (it sets up the shared communication state; each block
    prefetches the next block's all-gather). ``root_params``: whether the root unit also shards the
    parameters left outside the units (registered on ``module`` itself, or tied between two children);
    False keeps them whole and leaves the root with nothing to gather, so an instance wrapper of
    ``forward`` that skips the computation on some ranks (CFG parallelism's deferred pass) issues no
    all-gather there.

    ``cpu_offload``: shard with FSDP2's own ``CPUOffloadPolicy(pin_memory=pin_memory)``: the shards stay in
    host memory and each unit's shards are copied to the mesh's device for its all-gather (the prefetched
    gather of the next block included); the parameters left outside the units (kept whole) are moved to
    the mesh's device, and put back by :meth:`FsdpShards.remove`. On a CPU mesh host and device are the
    same memory: the policy's copies move nothing there. ``after_remove(module)``: called by
    :meth:`FsdpShards.remove` once the full weights are back (e.g. to offload them block by block again).
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    policy = CPUOffloadPolicy(pin_memory=pin_memory) if cpu_offload else OffloadPolicy()
    blocks, others = _units(module, block_class_names(module))
    shards = FsdpShards(module=module, sharded=[], blocks=[m for _, m in blocks], comm=comm, cpu_offload=cpu_offload,
                        after_remove=after_remove)
    shards.packed = [PackedWeight(m) for m in module.modules() if _subclass_weight(m)]
    for path, unit in blocks + others:
        fully_shard(unit, mesh=mesh, reshard_after_forward=True, offload_policy=policy)
        shards.sharded.append(unit)
    in_units = {id(p) for _, unit in blocks + others for p in unit.parameters()}
    ignored = None if root_params else {p for p in module.parameters() if id(p) not in in_units}
    fully_shard(module, mesh=mesh, reshard_after_forward=True, ignored_params=ignored or None, offload_policy=policy)
    shards.sharded.append(module)
    shards.device = module._get_fsdp_state()._device
    if cpu_offload:  # what FSDP leaves whole computes on the device (fully_shard moved the units' buffers)
        for t in list(ignored or ()) + list(module.buffers()):
            if t.device != shards.device:
                shards.moved.append((t, t.device))
                t.data = t.data.to(shards.device)
    for path, unit in blocks + others + [("", module)]:
        group = unit._get_fsdp_state()._fsdp_param_group
        if group is not None:
            _named_errors(group, path, comm)
    if prefetch:
        for (_, a), (_, b) in zip(blocks, blocks[1:]):
            a.set_modules_to_forward_prefetch([b])
    # diffusers' compile_repeated_blocks matches class names: add the FSDP subclasses' names
    repeated = getattr(module, "_repeated_blocks", None)
    if repeated:
        shards.priors["_repeated_blocks"] = module.__dict__.get("_repeated_blocks")
        module._repeated_blocks = list(repeated) + [f"FSDP{n}" for n in repeated]
    return shards


# ------------------------------------------------------------------------------------------ tensor parallel
class DistributedRMSNorm:
    """Instance ``forward`` of an RMS norm whose input is this rank's slice of the normalised features."""

    def __init__(self, norm, comm: Communicator, start: int, stop: int):
        self.norm = norm
        self.comm = comm
        full = getattr(norm, "weight", None)
        self.features = full.numel() if full is not None else int(norm.normalized_shape[-1])
        self.weight = None if full is None else full.detach()[start:stop].clone()
        eps = getattr(norm, "eps", None)
        self.eps = torch.finfo(torch.float32).eps if eps is None else eps

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        features = self.features
        sq = x.float().pow(2).sum(-1, keepdim=True)
        if torch.compiler.is_compiling():
            sq = funcol.all_reduce(sq, "sum", self.comm._funcol_group)
        else:
            self.comm._call("tp_norm_all_reduce", dist.all_reduce, sq, group=self.comm.group)
        out = x.float() * torch.rsqrt(sq / features + self.eps)
        if self.weight is not None:
            out = out * self.weight.to(out.device, torch.float32)
        return out.to(x.dtype)


@dataclass
class TensorParallelShards:
    """What :func:`apply_tensor_parallel` did to one model (to undo it)."""

    model: torch.nn.Module
    comm: Communicator
    layers: list = field(default_factory=list)  # (module, new pre-hook ids, new hook ids)
    heads: list = field(default_factory=list)  # (module, {attr: original})
    norms: list = field(default_factory=list)  # norm modules with an instance forward
    packed: dict = field(default_factory=dict)  # id(module) -> {param name: (dim, block sizes)} (packed layers)
    quantized: list = field(default_factory=list)  # QuantizedTensorParallel layers

    def remove(self) -> None:
        """All-gather the full weights back, drop the hooks, restore head counts (collective over the tp group)."""
        from torch.distributed.tensor import DTensor

        for module, pre, post in self.layers:
            for name, p in list(module.named_parameters(recurse=False)):
                # a packed layer's parameter is reordered whether gathered here or already by FSDP's removal (fsdp x
                # tp: the 2-D DTensor's full tensor has the same rank-major order)
                layout = self.packed.get(id(module), {}).get(name)
                if isinstance(p, DTensor) or layout is not None:
                    full = self.comm._call("tp_all_gather[unshard]", p.full_tensor) if isinstance(p, DTensor) else p
                    if layout is not None:
                        full = _unpacked(full.detach(), *layout, self.comm.size)
                    module.register_parameter(name, torch.nn.Parameter(full, requires_grad=p.requires_grad))
            for key in pre:
                module._forward_pre_hooks.pop(key, None)
            for key in post:
                module._forward_hooks.pop(key, None)
        for layer in self.quantized:
            layer.unshard()
        for module, originals in self.heads:
            for attr, value in originals.items():
                setattr(module, attr, value)
        for norm in self.norms:
            norm.__dict__.pop("forward", None)
        self.layers, self.heads, self.norms, self.packed, self.quantized = [], [], [], {}, []


def _packed_layout(style, module) -> dict:
    """{param name: (dim, block sizes)} of a packed layer (diffusers' ``PackedColwiseParallel`` /
    ``PackedRowwiseParallel``, or a style that stores ``_tp_packed_col_blocks`` / ``_tp_packed_row_blocks`` on
    the layer): each block of the fused dimension is split over the ranks on its own. {} for a plain layer."""
    if isinstance(style, str):
        return {}
    try:
        from diffusers.hooks.tensor_parallel import PackedColwiseParallel, PackedRowwiseParallel
    except ImportError:  # pragma: no cover - older diffusers
        PackedColwiseParallel = PackedRowwiseParallel = ()
    col, row = getattr(module, "_tp_packed_col_blocks", None), getattr(module, "_tp_packed_row_blocks", None)
    if isinstance(style, PackedColwiseParallel):
        col, row = style.blocks or col, None
    elif isinstance(style, PackedRowwiseParallel):
        col, row = None, style.blocks or row
    out = {}
    for name, p in module.named_parameters(recurse=False):
        if col and p.ndim >= 1:
            out[name] = (0, _block_sizes(p.shape[0], col))
        elif row and name == "weight":
            out[name] = (1, _block_sizes(p.shape[1], row))
    return out


def _block_sizes(total: int, blocks) -> list[int]:
    unit = total // sum(blocks)
    return [b * unit for b in blocks]


def _unpacked(full: torch.Tensor, dim: int, sizes, tp: int) -> torch.Tensor:
    """A packed layer's gathered parameter (rank 0's part of every block, then rank 1's, ...) in the layer's
    own order (block 0 whole, then block 1, ...)."""
    ranks = [part.split([s // tp for s in sizes], dim) for part in full.chunk(tp, dim)]
    return torch.cat([ranks[r][b] for b in range(len(sizes)) for r in range(tp)], dim)


class QuantizedTensorParallel:
    """A torchao ``Int8Tensor`` Linear (``int8_weight_only`` / ``int8_dynamic``) split over the tp group: the
    quantization was done on the full weight (as in one process); this rank keeps its part of the stored
    int8 data and scales, as plain frozen parameters (``weight__qdata``, ``weight__scale``, ...), and an
    instance ``forward`` computes from them with torchao's arithmetic (:mod:`lite_boost.ops.quant_int8`).

    "colwise": the output rows of ``qdata``, ``scale``, ``zero_point`` and ``bias`` are split; each rank
    computes its output features. "rowwise": the input columns of ``qdata`` are split, the per-output-row
    scale and the bias stay whole. int8_weight_only: the partial products are all-reduced, then scaled.
    int8_dynamic: each token's activation scale must be the whole row's, so the per-token absmax is
    all-reduced (MAX, ``tp_act_absmax[<layer>]``) before this rank quantizes its slice; the int32 partial
    products are all-reduced (SUM, exact) and scaled as torchao does, so the result equals one process.
    """

    def __init__(self, module: torch.nn.Linear, style: str, comm: Communicator, name: str):
        weight = module.weight
        self.module, self.style, self.comm, self.name = module, style, comm, name
        self.spec = int8_spec(weight)
        self.inner, self.ctx = weight.__tensor_flatten__()
        self.cls, self.size, self.stride = type(weight), weight.size(), weight.stride()
        self.requires_grad = weight.requires_grad
        self.bias_requires_grad = module.bias.requires_grad if module.bias is not None else False
        rows = style == "colwise"
        del module._parameters["weight"]
        for key in self.inner:
            t = getattr(weight, key)
            local = self._local(t, rows or key == "qdata", rows)
            module.register_parameter(self._key(key), torch.nn.Parameter(local, requires_grad=False))
        if rows and module.bias is not None:
            module.bias = torch.nn.Parameter(self._local(module.bias.detach(), True, True),
                                             requires_grad=self.bias_requires_grad)
        module.__dict__["weight"] = None
        self.prior_forward = module.__dict__.get("forward")  # a quantization's own instance forward, put back after
        module.forward = self.forward

    def _key(self, key: str) -> str:
        return f"weight{PACKED_SEP}{key}"

    def _local(self, t: torch.Tensor, split: bool, rows: bool) -> torch.Tensor:
        if not split:  # a rowwise layer's per-row scale / zero point: whole
            return t.detach().clone()
        dim = 0 if rows else t.ndim - 1
        part = t.shape[dim] // self.comm.size
        return t.detach().narrow(dim, self.comm.rank * part, part).contiguous().clone()

    def _all_reduce(self, t: torch.Tensor, op: str, what: str) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return funcol.all_reduce(t, op, self.comm._funcol_group)
        red = dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM
        self.comm._call(f"{what}[{self.name}]", functools.partial(dist.all_reduce, op=red, group=self.comm.group), t)
        return t

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = self.module
        q, scale = m.weight__qdata, m.weight__scale
        zero_point = getattr(m, "weight__zero_point", None)
        if self.style == "colwise":
            return int8_linear(x, q, scale, zero_point, m.bias, self.spec)
        if self.spec.dynamic:
            absmax = self._all_reduce(int8_act_absmax(x), "max", "tp_act_absmax")
            c, x_scale = int8_partial_mm(x, absmax, q, self.spec)
            c = self._all_reduce(c, "sum", "tp_all_reduce")
            return int8_finish(c, x_scale, scale, m.bias, x)
        out_dtype = x.dtype
        y = self._all_reduce(int8_weight_only_mm(x, q), "sum", "tp_all_reduce")
        y = (y * scale.to(y.dtype).flatten()).reshape(*x.shape[:-1], q.shape[0])  # torchao's weight-only order
        if m.bias is not None:
            y += m.bias
        return y.to(out_dtype)

    def unshard(self) -> None:
        """All-gather this layer's parts and register the quantized weight again (collective over the tp group)."""
        m, comm, rows = self.module, self.comm, self.style == "colwise"
        inner = {}
        for key in self.inner:
            local = m._parameters.pop(self._key(key))
            if rows or key == "qdata":
                inner[key] = comm.gather(local.detach(), 0 if rows else -1, op="tp_all_gather[unshard]")
            else:
                inner[key] = local.detach()
        if rows and m.bias is not None:
            m.bias = torch.nn.Parameter(comm.gather(m.bias.detach(), 0, op="tp_all_gather[unshard]"),
                                        requires_grad=self.bias_requires_grad)
        m.__dict__.pop("forward", None)
        if self.prior_forward is not None:
            m.forward = self.prior_forward
        m.__dict__.pop("weight", None)
        weight = self.cls.__tensor_unflatten__(inner, self.ctx, self.size, self.stride)
        m.register_parameter("weight", torch.nn.Parameter(weight, requires_grad=self.requires_grad))


def _style(style):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if style == "colwise":
        return ColwiseParallel()
    if style == "rowwise":
        return RowwiseParallel()
    try:  # diffusers' packed markers (Flux's fused single-block projection)
        from diffusers.hooks.tensor_parallel import _styles
    except ImportError:  # pragma: no cover - older diffusers
        return style
    return _styles({"x": style})["x"] if not hasattr(style, "_apply") else style


def _named_wait(comm: Communicator, op: str, module, args, output):
    """Forward hook after a layer's DTensor output hook: a row-wise layer's output all-reduce is issued
    asynchronously (an ``AsyncCollectiveTensor``); wait for it here, so that a dead or stalled peer raises
    :class:`~lite_boost.parallel.comm.CollectiveError` naming this all-reduce and the tp group."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    if isinstance(output, AsyncCollectiveTensor) and not torch.compiler.is_compiling():
        return comm._call(op, output.trigger_wait)
    return output


def apply_tensor_parallel(model, plan: TensorParallelPlan, mesh, comm: Communicator) -> TensorParallelShards:
    """Split ``model``'s planned layers over the 1-D DeviceMesh ``mesh`` of the tp group ``comm``."""
    from torch.distributed.tensor.parallel import parallelize_module

    tp = comm.size
    shards = TensorParallelShards(model=model, comm=comm)
    for path, name, module in _match(model, list(plan.layers)):
        if _subclass_weight(module):  # a torchao int8 weight (check_tensor_parallel_quant took the others)
            shards.quantized.append(QuantizedTensorParallel(module, plan.layers[path], comm, name))
        else:
            pre, post = set(module._forward_pre_hooks), set(module._forward_hooks)
            parallelize_module(module, mesh, _style(plan.layers[path]))
            layout = _packed_layout(plan.layers[path], module)
            if layout:
                shards.packed[id(module)] = layout
            module.register_forward_hook(functools.partial(_named_wait, comm, f"tp_all_reduce[{name}]"))
            shards.layers.append((module, set(module._forward_pre_hooks) - pre, set(module._forward_hooks) - post))
        if plan.layers[path] != "rowwise":
            parent = _parent(model, name)
            if isinstance(getattr(parent, "heads", None), int) and all(parent is not m for m, _ in shards.heads):
                originals = {a: getattr(parent, a) for a in HEAD_ATTRS if isinstance(getattr(parent, a, None), int)}
                for attr, value in originals.items():
                    setattr(parent, attr, value // tp)
                shards.heads.append((parent, originals))
    for _, name, norm in _match(model, plan.norms):
        if isinstance(norm, torch.nn.Identity):
            continue
        w = getattr(norm, "weight", None)
        n = w.numel() if w is not None else int(norm.normalized_shape[-1])
        part = n // tp
        norm.forward = DistributedRMSNorm(norm, comm, comm.rank * part, (comm.rank + 1) * part)
        shards.norms.append(norm)
    return shards

