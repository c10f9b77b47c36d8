"""CogVideoX (2B, 5B, 1.5; text-to-video, image-to-video, video-to-video, Fun-Control) on the adapter layer.

What varies for this family, as data (:data:`COGVIDEOX`) plus one processor shim:

* attention: one joint attention per block (``transformer_blocks.*.attn1``) over [text, video] with
  **shared** ``to_q/k/v`` / ``to_out`` and LayerNorm q/k norms; diffusers' ``CogVideoXAttnProcessor2_0``
  concatenates the streams and calls SDPA directly. :class:`CogVideoXJointProcessor` projects the two
  streams with the same modules and calls ``attn_fn(video q/k/v, joint=JointTokens(text q/k/v))``.
  The feed-forward and the adaLN modulation are per token, so a block needs nothing else.
* RoPE (5B, 1.5): built by the pipeline (``get_3d_rotary_pos_embed``) and passed to every block as
  ``image_rotary_emb`` = interleaved real (cos, sin) over the video rows only; the shim turns it into
  fp32 phasors once per block (2B has no RoPE: sincos position embeddings inside ``patch_embed``).
* text: the T5 text is padded to 226 tokens and every token is attended (no mask).
* sequence parallelism: the video tokens are split at ``transformer_blocks.0``; the (cos, sin) tuple
  is split on dim 0 with them at every block; the text stays replicated (226 is no multiple of most
  degrees); gathered after ``proj_out``.
* CFG: batched (one call with [uncond, cond] on the batch, inside ``cache_context("cond_uncond")``);
  under cfg degree 2 each cfg rank runs one half of the batch.
* token grid for sparse windows: (frames / patch_size_t, height / patch, width / patch) of the
  (B, F, C, H, W) input.
* tensor parallelism (:data:`COGVIDEOX_TP_PLAN`): the heads of the joint attention (the shared ``to_q/k/v``
  column-wise, ``to_out`` row-wise; text and video go through the same split layers) and the feed-forward's
  columns / rows. The q / k LayerNorms are per head (over ``head_dim``): nothing to all-reduce.
"""

from __future__ import annotations

import torch

from ..adapter import AttentionSite, LiteBoostProcessor, ModelFamily, rotate_qk
from ..adapter.shims import SEA_CACHE_WHY_NOT, norm_qk, video_token_grid
from ..cache import CacheAdapter
from ..ops.joint import JointTokens
from ..parallel.plan import CfgPlan, GatherOutput, PipelinePlan, ShardingPlan, SplitInput
from ..parallel.shard import TensorParallelPlan
from ..registry import register_family

__all__ = ["COGVIDEOX", "CogVideoXJointProcessor", "COGVIDEOX_SHARDING_PLAN", "COGVIDEOX_PIPELINE_PLAN",
           "COGVIDEOX_CACHE_ADAPTER", "COGVIDEOX_TP_PLAN", "boost_cogvideox_transformer", "boost_cogvideox_pipeline"]


class CogVideoXJointProcessor(LiteBoostProcessor):
    """Joint attention of a ``CogVideoXBlock``, with the semantics of diffusers' ``CogVideoXAttnProcessor2_0``;
    returns ``(video_out, text_out)``."""

    def __call__(self, attn, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
                 attention_mask: torch.Tensor | None = None, image_rotary_emb=None, **kwargs):
        if attention_mask is not None:
            raise ValueError("CogVideoXJointProcessor does not accept an attention_mask (CogVideoX attends every "
                             "text token)")
        if attn.is_cross_attention:
            raise ValueError("CogVideoXJointProcessor serves CogVideoX's joint self-attention only")
        head_dim = attn.inner_dim // attn.heads

        def qkv(x):
            q, k, v = (p(x).unflatten(-1, (-1, head_dim)) for p in (attn.to_q, attn.to_k, attn.to_v))
            q, k = norm_qk(attn, q, k)
            return q, k, v

        q, k, v = qkv(hidden_states)
        txt_q, txt_k, txt_v = qkv(encoder_hidden_states)
        if image_rotary_emb is not None:  # the pipeline's (cos, sin), video rows (this rank's under Ulysses)
            q, k = rotate_qk(q, k, image_rotary_emb)

        out, txt_out = self.attn_fn(q, k, v, joint=JointTokens(txt_q, txt_k, txt_v, None, self.text_first))

        def project(x, dtype):
            x = attn.to_out[0](x.flatten(2, 3).to(dtype).contiguous())
            return attn.to_out[1](x) if len(attn.to_out) > 1 else x  # dropout

        return project(out, q.dtype), project(txt_out, txt_q.dtype)


