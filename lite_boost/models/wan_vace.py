"""Wan VACE (``WanVACEPipeline``, ``WanVACETransformer3DModel``): Wan with a control branch.

The main blocks are Wan's; the context blocks (``vace_blocks``, one per ``vace_layers`` entry) are Wan
blocks over the control tokens: the VACE patch embedding of the control video, laid out on the same
(frames, height, width) grid as the video tokens and rotated by the same RoPE tables. Their hints are added
to the video tokens after the main blocks named in ``vace_layers``. So every piece is Wan's shim, with:

* attention sites in both block lists (the context blocks numbered after the main blocks, so each layer
  has its own index for per-layer sparse policies); block-sparse windows use the video grid in both;
* under sequence parallelism, the control tokens are split at the first context block like the video
  tokens at every context block and at the first main block: each rank's hints are its own tokens'.
"""

from __future__ import annotations

from ..adapter import AttentionSite, ModelFamily, RopeSource
from ..adapter.shims import SEA_CACHE_WHY_NOT
from ..cache import CacheAdapter
from ..parallel.plan import PipelinePlan, ShardingPlan, SplitInput
from ..parallel.shard import TensorParallelPlan
from ..registry import register_family
from .wan import WAN, WAN_CACHE_ADAPTER, WAN_SHARDING_PLAN, WAN_TP_PLAN, CachedWanRope, LiteBoostWanAttnProcessor, \
    _rope_matches_cache, _token_grid

__all__ = ["WAN_VACE"]

WAN_VACE_SHARDING_PLAN = ShardingPlan(
    split_inputs=(
        SplitInput("vace_blocks.0", "control_hidden_states", dim=1),  # the later context blocks get it split
        SplitInput("vace_blocks.*", "hidden_states", dim=1),  # the video tokens each context block adds (block 0)
        SplitInput("blocks.0", "hidden_states", dim=1),
    ),
    split_outputs=WAN_SHARDING_PLAN.split_outputs,
    gather_outputs=WAN_SHARDING_PLAN.gather_outputs,
    rope_range="rope_range",
)


def _layer_offset(model) -> int:
    return len(model.blocks)


# Wan's methods and defaults, less SeaCache (its indicator is derived for WanTransformer3DModel text-to-video).
WAN_VACE_CACHE_ADAPTER = CacheAdapter(
    methods=tuple(m for m in WAN_CACHE_ADAPTER.methods if m != "sea_cache"),
    defaults=WAN_CACHE_ADAPTER.defaults,
    why_not={**WAN_CACHE_ADAPTER.why_not, "sea_cache": SEA_CACHE_WHY_NOT},
    probe_module=WAN_CACHE_ADAPTER.probe_module,
)

WAN_VACE = register_family(ModelFamily(
    name="wan-vace",
    transformers=("WanVACETransformer3DModel",),
    pipelines=("WanVACEPipeline",),
    attention=WAN.attention + (
               AttentionSite("vace_blocks.*.attn1", LiteBoostWanAttnProcessor, role="self", layer_offset=_layer_offset),
               AttentionSite("vace_blocks.*.attn2", LiteBoostWanAttnProcessor, role="cross",
                             layer_offset=_layer_offset)),
    joint="cross",
    rope=RopeSource("rope", CachedWanRope, matches=_rope_matches_cache),
    token_grid=_token_grid,
    timestep_module="condition_embedder",
    sharding=WAN_VACE_SHARDING_PLAN,
    pipeline=PipelinePlan(transformers=WAN.pipeline.transformers, cfg=WAN.pipeline.cfg),
    tensor_parallel=TensorParallelPlan(
        layers={**WAN_TP_PLAN.layers,
                **{k.replace("blocks.", "vace_blocks.", 1): v for k, v in WAN_TP_PLAN.layers.items()}},
        norms=WAN_TP_PLAN.norms + tuple(n.replace("blocks.", "vace_blocks.", 1) for n in WAN_TP_PLAN.norms)),
    cache=WAN_VACE_CACHE_ADAPTER,
    quant_patterns=("blocks.*", "vace_blocks.*"),
    output="video",
    notes="Wan blocks plus context blocks over the control tokens (same grid, same RoPE); control tokens split "
          "with the video tokens",
    reference={"name": "Wan2.1-VACE-14B", "shape": (81, 480, 832), "vae_scale": (4, 8, 8),
               "transformer": {"vace_layers": list(range(0, 40, 5)), "vace_in_channels": 96},
               "text_encoder": WAN.reference["text_encoder"]},
))
