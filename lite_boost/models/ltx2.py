"""LTX-2 (``LTX2VideoTransformer3DModel``: joint audio + video) on the adapter layer.

Pipelines: ``LTX2Pipeline``, ``LTX2ImageToVideoPipeline`` (the other LTX-2 pipelines are not claimed: untested here,
they take the generic path; their transformer alone is this family's). What varies, as data (:data:`LTX2`) plus one
processor shim and one RoPE shim:

* attention: every ``LTX2VideoTransformerBlock`` has six ``LTX2Attention`` modules: video self-attention
  ``attn1`` (role "self": dense dispatch, block-sparse, Ulysses / Ring), audio self-attention ``audio_attn1``,
  the text cross-attentions ``attn2`` / ``audio_attn2`` (additive text bias), audio-to-video
  ``audio_to_video_attn`` (queries video, keys audio) and video-to-audio ``video_to_audio_attn`` (queries audio,
  keys video: role "split_kv"). :class:`LTX2AttnProcessor` reproduces diffusers' ``LTX2AudioVideoAttnProcessor``
  and ``LTX2PerturbedAttnProcessor`` (per-head gates, STG perturbation), q / k RMS-normed across heads and
  rotated before the head split.
* RoPE: four ``LTX2AudioVideoRotaryPosEmbed`` modules (video ``rope``, ``audio_rope``, and the
  cross-attention ``cross_attn_rope`` / ``cross_attn_audio_rope`` on the time axis only) turn coordinates
  (B, axes, S, 2) into per-sample tables, "interleaved" (B, S, dim) or "split" (B, heads, S, dim / heads / 2).
  :class:`CachedLTX2Rope` computes them with the module's own forward for the rows served and keeps them in
  fp32 (phasors, or split cos / sin), cached per coordinate tensor (identity and version; the pipelines pass
  the same ``video_coords`` / ``audio_coords`` every step) or, when the model builds the coordinates itself,
  per (batch, grid, fps / audio frames). The two video modules serve this rank's rows; the audio ones all rows.
* sequence parallelism: the video tokens are split at the transformer's input (per-token timesteps and
  key-frame marks with them), gathered after ``proj_out``; the audio stream (a few dozen tokens per second)
  stays whole on every rank: audio self- and text attention run locally, audio-to-video attends this rank's
  video rows to all audio keys, and video-to-audio attends all audio queries to this rank's video keys, merged
  exactly over the sequence group (:class:`~lite_boost.parallel.split_kv.SplitKeysAttention`), so the audio
  output is the same on every rank. Both video RoPE modules serve the same rows, so the cross-attention
  rotation always matches the tokens it rotates (diffusers' ``_cp_plan`` splits ``rope`` only).
* CFG: batched (B = 2 inside ``cache_context("cond_uncond")``); with cfg degree 2 each cfg rank runs its half
  and both outputs (video, audio) are gathered. The extra STG / modality-isolation calls (B = 1) run whole.
* token grid for sparse windows: the latent (frames, height, width) of the call's patches; calls whose token
  count differs (condition tokens in front) run dense. Audio tokens never enter a sparse window.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ..adapter import AttentionSite, LiteBoostProcessor, ModelFamily, RopeSource, TinyPipeline
from ..adapter.shims import SEA_CACHE_WHY_NOT, CachedRope, call_arg, patch_grid, patch_size, tensor_keys
from ..cache import CacheAdapter
from ..ops.attention import attention
from ..ops.rope import RotaryEmbedding, rotate
from ..parallel.plan import CfgPlan, GatherOutput, PipelinePlan, ShardingPlan, SplitInput
from ..registry import register_family

__all__ = ["LTX2", "LTX2AttnProcessor", "CachedLTX2Rope", "SplitRope", "LTX2_SHARDING_PLAN", "LTX2_PIPELINE_PLAN",
           "LTX2_CACHE_ADAPTER", "boost_ltx2_transformer", "boost_ltx2_pipeline"]

# positions in LTX2VideoTransformer3DModel.forward
_ARGS = {"hidden_states": 0, "audio_hidden_states": 1, "num_frames": 10, "height": 11, "width": 12, "fps": 13,
         "audio_num_frames": 14, "video_coords": 15, "audio_coords": 16}


def _arg(args, kwargs, name):
    return call_arg(args, kwargs, name, _ARGS[name])


class SplitRope(NamedTuple):
    """fp32 tables of diffusers' "split" RoPE for rows [start, stop): cos / sin (B, rows, heads, r), rotating
    channel j with channel j + r of each head's 2r channels."""

    cos: torch.Tensor
    sin: torch.Tensor


