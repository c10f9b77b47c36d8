"""Wan2.1 / Wan2.2 on the adapter layer: the family description, its processor shim and RoPE shim.

What boosting a ``WanTransformer3DModel`` changes (the generic machinery of :mod:`lite_boost.adapter`
does it from :data:`WAN`):

* every ``blocks[i].attn1`` (self-attention) and ``blocks[i].attn2`` (cross-attention, with the I2V
  image branch) gets a :class:`LiteBoostWanAttnProcessor`: same projections and norms as diffusers'
  ``WanAttnProcessor``, RoPE applied in place in fp32 from the cache, attention through
  ``lite_boost.ops.attention`` (FA3 -> FA2 -> NPU -> SDPA). Self-attention calls the processor's
  replaceable ``attn_fn(q, k, v)`` (B, S, H, D): sparse attention and Ulysses plug in there.
* ``transformer.rope.forward`` returns a :class:`~lite_boost.ops.rope.RotaryEmbedding` from the
  model's :class:`~lite_boost.ops.rope.RopeCache` instead of rebuilding the tables every call.
* ``transformer._lite_boost`` holds the :class:`~lite_boost.adapter.BoostState`.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.nn.functional as F

from ..adapter import (AttentionSite, BoostState, DenseAttention, LiteBoostProcessor, ModelFamily, RopeSource,
                       TinyPipeline)
from ..adapter.boost import unboost_model
from ..adapter.shims import SEA_CACHE_WHY_NOT, CachedRope, patch_grid, separate_passes_why_not, video_token_grid
from ..cache import CacheAdapter
from ..config import ConfigError
from ..ops.attention import attention
from ..ops.rope import RotaryEmbedding, apply_rotary_emb, rope_tables, rotate
from ..parallel.plan import CfgPlan, GatherOutput, PipelinePlan, ShardingPlan, SplitInput, SplitOutput
from ..parallel.shard import TensorParallelPlan
from ..registry import register_family

__all__ = [
    "WAN",
    "DenseAttention",
    "LiteBoostWanAttnProcessor",
    "CachedWanRope",
    "WanBoostState",
    "boost_wan_transformer",
    "boost_wan_pipeline",
    "unboost_wan_transformer",
    "unboost_wan_pipeline",
    "WAN_TEXT_CONTEXT",
    "WAN_SHARDING_PLAN",
    "WAN_PIPELINE_PLAN",
    "WAN_CACHE_ADAPTER",
    "wan_copy_cache_adapter",
    "WAN_TP_PLAN",
]

logger = logging.getLogger("lite_boost.models.wan")

# diffusers' WanAttnProcessor hard-codes the text context length; anything before it in the
# cross-attention context is the I2V image context.
WAN_TEXT_CONTEXT = 512
_ROPE_THETA = 10000.0
TRANSFORMER_ATTRS = ("transformer", "transformer_2")


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


class LiteBoostWanAttnProcessor(LiteBoostProcessor):
    """Attention processor for ``WanAttention`` with the semantics of diffusers' ``WanAttnProcessor``.

    Args:
        layer_idx: index of the transformer block (for per-layer policies such as dense layers).
        role: "self" for ``attn1`` (RoPE, ``attn_fn``), "cross" for ``attn2``.
        backend: dense attention backend name or None (automatic).

    ``attn_fn`` (self-attention only) maps q, k, v of shape (B, S, H, D) to (B, S, H, D); replace it
    to change how self-attention is computed (sparse, sequence parallel) without touching the rest.
    """

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


class CachedWanRope(CachedRope):
    """Replacement ``forward`` of a ``WanRotaryPosEmbed`` instance: tables come from the state's cache.

    Records the latent token grid of the current call in ``state.grid`` and serves the token range
    ``state.rope_range(seq_len)`` (the whole sequence unless a sequence-parallel plan sets it).
    """

    def __call__(self, hidden_states: torch.Tensor) -> RotaryEmbedding:
        _, _, frames, height, width = hidden_states.shape
        grid = patch_grid((frames, height, width), self.rope.patch_size)
        self.state.grid = grid
        seq_len = math.prod(grid)
        start, stop = self.state.serve_range(seq_len)
        return self.state.rope_cache.get(grid, self.rope.attention_head_dim, theta=_ROPE_THETA,
                                         device=hidden_states.device, start=start, stop=stop)


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


_token_grid = video_token_grid(frames_dim=2)  # (B, C, F, H, W) latents


# ----------------------------------------------------------------------------------------- step caching
def _check_cache(model, method: str, params: dict) -> None:
    cfg = getattr(model, "config", None)
    if method == "sea_cache" and cfg is not None and cfg.in_channels != cfg.out_channels:
        raise ConfigError(
            f"cache method 'sea_cache' needs a text-to-video Wan transformer (in_channels == out_channels), got "
            f"in_channels={cfg.in_channels}, out_channels={cfg.out_channels}; use first_block_cache, mag_cache, "
            "taylorseer_cache or pyramid_attention_broadcast for image-to-video"
        )


# Why these methods and defaults on Wan:
# * FasterCache is not offered: it approximates the unconditional branch from a batch that holds
#   both branches, and Wan's pipelines call the transformer once per branch (batch 1 each).
# * TaylorSeer's default module patterns (``^blocks.*attn``) match no Wan module (Wan names them
#   ``attn1`` / ``attn2``); the Wan default predicts each block's self-attention, cross-attention and
#   feed-forward outputs instead.
# * SeaCache builds its indicator from text-to-video latents (``in_channels == out_channels``); on
#   image-to-video Wan it would silently run uncached, so it is refused there.
WAN_CACHE_ADAPTER = CacheAdapter(
    methods=("first_block_cache", "mag_cache", "taylorseer_cache", "pyramid_attention_broadcast", "sea_cache"),
    defaults={"taylorseer_cache": {"cache_identifiers": (r"^blocks\.\d+\.(attn1|attn2|ffn)$",)}},
    check=_check_cache,
    why_not={"faster_cache": separate_passes_why_not("Wan")},
    probe_module="patch_embedding",
)



def wan_copy_cache_adapter(model: str, **extra) -> CacheAdapter:
    """The step caches of a family whose blocks are diffusers' copy of ``WanTransformerBlock`` under another class
    (ChronoEdit, Wan Animate): TaylorSeer and Pyramid Attention Broadcast with Wan's defaults; First-Block Cache
    and MagCache need diffusers' block metadata, which it registers for Wan's class only. ``model`` names the
    model in the refusals; ``extra``: more CacheAdapter fields (e.g. ``name_calls``)."""
    return CacheAdapter(
        methods=("taylorseer_cache", "pyramid_attention_broadcast"),
        defaults=WAN_CACHE_ADAPTER.defaults,
        why_not={**{m: f"diffusers registers no block metadata for {model}'s WanTransformerBlock copy (stock "
                       "diffusers fails too)" for m in ("first_block_cache", "mag_cache")},
                 "faster_cache": separate_passes_why_not(model), "sea_cache": SEA_CACHE_WHY_NOT},
        probe_module="patch_embedding", **extra)


# ----------------------------------------------------------------------------------------- parallel layout
WAN_SHARDING_PLAN = ShardingPlan(
    split_inputs=(
        SplitInput("", "timestep", dim=1, ndim=2),  # Wan2.2 TI2V: per-token timesteps (B, S)
        SplitInput("blocks.0", "hidden_states", dim=1),  # video tokens after patch embedding
    ),
    split_outputs=(SplitOutput("rope", dim=1),),  # only when diffusers' own (cos, sin) RoPE is kept
    gather_outputs=(GatherOutput("proj_out", dim=1),),
    rope_range="rope_range",  # BoostState.rope_range: the RoPE cache serves this rank's rows
)
WAN_PIPELINE_PLAN = PipelinePlan(transformers=TRANSFORMER_ATTRS, cfg=CfgPlan(), prepare_latents="prepare_latents")

# ----------------------------------------------------------------------------------------- the family
# Tensor parallelism: heads of both attentions (q / k / v colwise, out rowwise; the I2V image projections
# too) and the FFN (in colwise, out rowwise). Wan's q / k norms are RMS norms across all heads
# (qk_norm="rms_norm_across_heads"): distributed over the tp group.
WAN_TP_PLAN = TensorParallelPlan(
    layers={
        **{f"blocks.*.{a}.{p}": "colwise" for a in ("attn1", "attn2") for p in ("to_q", "to_k", "to_v")},
        "blocks.*.attn2.add_k_proj": "colwise",
        "blocks.*.attn2.add_v_proj": "colwise",
        **{f"blocks.*.{a}.to_out.0": "rowwise" for a in ("attn1", "attn2")},
        "blocks.*.ffn.net.0.proj": "colwise",
        "blocks.*.ffn.net.2": "rowwise",
    },
    norms=tuple(f"blocks.*.{a}.{n}" for a in ("attn1", "attn2") for n in ("norm_q", "norm_k")) + (
        "blocks.*.attn2.norm_added_k",),
)

WAN = register_family(ModelFamily(
    name="wan",
    transformers=("WanTransformer3DModel",),
    pipelines=("WanPipeline", "WanImageToVideoPipeline"),
    attention=(AttentionSite("blocks.*.attn1", LiteBoostWanAttnProcessor, role="self"),
               AttentionSite("blocks.*.attn2", LiteBoostWanAttnProcessor, role="cross")),
    joint="cross",
    rope=RopeSource("rope", CachedWanRope, matches=_rope_matches_cache),
    token_grid=_token_grid,
    timestep_module="condition_embedder",
    sharding=WAN_SHARDING_PLAN,
    pipeline=WAN_PIPELINE_PLAN,
    tensor_parallel=WAN_TP_PLAN,
    cache=WAN_CACHE_ADAPTER,
    quant_patterns=("blocks.*",),
    notes="text (512 tokens) and the I2V image context enter through cross-attention, local on every rank",
    # Wan2.1-T2V-14B (diffusers' WanTransformer3DModel defaults) with its UMT5-XXL text encoder
    reference={"name": "Wan2.1-T2V-14B", "shape": (81, 480, 832), "vae_scale": (4, 8, 8),
               "text_encoder": ("UMT5EncoderModel", dict(d_model=4096, d_ff=10240, num_layers=24, num_heads=64,
                                                         d_kv=64, vocab_size=256384, feed_forward_proj="gated-gelu",
                                                         relative_attention_num_buckets=32))},
    output="video",
    # the main job (a bare `lite-boost generate`): 192 x 256, 25 frames = 7 x 24 x 32 = 5,376 tokens, 10 steps,
    # block-sparse at 0.8 (lite_boost.demo.DEMO_SHAPE / DEMO_STEPS / DEMO_SPARSITY)
    tiny={kind: TinyPipeline(pipeline, builder="lite_boost.demo:demo_wan_pipeline", shape=(192, 256, 25), steps=10,
                             sparsity=0.8, describe="lite_boost.demo:describe_wan_demo", default=kind == "t2v")
          for kind, pipeline in (("t2v", "WanPipeline"), ("i2v", "WanImageToVideoPipeline"))},
))

boost_wan_transformer = WAN.boost_transformer
boost_wan_pipeline = WAN.boost_pipeline
unboost_wan_transformer = unboost_model
unboost_wan_pipeline = boost_wan_pipeline.unboost
WanBoostState = BoostState  # the generic boost state (name kept for existing imports)
