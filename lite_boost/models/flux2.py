"""Flux.2 (``Flux2Transformer2DModel``: Flux.2 [dev], Flux.2 [klein]) on the adapter layer.

What varies for this family, as data (:data:`FLUX2`) plus two processor shims and one RoPE shim:

* attention: dual-stream blocks (``transformer_blocks.*.attn``, ``Flux2Attention``) attend [text, image]
  jointly, image through ``to_q/k/v``, text through ``add_q/k/v_proj``; single-stream blocks
  (``single_transformer_blocks.*.attn``, ``Flux2ParallelSelfAttention``) get the [text, image]
  concatenation the model made, with one fused projection for q, k, v and the MLP input and one for
  the attention and MLP outputs. :class:`Flux2AttnProcessor` and :class:`Flux2SingleAttnProcessor`
  keep diffusers' projections, norms and MLP and hand the attention to ``attn_fn`` with the text as
  ``joint=JointTokens(...)``. A single block splits its rows at the text length of the call, which
  :func:`_call_args` passes as ``joint_attention_kwargs["num_txt_tokens"]`` (as diffusers' own KV path
  does), so under sequence parallelism only the image shard enters the all_to_all.
* RoPE: ``pos_embed`` is called once on ``img_ids`` and once on ``txt_ids`` (4 axes: t, h, w, layer;
  float64 angles) and the model concatenates the (cos, sin) tables [text, image]. :class:`CachedFlux2Rope`
  returns the cached fp32 phasors as a (table, empty) pair that the model's concatenation keeps whole:
  all text rows, and the image rows of this rank. Which call is which: the ids are the caller's own
  tensors (or the model's first-sample views of them), kept as ``BoostState.call``; cached by identity
  and version.
* reference-image KV caching (``kv_cache_mode``, Flux.2 [klein] KV): diffusers' KV processors run it on
  one process with dense attention; refused under sequence parallelism and sparse attention. Processors set
  on the sites after boosting (Flux2KleinKVPipeline sets diffusers' KV processors block by block) get
  diffusers' own (cos, sin) RoPE tables: the call then skips the cached form.
* sequence parallelism: image tokens split at ``transformer_blocks.0``, text replicated (any length),
  gathered after ``proj_out``; the modulation is one vector per sample (nothing per token to split).
* CFG: Flux.2 [dev] (``Flux2Pipeline``) is guidance-distilled (no CFG); Flux.2 [klein] runs two
  transformer calls (``cache_context("cond" / "uncond")``) while ``do_classifier_free_guidance``.
* token grid for sparse windows: (images, h, w) read from ``img_ids`` (target + reference images of one
  size), in eager code only.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..adapter import (AttentionSite, DenseAttention, LiteBoostProcessor, ModelFamily, RopeSource, TinyPipeline,
                       rotate_qk)
from ..adapter.shims import (SEA_CACHE_WHY_NOT, CachedRope, call_arg, norm_qk, packed_output_shape, raster_grid,
                             separate_passes_why_not, tensor_keys)
from ..cache import CacheAdapter
from ..ops.joint import JointTokens
from ..ops.rope import phasors_from_cos_sin
from ..parallel.plan import CfgPlan, GatherOutput, PipelinePlan, ShardingPlan, SplitInput
from ..registry import register_family

__all__ = ["FLUX2", "Flux2AttnProcessor", "Flux2SingleAttnProcessor", "CachedFlux2Rope", "FLUX2_SHARDING_PLAN",
           "FLUX2_PIPELINE_PLAN", "FLUX2_CACHE_ADAPTER", "boost_flux2_transformer", "boost_flux2_pipeline"]

# Flux2Transformer2DModel.forward's arguments in order (positional ones become keywords in _call_args)
_ARGS = ("hidden_states", "encoder_hidden_states", "timestep", "img_ids", "txt_ids", "guidance",
         "joint_attention_kwargs", "return_dict")


class Flux2Call(NamedTuple):
    """The ids of a Flux.2 transformer call in progress (``BoostState.call``): the caller's tensors."""

    txt_ids: torch.Tensor | None
    img_ids: torch.Tensor | None


