"""Wan2.1 / Wan2.2 adapter: LiteBoost attention processors and a cached RoPE for WanTransformer3DModel.

What ``boost_wan_transformer`` changes, on the instance only (never on diffusers' classes):

* every ``blocks[i].attn1`` (self-attention) and ``blocks[i].attn2`` (cross-attention, with the I2V
  image branch) gets a :class:`LiteBoostWanAttnProcessor`: same projections and norms as diffusers'
  ``WanAttnProcessor``, RoPE applied in place in fp32 from the cache, attention through
  ``lite_boost.ops.attention`` (FA3 -> FA2 -> NPU -> SDPA). Self-attention calls the processor's
  replaceable ``attn_fn(q, k, v)`` (B, S, H, D): sparse attention and Ulysses plug in there.
* ``transformer.rope.forward`` returns a :class:`~lite_boost.ops.rope.RotaryEmbedding` from the
  model's :class:`~lite_boost.ops.rope.RopeCache` instead of rebuilding the tables every call.
* ``transformer._lite_boost`` holds a :class:`WanBoostState` (config, cache, processors, the
  originals needed by ``unboost``).

Weights, the module tree and ``state_dict`` are untouched (unless ``BoostConfig.quant`` asks for
quantized Linear layers: :mod:`lite_boost.quant`), so ``.to()``, ``.eval()`` and ``save_pretrained``
keep working, and boosting twice with the same config is a no-op.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from ..config import BoostConfig
from ..ops.attention import attention
from ..ops.rope import RopeCache, RotaryEmbedding, apply_rotary_emb, rope_tables, rotate
from . import register_model
from ._sparse_wan import attach_pipeline, install_sparse, uninstall_sparse
from ._cache_wan import WAN_CACHE_ADAPTER, install_cache, uninstall_cache
from ..quant import QuantAdapter, check_uninstall_quant, install_quant, uninstall_quant

__all__ = [
    "DenseAttention",
    "LiteBoostWanAttnProcessor",
    "WanBoostState",
    "boost_wan_transformer",
    "boost_wan_pipeline",
    "unboost_wan_transformer",
    "unboost_wan_pipeline",
    "WAN_TEXT_CONTEXT",
]

logger = logging.getLogger("lite_boost.models.wan")

# diffusers' WanAttnProcessor hard-codes the text context length; anything before it in the
# cross-attention context is the I2V image context.
WAN_TEXT_CONTEXT = 512
_ROPE_THETA = 10000.0
TRANSFORMER_ATTRS = ("transformer", "transformer_2")


class DenseAttention:
    """Default ``attn_fn`` of a processor: dense attention through the backend dispatch."""

    def __init__(self, backend: str | None = None):
        self.backend = backend

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return attention(q, k, v, layout="BSND", backend=self.backend)

    def __repr__(self) -> str:
        return f"DenseAttention(backend={self.backend!r})"


def _qkv(attn, hidden_states, context):
    if getattr(attn, "fused_projections", False):
        if not attn.is_cross_attention:
            return attn.to_qkv(hidden_states).chunk(3, dim=-1)
        key, value = attn.to_kv(context).chunk(2, dim=-1)
        return attn.to_q(hidden_states), key, value
    return attn.to_q(hidden_states), attn.to_k(context), attn.to_v(context)


def _added_kv(attn, image_context):
    if getattr(attn, "fused_projections", False):
        return attn.to_added_kv(image_context).chunk(2, dim=-1)
    return attn.add_k_proj(image_context), attn.add_v_proj(image_context)


class LiteBoostWanAttnProcessor:
    """Attention processor for ``WanAttention`` with the semantics of diffusers' ``WanAttnProcessor``.

    Args:
        layer_idx: index of the transformer block (for per-layer policies such as dense layers).
        is_self_attention: True for ``attn1`` (RoPE, ``attn_fn``), False for ``attn2``.
        backend: dense attention backend name or None (automatic).

    ``attn_fn`` (self-attention only) maps q, k, v of shape (B, S, H, D) to (B, S, H, D); replace it
    to change how self-attention is computed (sparse, sequence parallel) without touching the rest.
    """

    # diffusers' AttentionModuleMixin.set_attention_backend / parallel config write these.
    _attention_backend = None
    _parallel_config = None

    def __init__(self, layer_idx: int, is_self_attention: bool, backend: str | None = None):
        self.layer_idx = layer_idx
        self.is_self_attention = is_self_attention
        self.backend = backend
        self.attn_fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] = DenseAttention(backend)

    def __repr__(self) -> str:
        kind = "self" if self.is_self_attention else "cross"
        return f"LiteBoostWanAttnProcessor(layer={self.layer_idx}, {kind}, attn_fn={self.attn_fn!r})"

    def _dense(self, q, k, v, mask):
        if mask is None:
            return attention(q, k, v, layout="BSND", backend=self.backend)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)
        return out.transpose(1, 2)

    def __call__(self, attn, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, rotary_emb=None, **kwargs) -> torch.Tensor:
        image_context = None
        if attn.add_k_proj is not None and encoder_hidden_states is not None:
            split = encoder_hidden_states.shape[1] - WAN_TEXT_CONTEXT
            image_context = encoder_hidden_states[:, :split]
            encoder_hidden_states = encoder_hidden_states[:, split:]
        context = hidden_states if encoder_hidden_states is None else encoder_hidden_states

        query, key, value = _qkv(attn, hidden_states, context)
        query = attn.norm_q(query).unflatten(2, (attn.heads, -1))
        key = attn.norm_k(key).unflatten(2, (attn.heads, -1))
        value = value.unflatten(2, (attn.heads, -1))

        if rotary_emb is not None:
            if isinstance(rotary_emb, RotaryEmbedding):
                # q and k are fresh outputs of norm_q / norm_k: rotating them in place is safe.
                query = rotate(query, rotary_emb.freqs, inplace=True)
                key = rotate(key, rotary_emb.freqs, inplace=True)
            else:  # diffusers' (cos, sin) tables, e.g. when the RoPE module is not ours
                query = apply_rotary_emb(query, *rotary_emb)
                key = apply_rotary_emb(key, *rotary_emb)

        image_out = None
        if image_context is not None:
            key_img, value_img = _added_kv(attn, image_context)
            key_img = attn.norm_added_k(key_img).unflatten(2, (attn.heads, -1))
            value_img = value_img.unflatten(2, (attn.heads, -1))
            image_out = self._dense(query, key_img, value_img, None).flatten(2, 3).type_as(query)

        if self.is_self_attention and encoder_hidden_states is None and attention_mask is None:
            out = self.attn_fn(query, key, value)
        else:
            out = self._dense(query, key, value, attention_mask)
        out = out.flatten(2, 3).type_as(query)
        if image_out is not None:
            out = out + image_out
        out = attn.to_out[0](out)
        return attn.to_out[1](out)


class CachedWanRope:
    """Replacement ``forward`` of a ``WanRotaryPosEmbed`` instance: tables come from the state's cache.

    Records the latent token grid of the current call in ``state.grid`` and serves the token range
    ``state.rope_range(seq_len)`` (the whole sequence unless a sequence-parallel plan sets it).
    """

    def __init__(self, rope_module, state: "WanBoostState"):
        self.rope = rope_module
        self.state = state

    def __call__(self, hidden_states: torch.Tensor) -> RotaryEmbedding:
        _, _, frames, height, width = hidden_states.shape
        p_t, p_h, p_w = self.rope.patch_size
        grid = (frames // p_t, height // p_h, width // p_w)
        self.state.grid = grid
        seq_len = math.prod(grid)
        start, stop = self.state.rope_range(seq_len) if self.state.rope_range is not None else (0, seq_len)
        return self.state.rope_cache.get(grid, self.rope.attention_head_dim, theta=_ROPE_THETA,
                                         device=hidden_states.device, start=start, stop=stop)


@dataclass
class WanBoostState:
    """Everything lite_boost attached to one WanTransformer3DModel instance."""

    config: BoostConfig
    rope_cache: RopeCache
    processors: dict[str, LiteBoostWanAttnProcessor] = field(default_factory=dict)
    original_processors: dict[str, object] = field(default_factory=dict)
    rope_patched: bool = False
    grid: tuple[int, int, int] | None = None  # latent token grid of the latest forward
    # Token range [start, stop) of the RoPE tables served for a sequence of the given length; set by
    # sequence parallelism so each rank gets its slice (stop may pass seq_len: padding rows).
    rope_range: Callable[[int], tuple[int, int]] | None = None
    extras: dict = field(default_factory=dict)  # per-feature state (sparse schedule, parallel plan)

    @property
    def self_attention_processors(self) -> list[LiteBoostWanAttnProcessor]:
        return [p for p in self.processors.values() if p.is_self_attention]

    @property
    def cross_attention_processors(self) -> list[LiteBoostWanAttnProcessor]:
        return [p for p in self.processors.values() if not p.is_self_attention]


def _rope_matches_cache(rope) -> bool:
    """True if our tables reproduce this RoPE module's (guards against a non-default theta)."""
    try:
        grid = tuple(min(4, rope.max_seq_len) for _ in range(3))
        p_t, p_h, p_w = rope.patch_size
        probe = torch.zeros(1, 1, grid[0] * p_t, grid[1] * p_h, grid[2] * p_w, device=rope.freqs_cos.device)
        cos, sin = type(rope).forward(rope, probe)
        ours = rope_tables(grid, rope.attention_head_dim, theta=_ROPE_THETA, device=cos.device).freqs
        tol = 1e-6 if cos.dtype in (torch.float32, torch.float64) else 1e-2
        return bool(torch.allclose(cos[..., 0::2].float(), ours.real, atol=tol)
                    and torch.allclose(sin[..., 1::2].float(), ours.imag, atol=tol))
    except Exception as exc:  # noqa: BLE001 - an unexpected RoPE module: keep diffusers' own
        logger.warning("lite_boost: cannot verify the RoPE module (%s); keeping diffusers' RoPE", exc)
        return False


