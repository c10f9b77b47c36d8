"""RoPE cost per transformer call: diffusers vs lite_boost, side by side in one process.

Baseline (diffusers 0.42): ``WanRotaryPosEmbed.forward`` builds the (1, S, 1, D) cos/sin tables,
then the processor rotates q and k (``empty_like`` + strided writes). lite_boost: the tables come
from the model's RopeCache (built once per grid) and q and k are rotated in place in fp32, as the
LiteBoost processor does. Runs are interleaved; medians and the reduction are reported.

    python benchmarks/bench_rope.py            # Wan2.1 480p: grid 21x30x52 (S=32,760), 12 heads x 128
    python benchmarks/bench_rope.py --quick    # smaller grid, fewer repeats
    python benchmarks/bench_rope.py --device cuda   # on a GPU (synchronised timing)
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed

from lite_boost.ops.rope import RopeCache, apply_rotary_emb, rotate


def diffusers_rotation(hidden_states, freqs_cos, freqs_sin):
    # verbatim semantics of the nested apply_rotary_emb in diffusers' WanAttnProcessor.__call__
    x1, x2 = hidden_states.unflatten(-1, (-1, 2)).unbind(-1)
    cos = freqs_cos[..., 0::2]
    sin = freqs_sin[..., 1::2]
    out = torch.empty_like(hidden_states)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(hidden_states)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--grid", default="21,30,52", help="latent token grid frames,height,width")
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--device", default="cpu", help="cpu, cuda, npu (timing synchronises the device)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "rope.md"))
    args = ap.parse_args(argv)
    if args.quick:
        args.grid, args.repeats = "5,30,52", 3
    torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    sync = getattr(torch, dev.type).synchronize if dev.type != "cpu" else (lambda: None)
    grid = tuple(int(x) for x in args.grid.split(","))
    seq = grid[0] * grid[1] * grid[2]
    d, n = args.head_dim, args.heads
    rope = WanRotaryPosEmbed(d, (1, 2, 2), 1024).to(dev)
    latents = torch.zeros(1, 1, grid[0], grid[1] * 2, grid[2] * 2, device=dev)

    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        g = torch.Generator().manual_seed(0)
        q = torch.randn(1, seq, n, d, generator=g).to(dev, dtype)
        k = torch.randn(1, seq, n, d, generator=g).to(dev, dtype)
        cache = RopeCache()
        # correctness check on this shape before timing
        cos, sin = rope(latents)
        ref = diffusers_rotation(q, cos, sin)
        ours = rotate(q.clone(), cache.get(grid, d, device=dev).freqs, inplace=True)
        err = (ours.float() - ref.float()).abs().max().item()
        del ref, ours

        sync()
        t0 = time.perf_counter()
        cache.clear()
        f = cache.get(grid, d, device=dev).freqs
        qq, kk = q.clone(), k.clone()
        rotate(qq, f, inplace=True), rotate(kk, f, inplace=True)
        sync()
        first = time.perf_counter() - t0

        stock, boosted, dropin = [], [], []
        for _ in range(args.repeats):
            sync()
            t0 = time.perf_counter()
            cos, sin = rope(latents)
            a = diffusers_rotation(q, cos, sin)
            b = diffusers_rotation(k, cos, sin)
            sync()
            stock.append(time.perf_counter() - t0)
            del a, b, cos, sin
            t0 = time.perf_counter()
            f = cache.get(grid, d, device=dev).freqs
            rotate(qq, f, inplace=True)
            rotate(kk, f, inplace=True)
            sync()
            boosted.append(time.perf_counter() - t0)
            cos, sin = rope(latents)
            sync()
            t0 = time.perf_counter()
            a = apply_rotary_emb(q, cos, sin)
            b = apply_rotary_emb(k, cos, sin)
            sync()
            dropin.append(time.perf_counter() - t0)
            del a, b, cos, sin
        ms, mb, md = (statistics.median(x) for x in (stock, boosted, dropin))
        rows.append((str(dtype).replace("torch.", ""), ms, mb, first, md, 1 - mb / ms, err))

    header = (f"RoPE per transformer call (table + rotate q and k), grid {grid} = S {seq:,}, {n} heads x {d}, "
              f"{dev}, {args.threads} threads, median of {args.repeats} interleaved runs, torch {torch.__version__}")
    lines = [header, "",
             "| dtype | diffusers (rope.forward + 2 rotations) | lite_boost (cache hit + 2 in-place rotations) "
             "| lite_boost first call (cache miss) | apply_rotary_emb drop-in (out of place, excl. table) "
             "| reduction (steady state) | max abs diff vs diffusers |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for name, ms, mb, first, md, red, err in rows:
        lines.append(f"| {name} | {ms * 1e3:.1f} ms | {mb * 1e3:.1f} ms | {first * 1e3:.1f} ms | {md * 1e3:.1f} ms "
                     f"| {red * 100:.1f}% | {err:.1e} |")
    text = "\n".join(lines)
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