def _rotate(x: torch.Tensor, emb, rope_type: str) -> torch.Tensor:
    """Rotate fresh q or k (B, S, inner) by the cached tables (or by diffusers' own tuple)."""
    if isinstance(emb, RotaryEmbedding):  # interleaved pairs over the whole inner dimension, rotated in place
        return rotate(x.unsqueeze(2), emb.freqs, inplace=True).squeeze(2)
    if isinstance(emb, SplitRope):
        heads, r = emb.cos.shape[-2:]
        x1, x2 = x.float().unflatten(-1, (heads, 2, r)).unbind(-2)
        c, s = emb.cos, emb.sin
        return torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-2).flatten(2).to(x.dtype)
    from diffusers.models.transformers.transformer_ltx2 import apply_interleaved_rotary_emb, apply_split_rotary_emb

    return (apply_interleaved_rotary_emb if rope_type == "interleaved" else apply_split_rotary_emb)(x, emb)


class LTX2AttnProcessor(LiteBoostProcessor):
    """Any ``LTX2Attention`` with the semantics of diffusers' ``LTX2AudioVideoAttnProcessor`` (and of
    ``LTX2PerturbedAttnProcessor`` when the block passes a perturbation)."""

    def __call__(self, attn, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, query_rotary_emb=None, key_rotary_emb=None,
                 perturbation_mask: torch.Tensor | None = None, all_perturbed=None) -> torch.Tensor:
        context = hidden_states if encoder_hidden_states is None else encoder_hidden_states
        gate_logits = attn.to_gate_logits(hidden_states) if attn.to_gate_logits is not None else None
        value = attn.to_v(context)
        if all_perturbed is None:
            all_perturbed = torch.all(perturbation_mask == 0) if perturbation_mask is not None else False
        if all_perturbed:  # STG: the values stand in for the attention
            out = value
        else:
            query = attn.norm_q(attn.to_q(hidden_states))
            key = attn.norm_k(attn.to_k(context))
            if query_rotary_emb is not None:
                query = _rotate(query, query_rotary_emb, attn.rope_type)
                key = _rotate(key, key_rotary_emb if key_rotary_emb is not None else query_rotary_emb, attn.rope_type)
            q, k, v = (x.unflatten(2, (attn.heads, -1)) for x in (query, key, value))
            if attention_mask is not None:  # text bias (B, 1, T) or a video self-attention bias (B, S, S)
                batch, length = context.shape[:2]
                if attention_mask.shape[-1] != length:
                    raise ValueError(f"an attention mask over {attention_mask.shape[-1]} keys meets {length} local keys: "
                                     "LTX-2's video_self_attention_mask is not supported under sequence parallelism")
                mask = attn.prepare_attention_mask(attention_mask, length, batch).view(batch, attn.heads, -1, length)
                out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                     attn_mask=mask.to(q.dtype)).transpose(1, 2)
            elif self.role in ("self", "split_kv"):
                out = self.attn_fn(q, k, v)
            else:  # audio self-attention, audio-to-video: keys every rank holds whole
                out = attention(q, k, v, layout="BSND", backend=self.backend)
            out = out.flatten(2, 3).to(query.dtype)
            if perturbation_mask is not None:
                out = torch.lerp(value, out, perturbation_mask)
        if gate_logits is not None:
            out = (out.unflatten(2, (attn.heads, -1)) * (2.0 * torch.sigmoid(gate_logits)).unsqueeze(-1)).flatten(2, 3)
        return attn.to_out[1](attn.to_out[0](out))


# ------------------------------------------------------------------------------------------------- RoPE
class LTX2Call(NamedTuple):
    """What the RoPE shims read of the transformer call in progress (``BoostState.call``)."""

    batch: int
    video_coords: torch.Tensor | None  # the caller's tensors (None: the model builds them from the grid)
    audio_coords: torch.Tensor | None
    grid: tuple  # (num_frames, height, width, fps)
    audio_frames: object


