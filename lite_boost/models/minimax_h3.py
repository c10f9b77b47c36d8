"""MiniMax-H3 (``MiniMaxH3Transformer3DModel``, joint video + audio) on the adapter layer.

What varies for this family, as data (:data:`MINIMAX_H3`) plus one processor shim and one RoPE shim:

* one packed sequence: the model scatters the text rows (after its token refiner), the conditioning video
  rows, the audio rows and the target video rows into one (B, S, C) buffer and every block runs plain
  self-attention over all of it (no mask, no cross-attention). :class:`MiniMaxH3Processor` keeps diffusers'
  projections and q / k norms and hands the whole packed sequence to ``attn_fn`` as self-attention, so
  every stream attends every other exactly as in the stock model. The token refiner's attention (text
  only, before the packing) gets the same shim in the "cross" role: whole on every rank, never sharded
  nor sparse.
* RoPE: ``rope`` turns the (S, 3) ``position_ids`` into (cos, sin) tables of ``2 * 3 * rope_freq_dim``
  channels applied rotate-half style to the leading channels of each head. :class:`CachedMiniMaxRope`
  serves the module's own fp32 tables as phasors (rows of this rank); the processor interleaves the two
  rotary halves of q and k (the same channel permutation for both, which leaves q . k unchanged) and
  rotates the pairs in fp32.
* sequence parallelism: the packed sequence is split at ``transformer_blocks.0`` with its per-row AdaLN
  indices (every block) and timestep indices (``norm_out``); the text and audio rows are sharded with the
  video rows (``text="shard"``) and attention over the whole sequence stays exact; both output heads are
  gathered (the model then selects the video and audio rows with sequence-wide indices).
* token grid for sparse windows: the pipelines pack ``[text | conditions | audio | target video]``; the
  target video is the tail of the sequence, a (frames, h, w) raster read from ``position_ids`` (eager
  code only). Everything in front of it (text, conditioning frames, audio) is the ``lead`` the block-
  sparse kernel keeps dense in both directions.
* CFG: the checkpoint is guidance-distilled; its modular pipeline (``MiniMaxH3ModularPipeline``, transformers
  ``transformer`` and ``transformer_ref``) makes one transformer call per step, without ``cache_context``.
* tensor parallelism (:data:`MINIMAX_H3_TP_PLAN`): the heads of every block's attention and the SwiGLU
  feed-forward; its input projection ``ff.net.0.proj`` holds [hidden, gate] stacked on its output rows, which
  ``chunk(2)`` takes apart, so each half is split over the ranks on its own (:class:`GluColwise`). q / k norms
  and RoPE are per head; the token refiner, the modulation tables and the output heads stay whole.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor.parallel import ParallelStyle

from ..adapter import AttentionSite, LiteBoostProcessor, ModelFamily, RopeSource, TinyPipeline
from ..adapter.shims import SEA_CACHE_WHY_NOT, CachedRope, call_arg, tensor_keys
from ..cache import CacheAdapter
from ..ops.rope import RotaryEmbedding, phasors_from_complex, rotate
from ..parallel.plan import CfgPlan, GatherOutput, PipelinePlan, ShardingPlan, SplitInput, SplitOutput
from ..parallel.shard import TensorParallelPlan
from ..registry import register_family

__all__ = ["MINIMAX_H3", "MiniMaxH3Processor", "CachedMiniMaxRope", "MINIMAX_H3_SHARDING_PLAN",
           "MINIMAX_H3_PIPELINE_PLAN", "MINIMAX_H3_CACHE_ADAPTER", "MINIMAX_H3_TP_PLAN", "GluColwise", "packed_video_grid",
           "boost_minimax_h3_transformer", "boost_minimax_h3_pipeline"]


def _phasors(emb) -> torch.Tensor:
    """complex64 (1, S, 1, R/2) phasors of the cached form or of diffusers' rotate-half (cos, sin) (S, R)."""
    if isinstance(emb, RotaryEmbedding):
        return emb.freqs
    cos, sin = emb
    half = cos.shape[-1] // 2
    return torch.complex(cos[:, :half].float(), sin[:, :half].float())[None, :, None, :]