def _check_wan_transformer(transformer) -> None:
    blocks = getattr(transformer, "blocks", None)
    if blocks is None or not hasattr(transformer, "rope"):
        raise TypeError(f"{type(transformer).__name__} does not look like a WanTransformer3DModel (no blocks/rope)")
    for i, block in enumerate(blocks):
        for name in ("attn1", "attn2"):
            if not hasattr(getattr(block, name, None), "set_processor"):
                raise TypeError(f"blocks[{i}].{name} is not a diffusers attention module with set_processor")


@register_model("WanTransformer3DModel")
def boost_wan_transformer(transformer, config: BoostConfig | None = None):
    """Boost a ``WanTransformer3DModel`` in place and return it (idempotent for an equal config)."""
    config = BoostConfig.coerce(config)
    _check_wan_transformer(transformer)
    state = getattr(transformer, "_lite_boost", None)
    if state is not None:
        if state.config == config:
            return transformer
        unboost_wan_transformer(transformer)

    state = WanBoostState(config=config, rope_cache=RopeCache(config.rope_cache_size))
    install_quant(transformer, state, WAN_QUANT_ADAPTER)  # first: on failure it leaves the model as it was
    for i, block in enumerate(transformer.blocks):
        for attr, is_self in (("attn1", True), ("attn2", False)):
            module = getattr(block, attr)
            name = f"blocks.{i}.{attr}"
            proc = LiteBoostWanAttnProcessor(i, is_self, backend=config.attention_backend)
            state.original_processors[name] = module.processor
            state.processors[name] = proc
            module.set_processor(proc)
    if _rope_matches_cache(transformer.rope):
        transformer.rope.forward = CachedWanRope(transformer.rope, state)
        state.rope_patched = True
    install_sparse(transformer, state)  # block-sparse self-attention when config.sparse asks for it
    install_cache(transformer, state)  # diffusers' step-cache hooks when config.cache asks for them
    transformer._lite_boost = state
    return transformer


