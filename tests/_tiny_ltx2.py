"""Tiny random-weight LTX-2 transformers / pipelines (lite_boost.demo) and their call arguments.

The transformer has 4 video heads x 6 (inner 24) and 2 audio heads x 8 (inner 16); the pipelines' video VAE
compresses 32 x 32 x 8 like the released model, the audio VAE gives 25 audio latents per second. No text
encoder: the pipelines get Gemma-shaped ``prompt_embeds`` (B, T, 16 x 2) with left-padded masks.
"""

from __future__ import annotations

import torch

from lite_boost.demo import TinyLTX2Spec, ltx2_prompt_embeds, tiny_ltx2_pipeline, tiny_ltx2_transformer

__all__ = ["TinyLTX2Spec", "tiny_ltx2_pipeline", "tiny_ltx2_transformer", "transformer_inputs", "call_kwargs",
           "image"]


def transformer_inputs(spec: TinyLTX2Spec = TinyLTX2Spec(), *, batch=2, grid=(2, 3, 5), audio=7, text=6, seed=0,
                       coords=False, per_token=False, masked=True, fps=24.0):
    """Direct LTX2VideoTransformer3DModel inputs: padded text (each sample its own length), one timestep per
    sample (or per video token with ``per_token``: the first frame's tokens at 0); ``coords``: the video /
    audio coordinates passed in (as the pipelines do), else built by the model from the grid."""
    g = torch.Generator().manual_seed(seed)
    f, h, w = grid
    n = f * h * w
    mask = torch.ones(batch, text, dtype=torch.long)
    if masked:
        for b in range(batch):
            mask[b, : 1 + b] = 0
    timestep = torch.full((batch,), 700.0)
    kw = dict(hidden_states=torch.randn(batch, n, 4, generator=g), audio_hidden_states=torch.randn(batch, audio, 4, generator=g),
              encoder_hidden_states=torch.randn(batch, text, spec.text_dim, generator=g),
              audio_encoder_hidden_states=torch.randn(batch, text, spec.text_dim, generator=g),
              timestep=timestep, encoder_attention_mask=mask, audio_encoder_attention_mask=mask.clone(),
              num_frames=f, height=h, width=w, fps=fps, audio_num_frames=audio)
    if per_token:
        ts = timestep[:, None].repeat(1, n)
        ts[:, : h * w] = 0.0
        kw.update(timestep=ts, audio_timestep=timestep.clone())
    if coords:
        model = tiny_ltx2_transformer(spec)
        vc = model.rope.prepare_video_coords(batch, f, h, w, torch.device("cpu"), fps=fps)
        kw.update(video_coords=vc, audio_coords=model.audio_rope.prepare_audio_coords(batch, audio, torch.device("cpu")))
    return kw


def image(height: int, width: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(1, 3, height, width, generator=g)


def call_kwargs(kind="t2v", *, height=96, width=160, frames=17, steps=2, seed=0, text=8, guidance=3.0, stg=0.0,
                modality=1.0, stg_blocks=None, output_type="latent", valid=(6, 3), batch=1, dim=32):
    """One pipeline call: left-padded prompt / negative prompt embeddings, CFG on (guidance > 1), fixed generator.

    96 x 160 x 17 pixels = 3 x 3 x 5 = 45 video tokens and 18 audio tokens. ``stg`` / ``modality``: LTX-2's
    spatio-temporal (on ``stg_blocks``) and modality-isolation guidance, each one more transformer call a step.
    """
    pe, pm = ltx2_prompt_embeds(text, batch=batch, dim=dim, seed=seed + 1, valid=[valid[0]] * batch)
    ne, nm = ltx2_prompt_embeds(text, batch=batch, dim=dim, seed=seed + 2, valid=[valid[1]] * batch)
    kw = dict(prompt_embeds=pe, prompt_attention_mask=pm, negative_prompt_embeds=ne, negative_prompt_attention_mask=nm,
              height=height, width=width, num_frames=frames, frame_rate=24.0, num_inference_steps=steps,
              guidance_scale=guidance, audio_guidance_scale=guidance, stg_scale=stg, audio_stg_scale=stg,
              modality_scale=modality, audio_modality_scale=modality, spatio_temporal_guidance_blocks=stg_blocks,
              generator=torch.Generator().manual_seed(seed), output_type=output_type)
    if kind == "i2v":
        kw.update(image=image(height, width, seed), image_crf=0)  # no H.264 re-compression of the image
    return kw


def run(pipe, kind="t2v", **kw):
    """(video, audio) of one call."""
    out = pipe(**call_kwargs(kind, **kw))
    return out.frames, out.audio
