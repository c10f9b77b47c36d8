"""Tiny Qwen-Image pipelines and their call arguments for the tests (single process and spawned ranks).

The Edit pipelines resize their condition images to about 1024 x 1024 pixels whatever the output size
(16,384 tokens with the tiny 4x VAE); :func:`small_condition_images` caps that area for the tests, as
a patch of the pipeline modules' ``calculate_dimensions`` (undone by the returned function).
"""

from __future__ import annotations

import numpy as np
import torch

# condition images are resized to about this many pixels (32 x 64 -> 4 x 8 tokens with the tiny VAE)
CONDITION_AREA = 32 * 64


def small_condition_images(area: int = CONDITION_AREA):
    """Cap the Edit pipelines' condition-image area; returns the function that restores diffusers'."""
    import diffusers.pipelines.qwenimage.pipeline_qwenimage_edit as edit
    import diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus as edit_plus

    originals = [(m, m.calculate_dimensions) for m in (edit, edit_plus)]
    for module, orig in originals:
        module.calculate_dimensions = (lambda o: (lambda target_area, ratio: o(min(target_area, area), ratio)))(orig)

    def restore():
        for module, orig in originals:
            module.calculate_dimensions = orig

    return restore


def image(height=32, width=64, seed=0):
    import PIL.Image

    return PIL.Image.fromarray((np.random.RandomState(seed).rand(height, width, 3) * 255).astype("uint8"))


def call_kwargs(kind: str, *, height=24, width=40, steps=2, seed=0, text=(7, 5), batch=1, valid=None,
                cfg=True, output_type="latent", dim=16):
    """One pipeline call: cond / uncond prompt embeddings of different lengths, CFG on, fixed generator.

    text: (cond length, uncond length). valid: real tokens per batch element (padding masks) or None.
    24 x 40 pixels = 3 x 5 tokens (an odd grid).
    """
    from lite_boost.demo import qwen_prompt_embeds

    pe, pm = qwen_prompt_embeds(text[0], batch=batch, dim=dim, seed=seed + 1, valid=valid)
    kw = dict(prompt_embeds=pe, prompt_embeds_mask=pm, height=height, width=width, num_inference_steps=steps,
              generator=torch.Generator().manual_seed(seed), output_type=output_type)
    if cfg:
        ne, nm = qwen_prompt_embeds(text[1], batch=batch, dim=dim, seed=seed + 2,
                                    valid=None if valid is None else [min(v, text[1]) for v in valid])
        kw.update(negative_prompt_embeds=ne, negative_prompt_embeds_mask=nm, true_cfg_scale=4.0)
    if kind == "edit":
        kw["image"] = image(seed=seed)
    elif kind == "edit_plus":
        kw["image"] = [image(seed=seed), image(seed=seed + 1)]
    return kw


def transformer_inputs(spec, *, batch=1, grid=(3, 5), text=8, seed=0, masked=False, condition=None):
    """Direct QwenImageTransformer2DModel inputs (diffusers' model-test layout, at other sizes).

    condition: (h, w) of a second image (Edit layout: target + condition tokens), or None.
    """
    g = torch.Generator().manual_seed(seed)
    h, w = grid
    shapes = [(1, h, w)] + ([(1, *condition)] if condition else [])
    n = sum(f * a * b for f, a, b in shapes)
    mask = torch.ones(batch, text, dtype=torch.long)
    if masked:
        for b in range(batch):
            mask[b, max(1, text - 2 - b):] = 0
    return dict(hidden_states=torch.randn(batch, n, spec.in_channels, generator=g),
                encoder_hidden_states=torch.randn(batch, text, spec.text_dim, generator=g),
                encoder_hidden_states_mask=mask, timestep=torch.tensor([0.7] * batch),
                img_shapes=[shapes] * batch)
