"""Per-family speed of one transformer block at a released model's dims: stock diffusers vs lite_boost
(dense, block-sparse 0.8, int8 weights x int8 activations), all in one process.

    flock /work/heavy.lock python benchmarks/bench_families.py ltx          # LTX 2B, 7,392 tokens
    flock /work/heavy.lock python benchmarks/bench_families.py ltx --size 13b
    flock /work/heavy.lock python benchmarks/bench_families.py qwen-image   # 4,096 image + 256 text tokens
    flock /work/heavy.lock python benchmarks/bench_families.py flux         # 4,096 image + 512 text tokens
    flock /work/heavy.lock python benchmarks/bench_families.py cogvideox    # 5B, 5,400 video + 226 text
    flock /work/heavy.lock python benchmarks/bench_families.py chronoedit   # 14B, 7,200 tokens (2-frame edit)
    flock /work/heavy.lock python benchmarks/bench_families.py skyreels-v2  # 1.3B-540P, 18,360 tokens
    flock /work/heavy.lock python benchmarks/bench_families.py wan-animate  # 14B, 7,800 tokens + face adapter
    flock /work/heavy.lock python benchmarks/bench_families.py wan-vace     # 1.3B, 14,040 + 14,040 control
    flock /work/heavy.lock python benchmarks/bench_families.py flux2        # [dev] 512 x 512 px; --size klein-4b
    flock /work/heavy.lock python benchmarks/bench_families.py ltx2         # 19B, 6,144 video + 126 audio tokens
    flock /work/heavy.lock python benchmarks/bench_families.py qwen-image-2.1  # 4,096 target + 256 text tokens
    flock /work/heavy.lock python benchmarks/bench_families.py minimax-h3   # 2,730 video + 74 audio + 128 text
    python benchmarks/bench_families.py ltx --quick                         # small token grid, 2 reps

Benchmarks and the released dims they use (from each release's transformer config.json):

* ``ltx``: LTX-Video 2B (32 x 64 heads) / 13B (32 x 128);
* ``qwen-image``: Qwen-Image 20B (24 x 128 heads, text 3584 -> 3072);
* ``flux``: Flux.1-dev (24 x 128 heads): one dual-stream and one single-stream block;
* ``cogvideox``: CogVideoX-5B (48 x 64 heads), the pipeline's 3-D RoPE;
* ``chronoedit``: ChronoEdit-14B (Wan2.1-I2V-14B: 40 x 128 heads, dim 5120, FFN 13824, CLIP image
  cross-attention), the two-frame edit latent at 720 x 1280 px;
* ``skyreels-v2``: SkyReels-V2-DF-1.3B-540P (12 x 128 heads, dim 1536, FFN 8960; ``--size 14b``: 40 x
  128, FFN 13824), diffusion forcing (per-frame timesteps), 544 x 960 px, 33 frames;
* ``wan-animate``: Wan2.2-Animate-14B (Wan2.1-I2V-14B dims) block + its face adapter, 480 x 832 px, 13
  frames + the reference frame;
* ``wan-vace``: Wan2.1-VACE-1.3B (12 x 128 heads; ``--size 14b``: 40 x 128) VACE context block + Wan
  block, 480 x 832 px, 33 frames;
* ``flux2``: Flux.2 [dev] (48 x 128 heads, dim 6144, text 15360; 512 x 512 px) / [klein] 4B (24 x 128,
  text 7680; 1024 x 1024 px), a one dual + one single block transformer called whole;
* ``ltx2``: LTX-2 19B (video 32 x 128 heads, audio 32 x 64), a one-block transformer called whole, the
  pipeline's default 512 x 768 px, 121 frames;
* ``qwen-image-2.1``: Qwen-Image 2.1 (diffusers' defaults: 32 x 128 heads, text 4096), a one-block transformer
  called whole on the block-causal [text | target] stream, 1024 x 1024 px;
* ``minimax-h3``: MiniMax-H3 (56 x 128 heads, hidden 5376, FFN 14336), a one-block transformer (with the two
  token-refiner layers) called whole on the modular pipeline's packed [text | audio | video] sequence, 480 x 832
  px, 22 frames.

The video shapes of the Wan-based benches are shorter than a default generation (81 frames at 480p =
32,760 tokens) where a 2-core CPU run of that would take minutes per block call; each docstring below
says which shape and why.

Each benchmark registers a builder (:data:`BENCHES`, by name) that makes one block of the released model
(random weights, fp32) and its variants on the same weight tensors: stock, boosted (dense), boosted with
block-sparse self-attention (``SparseConfig(sparsity=0.8)``) and boosted with ``QuantConfig("int8_dynamic")``
(the family's default Linear layers, eager), plus the inputs the block receives inside the transformer.
One repetition times, in this order, the RoPE module, the attention modules of the block (what the processor
shim replaces), then the whole block, for every variant (interleaved); the first repetition is a warm-up
and is dropped; its block outputs give each variant's max abs difference and relative L2 error
(||out - stock|| / ||stock||, fp64) against stock. Medians, ratios, the effective sparsity, the CPU
(model name, family, model), threads and the load average before / after go to
benchmarks/results/families_<bench>_<size>.{md,json}. The figures are for the CPU they ran on: on another
CPU they change (MKL on AMD takes its AVX2 path; on an Intel Xeon stock fp32 is about 2x faster).
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import platform
from pathlib import Path
from dataclasses import dataclass, field
from typing import Callable

import torch

from bench_sparse_common import environment, markdown_table, median, timed, write

import lite_boost
from lite_boost.config import BoostConfig, QuantConfig, SparseConfig
from lite_boost.quant import quant_state
from lite_boost.ops.quant_int8 import int8_mm_path


@dataclass
class Case:
    """One family's benchmark: per-variant callables for the attention part and the whole block."""

    title: str
    shape: str
    attention: dict[str, Callable[[], torch.Tensor]]  # variant -> one call of the block's attention modules
    block: dict[str, Callable[[], torch.Tensor]]  # variant -> one call of the whole block
    rope: dict[str, Callable[[], object]] = field(default_factory=dict)  # variant -> one RoPE module call
    sparse_state: object = None  # SparseState of the sparse variant (effective sparsity)
    quantized: tuple = ()  # names of the Linear layers the int8 variant quantized


BENCHES: dict[str, Callable[[argparse.Namespace], Case]] = {}


def family(name):
    def register(builder):
        BENCHES[name] = builder
        return builder

    return register


