"""Tiny random-weight Wan2.2-TI2V-5B pipelines, built in memory (no hub), for the tests.

Same classes and layout as ``Wan-AI/Wan2.2-TI2V-5B-Diffusers``, scaled down like diffusers' own
``Wan225BPipelineFastTests`` (tests/pipelines/wan/test_wan_22.py):

* transformer: ``WanTransformer3DModel`` with 48 input / output channels and patch (1, 2, 2), no
  ``transformer_2``; 3 heads of 24 by default (an awkward head count);
* VAE: ``AutoencoderKLWan`` with ``z_dim=48``, ``is_residual=True`` (AvgDown3D / DupUp3D shortcuts),
  ``patch_size=2`` (12 = 3 x 2 x 2 pixel channels), ``scale_factor_spatial=16``;
* pipeline: ``WanPipeline(expand_timesteps=True)`` (a (B, S) timestep, one value per token) or
  ``WanImageToVideoPipeline(expand_timesteps=True)`` (frame 0 encoded alone, its tokens get timestep
  0 through ``first_frame_mask``; no CLIP image encoder), flow-matching scheduler with shift 5;
* text encoder and tokenizer: the in-memory UMT5 and WordLevel tokenizer of ``lite_boost.demo``.

Token grid: latent (1 + (F - 1) / 4, H / 16, W / 16), tokens (latent frames, H / 32, W / 32).
"""

from __future__ import annotations

import torch

from lite_boost.demo import TinyWanSpec, tiny_wan_pipeline, tiny_wan_transformer

__all__ = ["VAE_5B", "tiny_wan5b_vae", "tiny_wan5b_transformer", "tiny_wan5b_pipeline", "tokens", "call_kwargs"]

# AutoencoderKLWan of Wan2.2-TI2V-5B at diffusers' tiny test size (base_dim raised from 3 to 8)
VAE_5B = dict(base_dim=8, z_dim=48, in_channels=12, out_channels=12, is_residual=True, patch_size=2,
              latents_mean=[0.0] * 48, latents_std=[1.0] * 48, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
              scale_factor_spatial=16, scale_factor_temporal=4, temperal_downsample=[False, True, True])


def tiny_wan5b_vae(seed: int = 1, **overrides):
    from diffusers import AutoencoderKLWan

    torch.manual_seed(seed)
    return AutoencoderKLWan(**{**VAE_5B, **overrides}).eval()


def tiny_wan5b_transformer(heads: int = 3, seed: int = 2):
    return tiny_wan_transformer(TinyWanSpec(heads=heads, head_dim=24, in_channels=48, out_channels=48), seed=seed)


def tiny_wan5b_pipeline(kind: str = "t2v", *, heads: int = 3, seed: int = 0):
    """A tiny Wan2.2-TI2V-5B pipeline: ``kind`` "t2v" (WanPipeline) or "i2v" (WanImageToVideoPipeline)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, WanImageToVideoPipeline, WanPipeline

    text = tiny_wan_pipeline("t2v", seed=seed)  # only its in-memory text encoder and tokenizer are used
    components = dict(tokenizer=text.tokenizer, text_encoder=text.text_encoder, vae=tiny_wan5b_vae(seed + 1),
                      scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0),
                      transformer=tiny_wan5b_transformer(heads, seed + 2), transformer_2=None, boundary_ratio=None,
                      expand_timesteps=True)
    if kind == "t2v":
        pipe = WanPipeline(**components)
    elif kind == "i2v":
        pipe = WanImageToVideoPipeline(image_encoder=None, image_processor=None, **components)
    else:
        raise ValueError(f"kind must be 't2v' or 'i2v', got {kind!r}")
    pipe.set_progress_bar_config(disable=True)
    return pipe


def tokens(height: int, width: int, num_frames: int) -> int:
    """Transformer tokens of a call (patch 1 x 2 x 2 on the 4 x 16 x 16 latent)."""
    return (1 + (num_frames - 1) // 4) * (height // 32) * (width // 32)


def call_kwargs(kind: str, hwf, *, steps: int = 2, output_type: str = "pt", seed: int = 0):
    from conftest import pipeline_kwargs

    h, w, f = hwf
    return pipeline_kwargs(kind, height=h, width=w, num_frames=f, steps=steps, seed=seed, output_type=output_type)