_token_grid = video_token_grid(frames_dim=1)  # (B, F, C, H, W) latents


COGVIDEOX_SHARDING_PLAN = ShardingPlan(
    split_inputs=(
        SplitInput("transformer_blocks.0", "hidden_states", dim=1),  # video tokens after patch_embed
        SplitInput("transformer_blocks.*", "image_rotary_emb", dim=0),  # the pipeline's (cos, sin), video rows
    ),
    gather_outputs=(GatherOutput("proj_out", dim=1),),
    text="replicate",  # 226 padded text tokens, whole on every rank
)

# The pipelines decide CFG in a local (guidance_scale > 1) and batch [uncond, cond]; the public
# ``guidance_scale`` property is what they keep on the instance.
COGVIDEOX_PIPELINE_PLAN = PipelinePlan(
    transformers=("transformer",),
    cfg=CfgPlan(flag="guidance_scale", kind="batched", cond="cond_uncond",
                batch_args=("hidden_states", "encoder_hidden_states", "timestep")),
    prepare_latents="prepare_latents",
)

# Pyramid Attention Broadcast fits here (unlike the two-call families): one batched call per step
# keeps one attention state for both branches, as the diffusers documentation's CogVideoX example does.
COGVIDEOX_CACHE_ADAPTER = CacheAdapter(
    methods=("first_block_cache", "mag_cache", "taylorseer_cache", "pyramid_attention_broadcast"),
    why_not={"sea_cache": SEA_CACHE_WHY_NOT},
    probe_module="patch_embed",
)

COGVIDEOX_TP_PLAN = TensorParallelPlan(layers={
    **{f"transformer_blocks.*.attn1.{p}": "colwise" for p in ("to_q", "to_k", "to_v")},
    "transformer_blocks.*.attn1.to_out.0": "rowwise",
    "transformer_blocks.*.ff.net.0.proj": "colwise",
    "transformer_blocks.*.ff.net.2": "rowwise",
})

COGVIDEOX = register_family(ModelFamily(
    name="cogvideox",
    output="video",
    transformers=("CogVideoXTransformer3DModel",),
    pipelines=("CogVideoXPipeline", "CogVideoXImageToVideoPipeline", "CogVideoXVideoToVideoPipeline",
               "CogVideoXFunControlPipeline"),
    attention=(AttentionSite("transformer_blocks.*.attn1", CogVideoXJointProcessor, role="joint"),),
    joint="text_first",
    token_grid=_token_grid,
    timestep_module="time_proj",
    sharding=COGVIDEOX_SHARDING_PLAN,
    pipeline=COGVIDEOX_PIPELINE_PLAN,
    tensor_parallel=COGVIDEOX_TP_PLAN,
    cache=COGVIDEOX_CACHE_ADAPTER,
    quant_patterns=("transformer_blocks.*",),
    unsupported={"parallel_vae": "AutoencoderKLCogVideoX has no parallel-VAE adapter yet; each rank decodes the "
                                 "whole video"},
    notes="text replicated on every rank; RoPE (cos, sin) passed in by the pipeline is split with the video tokens",
))

boost_cogvideox_transformer = COGVIDEOX.boost_transformer
boost_cogvideox_pipeline = COGVIDEOX.boost_pipeline
