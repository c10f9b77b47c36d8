"""Configuration dataclasses.

Every config validates itself in ``__post_init__`` and raises :class:`ConfigError` naming the field
and the accepted values, so a bad setting fails before any model is touched or any collective runs.
``from_dict`` rejects unknown keys (a typo never silently falls back to a default) and
``from_yaml`` loads the same structure from a YAML file.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from .errors import ConfigError, check_regexes

__all__ = [
    "ConfigError",
    "SparseConfig",
    "ParallelConfig",
    "BoostConfig",
    "AttentionConfig",
    "ATTENTION_PRECISIONS",
    "CacheConfig",
    "QuantConfig",
    "OffloadConfig",
    "QUANT_METHODS",
    "parse_bytes",
    "parallel_from_boost_manager",
    "ATTENTION_BACKEND_NAMES",
    "SPARSE_BACKEND_NAMES",
    "read_yaml",
    "yaml_path_hint",
]

# Names accepted for the dense attention backend (kept here so the config can validate without
# importing the ops package). ``lite_boost.ops.attention`` registers exactly these.
ATTENTION_BACKEND_NAMES = ("fa3", "fa2", "npu", "sdpa", "sage", "sage_fp8", "fa3_fp8", "npu_int8", "cpu_int8")
# Arithmetic of the sequence self-attention (dense and block-sparse): "auto" = the input dtype's own GEMMs;
# "int8" = int8 Q K^T after smoothing K by its mean over tokens, 16-bit P V; "fp8" = FP8 where the device has it.
ATTENTION_PRECISIONS = ("auto", "int8", "fp8")
# Block-sparse kernels of ``lite_boost.ops.rain_fusion_attention`` (same reason).
SPARSE_BACKEND_NAMES = ("npu", "cpp", "sparge", "flex_int8", "flex", "gather", "reference")
# Sequence length (tokens per sequence) from which the whole block-sparse call (selection, reorder, kernel) beat
# dense SDPA at sparsity 0.8, head_dim 128, float32, per CPU backend; None = not within the measured lengths (up to
# SPARSE_BREAK_EVEN_MEASURED_UP_TO). Measured by benchmarks/bench_sparse_break_even.py (results and the CPU model
# in benchmarks/results/sparse_break_even.md); `lite-boost generate` uses it to say when sparse cannot pay.
SPARSE_BREAK_EVEN = {"cpp": 8192, "flex": 8192, "gather": None}
SPARSE_BREAK_EVEN_MEASURED_UP_TO = 8192
SPARSE_TYPES = (None, "rf_v2")
SPARSE_SELECTORS = ("subblock", "reference")  # = lite_boost.ops.sparse.SELECTORS (tested)
SPARSE_BUDGETS = ("reference", "total")  # = lite_boost.ops.sparse.BUDGETS (tested)
ROTATE_METHODS = ("p2p", "allgather")
LAYOUTS = ("manual", "auto")  # ParallelConfig.layout: the degrees as given, or the memory planner's choice
# The degrees layout="auto" chooses (those ParallelConfig has; see lite_boost.memory.Layout.parallel_fields).
AUTO_LAYOUT_DEGREES = ("sequence_degree", "cfg_degree", "ulysses_degree", "ring_degree", "tp_degree", "fsdp_degree")  # Ring attention K/V movement (lite_boost.parallel.ring)
QUANT_METHODS = ("int8_dynamic", "int8_weight_only", "fp8", "w8a8_npu")  # = lite_boost.quant.QUANT_METHOD_INFO (tested)


def _check_int(name: str, value: Any, lo: int | None = None, hi: int | None = None, allow_none=False):
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an integer{' or None' if allow_none else ''}, got {value!r}")
    if lo is not None and value < lo:
        raise ConfigError(f"{name} must be >= {lo}, got {value}")
    if hi is not None and value > hi:
        raise ConfigError(f"{name} must be <= {hi}, got {value}")


_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000 ** 2, "mb": 1000 ** 2, "g": 1000 ** 3, "gb": 1000 ** 3,
          "t": 1000 ** 4, "tb": 1000 ** 4, "kib": 1024, "mib": 1024 ** 2, "gib": 1024 ** 3, "tib": 1024 ** 4}


def parse_bytes(value: Any, name: str = "device_memory") -> int:
    """A memory size: an int of bytes or a string such as ``"24GiB"``, ``"24 GB"``, ``"80G"`` (G = GB = 10^9,
    GiB = 2^30); ConfigError naming ``name`` otherwise."""
    if isinstance(value, bool):
        pass
    elif isinstance(value, int) and value > 0:
        return value
    elif isinstance(value, float) and value > 0 and math.isfinite(value):
        return int(value)
    elif isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
        if m and m.group(2).lower() in _UNITS and float(m.group(1)) > 0:
            return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    raise ConfigError(f"{name} must be a positive size in bytes or a string such as '24GiB', '24GB' or '80G' "
                      f"(units {sorted(u for u in _UNITS if u)}), got {value!r}")


def _check_bool(name: str, value: Any):
    if not isinstance(value, bool):
        raise ConfigError(f"{name} must be True or False, got {value!r}")


def _check_choice(name: str, value: Any, choices):
    if value not in choices:
        raise ConfigError(f"{name} must be one of {list(choices)}, got {value!r}")


def read_yaml(path) -> Any:
    """The data of a YAML file (None for an empty file becomes {}); ConfigError naming the file, and the line and
    column of a syntax error, in place of PyYAML's parser traceback."""
    import os

    import yaml

    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as fh:
            return yaml.safe_load(fh) or {}
    except OSError as exc:
        raise ConfigError(f"cannot read the config file {path!r}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark is not None else "somewhere"
        what = " ".join(str(x) for x in (getattr(exc, "context", None), getattr(exc, "problem", None)) if x)
        raise ConfigError(f"{path}: {where}: not valid YAML ({what or exc})") from None


def yaml_path_hint(path) -> str:
    """The message for a YAML path given where a config object is expected (``boost``, ``ParallelManager``)."""
    p = os.fspath(path)
    return (f"config {p!r} is a path: boost() and ParallelManager() take a BoostConfig, a sub-config, a mapping or None. "
            f"For a YAML file use lite_boost.BoostManager(pipe, config={p!r}) (it loads the file), or "
            f"lite_boost.boost(pipe, lite_boost.BoostConfig.from_yaml({p!r}))")


class _ConfigMixin:
    """from_dict / to_dict / from_yaml shared by all configs."""

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None):
        if data is None:
            return cls()
        if isinstance(data, cls):
            return data
        if not isinstance(data, Mapping):
            raise ConfigError(f"{cls.__name__} expects a mapping, got {type(data).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ConfigError(
                f"unknown {cls.__name__} key(s) {unknown}; accepted keys are {sorted(names)}"
            )
        kwargs = dict(data)
        for f in dataclasses.fields(cls):
            sub = _NESTED.get((cls.__name__, f.name))
            if sub is not None and f.name in kwargs and isinstance(kwargs[f.name], Mapping):
                kwargs[f.name] = sub.from_dict(kwargs[f.name])
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_yaml(cls, path: str):
        """Load from a YAML file; ConfigError naming the file (and the line of a syntax error) on bad input."""
        data = read_yaml(path)
        try:
            return cls.from_dict(data)
        except ConfigError as exc:
            raise ConfigError(f"{path}: {exc}") from None

    def replace(self, **changes):
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class SparseConfig(_ConfigMixin):
    """Block-sparse self-attention (RainFusion 2.0 style) and its step/layer schedule.

    sparse_type: None = dense attention; "rf_v2" = block-sparse path of ``ops.sparse_attention``.
    sparsity: fraction of KV blocks dropped per query block, in [0, 1).
    block_size: tokens per block (query and key blocks).
    window: (t, h, w) spatio-temporal token window whose volume equals block_size, or None for the
        reference 8x8 spatial windows of one frame.
    dense_steps_first / dense_steps_last: denoising steps run with dense attention at the start / end.
    dense_layers: indices of transformer blocks that always use dense attention.
    mask_reuse_steps: a computed block mask is reused for this many steps (1 = recompute every step).
    min_seq_len: sequences shorter than this use dense attention (mask overhead would dominate).
    backend: block-sparse kernel ("npu", "cpp", "sparge", "flex_int8", "flex", "gather", "reference") or
        None = automatic (npu -> cpp -> sparge -> flex_int8 -> flex -> gather, the int8 ones for precision
        "int8" on CUDA only; also settable with LITE_BOOST_SPARSE_BACKEND).
    budget: "reference" (the reference rule: each query block keeps its top
        ``ceil((1 - sparsity) * kv_blocks)`` blocks, then the forced text / first-frame / diagonal
        blocks are added on top) or "total" (forced blocks count toward that number: a hard cap).
    selector: how blocks are scored: "subblock" (estimated attention mass from sub-block
        representatives, the default) or "reference" (RainFusion 2.0 mean-pooled Q/K scores).
    selector_reps: (q_reps, k_reps) representatives per query / key block for "subblock", each in
        [1, block_size]; None = (32, 8) capped at block_size.
    """

    sparse_type: str | None = "rf_v2"
    sparsity: float = 0.8
    block_size: int = 128
    window: tuple[int, int, int] | None = None
    keep_sink: bool = True
    keep_recent: bool = True
    cdf_threshold: float = 1.0
    dense_steps_first: int = 0
    dense_steps_last: int = 0
    dense_layers: tuple[int, ...] = ()
    mask_reuse_steps: int = 1
    min_seq_len: int = 0
    backend: str | None = None
    budget: str = "reference"
    selector: str = "subblock"
    selector_reps: tuple[int, int] | None = None

    def __post_init__(self):
        _check_choice("sparse_type", self.sparse_type, SPARSE_TYPES)
        _check_choice("budget", self.budget, SPARSE_BUDGETS)
        _check_choice("selector", self.selector, SPARSE_SELECTORS)
        _check_choice("backend", self.backend, (None,) + SPARSE_BACKEND_NAMES)
        if isinstance(self.sparsity, bool) or not isinstance(self.sparsity, (int, float)):
            raise ConfigError(f"sparsity must be a float in [0, 1), got {self.sparsity!r}")
        if not (0.0 <= float(self.sparsity) < 1.0) or math.isnan(self.sparsity):
            raise ConfigError(f"sparsity must be in [0, 1), got {self.sparsity}")
        _check_int("block_size", self.block_size, lo=1)
        if self.selector_reps is not None:
            r = self.selector_reps
            if (not isinstance(r, (tuple, list)) or len(r) != 2
                    or any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in r)):
                raise ConfigError(f"selector_reps must be None or two positive ints (q_reps, k_reps), got {r!r}")
            if max(r) > self.block_size:
                raise ConfigError(f"selector_reps {tuple(r)} must not exceed block_size={self.block_size}")
            object.__setattr__(self, "selector_reps", tuple(r))
        if self.window is not None:
            w = tuple(self.window)
            if len(w) != 3 or any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in w):
                raise ConfigError(f"window must be None or three positive ints (t, h, w), got {self.window!r}")
            if math.prod(w) != self.block_size:
                raise ConfigError(
                    f"window volume t*h*w must equal block_size={self.block_size}, got {w} (volume {math.prod(w)})"
                )
            object.__setattr__(self, "window", w)
        _check_bool("keep_sink", self.keep_sink)
        _check_bool("keep_recent", self.keep_recent)
        if not isinstance(self.cdf_threshold, (int, float)) or not (0.0 < float(self.cdf_threshold) <= 1.0):
            raise ConfigError(f"cdf_threshold must be in (0, 1], got {self.cdf_threshold!r}")
        _check_int("dense_steps_first", self.dense_steps_first, lo=0)
        _check_int("dense_steps_last", self.dense_steps_last, lo=0)
        layers = tuple(self.dense_layers)
        for x in layers:
            _check_int("dense_layers[i]", x, lo=0)
        object.__setattr__(self, "dense_layers", layers)
        _check_int("mask_reuse_steps", self.mask_reuse_steps, lo=1)
        _check_int("min_seq_len", self.min_seq_len, lo=0)


