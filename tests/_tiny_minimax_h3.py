"""Tiny random-weight MiniMax-H3 transformers and the packed inputs of one call (one process and spawned ranks).

The packed layout comes from diffusers' own modular-pipeline steps (``MiniMaxH3PrepareLayoutStep.
build_packed_sequence``: ``[text | keyframe conditions | target audio | target video]``, and
``MiniMaxH3SetTimestepsStep.build_row_timesteps``), so the position ids, modality tags and per-row timesteps
are the pipeline's. Sizes are awkward on purpose: 3 heads, odd token counts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TinyMiniMaxSpec:
    """diffusers' MiniMax-H3 model-test sizes with 3 heads (heads x head_dim 48 != hidden 24, partial rotary)."""

    heads: int = 3
    head_dim: int = 16
    hidden: int = 24
    layers: int = 2
    refiner_layers: int = 2
    in_channels: int = 4
    audio_channels: int = 6
    text_dim: int = 8
    rope_freq_dim: int = 2


def transformer(spec: TinyMiniMaxSpec = TinyMiniMaxSpec(), seed: int = 0, dtype=torch.float32):
    from diffusers import MiniMaxH3Transformer3DModel

    torch.manual_seed(seed)
    model = MiniMaxH3Transformer3DModel(
        num_attention_heads=spec.heads, attention_head_dim=spec.head_dim, hidden_size=spec.hidden,
        num_layers=spec.layers, num_refiner_layers=spec.refiner_layers, ffn_dim=32, in_channels=spec.in_channels,
        audio_in_channels=spec.audio_channels, patch_size=(1, 2, 2), text_dim=spec.text_dim, freq_dim=8,
        time_embed_hidden_dim=24, time_embed_dim=16, rope_freq_dim=spec.rope_freq_dim)
    return (model if dtype == torch.float32 else model.to(dtype)).eval()


def layout(frames=3, height=6, width=10, text=5, audio_latents=3, anchors=("first",)):
    """The pipeline's packed layout: a dict of position_ids, token_tags and the three index tensors, plus
    ``num_condition_rows``. height / width are latent sizes (patch 2 x 2): 3 x 5 tokens a frame."""
    from diffusers.modular_pipelines.minimax_h3.before_denoise import MiniMaxH3PrepareLayoutStep

    tags = torch.ones(text, dtype=torch.long)
    pos, tags, vid, aud, txt, n_cond, _ = MiniMaxH3PrepareLayoutStep.build_packed_sequence(
        tags, frames, height, width, audio_latents, (1, 2, 2), audio_channels=2, audio_tag=2, video_tag=0,
        keyframe_anchors=tuple(anchors))
    return dict(position_ids=pos.to(torch.float32), token_tags=tags, video_indices=vid, audio_indices=aud,
                text_indices=txt), n_cond


def transformer_inputs(spec: TinyMiniMaxSpec = TinyMiniMaxSpec(), *, batch=1, seed=0, t=0.7, **shape):
    """The keyword arguments of one transformer call on the pipeline's layout (random latents and text)."""
    from diffusers.modular_pipelines.minimax_h3.before_denoise import MiniMaxH3SetTimestepsStep

    lay, n_cond = layout(**shape)
    g = torch.Generator().manual_seed(seed)
    n_vid, n_aud, n_txt = (lay[k].numel() for k in ("video_indices", "audio_indices", "text_indices"))
    timestep, timestep_indices = MiniMaxH3SetTimestepsStep.build_row_timesteps(
        lay["video_indices"], lay["audio_indices"], n_cond, 0, n_txt, t, t * 0.8, max(t, 0.9), 1.0)
    return dict(hidden_states=torch.randn(batch, n_vid, spec.in_channels * 4, generator=g),
                audio_hidden_states=torch.randn(batch, n_aud, spec.audio_channels, generator=g),
                encoder_hidden_states=torch.randn(batch, n_txt, spec.text_dim, generator=g),
                timestep=timestep.to(torch.float32), timestep_indices=timestep_indices, **lay)


def pipeline_transformer(seed: int = 0, dtype=torch.float32):
    """A tiny transformer with the channels the modular pipeline draws without a VAE (24 video, 32 audio)."""
    from diffusers import MiniMaxH3Transformer3DModel

    torch.manual_seed(seed)
    model = MiniMaxH3Transformer3DModel(
        num_attention_heads=3, attention_head_dim=16, hidden_size=24, num_layers=2, num_refiner_layers=1, ffn_dim=32,
        in_channels=24, audio_in_channels=32, patch_size=(1, 2, 2), text_dim=8, freq_dim=8, time_embed_hidden_dim=24,
        time_embed_dim=16, rope_freq_dim=2)
    return (model if dtype == torch.float32 else model.to(dtype)).eval()


