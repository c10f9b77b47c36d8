"""Qwen-Image 2.1 (``QwenImage21Transformer2DModel``, ``QwenImage21Pipeline``) on the adapter layer.

The model runs one single-stream sequence: the text, with the condition images' latent tokens put in
the places the vision-language encoder reserved for them, then the target image. Its attention is
block-causal, ``(q >= kv) or same image block``, padded text keys never attended:

* a text row sees every valid key up to and including itself;
* a condition-image row sees every valid key up to the end of its own image;
* a target-image row (the target is the last block) sees every valid key: the whole prefix and the
  whole target, and no prefix row ever sees a target key.

So the target is a stream attended jointly with the prefix as keys only, and the prefix (text and
condition images, everything before the target) depends on nothing after it. What varies, as data
(:data:`QWEN_IMAGE_21`) plus one processor shim and one RoPE shim:

* attention (``transformer_blocks.*.attn``): :class:`QwenImage21Processor` keeps diffusers'
  projections, q / k norms and output projection, and splits each call at the prefix length the
  model hands every non-flex processor (``segments``, the prefix's runs of text and images). The
  target rows go to ``attn_fn(target q, k, v, joint=JointTokens(no rows, prefix k, prefix v, key
  mask))``: keys only (:attr:`~lite_boost.ops.joint.JointTokens.keys_only`), so dense, block-sparse
  and sequence-parallel attention see the target as their stream and the prefix as the joint keys.
  The prefix rows run their block-causal attention right here, on every rank: one dense attention with
  the per-row key limit (a text row's own position, a condition image's last token) and the text mask.
* prefix KV caching (the pipeline's default ``use_kv_cache``: the prefix's keys and values from the
  first step serve every later step, which computes the target rows only): the processor stores and
  reads the layer cache as diffusers' processors do; a "cached" call is the keys-only joint attention
  of the target with the cached prefix.
* RoPE: ``pos_embed`` builds complex tables for the whole sequence in Python per call;
  :class:`CachedQwenImage21Rope` keeps them (the module's own tables, complex64: equal to stock), the
  prefix rows whole and the target rows of this rank under sequence parallelism.
* sequence parallelism: the prefix stays whole on every rank (any length, any text / image
  interleaving); only the target tokens are split, at ``transformer_blocks.0`` (``SplitInput(tail=...)``),
  with the per-token modulation mask at every block and at ``norm_out``; ``proj_out`` gathers the
  target rows behind the prefix rows (``GatherOutput(tail=True)``). Exact: the target attends every
  prefix key and every target key, which is the joint attention Ulysses and Ring already do.
* CFG: two transformer calls (``cache_context("cond" / "uncond")``), decided in a local variable (CFG
  runs when ``encode_prompt`` ran twice per call), as Qwen-Image; each branch keeps its own KV cache. The
  modular pipelines run one call per condition of their guider (``cache_context("pred_cond" / "pred_uncond")``).
  The two branches' outputs differ in length (their texts do): the exchange gathers them unevenly.
* token grid for sparse windows: the target image's (1, h, w) from ``img_shapes``.
* step caching: none of diffusers' hooks runs on this model (see ``_STEP_CACHE_WHY_NOT``); refused.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ..adapter import AttentionSite, LiteBoostProcessor, ModelFamily, RopeSource, TinyPipeline, rotate_qk
from ..adapter.shims import CachedRope, call_arg
from ..ops.joint import JointTokens
from ..ops.rope import phasors_from_complex
from ..parallel.plan import CfgPlan, GatherOutput, PipelinePlan, ShardingPlan, SplitInput
from ..registry import register_family

__all__ = ["QWEN_IMAGE_21", "QwenImage21Processor", "CachedQwenImage21Rope", "QWEN21_SHARDING_PLAN",
           "QWEN21_PIPELINE_PLAN", "boost_qwen_image_21_transformer", "boost_qwen_image_21_pipeline"]

# QwenImage21Transformer2DModel.forward's positional order
_IMG_SHAPES, _IMG_MASK, _KV_MODE = 3, 4, 8


class Qwen21Call(NamedTuple):
    """A transformer call in progress (``BoostState.call``): the target image's token count and whether the
    call is a cached (target-only) step."""

    target: int
    cached: bool


def _target_shape(img_shapes) -> tuple[int, int, int]:
    """(frames, h, w) of the target image (the last entry of the first sample's ``img_shapes``)."""
    return tuple(int(x) for x in img_shapes[0][-1])


def _call_context(model, args, kwargs) -> Qwen21Call | None:
    img_shapes = call_arg(args, kwargs, "img_shapes", _IMG_SHAPES)
    if not img_shapes:
        return None
    return Qwen21Call(math.prod(_target_shape(img_shapes)), call_arg(args, kwargs, "kv_cache_mode", _KV_MODE) == "cached")


def _sharded_tail(state) -> int:
    """The target tokens of the call in progress: the part of the sequence split over the ranks."""
    if not isinstance(state.call, Qwen21Call):
        raise RuntimeError("Qwen-Image 2.1 sequence parallelism needs img_shapes of the transformer call in progress")
    return state.call.target


def _prefix_attention(q, k, v, segments, key_valid):
    """Block-causal attention of the prefix rows over the prefix keys (B, P, H, D): row i attends key j when
    j <= limit[i] (i for a text row, the last token of its image for a condition-image row) and the key is
    valid text. One dense attention in the input dtype, on every rank (the prefix is never sharded)."""
    n = q.shape[1]
    limit = torch.arange(n, device=q.device)
    for start, end, is_text in segments:
        if not is_text:
            limit[start:end] = end - 1
    allowed = torch.arange(n, device=q.device)[None, :] <= limit[:, None]  # (P, P)
    mask = allowed[None, None] if key_valid is None else allowed[None, None] & key_valid[:, None, None, :n].bool()
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)
    return out.transpose(1, 2)


