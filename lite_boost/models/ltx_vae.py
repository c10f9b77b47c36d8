"""Parallel-VAE adapter for diffusers' ``AutoencoderKLLTXVideo`` (the LTX-Video 0.9.0 - 0.9.5 VAEs): exact mode.

Facts it encodes (diffusers 0.42, ``autoencoder_kl_ltx.py``):

* There is no causal feature cache: ``_decode(z, temb, return_dict)`` runs ``decoder(z, temb)`` once
  over all latent frames and ``_encode(x)`` runs ``encoder(x)`` once. Framewise decoding / encoding
  (``use_framewise_decoding``) runs the networks on overlapping temporal tiles blended in time (row-local),
  spatial tiling (``enable_tiling``) on overlapping spatial tiles blended in space; each network call is
  split by rows either way.
* Every spatial convolution is the ``nn.Conv3d`` inside an ``LTXVideoCausalConv3d``: the wrapper pads
  time by replicating the first frame (and the last one when not causal: the decoder), which is
  row-local, and the inner convolution zero-pads rows and columns itself (``padding=(0, k//2, k//2)``).
  The inner convolution is the halo module; its row padding is replaced by the halo rows.
* The 0.9.0 / 0.9.1 encoder downsamples with such a convolution at stride (2, 2, 2): a band of an even
  number of rows starting on an even row, unpadded, with one halo row each side, yields exactly its own
  output rows. ``LTXVideoDownsampler3d`` (0.9.5 encoder: a stride-1 convolution, then space-to-depth,
  plus a space-to-depth residual) and ``LTXVideoUpsampler3d`` (depth-to-space) are row-local when the
  band rows are multiples of the stride: the encoder's band unit is ``patch_size`` times the product of
  its row strides; the decoder only multiplies rows.
* RMSNorm (per pixel over channels), the shortcut LayerNorm (per pixel), SiLU, the per-sample timestep
  scale / shift of 0.9.1+ decoders (broadcast over the frame), patchify / unpatchify (rows x
  ``patch_size``) are row-local. The VAE has no attention and no GroupNorm (checked: such modules raise).
* Noise injection (0.9.1 decoders, ``decoder_inject_noise``): a residual block adds an (H, W) noise
  frame drawn with ``torch.randn`` per call, which a band cannot draw alone: such blocks are the
  layout's ``band_random`` modules (each band draws the whole frame's noise and keeps its rows: the
  draws of one process, given the same RNG state on every rank).
* Chunked (temporal) mode is refused: the decoder is not causal (its convolutions read the next frames)
  and decodes every frame in one call; its own framewise decoding is its temporal split.
"""

from __future__ import annotations

from torch import nn

from ..parallel.vae import SpatialLayout, VAEAdapter, register_vae_adapter
from .wan_vae import WanVAEAdapter, _unpad_rows, _zero_bias, spatially_untiled

__all__ = ["LTXVideoVAEAdapter"]

# modules whose math mixes rows beyond a convolution's halo, or convolutions outside LTXVideoCausalConv3d:
# none in diffusers 0.42's LTX VAE
_NOT_ROW_LOCAL = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d,
                  nn.GroupNorm, nn.MultiheadAttention, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool2d, nn.AvgPool3d)


def _is_attention(mod) -> bool:
    from diffusers.models.attention_processor import Attention

    return isinstance(mod, Attention)


@register_vae_adapter("AutoencoderKLLTXVideo")
class LTXVideoVAEAdapter(VAEAdapter):
    decode_method = "_decode"
    encode_method = "_encode"
    modes = ("exact",)  # see the module docstring: chunked is refused before any collective

    def __init__(self, vae):
        super().__init__(vae)
        for kind in ("decode", "encode"):
            self.spatial_layout(kind)  # an unsupported module raises here, before any collective

    unwrap = WanVAEAdapter.unwrap  # a tensor (encode), DecoderOutput or (tensor,) (decode)

    def row_local_tail(self, inp, kind):
        # untiled: the network output as is, or temporal tiles blended in time (framewise): row-local
        return spatially_untiled(self.vae, inp, kind)

    def wrap(self, tensor, kind, *args, **kwargs):
        if kind == "encode":
            return tensor
        from diffusers.models.autoencoders.vae import DecoderOutput

        return_dict = bool(args[1]) if len(args) > 1 else bool(kwargs.get("return_dict", True))  # (temb, return_dict)
        return DecoderOutput(sample=tensor) if return_dict else (tensor,)

    # --- exact mode: which modules need halos
    def spatial_layout(self, kind):
        from diffusers.models.autoencoders import autoencoder_kl_ltx as ltx

        vae = self.vae
        root = vae.decoder if kind == "decode" else vae.encoder
        layout = SpatialLayout(root=root, unpad=lambda mod: _unpad_rows(mod, ()))
        # residual blocks that draw a noise frame: each band draws the whole frame's (module docstring)
        layout.band_random = [m for m in root.modules()
                              if isinstance(m, ltx.LTXVideoResnetBlock3d) and m.per_channel_scale1 is not None]
        inner = {id(m.conv) for m in root.modules() if isinstance(m, ltx.LTXVideoCausalConv3d)}
        unit = 1
        for name, mod in root.named_modules():
            if id(mod) in inner:
                continue
            if isinstance(mod, ltx.LTXVideoCausalConv3d):
                conv = mod.conv
                (_, k_h, _), (_, s_h, s_w), (_, p_h, _) = conv.kernel_size, conv.stride, conv.padding
                ok = conv.padding_mode == "zeros" and conv.dilation[1:] == (1, 1) and s_h == s_w
                ok = ok and ((s_h, p_h) == (1, 0) if k_h == 1 else (2 * p_h + 1 == k_h and s_h in (1, 2)))
                if not ok:
                    raise NotImplementedError(f"exact parallel VAE: unsupported spatial convolution {name}: {conv}")
                unit *= s_h
                if k_h > 1:
                    layout.halo.append((conv, p_h))
            elif isinstance(mod, ltx.LTXVideoDownsampler3d):
                unit *= mod.stride[1]  # space-to-depth of rows
            elif isinstance(mod, _NOT_ROW_LOCAL) or _is_attention(mod):
                raise NotImplementedError(f"exact parallel VAE: {type(vae).__name__} module {name} "
                                          f"({type(mod).__name__}) is not row-local; set vae_parallel='off'")
        layout.unit = unit * (vae.config.patch_size if kind == "encode" else 1)
        # residual blocks: conv1 -> norm2 (no bias) -> SiLU -> dropout -> conv2 is row-local and maps zero
        # rows to zero rows (no timestep shift, no noise in between): one exchange serves both convolutions
        halo_ids = {id(m) for m, _ in layout.halo}
        for mod in root.modules():
            if (isinstance(mod, ltx.LTXVideoResnetBlock3d) and id(mod.conv1.conv) in halo_ids
                    and id(mod.conv2.conv) in halo_ids and mod.scale_shift_table is None
                    and mod.per_channel_scale1 is None and _zero_bias(mod.norm2)
                    and isinstance(mod.nonlinearity, (nn.SiLU, nn.ReLU, nn.GELU))
                    and (not mod.training or mod.dropout.p == 0)):
                layout.pairs.append((mod.conv1.conv, mod.conv2.conv))
        return layout
