"""Speed of the whole sparse_attention call (reorder, pool, mask, kernel, inverse) vs dense SDPA, per backend.

    python benchmarks/bench_sparse_speed.py            # S in {16384, 32760} x heads {1, 12}, fp32 + bf16
    python benchmarks/bench_sparse_speed.py --quick    # S = 8192, 1 head, 2 repetitions

B = 1, D = 128, block 128, window (2, 8, 8), keep_sink=False, two threads. Masks come from
selector="reference" (RainFusion 2.0's mean-pooled block scores, cheap); one extra cpp row at 0.8 uses
the library's default selector ("subblock", estimated attention mass), whose scoring costs more.
Baseline: PyTorch ``scaled_dot_product_attention`` in the same process.

What is computed: the whole ``sparse_attention`` call (keep_sink=False, other arguments at their
defaults) keeps ``ceil((1-s) * kv_blocks)`` blocks per query block and then forces each query
block's diagonal block on top (``keep_recent``, budget="reference"), so it computes slightly more
than 1-s of the blocks (effective-sparsity column). The "kernel only" timing measures the kernel
against the nominal ideal 1/(1-s), so it runs on a selection of exactly ``ceil((1-s) * kv_blocks)``
blocks per row (same selector, ``keep_recent=False``; "kernel density" column); the only excess
over 1-s left there is the rounding up of the block count.
Each repetition runs dense SDPA, then every (sparsity, backend) configuration once (interleaved);
medians are reported. For the rows of the C++ backend the mask building alone (``block_scores`` +
``select_blocks`` per head on the already reordered q, k, as the call runs them) is timed in the same
rounds: "selection s" and its share of the whole call. Backends: "cpp" (the C++ kernel, torch.ops.lite_boost) at every sparsity
including 0 (every block selected: sparse_attention would run dense SDPA there, so that row times
``rain_fusion_attention`` with a full selection); "flex" (compiled FlexAttention) and "gather" (pure PyTorch)
at 0.5 / 0.8 / 0.9; the 12-head shapes, which are expensive, run sparsity 0 (cpp) and 0.8 only. Repetitions:
``--reps`` (default 5; at most 3 at S = 32,760) for the 1-head shapes, ``--reps-big``
(default 2) for 12 heads. Results are written after every shape (benchmarks/results/sparse_speed.{md,json}) and
plotted (sparse_speed.png). Run under ``flock /tmp/lite_boost_cpu.lock`` on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import math
import os

import torch
import torch.nn.functional as F

from bench_sparse_common import GRIDS, RESULTS, environment, markdown_table, median, timed, write

from lite_boost.ops import _ext
from lite_boost.ops._sparse_layout import token_order
from lite_boost.ops._sparse_mask import block_scores, select_blocks
from lite_boost.ops.rain_fusion import rain_fusion_attention
from lite_boost.ops.sparse import DEFAULT_SELECTOR_REPS, SparseStats, sparse_attention

WINDOW = (2, 8, 8)
BLOCK = 128
HEADERS = ["S", "heads", "dtype", "sparsity", "backend", "selector", "effective sparsity", "dense SDPA s", "sparse call s",
           "speed-up", "ideal", "% of ideal", "kernel density", "kernel only s", "kernel speed-up", "kernel % of ideal",
           "kernel % of ideal at its density", "selection s", "selection % of call", "runs"]


def configs(heads, backends, sparsities, big=False):
    """(sparsity, backend, selector) triples; ``big`` shapes: flex / gather at 0.8 only, 12 heads 0 and 0.8 only."""
    out = [(0.0, "cpp", "-")] if "cpp" in backends else []
    for sp in sparsities:
        if heads > 1 and sp != 0.8:
            continue  # 12 heads (expensive): the target sparsity only
        for b in backends:
            if big and b != "cpp" and sp != 0.8:
                continue
            out.append((sp, b, "reference"))
            if b == "cpp" and sp == 0.8:
                out.append((sp, b, "subblock"))  # the library's default selector, for its cost
    return out


def selection(qc, kc, sparsity, selector):
    """The mask building of one call on reordered q, k (B, N, S, D): per head, the scores of
    ``selector`` and the top-k with each query block's diagonal block forced (keep_sink=False, no text)."""
    nb = -(-qc.shape[2] // BLOCK)
    keep = max(1, math.ceil((1.0 - sparsity) * nb))
    none = torch.zeros(nb, dtype=torch.bool)
    diag = torch.arange(nb)
    tok = torch.full((nb,), BLOCK)
    tok[-1] = qc.shape[2] - (nb - 1) * BLOCK
    reps = tuple(min(r, BLOCK) for r in DEFAULT_SELECTOR_REPS)
    for h in range(qc.shape[1]):
        score, probs = block_scores(qc[:, h:h + 1], kc[:, h:h + 1], BLOCK, qc.shape[-1] ** -0.5, selector, *reps)
        select_blocks(score, probs, keep, none, none, diag, 1.0, tok, tok, "reference")


def run_shape(s, heads, dtype, backends, sparsities, reps, d=128, kernel_only=False):
    grid = GRIDS[s]
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, heads, s, d, generator=gen).to(dtype) for _ in range(3))
    cfgs = configs(heads, backends, sparsities, big=s * heads > 16384)

    nb = -(-s // BLOCK)
    full_idx = torch.arange(nb).expand(nb, heads, nb).contiguous()
    full_num = torch.full((nb, heads), nb)

    def call(sp, backend, selector):
        if sp == 0.0:  # sparse_attention runs dense SDPA when every block is kept: time the kernel itself
            out, _ = rain_fusion_attention(q, k, v, full_idx, full_num, [BLOCK, BLOCK], q_input_layout="BNSD",
                                           kv_input_layout="BNSD", backend=backend)
            return out, SparseStats("sparse", "every block selected", backend, 0.0, 0.0)
        return sparse_attention(q, k, v, head_num=heads, sparse_type="rf_v2", block_size=BLOCK, latent_shape_q=grid,
                                sparsity=sp, window=WINDOW, keep_sink=False, backend=backend, selector=selector,
                                return_stats=True)

    stats, prepared, kdens = {}, {}, {}
    order = token_order(grid, WINDOW, 0).perm
    qc, kc, vc = (t.index_select(2, order) for t in (q, k, v))
    for cfg in cfgs:  # warm-up: compiles flex, computes the masks the kernel-only timing reuses
        if cfg[0] == 0.0:
            prepared[cfg] = (q, k, v, full_idx, full_num)
            kdens[cfg] = 1.0
            continue
        stats[cfg] = call(*cfg)[1]
        # kernel-only selection: exactly ceil((1-s) * kv_blocks) blocks per row (no forced diagonal)
        sel = sparse_attention(q, k, v, head_num=heads, sparse_type="rf_v2", block_size=BLOCK, latent_shape_q=grid,
                               sparsity=cfg[0], window=WINDOW, keep_sink=False, keep_recent=False, backend=cfg[1],
                               selector=cfg[2], return_stats=True)[1].selection
        keep = math.ceil((1.0 - cfg[0]) * nb - 1e-9)
        assert bool((sel.select_num == keep).all()), (keep, sel.select_num.min(), sel.select_num.max())
        prepared[cfg] = (qc, kc, vc, sel.select_idx, sel.select_num)
        kdens[cfg] = keep / nb

    def kernel(cfg):
        a, b, c, idx, num = prepared[cfg]
        return rain_fusion_attention(a, b, c, idx, num, [BLOCK, BLOCK], q_input_layout="BNSD",
                                     kv_input_layout="BNSD", backend=cfg[1])

    F.scaled_dot_product_attention(q, k, v)
    dense_t, sparse_t, kern_t, sel_t = [], {c: [] for c in cfgs}, {c: [] for c in cfgs}, {c: [] for c in cfgs}
    for _ in range(reps):
        dense_t.append(timed(lambda: F.scaled_dot_product_attention(q, k, v))[0])
        for cfg in cfgs:
            if cfg[0] == 0.0:
                t, (_, st) = timed(lambda: call(*cfg))
                sparse_t[cfg].append(t)
                stats[cfg] = st
                kern_t[cfg].append(t)
                continue
            if not kernel_only:
                t, (_, st) = timed(lambda: call(*cfg))
                sparse_t[cfg].append(t)
                stats[cfg] = st
            if (heads == 1 or cfg[1] == "cpp") and cfg[2] == "reference":
                kern_t[cfg].append(timed(lambda: kernel(cfg))[0])
            if cfg[1] == "cpp":
                sel_t[cfg].append(timed(lambda: selection(qc, kc, cfg[0], cfg[2]))[0])
    dm = median(dense_t)
    rows, data = [], []
    for cfg in cfgs:
        sp, backend, selector = cfg
        st = stats[cfg]
        assert st.backend == backend, (st.backend, backend)
        fm = median(sparse_t[cfg]) if sparse_t[cfg] else float("nan")
        km = median(kern_t[cfg]) if kern_t[cfg] else float("nan")
        sm = median(sel_t[cfg]) if sel_t[cfg] else float("nan")
        ideal = 1.0 / (1.0 - sp)
        rec = dict(S=s, heads=heads, grid=grid, dtype=str(dtype).replace("torch.", ""), sparsity=sp, backend=backend,
                   selector=selector,
                   effective_sparsity=round(st.effective_sparsity, 4), kernel_density=round(kdens[cfg], 4), dense_s=dm, sparse_s=fm, speedup=dm / fm,
                   ideal=ideal, frac_ideal=dm / fm / ideal, kernel_s=km, kernel_speedup=dm / km,
                   kernel_frac_ideal=dm / km / ideal, selection_s=sm, reps=reps, dense_all=dense_t,
                   sparse_all=sparse_t[cfg], kernel_all=kern_t[cfg], selection_all=sel_t[cfg])
        data.append(rec)
        rows.append(row_of(rec))
        print(rows[-1], flush=True)
    return rows, data


def row_of(r):
    dm, fm, km, ideal, eff = r["dense_s"], r["sparse_s"], r["kernel_s"], r["ideal"], r["effective_sparsity"]
    kd = r.get("kernel_density", 1.0 - eff)  # results of older runs: the kernel ran the whole call's selection
    sel = r.get("selection_s", float("nan"))  # not timed before
    return [r["S"], r["heads"], r["dtype"], r["sparsity"], r["backend"], r["selector"], f"{eff:.3f}", f"{dm:.3f}",
            f"{fm:.3f}", f"{dm / fm:.2f}x", f"{ideal:.2f}x", f"{100 * dm / fm / ideal:.0f}%", f"{kd:.3f}", f"{km:.3f}",
            f"{dm / km:.2f}x", f"{100 * dm / km / ideal:.0f}%", f"{100 * dm / km * kd:.0f}%",
            "-" if sel != sel else f"{sel:.4f}", "-" if sel != sel or fm != fm else f"{100 * sel / fm:.1f}%", r["reps"]]


def plot(data, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dtypes = sorted({r["dtype"] for r in data}, reverse=True)
    fig, axes = plt.subplots(1, len(dtypes), figsize=(6.2 * len(dtypes), 4.4), squeeze=False)
    xs = [x / 100 for x in range(0, 93)]
    style = {"cpp": "o-", "flex": "s--", "gather": "^:"}
    for ax, dtype in zip(axes[0], dtypes):
        ax.plot(xs, [1 / (1 - x) for x in xs], "k--", lw=1, label="ideal 1/(1-s)")
        for backend in ("cpp", "flex", "gather"):
            for s in sorted({r["S"] for r in data}):
                for h in sorted({r["heads"] for r in data}):
                    pts = sorted((r for r in data if r["dtype"] == dtype and r["S"] == s and r["heads"] == h
                                  and r["backend"] == backend and r["selector"] != "subblock"
                                  and r["speedup"] == r["speedup"]),
                                 key=lambda r: r["sparsity"])
                    if pts:
                        ax.plot([r["sparsity"] for r in pts], [r["speedup"] for r in pts], style[backend],
                                ms=4, label=f"{backend} S={s} x{h}h")
        ax.set_xlabel("sparsity")
        ax.set_ylabel("speed-up vs dense SDPA (whole sparse_attention call)")
        ax.set_ylim(0, 11)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6, ncol=2)
        ax.set_title(f"{dtype}, CPU, 2 threads, D=128")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="S = 8192, 1 head, 2 repetitions")
    ap.add_argument("--reps", type=int, default=5, help="repetitions for 1-head shapes (at most 3 at S=32760)")
    ap.add_argument("--reps-big", type=int, default=2, help="repetitions for 12-head shapes")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--seq", default=None, help="comma-separated sequence lengths (default 16384,32760)")
    ap.add_argument("--heads", default="1,12")
    ap.add_argument("--backends", default="cpp,flex,gather")
    ap.add_argument("--append", action="store_true", help="keep the shapes already in the results file")
    ap.add_argument("--kernel-only", action="store_true",
                    help="time SDPA and the kernel only (no whole-call timing; for the slow 12-head shapes)")
    ap.add_argument("--sparsities", default="0.5,0.8,0.9")
    ap.add_argument("--name", default=None, help="results file name (default sparse_speed / sparse_speed_quick)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lib = _ext.load()
    backends = [b for b in args.backends.split(",") if b != "cpp" or lib.loaded]
    seq = [8192] if args.quick else [16384, 32760]
    if args.seq:
        seq = [int(x) for x in args.seq.split(",")]
    heads = [1] if args.quick else [int(x) for x in args.heads.split(",")]
    dtypes = [getattr(torch, x) for x in args.dtypes.split(",")]
    name = args.name or ("sparse_speed_quick" if args.quick else "sparse_speed")
    rows, data = [], []
    if args.append and (RESULTS / f"{name}.json").is_file():  # continue an interrupted run
        data = json.loads((RESULTS / f"{name}.json").read_text())
        rows = [row_of(r) for r in data]
    done = {(r["S"], r["heads"], r["dtype"]) for r in data}
    for h in heads:
        for s in seq:
            for dtype in dtypes:
                if (s, h, str(dtype).replace("torch.", "")) in done:
                    continue
                if args.quick:
                    reps = 2
                elif h == 1:
                    reps = args.reps if s < 32760 else min(args.reps, 3)
                else:
                    reps = args.reps_big
                r, d = run_shape(s, h, dtype, backends, [float(x) for x in args.sparsities.split(",")], reps,
                                 kernel_only=args.kernel_only)
                rows += r
                data += d
                text = (f"### sparse_attention speed vs dense SDPA, per block-sparse backend\n\n{environment()}; "
                        f"load average at the end {os.getloadavg()[0]:.2f}; "
                        f"B=1, D=128, block 128, window {WINDOW}, keep_sink=False, medians of interleaved runs "
                        "(runs column). 'sparse call' = the whole sparse_attention call (reorder, pool, select, "
                        "kernel, inverse; keep_sink=False, diagonal block forced on top); 'kernel only' = "
                        "rain_fusion_attention on the already reordered tensors with the same selector but exactly "
                        "ceil((1-s) * kv_blocks) blocks per row ('kernel density'; 1-head shapes: every backend; "
                        "12 heads: cpp)"
                        + ("; whole call not timed (--kernel-only)" if args.kernel_only else "") + ". "
                        f"C++ library: {'built' if lib.loaded else 'not built: ' + str(lib.reason)}"
                        "\n\n" + markdown_table(HEADERS, rows))
                write(name, text, data)
                try:
                    plot(data, RESULTS / f"{name}.png")
                except ImportError:
                    print("matplotlib not installed: no plot (pip install matplotlib)")


if __name__ == "__main__":
    main()
