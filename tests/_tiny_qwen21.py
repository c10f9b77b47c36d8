"""Tiny random-weight Qwen-Image 2.1 transformers, inputs and pipelines for the tests (one process and spawned ranks).

A call's sequence is laid out as the pipeline lays it out: runs of text with condition images in the places the
vision-language encoder reserved for them (one ``img_mask`` slot per 2 x 2 latent tokens), then the target image's
slots. The pipelines have no text encoder: they are called with ``prompt_embeds`` (text only, as the pipeline
takes them without its processor).
"""

from __future__ import annotations

import math

import torch

from lite_boost.demo import TinyQwenImage21Spec, tiny_qwen_image21_pipeline, tiny_qwen_image21_transformer

__all__ = ["TinyQwenImage21Spec", "transformer", "pipeline", "transformer_inputs", "kv_calls", "LAYOUTS"]

# name -> layout: ("text", tokens) runs and ("image", (h, w)) condition images, in sequence order
LAYOUTS = {
    "t2i": (("text", 7),),
    "one_condition": (("text", 3), ("image", (2, 2)), ("text", 5)),
    "two_conditions_adjacent": (("text", 2), ("image", (2, 4)), ("image", (4, 2)), ("text", 4)),
}


def transformer(spec: TinyQwenImage21Spec = TinyQwenImage21Spec(), seed: int = 0, dtype=torch.float32):
    return tiny_qwen_image21_transformer(spec, seed=seed, dtype=dtype)


def pipeline(spec: TinyQwenImage21Spec = TinyQwenImage21Spec(), seed: int = 0, dtype=torch.float32):
    return tiny_qwen_image21_pipeline(spec, seed=seed, dtype=dtype)


