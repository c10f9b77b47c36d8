"""Speed of the whole sparse_attention call (reorder, pool, mask, kernel, inverse) vs dense SDPA.

    python benchmarks/bench_sparse_speed.py            # S in {8192, 16384, 32760}, fp32 + bf16
    python benchmarks/bench_sparse_speed.py --quick    # S = 8192 only, 2 repetitions

B = 1, one head, D = 128, block 128, window (2, 8, 8), two threads. Dense baseline: PyTorch
``scaled_dot_product_attention`` in the same process; runs are interleaved (dense, then each
sparsity) and medians reported. "kernel" = rain_fusion_attention alone on already reordered
tensors with the same mask; "full" = the whole sparse_attention call. Main rows use
keep_sink=False so the computed fraction equals the requested budget; "defaults" rows keep the
library defaults (first-frame blocks forced in both directions), whose effective sparsity is lower.
Writes benchmarks/results/sparse_speed.{md,json} and sparse_speed.png.
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F

from bench_sparse_common import GRIDS, RESULTS, environment, markdown_table, median, timed, write

from lite_boost.ops.rain_fusion import rain_fusion_attention
from lite_boost.ops.sparse import sparse_attention
from lite_boost.ops._sparse_layout import token_order

WINDOW = (2, 8, 8)
BLOCK = 128


def run(seq_lens, dtypes, sparsities, reps, heads=1, d=128):
    rows, data = [], []
    for dtype in dtypes:
        for s in seq_lens:
            grid = GRIDS[s]
            gen = torch.Generator().manual_seed(0)
            q, k, v = (torch.randn(1, heads, s, d, generator=gen).to(dtype) for _ in range(3))
            configs = [(sp, False) for sp in sparsities] + ([(0.8, True)] if dtype == torch.float32 else [])

            def call(sp, sink):
                return sparse_attention(q, k, v, head_num=heads, sparse_type="rf_v2", block_size=BLOCK,
                                        latent_shape_q=grid, sparsity=sp, window=WINDOW, keep_sink=sink,
                                        return_stats=True)

            order = token_order(grid, WINDOW, 0)
            prepared = {}
            for cfg in configs:  # warm-up: compile and build the masks used by the kernel-only timing
                _, stats = call(*cfg)
                sel = stats.selection
                qc, kc, vc = (t.index_select(2, order.perm) for t in (q, k, v))
                prepared[cfg] = (stats, qc, kc, vc, sel)
                rain_fusion_attention(qc, kc, vc, sel.select_idx, sel.select_num, [BLOCK, BLOCK],
                                      q_input_layout="BNSD", kv_input_layout="BNSD")
            F.scaled_dot_product_attention(q, k, v)
            dense_t = []
            full_t = {cfg: [] for cfg in configs}
            kern_t = {cfg: [] for cfg in configs}
            for _ in range(reps):
                dense_t.append(timed(lambda: F.scaled_dot_product_attention(q, k, v))[0])
                for cfg in configs:
                    full_t[cfg].append(timed(lambda: call(*cfg))[0])
                    stats, qc, kc, vc, sel = prepared[cfg]
                    kern_t[cfg].append(timed(lambda: rain_fusion_attention(
                        qc, kc, vc, sel.select_idx, sel.select_num, [BLOCK, BLOCK], q_input_layout="BNSD",
                        kv_input_layout="BNSD"))[0])
            dm = median(dense_t)
            for cfg in configs:
                sp, sink = cfg
                stats = prepared[cfg][0]
                fm, km = median(full_t[cfg]), median(kern_t[cfg])
                ideal = 1.0 / (1.0 - sp)
                ideal_eff = 1.0 / (1.0 - stats.effective_sparsity)
                rec = dict(S=s, grid=grid, dtype=str(dtype).replace("torch.", ""), sparsity=sp,
                           keep_sink=sink, effective_sparsity=round(stats.effective_sparsity, 4),
                           backend=stats.backend, dense_s=dm, full_s=fm, kernel_s=km, speedup=dm / fm,
                           kernel_speedup=dm / km, ideal=ideal, frac_ideal=dm / fm / ideal,
                           frac_ideal_effective=dm / fm / ideal_eff, reps=reps,
                           dense_all=dense_t, full_all=full_t[cfg])
                data.append(rec)
                rows.append([s, rec["dtype"], sp, "defaults" if sink else "budget", f"{stats.effective_sparsity:.3f}",
                             stats.backend, f"{dm:.3f}", f"{fm:.3f}", f"{km:.3f}", f"{dm / fm:.2f}x",
                             f"{ideal:.2f}x", f"{100 * dm / fm / ideal:.0f}%", f"{100 * dm / fm / ideal_eff:.0f}%"])
                print(rows[-1], flush=True)
    return rows, data


def plot(data, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    sp = sorted({r["sparsity"] for r in data})
    xs = [x / 100 for x in range(0, 95)]
    ax.plot(xs, [1 / (1 - x) for x in xs], "k--", lw=1, label="ideal 1/(1-s)")
    for dtype in sorted({r["dtype"] for r in data}):
        for s in sorted({r["S"] for r in data}):
            pts = [r for r in data if r["dtype"] == dtype and r["S"] == s and not r["keep_sink"]]
            if pts:
                ax.plot([r["sparsity"] for r in pts], [r["speedup"] for r in pts], "o-" if dtype == "float32" else "s:",
                        label=f"S={s} {dtype}")
    ax.set_xlabel("sparsity")
    ax.set_ylabel("speed-up vs dense SDPA (whole call)")
    ax.set_xlim(min(sp) - 0.05, max(sp) + 0.03)
    ax.set_ylim(0, 11)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title("lite_boost sparse_attention (rf_v2) on CPU, 2 threads, D=128")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="S = 8192 only, 2 repetitions")
    ap.add_argument("--reps", type=int, default=None, help="timed repetitions per configuration (default 3)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--seq", default=None, help="comma-separated sequence lengths (8192,16384,32760)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    seq = [8192] if args.quick else [8192, 16384, 32760]
    if args.seq:
        seq = [int(x) for x in args.seq.split(",")]
    reps = args.reps or (2 if args.quick else 3)
    dtypes = [getattr(torch, x) for x in args.dtypes.split(",")]
    rows, data = run(seq, dtypes, [0.5, 0.8, 0.9], reps)
    headers = ["S", "dtype", "sparsity", "mask", "effective sparsity", "backend", "dense SDPA s", "sparse call s",
               "kernel only s", "speed-up", "ideal", "% of ideal", "% of ideal at effective sparsity"]
    text = (f"### sparse_attention speed vs dense SDPA\n\n{environment()}; B=1, N=1, D=128, block 128, window "
            f"{WINDOW}, medians of {reps} interleaved runs.\n\n" + markdown_table(headers, rows))
    name = "sparse_speed_quick" if args.quick else "sparse_speed"
    write(name, text, data)
    try:
        plot(data, RESULTS / f"{name}.png")
        print(f"plot: {RESULTS / (name + '.png')}")
    except ImportError:
        print("matplotlib not installed: no plot (pip install matplotlib)")


if __name__ == "__main__":
    main()