def unboost_wan_transformer(transformer):
    """Undo ``boost_wan_transformer``: original processors and RoPE forward back; returns the model."""
    state = getattr(transformer, "_lite_boost", None)
    if state is None:
        return transformer
    check_uninstall_quant(state)  # QuantError before anything is undone when the weights were not kept
    for name, proc in state.original_processors.items():
        transformer.get_submodule(name).set_processor(proc)
    if state.rope_patched and "forward" in transformer.rope.__dict__:
        del transformer.rope.forward
    uninstall_sparse(transformer, state)
    uninstall_cache(transformer, state)
    uninstall_quant(transformer, state)
    del transformer._lite_boost
    return transformer


boost_wan_transformer.unboost = unboost_wan_transformer


def _pipeline_transformers(pipe) -> list[tuple[str, object]]:
    found = [(n, getattr(pipe, n, None)) for n in TRANSFORMER_ATTRS]
    found = [(n, m) for n, m in found if m is not None]
    if not found:
        raise ValueError(f"{type(pipe).__name__} has neither 'transformer' nor 'transformer_2' set; nothing to boost")
    return found


@register_model("WanPipeline", "WanImageToVideoPipeline")
def boost_wan_pipeline(pipe, config: BoostConfig | None = None):
    """Boost every transformer of a Wan pipeline (``transformer`` and Wan2.2's ``transformer_2``)."""
    config = BoostConfig.coerce(config)
    transformers = _pipeline_transformers(pipe)
    for _, module in transformers:
        _check_wan_transformer(module)
    for _, module in transformers:
        boost_wan_transformer(module, config)
        attach_pipeline(module, pipe)  # the sparse schedule follows pipe.scheduler's step
    return pipe


