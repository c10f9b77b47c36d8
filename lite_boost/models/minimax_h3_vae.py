"""Parallel-VAE adapter for diffusers' ``AutoencoderKLMiniMaxH3`` (MiniMax-H3's video VAE): exact mode by whole clips.

Facts it encodes (diffusers 0.42, ``autoencoder_kl_minimax_h3.py``):

* ``_decode(z)`` pads the latent frames by repeating the last one up to whole chunks of ``tokens_chunk_size``
  (``num_tokens = frames + token_drop``, ``pad = -num_tokens % tokens_chunk_size``), then calls
  ``_decode_clip`` on the windows ``z[:, :, i * tokens_chunk_size : i * tokens_chunk_size + tokens_chunk_size +
  token_overlap]`` for ``i < num_tokens_padded // tokens_chunk_size - (token_drop > 0)``, and only then
  cross-fades consecutive clips over ``frame_overlap`` frames, drops ``frame_pre_padding`` leading frames of
  each and trims the padded tail. ``_decode_clip`` (the ViT decoder attending the whole clip, spatially tiled
  when tiling is on) reads nothing but its window: the clips are independent.
* ``_encode(x)`` runs ``_encode_clip`` on one frame alone (a single image) or on the ``clip_length``-frame
  chunks of the video padded with copies of its last frame, concatenates the moments and drops the last
  ``token_drop`` latent frames. The causal encoder starts afresh in every chunk: independent too.

So exact mode hands whole clips to the ranks (:mod:`lite_boost.parallel.vae.clips`): each rank runs the stock
``_decode_clip`` / ``_encode_clip`` on its clips (with diffusers' spatial tiling inside when enabled), every
rank receives every clip output, and every rank runs diffusers' own ``_decode`` / ``_encode`` on them, the
cross-fade and trims included; the result is the one-process result. ``clip_inputs`` below repeats the
window arithmetic so the runner knows the clips before the call; the runner checks each predicted window
against the one ``_decode`` / ``_encode`` actually passes (``torch.equal``) and raises if diffusers changes.
There is no row split (the ViT decoder attends every latent voxel of a clip; the encoder's GroupNorms span
the frame) and no ``"chunked"`` mode (the clips already are the temporal chunks, exactly).

The audio VAE (``AutoencoderKLMiniMaxH3Audio``, the pipeline's ``audio_vae``) has no adapter: every rank
decodes the soundtrack whole.
"""

from __future__ import annotations

import torch

from ..parallel.vae import VAEAdapter, register_vae_adapter

__all__ = ["MiniMaxH3VAEAdapter"]


@register_vae_adapter("AutoencoderKLMiniMaxH3")
class MiniMaxH3VAEAdapter(VAEAdapter):
    decode_method = "_decode"
    encode_method = "_encode"
    modes = ("exact",)

    def clip_method(self, kind):
        return "_decode_clip" if kind == "decode" else "_encode_clip"

    def clip_inputs(self, inp, kind, *args, **kwargs):
        vae = self.vae
        if kind == "decode":  # _decode's windows
            size, drop = vae.tokens_chunk_size, vae.config.token_drop
            num_tokens = inp.shape[2] + drop
            pad = (-num_tokens) % size
            num_clips = (num_tokens + pad) // size - int(drop > 0)
            z = torch.cat([inp, inp[:, :, -1:].repeat(1, 1, pad, 1, 1)], dim=2) if pad else inp
            return [z[:, :, i * size:i * size + size + vae.token_overlap] for i in range(num_clips)]
        clip_length = vae.config.clip_length  # _encode's chunks
        frames = inp.shape[2]
        if frames == 1:
            return [inp]
        x = inp
        if frames % clip_length:
            x = torch.cat([inp, inp[:, :, -1:].repeat(1, 1, (-frames) % clip_length, 1, 1)], dim=2)
        return [x[:, :, i * clip_length:(i + 1) * clip_length] for i in range(x.shape[2] // clip_length)]

    def spatial_layout(self, kind):
        raise NotImplementedError(f"{type(self.vae).__name__} runs exact mode by whole clips, not by rows")
