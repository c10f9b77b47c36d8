"""SkyReels-V2 (``SkyReelsV2Transformer3DModel``): Wan's blocks, with diffusion forcing.

The attention modules, processors and RoPE module are diffusers' copies of Wan's, so the Wan family's
processor shim and cached RoPE apply as they are. What differs is data:

* Diffusion forcing (``SkyReelsV2DiffusionForcing*Pipeline``): a timestep per latent frame, so the
  blocks get a per-token modulation (B, 6, S, D) and the output norm a per-token shift / scale. Under
  sequence parallelism the modulation is split with the tokens at every block and the tokens are
  gathered before the output norm (``norm_out``), not after the projection.
* Asynchronous diffusion forcing (``causal_block_size > 1``) adds a frame-block causal (S, S) mask to the
  self-attention: it runs dense (sparse windows do not apply to it) and on one rank only: sequence
  parallelism refuses it when the transformer is called, before any collective.
* Step caching: diffusers registers no block metadata for ``SkyReelsV2TransformerBlock``, so the
  block-level caches (First-Block Cache, MagCache) fail on stock diffusers; TaylorSeer and Pyramid
  Attention Broadcast run.
"""

from __future__ import annotations

from ..adapter import ModelFamily, RopeSource
from ..adapter.shims import SEA_CACHE_WHY_NOT, separate_passes_why_not
from ..cache import CacheAdapter
from ..config import ConfigError
from ..parallel.plan import CfgPlan, GatherOutput, PipelinePlan, ShardingPlan, SplitInput, SplitOutput
from ..registry import register_family
from .wan import WAN, WAN_CACHE_ADAPTER, WAN_TP_PLAN, CachedWanRope, _rope_matches_cache, \
    _token_grid

__all__ = ["SKYREELS_V2"]

PIPELINES = ("SkyReelsV2Pipeline", "SkyReelsV2ImageToVideoPipeline", "SkyReelsV2DiffusionForcingPipeline",
             "SkyReelsV2DiffusionForcingImageToVideoPipeline", "SkyReelsV2DiffusionForcingVideoToVideoPipeline")


def _call_context(model, args, kwargs):
    state = model._lite_boost
    if model.config.num_frame_per_block > 1 and state.rope_range is not None:  # rope_range: set by a sharding plan
        raise ConfigError(
            f"causal_block_size={model.config.num_frame_per_block} (asynchronous diffusion forcing) adds a causal "
            "(S, S) attention mask that sequence parallelism (ulysses_degree / ring_degree) does not shard; use "
            "causal_block_size=1 or cfg_degree only")
    return None


SKYREELS_V2_SHARDING_PLAN = ShardingPlan(
    split_inputs=(
        SplitInput("blocks.0", "hidden_states", dim=1),
        SplitInput("blocks.*", "temb", dim=2, ndim=4),  # diffusion forcing: (B, 6, S, D) per-token modulation
    ),
    split_outputs=(SplitOutput("rope", dim=1),),  # only when diffusers' own (cos, sin) RoPE is kept
    gather_outputs=(GatherOutput("norm_out", dim=1),),  # before the per-token shift / scale of diffusion forcing
    rope_range="rope_range",
)

SKYREELS_V2_CACHE_ADAPTER = CacheAdapter(
    methods=("taylorseer_cache", "pyramid_attention_broadcast"),
    defaults=WAN_CACHE_ADAPTER.defaults,
    why_not={**{m: "diffusers registers no block metadata for SkyReelsV2TransformerBlock (stock diffusers fails too)"
                for m in ("first_block_cache", "mag_cache")},
             "faster_cache": separate_passes_why_not("SkyReels-V2"), "sea_cache": SEA_CACHE_WHY_NOT},
    probe_module="patch_embedding",
)

SKYREELS_V2 = register_family(ModelFamily(
    name="skyreels-v2",
    transformers=("SkyReelsV2Transformer3DModel",),
    pipelines=PIPELINES,
    attention=WAN.attention,  # Wan's blocks, Wan's processor
    joint="cross",
    rope=RopeSource("rope", CachedWanRope, matches=_rope_matches_cache),
    token_grid=_token_grid,
    timestep_module="condition_embedder",
    call_context=_call_context,
    sharding=SKYREELS_V2_SHARDING_PLAN,
    pipeline=PipelinePlan(cfg=CfgPlan()),
    tensor_parallel=WAN_TP_PLAN,
    cache=SKYREELS_V2_CACHE_ADAPTER,
    quant_patterns=WAN.quant_patterns,
    output="video",
    notes="Wan blocks; diffusion forcing's per-frame timesteps split with the tokens; asynchronous diffusion forcing "
          "(causal_block_size > 1) runs dense on one rank (its causal mask is not sharded)",
    reference={"name": "SkyReels-V2-DF-14B-540P", "shape": (97, 544, 960), "vae_scale": (4, 8, 8),
               "transformer": {"num_attention_heads": 40, "ffn_dim": 13824, "num_layers": 40},
               "text_encoder": WAN.reference["text_encoder"]},
))