def _call_args(model, args, kwargs):
    """Keywords only, and the text length for the single-stream processors in ``joint_attention_kwargs``
    (no tensor op: the hook adds nothing to a compiled graph)."""
    kwargs = {**dict(zip(_ARGS, args)), **kwargs}
    text = kwargs.get("encoder_hidden_states")
    if isinstance(text, torch.Tensor):
        kwargs["joint_attention_kwargs"] = {**(kwargs.get("joint_attention_kwargs") or {}),
                                            "num_txt_tokens": text.shape[1]}
    return (), kwargs


def _foreign_processors(model) -> bool:
    """Whether an attention site runs a processor set on it after boosting (``attn.set_processor``, as
    Flux2KleinKVPipeline does with diffusers' KV processors): those read diffusers' (cos, sin) tables."""
    state = getattr(model, "_lite_boost", None)
    return state is not None and any(model.get_submodule(name).processor is not proc
                                     for name, proc in state.processors.items())


def _call_context(model, args, kwargs) -> Flux2Call | None:
    """The call's ids; None (diffusers' own RoPE tables, which lite_boost's processors read too) when a site runs
    a processor of its own (checked in eager code; a compiled whole model assumes lite_boost's processors)."""
    if not torch.compiler.is_compiling() and _foreign_processors(model):
        return None
    return Flux2Call(kwargs.get("txt_ids"), kwargs.get("img_ids"))


def _which(ids: torch.Tensor, call, state) -> str | None:
    """"image" or "text" when ``ids`` are the call's image or text ids, else None (diffusers' own tables).

    Eagerly: the caller's tensor or the model's first-sample view of it (same storage, offset and strides). Traced (identity of views is not
    reliable there): by row count; equal text and image lengths need no telling apart on one process (the
    image rows are all rows) and are refused under sequence parallelism.
    """
    if not isinstance(call, Flux2Call) or call.img_ids is None or call.txt_ids is None:
        return None
    if not torch.compiler.is_compiling():
        for name, caller in (("image", call.img_ids), ("text", call.txt_ids)):
            if ids is caller or (caller.ndim == 3 and ids.untyped_storage().data_ptr()
                                 == caller.untyped_storage().data_ptr()
                                 and ids.storage_offset() == caller.storage_offset()
                                 and ids.shape == caller.shape[1:] and ids.stride() == caller.stride()[1:]):
                return name  # the caller's tensor, or caller[0] (the model's view of 3-D ids)
        return None
    n, n_img, n_txt = ids.shape[0], call.img_ids.shape[-2], call.txt_ids.shape[-2]
    if n_img == n_txt == n and state.serve_range(n) != (0, n):
        raise ValueError("a compiled Flux.2 transformer under sequence parallelism cannot tell text ids from image "
                         f"ids of one length ({n}); compile the blocks (compile_repeated_blocks) instead")
    return "image" if n == n_img else "text" if n == n_txt else None


def _table(emb) -> torch.Tensor:
    """complex64 (S, D/2) phasors of the [text, image] rows: the cached form, or diffusers' (cos, sin) tables."""
    first = emb[0]
    if first.is_complex():
        return first
    return torch.complex(first[:, 0::2].float(), emb[1][:, 1::2].float())


def _cos_sin(emb):
    """diffusers' interleaved (cos, sin) tables of either form (for diffusers' own KV processors)."""
    if not emb[0].is_complex():
        return emb
    return emb[0].real.repeat_interleave(2, -1), emb[0].imag.repeat_interleave(2, -1)


