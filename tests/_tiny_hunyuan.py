"""Tiny HunyuanVideo and HunyuanVideo-1.5 pipelines and their call arguments (single process and spawned ranks).

Built offline in memory from diffusers' test configurations (tests/models/transformers/
test_models_transformer_hunyuan_video.py, test_models_transformer_hunyuan_1_5.py and the pipeline tests),
at other sizes: 3 heads, odd token grids. Text encoders and tokenizers are None; the calls pass prompt
embeddings, pooled embeddings and padding masks.

* HunyuanVideo: T2V (``image_condition_type=None``), I2V ``latent_concat`` and I2V ``token_replace``;
  tiny ``AutoencoderKLHunyuanVideo`` (8x spatial, 4x temporal), patch 1: 16 x 32 px, 17 frames ->
  5 x 2 x 4 = 40 tokens (the pipeline wants sizes divisible by 16; 40 is not divisible by 3).
* HunyuanVideo-1.5: T2V and I2V (a tiny in-memory SigLIP image encoder), tiny
  ``AutoencoderKLHunyuanVideo15`` (4x spatial, 2x temporal), patch 1: 12 x 20 px, 5 frames -> 3 x 3 x 5.
  The pipeline adds 729 zero "image" text tokens for T2V (``vision_num_semantic_tokens``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class HySpec:
    """A tiny HunyuanVideoTransformer3DModel (rope axes sum to head_dim)."""

    heads: int = 3
    head_dim: int = 16
    rope_axes: tuple[int, int, int] = (4, 6, 6)
    layers: int = 1
    single_layers: int = 1
    kind: str = "t2v"  # "t2v", "latent_concat", "token_replace"
    text_dim: int = 16
    pooled_dim: int = 8
    latent_channels: int = 4

    @property
    def image_condition_type(self):
        return None if self.kind == "t2v" else self.kind

    @property
    def in_channels(self) -> int:
        return {"t2v": 1, "latent_concat": 2, "token_replace": 1}[self.kind] * self.latent_channels + (
            1 if self.kind == "latent_concat" else 0)


@dataclass(frozen=True)
class Hy15Spec:
    """A tiny HunyuanVideo15Transformer3DModel."""

    heads: int = 3
    head_dim: int = 8
    rope_axes: tuple[int, int, int] = (2, 2, 4)
    layers: int = 2
    task: str = "t2v"  # or "i2v"
    text_dim: int = 16
    text_2_dim: int = 32
    image_dim: int = 12
    latent_channels: int = 4


def hunyuan_transformer(spec: HySpec = HySpec(), seed: int = 0, dtype=torch.float32):
    from diffusers import HunyuanVideoTransformer3DModel

    torch.manual_seed(seed)
    return HunyuanVideoTransformer3DModel(
        in_channels=spec.in_channels, out_channels=spec.latent_channels, num_attention_heads=spec.heads,
        attention_head_dim=spec.head_dim, num_layers=spec.layers, num_single_layers=spec.single_layers,
        num_refiner_layers=1, patch_size=1, patch_size_t=1, guidance_embeds=spec.kind != "latent_concat",
        text_embed_dim=spec.text_dim, pooled_projection_dim=spec.pooled_dim, rope_axes_dim=spec.rope_axes,
        image_condition_type=spec.image_condition_type).to(dtype).eval()


def hunyuan15_transformer(spec: Hy15Spec = Hy15Spec(), seed: int = 0, dtype=torch.float32):
    from diffusers import HunyuanVideo15Transformer3DModel

    torch.manual_seed(seed)
    return HunyuanVideo15Transformer3DModel(
        in_channels=2 * spec.latent_channels + 1, out_channels=spec.latent_channels, num_attention_heads=spec.heads,
        attention_head_dim=spec.head_dim, num_layers=spec.layers, num_refiner_layers=1, mlp_ratio=2.0, patch_size=1,
        patch_size_t=1, text_embed_dim=spec.text_dim, text_embed_2_dim=spec.text_2_dim, image_embed_dim=spec.image_dim,
        rope_axes_dim=spec.rope_axes, target_size=16, task_type=spec.task).to(dtype).eval()


def _hunyuan_vae(latent_channels=4):
    from diffusers import AutoencoderKLHunyuanVideo

    torch.manual_seed(0)
    down, up = ("HunyuanVideoDownBlock3D",) * 4, ("HunyuanVideoUpBlock3D",) * 4
    return AutoencoderKLHunyuanVideo(
        in_channels=3, out_channels=3, latent_channels=latent_channels, down_block_types=down, up_block_types=up,
        block_out_channels=(8, 8, 8, 8), layers_per_block=1, act_fn="silu", norm_num_groups=4,
        scaling_factor=0.476986, spatial_compression_ratio=8, temporal_compression_ratio=4,
        mid_block_add_attention=True).eval()


def _hunyuan15_vae(latent_channels=4):
    from diffusers import AutoencoderKLHunyuanVideo15

    torch.manual_seed(0)
    return AutoencoderKLHunyuanVideo15(
        in_channels=3, out_channels=3, latent_channels=latent_channels, block_out_channels=(16, 16), layers_per_block=1,
        spatial_compression_ratio=4, temporal_compression_ratio=2, downsample_match_channel=False,
        upsample_match_channel=False).eval()


def hunyuan_pipeline(spec: HySpec = HySpec(), seed: int = 0):
    """HunyuanVideoPipeline (spec.kind "t2v") or HunyuanVideoImageToVideoPipeline, without encoders."""
    from diffusers import FlowMatchEulerDiscreteScheduler, HunyuanVideoImageToVideoPipeline, HunyuanVideoPipeline

    parts = dict(transformer=hunyuan_transformer(spec, seed), vae=_hunyuan_vae(spec.latent_channels),
                 scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0), text_encoder=None, tokenizer=None,
                 text_encoder_2=None, tokenizer_2=None)
    if spec.kind == "t2v":
        pipe = HunyuanVideoPipeline(**parts)
    else:
        pipe = HunyuanVideoImageToVideoPipeline(**parts, image_processor=None)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def hunyuan15_pipeline(spec: Hy15Spec = Hy15Spec(), seed: int = 0, guidance_scale: float = 4.0, stop: float = 1.0):
    """HunyuanVideo15Pipeline (spec.task "t2v") or HunyuanVideo15ImageToVideoPipeline, without text encoders.

    The guider runs CFG (two calls per step) for the steps before ``stop`` (a fraction of the steps)."""
    from diffusers import (FlowMatchEulerDiscreteScheduler, HunyuanVideo15ImageToVideoPipeline,
                           HunyuanVideo15Pipeline)
    from diffusers.guiders import ClassifierFreeGuidance

    parts = dict(transformer=hunyuan15_transformer(spec, seed), vae=_hunyuan15_vae(spec.latent_channels),
                 scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0), text_encoder=None, tokenizer=None,
                 text_encoder_2=None, tokenizer_2=None,
                 guider=ClassifierFreeGuidance(guidance_scale=guidance_scale, stop=stop))
    if spec.task == "t2v":
        pipe = HunyuanVideo15Pipeline(**parts)
    else:
        from transformers import SiglipImageProcessor, SiglipVisionConfig, SiglipVisionModel

        torch.manual_seed(0)
        encoder = SiglipVisionModel(SiglipVisionConfig(hidden_size=spec.image_dim, intermediate_size=16,
                                                       num_hidden_layers=1, num_attention_heads=2, image_size=28,
                                                       patch_size=14)).eval()
        processor = SiglipImageProcessor(size={"height": 28, "width": 28})
        pipe = HunyuanVideo15ImageToVideoPipeline(**parts, image_encoder=encoder, feature_extractor=processor)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def image(height=24, width=40, seed=0):
    import PIL.Image

    return PIL.Image.fromarray((np.random.RandomState(seed).rand(height, width, 3) * 255).astype("uint8"))


def _embeds(shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _mask(batch, length, valid):
    mask = torch.zeros(batch, length)
    for b, n in enumerate(valid):
        mask[b, :n] = 1
    return mask


def call_kwargs(spec: HySpec = HySpec(), *, height=16, width=32, frames=17, steps=2, seed=0, text=16,
                valid=(11, 7), batch=1, cfg=False, output_type="latent"):
    """One HunyuanVideo call: text padded to ``text`` tokens (``valid``: real cond / uncond tokens), fixed noise.

    cfg: true CFG (negative prompt embeddings, true_cfg_scale 4), i.e. two transformer calls per step;
    off = the distilled default (one call per step, embedded guidance).
    """
    kw = dict(prompt_embeds=_embeds((batch, text, spec.text_dim), seed + 1),
              pooled_prompt_embeds=_embeds((batch, spec.pooled_dim), seed + 2),
              prompt_attention_mask=_mask(batch, text, [valid[0] - b for b in range(batch)]),
              height=height, width=width, num_frames=frames, num_inference_steps=steps,
              generator=torch.Generator().manual_seed(seed), output_type=output_type)
    if spec.kind != "t2v":
        kw.update(image=image(height, width, seed), prompt_template={"template": "{}", "crop_start": 0})
    if cfg:
        kw.update(negative_prompt_embeds=_embeds((batch, text, spec.text_dim), seed + 3),
                  negative_pooled_prompt_embeds=_embeds((batch, spec.pooled_dim), seed + 4),
                  negative_prompt_attention_mask=_mask(batch, text, [valid[1]] * batch), true_cfg_scale=4.0)
    return kw


def call_kwargs_15(spec: Hy15Spec = Hy15Spec(), *, height=12, width=20, frames=5, steps=2, seed=0, text=(10, 6),
                   valid=((7, 4), (5, 3)), batch=1, output_type="latent"):
    """One HunyuanVideo-1.5 call: Qwen text ``text[0]`` and ByT5 text ``text[1]`` tokens with ``valid`` real
    ones for cond and uncond (the guider decides whether the uncond pass runs)."""
    def side(v, s):
        return dict(embeds=_embeds((batch, text[0], spec.text_dim), s), mask=_mask(batch, text[0], [v[0]] * batch),
                    embeds_2=_embeds((batch, text[1], spec.text_2_dim), s + 1),
                    mask_2=_mask(batch, text[1], [v[1]] * batch))

    c, u = side(valid[0], seed + 1), side(valid[1], seed + 3)
    kw = dict(prompt_embeds=c["embeds"], prompt_embeds_mask=c["mask"], prompt_embeds_2=c["embeds_2"],
              prompt_embeds_mask_2=c["mask_2"], negative_prompt_embeds=u["embeds"],
              negative_prompt_embeds_mask=u["mask"], negative_prompt_embeds_2=u["embeds_2"],
              negative_prompt_embeds_mask_2=u["mask_2"], num_frames=frames, num_inference_steps=steps,
              generator=torch.Generator().manual_seed(seed), output_type=output_type)
    if spec.task == "t2v":
        kw.update(height=height, width=width)
    else:
        kw["image"] = image(height, width, seed)
    return kw


def transformer_inputs(spec: HySpec = HySpec(), *, batch=1, grid=(3, 3, 5), text=12, valid=None, seed=0):
    """Direct HunyuanVideoTransformer3DModel inputs (diffusers' model-test layout at other sizes)."""
    g = torch.Generator().manual_seed(seed)
    f, h, w = grid
    valid = valid if valid is not None else [text] * batch
    kw = dict(hidden_states=torch.randn(batch, spec.in_channels, f, h, w, generator=g),
              timestep=torch.tensor([700.0] * batch),
              encoder_hidden_states=torch.randn(batch, text, spec.text_dim, generator=g),
              encoder_attention_mask=_mask(batch, text, valid),
              pooled_projections=torch.randn(batch, spec.pooled_dim, generator=g))
    if spec.kind != "latent_concat":
        kw["guidance"] = torch.tensor([6000.0] * batch)
    return kw


def transformer_inputs_15(spec: Hy15Spec = Hy15Spec(), *, batch=1, grid=(3, 3, 5), text=(6, 4), image_tokens=3,
                          valid=None, t2v=True, seed=0):
    """Direct HunyuanVideo15Transformer3DModel inputs; valid: (Qwen, ByT5) real tokens per sample."""
    g = torch.Generator().manual_seed(seed)
    f, h, w = grid
    valid = valid if valid is not None else [text] * batch
    images = torch.zeros(batch, image_tokens, spec.image_dim) if t2v else torch.randn(batch, image_tokens,
                                                                                     spec.image_dim, generator=g)
    return dict(hidden_states=torch.randn(batch, 2 * spec.latent_channels + 1, f, h, w, generator=g),
                timestep=torch.tensor([700.0] * batch),
                encoder_hidden_states=torch.randn(batch, text[0], spec.text_dim, generator=g),
                encoder_attention_mask=_mask(batch, text[0], [v[0] for v in valid]),
                encoder_hidden_states_2=torch.randn(batch, text[1], spec.text_2_dim, generator=g),
                encoder_attention_mask_2=_mask(batch, text[1], [v[1] for v in valid]),
                image_embeds=images)
