"""Cost of block selection (scoring + top-k + forced blocks) relative to dense attention.

    python benchmarks/bench_sparse_selector.py            # S = 32,760 (grid 21x30x52), 1 head, D = 128
    python benchmarks/bench_sparse_selector.py --quick    # S = 8,192
    python benchmarks/bench_sparse_selector.py --seq 16384 --heads 2 --name sparse_selector_cost_s16384_h2

Times, interleaved in one process: dense SDPA on the same tensors, and the mask building of each
selector as sparse_attention runs it on the reordered q, k (``block_scores`` + ``select_blocks``
with the first-frame sink and the diagonal forced; the reordering itself is shared by both
selectors and not counted), one head at a time as sparse_attention runs it. Medians over ``--reps``
rounds. Writes benchmarks/results/sparse_selector_cost.{md,json} (or ``--name``).
"""

from __future__ import annotations

import argparse
import math
import os

import torch
import torch.nn.functional as F

from bench_sparse_common import GRIDS, environment, markdown_table, median, timed, write

from lite_boost.ops._sparse_layout import token_order
from lite_boost.ops._sparse_mask import block_scores, forced_blocks, select_blocks
from lite_boost.ops.sparse import DEFAULT_SELECTOR_REPS

SELECTORS = [("reference (mean pooling)", "reference", None), ("subblock (32, 8), default", "subblock", (32, 8)),
             ("subblock (16, 8)", "subblock", (16, 8)), ("subblock (32, 16)", "subblock", (32, 16))]


def build_mask(q, k, grid, block, selector, reps, sparsity=0.8):
    nqb, nkb = -(-q.shape[2] // block), -(-k.shape[2] // block)
    o = token_order(grid, None, 0)
    fk = forced_blocks(o.is_sink, block)
    diag = torch.arange(nqb) * nkb // nqb
    q_tok = torch.full((nqb,), block)
    q_tok[-1] = q.shape[2] - (nqb - 1) * block
    kv_tok = q_tok.clone()
    reps = reps or DEFAULT_SELECTOR_REPS
    keep = math.ceil((1 - sparsity) * nkb)
    for h in range(q.shape[1]):
        score, probs = block_scores(q[:, h:h + 1], k[:, h:h + 1], block, q.shape[-1] ** -0.5, selector, reps[0], reps[1])
        select_blocks(score, probs, keep, fk, fk, diag, 1.0, q_tok, kv_tok, "reference")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--seq", type=int, default=None, choices=sorted(GRIDS), help="sequence length (default 32760)")
    ap.add_argument("--heads", type=int, default=1)
    ap.add_argument("--name", default=None, help="results file stem")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    s = args.seq or (8192 if args.quick else 32760)
    grid = GRIDS[s]
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, args.heads, s, 128, generator=gen).to(dtype) for _ in range(3))
    block = 128
    times = {"dense SDPA": []}
    times.update({name: [] for name, _, _ in SELECTORS})
    build_mask(q, k, grid, block, "subblock", None)  # warm-up
    for _ in range(args.reps):
        t, _ = timed(lambda: F.scaled_dot_product_attention(q, k, v))
        times["dense SDPA"].append(t)
        for name, sel, reps in SELECTORS:
            t, _ = timed(lambda: build_mask(q, k, grid, block, sel, reps))
            times[name].append(t)
        print({n: f"{ts[-1] * 1e3:.1f} ms" for n, ts in times.items()}, flush=True)
    dense = median(times["dense SDPA"])
    rows, data = [], []
    for name, ts in times.items():
        m = median(ts)
        rows.append([name, f"{m * 1e3:.1f} ms", f"{m * 1e3 / args.heads:.1f} ms", f"{100 * m / dense:.2f}%"])
        data.append(dict(name=name, seconds=ts, median=m, fraction_of_dense=m / dense, heads=args.heads, S=s))
    text = (f"### Block-selection cost vs dense attention\n\n{environment()}; load average at the end "
            f"{os.getloadavg()[0]:.2f}; S = {s} (grid {grid}), {args.heads} head(s), D = 128, {args.dtype}, block "
            f"128, sparsity 0.8, first-frame and diagonal blocks forced; medians of {args.reps} interleaved rounds."
            f"\n\n" + markdown_table(["", "median", "per head", "% of dense SDPA"], rows))
    write(args.name or ("sparse_selector_cost" + ("_quick" if args.quick else "")), text, data)


if __name__ == "__main__":
    main()
