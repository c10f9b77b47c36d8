"""Tiny random-weight Flux.2 transformers and pipelines for the tests (one process and spawned ranks).

No text encoders or tokenizers: the pipelines are called with ``prompt_embeds`` (and, for Flux.2 [klein]'s
CFG, ``negative_prompt_embeds``). The VAE is diffusers' one-level test ``AutoencoderKLFlux2`` (1 latent
channel), packed 2 x 2 by the pipelines: an image of H x W pixels is (H / 2) x (W / 2) tokens of 4 channels.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

PIPELINES = {"dev": "Flux2Pipeline", "klein": "Flux2KleinPipeline", "klein_inpaint": "Flux2KleinInpaintPipeline"}


@dataclass(frozen=True)
class TinyFlux2Spec:
    """diffusers' Flux.2 model-test sizes with 3 heads and two blocks of each kind."""

    heads: int = 3
    head_dim: int = 16
    layers: int = 2
    single_layers: int = 2
    text_dim: int = 32
    in_channels: int = 4
    axes: tuple[int, ...] = (4, 4, 4, 4)
    guidance_embeds: bool = False


def transformer(spec: TinyFlux2Spec = TinyFlux2Spec(), seed: int = 0, dtype=torch.float32):
    from diffusers import Flux2Transformer2DModel

    torch.manual_seed(seed)
    model = Flux2Transformer2DModel(
        patch_size=1, in_channels=spec.in_channels, num_layers=spec.layers, num_single_layers=spec.single_layers,
        attention_head_dim=spec.head_dim, num_attention_heads=spec.heads, joint_attention_dim=spec.text_dim,
        timestep_guidance_channels=256, axes_dims_rope=list(spec.axes), guidance_embeds=spec.guidance_embeds)
    return model.to(dtype).eval()


def pipeline(kind: str = "klein", *, spec: TinyFlux2Spec | None = None, seed: int = 0, dtype=torch.float32):
    import diffusers
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler

    if kind not in PIPELINES:
        raise ValueError(f"kind must be one of {list(PIPELINES)}, got {kind!r}")
    spec = spec or TinyFlux2Spec(guidance_embeds=kind == "dev")
    torch.manual_seed(seed + 1)
    vae = AutoencoderKLFlux2(sample_size=32, in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",),
                             up_block_types=("UpDecoderBlock2D",), block_out_channels=(4,), layers_per_block=1,
                             latent_channels=1, norm_num_groups=1, use_quant_conv=False,
                             use_post_quant_conv=False).eval()
    pipe = getattr(diffusers, PIPELINES[kind])(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=None,
                                               tokenizer=None, transformer=transformer(spec, seed + 2, dtype))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def image(height=6, width=10, seed=0):
    import PIL.Image

    return PIL.Image.fromarray((np.random.RandomState(seed).rand(height, width, 3) * 255).astype("uint8"))


def call_kwargs(kind: str = "klein", *, height=6, width=10, steps=2, seed=0, text=7, cfg=True, output_type="latent",
                spec: TinyFlux2Spec | None = None, reference=None):
    """One pipeline call: prompt (and for [klein]'s CFG negative prompt) embeddings, a fixed generator.

    6 x 10 px = 3 x 5 tokens. reference: (h, w) px of a reference image ([dev] / [klein] editing), or None.
    """
    spec = spec or TinyFlux2Spec()
    g = torch.Generator().manual_seed(seed + 1)
    kw = dict(prompt_embeds=torch.randn(1, text, spec.text_dim, generator=g), height=height, width=width,
              num_inference_steps=steps, generator=torch.Generator().manual_seed(seed), output_type=output_type)
    if kind == "dev":
        kw["guidance_scale"] = 3.5
    else:
        kw["guidance_scale"] = 4.0 if cfg else 1.0
        if cfg:
            kw["negative_prompt_embeds"] = torch.randn(1, text, spec.text_dim, generator=g)
    if reference is not None:
        kw["image"] = image(*reference, seed=seed)
    if kind == "klein_inpaint":
        kw.update(image=image(height, width, seed=seed), mask_image=_mask(height, width), strength=0.9)
    return kw


def _mask(height, width):
    import PIL.Image

    m = np.zeros((height, width), dtype="uint8")
    m[: height // 2, : width // 2] = 255
    return PIL.Image.fromarray(m)


def transformer_inputs(spec: TinyFlux2Spec = TinyFlux2Spec(), *, batch=1, grid=(3, 5), text=7, seed=0,
                       text_ids="pipeline", reference=None):
    """Direct Flux2Transformer2DModel inputs in the pipelines' layout (3-D ids: (t, h, w, layer)).

    text_ids: "pipeline" ((0, 0, 0, l)) or "random" (diffusers' model tests). reference: (h, w) of a
    reference image after the target (t = 10), or None.
    """
    from diffusers.pipelines.flux2.pipeline_flux2 import Flux2Pipeline as P

    g = torch.Generator().manual_seed(seed)
    img_ids = P._prepare_latent_ids(torch.zeros(batch, 1, *grid))
    if reference is not None:
        img_ids = torch.cat([img_ids, P._prepare_image_ids([torch.zeros(1, 1, *reference)]).expand(batch, -1, -1)], 1)
    emb = torch.randn(batch, text, spec.text_dim, generator=g)
    txt_ids = P._prepare_text_ids(emb) if text_ids == "pipeline" else torch.randint(0, 6, (batch, text, 4), generator=g)
    inputs = dict(hidden_states=torch.randn(batch, img_ids.shape[1], spec.in_channels, generator=g),
                  encoder_hidden_states=emb, timestep=torch.tensor([0.7] * batch), img_ids=img_ids, txt_ids=txt_ids)
    if spec.guidance_embeds:
        inputs["guidance"] = torch.tensor([3.5] * batch)
    return inputs