# --------------------------------------------------------------------------------------------- helpers
QUICK_GRIDS = {"ltx": (3, 8, 11), "qwen-image": (1, 8, 11), "flux": (1, 8, 11), "cogvideox": (2, 6, 11),
               "chronoedit": (2, 6, 8), "skyreels-v2": (3, 6, 8), "wan-animate": (3, 6, 8), "wan-vace": (3, 6, 8),
               "flux2": (1, 8, 11), "ltx2": (2, 4, 6), "qwen-image-2.1": (1, 8, 12),
               "minimax-h3": (2, 6, 8)}


def _size(args, sizes: dict) -> str:
    if args.size not in sizes:
        raise ValueError(f"--size for {args.bench} must be one of {sorted(sizes)}, got {args.size!r}")
    return args.size


def _grid(args, default) -> tuple[int, ...]:
    grid = tuple(int(x) for x in args.grid.split(",")) if args.grid else tuple(default)
    if len(grid) != 3 or min(grid) < 1:
        raise ValueError(f"--grid must be three positive integers frames,height,width, got {args.grid!r}")
    return grid


def _text(args, default: int) -> int:
    return default if args.text is None else args.text


def _shared_copy(model):
    """A deep copy of ``model`` whose parameters and buffers are the original's tensors (the boost patches
    instances and never writes weights; quantization swaps in new weight tensors): one copy of the weights in
    memory for every variant, which a 14B-dim block in fp32 needs."""
    memo = {id(t): t for t in (*model.parameters(), *model.buffers())}
    return copy.deepcopy(model, memo)


def _fingerprint(model) -> list[float]:
    """fp64 sums of every parameter: the check that building the variants left the stock weights as they were."""
    return [p.detach().double().sum().item() for p in model.parameters()]


def _variants(stock, args, sparse_ok: bool):
    """{'stock', 'boosted'[, 'sparse <s>'][, 'int8']} -> model, all on the same weight tensors, the sparse
    state, and the names of the layers the int8 variant quantized."""
    before = _fingerprint(stock)
    models = {"stock": stock, "boosted": lite_boost.boost(_shared_copy(stock))}
    state = None
    if sparse_ok and not args.no_sparse:
        sparse = lite_boost.boost(_shared_copy(stock), BoostConfig(sparse=SparseConfig(
            sparsity=args.sparsity, block_size=args.block_size)))
        models[f"sparse {args.sparsity}"] = sparse
        state = sparse._lite_boost.extras["sparse"]
    quantized = ()
    if not args.no_int8:
        int8 = lite_boost.boost(_shared_copy(stock), BoostConfig(quant=QuantConfig("int8_dynamic")))
        models["int8"] = int8
        quantized = quant_state(int8).layers
    if _fingerprint(stock) != before:
        raise RuntimeError("building the boosted variants changed the stock weights")
    return models, state, quantized


def _observed(fn, state, grid):
    """``fn`` preceded by what the sparse transformer's pre-hook records at a call (grid, noise level)."""
    def run():
        state.observe(grid, torch.tensor(500.0))
        return fn()
    return run


def _cases(models, state, grid, attention_fn, block_fn):
    """Per-variant attention and block callables; the sparse variant observes the grid first."""
    attention, block = {}, {}
    for name, model in models.items():
        att, blk = attention_fn(model), block_fn(model)
        if name.startswith("sparse"):
            att, blk = _observed(att, state, grid), _observed(blk, state, grid)
        attention[name], block[name] = att, blk
    return attention, block


# --------------------------------------------------------------------------------------------- LTX-Video
LTX_SIZES = {"2b": (32, 64), "13b": (32, 128)}  # heads x head_dim (scripts/convert_ltx_to_diffusers.py)


@family("ltx")
def ltx_case(args) -> Case:
    """One LTXVideoTransformerBlock: self-attention over the video tokens (RoPE over the inner dim),
    cross-attention to 128 T5 tokens (100 real, 28 padded: the bias mask), feed-forward."""
    from diffusers import LTXVideoTransformer3DModel

    heads, head_dim = LTX_SIZES[_size(args, LTX_SIZES)]
    inner = heads * head_dim
    grid = _grid(args, (21, 16, 22))  # 512 x 704 px, 161 frames
    seq, text, batch = math.prod(grid), _text(args, 128), args.batch
    valid = min(args.valid_text, text)
    torch.manual_seed(0)
    stock = LTXVideoTransformer3DModel(in_channels=128, out_channels=128, num_attention_heads=heads,
                                       attention_head_dim=head_dim, cross_attention_dim=inner, num_layers=1,
                                       caption_channels=inner).eval()
    models, state, quantized = _variants(stock, args, sparse_ok=True)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(batch, seq, inner, generator=g)
    context = torch.randn(batch, text, inner, generator=g)
    temb = 0.1 * torch.randn(batch, 1, 6 * inner, generator=g)
    mask = torch.ones(batch, text)
    mask[:, valid:] = 0
    bias = ((1 - mask) * -10000.0).unsqueeze(1)
    rope_args = (hidden, *grid, (8 / 25, 32, 32))  # LTXPipeline's interpolation scale at 25 fps

    def attention_fn(model):
        blk, rot = model.transformer_blocks[0], model.rope(*rope_args)
        return lambda: (blk.attn1(hidden_states=hidden, image_rotary_emb=rot)
                        + blk.attn2(hidden, encoder_hidden_states=context, attention_mask=bias))

    def block_fn(model):
        blk, rot = model.transformer_blocks[0], model.rope(*rope_args)
        return lambda: blk(hidden_states=hidden, encoder_hidden_states=context, temb=temb, image_rotary_emb=rot,
                           encoder_attention_mask=bias)

    attention, block = _cases(models, state, grid, attention_fn, block_fn)
    rope = {k: (lambda m=models[k]: m.rope(*rope_args)) for k in ("stock", "boosted")}
    shape = (f"LTX {args.size.upper()}: {heads} x {head_dim} heads, grid {grid} = {seq:,} video tokens, batch {batch}, "
             f"text {text} ({valid} real), fp32, sparse block {args.block_size}")
    return Case("LTX-Video block", shape, attention, block, rope, state, quantized)


# --------------------------------------------------------------------------------------------- Qwen-Image
QWEN_SIZES = {"20b": (24, 128, 3584)}  # heads x head_dim, joint_attention_dim (the 60-layer release)


