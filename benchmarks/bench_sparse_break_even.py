"""Where block-sparse self-attention starts to pay: the whole sparse_attention call vs dense SDPA, per backend,
over short sequence lengths.

    flock /tmp/lite_boost_bench.lock .venv/bin/python benchmarks/bench_sparse_break_even.py [--reps 5]

The call is the one the boost makes (library defaults: selector "subblock", budget "reference",
keep_sink / keep_recent on, reference 8x8 windows, block 128) at sparsity 0.8, B = 1, 2 heads, float32,
D = 128 (Wan, Qwen-Image, Flux, HunyuanVideo all use head_dim 128) and D = 16 (the tiny Qwen-Image of
``lite-boost generate --family qwen-image``). Dense SDPA runs in the same process, interleaved with each
backend (one call each per round), medians of ``--reps`` rounds after one warm-up call each (the warm-up
compiles flex). The break-even of a backend is the smallest measured length from which the sparse call
is faster than dense at every longer measured length; it is what ``SPARSE_BREAK_EVEN`` in
``lite_boost/ops/sparse_break_even.py`` records (rounded up to a block). Results:
benchmarks/results/sparse_break_even.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lite_boost.ops.sparse import sparse_attention  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
# sequence length -> (t, h, w) latent grid
GRIDS = {512: (2, 16, 16), 1024: (4, 16, 16), 2048: (8, 16, 16), 3072: (3, 32, 32), 4096: (4, 32, 32),
         5376: (7, 24, 32), 8192: (8, 32, 32)}


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return platform.processor() or "unknown"
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    name = fields.get("Model name", "unknown").strip()
    fam = fields.get("CPU family", "?").strip()
    return f"{name} (family {fam})"


def run(s, heads, d, backends, reps, sparsity):
    grid = GRIDS[s]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, heads, s, d, generator=g) for _ in range(3))

    def sparse(be):
        return sparse_attention(q, k, v, head_num=heads, sparse_type="rf_v2", block_size=128, latent_shape_q=grid,
                                sparsity=sparsity, backend=be, return_stats=True)

    def dense():
        return F.scaled_dot_product_attention(q, k, v)

    stats = {}
    with torch.inference_mode():
        dense()
        for be in backends:
            stats[be] = sparse(be)[1]  # warm-up (flex compiles here)
            assert stats[be].path == "sparse" and stats[be].backend == be, stats[be]
        t_dense, t_sparse = [], {be: [] for be in backends}
        for _ in range(reps):
            t0 = time.perf_counter()
            dense()
            t_dense.append(time.perf_counter() - t0)
            for be in backends:
                t0 = time.perf_counter()
                sparse(be)
                t_sparse[be].append(time.perf_counter() - t0)
    dm = statistics.median(t_dense)
    rows = []
    for be in backends:
        sm = statistics.median(t_sparse[be])
        rows.append(dict(S=s, grid=grid, heads=heads, head_dim=d, backend=be, sparsity=sparsity,
                         effective_sparsity=round(stats[be].effective_sparsity, 3), dense_s=dm, sparse_s=sm,
                         speedup=dm / sm, reps=reps, dense_all=t_dense, sparse_all=t_sparse[be]))
        print(f"S={s} D={d} {be}: dense {dm * 1e3:.2f} ms, sparse {sm * 1e3:.2f} ms, {dm / sm:.2f}x", flush=True)
    return rows


def break_even(rows, backend, d):
    pts = sorted((r for r in rows if r["backend"] == backend and r["head_dim"] == d), key=lambda r: r["S"])
    best = None
    for r in reversed(pts):
        if r["speedup"] < 1.0:
            break
        best = r["S"]
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--backends", default="cpp,flex,gather")
    ap.add_argument("--lengths", default=",".join(map(str, GRIDS)))
    ap.add_argument("--small-d-lengths", default="1024,2048,4096")
    ap.add_argument("--sparsity", type=float, default=0.8)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    backends = args.backends.split(",")
    load0 = os.getloadavg()[0]
    rows = []
    for s in map(int, args.lengths.split(",")):
        rows += run(s, 2, 128, backends, args.reps, args.sparsity)
    for s in map(int, args.small_d_lengths.split(",")) if args.small_d_lengths else ():
        rows += run(s, 2, 16, backends, args.reps, args.sparsity)
    load1 = os.getloadavg()[0]
    meta = dict(cpu=cpu_model(), torch=torch.__version__, threads=args.threads, dtype="float32", batch=1, heads=2,
                sparsity=args.sparsity, date=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                load_1min_before=load0, load_1min_after=load1)
    be = {f"{b} D={d}": break_even(rows, b, d) for b in backends for d in sorted({r["head_dim"] for r in rows})}
    lines = ["### Block-sparse break-even: whole sparse_attention call vs dense SDPA", "",
             f"{meta['cpu']}; torch {meta['torch']}; {args.threads} threads; float32; B=1, 2 heads; sparsity "
             f"{args.sparsity}; library defaults (selector subblock, keep_sink, keep_recent, 8x8 windows, block 128); "
             f"medians of {args.reps} interleaved rounds after a warm-up call each; {meta['date']}; shared machine, "
             f"1-minute load {load0:.2f} before, {load1:.2f} after.", "",
             "| S | grid | head_dim | backend | effective sparsity | dense SDPA ms | sparse call ms | speed-up |",
             "|---:|---|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['S']} | {'x'.join(map(str, r['grid']))} | {r['head_dim']} | {r['backend']} | "
                     f"{r['effective_sparsity']:.2f} | {r['dense_s'] * 1e3:.2f} | {r['sparse_s'] * 1e3:.2f} | "
                     f"{r['speedup']:.2f}x |")
    lines += ["", "Break-even (smallest measured S from which every longer measured S is faster than dense; "
                  "none = never within the measured lengths):", ""]
    lines += [f"- {k}: {v if v is not None else 'none'}" for k, v in be.items()]
    text = "\n".join(lines)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "sparse_break_even.md").write_text(text + "\n", encoding="utf-8")
    (RESULTS / "sparse_break_even.json").write_text(json.dumps(dict(meta=meta, break_even=be, rows=rows), indent=1),
                                                     encoding="utf-8")
    print(text)


if __name__ == "__main__":
    main()
