"""Tiny random-weight pipelines of the Wan-derived families (ChronoEdit, SkyReels-V2, Wan VACE), offline.

Each pipeline reuses the tiny Wan pipeline's tokenizer, UMT5 text encoder, VAE and (ChronoEdit) CLIP image
encoder from :func:`lite_boost.demo.tiny_wan_pipeline`, with the family's own transformer built from
diffusers' tiny test configuration (``tests/data/diffusers_tiny.pt``) at 3 heads (awkward for 2 ranks).
"""

from __future__ import annotations

import numpy as np
import torch

from _diffusers_tiny import init_dict, model_class

HEADS, HEAD_DIM = 3, 12  # 36 channels; head_dim 12 splits (4, 4, 4) for RoPE (t, h, w)

# family -> (transformer class, init overrides for its pipeline, pipeline class names by kind)
FAMILIES = {
    "chronoedit": ("ChronoEditTransformer3DModel",
                   dict(in_channels=36, image_dim=4, added_kv_proj_dim=HEADS * HEAD_DIM),
                   {"edit": "ChronoEditPipeline"}),
    "skyreels-v2": ("SkyReelsV2Transformer3DModel", dict(in_channels=16, out_channels=16, text_dim=32, freq_dim=32),
                    {"t2v": "SkyReelsV2Pipeline", "df": "SkyReelsV2DiffusionForcingPipeline",
                     "i2v": "SkyReelsV2ImageToVideoPipeline"}),
    # 3 main blocks, context blocks at 0 and 2; control: 16 + 16 latent channels and the 8 x 8 mask
    "wan-vace": ("WanVACETransformer3DModel", dict(in_channels=16, out_channels=16, text_dim=32, freq_dim=32,
                                                   num_layers=3, vace_layers=[0, 2], vace_in_channels=96),
                 {"v2v": "WanVACEPipeline"}),
    # Wan2.1-I2V channels (16 latent + 20 reference), pose latents of 16 channels, 16 x 16 face video
    "wan-animate": ("WanAnimateTransformer3DModel", dict(in_channels=36, latent_channels=16, out_channels=16,
                                                         text_dim=32, image_dim=4), {"animate": "WanAnimatePipeline"}),
}


def transformer(family: str, seed: int = 0, **over):
    """The family's tiny transformer (diffusers' test config at 3 heads of 12 channels, ``over`` on top)."""
    cls, pipe_over, _ = FAMILIES[family]
    torch.manual_seed(seed)
    cfg = {**init_dict(cls), "num_attention_heads": HEADS, "attention_head_dim": HEAD_DIM, **pipe_over, **over}
    return model_class(cls)(**cfg).eval()


def transformer_inputs(family: str, frames: int = 3, batch: int = 1, seed: int = 0, per_frame: bool = False) -> dict:
    """Direct inputs of the tiny transformer: a 5 x 7 token plane (odd), text of 7 tokens (512 + image with I2V);
    ``per_frame``: a timestep per latent frame (SkyReels-V2's diffusion forcing)."""
    model = transformer(family)
    g = torch.Generator().manual_seed(seed)
    cfg = model.config
    kw = dict(hidden_states=torch.randn(batch, cfg.in_channels, frames, 10, 14, generator=g),
              timestep=torch.tensor([500.0, 20.0][:batch] + [300.0] * max(0, batch - 2)))
    if per_frame:
        kw["timestep"] = (torch.rand(batch, frames, generator=g) * 900).round()
        kw["enable_diffusion_forcing"] = True
    if getattr(cfg, "motion_encoder_size", None):  # Wan Animate: pose latents (frames 1..F), 4 (F - 1) - 3 face frames
        kw["pose_hidden_states"] = torch.randn(batch, cfg.latent_channels, frames - 1, 10, 14, generator=g)
        size = cfg.motion_encoder_size
        kw["face_pixel_values"] = torch.rand(batch, 3, 4 * (frames - 1) - 3, size, size, generator=g) * 2 - 1
    if getattr(cfg, "vace_in_channels", None):  # Wan VACE: control latents on the video grid, a scale per layer
        kw["control_hidden_states"] = torch.randn(batch, cfg.vace_in_channels, frames, 10, 14, generator=g)
        kw["control_hidden_states_scale"] = torch.tensor([1.0, 0.5])
    text = 512 if getattr(cfg, "image_dim", None) else 7
    kw["encoder_hidden_states"] = torch.randn(batch, text, cfg.text_dim, generator=g)
    if getattr(cfg, "image_dim", None):
        kw["encoder_hidden_states_image"] = torch.randn(batch, 5, cfg.image_dim, generator=g)
    return kw


def pipeline(family: str, kind: str | None = None, seed: int = 0):
    """The family's tiny pipeline of ``kind`` (default: its first kind)."""
    import diffusers

    from lite_boost.demo import tiny_wan_pipeline

    kinds = FAMILIES[family][2]
    name = kinds[kind or next(iter(kinds))]
    image = family in ("chronoedit", "wan-animate") or kind == "i2v"
    base = tiny_wan_pipeline("i2v" if image else "t2v", seed=seed)
    over = dict(in_channels=36, image_dim=4, added_kv_proj_dim=HEADS * HEAD_DIM) if kind == "i2v" else {}
    parts = dict(tokenizer=base.tokenizer, text_encoder=base.text_encoder, vae=base.vae, scheduler=base.scheduler,
                 transformer=transformer(family, seed=seed + 2, **over))
    if image:
        parts.update(image_encoder=base.image_encoder, image_processor=base.image_processor)
    if family in ("chronoedit", "skyreels-v2"):  # their released schedulers (ChronoEdit's temporal reasoning needs it)
        parts["scheduler"] = diffusers.UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                                              flow_shift=3.0)
    pipe = getattr(diffusers, name)(**parts)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def call_kwargs(family: str, kind: str | None = None, *, height=48, width=80, num_frames=5, steps=2, seed=0,
                output_type="latent", guidance_scale=5.0, **extra) -> dict:
    """One tiny call (CFG on): 48 x 80 pixels = a 3 x 5 token plane, fixed generator; ``extra`` on top."""
    kw = dict(prompt="a red fox runs through fresh snow", negative_prompt="blurry low quality", height=height,
              width=width, num_frames=num_frames, num_inference_steps=steps, guidance_scale=guidance_scale,
              generator=torch.Generator().manual_seed(seed), output_type=output_type)
    rng = np.random.RandomState(seed)

    def image(h, w):
        import PIL.Image

        return PIL.Image.fromarray((rng.rand(h, w, 3) * 255).astype("uint8"))

    if family in ("chronoedit", "wan-animate") or kind == "i2v":
        kw["image"] = image(height, width)
    if family == "wan-animate":  # pose and face videos of one segment; guidance 2 (its outputs are ~15 in size)
        kw.update(pose_video=[image(height, width) for _ in range(num_frames)], segment_frame_length=num_frames,
                  face_video=[image(16, 16) for _ in range(num_frames)], guidance_scale=2.0)
        del kw["num_frames"]
    if family == "wan-vace":  # a control video and a mask (one frame kept, the rest generated)
        import PIL.Image

        rng = np.random.RandomState(seed + 1)
        kw["video"] = [PIL.Image.fromarray((rng.rand(height, width, 3) * 255).astype("uint8"))
                       for _ in range(num_frames)]
        kw["mask"] = [PIL.Image.new("L", (width, height), 0 if i == 0 else 255) for i in range(num_frames)]
    if family == "skyreels-v2" and kind == "df":
        kw.update(base_num_frames=num_frames, fps=None)
    return {**kw, **extra}