@family("qwen-image")
def qwen_image_case(args) -> Case:
    """One QwenImageTransformerBlock: joint attention over [text, image] (RoPE on both streams; no text
    mask: every text token real), the two streams' adaLN modulation and feed-forwards."""
    from diffusers import QwenImageTransformer2DModel

    heads, head_dim, text_dim = QWEN_SIZES[_size(args, QWEN_SIZES)]
    inner = heads * head_dim
    grid = _grid(args, (1, 64, 64))  # 1024 x 1024 px: VAE 8x, patch 2
    seq, text, batch = math.prod(grid), _text(args, 256), args.batch
    torch.manual_seed(0)
    stock = QwenImageTransformer2DModel(patch_size=2, in_channels=64, out_channels=16, num_layers=1,
                                        attention_head_dim=head_dim, num_attention_heads=heads,
                                        joint_attention_dim=text_dim, axes_dims_rope=(16, 56, 56)).eval()
    models, state, quantized = _variants(stock, args, sparse_ok=True)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(batch, seq, inner, generator=g)  # after img_in
    context = torch.randn(batch, text, inner, generator=g)  # after txt_norm / txt_in (3584 -> 3072)
    temb = torch.randn(batch, inner, generator=g)
    img_shapes = [[grid]] * batch

    def rope(model):
        return model.pos_embed(img_shapes, max_txt_seq_len=text, device=hidden.device)

    def attention_fn(model):
        attn, rot = model.transformer_blocks[0].attn, rope(model)
        return lambda: attn(hidden_states=hidden, encoder_hidden_states=context, encoder_hidden_states_mask=None,
                            image_rotary_emb=rot)

    def block_fn(model):
        blk, rot = model.transformer_blocks[0], rope(model)
        return lambda: blk(hidden_states=hidden, encoder_hidden_states=context, encoder_hidden_states_mask=None,
                           temb=temb, image_rotary_emb=rot)

    attention, block = _cases(models, state, grid, attention_fn, block_fn)
    rope_fns = {k: (lambda m=models[k]: rope(m)) for k in ("stock", "boosted")}
    shape = (f"Qwen-Image: {heads} x {head_dim} heads (inner {inner}, text projected from {text_dim}), "
             f"{grid[1] * 16} x {grid[2] * 16} px = {seq:,} image + {text} text tokens, batch {batch}, fp32")
    return Case("Qwen-Image block", shape, attention, block, rope_fns, state, quantized)


# --------------------------------------------------------------------------------------------- Flux.1
FLUX_SIZES = {"dev": (24, 128)}  # heads x head_dim (Flux.1-dev / schnell)


@family("flux")
def flux_case(args) -> Case:
    """One dual-stream FluxTransformerBlock followed by one single-stream FluxSingleTransformerBlock:
    joint attention over [text, image] with the pipeline's ids (zero text ids, raster image ids)."""
    from diffusers import FluxTransformer2DModel
    from diffusers.pipelines.flux.pipeline_flux import FluxPipeline

    from lite_boost.models.flux import FluxCall

    heads, head_dim = FLUX_SIZES[_size(args, FLUX_SIZES)]
    inner = heads * head_dim
    grid = _grid(args, (1, 64, 64))  # 1024 x 1024 px: VAE 8x, packed 2 x 2
    if grid[0] != 1:
        raise ValueError(f"--grid for flux must have 1 frame, got {args.grid!r}")
    seq, text, batch = math.prod(grid), _text(args, 512), args.batch
    torch.manual_seed(0)
    stock = FluxTransformer2DModel(patch_size=1, in_channels=64, num_layers=1, num_single_layers=1,
                                   attention_head_dim=head_dim, num_attention_heads=heads, joint_attention_dim=4096,
                                   pooled_projection_dim=768, guidance_embeds=True, axes_dims_rope=(16, 56, 56)).eval()
    models, state, quantized = _variants(stock, args, sparse_ok=True)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(batch, seq, inner, generator=g)  # after x_embedder
    context = torch.randn(batch, text, inner, generator=g)  # after context_embedder
    temb = torch.randn(batch, inner, generator=g)
    img_ids = FluxPipeline._prepare_latent_image_ids(batch, grid[1], grid[2], "cpu", torch.float32)
    txt_ids = torch.zeros(text, 3)
    ids = torch.cat([txt_ids, img_ids])

    def rope(model):
        state = getattr(model, "_lite_boost", None)  # what the transformer's pre-hook sets during a call
        if state is not None:
            state.call = FluxCall(txt_ids, img_ids)
        try:
            return model.pos_embed(ids)
        finally:
            if state is not None:
                state.call = None

    def attention_fn(model):
        dual, single, rot = model.transformer_blocks[0], model.single_transformer_blocks[0], rope(model)
        joint = torch.cat([context, hidden], dim=1)

        def run():
            out = dual.attn(hidden_states=hidden, encoder_hidden_states=context, image_rotary_emb=rot)
            return (*out, single.attn(hidden_states=joint, image_rotary_emb=rot))
        return run

    def block_fn(model):
        dual, single, rot = model.transformer_blocks[0], model.single_transformer_blocks[0], rope(model)

        def run():
            enc, hid = dual(hidden_states=hidden, encoder_hidden_states=context, temb=temb, image_rotary_emb=rot)
            return single(hidden_states=hid, encoder_hidden_states=enc, temb=temb, image_rotary_emb=rot)
        return run

    attention, block = _cases(models, state, grid, attention_fn, block_fn)
    rope_fns = {k: (lambda m=models[k]: rope(m)) for k in ("stock", "boosted")}
    shape = (f"Flux.1-dev: {heads} x {head_dim} heads, {grid[1] * 16} x {grid[2] * 16} px = {seq:,} image + {text} "
             f"text tokens, batch {batch}, one dual-stream + one single-stream block, fp32")
    return Case("Flux.1 blocks", shape, attention, block, rope_fns, state, quantized)


# --------------------------------------------------------------------------------------------- CogVideoX
COGVIDEOX_SIZES = {"5b": (48, 64)}  # heads x head_dim (CogVideoX-5B: the pipeline's 3-D RoPE)


