"""Parallel-VAE adapter for diffusers' ``AutoencoderKLWan`` (Wan2.1 and Wan2.2 VAEs).

Facts it encodes (diffusers 0.42, ``autoencoder_kl_wan.py``):

* ``_decode(z, return_dict)`` runs ``decoder`` once per latent frame with a fresh causal cache; the
  first call of a fresh cache yields one video frame (the temporal upsamplers replicate instead of
  convolving), every later one ``t = 2 ** sum(temperal_downsample)`` frames (4 for Wan). A fresh
  ``_decode`` on the latent frames ``[w, stop)`` therefore treats frame ``w`` as frame 0: that is
  exactly the warm-up of a chunk starting at ``start > w`` (drop the first ``1 + t * (start - w - 1)``
  frames), and exactly the sequential decode when ``w == 0`` (a prefix decode is bit-identical).
* ``_encode(x)`` runs ``encoder`` on video frame 0 alone, then on groups of ``t`` frames (latent
  frame ``i >= 1`` comes from video frames ``[1 + t(i-1), 1 + t*i)``), and applies ``quant_conv``. A
  fresh ``_encode`` starting at video frame ``t*(w-1)`` (the last frame of group ``w - 1``) plays that
  frame as frame 0, then groups ``w, w+1, ...``: the warm-up of an encode chunk.
* Spatial tiling (``enable_tiling``) lives inside ``_decode`` / ``_encode`` and the networks are
  called per tile, so both modes compose with it unchanged.
* Spatially, every module is row-local except the 3x3 convolutions (``WanCausalConv3d`` with a
  spatial kernel, the ``Conv2d`` after each nearest upsample: zero padding 1), the stride-2
  downsampling ``Conv2d`` after ``ZeroPad2d((0, 1, 0, 1))``, and ``WanAttentionBlock`` (attention over
  all positions of a frame): those are what the exact mode hooks.
* Wan2.2's 48-channel VAE (TI2V-5B: ``z_dim 48``, ``is_residual``, ``patch_size 2``, scale 16) adds
  only row-local pieces: ``patchify`` before the encoder network and ``unpatchify`` after the decoder
  network (inside ``_encode`` / ``_decode``, outside the split network calls: the encoder's bands are
  in patchified rows and the deferred gather scales the decoder's bands by 8 x 2); and the residual
  shortcuts ``AvgDown3D`` (space-to-channel by ``factor_s`` rows, then a channel mean) and
  ``DupUp3D`` (channel-to-space by ``factor_s``, its ``first_chunk`` frame drop is temporal).
  ``AvgDown3D`` stays inside a band when the band's rows are a multiple of ``factor_s`` at its
  resolution: every such shortcut sits beside one of the stride-2 downsamplings, whose product is
  the encoder's band unit (checked). The config's ``out_channels`` (12) is the patchified count.
"""

from __future__ import annotations

import torch
from torch import nn

from ..parallel.vae import SpatialLayout, VAEAdapter, register_vae_adapter

__all__ = ["WanVAEAdapter", "QwenImageVAEAdapter", "QwenImage21VAEAdapter", "WAN_VAE_DEFAULT_OVERLAP",
           "WAN_VAE_DEFAULT_ENCODE_OVERLAP"]

# Chosen from the seam study on the trained small Wan VAE (docs/benchmarks/vae.md): decode seams at
# overlap 2 are >= 29 dB PSNR against the sequential decode (the VAE's own reconstruction error is far
# larger) and 2 warm-up frames keep 2 ranks near 1.8x in the cost model. The encoder's reach is finite
# (3-tap causal convolutions, two stride-2 temporal downsamplings): its seam error falls ~10 dB per
# warm-up group and vanishes (<= 1e-5) from about 12; at 2 groups the seam latent is ~28 dB (range
# PSNR) off and decodes to pixels ~44 dB from the sequential latent's, smaller than the decode seam
# at its default, while 3 or more groups cap 2 ranks at 1.65x (integer chunk boundaries).
WAN_VAE_DEFAULT_OVERLAP = 2
WAN_VAE_DEFAULT_ENCODE_OVERLAP = 2
# Compute of a fresh call's first unit (decode: one latent frame -> one video frame, the temporal
# upsamplers skipped; encode: one video frame) over a later unit (one latent frame -> four video
# frames; four video frames -> one latent frame). Counted with FlopCounterMode on the meta device:
# decode 0.27 / encode 0.29 for the small trained VAE at 128x128, 0.32 / 0.34 for Wan2.1 at 480x832.
WAN_VAE_FIRST_UNIT_COST = 0.3


