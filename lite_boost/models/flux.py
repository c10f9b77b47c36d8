"""Flux.1 (``FluxTransformer2DModel`` and the pipelines sharing it) on the adapter layer.

What varies for this family, as data (:data:`FLUX`) plus one processor shim and one RoPE shim:

* attention: dual-stream blocks (``transformer_blocks.*.attn``) attend [text, image] jointly, image
  through ``to_q/k/v``, text through ``add_q/k/v_proj``; single-stream blocks
  (``single_transformer_blocks.*.attn``) get the [text, image] concatenation the *block* made and
  have no ``add_*`` projections. :class:`FluxAttnProcessor` serves both with diffusers'
  ``FluxAttnProcessor`` semantics and hands the attention to ``attn_fn`` with the text as
  ``joint=JointTokens(...)``; in a single block it splits the sequence at the text length of the
  call (the rows of the text RoPE table it is given), so under sequence parallelism a single block
  sees [text (replicated), image shard] and only the image shard enters the all_to_all.
* RoPE: ``pos_embed`` gets ``cat(txt_ids, img_ids)`` and rebuilds (cos, sin) for the whole joint
  sequence at every call (float64 angles). :class:`CachedFluxRope` returns the same tables in the
  cached fp32 phasor form as a :class:`FluxRope` pair (text rows, image rows of this rank); the
  text gets RoPE too (identity for the pipelines' zero text ids, rotated for any other ids). The
  split point comes from the transformer call's own ``txt_ids`` (:attr:`ModelFamily.call_context`).
* sequence parallelism: image tokens split at ``transformer_blocks.0`` (and ControlNet residuals
  at the root), text replicated (any length), gathered after ``proj_out``. The single blocks'
  token-wise norm / MLP / output projection run on [text, image shard]; the text rows they produce
  are identical on every rank (the text attention output is put together from every rank's heads).
* CFG: true CFG (``true_cfg_scale > 1`` with a negative prompt) calls the transformer twice per
  step; only ``FluxPipeline`` names the passes (``cache_context``), so the passes are told apart by
  call order; the decision is local to the pipeline, recognised from ``encode_prompt`` running twice.
* token grid for sparse windows: (images, h, w) read from ``img_ids`` (a raster per image; Kontext:
  target + reference of one size), in eager code only.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..adapter import AttentionSite, DenseAttention, LiteBoostProcessor, ModelFamily, RopeSource, rotate_qk
from ..adapter.shims import (SEA_CACHE_WHY_NOT, CachedRope, call_arg, norm_qk, packed_output_shape, raster_grid,
                             separate_passes_why_not, tensor_keys)
from ..cache import CacheAdapter
from ..ops.joint import JointTokens
from ..ops.rope import RotaryEmbedding, phasors_from_cos_sin
from ..parallel.plan import CfgPlan, GatherOutput, PipelinePlan, ShardingPlan, SplitInput
from ..registry import register_family

__all__ = ["FLUX", "FluxAttnProcessor", "FluxRope", "FluxCall", "CachedFluxRope", "FLUX_SHARDING_PLAN",
           "FLUX_PIPELINE_PLAN", "FLUX_CACHE_ADAPTER", "boost_flux_transformer", "boost_flux_pipeline"]


class FluxRope(NamedTuple):
    """The RoPE of one Flux call in cached form: text rows, and the image rows this rank holds."""

    text: RotaryEmbedding
    image: RotaryEmbedding


class FluxCall(NamedTuple):
    """What a Flux transformer call says about its sequence (``BoostState.call``): the caller's ids."""

    txt_ids: torch.Tensor | None
    img_ids: torch.Tensor | None


def _ids2d(ids):
    # diffusers' deprecated 3-D ids: the model takes the first batch element
    return ids[0] if isinstance(ids, torch.Tensor) and ids.ndim == 3 else ids


def _call_context(model, args, kwargs) -> FluxCall:
    return FluxCall(_ids2d(call_arg(args, kwargs, "txt_ids", 5)), _ids2d(call_arg(args, kwargs, "img_ids", 4)))


