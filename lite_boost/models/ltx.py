"""LTX-Video on the adapter layer: ``LTXPipeline``, ``LTXImageToVideoPipeline``, ``LTXConditionPipeline``.

What varies for this family, as data (:data:`LTX`) plus one processor shim and one RoPE shim:

* attention: every ``LTXVideoTransformerBlock`` has a self-attention ``attn1`` over the video tokens
  and a cross-attention ``attn2`` to the T5 text with an additive bias mask (B, 1, T) (-10000 on
  padded text). :class:`LTXAttnProcessor` keeps diffusers' projections and RMS norms (across heads,
  before the head split); ``attn1`` calls ``attn_fn(q, k, v)`` (dense dispatch, block-sparse,
  Ulysses), ``attn2`` attends the whole text locally on every rank (the text is replicated, never
  exchanged).
* RoPE: ``rope`` returns (cos, sin) of shape (B, S, inner_dim), frequencies spread over ALL
  channels (axes interleaved, an identity pad in front when inner_dim % 6 != 0), applied before the
  head split. :class:`CachedLTXRope` serves them once per (grid, interpolation scale, rows) in the
  cached fp32 phasor form over the whole inner dimension, this rank's ROWS only; the processor
  rotates q / k viewed as one (B, S, 1, inner_dim) "head". Per-token ``video_coords``
  (LTXConditionPipeline) give per-sample tables, computed for this rank's rows of the coordinates.
* sequence parallelism: ``hidden_states`` and per-token timesteps (B, S) (I2V / condition
  pipelines: the conditioning tokens have timestep 0) are split at the transformer's input,
  the output gathered after ``proj_out``; the text stays whole on every rank.
* CFG: batched (one call with B = 2 inside ``cache_context("cond_uncond")``): with cfg degree 2
  each cfg rank runs its half of the batch (CfgPlan kind "batched").
* token grid for sparse windows: (num_frames, height, width) of the call (the latent grid the
  pipelines pass); LTXConditionPipeline passes ``video_coords`` instead (condition tokens in front
  of the video): those calls run dense.
* tensor parallelism (:data:`LTX_TP_PLAN`): the heads of both attentions and the feed-forward's columns /
  rows. The q / k RMS norms normalise across all heads (``qk_norm="rms_norm_across_heads"``): they run as a
  distributed RMS norm (sum of squares all-reduced over the tp group), as for Wan. RoPE spans the whole
  inner dimension: each rank rotates its channels with its slice of the tables (:func:`_local_channels`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..adapter import AttentionSite, LiteBoostProcessor, ModelFamily, RopeSource, rotate_qk
from ..adapter.shims import SEA_CACHE_WHY_NOT, CachedRope, call_arg
from ..cache import CacheAdapter
from ..ops.attention import attention
from ..ops.rope import RotaryEmbedding, phasors_from_cos_sin
from ..parallel.plan import CfgPlan, GatherOutput, PipelinePlan, ShardingPlan, SplitInput, SplitOutput
from ..parallel.shard import TensorParallelPlan
from ..registry import register_family

__all__ = ["LTX", "LTXAttnProcessor", "CachedLTXRope", "LTX_SHARDING_PLAN", "LTX_PIPELINE_PLAN", "LTX_CACHE_ADAPTER",
           "LTX_TP_PLAN", "boost_ltx_transformer", "boost_ltx_pipeline"]


def _local_channels(attn, width: int) -> tuple[int, int]:
    """[start, stop) of the inner channels this rank's q / k hold (``width`` of them): under tensor parallelism
    the rank's row slice of ``to_q`` (a DTensor sharded on dim 0), else all of them."""
    mesh = getattr(attn.to_q.weight, "device_mesh", None)
    if mesh is None:
        return 0, width
    if width % 2:
        raise ValueError(f"tensor parallelism leaves {width} q / k channels per rank, which splits a RoPE channel "
                         "pair; use a tp_degree that leaves an even number of channels per rank")
    rank = mesh.get_local_rank()
    return rank * width, (rank + 1) * width