class QwenImage21Processor(LiteBoostProcessor):
    """Attention of a ``QwenImage21TransformerBlock`` with the semantics of diffusers' ``QwenImage21AttnProcessor``
    (block-causal prefill, prefix KV caching): the target rows through ``attn_fn`` with the prefix as keys only,
    the prefix rows block-causal on every rank."""

    def __call__(self, attn, hidden_states: torch.Tensor, attention_mask=None, rotary_emb=None, layer_cache=None,
                 kv_cache_mode: str | None = None, cache_write_slice: slice | None = None, segments=None,
                 key_valid: torch.Tensor | None = None):
        head_dim = attn.inner_dim // attn.heads
        q, k, v = (p(hidden_states).unflatten(-1, (-1, head_dim)) for p in (attn.to_q, attn.to_k, attn.to_v))
        q, k = attn.norm_q(q).to(v.dtype), attn.norm_k(k).to(v.dtype)
        if rotary_emb is not None:
            q, k = rotate_qk(q, k, rotary_emb)
        if kv_cache_mode == "cached":  # target rows only; the prefix keys and values come from the first step
            if layer_cache is None:
                raise ValueError("kv_cache_mode='cached' needs the layer's KV cache (layer_cache)")
            prefix_k, prefix_v = layer_cache.get()
            n = prefix_k.shape[1]
            mask = None if attention_mask is None else attention_mask.reshape(q.shape[0], -1)[:, :n].bool()
            out, _ = self.attn_fn(q, k, v, joint=JointTokens(q[:, :0], prefix_k, prefix_v, mask, True))
        else:
            if segments is None:
                raise ValueError("QwenImage21Processor needs `segments` (the prefix layout the model passes to "
                                 "processors other than QwenImage21FlexAttnProcessor)")
            n = segments[-1][1] if segments else 0
            if layer_cache is not None and kv_cache_mode == "extract" and cache_write_slice is not None:
                layer_cache.store(k[:, cache_write_slice].clone(), v[:, cache_write_slice].clone())
            if n == 0:
                out = self.attn_fn(q, k, v)
            else:
                mask = None if key_valid is None else key_valid[:, :n].bool()
                target, _ = self.attn_fn(q[:, n:], k[:, n:], v[:, n:],
                                         joint=JointTokens(q[:, :0], k[:, :n], v[:, :n], mask, True))
                prefix = _prefix_attention(q[:, :n], k[:, :n], v[:, :n], segments, key_valid)
                out = torch.cat([prefix.to(target.dtype), target], dim=1)
        out = attn.to_out[0](out.flatten(2, 3).to(q.dtype).contiguous())
        return attn.to_out[1](out)


class CachedQwenImage21Rope(CachedRope):
    """Replacement ``forward`` of a ``QwenImage21Rope``: its complex64 tables (S, D/2), kept per (image shapes,
    image-token layout, device, row range): every prefix row, and the target rows of this rank (identity rows
    past the end: padding of an equal shard)."""

    def __call__(self, img_shapes, image_pad_mask: torch.Tensor, device=None):
        shapes = tuple(tuple(int(x) for x in s) for s in img_shapes)
        seq, target = image_pad_mask.shape[-1], math.prod(shapes[-1])
        head = seq - target
        start, stop = self.state.serve_range(target)

        def build():
            table = self.original(img_shapes, image_pad_mask, device=device)
            if (start, stop) == (0, target):
                return table
            rows = phasors_from_complex(table[head:], start, stop).freqs[0, :, 0]
            return torch.cat([table[:head], rows])

        if torch.compiler.is_compiling():
            return build()
        layout = image_pad_mask.detach().to("cpu", torch.uint8).numpy().tobytes()
        return self.cached(("qwen-image-2.1", shapes, layout, str(device), start, stop), build)


def _is_qwen21_rope(rope) -> bool:
    from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21Rope

    return isinstance(rope, QwenImage21Rope) and type(rope).forward is QwenImage21Rope.forward