def _kv_stock(proc, kind: str, kv_cache_mode):
    if type(proc.attn_fn) is not DenseAttention:
        raise ValueError(f"kv_cache_mode={kv_cache_mode!r} (Flux.2 reference-image KV caching) runs on one process "
                         "with dense attention only; it is not supported with sequence parallelism or sparse attention")
    from diffusers.models.transformers import transformer_flux2 as tf2

    return getattr(tf2, kind)()


def _heads(attn, *xs):
    return tuple(x.unflatten(-1, (-1, attn.head_dim)) for x in xs)


class Flux2AttnProcessor(LiteBoostProcessor):
    """Joint attention of a ``Flux2TransformerBlock`` (diffusers' ``Flux2AttnProcessor`` semantics);
    returns ``(image_out, text_out)``."""

    def __call__(self, attn, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, image_rotary_emb=None, kv_cache=None,
                 kv_cache_mode: str | None = None, num_ref_tokens: int = 0, num_txt_tokens: int | None = None):
        if kv_cache_mode is not None:
            return _kv_stock(self, "Flux2KVAttnProcessor", kv_cache_mode)(
                attn, hidden_states, encoder_hidden_states, attention_mask,
                None if image_rotary_emb is None else _cos_sin(image_rotary_emb),
                kv_cache=kv_cache, kv_cache_mode=kv_cache_mode, num_ref_tokens=num_ref_tokens)
        if attention_mask is not None:
            raise ValueError("Flux2AttnProcessor (lite_boost) does not accept attention_mask: Flux.2 attends every "
                             "text and image token")
        if encoder_hidden_states is None or attn.added_kv_proj_dim is None:
            raise ValueError("Flux2AttnProcessor needs encoder_hidden_states and the text projections (a dual-stream "
                             "block)")
        from diffusers.models.transformers.transformer_flux2 import _get_qkv_projections

        q, k, v, txt_q, txt_k, txt_v = _heads(attn, *_get_qkv_projections(attn, hidden_states, encoder_hidden_states))
        q, k = norm_qk(attn, q, k)
        txt_q, txt_k = norm_qk(attn, txt_q, txt_k, added=True)
        if image_rotary_emb is not None:
            table, t = _table(image_rotary_emb), txt_q.shape[1]
            txt_q, txt_k = rotate_qk(txt_q, txt_k, table[:t])
            q, k = rotate_qk(q, k, table[t:])
        img_out, txt_out = self.attn_fn(q, k, v, joint=JointTokens(txt_q, txt_k, txt_v, None, True))
        img_out = attn.to_out[1](attn.to_out[0](img_out.flatten(2, 3).to(q.dtype).contiguous()))
        txt_out = attn.to_add_out(txt_out.flatten(2, 3).to(txt_q.dtype).contiguous())
        return img_out, txt_out