class FluxAttnProcessor(LiteBoostProcessor):
    """Attention of a Flux dual-stream or single-stream block (diffusers' ``FluxAttnProcessor`` semantics).

    Dual block: returns ``(image_out, text_out)``. Single block: ``hidden_states`` is the block's
    [text, image] concatenation; returns the attention output of the same rows (no projection).
    ``image_rotary_emb`` is a :class:`FluxRope` (the cached form) or diffusers' (cos, sin) tables of
    the whole joint sequence.
    """

    def __call__(self, attn, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, image_rotary_emb=None, **kwargs):
        if attention_mask is not None:
            raise ValueError("FluxAttnProcessor (lite_boost) does not accept attention_mask: Flux attends every "
                             "text and image token")
        from diffusers.models.transformers.transformer_flux import _get_qkv_projections

        q, k, v, txt_q, txt_k, txt_v = _get_qkv_projections(attn, hidden_states, encoder_hidden_states)

        def heads(x):
            return x.unflatten(-1, (-1, attn.head_dim))

        q, k, v = heads(q), heads(k), heads(v)
        q, k = norm_qk(attn, q, k)
        if encoder_hidden_states is not None and attn.added_kv_proj_dim is not None:  # dual-stream block
            txt_q, txt_k, txt_v = heads(txt_q), heads(txt_k), heads(txt_v)
            txt_q, txt_k = norm_qk(attn, txt_q, txt_k, added=True)
            if image_rotary_emb is not None:
                txt_emb, img_emb = _split_tables(image_rotary_emb, txt_q.shape[1])
                q, k = rotate_qk(q, k, img_emb)
                txt_q, txt_k = rotate_qk(txt_q, txt_k, txt_emb)
            img_out, txt_out = self.attn_fn(q, k, v, joint=JointTokens(txt_q, txt_k, txt_v, None, True))
            img_out = attn.to_out[0](img_out.flatten(2, 3).to(q.dtype).contiguous())
            img_out = attn.to_out[1](img_out)
            txt_out = attn.to_add_out(txt_out.flatten(2, 3).to(txt_q.dtype).contiguous())
            return img_out, txt_out
        # single-stream block: [text, image] rows, split at the text length of this call
        if not isinstance(image_rotary_emb, FluxRope):
            if type(self.attn_fn) is not DenseAttention:
                raise ValueError("a Flux single-stream block needs lite_boost's cached RoPE (FluxRope) to tell its "
                                 "text rows from its image rows under sequence parallelism or sparse attention; got "
                                 f"{type(image_rotary_emb).__name__}")
            if image_rotary_emb is not None:
                q, k = rotate_qk(q, k, _phasors(image_rotary_emb))
            return self.attn_fn(q, k, v).flatten(2, 3).to(q.dtype)
        t = image_rotary_emb.text.freqs.shape[1]
        txt_q, txt_k = rotate_qk(q[:, :t], k[:, :t], image_rotary_emb.text)
        img_q, img_k = rotate_qk(q[:, t:], k[:, t:], image_rotary_emb.image)
        if type(self.attn_fn) is DenseAttention:
            # dense, one process: the joint attention over [text, image] is self-attention over the rows
            # as they are. Eagerly the rotation wrote q and k in place (no copies into two streams and
            # back); traced it is functional and the rows are put together again (fused by inductor).
            if torch.compiler.is_compiling():
                q, k = torch.cat([txt_q, img_q], dim=1), torch.cat([txt_k, img_k], dim=1)
            return self.attn_fn(q, k, v).flatten(2, 3).to(q.dtype)
        img_out, txt_out = self.attn_fn(img_q, img_k, v[:, t:], joint=JointTokens(txt_q, txt_k, v[:, :t], None, True))
        return torch.cat([txt_out.to(q.dtype), img_out.to(q.dtype)], dim=1).flatten(2, 3)


def _phasors(emb) -> torch.Tensor:
    """complex64 (S, D/2) table of diffusers' interleaved (cos, sin) tables."""
    cos, sin = emb
    return torch.complex(cos[:, 0::2].float(), sin[:, 1::2].float())


def _split_tables(emb, text_len: int):
    """(text, image) tables of a :class:`FluxRope` or of diffusers' tables of the whole [text, image] sequence."""
    if isinstance(emb, FluxRope):
        return emb.text, emb.image
    freqs = _phasors(emb)
    return freqs[:text_len], freqs[text_len:]


class CachedFluxRope(CachedRope):
    """Replacement ``forward`` of a ``FluxPosEmbed``: cached phasors for (text rows, image rows of this rank).

    The tables are the module's own (``type(rope).forward`` on the same ids: float64 angles, fp32
    cos / sin), converted once per (text ids, image ids, device, row range) into
    :class:`~lite_boost.ops.rope.RotaryEmbedding` form. The ids are the caller's ``txt_ids`` and
    ``img_ids`` of the transformer call in progress (``BoostState.call``), keyed by identity and
    version, so no device value is read. Called outside a transformer call, or with ids that are
    not that call's, it returns diffusers' (cos, sin) tables.
    """

    def __call__(self, ids: torch.Tensor):
        state = self.state
        call = state.call
        txt, img = (call.txt_ids, call.img_ids) if isinstance(call, FluxCall) else (None, None)
        if not (isinstance(txt, torch.Tensor) and isinstance(img, torch.Tensor)) \
                or txt.shape[0] + img.shape[0] != ids.shape[0]:
            return self.original(ids)
        t, s = txt.shape[0], img.shape[0]
        start, stop = state.serve_range(s)

        def build():
            cos, sin = self.original(ids)
            return FluxRope(phasors_from_cos_sin(cos[:t], sin[:t]), phasors_from_cos_sin(cos[t:], sin[t:], start, stop))

        if torch.compiler.is_compiling():
            return build()
        keys = tensor_keys(state)
        return self.cached(("flux", keys(txt), keys(img), str(ids.device), start, stop), build)