@dataclass(frozen=True)
class ParallelConfig(_ConfigMixin):
    """Process mesh (cfg x ring x ulysses) for ``ParallelManager``.

    sequence_degree: ranks that share one sequence (= ulysses_degree x ring_degree); None =
        world_size // cfg_degree.
    ulysses_degree / ring_degree: how the sequence ranks split between Ulysses (all_to_all over
        heads, contiguous ranks: inside a node) and Ring attention (K/V passed around strided ranks:
        across nodes); the names diffusers and xDiT use. None: the other degree's complement in
        sequence_degree; both None = every sequence rank on Ulysses (ring_degree 1).
    rotate_method: how Ring attention moves K/V: "p2p" (default: the next chunk is sent and received
        point to point while the current one is computed, double-buffered) or "allgather" (one
        all_gather of every chunk up front, then the same loop; O(S) memory, nothing overlapped).
    cfg_degree: 1 or 2 (conditional and unconditional passes on different rank groups).
    timeout_s: collective timeout in seconds; a dead or failing rank makes the others exit.
    backend: torch.distributed backend (None = nccl on CUDA, hccl on NPU, gloo on CPU).
    vae_parallel: how the pipeline's VAE decode / encode is spread over all ranks
        (:mod:`lite_boost.parallel.vae`): "exact" (spatial split with halo exchange, equal to the
        one-process result up to fp32 rounding), "chunked" (the reference's temporal chunks with
        ``vae_overlap`` warm-up latent frames, approximate at the seams), "off" (every rank runs the
        whole VAE), None = "exact" whenever the world size is above 1. ``True`` / ``False`` keep the
        reference's boolean meaning ("chunked" / "off").
    vae_chunk_size: latent frames per chunk in "chunked" mode; None = one cost-balanced chunk per rank.
    vae_overlap: warm-up latent frames before each chunk in "chunked" mode (>= 1); None = the VAE
        adapter's defaults, chosen from the seam study in docs/benchmarks/vae.md (Wan: 2 for decode, 2 for encode).
    vae_gather: "all" (the decoded video on every rank) or "rank0" (only rank 0 gets it, the others
        an empty 0-frame tensor; saves memory) in "chunked" mode; "exact" mode assembles every frame
        on every rank (its per-frame loop needs the whole frame), so it accepts only "all".
    world_size: the world size this config was written for (MindSpore Lite's ``Parallel.world_size``);
        None = any. A launch with another world size fails in ``resolve_mesh``, before any collective.
    tp_degree: tensor parallelism (diffusers' name): attention heads and FFN columns / rows of the
        transformer blocks split over ``tp_degree`` ranks that work on the same tokens (DTensor
        ``parallelize_module``). A mesh axis of its own: ``world_size = cfg_degree x tp_degree x
        sequence_degree``; the TP ranks are the innermost (contiguous) ones. 1 = off.
    fsdp_degree: FSDP2 weight sharding (``torch.distributed.fsdp.fully_shard``): every transformer
        block's weights are split over ``fsdp_degree`` ranks and all-gathered just in time (the next
        block's gather prefetched while the current one computes), then freed again. It overlaps the
        other axes: the ranks that share the weights are the same ranks that split the sequence and
        the CFG branches, so it must divide the world size (groups of contiguous ranks: with
        ``fsdp_degree <= sequence_degree`` a group lies inside one sequence group). 1 = off. With
        ``tp_degree > 1`` it must divide ``world_size / tp_degree``: FSDP shards the tensor-parallel shards
        further over the ranks with the same tp rank (one 2-D ``DeviceMesh`` ("fsdp", "tp")), so a rank
        keeps ``1 / (tp_degree x fsdp_degree)`` of the split Linear layers.
    fsdp_text_encoder: with ``fsdp_degree > 1``, shard the pipeline's text encoder(s) the same way.
    layout: "manual" (the degrees above) or "auto": ``ParallelManager`` asks the memory planner
        (:mod:`lite_boost.memory`, ``lite-boost plan``) for the layout that fits ``device_memory`` per rank
        and moves least, and applies its degrees (and offload); the degrees are then left unset here.
    device_memory: with layout "auto": memory per device, bytes or a string such as "24GiB"; None = the
        accelerator's total memory (required on the CPU).
    layout_shape: with layout "auto": (num_frames, height, width) the layout is planned for; None = the
        family's reference shape (Wan: 81 x 480 x 832).
    """

    sequence_degree: int | None = None
    cfg_degree: int = 1
    ulysses_degree: int | None = None
    ring_degree: int | None = None
    rotate_method: str = "p2p"
    timeout_s: float = 600.0
    backend: str | None = None
    vae_parallel: str | bool | None = None
    vae_chunk_size: int | None = None
    vae_overlap: int | None = None
    vae_gather: str = "all"
    world_size: int | None = None
    tp_degree: int = 1
    fsdp_degree: int = 1
    fsdp_text_encoder: bool = True
    layout: str = "manual"
    device_memory: int | str | None = None
    layout_shape: tuple[int, int, int] | None = None

    def __post_init__(self):
        self._check_layout()
        _check_int("sequence_degree", self.sequence_degree, lo=1, allow_none=True)
        _check_choice("cfg_degree", self.cfg_degree, (1, 2))
        _check_int("ulysses_degree", self.ulysses_degree, lo=1, allow_none=True)
        _check_int("ring_degree", self.ring_degree, lo=1, allow_none=True)
        _check_choice("rotate_method", self.rotate_method, ROTATE_METHODS)
        if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, (int, float)) or self.timeout_s <= 0:
            raise ConfigError(f"timeout_s must be a positive number of seconds, got {self.timeout_s!r}")
        _check_choice("backend", self.backend, (None, "gloo", "nccl", "hccl"))
        if isinstance(self.vae_parallel, bool):
            object.__setattr__(self, "vae_parallel", "chunked" if self.vae_parallel else "off")
        _check_choice("vae_parallel", self.vae_parallel, (None, "exact", "chunked", "off"))
        _check_int("vae_chunk_size", self.vae_chunk_size, lo=1, allow_none=True)
        _check_int("vae_overlap", self.vae_overlap, lo=1, allow_none=True)
        _check_choice("vae_gather", self.vae_gather, ("all", "rank0"))
        _check_int("world_size", self.world_size, lo=1, allow_none=True)
        _check_int("tp_degree", self.tp_degree, lo=1)
        _check_int("fsdp_degree", self.fsdp_degree, lo=1)
        _check_bool("fsdp_text_encoder", self.fsdp_text_encoder)
        if self.vae_parallel != "chunked":
            mode = f"{self.vae_parallel!r}" if self.vae_parallel else "None (exact when world_size > 1)"
            for name in ("vae_chunk_size", "vae_overlap"):
                if getattr(self, name) is not None:
                    raise ConfigError(f"{name}={getattr(self, name)} applies to vae_parallel='chunked' only, but "
                                      f"vae_parallel is {mode}; set vae_parallel='chunked' or drop {name}")
            if self.vae_gather != "all":
                raise ConfigError(f"vae_gather={self.vae_gather!r} applies to vae_parallel='chunked' only, but "
                                  f"vae_parallel is {mode}; valid vae_gather here: ['all']")

    def processes_needed(self) -> int:
        """The fewest processes the degrees asked for need: cfg_degree x tp_degree x sequence degree
        (sequence_degree, or ulysses_degree x ring_degree), at least fsdp_degree, or ``world_size`` when that is
        larger; 1 = one process can run this config."""
        seq = self.sequence_degree or (self.ulysses_degree or 1) * (self.ring_degree or 1)
        return max(self.cfg_degree * self.tp_degree * seq, self.fsdp_degree * self.tp_degree, self.world_size or 1)

    def _check_layout(self) -> None:
        _check_choice("layout", self.layout, LAYOUTS)
        if self.device_memory is not None:
            object.__setattr__(self, "device_memory", parse_bytes(self.device_memory, "device_memory"))
        if self.layout_shape is not None:
            shp = self.layout_shape
            if (not isinstance(shp, (tuple, list)) or len(shp) != 3
                    or any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in shp)):
                raise ConfigError(f"layout_shape must be None or three positive ints (num_frames, height, width), "
                                  f"got {shp!r}")
            object.__setattr__(self, "layout_shape", tuple(shp))
        if self.layout == "manual":
            for name in ("device_memory", "layout_shape"):
                if getattr(self, name) is not None:
                    raise ConfigError(f"{name} applies to layout='auto' only; set layout='auto' or drop {name}")
            return
        chosen = {n: getattr(self, n) for n in AUTO_LAYOUT_DEGREES if hasattr(self, n)}
        fixed = {n: v for n, v in chosen.items() if v not in (None, 1)}
        if fixed:
            raise ConfigError(f"layout='auto' chooses {sorted(chosen)} itself, but {fixed} is set; drop "
                              f"{'it' if len(fixed) == 1 else 'them'} or use layout='manual'")

    def resolve(self, world_size: int) -> tuple[int, int]:
        """Return (cfg_degree, sequence_degree) for ``world_size`` or raise listing valid choices."""
        cfg, ulysses, ring = self.resolve_mesh(world_size)
        return cfg, ulysses * ring

    def resolve_mesh(self, world_size: int) -> tuple[int, int, int]:
        """Return (cfg_degree, ulysses_degree, ring_degree) for ``world_size`` or raise listing valid choices.

        The error for Ulysses / Ring degrees that do not fit names every valid (ulysses, ring) pair
        for this world size and cfg_degree (and sequence_degree, when given).
        """
        _check_int("world_size", world_size, lo=1)
        self.check_world_size(world_size)
        if world_size % self.cfg_degree:
            raise ConfigError(
                f"cfg_degree={self.cfg_degree} does not divide world_size={world_size}; "
                f"valid cfg_degree values: {[c for c in (1, 2) if world_size % c == 0]}"
            )
        tp = self.tp_degree
        if (world_size // self.cfg_degree) % tp:
            rest = world_size // self.cfg_degree
            raise ConfigError(
                f"tp_degree={tp} does not divide world_size={world_size} / cfg_degree={self.cfg_degree} = {rest}; "
                f"valid tp_degree values: {[d for d in range(1, rest + 1) if rest % d == 0]}"
            )
        if tp > 1 and (world_size // tp) % self.fsdp_degree:
            rest = world_size // self.cfg_degree
            pairs = [(t, f) for t in range(1, rest + 1) if rest % t == 0
                     for f in range(1, world_size // t + 1) if (world_size // t) % f == 0]
            raise ConfigError(
                f"fsdp_degree={self.fsdp_degree} does not divide world_size={world_size} / tp_degree={tp} = "
                f"{world_size // tp} (the fsdp groups are the ranks with the same tp rank); valid (tp_degree, "
                f"fsdp_degree) pairs for world_size={world_size}, cfg_degree={self.cfg_degree}: {pairs}"
            )
        if world_size % self.fsdp_degree:
            raise ConfigError(
                f"fsdp_degree={self.fsdp_degree} does not divide world_size={world_size}; valid fsdp_degree "
                f"values: {[d for d in range(1, world_size + 1) if world_size % d == 0]}"
            )
        u, r = self.ulysses_degree, self.ring_degree
        if self.sequence_degree is not None:
            seq = self.sequence_degree
        elif u is not None and r is not None:
            seq = u * r
        else:
            seq = world_size // (self.cfg_degree * tp)
        if seq * self.cfg_degree * tp != world_size:
            tp_part = f" x tp_degree={tp}" if tp > 1 else ""
            if self.sequence_degree is None:  # the product of the two given degrees does not fit
                raise self._pairs_error(world_size, f"ulysses_degree={u} x ring_degree={r} x cfg_degree="
                                                    f"{self.cfg_degree}{tp_part} must equal world_size={world_size}")
            valid = [d for d in range(1, world_size + 1) if d * self.cfg_degree * tp == world_size]
            raise ConfigError(
                f"sequence_degree={seq} x cfg_degree={self.cfg_degree}{tp_part} must equal world_size={world_size}; "
                f"valid sequence_degree for this cfg_degree{' and tp_degree' if tp > 1 else ''}: {valid}"
            )
        if u is None and r is None:
            return self.cfg_degree, seq, 1
        if u is None:
            u = seq // r if seq % r == 0 else None
        elif r is None:
            r = seq // u if seq % u == 0 else None
        if u is None or r is None or u * r != seq:
            given = ", ".join(f"{n}={v}" for n, v in (("ulysses_degree", self.ulysses_degree),
                                                      ("ring_degree", self.ring_degree)) if v is not None)
            raise self._pairs_error(world_size, f"{given} does not fit sequence_degree={seq} "
                                                f"(world_size={world_size} / cfg_degree={self.cfg_degree})")
        return self.cfg_degree, u, r

    def check_world_size(self, world_size: int) -> None:
        """ConfigError when the config names a ``world_size`` other than the launched one."""
        if self.world_size is not None and self.world_size != world_size:
            raise ConfigError(
                f"world_size={self.world_size} (the config's Parallel.world_size / parallel.world_size) does not match "
                f"the launched world size {world_size}; launch {self.world_size} processes (torchrun "
                f"--nproc_per_node {self.world_size}) or set world_size to {world_size}"
            )

    def _pairs_error(self, world_size: int, what: str) -> ConfigError:
        seq = (self.sequence_degree if self.sequence_degree is not None
               else world_size // (self.cfg_degree * self.tp_degree))
        pairs = [(d, seq // d) for d in range(1, seq + 1) if seq % d == 0]
        tp = f", tp_degree={self.tp_degree}" if self.tp_degree > 1 else ""
        return ConfigError(f"{what}; valid (ulysses_degree, ring_degree) pairs for world_size={world_size}, "
                           f"cfg_degree={self.cfg_degree}{tp}: {pairs}")


@dataclass(frozen=True)
class CacheConfig(_ConfigMixin):
    """Step caching with one of diffusers' cache hooks (see :mod:`lite_boost.cache`).

    method: "first_block_cache", "mag_cache", "taylorseer_cache", "pyramid_attention_broadcast" or
        "sea_cache" (diffusers' FirstBlockCache, MagCache, TaylorSeer, PyramidAttentionBroadcast and
        SeaCache configs).
    params: the method's parameters, with diffusers' names and meanings (e.g. ``threshold``); checked
        here against what the method accepts. Parameters not given keep the defaults of the model
        adapter, then of diffusers.

    ``CacheConfig.parse("first_block_cache:threshold=0.1")`` reads the CLI form; ``from_dict`` takes
    ``{"method": ..., "params": {...}}`` or the flat ``{"method": ..., "threshold": ...}``.
    """

    method: str = "first_block_cache"
    params: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        from .cache import validate_cache_params

        object.__setattr__(self, "params", validate_cache_params(self.method, self.params))

    @classmethod
    def from_dict(cls, data):
        if isinstance(data, (cls, type(None))):
            return cls() if data is None else data
        if isinstance(data, str):
            return cls.parse(data)
        if not isinstance(data, Mapping):
            raise ConfigError(f"CacheConfig expects a mapping or 'METHOD[:PARAM=VALUE,...]', got {type(data).__name__}")
        data = dict(data)
        method = data.pop("method", "first_block_cache")
        params = dict(data.pop("params", None) or {})
        params.update(data)  # flat form
        return cls(method=method, params=params)

    @classmethod
    def parse(cls, spec: str) -> "CacheConfig":
        """``"METHOD[:PARAM=VALUE,...]"``; lists and (low, high) pairs use ``/`` (``mag_ratios=1/0.98``)."""
        from .cache import parse_cache_spec

        method, params = parse_cache_spec(spec)
        return cls(method=method, params=params)

    def __hash__(self):
        return hash((self.method, tuple(sorted((k, repr(v)) for k, v in self.params.items()))))


@dataclass(frozen=True)
class QuantConfig(_ConfigMixin):
    r"""Quantized Linear layers (see :mod:`lite_boost.quant`).

    method: "int8_dynamic" (int8 weights x int8 activations, dynamic per token; CPU, CUDA),
        "int8_weight_only" (int8 weights; CPU, CUDA), "fp8" (float8_e4m3 weights x activations,
        dynamic; CUDA sm89+, bfloat16 models) or "w8a8_npu" (int8 x int8 through
        ``torch_npu.npu_quant_matmul``; Ascend, float16 / bfloat16 models).
    include: regular expressions matched against whole module names inside the transformer (e.g.
        ``r"blocks\.\d+\.ffn\..*"``); the nn.Linear layers that match are quantized. None = the
        model adapter's default (Wan: every Linear of the transformer blocks: attention projections
        and feed-forward; the embeddings, norms, final projection and modulation tables stay in
        full precision).
    exclude: regular expressions; matching layers stay in full precision.
    keep_original: keep the original full-precision weights so that ``unboost`` restores them bit
        for bit and ``save_pretrained`` writes them (on the CPU they stay where they are; on an
        accelerator a host copy is kept). False frees them: unboost / save_pretrained then refuse.

    ``QuantConfig.parse("int8_dynamic")`` reads the CLI form; ``{"quant": "int8_dynamic"}`` works too.
    """

    method: str = "int8_dynamic"
    include: tuple[str, ...] | None = None
    exclude: tuple[str, ...] = ()
    keep_original: bool = True

    def __post_init__(self):
        _check_choice("method", self.method, QUANT_METHODS)
        if self.include is not None:  # [] would quantize nothing: None means the model's default layers
            object.__setattr__(self, "include", check_regexes("quant include", self.include))
        object.__setattr__(self, "exclude", check_regexes("quant exclude", self.exclude, allow_empty=True))
        _check_bool("keep_original", self.keep_original)

    @classmethod
    def from_dict(cls, data):
        if isinstance(data, str):
            return cls.parse(data)
        return super().from_dict(data)

    @classmethod
    def parse(cls, spec: str) -> "QuantConfig":
        """``"METHOD"``, e.g. ``"int8_dynamic"``."""
        if not isinstance(spec, str):
            raise ConfigError(f"quant must be one of {list(QUANT_METHODS)}, got {spec!r}")
        return cls(method=spec.strip().replace("-", "_"))


# Device types an offloaded model may compute on (``OffloadConfig.onload_device``), with an optional ":index".
OFFLOAD_DEVICE_TYPES = ("cpu", "cuda", "npu", "xpu")


def _check_device(name: str, value: Any, types=OFFLOAD_DEVICE_TYPES) -> None:
    ok = isinstance(value, str) and re.fullmatch(rf"({'|'.join(types)})(:\d+)?", value) is not None
    if not ok:
        raise ConfigError(f"{name} must be a device string of type {list(types)} (optionally with ':INDEX', e.g. "
                          f"'cuda:0'), got {value!r}")


@dataclass(frozen=True)
class OffloadConfig(_ConfigMixin):
    """Block-level offload of the transformer(s) and the text encoder(s) to host memory
    (see :mod:`lite_boost.offload`; diffusers' group-offloading hooks).

    Each transformer block (group of ``num_blocks_per_group`` blocks) is uploaded to the compute device
    just before it runs and dropped from it afterwards; on CUDA / NPU the next block's upload runs on a
    side stream while the current block computes, so device memory holds about two blocks of weights
    plus what is not in a block (embeddings, norms, the output projection) instead of the whole model.

    onload_device: where the blocks compute: "cpu", "cuda[:N]", "npu[:N]", "xpu[:N]"; None = the
        model's device when it is an accelerator, else the rank's accelerator when there is one, else
        the CPU (where the hooks still run but nothing moves).
    offload_device: where the weights wait: only "cpu" (host memory).
    num_blocks_per_group: blocks uploaded together (1 with a side stream: diffusers' rule).
    use_stream: overlap the next group's upload with the current group's compute on a side stream;
        None = on when the onload device has streams (CUDA, NPU, XPU), off on the CPU.
    record_stream: with ``use_stream``, let the allocator track the compute stream instead of
        synchronising before each group is dropped (faster, slightly more memory).
    low_cpu_mem_usage: pin host copies on the fly instead of keeping a pinned copy of every block
        (less host memory, slower uploads); matters only with ``use_stream``.
    disk_path: a folder: offload to safetensors files there instead of host memory (for hosts whose RAM
        cannot hold the model; slower). None = host memory.
    text_encoder: offload the pipeline's text / image encoders the same way (their layer stacks);
        False leaves them where they are. The pipeline's other modules (the VAE) go to the onload device.

    Under ``ParallelManager`` with ``parallel.fsdp_degree > 1`` the FSDP-sharded modules are offloaded by
    FSDP2's ``CPUOffloadPolicy`` instead (the shards in host memory, pinned unless ``low_cpu_mem_usage``, the
    next block's gather prefetched unless ``use_stream=False``); ``disk_path`` and ``num_blocks_per_group`` > 1
    are refused there. With ``parallel.tp_degree > 1`` offload is refused.
    """

    onload_device: str | None = None
    offload_device: str = "cpu"
    num_blocks_per_group: int = 1
    use_stream: bool | None = None
    record_stream: bool = False
    low_cpu_mem_usage: bool = False
    disk_path: str | None = None
    text_encoder: bool = True

    def __post_init__(self):
        if self.onload_device is not None:
            _check_device("offload.onload_device", self.onload_device)
        _check_choice("offload.offload_device", self.offload_device, ("cpu",))
        _check_int("offload.num_blocks_per_group", self.num_blocks_per_group, lo=1)
        if self.use_stream is not None:
            _check_bool("offload.use_stream", self.use_stream)
        _check_bool("offload.record_stream", self.record_stream)
        _check_bool("offload.low_cpu_mem_usage", self.low_cpu_mem_usage)
        _check_bool("offload.text_encoder", self.text_encoder)
        if self.disk_path is not None and (not isinstance(self.disk_path, str) or not self.disk_path):
            raise ConfigError(f"offload.disk_path must be a folder path (str) or None, got {self.disk_path!r}")
        if self.record_stream and self.use_stream is False:
            raise ConfigError("offload.record_stream=True needs offload.use_stream True or None (a side stream); "
                              "valid record_stream with use_stream=False: [False]")
        if self.use_stream and self.onload_device is not None and self.onload_device.startswith("cpu"):
            raise ConfigError(f"offload.use_stream=True needs an onload device with streams (cuda, npu, xpu), got "
                              f"onload_device={self.onload_device!r}; valid use_stream on the CPU: [None, False]")
        if self.use_stream and self.num_blocks_per_group != 1:
            raise ConfigError(f"offload.num_blocks_per_group={self.num_blocks_per_group} with use_stream=True: a side "
                              "stream uploads one block at a time; valid num_blocks_per_group with use_stream: [1]")

    @classmethod
    def from_dict(cls, data):
        """A mapping of the fields above, ``True`` (the defaults) or a device string (``"cuda:1"``)."""
        if data is True:
            return cls()
        if isinstance(data, str):
            return cls(onload_device=data)
        return super().from_dict(data)


@dataclass(frozen=True)
class AttentionConfig(_ConfigMixin):
    """The attention kernels of a boosted model.

    backend: dense attention backend, None = automatic (fa3 -> fa2 -> npu -> sdpa), or one of
        ATTENTION_BACKEND_NAMES (the same setting as ``BoostConfig.attention_backend``).
    precision: arithmetic of the sequence self-attention (self and joint roles, dense and
        block-sparse alike; cross-attention to a short context stays in the input dtype):
        "auto" (the input dtype, the default), "int8" (int8 Q K^T after smoothing K by its mean
        over tokens, fp32 softmax, 16-bit P V) or "fp8" (where the device has FP8). A precision
        the device cannot run is refused with a ConfigError when the model is boosted.
    """

    backend: str | None = None
    precision: str = "auto"

    def __post_init__(self):
        _check_choice("attention.backend", self.backend, (None,) + ATTENTION_BACKEND_NAMES)
        _check_choice("attention.precision", self.precision, ATTENTION_PRECISIONS)

    @classmethod
    def from_dict(cls, data):
        if isinstance(data, str):
            raise ConfigError(f"attention must be a mapping with keys ['backend', 'precision'] or an AttentionConfig, "
                              f"got {data!r}")
        return super().from_dict(data)


@dataclass(frozen=True)
class BoostConfig(_ConfigMixin):
    """Top-level config for ``lite_boost.boost`` / ``ParallelManager``.

    attention_backend: None = automatic (fa3 -> fa2 -> npu -> sdpa) or one of ATTENTION_BACKEND_NAMES.
    attention: AttentionConfig or a mapping ``{"backend": ..., "precision": ...}``; its backend and
        ``attention_backend`` are one setting (give either, or both equal; each then reads the same).
    rope_cache_size: how many RoPE table sets (grid, head_dim, device, slice) are kept (LRU).
    sparse: SparseConfig or None (dense self-attention).
    parallel: ParallelConfig.
    cache: CacheConfig, a mapping, a "METHOD[:PARAM=VALUE,...]" string, or None (no step caching).
    quant: QuantConfig, a mapping, a method name string, or None (full-precision Linear layers).
    offload: OffloadConfig, a mapping, True (the defaults), a device string, or None / False (the
        weights stay where they are).
    """

    attention_backend: str | None = None
    rope_cache_size: int = 8
    sparse: SparseConfig | None = None
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    cache: CacheConfig | None = None
    quant: QuantConfig | None = None
    offload: OffloadConfig | None = None
    attention: AttentionConfig = field(default_factory=AttentionConfig)

    def __post_init__(self):
        _check_choice("attention_backend", self.attention_backend, (None,) + ATTENTION_BACKEND_NAMES)
        if isinstance(self.attention, Mapping):
            object.__setattr__(self, "attention", AttentionConfig.from_dict(self.attention))
        if not isinstance(self.attention, AttentionConfig):
            raise ConfigError(f"attention must be an AttentionConfig or a mapping with keys ['backend', 'precision'], "
                              f"got {type(self.attention).__name__}")
        a, b = self.attention_backend, self.attention.backend
        if a is not None and b is not None and a != b:
            raise ConfigError(f"attention_backend={a!r} and attention.backend={b!r} disagree; they are one setting: "
                              "give one of them")
        if a is None and b is not None:
            object.__setattr__(self, "attention_backend", b)
        elif b is None and a is not None:
            object.__setattr__(self, "attention", dataclasses.replace(self.attention, backend=a))
        _check_int("rope_cache_size", self.rope_cache_size, lo=1)
        if isinstance(self.sparse, Mapping):
            object.__setattr__(self, "sparse", SparseConfig.from_dict(self.sparse))
        if self.sparse is not None and not isinstance(self.sparse, SparseConfig):
            raise ConfigError(f"sparse must be a SparseConfig, a mapping or None, got {type(self.sparse).__name__}")
        if isinstance(self.parallel, Mapping):
            object.__setattr__(self, "parallel", ParallelConfig.from_dict(self.parallel))
        if not isinstance(self.parallel, ParallelConfig):
            raise ConfigError(f"parallel must be a ParallelConfig or a mapping, got {type(self.parallel).__name__}")
        if isinstance(self.cache, (Mapping, str)):
            object.__setattr__(self, "cache", CacheConfig.from_dict(self.cache))
        if self.cache is not None and not isinstance(self.cache, CacheConfig):
            raise ConfigError(f"cache must be a CacheConfig, a mapping, a 'METHOD[:PARAM=VALUE,...]' string or None, "
                              f"got {type(self.cache).__name__}")
        if isinstance(self.quant, (Mapping, str)):
            object.__setattr__(self, "quant", QuantConfig.from_dict(self.quant))
        if self.quant is not None and not isinstance(self.quant, QuantConfig):
            raise ConfigError(f"quant must be a QuantConfig, a mapping, a method name {list(QUANT_METHODS)} or None, "
                              f"got {type(self.quant).__name__}")
        if self.offload is False:
            object.__setattr__(self, "offload", None)
        elif self.offload is True or isinstance(self.offload, (Mapping, str)):
            object.__setattr__(self, "offload", OffloadConfig.from_dict(self.offload))
        if self.offload is not None and not isinstance(self.offload, OffloadConfig):
            raise ConfigError(f"offload must be an OffloadConfig, a mapping, True / False, a device string or None, "
                              f"got {type(self.offload).__name__}")

    def replace(self, **changes):
        """``dataclasses.replace``, keeping ``attention_backend`` and ``attention.backend`` one setting: the one
        changed wins."""
        if "attention_backend" in changes and "attention" not in changes:
            changes["attention"] = dataclasses.replace(self.attention, backend=changes["attention_backend"])
        elif "attention" in changes and "attention_backend" not in changes:
            att = changes["attention"]
            changes["attention_backend"] = att.get("backend") if isinstance(att, Mapping) else getattr(att, "backend", None)
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None):
        """Our keys, or MindSpore Lite's BoostManager schema: a ``Parallel`` section (see
        :func:`parallel_from_boost_manager`) in place of ``parallel``, beside any of our other keys."""
        if isinstance(data, Mapping) and "Parallel" in data:
            if "parallel" in data:
                raise ConfigError("give either 'Parallel' (the MindSpore Lite BoostManager schema) or 'parallel' "
                                  "(lite_boost's), not both")
            data = dict(data)
            data["parallel"] = parallel_from_boost_manager(data.pop("Parallel"))
        return super().from_dict(data)

    @classmethod
    def coerce(cls, config: "BoostConfig | SparseConfig | ParallelConfig | Mapping | None") -> "BoostConfig":
        """Accept a BoostConfig, a sub-config, a mapping or None and return a BoostConfig."""
        if config is None:
            return cls()
        if isinstance(config, BoostConfig):
            return config
        if isinstance(config, SparseConfig):
            return cls(sparse=config)
        if isinstance(config, ParallelConfig):
            return cls(parallel=config)
        if isinstance(config, CacheConfig):
            return cls(cache=config)
        if isinstance(config, QuantConfig):
            return cls(quant=config)
        if isinstance(config, OffloadConfig):
            return cls(offload=config)
        if isinstance(config, AttentionConfig):
            return cls(attention=config)
        if isinstance(config, Mapping):
            return cls.from_dict(config)
        if isinstance(config, os.PathLike) or (isinstance(config, str) and (
                config.lower().endswith((".yaml", ".yml")) or os.path.isfile(config))):
            raise ConfigError(yaml_path_hint(config))
        raise ConfigError(
            "config must be a BoostConfig, SparseConfig, ParallelConfig, CacheConfig, QuantConfig, OffloadConfig, "
            "AttentionConfig, a "
            "mapping or None, "
            f"got {type(config).__name__}"
        )


# ------------------------------------------------------------------ MindSpore Lite BoostManager schema
# Parallel:                     lite_boost ParallelConfig
#   world_size: N               world_size (checked against the launched world size)
#   dit:
#     alg: CP                   context (sequence) parallel over every rank: Ulysses x Ring
#     world_size: N             world_size
#     ulysses_degree / ring_degree / cfg_degree / sequence_degree / rotate_method   (lite_boost extensions)
#     tp_degree / fsdp_degree / fsdp_text_encoder   tensor parallelism, FSDP2 weight sharding (lite_boost extensions)
#   vae:
#     alg: DP                   vae_parallel: the VAE decode / encode split over the ranks ("NONE": every
#                               rank runs the whole VAE, vae_parallel="off")
#     world_size: N             world_size
#     mode: exact | chunked     vae_parallel mode (default exact; chunked = the reference's temporal tiles)
#     overlap / chunk_size / gather   vae_overlap / vae_chunk_size / vae_gather ("chunked" mode)
BOOST_MANAGER_DIT_ALGS = ("CP",)
BOOST_MANAGER_VAE_ALGS = ("DP", "NONE")
_BM_SECTIONS = ("dit", "vae", "world_size")
_BM_DIT = {"alg": None, "world_size": None, "ulysses_degree": "ulysses_degree", "ring_degree": "ring_degree",
           "cfg_degree": "cfg_degree", "sequence_degree": "sequence_degree", "rotate_method": "rotate_method",
           "tp_degree": "tp_degree", "fsdp_degree": "fsdp_degree", "fsdp_text_encoder": "fsdp_text_encoder"}
_BM_VAE = {"alg": None, "world_size": None, "mode": None, "overlap": "vae_overlap", "chunk_size": "vae_chunk_size",
           "gather": "vae_gather"}


def _bm_section(name: str, value: Any, keys) -> dict:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ConfigError(f"{name} must be a mapping with keys {sorted(keys)}, got {value!r}")
    unknown = sorted(map(str, set(value) - set(keys)))
    if unknown:
        raise ConfigError(f"unknown {name} key(s) {unknown}; accepted keys are {sorted(keys)}")
    return dict(value)


def _bm_alg(name: str, value: Any, allowed) -> str:
    alg = value.upper() if isinstance(value, str) else value
    if alg not in allowed:
        raise ConfigError(f"{name} must be one of {list(allowed)}, got {value!r}")
    return alg


def parallel_from_boost_manager(section: Any) -> dict[str, Any]:
    """Map MindSpore Lite's ``Parallel`` section (``dit.alg: CP``, ``vae.alg: DP``, ``world_size``) onto
    :class:`ParallelConfig` keys. Raises ConfigError naming the key (``Parallel.dit.alg``) and the allowed values.
    """
    top = _bm_section("Parallel", section, _BM_SECTIONS)
    dit = _bm_section("Parallel.dit", top.get("dit"), _BM_DIT)
    vae = _bm_section("Parallel.vae", top.get("vae"), _BM_VAE)
    out: dict[str, Any] = {}
    sizes = {}
    for name, sec in (("Parallel", top), ("Parallel.dit", dit), ("Parallel.vae", vae)):
        if sec.get("world_size") is not None:
            _check_int(f"{name}.world_size", sec["world_size"], lo=1)
            sizes[f"{name}.world_size"] = sec["world_size"]
    if len(set(sizes.values())) > 1:
        raise ConfigError(f"{' / '.join(sizes)} disagree ({sizes}); lite_boost runs the DiT and the VAE over the same "
                          "ranks: give one world size")
    if sizes:
        out["world_size"] = next(iter(sizes.values()))
    if "alg" in dit:
        _bm_alg("Parallel.dit.alg", dit["alg"], BOOST_MANAGER_DIT_ALGS)
    for key in ("ulysses_degree", "ring_degree", "sequence_degree"):
        if key in dit:
            _check_int(f"Parallel.dit.{key}", dit[key], lo=1, allow_none=True)
            out[key] = dit[key]
    if "cfg_degree" in dit:
        _check_choice("Parallel.dit.cfg_degree", dit["cfg_degree"], (1, 2))
        out["cfg_degree"] = dit["cfg_degree"]
    if "rotate_method" in dit:
        _check_choice("Parallel.dit.rotate_method", dit["rotate_method"], ROTATE_METHODS)
        out["rotate_method"] = dit["rotate_method"]
    for key in ("tp_degree", "fsdp_degree"):
        if key in dit:
            _check_int(f"Parallel.dit.{key}", dit[key], lo=1)
            out[key] = dit[key]
    if "fsdp_text_encoder" in dit:
        _check_bool("Parallel.dit.fsdp_text_encoder", dit["fsdp_text_encoder"])
        out["fsdp_text_encoder"] = dit["fsdp_text_encoder"]
    alg = _bm_alg("Parallel.vae.alg", vae["alg"], BOOST_MANAGER_VAE_ALGS) if "alg" in vae else None
    mode = vae.get("mode")
    if mode is not None:
        _check_choice("Parallel.vae.mode", mode, ("exact", "chunked"))
        if alg == "NONE":
            raise ConfigError(f"Parallel.vae.mode={mode!r} needs Parallel.vae.alg: DP (alg NONE runs the whole VAE on "
                              "every rank)")
    if alg == "NONE":
        out["vae_parallel"] = "off"
    elif alg == "DP" or mode is not None:
        out["vae_parallel"] = mode or "exact"
    for key, ours in (("overlap", "vae_overlap"), ("chunk_size", "vae_chunk_size")):
        if key in vae:
            _check_int(f"Parallel.vae.{key}", vae[key], lo=1, allow_none=True)
            if vae[key] is not None and out.get("vae_parallel") != "chunked":
                raise ConfigError(f"Parallel.vae.{key} applies to Parallel.vae.mode: chunked only; valid "
                                  f"Parallel.vae.mode values with {key}: ['chunked']")
            out[ours] = vae[key]
    if "gather" in vae:
        _check_choice("Parallel.vae.gather", vae["gather"], ("all", "rank0"))
        if vae["gather"] != "all" and out.get("vae_parallel") != "chunked":
            raise ConfigError("Parallel.vae.gather='rank0' applies to Parallel.vae.mode: chunked only; valid "
                              "Parallel.vae.gather here: ['all']")
        out["vae_gather"] = vae["gather"]
    return out


_NESTED = {("BoostConfig", "sparse"): SparseConfig, ("BoostConfig", "parallel"): ParallelConfig,
           ("BoostConfig", "cache"): CacheConfig, ("BoostConfig", "quant"): QuantConfig,
           ("BoostConfig", "offload"): OffloadConfig, ("BoostConfig", "attention"): AttentionConfig}