class Flux2SingleAttnProcessor(LiteBoostProcessor):
    """Attention and MLP of a ``Flux2SingleTransformerBlock`` (diffusers' ``Flux2ParallelSelfAttnProcessor``
    semantics) over the block's [text, image] rows, split at ``num_txt_tokens``."""

    def __call__(self, attn, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 image_rotary_emb=None, kv_cache=None, kv_cache_mode: str | None = None,
                 num_txt_tokens: int | None = None, num_ref_tokens: int = 0):
        if kv_cache_mode is not None:
            return _kv_stock(self, "Flux2KVParallelSelfAttnProcessor", kv_cache_mode)(
                attn, hidden_states, attention_mask, None if image_rotary_emb is None else _cos_sin(image_rotary_emb),
                kv_cache=kv_cache, kv_cache_mode=kv_cache_mode, num_txt_tokens=num_txt_tokens or 0,
                num_ref_tokens=num_ref_tokens)
        if attention_mask is not None:
            raise ValueError("Flux2SingleAttnProcessor (lite_boost) does not accept attention_mask: Flux.2 attends "
                             "every text and image token")
        dense = type(self.attn_fn) is DenseAttention
        if num_txt_tokens is None and not dense:
            raise ValueError("a Flux.2 single-stream block needs num_txt_tokens (set by lite_boost for a boosted "
                             "transformer call) to tell its text rows from its image rows under sequence parallelism "
                             "or sparse attention")
        proj = attn.to_qkv_mlp_proj(hidden_states)
        qkv_dim, mlp_dim = 3 * attn.inner_dim, attn.mlp_hidden_dim * attn.mlp_mult_factor
        local_qkv = proj.shape[-1] * qkv_dim // (qkv_dim + mlp_dim)
        qkv, mlp = torch.split(proj, [local_qkv, proj.shape[-1] - local_qkv], dim=-1)
        q, k, v = _heads(attn, *qkv.chunk(3, dim=-1))
        q, k = norm_qk(attn, q, k)
        if image_rotary_emb is not None:  # one table for the [text, image] rows as they are
            q, k = rotate_qk(q, k, _table(image_rotary_emb))
        if dense:  # one process, dense: joint attention over [text, image] is self-attention over the rows
            out = self.attn_fn(q, k, v)
        else:
            t = num_txt_tokens
            img_out, txt_out = self.attn_fn(q[:, t:], k[:, t:], v[:, t:],
                                            joint=JointTokens(q[:, :t], k[:, :t], v[:, :t], None, True))
            out = torch.cat([txt_out.to(q.dtype), img_out.to(q.dtype)], dim=1)
        out = torch.cat([out.flatten(2, 3).to(q.dtype), attn.mlp_act_fn(mlp)], dim=-1)
        return attn.to_out(out)


class CachedFlux2Rope(CachedRope):
    """Replacement ``forward`` of a ``Flux2PosEmbed``: cached fp32 phasors of the call's text ids (all rows)
    or image ids (this rank's rows), as ``(table (rows, D/2) complex64, empty)``.

    The tables are the module's own (``type(rope).forward`` on the same ids: float64 angles, fp32 cos /
    sin), converted once per (ids, device, row range). Called with ids that are not the transformer
    call's own, it returns diffusers' (cos, sin) tables.
    """

    def __call__(self, ids: torch.Tensor):
        state = self.state
        call = state.call
        which = _which(ids, call, state)
        if which is None:
            return self.original(ids)
        start, stop = state.serve_range(ids.shape[0]) if which == "image" else (0, ids.shape[0])

        def build():
            cos, sin = self.original(ids)
            freqs = phasors_from_cos_sin(cos, sin, start, stop).freqs[0, :, 0]
            return freqs, freqs[:0]

        if torch.compiler.is_compiling():
            return build()
        base = ids._base if ids._base is not None else ids  # the caller's 3-D ids, of which ids is a view
        key = (tensor_keys(state)(base), ids.storage_offset(), tuple(ids.shape), tuple(ids.stride()))
        return self.cached(("flux2", key, str(ids.device), start, stop), build)


def _is_flux2_rope(rope) -> bool:
    from diffusers.models.transformers.transformer_flux2 import Flux2PosEmbed

    return isinstance(rope, Flux2PosEmbed) and type(rope).forward is Flux2PosEmbed.forward


_GRIDS = "flux2_grids"


def _token_grid(model, args, kwargs):
    """(images, h, w) of this call's image tokens from its ``img_ids`` (t, h, w, layer); None runs it dense.

    Read in eager code only (once per ids tensor and version); a whole-model compiled graph runs dense.
    """
    img = call_arg(args, kwargs, "img_ids", 3)
    if torch.compiler.is_compiling() or not isinstance(img, torch.Tensor):
        return None
    img = img[0] if img.ndim == 3 else img
    memo = model._lite_boost.extras.setdefault(_GRIDS, {})
    base = img._base if img._base is not None else img
    key = (tensor_keys(model._lite_boost)(base), img.storage_offset(), tuple(img.shape))
    if key not in memo:
        if len(memo) >= 8:
            memo.pop(next(iter(memo)))
        memo[key] = raster_grid(img, columns=(0, 1, 2))
    return memo[key]


