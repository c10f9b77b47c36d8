"""Wan Animate (``WanAnimatePipeline``, ``WanAnimateTransformer3DModel``): Wan2.1-I2V blocks driven by a pose
video and a face video.

The blocks' attention modules and RoPE module are diffusers' copies of Wan's, so the Wan family's processor
shim and cached RoPE apply as they are; the pose latents are added to the video tokens (frames 1..F) after
the patch embedding, so they take no attention of their own. What stays diffusers' own: the face adapter
(``face_adapter.*``, after every ``inject_face_latents_blocks``-th block), whose queries are the video tokens
of one latent frame at a time against that frame's motion tokens. It runs dense, untouched, and since it
needs every token of a frame together, sequence parallelism is not offered; CFG parallel (the uncond pass
blanks the face video) and the Wan VAE's parallel decode / encode are.
"""

from __future__ import annotations

from ..adapter import ModelFamily, RopeSource
from ..adapter.shims import SEA_CACHE_WHY_NOT, separate_passes_why_not
from ..cache import CacheAdapter
from ..parallel.plan import CfgPlan, PipelinePlan
from ..registry import register_family
from .wan import WAN, WAN_CACHE_ADAPTER, CachedWanRope, _rope_matches_cache, _token_grid

__all__ = ["WAN_ANIMATE"]

WAN_ANIMATE = register_family(ModelFamily(
    name="wan-animate",
    transformers=("WanAnimateTransformer3DModel",),
    pipelines=("WanAnimatePipeline",),
    attention=WAN.attention,  # Wan's blocks, Wan's processor
    joint="cross",
    rope=RopeSource("rope", CachedWanRope, matches=_rope_matches_cache),
    token_grid=_token_grid,
    timestep_module="condition_embedder",
    pipeline=PipelinePlan(cfg=CfgPlan()),
    cache=CacheAdapter(
        methods=("taylorseer_cache", "pyramid_attention_broadcast"),
        defaults=WAN_CACHE_ADAPTER.defaults,
        why_not={**{m: "diffusers registers no block metadata for Wan Animate's WanTransformerBlock copy (stock "
                       "diffusers fails too)" for m in ("first_block_cache", "mag_cache")},
                 "faster_cache": separate_passes_why_not("Wan Animate"), "sea_cache": SEA_CACHE_WHY_NOT},
        probe_module="patch_embedding"),
    quant_patterns=WAN.quant_patterns,
    unsupported={"sequence_parallel": "the face adapter attends the video tokens frame by frame against that frame's "
                                      "motion tokens: it needs each frame's tokens on one rank"},
    output="video",
    notes="Wan2.1-I2V blocks; pose latents added to the video tokens; the face adapter keeps diffusers' processor "
          "(dense, per frame)",
    reference={"name": "Wan2.2-Animate-14B", "shape": (77, 720, 1280), "vae_scale": (4, 8, 8),
               "transformer": {}, "text_encoder": WAN.reference["text_encoder"]},
))