def _call_context(model, args, kwargs) -> LTX2Call:
    hidden = _arg(args, kwargs, "hidden_states")
    fps = _arg(args, kwargs, "fps")
    return LTX2Call(hidden.shape[0], _arg(args, kwargs, "video_coords"), _arg(args, kwargs, "audio_coords"),
                    tuple(_arg(args, kwargs, n) for n in ("num_frames", "height", "width")) + (24.0 if fps is None else fps,),
                    _arg(args, kwargs, "audio_num_frames"))


def _pad_rows(t: torch.Tensor, dim: int, rows: int, value: float) -> torch.Tensor:
    if t.shape[dim] >= rows:
        return t
    shape = list(t.shape)
    shape[dim] = rows - t.shape[dim]
    return torch.cat([t, t.new_full(shape, value)], dim=dim)


def _tables(rope, cos: torch.Tensor, sin: torch.Tensor, rows: int, start: int, stop: int, seq_len: int):
    """diffusers' tables of the served rows in the cached fp32 form; identity rows past the sequence end."""
    if rope.rope_type == "interleaved":  # (B, n, dim): pair i = (cos[2i], sin[2i + 1])
        freqs = torch.complex(cos[..., 0::2].float(), sin[..., 1::2].float())
        return RotaryEmbedding(_pad_rows(freqs, 1, rows, 1.0).unsqueeze(2).contiguous(), start, stop, seq_len)
    cos, sin = (_pad_rows(t.float().transpose(1, 2), 1, rows, v).contiguous() for t, v in ((cos, 1.0), (sin, 0.0)))
    return SplitRope(cos, sin)  # (B, rows, heads, r)


class CachedLTX2Rope(CachedRope):
    """Replacement ``forward`` of one ``LTX2AudioVideoRotaryPosEmbed`` (``stream``: "video" modules serve this
    rank's rows under sequence parallelism, "audio" modules all rows)."""

    stream = "video"
    name = "rope"

    def _key(self, coords, start, stop, device):
        call = self.state.call
        if call is None or coords.shape[0] != call.batch:
            return None
        given = call.video_coords if self.stream == "video" else call.audio_coords
        tail = (self.name, tuple(coords.shape), start, stop, str(device))
        if given is None:  # built by the model from the call's grid
            return ("grid", call.batch, call.grid if self.stream == "video" else call.audio_frames) + tail
        base = given._base if given._base is not None else given
        keys = tensor_keys(self.state)
        return ("coords", keys(base), given.storage_offset(), tuple(given.stride())) + tail

    def __call__(self, coords: torch.Tensor, device=None):
        seq_len = coords.shape[2]
        start, stop = self.state.serve_range(seq_len) if self.stream == "video" else (0, seq_len)
        device = device or coords.device

        def build():
            cos, sin = self.original(coords[:, :, start:min(stop, seq_len)], device)
            return _tables(self.rope, cos, sin, stop - start, start, stop, seq_len)

        if torch.compiler.is_compiling():
            return build()
        key = self._key(coords, start, stop, device)
        return build() if key is None else self.cached(key, build)


def _rope_shim(stream: str, name: str):
    return type(f"CachedLTX2Rope_{name}", (CachedLTX2Rope,), {"stream": stream, "name": name})


def _is_ltx2_rope(rope) -> bool:
    from diffusers.models.transformers.transformer_ltx2 import LTX2AudioVideoRotaryPosEmbed

    return isinstance(rope, LTX2AudioVideoRotaryPosEmbed) and type(rope).forward is LTX2AudioVideoRotaryPosEmbed.forward


# ------------------------------------------------------------------------------------------- token grid
def _token_grid(model, args, kwargs):
    """(frames, height, width) of the call's video patches; None when the token count differs (dense)."""
    sizes = tuple(_arg(args, kwargs, n) for n in ("num_frames", "height", "width"))
    hidden = _arg(args, kwargs, "hidden_states")
    patch = patch_size(getattr(model, "config", None))
    if any(not isinstance(s, int) for s in sizes) or hidden is None or patch is None:
        return None
    grid = patch_grid(sizes, patch)
    return grid if math.prod(grid) == hidden.shape[1] else None


