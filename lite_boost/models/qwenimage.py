"""Qwen-Image, Qwen-Image-Edit and Qwen-Image-Edit-Plus on the adapter layer (the worked example).

What varies for this family, as data (:data:`QWEN_IMAGE`) plus one processor shim and one RoPE shim:

* attention: one joint attention per dual-stream block (``transformer_blocks.*.attn``) over
  [text, image]; image tokens through ``to_q/k/v``, text through ``add_q/k/v_proj``, RMS q/k norms.
  :class:`QwenImageJointProcessor` keeps diffusers' projections and norms and calls
  ``attn_fn(img_q, img_k, img_v, joint=JointTokens(text q/k/v, text mask))``.
* RoPE: ``pos_embed`` returns complex tables for the image tokens and the text tokens (text is
  rotated too). :class:`CachedQwenRope` turns them into the cached fp32 phasor form
  (:func:`~lite_boost.ops.rope.phasors_from_complex`), image rows for this rank only.
* text mask: ``encoder_hidden_states_mask`` (None when nothing is padded, as the pipelines pass it);
  a padded text key is never attended. cond and uncond prompts have different text lengths.
* sequence parallelism: the image tokens are split at ``transformer_blocks.0``; the text stays
  replicated (any length, no divisibility); the per-token ``modulate_index`` of Edit-2511
  (``zero_cond_t``) is split with the tokens at every block; gathered after ``proj_out``.
* CFG: two transformer calls (``cache_context("cond" / "uncond")``); the pipelines keep the decision
  in a local variable, so CFG is recognised from ``encode_prompt`` running twice per call.
* token grid for sparse windows: (images, h, w) from ``img_shapes`` (Edit: target + condition
  images, when they have one size; otherwise the call runs dense).
"""

from __future__ import annotations

import math

import torch

from ..adapter import AttentionSite, LiteBoostProcessor, ModelFamily, RopeSource, TinyPipeline, rotate_qk
from ..adapter.shims import (SEA_CACHE_WHY_NOT, CachedRope, call_arg, norm_qk, packed_output_shape,
                             separate_passes_why_not)
from ..cache import CacheAdapter
from ..ops.joint import JointTokens
from ..ops.rope import phasors_from_complex
from ..parallel.plan import CfgPlan, GatherOutput, PipelinePlan, ShardingPlan, SplitInput, SplitOutput
from ..registry import register_family

__all__ = ["QWEN_IMAGE", "QwenImageJointProcessor", "CachedQwenRope", "QWEN_SHARDING_PLAN", "QWEN_PIPELINE_PLAN",
           "QWEN_CACHE_ADAPTER", "boost_qwen_image_transformer", "boost_qwen_image_pipeline"]


class QwenImageJointProcessor(LiteBoostProcessor):
    """Joint attention of a ``QwenImageTransformerBlock``, with the semantics of diffusers'
    ``QwenDoubleStreamAttnProcessor2_0``; returns ``(image_out, text_out)``."""

    def __call__(self, attn, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                 encoder_hidden_states_mask: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                 image_rotary_emb=None, **kwargs):
        if encoder_hidden_states is None:
            raise ValueError("QwenImageJointProcessor requires encoder_hidden_states (text stream)")
        if attention_mask is not None:
            raise ValueError("QwenImageJointProcessor does not accept an external attention_mask; pass "
                             "encoder_hidden_states_mask to mask padded text tokens")
        head_dim = attn.inner_dim // attn.heads

        def heads(x):
            return x.unflatten(-1, (-1, head_dim))

        img_q, img_k, img_v = (heads(p(hidden_states)) for p in (attn.to_q, attn.to_k, attn.to_v))
        txt_q, txt_k, txt_v = (heads(p(encoder_hidden_states)) for p in (attn.add_q_proj, attn.add_k_proj,
                                                                          attn.add_v_proj))
        img_q, img_k = norm_qk(attn, img_q, img_k)
        txt_q, txt_k = norm_qk(attn, txt_q, txt_k, added=True)
        if image_rotary_emb is not None:  # cached phasors (CachedQwenRope) or diffusers' complex tables
            img_emb, txt_emb = image_rotary_emb
            img_q, img_k = rotate_qk(img_q, img_k, img_emb)
            txt_q, txt_k = rotate_qk(txt_q, txt_k, txt_emb)

        mask = encoder_hidden_states_mask
        if mask is not None and mask.dtype != torch.bool:
            mask = mask.to(torch.bool)
        joint = JointTokens(txt_q, txt_k, txt_v, mask, self.text_first)
        img_out, txt_out = self.attn_fn(img_q, img_k, img_v, joint=joint)

        img_out = attn.to_out[0](img_out.flatten(2, 3).to(img_q.dtype).contiguous())
        if len(attn.to_out) > 1:
            img_out = attn.to_out[1](img_out)  # dropout
        txt_out = attn.to_add_out(txt_out.flatten(2, 3).to(txt_q.dtype).contiguous())
        return img_out, txt_out


def _image_shapes(video_fhw) -> list[tuple[int, int, int]]:
    """The (frames, height, width) entries of the first sample of ``img_shapes``, as diffusers reads them."""
    if isinstance(video_fhw, list):
        video_fhw = video_fhw[0]
    if not isinstance(video_fhw, list):
        video_fhw = [video_fhw]
    return [tuple(int(x) for x in fhw) for fhw in video_fhw]


