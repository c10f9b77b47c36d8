"""Per-family speed of one transformer block at a released model's dims: stock diffusers vs lite_boost.

    flock /tmp/lite_boost_cpu.lock python benchmarks/bench_families.py ltx          # LTX 2B, 7,392 tokens
    flock /tmp/lite_boost_cpu.lock python benchmarks/bench_families.py ltx --size 13b
    flock /tmp/lite_boost_cpu.lock python benchmarks/bench_families.py qwen-image   # 4,096 image + 256 text tokens
    flock /tmp/lite_boost_cpu.lock python benchmarks/bench_families.py flux         # 4,096 image + 512 text tokens
    flock /tmp/lite_boost_cpu.lock python benchmarks/bench_families.py cogvideox    # 5B, 5,400 video + 226 text
    python benchmarks/bench_families.py ltx --quick                                 # small shape, 2 reps

Benchmarks: ``ltx`` (LTX-Video 2B / 13B), ``qwen-image`` (Qwen-Image, 24 x 128 heads), ``flux``
(Flux.1-dev, 24 x 128 heads: one dual-stream and one single-stream block), ``cogvideox``
(CogVideoX-5B, 48 x 64 heads, the pipeline's 3-D RoPE).

Each benchmark registers a builder (:data:`BENCHES`, by name) that makes one block of the released model twice
from the same weights, stock and boosted (and boosted with block-sparse self-attention for video
families), plus the inputs the block receives inside the transformer. One repetition times, in this
order, the attention modules of the block (what the processor shim replaces), then the whole block,
for every variant (interleaved); the first repetition is a warm-up and is dropped. Also timed: the
RoPE module once per transformer call (stock rebuilds its tables at every call, the boost serves
them from its cache). Medians, ratios, the max abs difference boosted vs stock (fp32), threads and the
load average before / after go to benchmarks/results/families_<bench>_<size>.{md,json}.
"""

from __future__ import annotations

import argparse
import copy
import math
import os
from dataclasses import dataclass, field
from typing import Callable

import torch

from bench_sparse_common import environment, markdown_table, median, timed, write

import lite_boost
from lite_boost.config import BoostConfig, SparseConfig


@dataclass
class Case:
    """One family's benchmark: per-variant callables for the attention part and the whole block."""

    title: str
    shape: str
    attention: dict[str, Callable[[], torch.Tensor]]  # variant -> one call of the block's attention modules
    block: dict[str, Callable[[], torch.Tensor]]  # variant -> one call of the whole block
    rope: dict[str, Callable[[], object]] = field(default_factory=dict)  # variant -> one RoPE module call
    sparse_state: object = None  # SparseState of the sparse variant (effective sparsity)


BENCHES: dict[str, Callable[[argparse.Namespace], Case]] = {}


def family(name):
    def register(builder):
        BENCHES[name] = builder
        return builder

    return register


# --------------------------------------------------------------------------------------------- helpers
QUICK_GRIDS = {"ltx": (3, 8, 11), "qwen-image": (1, 8, 11), "flux": (1, 8, 11), "cogvideox": (2, 6, 11)}


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


def _variants(stock, args, sparse_ok: bool):
    """{'stock', 'boosted'[, 'sparse <s>']} -> model, all from the same weights, and the sparse state."""
    models = {"stock": stock, "boosted": lite_boost.boost(copy.deepcopy(stock))}
    state = None
    if sparse_ok and not args.no_sparse:
        sparse = lite_boost.boost(copy.deepcopy(stock), BoostConfig(sparse=SparseConfig(
            sparsity=args.sparsity, block_size=args.block_size)))
        models[f"sparse {args.sparsity}"] = sparse
        state = sparse._lite_boost.extras["sparse"]
    return models, state


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
    models, state = _variants(stock, args, sparse_ok=True)
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
    return Case("LTX-Video block", shape, attention, block, rope, state)


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
    models, _ = _variants(stock, args, sparse_ok=False)
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

    attention, block = _cases(models, None, grid, attention_fn, block_fn)
    rope_fns = {k: (lambda m=m: rope(m)) for k, m in models.items()}
    shape = (f"Qwen-Image: {heads} x {head_dim} heads (inner {inner}, text projected from {text_dim}), "
             f"{grid[1] * 16} x {grid[2] * 16} px = {seq:,} image + {text} text tokens, batch {batch}, fp32")
    return Case("Qwen-Image block", shape, attention, block, rope_fns)


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
    models, _ = _variants(stock, args, sparse_ok=False)
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

    attention, block = _cases(models, None, grid, attention_fn, block_fn)
    rope_fns = {k: (lambda m=m: rope(m)) for k, m in models.items()}
    shape = (f"Flux.1-dev: {heads} x {head_dim} heads, {grid[1] * 16} x {grid[2] * 16} px = {seq:,} image + {text} "
             f"text tokens, batch {batch}, one dual-stream + one single-stream block, fp32")
    return Case("Flux.1 blocks", shape, attention, block, rope_fns)


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
    models, state = _variants(stock, args, sparse_ok=True)
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
    return Case("CogVideoX block", shape, attention, block, sparse_state=state)