@family("cogvideox")
def cogvideox_case(args) -> Case:
    """One CogVideoXBlock: joint attention over [226 text, video] with shared projections, the
    pipeline's (cos, sin) RoPE over the video rows, feed-forward."""
    from diffusers import CogVideoXTransformer3DModel
    from diffusers.models.embeddings import get_3d_rotary_pos_embed
    from diffusers.pipelines.cogvideo.pipeline_cogvideox import get_resize_crop_region_for_grid

    heads, head_dim = COGVIDEOX_SIZES[_size(args, COGVIDEOX_SIZES)]
    inner = heads * head_dim
    grid = _grid(args, (4, 30, 45))  # 480 x 720 px, 13 frames (49 frames would be 13 x 30 x 45 = 17,550)
    seq, text, batch = math.prod(grid), _text(args, 226), args.batch
    torch.manual_seed(0)
    stock = CogVideoXTransformer3DModel(num_attention_heads=heads, attention_head_dim=head_dim, in_channels=16,
                                        num_layers=1, use_rotary_positional_embeddings=True).eval()
    models, state, quantized = _variants(stock, args, sparse_ok=True)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(batch, seq, inner, generator=g)  # after patch_embed
    context = torch.randn(batch, text, inner, generator=g)
    temb = torch.randn(batch, stock.config.time_embed_dim, generator=g)
    p = stock.config.patch_size
    crops = get_resize_crop_region_for_grid(grid[1:], stock.config.sample_width // p, stock.config.sample_height // p)
    rot = get_3d_rotary_pos_embed(embed_dim=head_dim, crops_coords=crops, grid_size=grid[1:], temporal_size=grid[0],
                                  device="cpu")  # what CogVideoXPipeline passes to every block

    def attention_fn(model):
        attn = model.transformer_blocks[0].attn1
        return lambda: attn(hidden_states=hidden, encoder_hidden_states=context, image_rotary_emb=rot)

    def block_fn(model):
        blk = model.transformer_blocks[0]
        return lambda: blk(hidden_states=hidden, encoder_hidden_states=context, temb=temb, image_rotary_emb=rot)

    attention, block = _cases(models, state, grid, attention_fn, block_fn)
    shape = (f"CogVideoX-5B: {heads} x {head_dim} heads, grid {grid} = {seq:,} video + {text} text tokens "
             f"({grid[1] * 16} x {grid[2] * 16} px, {4 * (grid[0] - 1) + 1} frames), batch {batch}, fp32, "
             f"sparse block {args.block_size}")
    return Case("CogVideoX block", shape, attention, block, sparse_state=state, quantized=quantized)


# --------------------------------------------------------------------------------------------- Wan-based
# heads x head_dim, FFN width of the released Wan2.1 transformers (config.json of Wan2.1-T2V-1.3B / -14B;
# the I2V-14B transformer adds the CLIP image cross-attention: image_dim 1280, added_kv_proj_dim 5120)
WAN_DIMS = {"1.3b": (12, 128, 8960), "14b": (40, 128, 13824)}
WAN_TEXT, WAN_IMAGE = 512, 257  # umT5 tokens (padded to 512), CLIP ViT-H image tokens (I2V)


def _wan_grid(args, default):
    grid = _grid(args, default)
    return grid, math.prod(grid)


def _wan_px(grid) -> str:
    return f"{grid[1] * 16} x {grid[2] * 16} px"


def _wan_inputs(batch, seq, inner, text, image, grid, in_channels):
    """Block inputs as the transformer makes them: video tokens after the patch embedding, [image, text]
    context after the condition embedder, the (B, 6, D) modulation, and latents for the RoPE module."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(batch, seq, inner, generator=g)
    context = torch.randn(batch, image + text, inner, generator=g)
    temb = 0.1 * torch.randn(batch, 6, inner, generator=g)
    latents = torch.zeros(batch, in_channels, grid[0], 2 * grid[1], 2 * grid[2])  # patch (1, 2, 2)
    return hidden, context, temb, latents


def _wan_block_case(args, stock, title, shape, grid, hidden, context, temb, latents, extra=None, tail=()):
    """Attention (self + cross of ``blocks[0]``) and the whole ``blocks[0]`` of a Wan-type transformer, with
    ``extra(model, out)`` after the block (e.g. a face adapter) when given; ``tail``: further positional
    arguments of the block (SkyReels-V2: the causal mask, None for synchronous diffusion forcing)."""
    models, state, quantized = _variants(stock, args, sparse_ok=True)

    def attention_fn(model):
        blk, rot = model.blocks[0], model.rope(latents)
        return lambda: blk.attn1(hidden, None, None, rot) + blk.attn2(hidden, context, None, None)

    def block_fn(model):
        blk, rot = model.blocks[0], model.rope(latents)

        def run():
            out = blk(hidden, context, temb, rot, *tail)
            return extra(model, out) if extra is not None else out
        return run

    attention, block = _cases(models, state, grid, attention_fn, block_fn)
    rope = {k: (lambda m=models[k]: m.rope(latents)) for k in ("stock", "boosted")}
    return Case(title, shape, attention, block, rope, state, quantized)


@family("chronoedit")
def chronoedit_case(args) -> Case:
    """One ChronoEdit-14B block (Wan2.1-I2V-14B dims: 40 x 128 heads, dim 5120, FFN 13824, in_channels 36,
    CLIP image cross-attention: image_dim 1280, added_kv_proj_dim 5120; rope_temporal_skip_len 8). The edit's
    two-frame latent (input frame, output frame) at 720 x 1280 px: 2 x 45 x 80 = 7,200 tokens; 512 text +
    257 image context tokens."""
    from diffusers import ChronoEditTransformer3DModel

    heads, head_dim, ffn = WAN_DIMS[_size(args, {"14b": None})]
    inner = heads * head_dim
    grid, seq = _wan_grid(args, (2, 45, 80))
    torch.manual_seed(0)
    stock = ChronoEditTransformer3DModel(num_attention_heads=heads, attention_head_dim=head_dim, in_channels=36,
                                         ffn_dim=ffn, num_layers=1, image_dim=1280, added_kv_proj_dim=inner,
                                         rope_temporal_skip_len=8).eval()
    hidden, context, temb, latents = _wan_inputs(args.batch, seq, inner, WAN_TEXT, WAN_IMAGE, grid, 36)
    shape = (f"ChronoEdit-14B: {heads} x {head_dim} heads (dim {inner}, FFN {ffn}), grid {grid} = {seq:,} video "
             f"tokens ({_wan_px(grid)}, {grid[0]} latent frames), {WAN_TEXT} text + {WAN_IMAGE} image context "
             f"tokens, batch {args.batch}, fp32, sparse block {args.block_size}")
    return _wan_block_case(args, stock, "ChronoEdit block", shape, grid, hidden, context, temb, latents)


@family("skyreels-v2")
def skyreels_v2_case(args) -> Case:
    """One SkyReels-V2 block at the 1.3B-540P dims (12 x 128 heads, dim 1536, FFN 8960; the released
    SkyReels-V2-DF-1.3B-540P config), diffusion forcing: one timestep per latent frame, so a per-token (B, 6,
    S, D) modulation. 544 x 960 px, 33 frames: 9 x 34 x 60 = 18,360 tokens (the 97-frame default would be
    51,000: too slow for a 2-core run); 512 text tokens."""
    from diffusers import SkyReelsV2Transformer3DModel

    heads, head_dim, ffn = WAN_DIMS[_size(args, {"1.3b": None, "14b": None})]
    inner = heads * head_dim
    grid, seq = _wan_grid(args, (9, 34, 60))
    torch.manual_seed(0)
    stock = SkyReelsV2Transformer3DModel(num_attention_heads=heads, attention_head_dim=head_dim, ffn_dim=ffn,
                                         num_layers=1, inject_sample_info=False).eval()
    hidden, context, _, latents = _wan_inputs(args.batch, seq, inner, WAN_TEXT, 0, grid, 16)
    g = torch.Generator().manual_seed(1)
    per_frame = 0.1 * torch.randn(args.batch, 6, grid[0], 1, inner, generator=g)  # one modulation per frame
    temb = per_frame.expand(-1, -1, -1, grid[1] * grid[2], -1).reshape(args.batch, 6, seq, inner).contiguous()
    shape = (f"SkyReels-V2 {args.size.upper()}: {heads} x {head_dim} heads (dim {inner}, FFN {ffn}), grid {grid} = "
             f"{seq:,} video tokens ({_wan_px(grid)}, {4 * (grid[0] - 1) + 1} frames), diffusion forcing (per-frame "
             f"timesteps: a (B, 6, S, D) modulation), {WAN_TEXT} text tokens, batch {args.batch}, fp32, sparse block "
             f"{args.block_size}")
    return _wan_block_case(args, stock, "SkyReels-V2 block", shape, grid, hidden, context, temb, latents,
                           tail=(None,))


@family("wan-animate")
def wan_animate_case(args) -> Case:
    """One Wan Animate 14B block (Wan2.2-Animate-14B: Wan2.1-I2V-14B dims, 40 x 128 heads, dim 5120, FFN
    13824, in_channels 36, image_dim 1280, added_kv_proj_dim 5120) followed by its face adapter (the
    ``face_adapter`` cross-attention of every latent frame's video tokens to that frame's 5 motion tokens, after
    every 5th block in the released model). 480 x 832 px, 13 frames (4 latent) + the reference latent frame: 5 x
    30 x 52 = 7,800 tokens (the released 77-frame segment at 720 x 1280 would be 75,600: too slow for a
    2-core run); 512 text + 257 image context tokens."""
    from diffusers import WanAnimateTransformer3DModel

    heads, head_dim, ffn = WAN_DIMS[_size(args, {"14b": None})]
    inner = heads * head_dim
    grid, seq = _wan_grid(args, (5, 30, 52))
    torch.manual_seed(0)
    stock = WanAnimateTransformer3DModel(num_attention_heads=heads, attention_head_dim=head_dim, ffn_dim=ffn,
                                         num_layers=1, image_dim=1280, added_kv_proj_dim=inner,
                                         inject_face_latents_blocks=1).eval()
    hidden, context, temb, latents = _wan_inputs(args.batch, seq, inner, WAN_TEXT, WAN_IMAGE, grid, 36)
    g = torch.Generator().manual_seed(2)
    n = stock.config.face_encoder_num_heads + 1
    motion = torch.randn(args.batch, grid[0], n, inner, generator=g)  # face encoder output, padded first frame

    def face(model, out):
        return model.face_adapter[0](out, motion) + out

    shape = (f"Wan Animate 14B: {heads} x {head_dim} heads (dim {inner}, FFN {ffn}), one block + its face adapter, "
             f"grid {grid} = {seq:,} video tokens ({_wan_px(grid)}, {4 * (grid[0] - 2) + 1} frames + reference), "
             f"{WAN_TEXT} text + {WAN_IMAGE} image context tokens, {n} motion tokens per frame, batch {args.batch}, "
             f"fp32, sparse block {args.block_size}")
    return _wan_block_case(args, stock, "Wan Animate block + face adapter", shape, grid, hidden, context, temb,
                           latents, extra=face)


@family("wan-vace")
def wan_vace_case(args) -> Case:
    """One VACE context block (``vace_blocks[0]``: control tokens + video tokens in, hint out) and one Wan
    block with the hint added, at Wan2.1-VACE-1.3B dims (12 x 128 heads, dim 1536, FFN 8960, vace_in_channels
    96; 14B: 40 x 128, FFN 13824). 480 x 832 px, 33 frames: 9 x 30 x 52 = 14,040 tokens (81 frames would be
    32,760: too slow for a 2-core run); 512 text tokens."""
    from diffusers import WanVACETransformer3DModel

    heads, head_dim, ffn = WAN_DIMS[_size(args, {"1.3b": None, "14b": None})]
    inner = heads * head_dim
    grid, seq = _wan_grid(args, (9, 30, 52))
    torch.manual_seed(0)
    stock = WanVACETransformer3DModel(num_attention_heads=heads, attention_head_dim=head_dim, ffn_dim=ffn,
                                      num_layers=1, vace_layers=[0], vace_in_channels=96).eval()
    hidden, context, temb, latents = _wan_inputs(args.batch, seq, inner, WAN_TEXT, 0, grid, 16)
    control = torch.randn(args.batch, seq, inner, generator=torch.Generator().manual_seed(3))  # VACE patch embed
    models, state, quantized = _variants(stock, args, sparse_ok=True)

    def attention_fn(model):
        vace, blk, rot = model.vace_blocks[0], model.blocks[0], model.rope(latents)
        return lambda: (vace.attn1(control, None, None, rot) + vace.attn2(control, context, None, None)
                        + blk.attn1(hidden, None, None, rot) + blk.attn2(hidden, context, None, None))

    def block_fn(model):
        vace, blk, rot = model.vace_blocks[0], model.blocks[0], model.rope(latents)

        def run():
            hint, _ = vace(hidden, context, control, temb, rot)
            return blk(hidden, context, temb, rot) + hint
        return run

    attention, block = _cases(models, state, grid, attention_fn, block_fn)
    rope = {k: (lambda m=models[k]: m.rope(latents)) for k in ("stock", "boosted")}
    shape = (f"Wan VACE {args.size.upper()}: {heads} x {head_dim} heads (dim {inner}, FFN {ffn}), one VACE context "
             f"block + one Wan block, grid {grid} = {seq:,} video tokens and as many control tokens "
             f"({_wan_px(grid)}, {4 * (grid[0] - 1) + 1} frames), {WAN_TEXT} text tokens, batch {args.batch}, fp32, "
             f"sparse block {args.block_size}")
    return Case("Wan VACE blocks", shape, attention, block, rope, state, quantized)


# --------------------------------------------------------------------------------------------- Flux.2
# heads x head_dim, joint_attention_dim, guidance embedding (config.json of FLUX.2-dev, FLUX.2-klein-4B / -9B;
# dev = diffusers' Flux2Transformer2DModel defaults: 8 double + 48 single blocks, mlp_ratio 3)
FLUX2_SIZES = {"dev": (48, 128, 15360, True), "klein-4b": (24, 128, 7680, False), "klein-9b": (32, 128, 12288, False)}


@family("flux2")
def flux2_case(args) -> Case:
    """A Flux.2 transformer with one dual-stream and one single-stream block at released dims, called as the
    pipeline calls it (the boost's pre-hook passes the text length to the single block and serves the RoPE
    tables, so the whole call is timed: embedders, RoPE, both blocks, output layer; no separate attention
    part). [dev]: 48 x 128 heads (dim 6144), text 15360 -> 6144; [klein] 4B: 24 x 128 (3072), text 7680."""
    from diffusers import Flux2Transformer2DModel
    from diffusers.pipelines.flux2.pipeline_flux2 import Flux2Pipeline

    heads, head_dim, text_dim, guidance = FLUX2_SIZES[_size(args, FLUX2_SIZES)]
    inner = heads * head_dim
    grid = _grid(args, (1, 32, 32) if args.size == "dev" else (1, 64, 64))
    if grid[0] != 1:
        raise ValueError(f"--grid for flux2 must have 1 frame, got {args.grid!r}")
    seq, text, batch = math.prod(grid), _text(args, 512), args.batch
    torch.manual_seed(0)
    stock = Flux2Transformer2DModel(num_layers=1, num_single_layers=1, attention_head_dim=head_dim,
                                    num_attention_heads=heads, joint_attention_dim=text_dim,
                                    guidance_embeds=guidance).eval()
    models, state, quantized = _variants(stock, args, sparse_ok=True)
    g = torch.Generator().manual_seed(0)
    latents = torch.randn(batch, stock.config.in_channels, grid[1], grid[2], generator=g)
    hidden = latents.flatten(2).transpose(1, 2).contiguous()  # packed latents (B, h * w, 128)
    context = torch.randn(batch, text, text_dim, generator=g)  # text encoder hidden states
    img_ids = Flux2Pipeline._prepare_latent_ids(latents)
    txt_ids = Flux2Pipeline._prepare_text_ids(context)
    timestep = torch.full((batch,), 0.5)
    kwargs = dict(hidden_states=hidden, encoder_hidden_states=context, timestep=timestep, img_ids=img_ids,
                  txt_ids=txt_ids, return_dict=False)
    if guidance:
        kwargs["guidance"] = torch.full((batch,), 4.0)
    block = {name: (lambda m=m: m(**kwargs)[0]) for name, m in models.items()}
    shape = (f"Flux.2 [{args.size}]: {heads} x {head_dim} heads (dim {inner}), text {text_dim} -> {inner}, one "
             f"dual-stream + one single-stream block in a whole transformer call, {grid[1] * 16} x {grid[2] * 16} px "
             f"= {seq:,} image + {text} text tokens, batch {batch}, fp32, sparse block {args.block_size}")
    return Case("Flux.2 transformer (1 + 1 blocks)", shape, {}, block, {}, state, quantized)


# --------------------------------------------------------------------------------------------- LTX-2
@family("ltx2")
def ltx2_case(args) -> Case:
    """An LTX-2 transformer with one audio-video block at the released LTX-2 19B dims (diffusers'
    LTX2VideoTransformer3DModel defaults: video 32 x 128 heads, dim 4096; audio 32 x 64, dim 2048; text
    3840 -> 4096 / 2048), called whole as the pipeline calls it (embedders, the four RoPE modules, the block's
    six attentions, output layers; no separate attention part). The pipeline's default 512 x 768 px, 121
    frames at 24 fps: 16 x 16 x 24 = 6,144 video tokens, 126 audio tokens; 1024 text tokens (100 real, left
    padded)."""
    from diffusers import LTX2VideoTransformer3DModel

    _size(args, {"19b": None})
    grid = _grid(args, (16, 16, 24))
    seq, text, batch = math.prod(grid), _text(args, 1024), args.batch
    audio = max(1, round((8 * (grid[0] - 1) + 1) / 24 * 16000 / 160 / 4))  # seconds x 16 kHz / hop 160 / 4
    valid = min(args.valid_text, text)
    torch.manual_seed(0)
    stock = LTX2VideoTransformer3DModel(num_layers=1).eval()
    models, state, quantized = _variants(stock, args, sparse_ok=True)
    c = stock.config
    g = torch.Generator().manual_seed(0)
    mask = torch.zeros(batch, text, dtype=torch.long)
    mask[:, text - valid:] = 1  # left padding
    kwargs = dict(hidden_states=torch.randn(batch, seq, c.in_channels, generator=g),
                  audio_hidden_states=torch.randn(batch, audio, c.audio_in_channels, generator=g),
                  encoder_hidden_states=torch.randn(batch, text, c.caption_channels, generator=g),
                  audio_encoder_hidden_states=torch.randn(batch, text, c.caption_channels, generator=g),
                  timestep=torch.full((batch,), 700.0), encoder_attention_mask=mask,
                  audio_encoder_attention_mask=mask.clone(), num_frames=grid[0], height=grid[1], width=grid[2],
                  fps=24.0, audio_num_frames=audio, return_dict=False)
    block = {name: (lambda m=m: m(**kwargs)) for name, m in models.items()}
    inner, audio_inner = c.num_attention_heads * c.attention_head_dim, c.audio_num_attention_heads * c.audio_attention_head_dim
    shape = (f"LTX-2 19B: video {c.num_attention_heads} x {c.attention_head_dim} heads (dim {inner}), audio "
             f"{c.audio_num_attention_heads} x {c.audio_attention_head_dim} (dim {audio_inner}), one block in a whole "
             f"transformer call, grid {grid} = {seq:,} video tokens ({grid[1] * 32} x {grid[2] * 32} px, "
             f"{8 * (grid[0] - 1) + 1} frames), {audio} audio tokens, {text} text tokens ({valid} real), batch "
             f"{batch}, fp32, sparse block {args.block_size}")
    return Case("LTX-2 transformer (1 block)", shape, {}, block, {}, state, quantized)


# --------------------------------------------------------------------------------------------- Qwen-Image 2.1
@family("qwen-image-2.1")
def qwen_image_21_case(args) -> Case:
    """A Qwen-Image 2.1 transformer with one block at the released dims (diffusers'
    QwenImage21Transformer2DModel defaults: 32 x 128 heads, dim 4096, text 4096 -> 4096, mlp ratio 3), called whole
    as QwenImage21Pipeline calls it for text-to-image: the single block-causal stream of [text | target image],
    the target's ``img_mask`` slots after the text (one per 2 x 2 target tokens). 1024 x 1024 px = 64 x 64
    target tokens, 256 text tokens."""
    from diffusers import QwenImage21Transformer2DModel

    _size(args, {"default": None})
    grid = _grid(args, (1, 64, 64))
    if grid[0] != 1 or grid[1] * grid[2] % 4:
        raise ValueError(f"--grid for qwen-image-2.1 must be 1,h,w with h * w a multiple of 4, got {args.grid!r}")
    seq, text, batch = grid[1] * grid[2], _text(args, 256), args.batch
    torch.manual_seed(0)
    stock = QwenImage21Transformer2DModel(num_layers=1).eval()
    models, state, quantized = _variants(stock, args, sparse_ok=True)
    c = stock.config
    g = torch.Generator().manual_seed(0)
    img_mask = torch.tensor([False] * text + [True] * (seq // 4)).expand(batch, -1).clone()
    kwargs = dict(hidden_states=torch.randn(batch, seq, c.in_channels, generator=g),
                  encoder_hidden_states=torch.randn(batch, text, c.context_in_dim, generator=g),
                  timestep=torch.full((batch,), 0.7), img_shapes=[[grid]] * batch, img_mask=img_mask,
                  return_dict=False)
    block = {name: (lambda m=m: m(**kwargs)[0]) for name, m in models.items()}
    inner = c.num_attention_heads * c.attention_head_dim
    shape = (f"Qwen-Image 2.1: {c.num_attention_heads} x {c.attention_head_dim} heads (dim {inner}), text "
             f"{c.context_in_dim} -> {inner}, one block in a whole transformer call, {grid[1] * 16} x {grid[2] * 16} px "
             f"= {seq:,} target + {text} text tokens, batch {batch}, fp32, sparse block {args.block_size}")
    return Case("Qwen-Image 2.1 transformer (1 block)", shape, {}, block, {}, state, quantized)


# --------------------------------------------------------------------------------------------- MiniMax-H3
@family("minimax-h3")
def minimax_h3_case(args) -> Case:
    """A MiniMax-H3 transformer with one main block (and the released 2 token-refiner layers) at the released dims
    (diffusers' MiniMaxH3Transformer3DModel defaults: 56 x 128 heads, hidden 5376, FFN 14336, text 5120), called
    whole on the modular pipeline's packed sequence [text | target audio | target video] (diffusers'
    MiniMaxH3PrepareLayoutStep, no keyframe condition). Default latent grid 7 x 30 x 52 (480 x 832 px, 22 frames:
    7 x 15 x 26 = 2,730 video tokens), the audio latents of those frames, 128 text tokens."""
    from diffusers import MiniMaxH3Transformer3DModel
    from diffusers.modular_pipelines.minimax_h3.before_denoise import (MiniMaxH3PrepareLayoutStep,
                                                                         MiniMaxH3SetTimestepsStep)
    from diffusers.modular_pipelines.minimax_h3.modular_pipeline import audio_latent_num_frames

    _size(args, {"default": None})
    grid = _grid(args, (7, 30, 52))  # latent frames (5 n + 2), latent height, width (VAE 16x; patch 2 x 2)
    text, batch = _text(args, 128), args.batch
    frames_px = 17 * ((grid[0] - 2) // 5) + 5
    audio = audio_latent_num_frames(frames_px)
    torch.manual_seed(0)
    stock = MiniMaxH3Transformer3DModel(num_layers=1).eval()
    models, state, quantized = _variants(stock, args, sparse_ok=True)
    c = stock.config
    pos, tags, vid, aud, txt, n_cond, _ = MiniMaxH3PrepareLayoutStep.build_packed_sequence(
        torch.ones(text, dtype=torch.long), grid[0], grid[1], grid[2], audio, tuple(c.patch_size),
        audio_channels=2, audio_tag=2, video_tag=0, keyframe_anchors=())
    timestep, timestep_indices = MiniMaxH3SetTimestepsStep.build_row_timesteps(
        vid, aud, n_cond, 0, txt.numel(), 0.7, 0.56, 0.9, 1.0)
    g = torch.Generator().manual_seed(0)
    patch = math.prod(c.patch_size)
    kwargs = dict(hidden_states=torch.randn(batch, vid.numel(), c.in_channels * patch, generator=g),
                  audio_hidden_states=torch.randn(batch, aud.numel(), c.audio_in_channels, generator=g),
                  encoder_hidden_states=torch.randn(batch, txt.numel(), c.text_dim, generator=g),
                  timestep=timestep.to(torch.float32), timestep_indices=timestep_indices,
                  position_ids=pos.to(torch.float32), token_tags=tags, video_indices=vid, audio_indices=aud,
                  text_indices=txt, return_dict=False)
    block = {name: (lambda m=m: m(**kwargs)) for name, m in models.items()}
    shape = (f"MiniMax-H3: {c.num_attention_heads} x {c.attention_head_dim} heads (hidden {c.hidden_size}, FFN "
             f"{c.ffn_dim}), one main block + {c.num_refiner_layers} refiner layers in a whole transformer call, latent "
             f"grid {grid} = {vid.numel():,} video tokens ({grid[1] * 16} x {grid[2] * 16} px, {frames_px} frames), "
             f"{aud.numel()} audio rows, {txt.numel()} text tokens, batch {batch}, fp32, sparse block {args.block_size}")
    return Case("MiniMax-H3 transformer (1 block)", shape, {}, block, {}, state, quantized)


# --------------------------------------------------------------------------------------------- runner
def _flat(out) -> torch.Tensor:
    """One tensor of a block's output (the streams of a (video, text) tuple side by side)."""
    return torch.cat([o.flatten(1) for o in out], dim=1) if isinstance(out, tuple) else out


def _errors(outputs, reference="stock"):
    """variant -> (max abs difference, relative L2 error ||out - ref|| / ||ref||) of the block output vs stock."""
    ref = _flat(outputs[reference]).double()
    errs = {}
    for k, out in outputs.items():
        if k != reference:
            d = _flat(out).double() - ref
            errs[k] = (d.abs().max().item(), (d.norm() / ref.norm()).item())
    return errs


def cpu_model() -> str:
    """``lscpu``'s model name, CPU family and model (the ratios depend on the CPU)."""
    info = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, val = line.partition(":")
            info.setdefault(key.strip(), val.strip())
    except OSError:
        return platform.processor()
    return f"{info.get('model name', '?')} (family {info.get('cpu family', '?')} model {info.get('model', '?')})"


def run(case: Case, args) -> tuple[str, dict]:
    load_before = os.getloadavg()
    parts = (("rope", case.rope), ("attention", case.attention), ("block", case.block))
    times = {part: {k: [] for k in fns} for part, fns in parts}
    errors = {}
    with torch.no_grad():
        for rep in range(args.repeats + 1):  # repetition 0: warm-up, dropped (its block outputs give the errors)
            for part, fns in parts:
                outputs = {}
                for name, fn in fns.items():
                    t, out = timed(fn)
                    if rep:
                        times[part][name].append(t)
                    elif part == "block":
                        outputs[name] = out
                if outputs:
                    errors = _errors(outputs)
                del outputs
            print(f"repetition {rep}: " + ", ".join(f"{p} {k} {v[-1]:.3f}s" for p, d in times.items()
                                                   for k, v in d.items() if v), flush=True)
    load_after = os.getloadavg()
    effective = None
    if case.sparse_state is not None and case.sparse_state.events:
        effective = case.sparse_state.mean_effective_sparsity()
    rows = []
    for part in ("attention", "block", "rope"):
        if not times[part]:
            continue  # no RoPE module (CogVideoX: the pipeline passes the tables in) / no separate attention part
        base = median(times[part]["stock"])
        for name, ts in times[part].items():
            med = median(ts)
            err = errors.get(name) if part == "block" else None
            rows.append([part, name, f"{med:.4f}", f"{base / med:.3f}x", len(ts),
                         "" if err is None else f"{err[0]:.2e}", "" if err is None else f"{err[1]:.2e}"])
    machine = cpu_model()
    text = "\n".join([
        f"### {case.title}: stock diffusers vs lite_boost (`benchmarks/bench_families.py {args.bench}`)",
        "",
        case.shape + ".",
        "",
        "Variants (same weights, same process, interleaved, first repetition dropped): stock diffusers"
        + ("" if args.no_dense else "; boosted (dense)")
        + ("" if args.no_sparse else f"; sparse {args.sparsity} (block-sparse self-attention, block "
                                     f"{args.block_size})")
        + ("; int8 not run (`--no-int8`)." if args.no_int8 else
           f"; int8 (`QuantConfig(\"int8_dynamic\")`, eager, {len(case.quantized)} Linear layers of the block(s); "
           f"int8 products: {int8_mm_path('cpu')} path)."),
        "",
        markdown_table(["part", "variant", "median s", "speed-up vs stock", "runs", "max abs diff (block out)",
                        "rel. L2 error (block out)"], rows),
        "",
        (f"sparse effective sparsity {effective:.3f}; " if effective is not None else "")
        + f"CPU: {machine}; {environment()}; load average before {load_before[0]:.2f}, after {load_after[0]:.2f} "
        "(1 min). Figures are for this CPU: on another CPU they change (MKL on AMD takes its AVX2 path; on an "
        "Intel Xeon stock fp32 is about 2x faster).",
    ])
    data = {"bench": args.bench, "size": args.size, "shape": case.shape, "cpu": machine, "times": times,
            "int8_path": None if args.no_int8 else int8_mm_path("cpu"),
            "max_abs_diff": {k: v[0] for k, v in errors.items()},
            "rel_l2_error": {k: v[1] for k, v in errors.items()}, "quantized_layers": list(case.quantized),
            "effective_sparsity": effective, "load_before": load_before, "load_after": load_after,
            "threads": torch.get_num_threads(), "repeats": args.repeats}
    return text, data


DEFAULT_SIZES = {"ltx": "2b", "qwen-image": "20b", "flux": "dev", "cogvideox": "5b", "chronoedit": "14b",
                 "skyreels-v2": "1.3b", "wan-animate": "14b", "wan-vace": "1.3b", "flux2": "dev", "ltx2": "19b",
                 "qwen-image-2.1": "default", "minimax-h3": "default"}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bench", nargs="?", choices=sorted(BENCHES), default="ltx")
    ap.add_argument("--family", dest="bench", choices=sorted(BENCHES), help=argparse.SUPPRESS)
    ap.add_argument("--size", default=None, help="released model size (ltx: 2b, 13b; qwen-image: 20b; flux: dev; "
                                                 "cogvideox: 5b; chronoedit, wan-animate: 14b; skyreels-v2, "
                                                 "wan-vace: 1.3b, 14b; flux2: dev, klein-4b, klein-9b; ltx2: 19b; "
                                                 "qwen-image-2.1, minimax-h3: default); "
                                                 "default the first")
    ap.add_argument("--grid", default=None, help="latent token grid frames,height,width (default per benchmark: "
                                                 "ltx 21,16,22; qwen-image and flux 1,64,64; cogvideox 4,30,45)")
    ap.add_argument("--text", type=int, default=None, help="text tokens (default ltx 128, qwen-image 256, flux 512, "
                                                         "cogvideox 226)")
    ap.add_argument("--valid-text", type=int, default=100)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--sparsity", type=float, default=0.8)
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--no-sparse", action="store_true")
    ap.add_argument("--no-int8", action="store_true")
    ap.add_argument("--no-dense", action="store_true", help="do not time the dense boost's attention / block (e.g. "
                                                            "an int8-only run: --no-dense --no-sparse)")
    ap.add_argument("--block-only", action="store_true", help="time the whole block (and RoPE) only, not the "
                                                              "attention modules separately (a shorter run)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="small grid (ltx 3,8,11 = 264 tokens), 2 repetitions")
    ap.add_argument("--out", default=None, help="results name (default families_<bench>_<size>)")
    args = ap.parse_args(argv)
    args.size = args.size or DEFAULT_SIZES[args.bench]
    if args.quick:
        args.grid, args.repeats = ",".join(map(str, QUICK_GRIDS[args.bench])), 2
    torch.set_num_threads(args.threads)
    case = BENCHES[args.bench](args)
    if args.block_only:
        case.attention = {}
    if args.no_dense:  # the dense boost not timed (its RoPE table timing stays: it is what the boost caches)
        case.attention.pop("boosted", None)
        case.block.pop("boosted", None)
    text, data = run(case, args)
    write(args.out or f"families_{args.bench}_{args.size}" + ("_quick" if args.quick else ""), text, data)


if __name__ == "__main__":
    main()