def _rotate_half_pairs(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """x (B, S, H, D) with its leading rotary channels interleaved ([a0, b0, a1, b1, ...] from the halves
    [a | b]) and rotated in fp32; the pass-through channels follow unchanged."""
    r = 2 * freqs.shape[-1]
    head = x[..., :r].unflatten(-1, (2, r // 2)).transpose(-1, -2).flatten(-2)
    head = rotate(head.contiguous(), freqs, inplace=True)
    return torch.cat([head, x[..., r:]], dim=-1) if r < x.shape[-1] else head


class MiniMaxH3Processor(LiteBoostProcessor):
    """Self-attention of a ``MiniMaxH3Attention`` (diffusers' ``MiniMaxH3AttnProcessor`` semantics).

    The blocks' attention (role "self") runs over the whole packed sequence through ``attn_fn``; the
    token refiner's (role "cross", no RoPE) over the text. With RoPE, q and k leave the rotation with
    their rotary channels in pair order (one permutation for both: the attention is the same).
    """

    def __call__(self, attn, hidden_states: torch.Tensor, rotary_emb=None, attention_mask: torch.Tensor | None = None):
        if attention_mask is not None:
            raise ValueError("MiniMaxH3Processor (lite_boost) does not accept attention_mask: MiniMax-H3 attends "
                             "its whole packed sequence (the model passes none)")
        if getattr(attn, "fused_projections", False):
            q, k, v = attn.to_qkv(hidden_states).chunk(3, dim=-1)
        else:
            q, k, v = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        q, k, v = (x.unflatten(-1, (attn.heads, -1)) for x in (q, k, v))
        q, k = attn.norm_q(q), attn.norm_k(k)
        if rotary_emb is not None:
            freqs = _phasors(rotary_emb)
            q, k = _rotate_half_pairs(q, freqs), _rotate_half_pairs(k, freqs)
        out = self.attn_fn(q, k, v).flatten(2, 3).to(q.dtype)
        return attn.to_out[1](attn.to_out[0](out))


class CachedMiniMaxRope(CachedRope):
    """Replacement ``forward`` of a ``MiniMaxH3RotaryPosEmbed``: the module's own fp32 (cos, sin) tables of
    ``position_ids`` as phasors (:class:`~lite_boost.ops.rope.RotaryEmbedding`, this rank's rows; identity
    rows past the end), kept per (ids tensor and version, device, rows). Traced code builds them inline."""

    def __call__(self, position_ids: torch.Tensor):
        start, stop = self.state.serve_range(position_ids.shape[0])

        def build():
            cos, sin = self.original(position_ids)
            half = cos.shape[-1] // 2
            return phasors_from_complex(torch.complex(cos[:, :half], sin[:, :half]), start, stop)

        if torch.compiler.is_compiling():
            return build()
        key = ("minimax-h3", tensor_keys(self.state)(position_ids), str(position_ids.device), start, stop)
        return self.cached(key, build)


def _is_minimax_rope(rope) -> bool:
    from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3RotaryPosEmbed

    return isinstance(rope, MiniMaxH3RotaryPosEmbed) and type(rope).forward is MiniMaxH3RotaryPosEmbed.forward


# ----------------------------------------------------------------------------------------- token grid
def packed_video_grid(position_ids: torch.Tensor, video_indices: torch.Tensor):
    """(frames, h, w, lead) of the target video at the tail of a packed sequence, or None.

    The tail is the longest run of video rows ending the sequence; it must be a raster of equal frames
    (one time value per frame, each frame the same (h, w) grid, rows then columns). ``lead``: the rows
    in front of it. Reads the tensors: eager code only.
    """
    s, n = position_ids.shape[0], video_indices.shape[0]
    if position_ids.ndim != 2 or n == 0:
        return None
    want = torch.arange(s - n, s, device=video_indices.device)
    tail = int((video_indices.flip(0) == want.flip(0)).long().cumprod(0).sum().item())
    if tail == 0:
        return None
    pos = position_ids[s - tail:].detach().to(torch.float64)
    time = pos[:, 0]
    per_frame = int((time == time[0]).long().cumprod(0).sum().item())
    if tail % per_frame:
        return None
    first = pos[:per_frame, 1:]
    rows = torch.unique_consecutive(first[:, 0])
    h = rows.shape[0]
    if per_frame % h:
        return None
    w = per_frame // h
    grid = first.reshape(h, w, 2)
    if not (bool((grid[:, :, 0] == grid[:, :1, 0]).all()) and bool((grid[:, :, 1] == grid[:1, :, 1]).all())):
        return None
    frames = pos.reshape(tail // per_frame, per_frame, 3)
    if not (bool((frames[:, :, 1:] == first).all()) and bool((frames[:, :, 0] == frames[:, :1, 0]).all())):
        return None
    return tail // per_frame, h, w, s - tail


_GRIDS = "minimax_h3_grids"


def _token_grid(model, args, kwargs):
    """(frames, h, w, lead) of this call's target video; None (a dense call) when traced or not a raster."""
    if torch.compiler.is_compiling():
        return None
    pos = call_arg(args, kwargs, "position_ids", 6)
    vid = call_arg(args, kwargs, "video_indices", 7)
    if not (isinstance(pos, torch.Tensor) and isinstance(vid, torch.Tensor)):
        return None
    state = model._lite_boost
    keys = tensor_keys(state)
    memo = state.extras.setdefault(_GRIDS, {})
    key = (keys(pos), keys(vid))
    if key not in memo:
        if len(memo) >= 8:
            memo.pop(next(iter(memo)))
        memo[key] = packed_video_grid(pos, vid)
    return memo[key]


MINIMAX_H3_SHARDING_PLAN = ShardingPlan(
    split_inputs=(
        SplitInput("transformer_blocks.0", "hidden_states", dim=1),  # the packed sequence, once built
        SplitInput("transformer_blocks.*", "adaln_indices", dim=0),  # per-row AdaLN table rows, at every block
        SplitInput("norm_out", "timestep_indices", dim=0),  # per-row timestep of the output norm
    ),
    split_outputs=(SplitOutput("rope", dim=0),),  # only when diffusers' own RoPE module is kept
    gather_outputs=(GatherOutput("proj_out", dim=1), GatherOutput("audio_proj_out", dim=1)),
    rope_range="rope_range",
    text="shard",  # text and audio rows are rows of the one sharded sequence
)

MINIMAX_H3_PIPELINE_PLAN = PipelinePlan(
    transformers=("transformer", "transformer_ref"),
    cfg=CfgPlan(kind="none"),
    prepare_latents=None,
)

_BLOCKS_UNKNOWN = ("diffusers' block hooks do not know MiniMaxH3TransformerBlock (not in its TransformerBlockRegistry; "
                   "stock diffusers fails too)")

MINIMAX_H3_CACHE_ADAPTER = CacheAdapter(
    methods=("taylorseer_cache", "pyramid_attention_broadcast"),
    why_not={"first_block_cache": _BLOCKS_UNKNOWN, "mag_cache": _BLOCKS_UNKNOWN,
             "faster_cache": "it needs cond and uncond batched into one call; MiniMax-H3 is guidance-distilled "
                             "(one call per step)",
             "sea_cache": SEA_CACHE_WHY_NOT},
    probe_module="proj_in",
    refuse_pipelines={"MiniMaxH3ModularPipeline": "its denoise loop calls the transformer without cache_context, which "
                                                  "diffusers' cache hooks need (stock diffusers fails there too)"},
)

class GluColwise(ParallelStyle):
    """Column-wise split of a gated (SwiGLU) projection whose output rows are [hidden, gate], taken apart by
    ``chunk(2, dim=-1)``: each half is split over the tp ranks on its own, so a rank's output is [its hidden
    columns, its gate columns] and its ``chunk(2)`` pairs them as in one process. diffusers'
    ``PackedColwiseParallel`` with two equal blocks, stored on the layer as ``_tp_packed_col_blocks``."""

    def _apply(self, module, device_mesh):
        from diffusers.hooks.tensor_parallel import PackedColwiseParallel, _styles

        module._tp_packed_col_blocks = [module.out_features // 2, module.out_features // 2]
        style = _styles({"proj": PackedColwiseParallel()})["proj"]
        style.src_data_rank = self.src_data_rank
        return style._apply(module, device_mesh)

    def __repr__(self) -> str:
        return "GluColwise()"


MINIMAX_H3_TP_PLAN = TensorParallelPlan(layers={
    **{f"transformer_blocks.*.attn.{p}": "colwise" for p in ("to_q", "to_k", "to_v")},
    "transformer_blocks.*.attn.to_out.0": "rowwise",
    "transformer_blocks.*.ff.net.0.proj": GluColwise(),
    "transformer_blocks.*.ff.net.2": "rowwise",
})

MINIMAX_H3 = register_family(ModelFamily(
    name="minimax-h3",
    transformers=("MiniMaxH3Transformer3DModel",),
    pipelines=("MiniMaxH3ModularPipeline",),
    attention=(AttentionSite("transformer_blocks.*.attn", MiniMaxH3Processor),
               AttentionSite("token_refiner.refiner_blocks.*.attn", MiniMaxH3Processor, role="cross")),
    joint="packed",
    rope=RopeSource("rope", CachedMiniMaxRope, matches=_is_minimax_rope),
    token_grid=_token_grid,
    timestep_module="time_proj",
    sharding=MINIMAX_H3_SHARDING_PLAN,
    pipeline=MINIMAX_H3_PIPELINE_PLAN,
    tensor_parallel=MINIMAX_H3_TP_PLAN,
    cache=MINIMAX_H3_CACHE_ADAPTER,
    quant_patterns=("transformer_blocks.*", "token_refiner.refiner_blocks.*"),
    unsupported={"cfg_parallel": "the checkpoint is guidance-distilled: one transformer call per step, no CFG to "
                                 "split"},
    notes="text, audio and video rows share one packed self-attention sequence (sharded together); the token "
          "refiner runs whole on every rank; parallel VAE: the video VAE's temporal clips are spread over the "
          "ranks (exact; models/minimax_h3_vae.py), the audio VAE decodes whole on every rank",
    output="video",
    cfg_argument=None,
    # the t2va workflow without its Qwen3-VL text-encoder step (random prompt embeddings); 5 s at 24 fps is the
    # shortest video the pipeline makes (124 frames)
    tiny={"t2v": TinyPipeline("MiniMaxH3ModularPipeline", builder="lite_boost.demo:demo_minimax_h3_pipeline",
                              shape=(32, 32, 124), steps=2, prompt="lite_boost.demo:minimax_h3_demo_prompt")},
))

boost_minimax_h3_transformer = MINIMAX_H3.boost_transformer
boost_minimax_h3_pipeline = MINIMAX_H3.boost_pipeline
