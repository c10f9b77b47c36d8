"""Per-rank memory of a transformer under each parallel layout, and the layout to use (``lite-boost plan``).

Pure arithmetic on a :class:`ModelDims` record (parameter counts and widths) and a token count: no model
is imported here, nothing is allocated. :meth:`ModelDims.from_module` reads the counts from any module,
typically one built on the meta device (``with torch.device("meta")``: no weights are read or allocated);
:func:`plan_layouts` lists every candidate layout for a number of ranks with its per-rank weights,
activations and attention working set, marks what fits a device's memory and recommends one.

The model (per rank, one transformer call, inference: no autograd state):

* **weights** of the transformer at rest: replicated = all of them; ``tp_degree`` t = the blocks' Linear
  layers / t (attention heads and FFN columns / rows), the rest whole; ``fsdp_degree`` f = everything / f;
  both (FSDP over the ranks with the same tp rank) = (the blocks' Linear layers / t + the rest) / f, i.e. the
  split Linears / (t x f); ``offload`` = what lies outside the blocks plus two blocks (the running one and the
  one being uploaded); ``offload`` with ``fsdp_degree`` f (FSDP2's ``CPUOffloadPolicy``) = nothing at rest:
  the rank's shards, everything / f, wait in host memory (``Estimate.host_weights``, like the blocks plain
  offload keeps there).
* **FSDP gather working set** (``gather``, during a call only): the unsharded parameters a rank holds while
  it computes one block and prefetches the next, :func:`fsdp_gather_blocks` x the largest block (with
  ``tp_degree`` t: one tp shard of it, its Linear layers / t). The multiple
  depends on the collective backend (:data:`FSDP_GATHER_BLOCKS`): on gloo, 4 whole blocks, measured
  (``benchmarks/bench_memory.py``: each rank grows by 4.0 blocks during a call at fsdp 2 and at fsdp 4 alike:
  the all-gather output, FSDP2's copy-in / copy-out buffers and gloo's own staging, for the running block
  and the prefetched one); on NCCL / HCCL (and by default) 2 x (f - 1) / f blocks, the running and the
  prefetched block less the rank's own shard: an assumption, not measured. With offload
  (:func:`fsdp_offload_gather_blocks`) the own shard is uploaded too: 2 + 1 / f blocks on NCCL / HCCL (the two
  blocks whole and the shard upload the prefetched gather reads; assumed), gloo's 4 on the CPU.
* **text encoder** weights, resident while the transformer runs (they are not freed after encoding):
  whole, / f under FSDP (``fsdp_text_encoder``) plus its own gather working set (the same multiple of its
  largest block, counted as if it overlapped the transformer's: conservative), two blocks under offload, only
  that gather working set under FSDP with offload (its shards in host memory).
* **activations** at the peak inside one block (tokens per rank S = tokens / (ulysses x ring)), the largest of
  the attention phase (residual + modulated input (2 x S x hidden) + q, k, v, output (4 x S x attention width
  / t) + the fp32 temporaries of the q / k RMS norms (S x width / t in fp32) + Ulysses' all_to_all receive
  buffers (3 x S x width / t when ulysses > 1) + Ring's K / V chunks in flight (4 x S x width / t when
  ring > 1)), the FFN phase (2 x S x hidden + the two FFN-wide tensors 2 x S x ffn / t) and the gated
  residual update after the FFN (4 x S x hidden + three fp32 temporaries: diffusers' DiT blocks modulate
  and gate in fp32, which makes this the peak of Wan's block), plus the fp32 RoPE tables (S x head_dim)
  and the text context (6 x text tokens x hidden: the embedded context, its MLP and one cross-attention
  K / V). The terms follow diffusers' Wan block line by line; ``benchmarks/bench_memory.py`` checks them
  against measured peaks.
* **attention working set**: q, k, v and the output of the heads this rank attends over the sequence it
  sees (part of the activations above, shown on its own).

Layouts are ranked by the bytes each rank moves per transformer call (Ulysses all_to_all, Ring K / V,
TP all-reduce, FSDP all-gather, host uploads of offloaded blocks (under FSDP: of the rank's shards) weighted x4
for the slower host link);
the recommendation is the fitting layout that moves least (then the smallest). The device total leaves
out the VAE (its decode runs after the transformer, with its own parallel modes), the framework's own
device memory (CUDA / CANN context, allocator slack: ``headroom`` keeps 10% of the device free for them) and
temporary buffers of individual kernels.

**Host memory of the runtime** (``Estimate.host``, not in the device total): every process holds the
libraries it loads before any weight, :data:`HOST_RUNTIME_BYTES` = :data:`HOST_TORCH_BYTES` (the
interpreter and ``import torch``) + :data:`HOST_LIBRARIES_BYTES` (diffusers, lite_boost and its operator
library). On an accelerator this is host memory, so it is reported beside the device total and never
compared with ``device_memory``; on the CPU, where host and device are the same memory, the measured
resident set is device total + host constant (``benchmarks/bench_memory.py`` starts counting after
``import torch``, so it compares against device total + :data:`HOST_LIBRARIES_BYTES`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from torch import nn

from .config import ConfigError, parse_bytes

__all__ = ["ModelDims", "Layout", "Estimate", "MemoryPlan", "estimate", "candidate_layouts", "plan_layouts",
           "token_count", "format_plan", "meta_model", "dims_for_family", "dims_for_model_dir", "DTYPE_BYTES",
           "HOST_LINK_FACTOR", "GiB", "MiB", "DEFAULT_SHAPE", "HOST_TORCH_BYTES", "HOST_LIBRARIES_BYTES",
           "HOST_RUNTIME_BYTES", "FSDP_GATHER_BLOCKS", "fsdp_gather_blocks", "fsdp_offload_gather_blocks"]

GiB = 1024 ** 3
MiB = 1024 ** 2
HOST_LINK_FACTOR = 4  # a byte uploaded from the host costs this many bytes moved between devices

# Resident host memory of one process before any weight, measured on the CPU machine of the benchmarks
# (Intel Xeon family 6 model 167, Linux x86-64, Python 3.11, torch 2.13 CPU build, diffusers, one thread,
# MALLOC_MMAP_THRESHOLD_=65536; VmRSS read at each step, the same to 0.1 MiB on a rerun): the interpreter 11 MiB,
# ``import torch`` 266 MiB more, ``import diffusers, lite_boost`` 166.5 MiB more, loading lite_boost's operator
# library (``lite_boost.ops._ext.load()``) 3 MiB more. These differ by platform and build (a CUDA or NPU build of
# torch maps more libraries, another allocator keeps more or less; 17 MiB was seen for the libraries on another
# machine): treat them as an order of magnitude elsewhere. The accelerator's own context (CUDA / CANN) is device
# memory and is not in them (``headroom`` covers it).
HOST_TORCH_BYTES = 277 * MiB  # the interpreter + ``import torch``
HOST_LIBRARIES_BYTES = 170 * MiB  # diffusers + lite_boost + the operator library, on top of torch
HOST_RUNTIME_BYTES = HOST_TORCH_BYTES + HOST_LIBRARIES_BYTES

# Unsharded blocks each rank holds at the peak of an FSDP call, per torch.distributed backend (whole blocks, any
# fsdp degree). gloo: measured by benchmarks/bench_memory.py (Wan2.1-14B block dims, 670 MiB blocks in bf16): a
# rank's resident set grows by 2691 MiB during a call at fsdp 2 and fsdp 4 alike, 4.0 blocks with the activations
# (the all-gather output, FSDP2's copy-in / copy-out buffers, gloo's staging, for the running and the prefetched
# block; 3.9 blocks without the call's 43-56 MiB of activations). A backend not listed (nccl, hccl: not
# measured) gets 2 x (f - 1) / f blocks, see fsdp_gather_blocks.
FSDP_GATHER_BLOCKS = {"gloo": 4.0}
_BACKENDS = (None, "gloo", "nccl", "hccl")


def fsdp_offload_gather_blocks(fsdp: int, backend: str | None = None) -> float:
    """How many blocks' worth of device memory a rank holds at the peak of a call under ``fsdp``-way FSDP with
    ``offload`` (FSDP2's ``CPUOffloadPolicy``: the shards wait in host memory). NCCL / HCCL: 2 + 1 / f, the
    running block and the prefetched one whole (the rank's own shard uploaded with them) plus the shard upload
    the prefetched gather reads from, an assumption that no measurement has checked. gloo: the same multiple as
    without offload (on the CPU host and device are one memory, the policy copies nothing)."""
    if backend not in _BACKENDS:
        raise ConfigError(f"backend must be one of {list(_BACKENDS)}, got {backend!r}")
    if fsdp <= 1:
        return 0.0
    if backend in FSDP_GATHER_BLOCKS:
        return FSDP_GATHER_BLOCKS[backend]
    return 2 + 1 / fsdp


def fsdp_gather_blocks(fsdp: int, backend: str | None = None) -> float:
    """How many unsharded blocks a rank holds at the peak of a call under ``fsdp``-way FSDP on ``backend``
    (None = an accelerator's collective library, NCCL / HCCL). 0 without FSDP. gloo: 4, measured; NCCL / HCCL:
    2 x (f - 1) / f (the running block and the prefetched one, less the rank's own shard), an assumption that
    no measurement has checked."""
    if backend not in _BACKENDS:
        raise ConfigError(f"backend must be one of {list(_BACKENDS)}, got {backend!r}")
    if fsdp <= 1:
        return 0.0
    return FSDP_GATHER_BLOCKS.get(backend, 2 * (fsdp - 1) / fsdp)


@dataclass(frozen=True)
class ModelDims:
    """What the memory model needs to know about one transformer (and its pipeline's text encoder).

    layers: transformer blocks (all block lists together). block_params: the largest block's parameters;
    blocks_params: all blocks together; blocks_linear_params: of those, the Linear layers' (what
    ``tp_degree`` splits). other_params: parameters outside the blocks. hidden: the residual width;
    attn_width: heads x head_dim; ffn: the feed-forward width. joint_text: text tokens join the
    self-attention sequence (``text_tokens`` of them). text_encoder_*: the same counts for the text
    encoder (0 = none). dtype_bytes: bytes per weight and activation element. patch / vae_scale: (t, h, w)
    patch size and VAE down-sampling, for :func:`token_count`. cfg_batched: the pipeline stacks the two
    CFG branches on the batch (activations x 2 unless ``cfg_degree`` is 2).
    """

    name: str
    layers: int
    heads: int
    head_dim: int
    hidden: int
    attn_width: int
    ffn: int
    block_params: int
    blocks_params: int
    blocks_linear_params: int
    other_params: int
    dtype_bytes: int = 2
    joint_text: bool = False
    text_tokens: int = 512
    text_encoder_params: int = 0
    text_encoder_block_params: int = 0
    text_encoder_blocks_params: int = 0
    patch: tuple[int, int, int] = (1, 2, 2)
    vae_scale: tuple[int, int, int] = (4, 8, 8)
    cfg_batched: bool = False

    @property
    def params(self) -> int:
        return self.blocks_params + self.other_params

    @classmethod
    def from_module(cls, model: nn.Module, *, name: str | None = None, text_encoder: nn.Module | None = None,
                    dtype_bytes: int = 2, **extra) -> "ModelDims":
        """Counts and widths of ``model`` (any device, meta included) and of ``text_encoder``."""
        blocks = _block_lists(model)
        if not blocks:
            raise ConfigError(f"{type(model).__name__} has no list of transformer blocks to plan for")
        mods = [b for lst in blocks for b in lst]
        sizes = [_count(b) for b in mods]
        linear = sum(_count(m) for b in mods for m in b.modules() if isinstance(m, nn.Linear))
        cfg = getattr(model, "config", {}) or {}
        get = (lambda k: cfg.get(k)) if isinstance(cfg, dict) else (lambda k: getattr(cfg, k, None))
        heads = get("num_attention_heads") or get("num_heads") or 1
        head_dim = get("attention_head_dim") or get("head_dim") or 0
        widths = [m for m in mods[0].modules() if isinstance(m, nn.Linear)]
        hidden = get("hidden_size") or get("inner_dim") or (heads * head_dim) or max(
            (m.in_features for m in widths), default=1)
        ffn = get("ffn_dim") or get("ffn_hidden_size") or max((m.out_features for m in widths
                                                                if m.in_features == hidden), default=4 * hidden)
        patch = get("patch_size") or (1, 2, 2)
        patch = tuple(patch) if isinstance(patch, (tuple, list)) else (1, int(patch), int(patch))
        if len(patch) == 2:
            patch = (1, *patch)
        te = dict(text_encoder_params=0, text_encoder_block_params=0, text_encoder_blocks_params=0)
        if text_encoder is not None:
            te_blocks = [b for lst in _block_lists(text_encoder) for b in lst]
            te_sizes = [_count(b) for b in te_blocks] or [0]
            te = dict(text_encoder_params=_count(text_encoder), text_encoder_block_params=max(te_sizes),
                      text_encoder_blocks_params=sum(te_sizes))
        fields = dict(name=name or type(model).__name__, layers=len(mods), heads=int(heads),
                      head_dim=int(head_dim or hidden // heads), hidden=int(hidden),
                      attn_width=int(heads * (head_dim or hidden // heads)), ffn=int(ffn), block_params=max(sizes),
                      blocks_params=sum(sizes), blocks_linear_params=linear, other_params=_count(model) - sum(sizes),
                      dtype_bytes=dtype_bytes, patch=patch, **te)
        fields.update(extra)
        return cls(**fields)


def _count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _block_lists(model: nn.Module) -> list:
    """The outermost ModuleLists of two or more modules with weights (the block lists)."""
    out, names = [], []
    for name, sub in model.named_modules():
        if not isinstance(sub, nn.ModuleList) or len(sub) < 2:
            continue
        if any(name.startswith(p + ".") for p in names):
            continue
        if sum(1 for m in sub if _count(m) > 0) < 2:
            continue
        names.append(name)
        out.append(sub)
    return out


def token_count(dims: ModelDims, num_frames: int, height: int, width: int) -> int:
    """Tokens of the self-attention sequence for a video of ``num_frames`` x ``height`` x ``width`` pixels."""
    vt, vh, vw = dims.vae_scale
    pt, ph, pw = dims.patch
    frames = (num_frames - 1) // vt + 1 if num_frames > 1 else 1
    tokens = max(1, frames // pt) * (height // (vh * ph)) * (width // (vw * pw))
    return tokens + (dims.text_tokens if dims.joint_text else 0)


@dataclass(frozen=True)
class Layout:
    """One way to place the model on ``world`` ranks: cfg x tp x ulysses x ring ranks, FSDP over
    ``fsdp`` of them (overlapping the other axes), and / or offload (without FSDP: one copy per rank in host
    memory, blocks uploaded; with FSDP: the shards in host memory, FSDP2's ``CPUOffloadPolicy``)."""

    cfg: int = 1
    tp: int = 1
    ulysses: int = 1
    ring: int = 1
    fsdp: int = 1
    offload: bool = False

    @property
    def world(self) -> int:
        return self.cfg * self.tp * self.ulysses * self.ring

    @property
    def sequence(self) -> int:
        return self.ulysses * self.ring

    def label(self) -> str:
        parts = [f"{n}{v}" for n, v in (("cfg", self.cfg), ("tp", self.tp), ("ulysses", self.ulysses),
                                         ("ring", self.ring), ("fsdp", self.fsdp)) if v > 1]
        if self.offload:
            parts.append("offload")
        return " x ".join(parts) or "replicated"

    def parallel_fields(self) -> dict:
        """The ParallelConfig degrees of this layout (``ulysses_degree`` ... ``fsdp_degree``)."""
        return dict(cfg_degree=self.cfg, ulysses_degree=self.ulysses, ring_degree=self.ring, tp_degree=self.tp,
                    fsdp_degree=self.fsdp)


@dataclass(frozen=True)
class Estimate:
    """Per-rank bytes of one layout (see the module docstring for the model). ``total``: the device memory of
    one call's peak (weights at rest + text encoder + FSDP gather working set + activations); ``host``: host
    memory per process, the runtime's (:data:`HOST_RUNTIME_BYTES`) plus ``host_weights``, the weights an offload
    layout keeps there (the blocks; under FSDP the rank's shards); neither is in ``total``."""

    layout: Layout
    weights: int
    text_encoder: int
    activations: int
    attention: int
    traffic: int
    fits: bool | None = None
    gather: int = 0
    host: int = HOST_RUNTIME_BYTES
    host_weights: int = 0

    @property
    def total(self) -> int:
        return self.weights + self.text_encoder + self.gather + self.activations


def estimate(dims: ModelDims, layout: Layout, tokens: int, *, text_encoder: bool = True,
             backend: str | None = None) -> Estimate:
    """Per-rank weights, text-encoder weights, FSDP gather working set, peak activations, attention working set
    and traffic. ``backend``: the torch.distributed backend, for the FSDP gather multiple
    (:func:`fsdp_gather_blocks`; None = NCCL / HCCL)."""
    b = dims.dtype_bytes
    t, f, L = layout.tp, layout.fsdp, dims.layers
    blocks, other, block = dims.blocks_params, dims.other_params, dims.block_params
    gathered = fsdp_offload_gather_blocks(f, backend) if layout.offload else fsdp_gather_blocks(f, backend)
    linear = dims.blocks_linear_params
    # one tp shard of the largest block (its Linear layers / t): what an FSDP gather brings back under tp x fsdp
    block_shard = block - (block * linear / blocks if blocks else 0) * (t - 1) / t
    host_weights = 0.0
    if layout.offload and f > 1:  # FSDP2's CPUOffloadPolicy: the shards in host memory, gathered blocks on the device
        weights = 0.0
        host_weights = (blocks + other) / f
    elif layout.offload:
        weights = other + 2 * block
        host_weights = blocks
    elif t > 1:  # the split Linears / t, the rest whole; with fsdp everything / f on top
        weights = (blocks - linear + linear / t + other) / f
    elif f > 1:
        weights = (blocks + other) / f
    else:
        weights = blocks + other
    gather = gathered * block_shard
    te = 0.0
    if text_encoder and dims.text_encoder_params:
        te_all, te_block = dims.text_encoder_params, dims.text_encoder_block_params
        if layout.offload and f > 1:
            te = gathered * te_block
            host_weights += te_all / f
        elif layout.offload:
            te = te_all - dims.text_encoder_blocks_params + 2 * te_block
            host_weights += dims.text_encoder_blocks_params
        elif f > 1:
            te = te_all / f + gathered * te_block
        else:
            te = te_all
    batch = 2 if dims.cfg_batched and layout.cfg == 1 else 1
    s = math.ceil(tokens / layout.sequence) * batch
    width = dims.attn_width / t
    attention = 4 * s * width  # q, k, v, output of this rank's heads
    f32 = 4 / b  # one fp32 element in units of the model's dtype
    # attention: residual + modulated input + q, k, v, output + the fp32 q / k norm temporaries (+ exchange buffers)
    attn_phase = 2 * s * dims.hidden + attention + s * width * f32
    if layout.ulysses > 1:
        attn_phase += 3 * s * width
    if layout.ring > 1:
        attn_phase += 4 * s * width
    ffn_phase = 2 * s * dims.hidden + 2 * s * dims.ffn / t  # residual + input + the two FFN-wide tensors
    # the gated residual update after the FFN: block input, residual, modulated input, FFN output + three fp32
    # temporaries (diffusers' Wan block: `(x.float() + ff.float() * gate).type_as(x)`)
    residual_phase = 4 * s * dims.hidden + 3 * s * dims.hidden * f32
    rope = s * dims.head_dim * f32  # fp32 tables
    text = 6 * dims.text_tokens * dims.hidden * batch  # the embedded context (and its MLP) + one cross-attention K / V
    activations = max(attn_phase, ffn_phase, residual_phase) + rope + text
    # bytes moved per rank per transformer call
    traffic = 0.0
    if layout.ulysses > 1:
        traffic += L * 4 * s * width * (layout.ulysses - 1) / layout.ulysses
    if layout.ring > 1:
        traffic += L * 2 * s * width * (layout.ring - 1)
    if t > 1:
        traffic += L * 2 * 2 * s * dims.hidden * (t - 1) / t
    if f > 1:
        traffic += (blocks - linear + linear / t + other) * (f - 1) / f
    if layout.offload:  # the blocks uploaded (under FSDP: each rank uploads its shards of everything)
        traffic += ((blocks + other) / f if f > 1 else blocks) * HOST_LINK_FACTOR
    return Estimate(layout, int(weights * b), int(te * b), int(activations * b), int(attention * b), int(traffic * b),
                    gather=int(gather * b), host=HOST_RUNTIME_BYTES + int(host_weights * b),
                    host_weights=int(host_weights * b))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_layouts(dims: ModelDims, world: int, *, cfg: bool = True, tp: bool = True, fsdp: bool = True,
                      ring: bool = True, offload: bool = True) -> list[Layout]:
    """Every layout of ``world`` ranks the switches allow: cfg in (1, 2), tp dividing the heads and the FFN
    width, the sequence ranks on Ulysses up to the heads each TP rank holds and the rest on Ring, FSDP
    over any divisor of world / tp (with tp: over the ranks with the same tp rank, sharding the tp shards),
    offload without tp (alone, or with FSDP: CPUOffloadPolicy)."""
    out = []
    for c in ((1, 2) if cfg else (1,)):
        if world % c:
            continue
        for t in (_divisors(world // c) if tp else [1]):
            if dims.heads % t or dims.ffn % t:
                continue
            seq = world // (c * t)
            u = max(d for d in _divisors(seq) if d <= max(1, dims.heads // t) or d == 1)
            r = seq // u
            if r > 1 and not ring:
                continue
            for fd in (_divisors(world // t) if fsdp else [1]):
                out.append(Layout(c, t, u, r, fd))
                if offload and t == 1:
                    out.append(Layout(c, t, u, r, fd, True))
    return out


@dataclass(frozen=True)
class MemoryPlan:
    """The estimates of every candidate layout, what fits and the recommendation."""

    dims: ModelDims
    world: int
    tokens: int
    device_memory: int | None
    headroom: float
    rows: tuple[Estimate, ...]
    recommended: Estimate | None
    shape: tuple[int, int, int] | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)
    backend: str | None = None

    @property
    def budget(self) -> float | None:
        return None if self.device_memory is None else self.device_memory * (1 - self.headroom)


def plan_layouts(dims: ModelDims, world: int, tokens: int, device_memory: int | str | None, *,
                 headroom: float = 0.1, text_encoder: bool = True, available: dict | None = None,
                 shape: tuple[int, int, int] | None = None, backend: str | None = None,
                 **switches) -> MemoryPlan:
    """Estimate every candidate layout (:func:`candidate_layouts`) and recommend the fitting one that moves
    least. ``available``: feature -> bool for what this installation can apply (``tp``, ``fsdp``, ``cfg``,
    ``offload``): the others are listed but not recommended. ``backend``: the torch.distributed backend
    (None = NCCL / HCCL), for the FSDP gather working set."""
    mem = parse_bytes(device_memory, "device_memory") if device_memory is not None else None
    fsdp_gather_blocks(1, backend)  # checks the name before anything is estimated
    rows = []
    for layout in candidate_layouts(dims, world, **switches):
        e = estimate(dims, layout, tokens, text_encoder=text_encoder, backend=backend)
        rows.append(replace(e, fits=None if mem is None else e.total <= mem * (1 - headroom)))
    rows.sort(key=lambda e: (e.traffic, e.total))
    avail = available or {}

    def usable(e):
        lay = e.layout
        return ((lay.tp == 1 or avail.get("tp", True)) and (lay.fsdp == 1 or avail.get("fsdp", True))
                and (lay.cfg == 1 or avail.get("cfg", True)) and (not lay.offload or avail.get("offload", True)))

    fitting = [e for e in rows if e.fits and usable(e)]
    notes = tuple(f"{k} is not available here: its layouts are listed, not recommended"
                  for k, v in avail.items() if not v)
    return MemoryPlan(dims, world, tokens, mem, headroom, tuple(rows), fitting[0] if fitting else None, shape, notes,
                      backend)


def _gib(n: float) -> str:
    return f"{n / GiB:.2f}"


def _gather_note(backend: str | None) -> str:
    if backend in FSDP_GATHER_BLOCKS:
        return f"{FSDP_GATHER_BLOCKS[backend]:g} whole blocks on {backend}, measured without offload"
    return (f"2 x (f - 1) / f blocks on {backend or 'NCCL / HCCL'}, 2 + 1 / f with offload, assumed, not "
            "measured")


def format_plan(plan: MemoryPlan) -> str:
    """The plan as a text table (GiB per rank), the recommendation marked."""
    d = plan.dims
    lines = [f"{d.name}: {d.layers} blocks, {d.params / 1e9:.2f} B parameters "
             f"({d.blocks_params / 1e9:.2f} B in blocks, {d.block_params / 1e6:.0f} M per block), "
             f"{d.heads} heads x {d.head_dim}, hidden {d.hidden}, ffn {d.ffn}, {d.dtype_bytes} bytes per element"
             + (f"; text encoder {d.text_encoder_params / 1e9:.2f} B" if d.text_encoder_params else "")]
    shape = f"{plan.shape[0]} frames x {plan.shape[1]} x {plan.shape[2]}, " if plan.shape else ""
    budget = (f"device memory {_gib(plan.device_memory)} GiB ({_gib(plan.budget)} GiB usable, "
              f"{plan.headroom:.0%} kept free)" if plan.device_memory else "no device memory given")
    lines.append(f"{plan.world} rank(s), {shape}{plan.tokens} tokens; {budget}")
    lines.append("")
    head = (f"{'layout':<34} {'weights':>8} {'text enc':>8} {'gather':>8} {'activ.':>8} {'attn ws':>8} {'total':>8} "
            f"{'fits':>5} {'moved/call':>10} {'host w.':>8}")
    lines += [head, "-" * len(head)]
    for e in plan.rows:
        fits = "-" if e.fits is None else ("yes" if e.fits else "no")
        mark = "  <- recommended" if e is plan.recommended else ""
        lines.append(f"{e.layout.label():<34} {_gib(e.weights):>8} {_gib(e.text_encoder):>8} {_gib(e.gather):>8} "
                     f"{_gib(e.activations):>8} {_gib(e.attention):>8} {_gib(e.total):>8} {fits:>5} "
                     f"{_gib(e.traffic):>10} {_gib(e.host_weights):>8}{mark}")
    lines.append("")
    lines.append("GiB of device memory per rank. weights: the transformer's, at rest; text enc: the text encoder's, "
                 "resident during denoising; gather: FSDP's unsharded blocks during a call "
                 f"({_gather_note(plan.backend)}); activ.: peak inside one block of one transformer call; attn ws: "
                 "q, k, v and output of the attention (part of activ.); moved/call: bytes each rank sends or uploads "
                 f"per transformer call (host uploads x{HOST_LINK_FACTOR}); host w.: weights an offload layout keeps in "
                 "host memory, not in the device total (under FSDP the rank's shards). Not included: the VAE, the "
                 "framework's device context and allocator slack (the headroom), and the host memory of each "
                 "process's runtime "
                 f"(Python, torch, diffusers, lite_boost: about {_gib(HOST_RUNTIME_BYTES)} GiB, measured on an "
                 "x86-64 CPU build; it differs by platform).")
    if plan.recommended is not None:
        lines.append(f"recommended: {plan.recommended.layout.label()} ({_gib(plan.recommended.total)} GiB per rank)")
    elif plan.device_memory is not None:
        smallest = min(plan.rows, key=lambda e: e.total)
        lines.append(f"nothing fits: the smallest layout, {smallest.layout.label()}, needs {_gib(smallest.total)} GiB "
                     f"per rank; use more ranks, a shorter video or a smaller dtype")
    lines += list(plan.notes)
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------ from configs only
DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2}
DEFAULT_SHAPE = (81, 480, 832)  # (num_frames, height, width) when a family names none


def meta_model(library: str, class_name: str, config: dict | None = None) -> nn.Module:
    """``class_name`` of ``library`` ("diffusers" or "transformers") built from ``config`` on the meta device:
    shapes only, nothing allocated or read."""
    import importlib

    import torch

    lib = importlib.import_module(library)
    cls = getattr(lib, class_name, None)
    if cls is None:
        raise ConfigError(f"{library} has no class {class_name!r} (its version: {getattr(lib, '__version__', '?')})")
    with torch.device("meta"):
        if library == "transformers":
            conf_cls = getattr(cls, "config_class", None)
            conf = conf_cls(**(config or {})) if not isinstance(config, conf_cls) else config
            return cls(conf)
        return cls.from_config(config or {}) if config else cls()


def _family_extras(family) -> dict:
    joint = getattr(family, "joint", "cross") != "cross"
    cfg = getattr(getattr(family, "pipeline", None), "cfg", None)
    return dict(joint_text=joint, cfg_batched=getattr(cfg, "kind", None) == "batched")


def dims_for_family(family, dtype_bytes: int = 2) -> tuple[ModelDims, tuple[int, int, int]]:
    """(dims, reference shape) of a family's reference model (``ModelFamily.reference``), from configs on the
    meta device; the first transformer class's defaults when the family names no config."""
    ref = dict(getattr(family, "reference", None) or {})
    model = meta_model("diffusers", family.transformers[0], ref.get("transformer"))
    te = ref.get("text_encoder")
    text_encoder = meta_model("transformers", te[0], te[1]) if te else None
    extras = _family_extras(family)
    if ref.get("vae_scale"):
        extras["vae_scale"] = tuple(ref["vae_scale"])
    dims = ModelDims.from_module(model, name=ref.get("name", family.transformers[0]), text_encoder=text_encoder,
                                 dtype_bytes=dtype_bytes, **extras)
    return dims, tuple(ref.get("shape", DEFAULT_SHAPE))


def dims_for_model_dir(path, dtype_bytes: int = 2, family=None) -> ModelDims:
    """Dims of a diffusers pipeline folder from its ``model_index.json`` and the components' ``config.json``
    (no weights read): the transformer, the text encoder, the VAE's down-sampling."""
    import json
    from pathlib import Path

    root = Path(path)
    index_file = root / "model_index.json"
    if not index_file.is_file():
        raise ConfigError(f"--model {path}: no model_index.json there (a diffusers pipeline folder is needed)")
    index = json.loads(index_file.read_text(encoding="utf-8"))

    def component(name):
        entry = index.get(name)
        if not (isinstance(entry, (list, tuple)) and len(entry) == 2 and entry[1]):
            return None
        conf = root / name / "config.json"
        return entry[0], entry[1], (json.loads(conf.read_text(encoding="utf-8")) if conf.is_file() else {})

    tr = component("transformer")
    if tr is None:
        raise ConfigError(f"--model {path}: model_index.json names no transformer")
    model = meta_model(tr[0], tr[1], {k: v for k, v in tr[2].items() if not k.startswith("_")})
    text_encoder = None
    te = component("text_encoder")
    if te is not None and te[0] == "transformers":
        import transformers

        conf = transformers.AutoConfig.for_model(**te[2]) if "model_type" in te[2] else None
        text_encoder = meta_model("transformers", te[1], conf if conf is not None else te[2])
    extras = _family_extras(family) if family is not None else {}
    vae = component("vae")
    if vae is not None:
        down = vae[2].get("temperal_downsample")
        if isinstance(down, list):
            extras["vae_scale"] = (2 ** sum(bool(x) for x in down), 2 ** len(down), 2 ** len(down))
    return ModelDims.from_module(model, name=f"{root.name} ({tr[1]})", text_encoder=text_encoder,
                                 dtype_bytes=dtype_bytes, **extras)
