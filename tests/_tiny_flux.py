"""Tiny random-weight Flux.1 pipelines and their call arguments for the tests (one process and spawned ranks).

No text encoders or tokenizers: the pipelines are called with ``prompt_embeds`` and
``pooled_prompt_embeds`` (and their negatives for true CFG). The VAE is a 2-level ``AutoencoderKL``
with 4 latent channels (2x spatial), packed 2 x 2 by the pipelines, so an image of H x W pixels is
(H / 4) x (W / 4) transformer tokens: 12 x 20 px = 3 x 5 tokens (an odd grid).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

PIPELINES = {"t2i": "FluxPipeline", "img2img": "FluxImg2ImgPipeline", "inpaint": "FluxInpaintPipeline",
             "kontext": "FluxKontextPipeline", "kontext_inpaint": "FluxKontextInpaintPipeline",
             "control": "FluxControlPipeline", "fill": "FluxFillPipeline"}
LATENT_CHANNELS = 4


@dataclass(frozen=True)
class TinyFluxSpec:
    """A tiny FluxTransformer2DModel (diffusers' model-test sizes with 3 heads: RoPE axes (4, 4, 8) split a head)."""

    heads: int = 3
    head_dim: int = 16
    layers: int = 2  # dual-stream blocks
    single_layers: int = 2  # single-stream blocks
    text_dim: int = 32  # joint_attention_dim: the width of prompt_embeds
    pooled_dim: int = 32
    in_channels: int = 4 * LATENT_CHANNELS  # latents packed 2 x 2
    out_channels: int | None = None
    axes: tuple[int, int, int] = (4, 4, 8)
    guidance_embeds: bool = False


def transformer(spec: TinyFluxSpec = TinyFluxSpec(), seed: int = 0, dtype=torch.float32):
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(seed)
    model = FluxTransformer2DModel(
        patch_size=1, in_channels=spec.in_channels, out_channels=spec.out_channels, num_layers=spec.layers,
        num_single_layers=spec.single_layers, attention_head_dim=spec.head_dim, num_attention_heads=spec.heads,
        joint_attention_dim=spec.text_dim, pooled_projection_dim=spec.pooled_dim, guidance_embeds=spec.guidance_embeds,
        axes_dims_rope=list(spec.axes))
    return (model if dtype == torch.float32 else model.to(dtype)).eval()


def spec_for(kind: str, spec: TinyFluxSpec | None = None) -> TinyFluxSpec:
    """The transformer input / output channels each pipeline kind needs (Control: latents + control latents;
    Fill: latents + masked-image latents + the mask packed (VAE factor x 2)^2 = 16 channels)."""
    from dataclasses import replace

    spec = spec or TinyFluxSpec()
    packed = 4 * LATENT_CHANNELS
    if kind == "control":
        return replace(spec, in_channels=2 * packed, out_channels=packed)
    if kind == "fill":
        return replace(spec, in_channels=2 * packed + 16, out_channels=packed)
    return spec


def pipeline(kind: str = "t2i", *, spec: TinyFluxSpec | None = None, seed: int = 0, dtype=torch.float32):
    import diffusers
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler

    if kind not in PIPELINES:
        raise ValueError(f"kind must be one of {list(PIPELINES)}, got {kind!r}")
    torch.manual_seed(seed + 1)
    vae = AutoencoderKL(in_channels=3, out_channels=3, block_out_channels=(8, 16), layers_per_block=1,
                        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                        latent_channels=LATENT_CHANNELS, norm_num_groups=4, use_quant_conv=False,
                        use_post_quant_conv=False, shift_factor=0.0609, scaling_factor=1.5035).eval()
    model = transformer(spec_for(kind, spec), seed=seed + 2, dtype=dtype)
    pipe = getattr(diffusers, PIPELINES[kind])(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=None,
                                               tokenizer=None, text_encoder_2=None, tokenizer_2=None, transformer=model)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def image(height=12, width=20, seed=0):
    import PIL.Image

    return PIL.Image.fromarray((np.random.RandomState(seed).rand(height, width, 3) * 255).astype("uint8"))


def mask(height=12, width=20):
    import PIL.Image

    m = np.zeros((height, width), dtype="uint8")
    m[: height // 2, : width // 2] = 255
    return PIL.Image.fromarray(m)


def call_kwargs(kind: str = "t2i", *, height=12, width=20, steps=2, seed=0, text=7, batch=1, cfg=True,
                output_type="latent", spec: TinyFluxSpec | None = None, reference=(16, 24)):
    """One pipeline call: prompt (and, for true CFG, negative prompt) embeddings, a fixed generator.

    text: prompt length (the pipelines want cond and uncond of one shape). 12 x 20 px = 3 x 5 tokens.
    reference: (h, w) pixels of the image input of img2img / inpaint / Kontext / Control / Fill
    (Kontext: 16 x 24 px = 4 x 6 reference tokens after the target's).
    """
    spec = spec or TinyFluxSpec()
    g = torch.Generator().manual_seed(seed + 1)
    kw = dict(prompt_embeds=torch.randn(batch, text, spec.text_dim, generator=g),
              pooled_prompt_embeds=torch.randn(batch, spec.pooled_dim, generator=g), height=height, width=width,
              num_inference_steps=steps, generator=torch.Generator().manual_seed(seed), output_type=output_type)
    if cfg and kind not in ("control", "fill"):
        kw.update(negative_prompt_embeds=torch.randn(batch, text, spec.text_dim, generator=g),
                  negative_pooled_prompt_embeds=torch.randn(batch, spec.pooled_dim, generator=g), true_cfg_scale=4.0)
    rh, rw = reference
    if kind in ("img2img", "inpaint", "kontext", "kontext_inpaint", "fill"):
        kw["image"] = image(*(reference if kind.startswith("kontext") else (height, width)), seed=seed)
    if kind in ("img2img", "inpaint"):
        kw["strength"] = 0.9
    if kind in ("inpaint", "kontext_inpaint", "fill"):
        kw["mask_image"] = mask(*((rh, rw) if kind == "kontext_inpaint" else (height, width)))
    if kind.startswith("kontext"):
        kw.update(_auto_resize=False, max_area=height * width)  # Kontext rescales the output to max_area
    if kind == "control":
        kw["control_image"] = image(height, width, seed=seed + 3)
    return kw


def transformer_inputs(spec: TinyFluxSpec = TinyFluxSpec(), *, batch=1, grid=(3, 5), text=7, seed=0,
                       text_ids="zeros", reference=None):
    """Direct FluxTransformer2DModel inputs (the pipelines' layout: zero text ids, raster image ids).

    text_ids: "zeros" (the pipelines'), or "random" (diffusers' model tests: the text is rotated too).
    reference: (h, w) of a second image (Kontext: ids with first axis 1), or None.
    """
    from diffusers.pipelines.flux.pipeline_flux import FluxPipeline

    g = torch.Generator().manual_seed(seed)
    h, w = grid
    img_ids = FluxPipeline._prepare_latent_image_ids(batch, h, w, "cpu", torch.float32)
    if reference is not None:
        ref = FluxPipeline._prepare_latent_image_ids(batch, *reference, "cpu", torch.float32)
        ref[:, 0] = 1
        img_ids = torch.cat([img_ids, ref])
    n = img_ids.shape[0]
    txt_ids = torch.zeros(text, 3) if text_ids == "zeros" else torch.randn(text, 3, generator=g) * 4
    inputs = dict(hidden_states=torch.randn(batch, n, spec.in_channels, generator=g),
                  encoder_hidden_states=torch.randn(batch, text, spec.text_dim, generator=g),
                  pooled_projections=torch.randn(batch, spec.pooled_dim, generator=g),
                  timestep=torch.tensor([0.7] * batch), img_ids=img_ids, txt_ids=txt_ids)
    if spec.guidance_embeds:
        inputs["guidance"] = torch.tensor([3.5] * batch)
    return inputs


def ip_adapter(model, seed, clip_dim=8):
    """A random IP-Adapter for ``model`` in the format of diffusers' Flux loader ({"image_proj", "ip_adapter"})."""
    g = torch.Generator().manual_seed(seed)
    c, inner = model.config.joint_attention_dim, model.inner_dim

    def r(*shape):
        return torch.randn(*shape, generator=g) * 0.3

    ip = {}
    for i in range(len(model.transformer_blocks)):
        ip.update({f"{i}.to_k_ip.weight": r(inner, c), f"{i}.to_k_ip.bias": r(inner),
                   f"{i}.to_v_ip.weight": r(inner, c), f"{i}.to_v_ip.bias": r(inner)})
    return {"image_proj": {"proj.weight": r(4 * c, clip_dim), "proj.bias": r(4 * c), "norm.weight": 1 + r(c),
                           "norm.bias": r(c)}, "ip_adapter": ip}