def unboost_wan_pipeline(pipe):
    for _, module in _pipeline_transformers(pipe):
        unboost_wan_transformer(module)
    return pipe


boost_wan_pipeline.unboost = unboost_wan_pipeline


# Sequence / CFG parallel layout of Wan, executed by lite_boost.parallel's generic hooks.
from ..parallel.plan import CfgPlan, GatherOutput, PipelinePlan, ShardingPlan, SplitInput, SplitOutput  # noqa: E402

WAN_SHARDING_PLAN = ShardingPlan(
    split_inputs=(
        SplitInput("", "timestep", dim=1, ndim=2),  # Wan2.2 TI2V: per-token timesteps (B, S)
        SplitInput("blocks.0", "hidden_states", dim=1),  # video tokens after patch embedding
    ),
    split_outputs=(SplitOutput("rope", dim=1),),  # only when diffusers' own (cos, sin) RoPE is kept
    gather_outputs=(GatherOutput("proj_out", dim=1),),
    rope_range="rope_range",  # WanBoostState.rope_range: the RoPE cache serves this rank's rows
)
WAN_PIPELINE_PLAN = PipelinePlan(transformers=TRANSFORMER_ATTRS, cfg=CfgPlan(), prepare_latents="prepare_latents")
boost_wan_transformer.sharding_plan = WAN_SHARDING_PLAN
boost_wan_pipeline.pipeline_plan = WAN_PIPELINE_PLAN
boost_wan_transformer.cache_adapter = WAN_CACHE_ADAPTER  # step caching (diffusers' hooks), lite_boost.cache
boost_wan_pipeline.cache_adapter = WAN_CACHE_ADAPTER
# Quantization (lite_boost.quant): every Linear of the transformer blocks (attention projections, the I2V
# image projections, feed-forward); patch/text/time embeddings, norms, proj_out and the modulation
# tables (parameters, not Linear layers) stay in full precision.
WAN_QUANT_ADAPTER = QuantAdapter(include=(r"blocks\.\d+\..*",), describe="the transformer blocks' Linear layers")
boost_wan_transformer.quant_adapter = WAN_QUANT_ADAPTER
boost_wan_pipeline.quant_adapter = WAN_QUANT_ADAPTER