def _token_grid(model, args, kwargs):
    """(frames, h, w) of the target image: the sharded, block-sparse stream."""
    img_shapes = call_arg(args, kwargs, "img_shapes", _IMG_SHAPES)
    return _target_shape(img_shapes) if img_shapes else None


def _output_shape(model, args, kwargs) -> tuple[int, ...]:
    """(B, sequence, out channels) of a call: the target rows of a cached call, else the whole sequence (each
    vision-language image slot of ``img_mask`` stands for 4 latent tokens of ``hidden_states``)."""
    hidden = call_arg(args, kwargs, "hidden_states", 0)
    if call_arg(args, kwargs, "kv_cache_mode", _KV_MODE) == "cached":
        seq = math.prod(_target_shape(call_arg(args, kwargs, "img_shapes", _IMG_SHAPES)))
    else:
        seq = call_arg(args, kwargs, "img_mask", _IMG_MASK).shape[1] + 3 * hidden.shape[1] // 4
    return (hidden.shape[0], seq, model.proj_out.out_features)


QWEN21_SHARDING_PLAN = ShardingPlan(
    split_inputs=(
        SplitInput("transformer_blocks.0", "hidden_states", dim=1, tail=_sharded_tail),  # the target tokens
        SplitInput("transformer_blocks.*", "target_token_mask", dim=0, tail=_sharded_tail),  # per-token modulation
        SplitInput("norm_out", "target_token_mask", dim=0, tail=_sharded_tail),
    ),
    gather_outputs=(GatherOutput("proj_out", dim=1, tail=True),),  # [prefix, every rank's target rows]
    rope_range="rope_range",
    text="replicate",  # the prefix (text and condition images) is whole on every rank
)

QWEN21_PIPELINE_PLAN = PipelinePlan(
    transformers=("transformer",),
    cfg=CfgPlan(flag=None, encodes="encode_prompt", call_start="check_inputs", output_shape=_output_shape),
    prepare_latents="prepare_latents",
    # the modular pipelines run one call per condition of their guider (its own KV cache per condition)
    cfg_by_pipeline=(("QwenImage21ModularPipeline", CfgPlan(kind="guider", flag=None, guider="guider", cond="pred_cond",
                                                            uncond="pred_uncond", output_shape=_output_shape)),),
)

# Each fails on stock diffusers too; the pipeline's own prefix KV caching is what skips work across steps here.
_STEP_CACHE_WHY_NOT = ("no diffusers step-cache hook fits: First-Block Cache and MagCache do not know "
                       "QwenImage21TransformerBlock, TaylorSeer's kept block outputs do not match the target-only steps "
                       "of the pipeline's prefix KV caching, Pyramid Attention Broadcast shares one attention cache "
                       "between cond and uncond texts of different lengths (stock diffusers fails in each case)")

QWEN_IMAGE_21 = register_family(ModelFamily(
    name="qwen-image-2.1",
    transformers=("QwenImage21Transformer2DModel",),
    pipelines=("QwenImage21Pipeline", "QwenImage21ModularPipeline", "QwenImage21TurboModularPipeline"),
    attention=(AttentionSite("transformer_blocks.*.attn", QwenImage21Processor, role="joint"),),
    joint="text_first",
    rope=RopeSource("pos_embed", CachedQwenImage21Rope, matches=_is_qwen21_rope),
    call_context=_call_context,
    token_grid=_token_grid,
    timestep_module="time_text_embed",
    sharding=QWEN21_SHARDING_PLAN,
    pipeline=QWEN21_PIPELINE_PLAN,
    quant_patterns=("transformer_blocks.*",),
    unsupported={"step_cache": _STEP_CACHE_WHY_NOT},
    notes="block-causal single stream: text and condition images whole on every rank, the target image split; "
          "prefix KV caching as the pipeline asks",
    # diffusers' QwenImage21Transformer2DModel defaults (32 blocks, 32 heads x 128) at 1024 x 1024 px (16x VAE, no
    # patching: 4,096 target tokens); the text encoder is not counted
    reference={"name": "Qwen-Image-2.1", "shape": (1, 1024, 1024), "vae_scale": (1, 16, 16)},
    output="image",
    cfg_argument="true_cfg_scale",
    # `lite-boost generate --family qwen-image-2.1`: 512 x 512 px = 1,024 target tokens, random prompt embeddings
    # (no text encoder), 10 steps, dense (lite_boost.demo.DEMO_QWEN21_*)
    tiny={"t2i": TinyPipeline("QwenImage21Pipeline", builder="lite_boost.demo:demo_qwen_image21_pipeline",
                              shape=(512, 512, None), steps=10, describe="lite_boost.demo:describe_qwen_image21_demo",
                              prompt="lite_boost.demo:qwen21_demo_prompt",
                              stand_ins={"processor": "lite_boost.demo:qwen21_stand_in_processor"})},
))

boost_qwen_image_21_transformer = QWEN_IMAGE_21.boost_transformer
boost_qwen_image_21_pipeline = QWEN_IMAGE_21.boost_pipeline
