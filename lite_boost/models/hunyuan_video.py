"""HunyuanVideo (T2V, I2V) and HunyuanVideo-1.5 (T2V, I2V) on the adapter layer.

What varies for these families, as data (:data:`HUNYUAN_VIDEO`, :data:`HUNYUAN_VIDEO_15`) plus two
processor shims and one RoPE shim:

* attention: joint attention over [image, text] (``joint="image_first"``). HunyuanVideo has 20 dual-stream
  blocks (``transformer_blocks.*.attn``: image through ``to_q/k/v``, text through ``add_*_proj``) and
  40 single-stream blocks (``single_transformer_blocks.*.attn``: no ``add_q_proj``; the block
  concatenates [image, text] for its norm and MLP and hands the two parts in separately, both through
  ``to_q/k/v``); their layer indices continue after the dual blocks' (``layer_offset``). 1.5 has 54 dual blocks. The
  token-refiner attentions inside ``context_embedder`` keep diffusers' processor (not an attention site).
* text mask: HunyuanVideo's pipelines pad the text to 256 tokens and the model builds a (B, 1, 1, S + T)
  boolean key mask whose last T entries are the text's; the shim passes those as ``key_mask``. 1.5's
  stock processor expands its (B, T) text mask into a dense (B, 1, S + T, S + T) mask on every call
  (O(S^2) memory); :class:`HunyuanVideo15JointProcessor` passes the (B, T) key-padding mask instead and
  zeroes the padded text rows' output, which the dense mask leaves at zero (they attend nothing).
* RoPE: ``rope`` rebuilds real interleaved (cos, sin) tables for the image tokens from the latent shape
  at every call; :class:`CachedHunyuanRope` keeps the module's own tables as cached fp32 phasors, this
  rank's rows only. Text tokens get no RoPE.
* sequence parallelism: image tokens split at ``transformer_blocks.0`` (the single blocks get the
  shard from the dual blocks), text replicated (``joint=``), gathered after ``proj_out``. The I2V
  token-replace blocks modulate the first ``num_tokens`` (first-frame) rows differently: each rank gets
  ``clamp(num_tokens - its offset, 0, its length)`` (``RankArg``; T2V blocks take no such argument).
* CFG: HunyuanVideo makes two transformer calls per step with true CFG only (``true_cfg_scale > 1`` and a
  negative prompt; the default is guidance-distilled, one call); T2V names them by ``cache_context``,
  I2V does not, so both are split by call order (``CfgPlan(by_call_order=True)``, CFG recognised from
  ``encode_prompt`` running twice, the order reset by ``check_inputs`` at every pipeline call). 1.5 runs a diffusers ``ClassifierFreeGuidance`` guider ("guider": ``pred_cond`` /
  ``pred_uncond``, CFG steps decided by the guider).
* 1.5 reorders its text tokens per sample with boolean indexing (valid tokens first) in the model's
  forward, before the blocks: data-dependent shapes there, none in a block (``compile_repeated_blocks``
  compiles the blocks only; the shims add no data-dependent code).
* token grid for sparse windows: (frames / patch_t, height / patch, width / patch) of ``hidden_states``.
* tensor parallelism (:data:`HUNYUAN_VIDEO_TP_PLAN`, both families): the heads of every block's attention
  (image and text projections), both feed-forwards of the dual blocks, and the single blocks' MLP; a single
  block's ``proj_out`` reads [attention output, MLP hidden] concatenated, each part split over the ranks by
  the layer before it, so its input columns are split part by part (:class:`AttnMlpRowwise`). The q / k
  norms are per head (nothing to all-reduce); the token refiner stays whole on every rank.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor.parallel import ParallelStyle

from ..adapter import AttentionSite, LiteBoostProcessor, ModelFamily, RopeSource, rotate_qk
from ..adapter.shims import (SEA_CACHE_WHY_NOT, CachedRope, call_arg, norm_qk, patch_grid, patch_size,
                             separate_passes_why_not, video_token_grid)
from ..cache import CacheAdapter
from ..config import ConfigError
from ..ops.joint import JointTokens
from ..ops.rope import phasors_from_cos_sin
from ..parallel.plan import CfgPlan, GatherOutput, PipelinePlan, RankArg, ShardingPlan, SplitInput, SplitOutput
from ..parallel.shard import TensorParallelPlan
from ..registry import register_family

__all__ = ["HUNYUAN_VIDEO", "HUNYUAN_VIDEO_15", "HunyuanVideoJointProcessor", "HunyuanVideo15JointProcessor",
           "CachedHunyuanRope", "AttnMlpRowwise", "HUNYUAN_VIDEO_TP_PLAN", "boost_hunyuan_video_transformer", "boost_hunyuan_video_pipeline",
           "boost_hunyuan_video_15_transformer", "boost_hunyuan_video_15_pipeline"]


def _heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    return x.unflatten(2, (heads, -1))


def _project(attn, image, text, dual: bool):
    """Normalised (q, k, v) of the image and of the text stream, (B, S, H, D) each."""
    q, k, v = (_heads(p(image), attn.heads) for p in (attn.to_q, attn.to_k, attn.to_v))
    text_proj = (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj) if dual else (attn.to_q, attn.to_k, attn.to_v)
    tq, tk, tv = (_heads(p(text), attn.heads) for p in text_proj)
    q, k = norm_qk(attn, q, k)
    tq, tk = norm_qk(attn, tq, tk, added=dual)
    return (q, k, v), (tq, tk, tv)


def _outputs(attn, img_out, txt_out, dtype):
    img_out = img_out.flatten(2, 3).to(dtype)
    txt_out = txt_out.flatten(2, 3).to(dtype)
    if attn.to_out is not None:
        img_out = attn.to_out[1](attn.to_out[0](img_out))
    if attn.to_add_out is not None:
        txt_out = attn.to_add_out(txt_out)
    return img_out, txt_out


class HunyuanVideoJointProcessor(LiteBoostProcessor):
    """Joint [image, text] attention of a HunyuanVideo dual- or single-stream block, with the semantics of
    diffusers' ``HunyuanVideoAttnProcessor2_0``; returns ``(image_out, text_out)``.

    ``attention_mask`` is the model's (B, 1, 1, S + T) boolean key mask over [image, text]; its last T
    entries (the text's) become the key-padding mask (the image part is all True by construction).
    """

    def __call__(self, attn, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, image_rotary_emb=None, **kwargs):
        if encoder_hidden_states is None:
            raise ValueError("HunyuanVideoJointProcessor requires encoder_hidden_states (the text stream)")
        (q, k, v), (tq, tk, tv) = _project(attn, hidden_states, encoder_hidden_states, attn.add_q_proj is not None)
        if image_rotary_emb is not None:  # image rows only: cached phasors, or diffusers' (cos, sin)
            q, k = rotate_qk(q, k, image_rotary_emb)
        key_mask = None
        if attention_mask is not None:
            if attention_mask.dtype != torch.bool or attention_mask.ndim not in (2, 4) or (
                    attention_mask.ndim == 4 and attention_mask.shape[1:3] != (1, 1)):
                raise ValueError("HunyuanVideoJointProcessor takes a boolean key mask of shape (B, 1, 1, S + T) or "
                                 f"(B, S + T), got {attention_mask.dtype} {tuple(attention_mask.shape)}")
            key_mask = attention_mask.reshape(attention_mask.shape[0], -1)[:, -tq.shape[1]:]
        img_out, txt_out = self.attn_fn(q, k, v, joint=JointTokens(tq, tk, tv, key_mask, self.text_first))
        return _outputs(attn, img_out, txt_out, q.dtype)


class HunyuanVideo15JointProcessor(LiteBoostProcessor):
    """Joint [image, text] attention of a HunyuanVideo-1.5 block (diffusers' ``HunyuanVideo15AttnProcessor2_0``)
    with the (B, T) text mask as a key-padding mask instead of the stock dense (B, 1, S + T, S + T) mask.

    The dense mask also masks the padded text *queries* (their rows attend nothing and come out zero);
    they are zeroed here too, so every output row equals stock's.
    """

    def __call__(self, attn, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, image_rotary_emb=None, **kwargs):
        if encoder_hidden_states is None:
            raise ValueError("HunyuanVideo15JointProcessor requires encoder_hidden_states (the text stream)")
        (q, k, v), (tq, tk, tv) = _project(attn, hidden_states, encoder_hidden_states, True)
        if image_rotary_emb is not None:
            q, k = rotate_qk(q, k, image_rotary_emb)
        key_mask = None if attention_mask is None else attention_mask.to(torch.bool)
        if key_mask is not None and tuple(key_mask.shape) != tuple(tq.shape[:2]):
            raise ValueError(f"HunyuanVideo15JointProcessor takes the (B, T) = {tuple(tq.shape[:2])} text mask, got "
                             f"{tuple(attention_mask.shape)}")
        img_out, txt_out = self.attn_fn(q, k, v, joint=JointTokens(tq, tk, tv, key_mask, self.text_first))
        if key_mask is not None:
            txt_out = txt_out.masked_fill(~key_mask[:, :, None, None], 0.0)
        return _outputs(attn, img_out, txt_out, q.dtype)


def _is_hunyuan_rope(rope) -> bool:
    """The cached form serves diffusers' two (identical) HunyuanVideo RoPE modules, unmodified."""
    from diffusers.models.transformers.transformer_hunyuan_video import HunyuanVideoRotaryPosEmbed
    from diffusers.models.transformers.transformer_hunyuan_video15 import HunyuanVideo15RotaryPosEmbed

    return any(isinstance(rope, c) and type(rope).forward is c.forward
               for c in (HunyuanVideoRotaryPosEmbed, HunyuanVideo15RotaryPosEmbed))


class CachedHunyuanRope(CachedRope):
    """Replacement ``forward`` of a HunyuanVideo(-1.5) ``rope``: cached phasors for this rank's image rows.

    The tables are the module's own (the same float32 (cos, sin) arithmetic), converted once per (token
    grid, rope axes, theta, device, row range) into :class:`~lite_boost.ops.rope.RotaryEmbedding` form;
    rows past the token count (padding of an equal sequence shard) are identity rotations.
    """

    def __call__(self, hidden_states: torch.Tensor):
        rope = self.rope
        grid = patch_grid(hidden_states.shape[2:], patch_size(rope))
        start, stop = self.state.serve_range(math.prod(grid))

        def build():
            cos, sin = self.original(hidden_states)
            return phasors_from_cos_sin(cos, sin, start, stop)

        key = ("hunyuan-video", grid, tuple(rope.rope_dim), float(rope.theta), str(hidden_states.device), start, stop)
        return self.cached(key, build)


_token_grid = video_token_grid(frames_dim=2)  # (B, C, F, H, W) latents


def _output_shape(model, args, kwargs):
    """The transformer output (B, out_channels, F, H, W) of a call."""
    hidden = call_arg(args, kwargs, "hidden_states", 0)
    return (hidden.shape[0], model.config.out_channels, *hidden.shape[2:])


def _first_frame_rows(num_tokens, start, stop):
    """This rank's count of first-frame rows (the first ``num_tokens`` of the sequence) in [start, stop)."""
    return max(0, min(num_tokens - start, stop - start))


def _sharding(single_blocks: bool) -> ShardingPlan:
    stacks = ("transformer_blocks.*", "single_transformer_blocks.*") if single_blocks else ()
    return ShardingPlan(
        split_inputs=(SplitInput("transformer_blocks.0", "hidden_states", dim=1),),  # image tokens after x_embedder
        split_outputs=(SplitOutput("rope", dim=0),),  # only when diffusers' own (cos, sin) RoPE is kept
        gather_outputs=(GatherOutput("proj_out", dim=1),),
        rank_args=tuple(RankArg(s, "num_tokens", _first_frame_rows, optional=True) for s in stacks),
        rope_range="rope_range",
        text="replicate",  # the text (256 padded tokens; 1.5: ~2,000) is whole on every rank
    )


_NEED_CONTEXT = ("first_block_cache", "taylorseer_cache")  # their hook state is kept per cache_context


def _check_cache(model, method: str, params: dict) -> None:
    kind = getattr(model.config, "image_condition_type", None)
    if kind is not None and method in _NEED_CONTEXT:
        raise ConfigError(f"cache method {method!r} is not supported for an image-to-video HunyuanVideo transformer "
                          f"(image_condition_type={kind!r}): HunyuanVideoImageToVideoPipeline calls it without the "
                          "cache_context this hook keeps its state in (stock diffusers fails too); use mag_cache or "
                          "pyramid_attention_broadcast")


# Not offered: FasterCache needs cond and uncond batched into one call; SeaCache's indicator is defined
# for Wan text-to-video and Cosmos only. Pyramid Attention Broadcast keeps one attention cache for the
# cond and uncond passes, as in stock diffusers (both texts are padded to one length here).
HUNYUAN_VIDEO_CACHE_ADAPTER = CacheAdapter(
    methods=("first_block_cache", "mag_cache", "taylorseer_cache", "pyramid_attention_broadcast"),
    check=_check_cache,
    why_not={"faster_cache": separate_passes_why_not("HunyuanVideo"), "sea_cache": SEA_CACHE_WHY_NOT},
    probe_module="x_embedder",
)

# 1.5: diffusers registers no block metadata for HunyuanVideo15TransformerBlock, so the block-level
# caches (First-Block Cache, MagCache) fail on stock diffusers; the attention-level ones work.
HUNYUAN_VIDEO_15_CACHE_ADAPTER = CacheAdapter(
    methods=("taylorseer_cache", "pyramid_attention_broadcast"),
    why_not={**{m: "diffusers registers no block metadata for HunyuanVideo15TransformerBlock (stock diffusers fails "
                   "too)" for m in ("first_block_cache", "mag_cache")},
             "faster_cache": separate_passes_why_not("the guider"), "sea_cache": SEA_CACHE_WHY_NOT},
    probe_module="x_embedder",
)

class AttnMlpRowwise(ParallelStyle):
    """Row-wise split of a single-stream block's ``proj_out``, whose input is ``cat([attention output, MLP
    hidden])``: the attention part is as wide as the layer's output (``out_features``), the MLP part is the
    rest. Each part arrives split over the tp ranks on its own (the heads by ``to_q/k/v``, the MLP by the
    column-wise ``proj_mlp``), so the weight's input columns are split part by part: diffusers'
    ``PackedRowwiseParallel`` with those two block sizes, read from the layer and stored on it as
    ``_tp_packed_row_blocks`` (as diffusers does for Flux's single blocks at construction)."""

    def _apply(self, module, device_mesh):
        from diffusers.hooks.tensor_parallel import PackedRowwiseParallel, _styles

        module._tp_packed_row_blocks = [module.out_features, module.in_features - module.out_features]
        style = _styles({"proj_out": PackedRowwiseParallel()})["proj_out"]
        style.src_data_rank = self.src_data_rank
        return style._apply(module, device_mesh)

    def __repr__(self) -> str:
        return "AttnMlpRowwise()"


def _tp_plan() -> TensorParallelPlan:
    dual = {**{f"transformer_blocks.*.attn.{p}": "colwise" for p in ("to_q", "to_k", "to_v", "add_q_proj",
                                                                      "add_k_proj", "add_v_proj")},
            "transformer_blocks.*.attn.to_out.0": "rowwise", "transformer_blocks.*.attn.to_add_out": "rowwise",
            **{f"transformer_blocks.*.{ff}.net.0.proj": "colwise" for ff in ("ff", "ff_context")},
            **{f"transformer_blocks.*.{ff}.net.2": "rowwise" for ff in ("ff", "ff_context")}}
    single = {**{f"single_transformer_blocks.*.attn.{p}": "colwise" for p in ("to_q", "to_k", "to_v")},
              "single_transformer_blocks.*.proj_mlp": "colwise",
              "single_transformer_blocks.*.proj_out": AttnMlpRowwise()}
    return TensorParallelPlan(layers={**dual, **single})


# Tensor parallelism: HunyuanVideo's dual and single blocks; 1.5 has dual blocks only (the single-block
# entries match nothing there). q / k norms are per head (rms_norm over head_dim): no distributed norm.
HUNYUAN_VIDEO_TP_PLAN = _tp_plan()

# What the two families share: [image, text] joint attention, the RoPE module and the token grid.
_COMMON = dict(joint="image_first", rope=RopeSource("rope", CachedHunyuanRope, matches=_is_hunyuan_rope),
               token_grid=_token_grid, tensor_parallel=HUNYUAN_VIDEO_TP_PLAN)

HUNYUAN_VIDEO = register_family(ModelFamily(
    name="hunyuan-video",
    output="video", cfg_argument="true_cfg_scale",
    transformers=("HunyuanVideoTransformer3DModel",),
    pipelines=("HunyuanVideoPipeline", "HunyuanVideoImageToVideoPipeline"),
    attention=(AttentionSite("transformer_blocks.*.attn", HunyuanVideoJointProcessor, role="joint"),
               AttentionSite("single_transformer_blocks.*.attn", HunyuanVideoJointProcessor, role="joint",
                             layer_offset=lambda model: len(model.transformer_blocks))),
    timestep_module="time_text_embed",
    sharding=_sharding(single_blocks=True),
    pipeline=PipelinePlan(cfg=CfgPlan(flag=None, encodes="encode_prompt", call_start="check_inputs", by_call_order=True,
                                      output_shape=_output_shape)),
    cache=HUNYUAN_VIDEO_CACHE_ADAPTER,
    quant_patterns=("transformer_blocks.*", "single_transformer_blocks.*"),
    unsupported={"parallel_vae": "AutoencoderKLHunyuanVideo has no parallel-VAE adapter yet; each rank decodes the "
                                 "whole video"},
    notes="text (padded to 256) replicated on every rank; CFG parallel with true CFG only (the default is "
          "guidance-distilled); I2V first-frame rows counted per rank",
    **_COMMON,
))

HUNYUAN_VIDEO_15 = register_family(ModelFamily(
    name="hunyuan-video-1.5",
    output="video", cfg_argument=None,  # its guider holds the scale
    transformers=("HunyuanVideo15Transformer3DModel",),
    pipelines=("HunyuanVideo15Pipeline", "HunyuanVideo15ImageToVideoPipeline"),
    attention=(AttentionSite("transformer_blocks.*.attn", HunyuanVideo15JointProcessor, role="joint"),),
    timestep_module="time_embed",
    sharding=_sharding(single_blocks=False),
    pipeline=PipelinePlan(cfg=CfgPlan(kind="guider", flag=None, guider="guider", cond="pred_cond",
                                      uncond="pred_uncond", output_shape=_output_shape)),
    cache=HUNYUAN_VIDEO_15_CACHE_ADAPTER,
    quant_patterns=("transformer_blocks.*",),
    notes="dense (S+T)^2 mask replaced by a key-padding mask; text (~2,000 tokens) replicated on every rank; CFG "
          "parallel through the ClassifierFreeGuidance guider",
    **_COMMON,
))

boost_hunyuan_video_transformer = HUNYUAN_VIDEO.boost_transformer
boost_hunyuan_video_pipeline = HUNYUAN_VIDEO.boost_pipeline
boost_hunyuan_video_15_transformer = HUNYUAN_VIDEO_15.boost_transformer
boost_hunyuan_video_15_pipeline = HUNYUAN_VIDEO_15.boost_pipeline