def transformer_inputs(spec: TinyQwenImage21Spec = TinyQwenImage21Spec(), *, layout="one_condition", target=(2, 6),
                       batch=1, pad=None, seed=0, timestep=0.7):
    """Keyword arguments of one ``QwenImage21Transformer2DModel`` call.

    target: (h, w) target tokens (h * w a multiple of 4). pad: right-padded text tokens per sample (a list of
    ``batch`` ints) or None (no ``encoder_hidden_states_mask``).
    """
    runs = LAYOUTS[layout] if isinstance(layout, str) else layout
    g = torch.Generator().manual_seed(seed)
    slots, shapes = [], []
    for kind, size in runs:
        if kind == "text":
            slots += [False] * size
        else:
            h, w = size
            assert h * w % 4 == 0, size
            slots += [True] * (h * w // 4)
            shapes.append((1, h, w))
    n_target = math.prod(target)
    assert n_target % 4 == 0, target
    vlm = len(slots)
    img_mask = torch.tensor(slots + [True] * (n_target // 4)).expand(batch, -1).clone()
    n_img = sum(math.prod(s) for s in shapes) + n_target
    inputs = dict(hidden_states=torch.randn(batch, n_img, spec.channels, generator=g),
                  encoder_hidden_states=torch.randn(batch, vlm, spec.text_dim, generator=g),
                  timestep=torch.tensor([timestep] * batch),
                  img_shapes=[shapes + [(1, *target)]] * batch, img_mask=img_mask)
    if pad is not None:
        mask = torch.ones(batch, vlm, dtype=torch.bool)
        for b, p in enumerate(pad):
            if p:
                mask[b, -p:] = False
        inputs["encoder_hidden_states_mask"] = mask
    return inputs


def kv_calls(inputs: dict, model, steps=(0.7, 0.4)):
    """The calls of a pipeline with prefix KV caching: extract at the first timestep, cached after (new noise)."""
    from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21KVCache

    cache = QwenImage21KVCache(len(model.transformer_blocks))
    calls = []
    for i, t in enumerate(steps):
        g = torch.Generator().manual_seed(100 + i)
        kw = dict(inputs, timestep=torch.full_like(inputs["timestep"], t),
                  hidden_states=torch.randn(inputs["hidden_states"].shape, generator=g).to(inputs["hidden_states"]),
                  kv_cache=cache, kv_cache_mode="extract" if i == 0 else "cached")
        calls.append(kw)
    return calls


def call_kwargs(*, height=64, width=96, steps=2, seed=0, text=(7, 5), pad=(0, 2), cfg=True, kv=True,
                output_type="latent", spec: TinyQwenImage21Spec = TinyQwenImage21Spec()):
    """One text-to-image pipeline call: prompt (and with ``cfg`` negative prompt) embeddings of ``text`` tokens,
    the last ``pad`` of them padded (``prompt_embeds_mask``), a fixed generator. 64 x 96 px = 4 x 6 target tokens
    (16x VAE)."""
    g = torch.Generator().manual_seed(seed + 1)

    def embeds(n, p):
        mask = torch.ones(1, n, dtype=torch.bool)
        if p:
            mask[:, -p:] = False
        return torch.randn(1, n, spec.text_dim, generator=g), mask

    kw = dict(height=height, width=width, num_inference_steps=steps, generator=torch.Generator().manual_seed(seed),
              output_type=output_type, use_kv_cache=kv)
    kw["prompt_embeds"], kw["prompt_embeds_mask"] = embeds(text[0], pad[0])
    if cfg:
        kw["negative_prompt_embeds"], kw["negative_prompt_embeds_mask"] = embeds(text[1], pad[1])
        kw["true_cfg_scale"] = 4.0
    return kw


def condition_image(height=32, width=64, seed=0):
    import numpy as np
    import PIL.Image

    return PIL.Image.fromarray((np.random.RandomState(seed).rand(height, width, 3) * 255).astype("uint8"))


def image_conditioned(pipe, layout=(("text", 3), ("image", None), ("text", 4)), seed=0):
    """Let a pipeline without a text encoder take condition images: its ``encode_prompt`` (on the instance) returns
    random embeddings laid out as ``layout``, one ``("image", None)`` run per condition image, sized as the
    pipeline sizes it (``calculate_dimensions`` of its ``output_resolution``)."""
    spec_dim = pipe.transformer.config.context_in_dim

    def encode_prompt(prompt=None, image=None, device=None, num_images_per_prompt=1, prompt_embeds=None,
                      prompt_embeds_mask=None, image_pad_mask=None):
        g = torch.Generator().manual_seed(seed + (0 if prompt_embeds is None else prompt_embeds.shape[1]))
        slots, images = [], list(image or [])
        for kind, size in layout:
            if kind == "text":
                slots += [False] * size
            else:
                w, h = images.pop(0).size
                slots += [True] * ((h // 16) * (w // 16) // 4)
        emb = torch.randn(1, len(slots), spec_dim, generator=g)
        return emb, None, torch.tensor([slots])

    pipe.encode_prompt = encode_prompt
    return pipe


def modular_pipeline(spec: TinyQwenImage21Spec = TinyQwenImage21Spec(), seed: int = 0, guidance_scale: float = 4.0):
    """A ``QwenImage21ModularPipeline`` of the tiny components (its denoise and decode blocks: no text or VAE
    encoder step, called with prompt embeddings), a ClassifierFreeGuidance guider."""
    from diffusers import ClassifierFreeGuidance
    from diffusers.modular_pipelines.qwenimage21 import QwenImage21AutoBlocks

    base = pipeline(spec, seed)
    blocks = QwenImage21AutoBlocks()
    for name in ("text_encoder", "vae_encoder"):
        blocks.sub_blocks.pop(name)
    pipe = blocks.init_pipeline()
    pipe.update_components(transformer=base.transformer, vae=base.vae, scheduler=base.scheduler,
                           guider=ClassifierFreeGuidance(guidance_scale=guidance_scale))
    return pipe


def modular_kwargs(**kw):
    """The modular pipeline's arguments for :func:`call_kwargs`' call (text-only layouts: no image slots)."""
    kw = call_kwargs(**kw)
    kw.pop("true_cfg_scale", None)
    for prefix in ("", "negative_"):
        if f"{prefix}prompt_embeds" in kw:
            emb = kw[f"{prefix}prompt_embeds"]
            kw[f"{prefix}image_pad_mask"] = torch.zeros(emb.shape[:2], dtype=torch.bool)
    if kw["output_type"] == "latent":
        kw["output_type"] = "pt"
    return kw


def run(pipe, kw):
    """The output tensor of a call of either pipeline kind."""
    out = pipe(**kw)
    return out.get("images") if hasattr(out, "get") else out.images