# --------------------------------------------------------------------------------------------- runner
def _flat(out) -> torch.Tensor:
    """One tensor of a block's output (the streams of a (video, text) tuple side by side)."""
    return torch.cat([o.flatten(1) for o in out], dim=1) if isinstance(out, tuple) else out


def _max_diff(outputs, reference="stock"):
    ref = _flat(outputs[reference])
    return {k: (_flat(out) - ref).abs().max().item() for k, out in outputs.items() if k != reference}


def run(case: Case, args) -> tuple[str, dict]:
    load_before = os.getloadavg()
    times = {part: {k: [] for k in fns} for part, fns in (("attention", case.attention), ("block", case.block),
                                                         ("rope", case.rope))}
    diffs = {}
    with torch.no_grad():
        for rep in range(args.repeats + 1):  # repetition 0: warm-up, dropped (its block outputs give the diffs)
            for part, fns in (("rope", case.rope), ("attention", case.attention), ("block", case.block)):
                outputs = {}
                for name, fn in fns.items():
                    t, out = timed(fn)
                    if rep:
                        times[part][name].append(t)
                    elif part == "block":
                        outputs[name] = out
                if outputs:
                    diffs = _max_diff(outputs)
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
            continue  # no RoPE module (CogVideoX: the pipeline passes the tables in)
        base = median(times[part]["stock"])
        for name, ts in times[part].items():
            med = median(ts)
            rows.append([part, name, f"{med:.4f}", f"{base / med:.3f}x", len(ts)])
    text = "\n".join([
        f"### {case.title}: stock diffusers vs lite_boost (`benchmarks/bench_families.py {args.bench}`)",
        "",
        case.shape + ".",
        "",
        markdown_table(["part", "variant", "median s", "speed-up vs stock", "runs"], rows),
        "",
        f"max abs diff vs stock (block output): {', '.join(f'{k} {v:.2e}' for k, v in diffs.items())}"
        + (f"; sparse effective sparsity {effective:.3f}" if effective is not None else ""),
        f"{environment()}; load average before {load_before[0]:.2f}, after {load_after[0]:.2f} (1 min).",
    ])
    data = {"bench": args.bench, "shape": case.shape, "times": times, "max_abs_diff": diffs,
            "effective_sparsity": effective, "load_before": load_before, "load_after": load_after,
            "threads": torch.get_num_threads()}
    return text, data


DEFAULT_SIZES = {"ltx": "2b", "qwen-image": "20b", "flux": "dev", "cogvideox": "5b"}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bench", nargs="?", choices=sorted(BENCHES), default="ltx")
    ap.add_argument("--family", dest="bench", choices=sorted(BENCHES), help=argparse.SUPPRESS)
    ap.add_argument("--size", default=None, help="released model size (ltx: 2b, 13b; qwen-image: 20b; flux: dev; "
                                                 "cogvideox: 5b); default the first")
    ap.add_argument("--grid", default=None, help="latent token grid frames,height,width (default per benchmark: "
                                                 "ltx 21,16,22; qwen-image and flux 1,64,64; cogvideox 4,30,45)")
    ap.add_argument("--text", type=int, default=None, help="text tokens (default ltx 128, qwen-image 256, flux 512, "
                                                         "cogvideox 226)")
    ap.add_argument("--valid-text", type=int, default=100)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--sparsity", type=float, default=0.8)
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--no-sparse", action="store_true")
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
    text, data = run(case, args)
    write(args.out or f"families_{args.bench}_{args.size}" + ("_quick" if args.quick else ""), text, data)


if __name__ == "__main__":
    main()
