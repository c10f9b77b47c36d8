"""Parallel-VAE adapter for diffusers' ``AutoencoderKLLTX2Video`` (the LTX-2 video VAE): exact mode.

The LTX-Video VAE's facts (:mod:`lite_boost.models.ltx_vae`) hold under the LTX-2 class names, with three
differences (diffusers 0.42, ``autoencoder_kl_ltx2.py``):

* the spatial padding mode is configurable: the encoder pads rows with zeros, the decoder (by default) reflects
  them. Reflect-padded convolutions are the layout's ``reflect`` halo modules: at the image's top and bottom
  edges their halo rows are the band's rows next to the edge, mirrored, which is what ``F.pad(mode="reflect")``
  gives the whole frame. Their row padding lives in ``_reversed_padding_repeated_twice`` (the padding the
  module applies itself before an unpadded convolution), which ``unpad`` sets to 0 for the rows;
* the residual blocks' shortcut is a plain 1 x 1 x 1 ``nn.Conv3d`` (row-local);
* ``_decode(z, temb, causal, return_dict)`` takes a ``causal`` flag (time only: row-local either way).

The audio VAE (``AutoencoderKLLTX2Audio``) and the vocoder are not split: every rank runs them whole.
"""

from __future__ import annotations

from torch import nn

from ..parallel.vae import SpatialLayout, register_vae_adapter
from .ltx_vae import _NOT_ROW_LOCAL, LTXVideoVAEAdapter, _is_attention
from .wan_vae import _zero_bias

__all__ = ["LTX2VideoVAEAdapter"]


def _unpad_rows(mod):
    """Set an inner convolution's row padding to 0 (the halo rows replace it); returns the undo."""
    if mod.padding_mode == "zeros":
        old = mod.padding
        mod.padding = tuple(old[:-2]) + (0, old[-1])
        return lambda: setattr(mod, "padding", old)
    old = mod._reversed_padding_repeated_twice  # F.pad order: (w, w, h, h, t, t)
    mod._reversed_padding_repeated_twice = [old[0], old[1], 0, 0, *old[4:]]
    return lambda: setattr(mod, "_reversed_padding_repeated_twice", old)


@register_vae_adapter("AutoencoderKLLTX2Video")
class LTX2VideoVAEAdapter(LTXVideoVAEAdapter):
    def wrap(self, tensor, kind, *args, **kwargs):
        if kind == "encode":
            return tensor
        from diffusers.models.autoencoders.vae import DecoderOutput

        return_dict = bool(args[2]) if len(args) > 2 else bool(kwargs.get("return_dict", True))  # (temb, causal, rd)
        return DecoderOutput(sample=tensor) if return_dict else (tensor,)

    def spatial_layout(self, kind):
        from diffusers.models.autoencoders import autoencoder_kl_ltx2 as ltx2

        vae = self.vae
        root = vae.decoder if kind == "decode" else vae.encoder
        layout = SpatialLayout(root=root, unpad=_unpad_rows)
        layout.band_random = [m for m in root.modules()
                              if isinstance(m, ltx2.LTX2VideoResnetBlock3d) and m.per_channel_scale1 is not None]
        inner = {id(m.conv) for m in root.modules() if isinstance(m, ltx2.LTX2VideoCausalConv3d)}
        shortcuts = {id(m.conv_shortcut) for m in root.modules()
                     if isinstance(m, ltx2.LTX2VideoResnetBlock3d) and isinstance(m.conv_shortcut, nn.Conv3d)}
        unit = 1
        for name, mod in root.named_modules():
            if id(mod) in inner:
                continue
            if id(mod) in shortcuts:
                if mod.kernel_size != (1, 1, 1) or mod.stride != (1, 1, 1) or mod.padding != (0, 0, 0):
                    raise NotImplementedError(f"exact parallel VAE: unsupported shortcut convolution {name}: {mod}")
            elif isinstance(mod, ltx2.LTX2VideoCausalConv3d):
                conv = mod.conv
                (_, k_h, _), (_, s_h, s_w), (_, p_h, _) = conv.kernel_size, conv.stride, conv.padding
                ok = conv.padding_mode in ("zeros", "reflect") and conv.dilation[1:] == (1, 1) and s_h == s_w
                ok = ok and ((s_h, p_h) == (1, 0) if k_h == 1 else (2 * p_h + 1 == k_h and s_h in (1, 2)))
                if not ok:
                    raise NotImplementedError(f"exact parallel VAE: unsupported spatial convolution {name}: {conv}")
                unit *= s_h
                if k_h > 1:
                    layout.halo.append((conv, p_h))
                    if conv.padding_mode == "reflect":
                        layout.reflect.append(conv)
            elif isinstance(mod, ltx2.LTX2VideoDownsampler3d):
                unit *= mod.stride[1]  # space-to-depth of rows
            elif isinstance(mod, _NOT_ROW_LOCAL) or _is_attention(mod):
                raise NotImplementedError(f"exact parallel VAE: {type(vae).__name__} module {name} "
                                          f"({type(mod).__name__}) is not row-local; set vae_parallel='off'")
        unit *= vae.config.patch_size if kind == "encode" else 1
        # a reflected halo row needs a band of at least (halo + 1) rows: bands of 2 rows at least
        layout.unit = 2 * unit if layout.reflect and unit < 2 else unit
        halo_ids = {id(m) for m, _ in layout.halo} - {id(m) for m in layout.reflect}
        for mod in root.modules():  # one exchange for conv1 -> norm -> SiLU -> conv2 (zero-padded, no noise)
            if (isinstance(mod, ltx2.LTX2VideoResnetBlock3d) and id(mod.conv1.conv) in halo_ids
                    and id(mod.conv2.conv) in halo_ids and mod.scale_shift_table is None
                    and mod.per_channel_scale1 is None and _zero_bias(mod.norm2)
                    and isinstance(mod.nonlinearity, (nn.SiLU, nn.ReLU, nn.GELU))
                    and (not mod.training or mod.dropout.p == 0)):
                layout.pairs.append((mod.conv1.conv, mod.conv2.conv))
        return layout
