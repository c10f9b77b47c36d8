"""Tiny random-weight LTX-Video pipelines and their call arguments (single-process and spawned-rank tests).

The transformer follows diffusers' model test (``attention_head_dim`` 8, 1-2 layers) with 3 heads by
default; the VAE has LTX's real compression (patch 4 x 2^3 = 32 spatial, 2^3 = 8 temporal) at 8
channels, so H x W x F pixels are (H / 32) x (W / 32) x ((F - 1) / 8 + 1) tokens, as in the released
model (96 x 160 x 9 -> 3 x 5 x 2 = 30 tokens, an odd grid). No text encoder or tokenizer: the pipelines
are called with ``prompt_embeds`` / ``prompt_attention_mask`` (and the negatives for CFG).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

PIPELINES = {"t2v": "LTXPipeline", "i2v": "LTXImageToVideoPipeline", "condition": "LTXConditionPipeline"}


@dataclass(frozen=True)
class TinyLTXSpec:
    heads: int = 3
    head_dim: int = 8
    layers: int = 2
    channels: int = 8  # latent channels = transformer in / out channels
    text_dim: int = 16  # caption_channels: the width of prompt_embeds


def tiny_ltx_transformer(spec: TinyLTXSpec = TinyLTXSpec(), seed: int = 0, dtype=torch.float32):
    from diffusers import LTXVideoTransformer3DModel

    torch.manual_seed(seed)
    inner = spec.heads * spec.head_dim
    model = LTXVideoTransformer3DModel(in_channels=spec.channels, out_channels=spec.channels, patch_size=1,
                                       patch_size_t=1, num_attention_heads=spec.heads,
                                       attention_head_dim=spec.head_dim, cross_attention_dim=inner,
                                       num_layers=spec.layers, caption_channels=spec.text_dim)
    return (model if dtype == torch.float32 else model.to(dtype)).eval()


VAE_VERSIONS = ("0.9.0", "0.9.1", "0.9.5")


def tiny_ltx_vae(channels: int = 8, seed: int = 0, version: str = "0.9.0"):
    """A tiny AutoencoderKLLTXVideo shaped like a released config: "0.9.0" (stride-2 convolution down
    blocks, no timestep), "0.9.1" (timestep-conditioned decoder with noise injection and residual
    depth-to-space upsamplers) or "0.9.5" (LTXVideo095DownBlock3D space-to-depth downsamplers, spatial /
    temporal / spatiotemporal, and a timestep-conditioned decoder without noise). All compress 32 x 8."""
    from diffusers import AutoencoderKLLTXVideo

    if version not in VAE_VERSIONS:
        raise ValueError(f"version must be one of {list(VAE_VERSIONS)}, got {version!r}")
    torch.manual_seed(seed)
    common = dict(in_channels=3, out_channels=3, latent_channels=channels, patch_size=4, patch_size_t=1,
                  encoder_causal=True, decoder_causal=False)
    if version == "0.9.0":
        kw = dict(block_out_channels=(8,) * 4, decoder_block_out_channels=(8,) * 4, layers_per_block=(1,) * 5,
                  decoder_layers_per_block=(1,) * 5, spatio_temporal_scaling=(True, True, True, False),
                  decoder_spatio_temporal_scaling=(True, True, True, False), decoder_inject_noise=(False,) * 5,
                  upsample_residual=(False,) * 4, upsample_factor=(1,) * 4, timestep_conditioning=False)
    else:
        kw = dict(decoder_block_out_channels=(8, 16, 32), decoder_layers_per_block=(1,) * 4,
                  decoder_spatio_temporal_scaling=(True,) * 3, upsample_residual=(True,) * 3,
                  upsample_factor=(2,) * 3, timestep_conditioning=True)
        if version == "0.9.1":
            kw.update(block_out_channels=(8,) * 4, layers_per_block=(1,) * 5,
                      spatio_temporal_scaling=(True, True, True, False),
                      decoder_inject_noise=(True, True, True, False))
        else:
            kw.update(block_out_channels=(8, 8, 16, 16, 16), down_block_types=("LTXVideo095DownBlock3D",) * 4,
                      layers_per_block=(1,) * 5, spatio_temporal_scaling=(True,) * 4,
                      downsample_type=("spatial", "temporal", "spatiotemporal", "spatiotemporal"),
                      decoder_inject_noise=(False,) * 4, spatial_compression_ratio=32,
                      temporal_compression_ratio=8)
    vae = AutoencoderKLLTXVideo(**common, **kw)
    with torch.no_grad():  # diffusers starts the noise scales at zero: make the injected noise count
        for m in vae.modules():
            for name in ("per_channel_scale1", "per_channel_scale2"):
                if getattr(m, name, None) is not None:
                    getattr(m, name).normal_(0.0, 0.5)
    vae.use_framewise_encoding = False
    vae.use_framewise_decoding = False
    return vae.eval()


def tiny_ltx_pipeline(kind: str = "t2v", *, spec: TinyLTXSpec | None = None, seed: int = 0, dtype=torch.float32,
                      vae_version: str = "0.9.0"):
    """A tiny LTX pipeline without text encoder or tokenizer (kind: "t2v", "i2v" or "condition")."""
    if kind not in PIPELINES:
        raise ValueError(f"kind must be one of {list(PIPELINES)}, got {kind!r}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import diffusers
    from diffusers import FlowMatchEulerDiscreteScheduler

    spec = spec or TinyLTXSpec()
    pipe = getattr(diffusers, PIPELINES[kind])(
        scheduler=FlowMatchEulerDiscreteScheduler(), vae=tiny_ltx_vae(spec.channels, seed + 1, vae_version),
        text_encoder=None,
        tokenizer=None, transformer=tiny_ltx_transformer(spec, seed + 2, dtype))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def prompt_embeds(length: int, *, batch: int = 1, dim: int = 16, seed: int = 0, valid=None):
    """(prompt_embeds, prompt_attention_mask) as the T5 encoder gives them (``valid`` real tokens each)."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(batch, length, dtype=torch.long)
    for b, n in enumerate(valid or ()):
        mask[b, n:] = 0
    return torch.randn(batch, length, dim, generator=g), mask