def _is_flux_rope(rope) -> bool:
    from diffusers.models.transformers.transformer_flux import FluxPosEmbed

    return isinstance(rope, FluxPosEmbed)


# ----------------------------------------------------------------------------------------- token grid
_GRIDS = "flux_grids"


def _token_grid(model, args, kwargs):
    """(images, h, w) of this call's image tokens from its ``img_ids``; None runs the call dense.

    The ids are read in eager code only (once per ids tensor and version); a whole-model compiled
    graph runs dense (compile the blocks, diffusers' ``compile_repeated_blocks``, to keep sparse).
    """
    if torch.compiler.is_compiling():
        return None
    state = model._lite_boost
    img = _ids2d(call_arg(args, kwargs, "img_ids", 4))
    if not isinstance(img, torch.Tensor):
        return None
    memo = state.extras.setdefault(_GRIDS, {})
    key = tensor_keys(state)(img)
    if key not in memo:
        if len(memo) >= 8:
            memo.pop(next(iter(memo)))
        memo[key] = raster_grid(img)
    return memo[key]


_output_shape = packed_output_shape  # (B, image tokens, patch * patch * out_channels)


FLUX_SHARDING_PLAN = ShardingPlan(
    split_inputs=(
        SplitInput("", "controlnet_block_samples", dim=1),  # ControlNet residuals (lists of image-token tensors)
        SplitInput("", "controlnet_single_block_samples", dim=1),
        SplitInput("transformer_blocks.0", "hidden_states", dim=1),  # image tokens after x_embedder
    ),
    gather_outputs=(GatherOutput("proj_out", dim=1),),
    rope_range="rope_range",
    text="replicate",  # any text length: the single blocks split [text, image shard] at the text length
)

FLUX_PIPELINE_PLAN = PipelinePlan(
    transformers=("transformer",),
    cfg=CfgPlan(flag=None, encodes="encode_prompt", call_start="check_inputs", by_call_order=True,
                output_shape=_output_shape),
    prepare_latents="prepare_latents",
    without_cfg=("FluxControlPipeline", "FluxControlImg2ImgPipeline", "FluxControlInpaintPipeline", "FluxFillPipeline"),
)

_PIPELINES = ("FluxPipeline", "FluxImg2ImgPipeline", "FluxInpaintPipeline", "FluxKontextPipeline",
              "FluxKontextInpaintPipeline", "FluxControlPipeline", "FluxControlImg2ImgPipeline",
              "FluxControlInpaintPipeline", "FluxFillPipeline")

# Pyramid Attention Broadcast keeps one attention cache for the cond and uncond passes, as stock
# diffusers does (Flux's two passes have one text length, so it runs; refused with cfg_degree 2).
FLUX_CACHE_ADAPTER = CacheAdapter(
    methods=("first_block_cache", "mag_cache", "taylorseer_cache", "pyramid_attention_broadcast"),
    why_not={"faster_cache": separate_passes_why_not("Flux"), "sea_cache": SEA_CACHE_WHY_NOT},
    probe_module="x_embedder",
    timestep_scale=1000.0,  # the pipelines pass timestep / 1000
    refuse_pipelines={p: "it calls the transformer without cache_context, which diffusers' cache hooks need to keep "
                         "the passes apart (stock diffusers fails there too)" for p in _PIPELINES if p != "FluxPipeline"},
)

FLUX = register_family(ModelFamily(
    name="flux",
    output="image", cfg_argument="true_cfg_scale",
    transformers=("FluxTransformer2DModel",),
    pipelines=_PIPELINES,
    attention=(AttentionSite("transformer_blocks.*.attn", FluxAttnProcessor, role="joint"),
               AttentionSite("single_transformer_blocks.*.attn", FluxAttnProcessor, role="joint",
                             layer_offset=lambda model: len(model.transformer_blocks))),
    joint="text_first",
    rope=RopeSource("pos_embed", CachedFluxRope, matches=_is_flux_rope),
    call_context=_call_context,
    token_grid=_token_grid,
    timestep_module="time_text_embed",
    sharding=FLUX_SHARDING_PLAN,
    pipeline=FLUX_PIPELINE_PLAN,
    cache=FLUX_CACHE_ADAPTER,
    quant_patterns=("transformer_blocks.*", "single_transformer_blocks.*"),
    notes="text replicated on every rank (dual and single blocks exchange only the image tokens); parallel VAE: row "
          "bands per rank (exact; models/flux_vae.py: halo rows per 3x3 conv, GroupNorm statistics merged over the "
          "bands, the mid-block attention gathered)",
))

boost_flux_transformer = FLUX.boost_transformer
boost_flux_pipeline = FLUX.boost_pipeline