def pipeline(seed: int = 0, dtype=torch.float32):
    """diffusers' t2va core denoise workflow (``MiniMaxH3CoreDenoiseStep``: layout, noise, per-row timesteps, the
    denoising loop, unpacking) as a ``MiniMaxH3ModularPipeline`` on a tiny transformer: no text encoder (prompt
    embeddings passed in) and no VAEs (it returns latents)."""
    from diffusers.modular_pipelines.minimax_h3.modular_blocks_minimax_h3 import MiniMaxH3CoreDenoiseStep
    from diffusers.schedulers import MiniMaxH3Scheduler

    pipe = MiniMaxH3CoreDenoiseStep().init_pipeline()
    pipe.update_components(transformer=pipeline_transformer(seed, dtype), scheduler=MiniMaxH3Scheduler(shift=12.0),
                           audio_scheduler=MiniMaxH3Scheduler(shift=3.0))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def call_kwargs(*, text=6, height=64, width=96, steps=3, seed=0):
    """One t2va request: 124 frames (5 s, the shortest) = 37 latent frames of 2 x 3 tokens, 414 audio rows."""
    g = torch.Generator().manual_seed(seed + 1)
    return dict(prompt_embeds=torch.randn(1, text, 8, generator=g), text_token_tags=torch.ones(text, dtype=torch.long),
                height=height, width=width, num_frames=124, num_inference_steps=steps,
                generator=torch.Generator().manual_seed(seed), output=["latents", "audio_latents"])


def video_vae(seed: int = 0, latent_channels: int = 4, spatial=(2, 2), temporal=(2, 2), channels=(8, 16),
              layers: int = 2):
    """A tiny random-weight ``AutoencoderKLMiniMaxH3`` (diffusers' model-test sizes by default: 4x spatial, 4x
    temporal; ``clip_length`` 17 and ``token_drop`` 3 as released, so clips of 5 + 2 latent frames cross-faded
    over 5 video frames). ``latent_channels=24, spatial=(2, 2, 2, 2)`` is the pipelines' geometry (16x)."""
    from diffusers import AutoencoderKLMiniMaxH3

    torch.manual_seed(seed)
    return AutoencoderKLMiniMaxH3(
        in_channels=3, out_channels=3, latent_channels=latent_channels, block_out_channels=channels,
        layers_per_block=1, spatial_downsample_factors=spatial, temporal_downsample_factors=temporal,
        norm_num_groups=4, decoder_num_layers=layers, decoder_num_attention_heads=2, decoder_attention_head_dim=8,
        decoder_num_register_tokens=2, decoder_ffn_mult=2, latents_mean=(0.0,) * latent_channels,
        latents_std=(1.0,) * latent_channels).eval()


def decode_pipeline(seed: int = 0, dtype=torch.float32):
    """:func:`pipeline` followed by diffusers' ``MiniMaxH3VideoDecodeStep`` with a tiny 16x / 4x video VAE
    (24 latent channels: the geometry the pipeline assumes without one, so the same 37 x 4 x 6 latents):
    latents and the decoded video out (no audio VAE)."""
    from diffusers.modular_pipelines import SequentialPipelineBlocks
    from diffusers.modular_pipelines.minimax_h3.decoders import MiniMaxH3VideoDecodeStep
    from diffusers.modular_pipelines.minimax_h3.modular_blocks_minimax_h3 import MiniMaxH3CoreDenoiseStep
    from diffusers.schedulers import MiniMaxH3Scheduler

    blocks = SequentialPipelineBlocks.from_blocks_dict({"core": MiniMaxH3CoreDenoiseStep(),
                                                        "decode": MiniMaxH3VideoDecodeStep()})
    pipe = blocks.init_pipeline()
    vae = video_vae(seed + 3, latent_channels=24, spatial=(2, 2, 2, 2), temporal=(1, 2, 2, 1), channels=(8,) * 4,
                    layers=1)
    pipe.update_components(transformer=pipeline_transformer(seed, dtype), scheduler=MiniMaxH3Scheduler(shift=12.0),
                           audio_scheduler=MiniMaxH3Scheduler(shift=3.0), vae=vae)
    pipe.set_progress_bar_config(disable=True)
    return pipe
