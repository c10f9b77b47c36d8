"""Parallel-VAE adapter for diffusers' ``AutoencoderKLHunyuanVideo15`` (HunyuanVideo-1.5's VAE).

Facts it encodes (diffusers 0.42, ``autoencoder_kl_hunyuanvideo15.py``):

* ``_decode(z)`` / ``_encode(x)`` return a tensor and run the whole clip through ``decoder`` /
  ``encoder`` in ONE call (no per-frame loop, no feature cache): time is causal inside the network
  (3-tap causal convolutions, a frame-causal attention mask, first-frame special cases in the
  temporal up/down samplers). A fresh call on the latent frames ``[w, stop)`` therefore treats frame
  ``w`` as frame 0 and a prefix call is the sequential prefix: the frame bookkeeping of
  ``AutoencoderKLWan`` (``t = temporal_compression_ratio``: latent frame 0 <-> video frame 0, latent
  frame ``i >= 1`` <-> video frames ``[1 + t(i-1), 1 + t*i)``), reused below for the chunked mode.
* ``HunyuanVideo15CausalConv3d`` pads with ``F.pad(x, (k//2, k//2, k//2, k//2, k-1, 0),
  mode="replicate")``, then runs an unpadded stride-1 ``Conv3d``: in space the edge rows are
  REPLICATED, not zero-padded. The exact mode sets the row padding to 0 during a split call and its
  halo rows take its place, copies of the edge row at the image's top and bottom
  (``SpatialLayout.replicate``); replicate padding is a clamp of the indices, so the composition with
  the (unchanged) time and width padding is exactly the full frame's.
* ``HunyuanVideo15RMS_norm`` is ``F.normalize`` over channels, times a scale, gamma and bias: per
  pixel, row-local. The residual blocks' ``conv_shortcut`` and the attention projections are 1x1x1.
* ``HunyuanVideo15Upsample`` / ``HunyuanVideo15Downsample``: a 3x3x3 causal conv (stride 1) and a
  pixel (un)shuffle by 2 in rows and columns (and 2 in time when temporal), plus a channel
  repeat / group-mean shortcut: row-local once every band has an even number of rows at each
  downsampler's input, i.e. the encoder's band unit is ``2 ** (number of downsamplers)``; the decoder's
  bands double at each upsampler (unit 1). The encoder's final shortcut is a channel group mean.
* ``HunyuanVideo15AttnBlock`` (the mid block's) attends over ALL ``frames * height * width``
  positions (frame-causal mask): it sees the gathered input and keeps its band of the output.
* Spatial tiling (``enable_tiling``) lives inside ``_decode`` / ``_encode`` and calls the network per
  tile: each tile call is split the same way, its output gathered; the blending is the model's code.
"""

from __future__ import annotations

import torch
from torch import nn

from ..parallel.vae import SpatialLayout, VAEAdapter, register_vae_adapter
from .wan_vae import WanVAEAdapter

__all__ = ["HunyuanVideo15VAEAdapter", "HUNYUAN15_VAE_FIRST_UNIT_COST"]

# A fresh call's first unit over a later one, by output frames (frame 0 yields 1 video frame, a later
# latent frame t = 4). An estimate, not a measurement: the low-resolution stages cost the same per
# latent frame and the mid attention grows with the frames, so the true ratio is somewhat higher.
HUNYUAN15_VAE_FIRST_UNIT_COST = 0.25


@register_vae_adapter("AutoencoderKLHunyuanVideo15")
class HunyuanVideo15VAEAdapter(VAEAdapter):
    decode_method = "_decode"
    encode_method = "_encode"
    # chunked mode's warm-up frames: Wan's defaults, NOT a seam study of this VAE (no trained weights offline)
    default_overlap = 2
    default_encode_overlap = 2

    def __init__(self, vae):
        super().__init__(vae)
        cfg = vae.config
        self.t = cfg.temporal_compression_ratio
        self.scale = cfg.spatial_compression_ratio
        self.out_channels = cfg.out_channels
        self.z_dim = cfg.latent_channels

    # --- frame bookkeeping and chunk runs: Wan's (one fresh network call per chunk, frame w as frame 0)
    num_units = WanVAEAdapter.num_units
    out_frames = WanVAEAdapter.out_frames
    out_shape = WanVAEAdapter.out_shape
    run_chunk = WanVAEAdapter.run_chunk

    def decode_tensor(self, inner, z):
        return inner(z)  # _decode(z) returns the video tensor itself

    def chunk_cost(self, warm_start, start, stop, kind):
        extra = 1 if (kind == "encode" and start > 0) else 0
        return HUNYUAN15_VAE_FIRST_UNIT_COST + (stop - warm_start - 1 + extra)

    def row_local_tail(self, inp, kind):
        # untiled: _decode / _encode return the network's output as it is; tiled: tiles are blended
        vae = self.vae
        if not vae.use_tiling:
            return True
        h, w = inp.shape[-2:]
        if kind == "decode":
            return not (w > vae.tile_latent_min_width or h > vae.tile_latent_min_height)
        return not (w > vae.tile_sample_min_width or h > vae.tile_sample_min_height)

    # --- exact mode
    def spatial_layout(self, kind):
        from diffusers.models.autoencoders import autoencoder_kl_hunyuanvideo15 as hv

        root = self.vae.decoder if kind == "decode" else self.vae.encoder
        layout = SpatialLayout(root=root, unpad=_unpad_rows)
        n_down = 0
        inner_convs = set()
        for name, mod in root.named_modules():
            if isinstance(mod, hv.HunyuanVideo15AttnBlock):
                layout.gather.append(mod)
            elif isinstance(mod, hv.HunyuanVideo15Downsample):
                n_down += 1
            elif isinstance(mod, hv.HunyuanVideo15CausalConv3d):
                conv = mod.conv
                inner_convs.add(id(conv))
                k_h = conv.kernel_size[1]
                pad = mod.time_causal_padding  # (w, w, h, h, t, 0): F.pad order
                if (conv.stride != (1, 1, 1) or conv.dilation != (1, 1, 1) or conv.padding != (0, 0, 0)
                        or pad[2] != pad[3] or 2 * pad[2] + 1 != k_h
                        or mod.pad_mode not in ("replicate", "constant")):
                    raise NotImplementedError(f"exact parallel VAE: unsupported causal convolution {name}: {mod} "
                                              f"(padding {pad}, mode {mod.pad_mode!r})")
                if k_h == 1:
                    continue
                layout.halo.append((mod, pad[2]))
                if mod.pad_mode == "replicate":
                    layout.replicate.append(mod)
            elif isinstance(mod, (nn.Conv1d, nn.Conv2d, nn.Conv3d)) and id(mod) not in inner_convs:
                if any(k != 1 for k in mod.kernel_size) or any(s != 1 for s in mod.stride):
                    raise NotImplementedError(f"exact parallel VAE: unexpected spatial module {name}: {mod}")
            elif isinstance(mod, (nn.GroupNorm, nn.BatchNorm3d, nn.MaxPool3d, nn.AvgPool3d, nn.Upsample)):
                raise NotImplementedError(f"exact parallel VAE: module {name} ({type(mod).__name__}) is not row-local")
        layout.unit = 2 ** n_down if kind == "encode" else 1
        return layout


def _unpad_rows(mod):
    """Set a causal convolution's row padding to 0 (the halo rows replace it); returns the undo."""
    old = mod.time_causal_padding
    mod.time_causal_padding = (old[0], old[1], 0, 0, old[4], old[5])
    return lambda: setattr(mod, "time_causal_padding", old)