def _return_dict(args, kwargs) -> bool:
    if args:
        return bool(args[0])
    return bool(kwargs.get("return_dict", True))


@register_vae_adapter("AutoencoderKLWan")
class WanVAEAdapter(VAEAdapter):
    decode_method = "_decode"
    encode_method = "_encode"
    default_overlap = WAN_VAE_DEFAULT_OVERLAP
    default_encode_overlap = WAN_VAE_DEFAULT_ENCODE_OVERLAP

    def __init__(self, vae):
        super().__init__(vae)
        cfg = vae.config
        self.t = 2 ** sum(bool(b) for b in vae.temperal_downsample)
        self.patch = getattr(cfg, "patch_size", None) or 1
        self.scale = 2 ** (len(cfg.dim_mult) - 1) * self.patch
        # the decoder's output is unpatchified: Wan2.2-TI2V-5B's VAE (patch 2) declares out_channels 12 = 3 x 2 x 2
        out_channels = getattr(cfg, "out_channels", None) or getattr(cfg, "input_channels", 3)
        self.out_channels = out_channels // self.patch ** 2
        self.z_dim = cfg.z_dim

    # the diffusers module holding the VAE's building blocks, and their class-name prefix
    blocks_module = "autoencoder_kl_wan"
    blocks_prefix = "Wan"

    def _blocks(self):
        """(attention block, causal conv, resample, residual block, AvgDown3D or ()) classes of this VAE."""
        import importlib

        mod = importlib.import_module(f"diffusers.models.autoencoders.{self.blocks_module}")
        names = ("AttentionBlock", "CausalConv3d", "Resample", "ResidualBlock")
        avg_down = getattr(mod, self.blocks_prefix + "AvgDown3D", None) or getattr(mod, "AvgDown3D", ())
        return tuple(getattr(mod, self.blocks_prefix + n) for n in names) + (avg_down,)

    # --- frame bookkeeping
    def num_units(self, inp, kind):
        n = inp.shape[2]
        return n if kind == "decode" else 1 + (n - 1) // self.t

    def out_frames(self, start, stop, kind):
        if kind == "encode":
            return stop - start
        return self.t * (stop - start) - (self.t - 1 if start == 0 else 0)

    def out_shape(self, inp, kind):
        B, _, _, H, W = inp.shape
        n = self.num_units(inp, kind)
        if kind == "decode":
            return (B, self.out_channels, self.out_frames(0, n, kind), H * self.scale, W * self.scale)
        return (B, 2 * self.z_dim, n, H // self.scale, W // self.scale)

    # --- planning: the cost of one chunk run, in later latent frames
    def chunk_cost(self, warm_start, start, stop, kind):
        # decode: the call starts at latent frame warm_start, which plays frame 0 (cheap);
        # encode: a chunk after frame 0 starts one video frame early (the last frame of the group
        # before, played as frame 0), then runs groups warm_start .. stop - 1
        extra = 1 if (kind == "encode" and start > 0) else 0
        return WAN_VAE_FIRST_UNIT_COST + (stop - warm_start - 1 + extra)

    # --- running one chunk through the VAE's own method
    def decode_tensor(self, inner, z):
        """The video tensor of ``inner(z)`` (the wrapped ``_decode``)."""
        return inner(z, return_dict=False)[0]

    def run_chunk(self, inner, inp, chunk, kind):
        w, s, e = chunk.warm_start, chunk.start, chunk.stop
        if kind == "decode":
            out = self.decode_tensor(inner, inp[:, :, w:e])
            drop = 0 if s == 0 else self.out_frames(0, s - w, kind)  # frame w plays frame 0
            return out[:, :, drop:]
        t = self.t
        if w == 0:
            out = inner(inp[:, :, : 1 + t * (e - 1)])
            return out[:, :, s:]
        out = inner(inp[:, :, t * (w - 1) : 1 + t * (e - 1)])
        return out[:, :, s - w + 1 :]

    def unwrap(self, out, kind):
        if kind == "encode" or isinstance(out, torch.Tensor):
            return out
        return out[0] if isinstance(out, tuple) else out.sample

    def row_local_tail(self, inp, kind):
        # untiled _decode / _encode: the network calls' outputs are concatenated in time, then
        # quant_conv (1x1) / unpatchify (rows x patch) / clamp: all row-local. Tiled: tiles are blended.
        return spatially_untiled(self.vae, inp, kind)

    def wrap(self, tensor, kind, *args, **kwargs):
        if kind == "encode":
            return tensor
        from diffusers.models.autoencoders.vae import DecoderOutput

        return DecoderOutput(sample=tensor) if _return_dict(args, kwargs) else (tensor,)

    # --- exact mode: which modules need halos
    def spatial_layout(self, kind):
        # avg_down: Wan2.2's residual shortcut (absent from older diffusers and from the Qwen-Image VAE)
        WanAttentionBlock, WanCausalConv3d, WanResample, WanResidualBlock, avg_down = self._blocks()
        causal_conv = WanCausalConv3d

        root = self.vae.decoder if kind == "decode" else self.vae.encoder
        layout = SpatialLayout(root=root, unpad=lambda mod: _unpad_rows(mod, causal_conv))
        down = set()
        n_down = 0
        avg_factor = 1  # Wan2.2 residual encoder: product of the AvgDown3D shortcuts' spatial factors
        for mod in root.modules():
            if isinstance(mod, WanResample) and mod.mode in ("downsample2d", "downsample3d"):
                n_down += 1
                down.add(id(mod.resample[1]))
            elif isinstance(mod, avg_down):
                avg_factor *= mod.factor_s
        layout.unit = 2 ** n_down if kind == "encode" else 1
        if kind == "encode" and layout.unit % avg_factor:
            raise NotImplementedError(f"exact parallel VAE: AvgDown3D shortcuts downsample rows by {avg_factor}, "
                                      f"which does not divide the encoder's band unit {layout.unit}")
        for name, mod in root.named_modules():
            if isinstance(mod, WanAttentionBlock):
                layout.gather.append(mod)
            elif isinstance(mod, WanCausalConv3d):
                k_h, k_w = mod.kernel_size[-2:]  # (t, h, w); Qwen-Image 2.1's 2-D "causal" conv: (h, w)
                if k_h == 1 and k_w == 1:
                    continue
                pad = mod._padding  # (w, w, h, h, 2t, 0), or (w, w, h, h) for the 2-D one
                if tuple(mod.stride[-2:]) != (1, 1) or pad[2] != pad[3] or 2 * pad[2] + 1 != k_h:
                    raise NotImplementedError(f"exact parallel VAE: unsupported spatial convolution {name}: {mod}")
                layout.halo.append((mod, pad[2]))
            elif isinstance(mod, nn.Conv2d):
                if id(mod) in down:
                    if mod.stride != (2, 2) or mod.padding != (0, 0) or mod.kernel_size != (3, 3):
                        raise NotImplementedError(f"exact parallel VAE: unsupported downsampling conv {name}: {mod}")
                    layout.bottom_halo.append(mod)
                elif mod.kernel_size != (1, 1):
                    if mod.stride != (1, 1) or 2 * mod.padding[0] + 1 != mod.kernel_size[0]:
                        raise NotImplementedError(f"exact parallel VAE: unsupported spatial convolution {name}: {mod}")
                    layout.halo.append((mod, mod.padding[0]))
            elif isinstance(mod, (nn.Conv3d, nn.Conv1d, nn.MaxPool2d, nn.AvgPool2d)) and not isinstance(mod, WanCausalConv3d):
                raise NotImplementedError(f"exact parallel VAE: unexpected module {name}: {type(mod).__name__}")
        # residual blocks: conv1 -> norm2 (no bias) -> SiLU -> dropout -> conv2 is row-local and maps zero
        # rows to zero rows, so one exchange of 2 rows before conv1 serves both convolutions
        halo_ids = {id(m) for m, _ in layout.halo}
        for mod in root.modules():
            if (isinstance(mod, WanResidualBlock) and id(mod.conv1) in halo_ids and id(mod.conv2) in halo_ids
                    and _zero_bias(mod.norm2) and isinstance(mod.nonlinearity, (nn.SiLU, nn.ReLU, nn.GELU))
                    and (not mod.training or mod.dropout.p == 0)):
                layout.pairs.append((mod.conv1, mod.conv2))
        return layout


def spatially_untiled(vae, inp, kind) -> bool:
    """True when the VAE's ``_decode`` / ``_encode`` of ``inp`` does not take its spatial-tiling path
    (diffusers' ``use_tiling`` with ``tile_sample_min_height`` / ``_width`` in pixels)."""
    if not vae.use_tiling:
        return True
    h, w = inp.shape[-2:]
    ratio = vae.spatial_compression_ratio if kind == "decode" else 1
    return not (w > vae.tile_sample_min_width // ratio or h > vae.tile_sample_min_height // ratio)


def _zero_bias(norm) -> bool:
    bias = getattr(norm, "bias", None)
    if isinstance(bias, torch.Tensor):
        return not bool(bias.detach().any())
    return bias in (None, 0, 0.0)


def _unpad_rows(mod, causal_conv):
    """Set a spatial convolution's row padding to 0 (the exact mode's halo rows replace it); returns the undo."""
    if isinstance(mod, causal_conv):
        old = mod._padding  # (w, w, h, h, 2t, 0) or (w, w, h, h): F.pad order
        mod._padding = (old[0], old[1], 0, 0) + tuple(old[4:])
        return lambda: setattr(mod, "_padding", old)
    if isinstance(mod, (nn.Conv2d, nn.Conv3d)):
        old = mod.padding
        mod.padding = tuple(old[:-2]) + (0, old[-1])
        return lambda: setattr(mod, "padding", old)
    raise NotImplementedError(f"exact parallel VAE: cannot remove the row padding of {type(mod).__name__}")


@register_vae_adapter("AutoencoderKLQwenImage")
class QwenImageVAEAdapter(WanVAEAdapter):
    """Qwen-Image's VAE: Wan 2.1's structure (causal 3D convolutions, per-pixel RMS norms, the same
    resamplers and attention blocks) under its own class names; an image is one latent frame."""

    blocks_module = "autoencoder_kl_qwenimage"
    blocks_prefix = "QwenImage"


@register_vae_adapter("AutoencoderKLQwenImage21")
class QwenImage21VAEAdapter(WanVAEAdapter):
    """Qwen-Image 2.1's VAE (``AutoencoderKLQwenImage21``): Wan2.2's residual VAE (``AvgDown3D`` / ``DupUp3D``
    shortcuts, per-pixel RMS norms, the mid-block attention, the same resamplers and ``_decode`` / ``_encode``)
    specialised to images, under its own class names. What differs, and how the Wan layout covers it:

    * ``QwenImage21CausalConv3d`` is an ``nn.Conv2d``: it drops the frame axis, zero-pads ``_padding = (w, w,
      h, h)`` (no temporal entries) and convolves in 2-D; it refuses a causal cache (``cache_x``), so a call is
      one latent frame (decode) or one encoder group (encode: at most 4 video frames, of which only the first
      is encoded). Its halos are those of Wan's 3x3(x3) convs (rows at dim -2 of the 5-D input).
    * ``AvgDown3D`` / ``DupUp3D`` (``QwenImage21AvgDown3D`` / ``QwenImage21DupUp3D``) are row-local given
      bands that are multiples of the encoder's downsampling (checked); the resamplers' temporal convolutions
      never run on a first frame.
    * ``_patchify`` / ``_unpatchify`` (``patch_size``, None for the released VAE) are row-local and outside
      the network calls, as Wan's.

    ``exact`` only: an image has one latent frame, so there is nothing to chunk in time (``chunked`` raises a
    ``ConfigError`` before any collective). Inputs stock diffusers fails on (a second latent frame, more than
    one encoder group) raise a ``ValueError`` on every rank before any collective.
    """

    blocks_module = "autoencoder_kl_qwenimage21"
    blocks_prefix = "QwenImage21"
    modes = ("exact",)

    def check_input(self, inp, kind):
        if inp.dim() != 5:
            raise ValueError(f"AutoencoderKLQwenImage21.{kind}: expected a 5-D (B, C, T, H, W) input, got shape "
                             f"{tuple(inp.shape)}")
        frames = inp.shape[2]
        # stock diffusers hands the second decoder call (encoder group) a causal cache that its 2-D convs refuse
        calls = frames if kind == "decode" else 1 + (frames - 1) // 4
        if calls > 1:
            what = "latent frame" if kind == "decode" else "group of up to 4 video frames (only the first is encoded)"
            raise ValueError(f"AutoencoderKLQwenImage21.{kind}: the VAE takes one {what}; the input has {frames} "
                             f"frames (shape {tuple(inp.shape)}); diffusers' 2-D QwenImage21CausalConv3d takes one frame "
                             "and no causal cache, so the stock VAE fails on it too")
