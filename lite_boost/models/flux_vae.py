"""Parallel-VAE adapter for diffusers' 2-D ``AutoencoderKL`` (Flux.1's VAE) and ``AutoencoderKLFlux2`` (Flux.2's).

Facts it encodes (diffusers 0.42, ``autoencoder_kl.py``, ``autoencoder_kl_flux2.py``, ``vae.py``):

* Both build their networks from ``vae.py``'s ``Encoder`` / ``Decoder``: ``_decode(z, return_dict)`` runs the
  1x1 ``post_quant_conv`` (if any) and ``decoder(z)`` once and returns ``DecoderOutput`` / ``(sample,)``;
  ``_encode(x)`` runs ``encoder(x)`` and the 1x1 ``quant_conv`` (if any). Flux.2's latent ``BatchNorm2d``
  (``vae.bn``) is applied by the pipelines outside these methods.
* The networks: 3x3 ``Conv2d`` (stride 1, zero padding 1: halo modules, their row padding replaced by the
  halo rows), 1x1 convolutions (row-local), ``ResnetBlock2D`` (GroupNorm, SiLU, dropout), nearest 2x
  ``Upsample2D`` + 3x3 conv (the decoder's bands double: unit 1), ``Downsample2D`` with ``padding=0`` (an
  explicit ``(0, 1, 0, 1)`` zero pad, then a stride-2 3x3 conv: the layout's ``bottom_halo``; the encoder's
  band unit is ``2 ** downsamplers``), and a ``UNetMidBlock2D`` whose ``Attention`` attends over all
  positions: it sees the gathered input (its own GroupNorm included) and keeps its band of the output.
* Every other ``GroupNorm`` (the resnets' ``norm1`` / ``norm2``, ``conv_norm_out``) normalises over all rows
  of a group: the layout's ``group_norm`` modules (statistics merged over the bands,
  :mod:`lite_boost.parallel.vae.norms`).
* Spatial tiling (``enable_tiling``) lives inside ``_decode`` / ``_encode`` and calls the network per tile:
  each tile call is split the same way and gathered; the blending is the model's code.
* Anything else in the networks (a SpatialNorm decoder, FIR / conv-transpose resamplers, resnets that resample
  or take a time embedding) is refused when the adapter is made, before any collective. Chunked (temporal)
  mode is refused: an image has no frames to spread.
"""

from __future__ import annotations

from torch import nn

from ..parallel.vae import SpatialLayout, VAEAdapter, register_vae_adapter
from .wan_vae import WanVAEAdapter, _unpad_rows

__all__ = ["Flux2DVAEAdapter"]


def _allowed():
    from diffusers.models.autoencoders.vae import Decoder, Encoder
    from diffusers.models.unets.unet_2d_blocks import DownEncoderBlock2D, UNetMidBlock2D, UpDecoderBlock2D

    return (Decoder, Encoder, DownEncoderBlock2D, UpDecoderBlock2D, UNetMidBlock2D, nn.ModuleList, nn.SiLU,
            nn.GELU, nn.Mish, nn.ReLU, nn.Dropout, nn.Identity)


def _is_3x3(conv) -> bool:
    return (conv.kernel_size == (3, 3) and conv.dilation == (1, 1) and conv.groups == 1
            and conv.padding_mode == "zeros")


@register_vae_adapter("AutoencoderKL", "AutoencoderKLFlux2")
class Flux2DVAEAdapter(VAEAdapter):
    decode_method = "_decode"
    encode_method = "_encode"
    modes = ("exact",)  # an image: no frames for the chunked mode

    def __init__(self, vae):
        super().__init__(vae)
        for kind in ("decode", "encode"):
            if getattr(vae, "decoder" if kind == "decode" else "encoder", None) is not None:
                self.spatial_layout(kind)  # an unsupported module raises here, before any collective

    unwrap = WanVAEAdapter.unwrap  # a tensor (encode), DecoderOutput or (tensor,) (decode)

    def row_local_tail(self, inp, kind):
        # untiled: the network output as is (after a 1x1 conv); tiled: the tiles are blended (square tile sizes)
        vae = self.vae
        if not vae.use_tiling:
            return True
        h, w = inp.shape[-2:]
        size = vae.tile_latent_min_size if kind == "decode" else vae.tile_sample_min_size
        return not (w > size or h > size)

    def wrap(self, tensor, kind, *args, **kwargs):
        if kind == "encode":
            return tensor
        from diffusers.models.autoencoders.vae import DecoderOutput

        return_dict = bool(args[0]) if args else bool(kwargs.get("return_dict", True))  # _decode(z, return_dict)
        return DecoderOutput(sample=tensor) if return_dict else (tensor,)

    def spatial_layout(self, kind):
        from diffusers.models.attention_processor import Attention
        from diffusers.models.downsampling import Downsample2D
        from diffusers.models.resnet import ResnetBlock2D
        from diffusers.models.upsampling import Upsample2D

        vae = self.vae
        root = vae.decoder if kind == "decode" else vae.encoder
        layout = SpatialLayout(root=root, unpad=lambda mod: _unpad_rows(mod, ()))
        allowed = _allowed()
        skip, bottom = set(), set()
        unit = 1

        def refuse(name, mod, why=""):
            raise NotImplementedError(f"exact parallel VAE: {type(vae).__name__}.{'decoder' if kind == 'decode' else 'encoder'}"
                                      f" module {name} ({type(mod).__name__}{why}) is not supported; set "
                                      "vae_parallel='off'")

        for name, mod in root.named_modules():
            if id(mod) in skip:
                continue
            if isinstance(mod, Attention):
                if getattr(mod, "spatial_norm", None) is not None:
                    refuse(name, mod, " with a spatial norm")
                layout.gather.append(mod)  # sees the gathered input: its submodules run as they are
                skip.update(id(m) for m in mod.modules())
            elif isinstance(mod, nn.GroupNorm):
                layout.group_norm.append(mod)
            elif isinstance(mod, ResnetBlock2D):
                if (mod.up or mod.down or mod.upsample is not None or mod.downsample is not None
                        or mod.time_emb_proj is not None):
                    refuse(name, mod, ": resampling or time-conditioned")
            elif isinstance(mod, Upsample2D):
                if mod.use_conv_transpose or not mod.interpolate or mod.norm is not None:
                    refuse(name, mod, ": not nearest interpolation + conv")
            elif isinstance(mod, Downsample2D):
                conv = getattr(mod, "conv", None)
                if (not mod.use_conv or mod.padding != 0 or mod.norm is not None or not isinstance(conv, nn.Conv2d)
                        or not _is_3x3(conv) or conv.stride != (2, 2) or conv.padding != (0, 0)):
                    refuse(name, mod, ": not a (0, 1, 0, 1) pad + stride-2 3x3 conv")
                layout.bottom_halo.append(conv)
                bottom.add(id(conv))
                unit *= 2
            elif isinstance(mod, nn.Conv2d):
                if id(mod) in bottom:
                    continue
                if mod.kernel_size == (1, 1) and mod.stride == (1, 1) and mod.padding == (0, 0):
                    continue  # row-local
                if _is_3x3(mod) and mod.stride == (1, 1) and mod.padding == (1, 1):
                    layout.halo.append((mod, 1))
                    continue
                refuse(name, mod, f": kernel {mod.kernel_size}, stride {mod.stride}, padding {mod.padding}")
            elif not isinstance(mod, allowed):
                refuse(name, mod)
        layout.unit = unit if kind == "encode" else 1
        return layout
