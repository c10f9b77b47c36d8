"""Wan Animate (``WanAnimatePipeline``, ``WanAnimateTransformer3DModel``): Wan2.1-I2V blocks driven by a pose
video and a face video.

The blocks' attention modules and RoPE module are diffusers' copies of Wan's, so the Wan family's processor
shim, cached RoPE and sharding plan apply as they are; the pose latents are added to the video tokens (frames
1..F) after the patch embedding, before the tokens are flattened and split, so they take no attention of their
own. The face adapter (``face_adapter.*``, after every ``inject_face_latents_blocks``-th block) attends each
video token to the motion tokens of its own latent frame (the motion vector, computed from the face video
before the blocks, every rank holds whole): it is per token, so :class:`LiteBoostWanAnimateFaceProcessor` runs
it on any contiguous run of tokens, given where that run starts in the whole sequence. Under sequence
parallelism that is this rank's shard (``BoostState.serve_range`` of the call's token count, which the
family's ``call_context`` reads off the latents); a shard may start and end mid-frame, and the padding rows
past the sequence's end are left out of the attention (the gather drops them).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..adapter import AttentionSite, LiteBoostProcessor, ModelFamily, RopeSource
from ..ops.attention import attention
from ..parallel.plan import CfgPlan, PipelinePlan
from ..registry import register_family
from .wan import (WAN, WAN_SHARDING_PLAN, WAN_TP_PLAN, CachedWanRope, _qkv, _rope_matches_cache, _token_grid,
                  wan_copy_cache_adapter)

__all__ = ["WAN_ANIMATE", "LiteBoostWanAnimateFaceProcessor"]


def _token_count(model, args, kwargs) -> int | None:
    """The call's ``call_context``: how many video tokens the whole sequence has (None without 5-D latents)."""
    grid = _token_grid(model, args, kwargs)
    return None if grid is None else math.prod(grid)


class LiteBoostWanAnimateFaceProcessor(LiteBoostProcessor):
    """Processor of a ``WanAnimateFaceBlockCrossAttention`` (the face adapter) with the semantics of diffusers'
    ``WanAnimateFaceBlockAttnProcessor``: each video token attends the N motion tokens of its latent frame.

    The video tokens it gets are the run [start, start + local) of the call's sequence (the whole sequence
    unless a sequence-parallel plan split it; ``state.serve_range`` says where): the tokens of frame f are the
    positions [f L, (f + 1) L), L = tokens / frames of the motion vector. The run is padded at both ends to
    whole frames, attended frame by frame (diffusers' layout), and cut back; positions at or past the end of
    the sequence (a shard's padding) stay out of the attention and come back as zeros.
    """

    def _run(self, local: int) -> tuple[int, int]:
        """(tokens of the whole sequence, position of the first of the ``local`` tokens given)."""
        state = self.state
        total = state.call if state is not None else None
        if not isinstance(total, int):  # outside a transformer call (the module called by itself): all of it
            return local, 0
        start, stop = state.serve_range(total)
        if stop - start != local:
            raise RuntimeError(f"face adapter {self.layer_idx}: got {local} video tokens, expected {stop - start} "
                               f"(positions [{start}, {stop}) of {total})")
        return total, start

    def __call__(self, attn, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        hidden_states = attn.pre_norm_q(hidden_states)
        motion = attn.pre_norm_kv(encoder_hidden_states)
        batch, frames, n, _ = motion.shape  # (B, T, N, C): N motion tokens per latent frame
        query, key, value = _qkv(attn, hidden_states, motion.flatten(1, 2))
        query = attn.norm_q(query.unflatten(2, (attn.heads, -1)))  # (B, local, H, D)
        key = attn.norm_k(key.view(batch, frames, n, attn.heads, -1))  # (B, T, N, H, D)
        value = value.view(batch, frames, n, attn.heads, -1)

        local = query.shape[1]
        total, start = self._run(local)
        if total % frames:
            raise ValueError(f"face adapter {self.layer_idx}: {total} video tokens do not split into the motion "
                             f"vector's {frames} frames")
        frame_len = total // frames
        real = max(0, min(local, total - start))  # tokens of this run before the end of the sequence
        if real == 0:  # a shard of padding only
            out = query.new_zeros(batch, local, query.shape[2] * query.shape[3])
        else:
            first = start // frame_len
            lead = start - first * frame_len  # tokens of frame `first` before the run
            span = -(-(lead + real) // frame_len)  # frames the run touches
            q = query[:, :real] if real < local else query
            if span * frame_len != real:
                q = F.pad(q, (0, 0, 0, 0, lead, span * frame_len - lead - real))
            if span < frames:
                key, value = key[:, first:first + span], value[:, first:first + span]
            out = attention(q.unflatten(1, (span, frame_len)).flatten(0, 1), key.flatten(0, 1),
                            value.flatten(0, 1), layout="BSND", backend=self.backend)  # (B * span, L, H, D)
            out = out.flatten(2, 3).type_as(query).unflatten(0, (batch, span)).flatten(1, 2)
            if span * frame_len != real:
                out = out[:, lead:lead + real]
            if real < local:
                out = F.pad(out, (0, 0, 0, local - real))
        out = attn.to_out(out)
        if attention_mask is not None:  # diffusers' multiplicative mask, applied as diffusers applies it
            out = out * attention_mask.flatten(start_dim=1)
        return out


WAN_ANIMATE = register_family(ModelFamily(
    name="wan-animate",
    transformers=("WanAnimateTransformer3DModel",),
    pipelines=("WanAnimatePipeline",),
    attention=WAN.attention + (AttentionSite("face_adapter.*", LiteBoostWanAnimateFaceProcessor, role="cross"),),
    joint="cross",
    rope=RopeSource("rope", CachedWanRope, matches=_rope_matches_cache),
    token_grid=_token_grid,
    timestep_module="condition_embedder",
    call_context=_token_count,
    sharding=WAN_SHARDING_PLAN,  # the face adapter runs on each rank's shard
    pipeline=PipelinePlan(cfg=CfgPlan()),
    tensor_parallel=WAN_TP_PLAN,  # the blocks' heads and FFN; the face adapter whole on every rank (full tokens)
    cache=wan_copy_cache_adapter("Wan Animate"),
    quant_patterns=WAN.quant_patterns,
    output="video",
    notes="Wan2.1-I2V blocks; pose latents added to the video tokens; the face adapter attends each rank's tokens "
          "to their frames' motion tokens",
    reference={"name": "Wan2.2-Animate-14B", "shape": (77, 720, 1280), "vae_scale": (4, 8, 8),
               "transformer": {}, "text_encoder": WAN.reference["text_encoder"]},
))