class CachedQwenRope(CachedRope):
    """Replacement ``forward`` of a ``QwenEmbedRope``: cached phasors for (image rows of this rank, text).

    The tables are the module's own (its complex64 tables, same positions, same rounding), converted
    once per (image shapes, text length, device, row range) into
    :class:`~lite_boost.ops.rope.RotaryEmbedding` form; rows past the image length (padding of an
    equal sequence shard) are identity rotations.
    """

    def __call__(self, video_fhw, device=None, max_txt_seq_len=None):
        if max_txt_seq_len is None:
            raise ValueError("`max_txt_seq_len` must be provided.")
        shapes = _image_shapes(video_fhw)
        txt_len = int(max_txt_seq_len)
        start, stop = self.state.serve_range(sum(math.prod(s) for s in shapes))

        def build():
            img, txt = self.original(video_fhw, device=device, max_txt_seq_len=txt_len)
            return phasors_from_complex(img, start, stop), phasors_from_complex(txt)

        return self.cached(("qwen-image", tuple(shapes), txt_len, str(device), start, stop), build)


def _is_qwen_rope(rope) -> bool:
    """The cached form serves ``QwenEmbedRope`` (Qwen-Image-Layered's 3-D layer RoPE keeps diffusers')."""
    from diffusers.models.transformers.transformer_qwenimage import QwenEmbedRope

    return isinstance(rope, QwenEmbedRope) and type(rope).forward is QwenEmbedRope.forward


def _token_grid(model, args, kwargs):
    """(images, h, w) token grid of a call; None when the images differ in size (the call runs dense)."""
    img_shapes = call_arg(args, kwargs, "img_shapes", 4)
    if img_shapes is None:
        return None
    shapes = _image_shapes(img_shapes)
    if len({(h, w) for _, h, w in shapes}) != 1:
        return None
    return sum(f for f, _, _ in shapes), shapes[0][1], shapes[0][2]


_output_shape = packed_output_shape  # (B, image tokens, patch * patch * out_channels)


QWEN_SHARDING_PLAN = ShardingPlan(
    split_inputs=(
        SplitInput("", "controlnet_block_samples", dim=1),  # ControlNet residuals (a list of image-token tensors)
        SplitInput("transformer_blocks.0", "hidden_states", dim=1),  # image tokens after img_in
        SplitInput("transformer_blocks.*", "modulate_index", dim=1, ndim=2),  # Edit-2511: per-token modulation
    ),
    split_outputs=(SplitOutput("pos_embed", dim=0, index=0),),  # only when diffusers' own RoPE is kept
    gather_outputs=(GatherOutput("proj_out", dim=1),),
    rope_range="rope_range",
    text="replicate",  # any text length: the text stream is whole on every rank
)

QWEN_PIPELINE_PLAN = PipelinePlan(
    transformers=("transformer",),
    cfg=CfgPlan(flag=None, encodes="encode_prompt", call_start="check_inputs", output_shape=_output_shape),
    prepare_latents="prepare_latents",
)

# Not offered: FasterCache needs cond and uncond in one batch; Pyramid Attention Broadcast keeps one
# attention cache for both passes, and Qwen-Image's cond and uncond texts differ in length (the cached
# text output of one pass cannot serve the other: stock diffusers fails there too); SeaCache's indicator
# is defined for Wan text-to-video and Cosmos latents only.
QWEN_CACHE_ADAPTER = CacheAdapter(
    methods=("first_block_cache", "mag_cache", "taylorseer_cache"),
    why_not={"faster_cache": separate_passes_why_not("Qwen-Image"),
             "pyramid_attention_broadcast": "its attention cache is shared by the cond and uncond passes, whose "
                                            "text lengths differ in Qwen-Image",
             "sea_cache": SEA_CACHE_WHY_NOT},
    probe_module="img_in",
)

QWEN_IMAGE = register_family(ModelFamily(
    name="qwen-image",
    transformers=("QwenImageTransformer2DModel",),
    pipelines=("QwenImagePipeline", "QwenImageEditPipeline", "QwenImageEditPlusPipeline"),
    attention=(AttentionSite("transformer_blocks.*.attn", QwenImageJointProcessor, role="joint"),),
    joint="text_first",
    rope=RopeSource("pos_embed", CachedQwenRope, matches=_is_qwen_rope),
    token_grid=_token_grid,
    timestep_module="time_text_embed",
    sharding=QWEN_SHARDING_PLAN,
    pipeline=QWEN_PIPELINE_PLAN,
    cache=QWEN_CACHE_ADAPTER,
    quant_patterns=("transformer_blocks.*",),
    notes="text replicated on every rank (joint attention exchanges only the image tokens)",
    output="image",
    cfg_argument="true_cfg_scale",
    # `lite-boost generate --family qwen-image`: 256 x 256 = 1,024 image tokens, random prompt embeddings of
    # 12 / 7 tokens (no text encoder), 10 steps, dense (lite_boost.demo.DEMO_QWEN_*)
    tiny={"t2i": TinyPipeline("QwenImagePipeline", builder="lite_boost.demo:demo_qwen_image_pipeline",
                              shape=(256, 256, None), steps=10, describe="lite_boost.demo:describe_qwen_image_demo",
                              prompt="lite_boost.demo:qwen_demo_prompt")},
))

boost_qwen_image_transformer = QWEN_IMAGE.boost_transformer
boost_qwen_image_pipeline = QWEN_IMAGE.boost_pipeline
