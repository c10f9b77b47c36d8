"""Tiny random-weight CogVideoX pipelines and transformers for the tests (no hub, no text encoder).

Awkward shapes: 3 heads, odd token grids (48 x 80 pixels = 3 x 5 tokens with the 8x VAE and patch 2),
odd text lengths. Variants: "2b" (sincos position embeddings, no RoPE), "5b" (RoPE passed in by the
pipeline), "15" (RoPE with ``patch_size_t`` 2, CogVideoX 1.5), "i2v" (5B image-to-video: the image
latents concatenated on channels), "i2v15" (1.5 image-to-video with ``ofs`` embeddings).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

TEXT_DIM = 32
TEXT_LEN = 7  # the 2B sincos table covers max_text_seq_length text rows: the text is padded to it
VARIANTS = ("2b", "5b", "15", "i2v", "i2v15")


@dataclass(frozen=True)
class TinyCogSpec:
    variant: str = "5b"
    heads: int = 3
    head_dim: int = 16  # RoPE needs a multiple of 16
    layers: int = 2
    latent_channels: int = 4

    @property
    def rope(self) -> bool:
        return self.variant != "2b"

    @property
    def patch_t(self) -> int | None:
        return 2 if self.variant in ("15", "i2v15") else None

    @property
    def i2v(self) -> bool:
        return self.variant.startswith("i2v")


def transformer_config(spec: TinyCogSpec) -> dict:
    return dict(num_attention_heads=spec.heads, attention_head_dim=spec.head_dim,
                in_channels=spec.latent_channels * (2 if spec.i2v else 1), out_channels=spec.latent_channels,
                time_embed_dim=8, text_embed_dim=TEXT_DIM, num_layers=spec.layers, sample_width=16, sample_height=16,
                sample_frames=9, patch_size=2, patch_size_t=spec.patch_t, temporal_compression_ratio=4,
                max_text_seq_length=7, use_rotary_positional_embeddings=spec.rope,
                ofs_embed_dim=8 if spec.variant == "i2v15" else None)


def tiny_transformer(spec: TinyCogSpec = TinyCogSpec(), seed: int = 0, dtype=torch.float32):
    from diffusers import CogVideoXTransformer3DModel

    torch.manual_seed(seed)
    return CogVideoXTransformer3DModel(**transformer_config(spec)).to(dtype).eval()


def tiny_vae(seed: int = 0):
    from diffusers import AutoencoderKLCogVideoX

    torch.manual_seed(seed)
    return AutoencoderKLCogVideoX(in_channels=3, out_channels=3, down_block_types=("CogVideoXDownBlock3D",) * 4,
                                  up_block_types=("CogVideoXUpBlock3D",) * 4, block_out_channels=(8, 8, 8, 8),
                                  latent_channels=4, layers_per_block=1, norm_num_groups=2,
                                  temporal_compression_ratio=4).eval()


def tiny_pipeline(spec: TinyCogSpec = TinyCogSpec(), seed: int = 0, dtype=torch.float32):
    from diffusers import CogVideoXDDIMScheduler, CogVideoXImageToVideoPipeline, CogVideoXPipeline

    cls = CogVideoXImageToVideoPipeline if spec.i2v else CogVideoXPipeline
    pipe = cls(tokenizer=None, text_encoder=None, vae=tiny_vae(seed), transformer=tiny_transformer(spec, seed, dtype),
               scheduler=CogVideoXDDIMScheduler())
    pipe.set_progress_bar_config(disable=True)
    return pipe


def prompt_embeds(text: int, batch: int = 1, seed: int = 0, dtype=torch.float32):
    return torch.randn(batch, text, TEXT_DIM, generator=torch.Generator().manual_seed(seed)).to(dtype)


def image(height=48, width=80, seed=0):
    import PIL.Image

    return PIL.Image.fromarray((np.random.RandomState(seed).rand(height, width, 3) * 255).astype("uint8"))


def call_kwargs(spec: TinyCogSpec, *, height=48, width=80, frames=9, steps=2, seed=0, text=7, cfg=True,
                output_type="latent", dtype=torch.float32):
    """One pipeline call: 48 x 80 x 9 -> 3 x 5 tokens x 3 latent frames (2 with patch_size_t 2), CFG on."""
    kw = dict(prompt_embeds=prompt_embeds(text, seed=seed + 1, dtype=dtype), height=height, width=width,
              num_frames=frames, num_inference_steps=steps, generator=torch.Generator().manual_seed(seed),
              output_type=output_type, guidance_scale=5.0 if cfg else 1.0, max_sequence_length=text)
    if cfg:
        kw["negative_prompt_embeds"] = prompt_embeds(text, seed=seed + 2, dtype=dtype)
    if spec.i2v:
        kw["image"] = image(height, width, seed)
    return kw


def transformer_inputs(spec: TinyCogSpec, *, batch=2, grid=(3, 3, 5), text=7, seed=0, dtype=torch.float32):
    """Direct CogVideoXTransformer3DModel inputs: (B, F, C, H, W) latents, text, timestep, RoPE when the spec has it.

    grid: (t, h, w) video tokens (t latent frames, or t * patch_size_t with ``patch_size_t``).
    """
    from diffusers.models.embeddings import get_3d_rotary_pos_embed

    g = torch.Generator().manual_seed(seed)
    t, h, w = grid
    frames = t * (spec.patch_t or 1)
    channels = spec.latent_channels * (2 if spec.i2v else 1)
    kw = dict(hidden_states=torch.randn(batch, frames, channels, 2 * h, 2 * w, generator=g).to(dtype),
              encoder_hidden_states=torch.randn(batch, text, TEXT_DIM, generator=g).to(dtype),
              timestep=torch.tensor([700] * batch))
    if spec.rope:
        cos, sin = get_3d_rotary_pos_embed(spec.head_dim, None, (h, w), t, grid_type="slice", max_size=(h, w))
        kw["image_rotary_emb"] = (cos, sin)
    if spec.variant == "i2v15":
        kw["ofs"] = torch.full((1,), 2.0)
    return kw