def _rope_for(attn, emb, width: int):
    """``emb`` (over the whole inner dimension) restricted to this rank's ``width`` q / k channels."""
    if isinstance(emb, RotaryEmbedding):
        if emb.freqs.shape[-1] * 2 == width:
            return emb
        start, stop = _local_channels(attn, width)
        return emb._replace(freqs=emb.freqs[..., start // 2:stop // 2])
    cos, sin = emb
    if cos.shape[-1] == width:
        return emb
    start, stop = _local_channels(attn, width)
    return cos[..., start:stop], sin[..., start:stop]


class LTXAttnProcessor(LiteBoostProcessor):
    """Attention of an ``LTXAttention`` (``attn1`` self, ``attn2`` cross) with the semantics of
    diffusers' ``LTXVideoAttnProcessor``."""

    def __call__(self, attn, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, image_rotary_emb=None) -> torch.Tensor:
        context = hidden_states if encoder_hidden_states is None else encoder_hidden_states
        query = attn.norm_q(attn.to_q(hidden_states))
        key = attn.norm_k(attn.to_k(context))
        value = attn.to_v(context)
        if image_rotary_emb is not None:  # tensor parallelism: this rank's channels of the tables
            image_rotary_emb = _rope_for(attn, image_rotary_emb, query.shape[-1])
        if isinstance(image_rotary_emb, RotaryEmbedding):  # cached phasors over the whole inner dim
            query, key = (x.squeeze(2) for x in rotate_qk(query.unsqueeze(2), key.unsqueeze(2), image_rotary_emb))
        elif image_rotary_emb is not None:  # diffusers' own (cos, sin) tables
            from diffusers.models.transformers.transformer_ltx import apply_rotary_emb

            query, key = apply_rotary_emb(query, image_rotary_emb), apply_rotary_emb(key, image_rotary_emb)
        q, k, v = (x.unflatten(2, (attn.heads, -1)) for x in (query, key, value))

        if self.is_self_attention and encoder_hidden_states is None and attention_mask is None:
            out = self.attn_fn(q, k, v)
        elif attention_mask is None:
            out = attention(q, k, v, layout="BSND", backend=self.backend)
        else:  # the text bias, prepared as diffusers does (broadcast over the query rows)
            batch, text = context.shape[:2]
            mask = attn.prepare_attention_mask(attention_mask, text, batch).view(batch, attn.heads, -1, text)
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                 attn_mask=mask.to(q.dtype)).transpose(1, 2)
        out = attn.to_out[0](out.flatten(2, 3).to(query.dtype))
        return attn.to_out[1](out)


def _batched_phasors(cos: torch.Tensor, sin: torch.Tensor, rows: int) -> torch.Tensor:
    """(B, n, D) interleaved cos / sin -> complex64 (B, rows, 1, D/2), identity rows past n."""
    freqs = torch.complex(cos[..., 0::2].float(), sin[..., 1::2].float())
    if rows > freqs.shape[1]:
        pad = freqs.new_ones((freqs.shape[0], rows - freqs.shape[1], freqs.shape[2]))
        freqs = torch.cat([freqs, pad], dim=1)
    return freqs.unsqueeze(2).contiguous()


def _scale_key(scale):
    """A cache key for ``rope_interpolation_scale`` (plain numbers), or False when it holds tensors."""
    if scale is None:
        return None
    values = tuple(scale)
    if not all(isinstance(v, (int, float)) for v in values):
        return False
    return tuple(float(v) for v in values)


class CachedLTXRope(CachedRope):
    """Replacement ``forward`` of an ``LTXVideoRotaryPosEmbed``: its own (cos, sin) tables as phasors.

    The tables are computed by the module's own forward (same positions, same fp32 arithmetic) and
    converted to :class:`~lite_boost.ops.rope.RotaryEmbedding` form over the whole inner dimension
    (the identity pad channels become 1 + 0j pairs). Grid tables (num_frames, height, width) are the
    same for every sample and cached per (grid, interpolation scale, device, rows); ``video_coords``
    tables are per sample, built each call for this rank's rows of the coordinates. Rows past the
    sequence end (padding of an equal sequence shard) are identity rotations.
    """

    def __call__(self, hidden_states: torch.Tensor, num_frames=None, height=None, width=None,
                 rope_interpolation_scale=None, video_coords=None) -> RotaryEmbedding:
        forward = self.original
        if video_coords is not None:
            seq_len = video_coords.shape[-1]
            start, stop = self.state.serve_range(seq_len)
            cos, sin = forward(hidden_states, video_coords=video_coords[..., start:min(stop, seq_len)])
            return RotaryEmbedding(_batched_phasors(cos, sin, stop - start), start, stop, seq_len)
        seq_len = num_frames * height * width
        start, stop = self.state.serve_range(seq_len)
        probe = hidden_states[:1, :0]  # the module reads only the batch size and the device

        def build():
            cos, sin = forward(probe, num_frames, height, width, rope_interpolation_scale, None)
            return phasors_from_cos_sin(cos[0], sin[0], start, stop)

        scale = _scale_key(rope_interpolation_scale)
        if scale is False:  # tensors in the scale: values are data, not a key
            return build()
        key = ("ltx", int(num_frames), int(height), int(width), scale, str(hidden_states.device), start, stop)
        return self.cached(key, build)


def _is_ltx_rope(rope) -> bool:
    """The cached form serves diffusers' ``LTXVideoRotaryPosEmbed`` with an even dim (channel pairs
    stay aligned through the identity pad)."""
    from diffusers.models.transformers.transformer_ltx import LTXVideoRotaryPosEmbed

    return (isinstance(rope, LTXVideoRotaryPosEmbed) and type(rope).forward is LTXVideoRotaryPosEmbed.forward
            and rope.dim % 2 == 0)


# positions in LTXVideoTransformer3DModel.forward
_ARGS = {"hidden_states": 0, "num_frames": 4, "height": 5, "width": 6, "video_coords": 8}


def _arg(args, kwargs, name):
    return call_arg(args, kwargs, name, _ARGS[name])


def _token_grid(model, args, kwargs):
    """(frames, height, width) of the call's video tokens; None with ``video_coords`` (dense)."""
    if _arg(args, kwargs, "video_coords") is not None:
        return None
    grid = tuple(_arg(args, kwargs, n) for n in ("num_frames", "height", "width"))
    if any(g is None for g in grid):
        return None
    hidden = _arg(args, kwargs, "hidden_states")
    if hidden is not None and math.prod(grid) != hidden.shape[1]:
        return None
    return tuple(int(g) for g in grid)


LTX_SHARDING_PLAN = ShardingPlan(
    split_inputs=(
        SplitInput("", "hidden_states", dim=1),  # packed video tokens (B, S, C)
        # I2V / condition: per-token timesteps (B, S); (B, 1) (the condition pipeline without a condition) broadcasts
        SplitInput("", "timestep", dim=1, ndim=2, broadcast=True),
    ),
    split_outputs=(SplitOutput("rope", dim=1),),  # only when diffusers' own (cos, sin) RoPE is kept
    gather_outputs=(GatherOutput("proj_out", dim=1),),
    rope_range="rope_range",
    text="replicate",  # cross-attention to the whole text on every rank
)

LTX_PIPELINE_PLAN = PipelinePlan(
    transformers=("transformer",),
    cfg=CfgPlan(kind="batched", cond="cond_uncond",
                batch_args=("hidden_states", "encoder_hidden_states", "timestep", "encoder_attention_mask",
                            "video_coords")),
    prepare_latents="prepare_latents",
)

# TaylorSeer's default patterns (``^transformer_blocks.*attn``) match no LTX module (``attn1`` /
# ``attn2``); the default here predicts each block's attentions and feed-forward. Not offered:
# FasterCache (diffusers' FasterCache has no (B, S, C) token format for LTX), SeaCache (its
# indicator is derived for Wan text-to-video and Cosmos only).
LTX_CACHE_ADAPTER = CacheAdapter(
    methods=("first_block_cache", "mag_cache", "taylorseer_cache", "pyramid_attention_broadcast"),
    defaults={"taylorseer_cache": {"cache_identifiers": (r"^transformer_blocks\.\d+\.(attn1|attn2|ff)$",)}},
    why_not={"faster_cache": "diffusers' FasterCache supports no packed (B, S, C) LTX latents",
             "sea_cache": SEA_CACHE_WHY_NOT},
    probe_module="proj_in",
)

# Tensor parallelism: heads of both attentions (q / k / v colwise, out rowwise) and the FFN (in colwise, out
# rowwise); the q / k norms across all heads are distributed over the tp group.
LTX_TP_PLAN = TensorParallelPlan(
    layers={
        **{f"transformer_blocks.*.{a}.{p}": "colwise" for a in ("attn1", "attn2") for p in ("to_q", "to_k", "to_v")},
        **{f"transformer_blocks.*.{a}.to_out.0": "rowwise" for a in ("attn1", "attn2")},
        "transformer_blocks.*.ff.net.0.proj": "colwise",
        "transformer_blocks.*.ff.net.2": "rowwise",
    },
    norms=tuple(f"transformer_blocks.*.{a}.{n}" for a in ("attn1", "attn2") for n in ("norm_q", "norm_k")),
)

LTX = register_family(ModelFamily(
    name="ltx",
    output="video",
    transformers=("LTXVideoTransformer3DModel",),
    pipelines=("LTXPipeline", "LTXImageToVideoPipeline", "LTXConditionPipeline"),
    attention=(AttentionSite("transformer_blocks.*.attn1", LTXAttnProcessor, role="self"),
               AttentionSite("transformer_blocks.*.attn2", LTXAttnProcessor, role="cross")),
    joint="cross",
    rope=RopeSource("rope", CachedLTXRope, matches=_is_ltx_rope),
    token_grid=_token_grid,
    timestep_module="time_embed",
    sharding=LTX_SHARDING_PLAN,
    pipeline=LTX_PIPELINE_PLAN,
    tensor_parallel=LTX_TP_PLAN,
    cache=LTX_CACHE_ADAPTER,
    quant_patterns=("transformer_blocks.*",),
    notes="text (T5, 128 tokens) enters through cross-attention, local on every rank; CFG batched (B = 2)",
))

boost_ltx_transformer = LTX.boost_transformer
boost_ltx_pipeline = LTX.boost_pipeline