FLUX2_SHARDING_PLAN = ShardingPlan(
    split_inputs=(SplitInput("transformer_blocks.0", "hidden_states", dim=1),),  # image tokens after x_embedder
    gather_outputs=(GatherOutput("proj_out", dim=1),),
    rope_range="rope_range",
    text="replicate",  # any text length: the single blocks split [text, image shard] at num_txt_tokens
)

_PIPELINES = ("Flux2Pipeline", "Flux2KleinPipeline", "Flux2KleinInpaintPipeline")

FLUX2_PIPELINE_PLAN = PipelinePlan(
    transformers=("transformer",),
    cfg=CfgPlan(flag="do_classifier_free_guidance", output_shape=packed_output_shape),
    prepare_latents="prepare_latents",
    without_cfg=("Flux2Pipeline",),  # guidance-distilled: the guidance scale is an embedding
)

FLUX2_CACHE_ADAPTER = CacheAdapter(
    methods=("mag_cache", "taylorseer_cache"),
    why_not={"faster_cache": separate_passes_why_not("Flux.2 [klein]"), "sea_cache": SEA_CACHE_WHY_NOT,
             "first_block_cache": "diffusers' hook takes the single-stream tail's output for a tuple on Flux.2 (stock "
                                  "diffusers fails there too)",
             "pyramid_attention_broadcast": "not yet checked against diffusers' hook on Flux.2"},
    probe_module="x_embedder",
    timestep_scale=1000.0,  # the pipelines pass timestep / 1000
    refuse_pipelines={"Flux2Pipeline": "it calls the transformer without cache_context, which diffusers' cache hooks "
                                       "need (stock diffusers fails there too)"},
)

FLUX2 = register_family(ModelFamily(
    name="flux2",
    output="image", cfg_argument="guidance_scale",
    transformers=("Flux2Transformer2DModel",),
    pipelines=_PIPELINES,
    attention=(AttentionSite("transformer_blocks.*.attn", Flux2AttnProcessor, role="joint"),
               AttentionSite("single_transformer_blocks.*.attn", Flux2SingleAttnProcessor, role="joint",
                             layer_offset=lambda model: len(model.transformer_blocks))),
    joint="text_first",
    rope=RopeSource("pos_embed", CachedFlux2Rope, matches=_is_flux2_rope),
    call_args=_call_args,
    call_context=_call_context,
    token_grid=_token_grid,
    timestep_module="time_guidance_embed",
    sharding=FLUX2_SHARDING_PLAN,
    pipeline=FLUX2_PIPELINE_PLAN,
    cache=FLUX2_CACHE_ADAPTER,
    quant_patterns=("transformer_blocks.*", "single_transformer_blocks.*"),
    notes="text replicated on every rank; Flux.2 [dev] is guidance-distilled (no CFG); reference-image KV caching "
          "(Flux.2 [klein] KV) on one process only; parallel VAE: row bands per rank (exact; models/flux_vae.py: "
          "halo rows per 3x3 conv, GroupNorm statistics merged over the bands, the mid-block attention gathered)",
    # `lite-boost generate --family flux2`: 64 x 64 px = 1,024 image tokens, random prompt embeddings (no text
    # encoder), 10 steps, dense (lite_boost.demo.DEMO_FLUX2_*)
    tiny={"t2i": TinyPipeline("Flux2KleinPipeline", builder="lite_boost.demo:demo_flux2_pipeline",
                              shape=(64, 64, None), steps=10, describe="lite_boost.demo:describe_flux2_demo",
                              prompt="lite_boost.demo:flux2_demo_prompt")},
))

boost_flux2_transformer = FLUX2.boost_transformer
boost_flux2_pipeline = FLUX2.boost_pipeline