LTX2_SHARDING_PLAN = ShardingPlan(
    split_inputs=(
        SplitInput("", "hidden_states", dim=1),  # packed video tokens (B, S, C)
        SplitInput("", "timestep", dim=1, ndim=2, broadcast=True),  # per-token video timesteps (I2V, condition)
        SplitInput("", "video_keyframes_mask", dim=1, ndim=3),  # (B, S, 1) key-frame marks
    ),
    gather_outputs=(GatherOutput("proj_out", dim=1),),  # the audio output is whole on every rank already
    rope_range="rope_range",
    text="replicate",
    split_kv_processors="split_kv_processors",  # video-to-audio: audio queries, this rank's video keys
)

_BATCH_ARGS = ("hidden_states", "audio_hidden_states", "encoder_hidden_states", "audio_encoder_hidden_states",
               "timestep", "audio_timestep", "sigma", "audio_sigma", "encoder_attention_mask",
               "audio_encoder_attention_mask", "video_coords", "audio_coords", "perturbation_mask",
               "video_self_attention_mask", "video_keyframes_mask")

LTX2_PIPELINE_PLAN = PipelinePlan(
    transformers=("transformer",),
    cfg=CfgPlan(kind="batched", cond="cond_uncond", flag="do_classifier_free_guidance", batch_args=_BATCH_ARGS),
    prepare_latents="prepare_latents",
)

_NOT_REGISTERED = ("diffusers registers no LTX2VideoTransformerBlock for its block-level hooks (stock diffusers "
                   "fails there too)")

LTX2_CACHE_ADAPTER = CacheAdapter(
    methods=("taylorseer_cache", "pyramid_attention_broadcast"),
    why_not={"first_block_cache": _NOT_REGISTERED, "mag_cache": _NOT_REGISTERED, "sea_cache": SEA_CACHE_WHY_NOT,
             "faster_cache": "diffusers' FasterCache supports no packed (B, S, C) latents"},
    probe_module="proj_in",
)

_SITES = (("attn1", "self"), ("audio_attn1", "cross"), ("attn2", "cross"), ("audio_attn2", "cross"),
          ("audio_to_video_attn", "cross"), ("video_to_audio_attn", "split_kv"))

LTX2 = register_family(ModelFamily(
    name="ltx2",
    output="video",
    transformers=("LTX2VideoTransformer3DModel",),
    pipelines=("LTX2Pipeline", "LTX2ImageToVideoPipeline"),
    attention=tuple(AttentionSite(f"transformer_blocks.*.{name}", LTX2AttnProcessor, role=role) for name, role in _SITES),
    joint="cross",
    rope=RopeSource("rope", _rope_shim("video", "rope"), matches=_is_ltx2_rope),
    ropes=(RopeSource("audio_rope", _rope_shim("audio", "audio_rope"), matches=_is_ltx2_rope),
           RopeSource("cross_attn_rope", _rope_shim("video", "cross_attn_rope"), matches=_is_ltx2_rope),
           RopeSource("cross_attn_audio_rope", _rope_shim("audio", "cross_attn_audio_rope"), matches=_is_ltx2_rope)),
    call_context=_call_context,
    token_grid=_token_grid,
    timestep_module="time_embed",
    sharding=LTX2_SHARDING_PLAN,
    pipeline=LTX2_PIPELINE_PLAN,
    cache=LTX2_CACHE_ADAPTER,
    quant_patterns=("transformer_blocks.*",),
    notes="video tokens split under sequence parallelism, the audio stream whole on every rank (video-to-audio "
          "attention merged over the ranks); CFG batched (B = 2); parallel VAE for the video VAE only",
    tiny={"t2v": TinyPipeline("LTX2Pipeline", builder="lite_boost.demo:demo_ltx2_pipeline", shape=(160, 224, 33),
                              steps=10, describe="lite_boost.demo:describe_ltx2_demo",
                              prompt="lite_boost.demo:ltx2_demo_prompt")},
))

boost_ltx2_transformer = LTX2.boost_transformer
boost_ltx2_pipeline = LTX2.boost_pipeline
