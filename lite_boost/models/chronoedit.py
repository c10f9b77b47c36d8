"""ChronoEdit (``ChronoEditPipeline``, ``ChronoEditTransformer3DModel``): image editing on Wan2.1-I2V.

The transformer is Wan's, block for block (diffusers copies ``WanAttention`` and ``WanTransformerBlock``),
so the Wan family's processor shim, sharding plan, cache adapter and tensor-parallel plan apply as they
are. What differs is data, plus one RoPE shim:

* RoPE: a two-frame latent (the edit: input frame and output frame, the pipeline's default when
  temporal reasoning is off, and its last steps when it is on) takes the temporal positions 0 and
  ``rope_temporal_skip_len - 1``; other frame counts are Wan's grid. The tables come from the cache
  like Wan's (the two frames are rows of the ``skip_len``-frame grid).
* CFG: the pipeline runs cond then uncond without ``cache_context`` names, so CFG parallel splits the
  two calls by their order (``CfgPlan(by_call_order=True)``).
* Step caching: with a cache configured, the boosted pipeline names each transformer call ``cond`` /
  ``uncond`` by the same order (``CacheAdapter(name_calls=True)``), so TaylorSeer and Pyramid Attention
  Broadcast run as on a Wan pipeline; First-Block Cache / MagCache do not know the block copy.
"""

from __future__ import annotations

import math

import torch

from ..adapter import ModelFamily, RopeSource
from ..adapter.shims import patch_grid
from ..ops.rope import RotaryEmbedding, phasors_from_complex, rope_tables
from ..parallel.plan import CfgPlan, PipelinePlan
from ..registry import register_family
from .wan import (_ROPE_THETA, WAN, WAN_SHARDING_PLAN, WAN_TP_PLAN, CachedWanRope, _rope_matches_cache, _token_grid,
                  wan_copy_cache_adapter)

__all__ = ["CHRONOEDIT", "CachedChronoEditRope"]


class CachedChronoEditRope(CachedWanRope):
    """Wan's cached RoPE, with ChronoEdit's two-frame positions (0 and ``temporal_skip_len - 1``)."""

    def __call__(self, hidden_states: torch.Tensor) -> RotaryEmbedding:
        _, _, frames, height, width = hidden_states.shape
        if frames != 2:
            return super().__call__(hidden_states)
        grid = patch_grid((frames, height, width), self.rope.patch_size)
        self.state.grid = grid
        start, stop = self.state.serve_range(math.prod(grid))
        skip, head_dim, device = self.rope.temporal_skip_len, self.rope.attention_head_dim, hidden_states.device

        def build():
            full = rope_tables((skip, grid[1], grid[2]), head_dim, theta=_ROPE_THETA, device=device).freqs
            plane = grid[1] * grid[2]
            rows = torch.cat([full[0, :plane, 0], full[0, (skip - 1) * plane:skip * plane, 0]])
            return phasors_from_complex(rows, start, stop)

        return self.state.rope_cache.get_or_build(("chronoedit", skip, grid, head_dim, str(device), start, stop), build)


def _rope_matches(rope) -> bool:
    # diffusers splits ChronoEdit's tables as (D - 2 * (D // 3), D // 3, D // 3) where Wan's split is
    # (D - 4 * (D // 6), 2 * (D // 6), 2 * (D // 6)): the same unless D % 6 == 4 (e.g. 64); otherwise
    # diffusers' own module is kept (and sharded by the plan's split_outputs).
    d = rope.attention_head_dim
    return d // 3 == 2 * (d // 6) and _rope_matches_cache(rope)


CHRONOEDIT = register_family(ModelFamily(
    name="chronoedit",
    transformers=("ChronoEditTransformer3DModel",),
    pipelines=("ChronoEditPipeline",),
    attention=WAN.attention,  # Wan's blocks, Wan's processor
    joint="cross",
    rope=RopeSource("rope", CachedChronoEditRope, matches=_rope_matches),
    token_grid=_token_grid,
    timestep_module="condition_embedder",
    sharding=WAN_SHARDING_PLAN,
    pipeline=PipelinePlan(cfg=CfgPlan(call_start="check_inputs", by_call_order=True)),
    tensor_parallel=WAN_TP_PLAN,
    quant_patterns=WAN.quant_patterns,
    # ChronoEditPipeline sets no cache_context: the boosted pipeline names its calls cond / uncond by their order
    # (name_calls), which TaylorSeer's per-branch state and the new-generation reset need. First-Block Cache and
    # MagCache fail on stock diffusers (ChronoEdit's copy of WanTransformerBlock is not in diffusers' block registry).
    cache=wan_copy_cache_adapter("ChronoEdit", name_calls=True),
    output="video",
    notes="Wan2.1-I2V blocks; two-frame edits take RoPE frames 0 and rope_temporal_skip_len - 1; CFG passes "
          "split by call order (the pipeline names neither)",
    reference={"name": "ChronoEdit-14B", "shape": (5, 480, 832), "vae_scale": (4, 8, 8),
               "transformer": {"in_channels": 36, "image_dim": 1280, "added_kv_proj_dim": 5120},
               "text_encoder": WAN.reference["text_encoder"]},
))
