"""Tiny random-weight ControlNet pipelines (Flux.1, Qwen-Image) and their call arguments for the tests.

The pipelines reuse the tiny family pipelines (tests/_tiny_flux.py, lite_boost.demo) and add a ControlNet model of
the same width. diffusers zero-initialises a ControlNet's residual projections; the tests draw every ControlNet
weight at random so the residuals change the output. Called with prompt embeddings (no text encoders).
"""

from __future__ import annotations

import torch

KINDS = ("flux", "flux_multi", "qwen", "qwen_multi")  # qwen_multi: one ControlNet (union) in the wrapper


def _randomize(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model.eval()


def flux_controlnet(seed=7, layers=2, single_layers=1):
    import _tiny_flux as tf
    from diffusers import FluxControlNetModel

    s = tf.TinyFluxSpec()
    torch.manual_seed(seed)
    return _randomize(FluxControlNetModel(
        patch_size=1, in_channels=s.in_channels, num_layers=layers, num_single_layers=single_layers,
        attention_head_dim=s.head_dim, num_attention_heads=s.heads, joint_attention_dim=s.text_dim,
        pooled_projection_dim=s.pooled_dim, axes_dims_rope=list(s.axes)), seed)


def qwen_controlnet(seed=7, layers=2):
    from diffusers import QwenImageControlNetModel

    from lite_boost.demo import TinyQwenImageSpec

    s = TinyQwenImageSpec()
    torch.manual_seed(seed)
    return _randomize(QwenImageControlNetModel(
        patch_size=2, in_channels=s.in_channels, out_channels=s.out_channels, num_layers=layers,
        attention_head_dim=s.head_dim, num_attention_heads=s.heads, joint_attention_dim=s.text_dim,
        axes_dims_rope=s.axes), seed)


def pipeline(kind: str = "flux"):
    """FluxControlNetPipeline / QwenImageControlNetPipeline (``*_multi``: two ControlNets in the Multi wrapper)."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {list(KINDS)}, got {kind!r}")
    if kind.startswith("flux"):
        import _tiny_flux as tf
        from diffusers import FluxControlNetPipeline, FluxMultiControlNetModel

        base = tf.pipeline("t2i")
        controlnet = flux_controlnet()
        if kind == "flux_multi":
            controlnet = FluxMultiControlNetModel([controlnet, flux_controlnet(seed=8, layers=1)])
        pipe = FluxControlNetPipeline(scheduler=base.scheduler, vae=base.vae, text_encoder=None, tokenizer=None,
                                      text_encoder_2=None, tokenizer_2=None, transformer=base.transformer,
                                      controlnet=controlnet)
    else:
        from diffusers import QwenImageControlNetPipeline, QwenImageMultiControlNetModel

        from lite_boost.demo import tiny_qwen_image_pipeline

        base = tiny_qwen_image_pipeline("t2i")
        controlnet = qwen_controlnet()
        if kind == "qwen_multi":
            controlnet = QwenImageMultiControlNetModel([controlnet])  # diffusers takes one (a union ControlNet)
        pipe = QwenImageControlNetPipeline(scheduler=base.scheduler, vae=base.vae, text_encoder=None, tokenizer=None,
                                           transformer=base.transformer, controlnet=controlnet)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def call_kwargs(kind: str = "flux", *, cfg: bool = True, steps: int = 2):
    """One call: prompt embeddings (and negatives for true CFG), a control image (two for ``*_multi``), latents out."""
    multi = kind == "flux_multi"
    if kind.startswith("flux"):
        import _tiny_flux as tf

        kw = tf.call_kwargs("t2i", cfg=cfg, steps=steps)
        h, w = kw["height"], kw["width"]
    else:
        from _qwen_cases import call_kwargs as qwen_call

        kw = qwen_call("t2i", cfg=cfg, steps=steps)
        h, w = kw["height"], kw["width"]
        import _tiny_flux as tf
    images = [tf.image(h, w, seed=5), tf.image(h, w, seed=6)]
    kw["control_image"] = images if multi else [images[0]] if kind == "qwen_multi" else images[0]
    kw["controlnet_conditioning_scale"] = [1.0, 0.5] if multi else [0.8] if kind == "qwen_multi" else 0.8
    return kw
