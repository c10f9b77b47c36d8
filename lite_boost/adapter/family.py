"""The declarative description of a model family: what varies per family is data.

A :class:`ModelFamily` says where the attention processors go, how the text meets the image tokens,
which module makes the RoPE tables and how they become the cached fp32 form, the latent token grid
for sparse windows, where the sequence is split and gathered, how the pipeline runs classifier-free
guidance, which step-cache methods fit, which modules quantize by default, and so which features
the family supports. The generic machinery of :mod:`lite_boost.adapter` does the rest.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from ..cache import CacheAdapter
from ..config import BoostConfig, ConfigError
from ..parallel.plan import PipelinePlan, ShardingPlan
from . import boost as _boost
from .processor import ROLES

__all__ = ["AttentionSite", "RopeSource", "TinyPipeline", "ModelFamily", "FEATURES", "JOINT_LAYOUTS", "OUTPUTS",
           "RUN_KINDS", "feature_error", "resolve_ref"]

# How the text meets the image / video tokens:
# "cross": separate cross-attention (Wan, LTX); "text_first": joint attention over [text, image]
# (Qwen-Image, Flux, CogVideoX); "image_first": joint attention over [image, text] (HunyuanVideo);
# "packed": the text rows (and any other stream) are rows of the one self-attention sequence the model
# packs itself (MiniMax-H3): no joint stream, the sites are "self".
JOINT_LAYOUTS = ("cross", "text_first", "image_first", "packed")

# What a family's pipelines make (``ModelFamily.output``) and the kinds of run of each (text- or image-conditioned).
OUTPUTS = ("image", "video")
RUN_KINDS = {"video": ("t2v", "i2v"), "image": ("t2i", "i2i")}

# Features a family may support (``ModelFamily.features``; ``lite-boost models`` lists them).
FEATURES = ("dense", "sparse", "sequence_parallel", "cfg_parallel", "step_cache", "compile", "parallel_vae", "quant")


def feature_error(family, feature: str, option: str) -> ConfigError:
    """The refusal of ``feature`` for a family that lacks it (any record with ``name`` and ``features``),
    naming the option, the reason and the registered families that have the feature."""
    from ..registry import families

    others = [f.name for f in families() if f.supports(feature)]
    return ConfigError(f"{option} is not supported for the {family.name} family "
                       f"({family.features[feature]}); families with {feature}: {others}")


def resolve_ref(ref: str):
    """The object a ``"package.module:attribute"`` reference names (imported when called: records refer to
    code above their layer, such as the built-in tiny pipelines of :mod:`lite_boost.demo`, by name)."""
    import importlib

    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)


def _check_ref(owner: str, what: str, ref, optional: bool = False) -> None:
    if optional and ref is None:
        return
    module, sep, attr = ref.partition(":") if isinstance(ref, str) else ("", "", "")
    if not (sep and module and attr.isidentifier()):
        raise ValueError(f"{owner}: {what} must be a 'package.module:function' reference, got {ref!r}")


@dataclass(frozen=True)
class TinyPipeline:
    """A built-in tiny random-weight pipeline of a family: what ``lite-boost generate --family NAME`` runs
    offline without ``--model`` (one per kind of run, :attr:`ModelFamily.tiny`).

    pipeline: the diffusers pipeline class name it builds.
    builder: ``"module:function"``; ``function(kind, dtype=...) -> pipeline`` builds it (imported when run).
    shape: default (height, width, num_frames) of the run; num_frames None for an image family.
    steps: default denoising steps.
    sparsity: default ``--sparsity`` of the run (0 = dense).
    describe: ``"module:function"``; ``function(pipe, call_kwargs) -> str``: the one line the command prints
        about the model (sizes, tokens, text), or None.
    prompt: ``"module:function"``; ``function(pipe, *, cfg, seed) -> dict``: the prompt arguments of a call
        when the built pipeline has no text encoder (random prompt embeddings), or None (``prompt`` /
        ``negative_prompt`` strings).
    default: this is the run of a bare ``lite-boost generate`` (exactly one registered tiny pipeline says so).
    stand_ins: component name -> ``"module:function"``; ``function() -> object``: what a pipeline folder saved
        without that component (and without a text encoder: called with ``prompt``'s embeddings) is created with,
        where diffusers cannot create the pipeline with None (a stand-in of what its ``__init__`` reads).
    """

    pipeline: str
    builder: str
    shape: tuple
    steps: int = 10
    sparsity: float = 0.0
    describe: str | None = None
    prompt: str | None = None
    default: bool = False
    stand_ins: Mapping[str, str] = field(default_factory=dict, hash=False)

    def __post_init__(self):
        owner = f"TinyPipeline {self.pipeline!r}"
        if not isinstance(self.pipeline, str) or not self.pipeline:
            raise ValueError(f"TinyPipeline.pipeline must be a diffusers pipeline class name, got {self.pipeline!r}")
        _check_ref(owner, "builder", self.builder)
        _check_ref(owner, "describe", self.describe, optional=True)
        _check_ref(owner, "prompt", self.prompt, optional=True)
        if not isinstance(self.stand_ins, Mapping) or not all(isinstance(k, str) for k in self.stand_ins):
            raise ValueError(f"{owner}: stand_ins must map component names to 'package.module:function' references, "
                             f"got {self.stand_ins!r}")
        for name, ref in self.stand_ins.items():
            _check_ref(owner, f"stand_ins[{name!r}]", ref)
        if self.stand_ins and self.prompt is None:
            raise ValueError(f"{owner}: stand_ins need prompt (a pipeline created with stand-ins is called with "
                             "prompt embeddings)")
        object.__setattr__(self, "stand_ins", dict(self.stand_ins))
        shape = tuple(self.shape)
        if (len(shape) != 3 or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in shape[:2])
                or not (shape[2] is None or (isinstance(shape[2], int) and shape[2] > 0))):
            raise ValueError(f"{owner}: shape must be (height, width, num_frames or None), got {self.shape!r}")
        object.__setattr__(self, "shape", shape)
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 1:
            raise ValueError(f"{owner}: steps must be a positive int, got {self.steps!r}")
        if not isinstance(self.sparsity, (int, float)) or not 0.0 <= self.sparsity < 1.0:
            raise ValueError(f"{owner}: sparsity must be in [0, 1), got {self.sparsity!r}")

    def build(self, kind: str, dtype):
        """The tiny pipeline (random weights, built offline)."""
        return resolve_ref(self.builder)(kind, dtype=dtype)

    def describe_run(self, pipe, call_kwargs) -> str | None:
        return resolve_ref(self.describe)(pipe, call_kwargs) if self.describe is not None else None

    def prompt_kwargs(self, pipe, *, cfg: bool, seed: int) -> dict | None:
        return resolve_ref(self.prompt)(pipe, cfg=cfg, seed=seed) if self.prompt is not None else None

    def stand_in(self, name: str):
        """A new stand-in for the component ``name`` (:attr:`stand_ins`)."""
        return resolve_ref(self.stand_ins[name])()


@dataclass(frozen=True)
class AttentionSite:
    """Attention modules that get one processor shim.

    path: module path with ``*`` for a ``ModuleList`` index, e.g. ``"transformer_blocks.*.attn"``
        (the first ``*`` is the processor's layer index). Only matching modules are touched, so
        refiner or adapter attentions elsewhere in the model keep diffusers' processors.
    processor: ``processor(layer_idx, role, backend) -> LiteBoostProcessor`` (usually the class).
    role: "self" (sequence self-attention), "joint" (the same with a text stream) or "cross".
    layer_offset: added to the matched index: an int, or ``layer_offset(model) -> int``. A model
        with two block lists (Flux's dual- then single-stream blocks) numbers the second list after
        the first (``lambda model: len(model.transformer_blocks)``), so every layer of the sequence
        attention has its own index (per-layer sparse policies and masks).
    """

    path: str
    processor: Callable[..., Any]
    role: str = "self"
    layer_offset: int | Callable[[Any], int] = 0

    def __post_init__(self):
        if not isinstance(self.path, str) or not self.path:
            raise ValueError(f"AttentionSite.path must be a module path such as 'blocks.*.attn1', got {self.path!r}")
        if self.role not in ROLES:
            raise ValueError(f"AttentionSite.role must be one of {list(ROLES)}, got {self.role!r}")
        if not callable(self.processor):
            raise TypeError(f"AttentionSite.processor must be callable, got {type(self.processor).__name__}")
        if isinstance(self.layer_offset, bool) or not (callable(self.layer_offset) or isinstance(self.layer_offset, int)):
            raise TypeError(f"AttentionSite.layer_offset must be an int or a callable(model) -> int, got "
                            f"{self.layer_offset!r}")

    def offset(self, model) -> int:
        """The layer offset of this site in ``model``."""
        value = self.layer_offset(model) if callable(self.layer_offset) else self.layer_offset
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise TypeError(f"layer_offset of attention site {self.path!r} must give an int >= 0, got {value!r}")
        return value


@dataclass(frozen=True)
class RopeSource:
    """The module that produces the RoPE tables and its cached replacement.

    module: path of the RoPE module (``"rope"``, ``"pos_embed"``).
    forward: ``forward(rope_module, boost_state) -> callable`` building the instance ``forward`` that
        serves the tables in the cached fp32 form (:class:`~lite_boost.ops.rope.RotaryEmbedding`,
        from ``boost_state.rope_cache``; rows ``boost_state.serve_range(seq_len)`` under sequence
        parallelism). The processor shim applies what it returns.
    matches: ``matches(rope_module) -> bool``: the replacement reproduces this module (else diffusers'
        own RoPE is kept and the plan's ``split_outputs`` shard its tables); None = always.
    """

    module: str
    forward: Callable[[Any, Any], Callable]
    matches: Callable[[Any], bool] | None = None


@dataclass(frozen=True)
class ModelFamily:
    """A diffusers model family as lite_boost boosts it (see the guide in :mod:`lite_boost.adapter`).

    name: short name ("wan", "qwen-image"): CLI, docs and error messages.
    transformers: transformer class names (subclasses are found by lookup).
    pipelines: pipeline class names.
    attention: the attention sites and their processor shims.
    joint: how text meets the image tokens, one of :data:`JOINT_LAYOUTS`.
    rope: the RoPE module and its cached replacement, or None (the family has no RoPE module).
    ropes: further RoPE modules of a model that has several (LTX-2: video, audio and the two cross-attention
        RoPE modules), each replaced like ``rope``; empty for most families.
    token_grid: ``token_grid(model, args, kwargs) -> (t, h, w) | None``: the latent token grid of a
        transformer call (shape arithmetic only: it runs in traced code), for sparse windows;
        None = the family has no block-sparse path. ``(t, h, w, lead)``: the grid is the tail of a
        self-attention sequence behind ``lead`` other rows (a "packed" layout), kept dense both ways.
    timestep_module: child module whose first argument is the timestep (where the compiled graph
        advances the sparse step tracker); None = the step is tracked from the transformer call only.
    call_context: ``call_context(model, args, kwargs) -> object``: facts about one transformer call
        read from its arguments before anything else runs (shape arithmetic, the caller's argument
        tensors by reference: never large activations), kept as ``BoostState.call`` for the
        duration of that call (None outside a call) for the family's RoPE shim and token grid, e.g.
        the text length of a model whose RoPE module only sees the concatenated position ids
        (Flux); None = the family needs none.
    call_args: ``call_args(model, args, kwargs) -> (args, kwargs) | None``: rewrites the arguments
        of every transformer call before anything else runs (a pure function of them, e.g. shape
        arithmetic; None keeps them), e.g. Flux.2 hands its single-stream processors the text
        length through ``joint_attention_kwargs`` as diffusers' own KV path does. Runs before
        ``call_context``; None = the family needs none.
    sharding: where the sequence is split and gathered under sequence parallelism, or None.
    pipeline: the pipelines' transformer attributes, CFG plan and latent preparation.
    cache: the step-cache methods that fit (diffusers' hooks), or None.
    quant_patterns: module-name patterns (``fnmatch``, e.g. ``"blocks.*"``) quantized by default.
    unsupported: feature -> why not, for features the data would otherwise imply (or to explain a
        missing one in ``lite-boost models``).
    notes: one line for ``lite-boost models`` (e.g. what runs on one rank).
    tensor_parallel: which Linear layers ``tp_degree`` splits (:class:`~lite_boost.parallel.shard.TensorParallelPlan`),
        or None: diffusers' ``_tp_plan`` of the model class when it has one, else no tensor parallelism.
    reference: the released model the memory planner plans for by default (``lite-boost plan --family``,
        ``ParallelConfig(layout="auto")``): ``name``, ``transformer`` (config of the first transformer class;
        omitted = the class defaults), ``text_encoder`` ((transformers class name, config) or omitted),
        ``shape`` ((num_frames, height, width)), ``vae_scale`` ((t, h, w) down-sampling); see
        :func:`lite_boost.memory.dims_for_family`.
    output: what its pipelines make, one of :data:`OUTPUTS` ("image", "video"), or None: read from each
        pipeline's call signature (``num_frames``), as for the generic path.
    cfg_argument: the pipelines' call argument that takes the classifier-free guidance scale
        (``"guidance_scale"``; Qwen-Image's and Flux's true CFG: ``"true_cfg_scale"``), or None when the
        pipelines take none (a guider object holds it). ``lite-boost generate --guidance-scale`` sets it.
    tiny: kind of run (:data:`RUN_KINDS` of ``output``: "t2v" / "i2v", "t2i" / "i2i") -> the built-in tiny
        pipeline (:class:`TinyPipeline`) ``lite-boost generate --family NAME`` runs without ``--model``;
        empty = the family has none.
    """

    name: str
    transformers: tuple[str, ...]
    attention: tuple[AttentionSite, ...]
    pipelines: tuple[str, ...] = ()
    joint: str = "cross"
    rope: RopeSource | None = None
    ropes: tuple[RopeSource, ...] = ()
    token_grid: Callable[..., Any] | None = None
    timestep_module: str | None = None
    call_context: Callable[..., Any] | None = None
    call_args: Callable[..., Any] | None = None
    sharding: ShardingPlan | None = None
    pipeline: PipelinePlan = field(default_factory=PipelinePlan)
    cache: CacheAdapter | None = None
    quant_patterns: tuple[str, ...] = ()
    unsupported: Mapping[str, str] = field(default_factory=dict)
    notes: str = ""
    tensor_parallel: Any = None
    reference: Mapping[str, Any] = field(default_factory=dict)
    output: str | None = None
    cfg_argument: str | None = "guidance_scale"
    tiny: Mapping[str, TinyPipeline] = field(default_factory=dict)

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"ModelFamily.name must be a non-empty str, got {self.name!r}")
        for what in ("transformers", "pipelines", "attention", "quant_patterns", "ropes"):
            object.__setattr__(self, what, tuple(getattr(self, what)))
        if not self.transformers or not all(isinstance(n, str) and n for n in (*self.transformers, *self.pipelines)):
            raise ValueError(f"family {self.name!r}: transformers / pipelines must be class names, got "
                             f"{self.transformers!r} / {self.pipelines!r}")
        if not self.attention or not all(isinstance(s, AttentionSite) for s in self.attention):
            raise ValueError(f"family {self.name!r}: attention must be one or more AttentionSite")
        if not all(isinstance(r, RopeSource) for r in self.ropes):
            raise ValueError(f"family {self.name!r}: ropes must be RopeSource records, got {self.ropes!r}")
        if self.joint not in JOINT_LAYOUTS:
            raise ValueError(f"family {self.name!r}: joint must be one of {list(JOINT_LAYOUTS)}, got {self.joint!r}")
        separate = self.joint in ("cross", "packed")
        if separate == any(s.role == "joint" for s in self.attention):
            raise ValueError(f"family {self.name!r}: joint={self.joint!r} needs "
                             f"{'no' if separate else 'at least one'} attention site with role 'joint'")
        for what in ("call_context", "call_args"):
            fn = getattr(self, what)
            if fn is not None and not callable(fn):
                raise TypeError(f"family {self.name!r}: {what} must be callable, got {type(fn).__name__}")
        unknown = sorted(set(self.unsupported) - set(FEATURES))
        if unknown:
            raise ValueError(f"family {self.name!r}: unknown feature(s) {unknown} in unsupported; features: {list(FEATURES)}")
        if self.output is not None and self.output not in OUTPUTS:
            raise ValueError(f"family {self.name!r}: output must be one of {list(OUTPUTS)} or None, got {self.output!r}")
        if self.cfg_argument is not None and not (isinstance(self.cfg_argument, str)
                                                  and self.cfg_argument.isidentifier()):
            raise ValueError(f"family {self.name!r}: cfg_argument must be a pipeline argument name or None, got "
                             f"{self.cfg_argument!r}")
        if self.tiny:
            kinds = RUN_KINDS.get(self.output, ())
            bad = [k for k in self.tiny if k not in kinds]
            if bad or not all(isinstance(t, TinyPipeline) for t in self.tiny.values()):
                raise ValueError(f"family {self.name!r}: tiny must map kinds of run of its output ({self.output!r}: "
                                 f"{list(kinds)}; set output) to TinyPipeline records, got {dict(self.tiny)!r}")
            if any((t.shape[2] is None) != (self.output == "image") for t in self.tiny.values()):
                raise ValueError(f"family {self.name!r}: a tiny pipeline's shape has num_frames for a video family "
                                 "and None for an image family")
        object.__setattr__(self, "tiny", dict(self.tiny))
        object.__setattr__(self, "boost_transformer", self._make_boost(transformer=True))
        object.__setattr__(self, "boost_pipeline", self._make_boost(transformer=False))

    # ------------------------------------------------------------------ generated boost functions
    def _make_boost(self, transformer: bool):
        family = self
        ident = self.name.replace("-", "_")
        if transformer:
            def boost(model, config: BoostConfig | None = None, *, plan=None):
                return _boost.boost_model(family, model, config, plan=plan)

            boost.unboost = _boost.unboost_model
            kind, what = "transformer", " / ".join(self.transformers)
        else:
            def boost(pipe, config: BoostConfig | None = None, *, plan=None):
                return _boost.boost_pipeline(family, pipe, config, plan=plan)

            boost.unboost = lambda pipe: _boost.unboost_pipeline(family, pipe)
            kind, what = "pipeline", ", ".join(self.pipelines) or "(none)"
        boost.__name__ = boost.__qualname__ = f"boost_{ident}_{kind}"
        boost.__doc__ = f"Boost a {what} in place and return it (the {self.name} family; idempotent for an equal config)."
        boost.family = family
        return boost

    # ------------------------------------------------------------------ capabilities
    @property
    def features(self) -> dict[str, str | None]:
        """feature -> None when supported, else the reason it is not (every name of :data:`FEATURES`)."""
        sequence_roles = any(s.role in ("self", "joint") for s in self.attention)
        derived = {
            "dense": None,
            "sparse": None if (self.token_grid is not None and sequence_roles) else "no latent token grid declared",
            "sequence_parallel": None if self.sharding is not None else "no sharding plan",
            "cfg_parallel": (None if (self.pipelines and self.pipeline.cfg is not None
                                      and self.pipeline.cfg.kind != "none") else "its pipelines run no CFG to split"),
            "step_cache": None if self.cache is not None else "no cache adapter",
            "compile": None,
            "parallel_vae": None if self.pipelines else "no pipelines (the VAE belongs to the pipeline)",
            "quant": None if self.quant_patterns else "no default quantization patterns",
        }
        return {f: self.unsupported.get(f, derived[f]) for f in FEATURES}

    def supports(self, feature: str) -> bool:
        if feature not in FEATURES:
            raise ValueError(f"unknown feature {feature!r}; features: {list(FEATURES)}")
        return self.features[feature] is None

    def check_config(self, config: BoostConfig, model=None, *, option=None) -> None:
        """ConfigError, naming the option, when ``config`` asks for a feature this family lacks.

        ``option(key) -> str``: how the option is named (``sparse``, ``cache``, ``quant``; default the
        BoostConfig field, the command line passes its flags).
        """
        name = option or (lambda key: f"{key} (BoostConfig.{key})")
        if config.sparse is not None and config.sparse.sparse_type is not None and not self.supports("sparse"):
            raise feature_error(self, "sparse", name("sparse"))
        if config.cache is not None and not self.supports("step_cache"):
            raise feature_error(self, "step_cache", name("cache"))
        if config.quant is not None and not self.supports("quant"):
            raise feature_error(self, "quant", name("quant"))

    def check_model(self, model) -> None:
        """TypeError unless ``model`` has this family's attention sites and RoPE module."""
        _boost.check_model(self, model)

    def is_pipeline(self, target) -> bool:
        """True if ``target``'s class (or a base) is one of this family's pipelines."""
        return any(cls.__name__ in self.pipelines for cls in type(target).__mro__)

    def transformers_of(self, target) -> list:
        """The transformers of a pipeline of this family (``pipeline.transformers`` attributes) or [target]."""
        if not self.is_pipeline(target):
            return [target]
        return [m for m in (getattr(target, a, None) for a in self.pipeline.transformers) if m is not None]

    def describe(self) -> dict:
        """A plain summary (``lite-boost models``, docs)."""
        return {
            "family": self.name,
            "pipelines": list(self.pipelines),
            "transformers": list(self.transformers),
            "joint": self.joint,
            "cfg": self.pipeline.cfg.kind if self.pipeline.cfg is not None else "none",
            "cache_methods": list(self.cache.methods) if self.cache is not None else [],
            "quant_patterns": list(self.quant_patterns),
            "features": self.features,
            "notes": self.notes,
            "output": self.output,
            "cfg_argument": self.cfg_argument,
            "tiny": {kind: t.pipeline for kind, t in self.tiny.items()},
        }

    def __repr__(self) -> str:
        return f"ModelFamily({self.name!r}, transformers={list(self.transformers)}, pipelines={list(self.pipelines)})"