def image(height: int, width: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(1, 3, height, width, generator=g)


def call_kwargs(kind: str, *, height=96, width=160, frames=9, steps=2, seed=0, text=8, batch=1, valid=None,
                guidance=3.0, output_type="latent", dim=16, frame_index=0):
    """One pipeline call: padded prompt / negative prompt embeddings, CFG on (guidance > 1), fixed generator.

    96 x 160 x 9 pixels = 2 x 3 x 5 latent tokens. ``valid``: real text tokens per sample (default:
    the prompt 5 of ``text``, the negative prompt 3: both padded). ``frame_index`` (condition
    pipeline): where the condition image goes; > 0 prepends its tokens to the video tokens; None: no
    condition image.
    """
    valid = valid or [5] * batch
    pe, pm = prompt_embeds(text, batch=batch, dim=dim, seed=seed + 1, valid=valid)
    ne, nm = prompt_embeds(text, batch=batch, dim=dim, seed=seed + 2, valid=[max(1, v - 2) for v in valid])
    kw = dict(prompt_embeds=pe, prompt_attention_mask=pm, negative_prompt_embeds=ne, negative_prompt_attention_mask=nm,
              height=height, width=width, num_frames=frames, num_inference_steps=steps, guidance_scale=guidance,
              generator=torch.Generator().manual_seed(seed), output_type=output_type)
    if kind == "i2v":
        kw["image"] = image(height, width, seed)
    elif kind == "condition" and frame_index is not None:  # None: no condition (one timestep per sample)
        kw.update(image=image(height, width, seed), frame_index=frame_index)
    return kw


def transformer_inputs(spec: TinyLTXSpec = TinyLTXSpec(), *, batch=2, grid=(2, 3, 5), text=8, seed=0, masked=True,
                       per_token=False, coords=False):
    """Direct LTXVideoTransformer3DModel inputs (padded text; per-token timesteps; video_coords)."""
    g = torch.Generator().manual_seed(seed)
    f, h, w = grid
    n = f * h * w
    mask = torch.ones(batch, text, dtype=torch.long)
    if masked:
        for b in range(batch):
            mask[b, max(1, text - 2 - b):] = 0
    timestep = torch.full((batch,), 700.0)
    if per_token:
        timestep = timestep[:, None] * (torch.rand(batch, n, generator=g) > 0.2)
    kw = dict(hidden_states=torch.randn(batch, n, spec.channels, generator=g),
              encoder_hidden_states=torch.randn(batch, text, spec.text_dim, generator=g), timestep=timestep,
              encoder_attention_mask=mask)
    if coords:
        ids = torch.stack(torch.meshgrid(torch.arange(f), torch.arange(h), torch.arange(w), indexing="ij")).flatten(1)
        coords_ = ids.float() * torch.tensor([8.0 / 25, 32.0, 32.0])[:, None]
        kw["video_coords"] = coords_[None].repeat(batch, 1, 1) + torch.rand(batch, 3, n, generator=g)
    else:
        kw.update(num_frames=f, height=h, width=w, rope_interpolation_scale=(8 / 25, 32, 32))
    return kw
