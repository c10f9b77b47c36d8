"""The DiT step a user sees: one Wan transformer call at Wan2.1-1.3B dims, stock vs boosted variants.

    flock /tmp/lite_boost_cpu.lock python benchmarks/bench_dit_step.py --rows stock_compiled,boost_sparse_int8
    flock /tmp/lite_boost_cpu.lock python benchmarks/bench_dit_step.py --tokens 4096 --layers 2 --rows stock_compiled,boost_int8
    python benchmarks/bench_dit_step.py --assemble            # table + plot from the stored rows
    flock /tmp/lite_boost_cpu.lock python benchmarks/bench_dit_step.py --rows boost_sparse_int8 --profile

Model: ``WanTransformer3DModel`` with Wan2.1-T2V-1.3B's dimensions (12 heads x 128, ffn 8960, text_dim 4096,
freq_dim 256, patch (1, 2, 2), 16 channels in / out), random weights (seed 0), ``--layers`` blocks (default 1),
float32, CPU. Input: 480p, 81 frames = a 21 x 30 x 52 latent token grid (32,760 tokens; ``--tokens 4096`` =
4 x 32 x 32), timestep 500, a 512 x 4096 text context. One "step" = one transformer call (a pipeline step
with CFG makes two).

Rows (each a model built from the same weights; ``*_eager`` variants run the boosted row uncompiled):

* ``stock_eager``       diffusers as shipped: the baseline of every run (always included);
* ``stock_compiled``    ``transformer.compile_repeated_blocks(fullgraph=True)`` (inductor);
* ``boost_dense``       ``lite_boost.boost(model)``, compiled the same way (the recommendation of docs/guides/compile.md);
* ``boost_sparse``      ``SparseConfig(sparsity=0.8)`` (every other setting at its default), compiled;
* ``boost_int8``        ``QuantConfig("int8_dynamic")`` (torchao), compiled;
* ``boost_sparse_int8`` both, compiled;
* ``boost_sparse_int8_attn8`` both, and int8 attention (``attention={"precision": "int8"}``: int8 Q K^T,
  bf16 P V in the sparse kernel), compiled.

The int8-attention figure (one command; it appends its rows and prints the ratio of the last two rows)::

    flock /tmp/lite_boost_bench.lock python benchmarks/bench_dit_step.py --rows boost_sparse_int8,boost_sparse_int8_attn8 --repeats 2

Protocol: every row of the run is built and called once (warm-up: compiles, kernel JIT, first-touch
allocations), then ``--repeats`` rounds call each row once in turn (interleaved), medians reported with
the single runs. Speed-ups are against the stock eager row of the same process. Each run appends one
JSON record per row to ``benchmarks/results/dit_step_rows.jsonl`` (tokens, layers, threads, load average
before / after, times, output error vs stock eager); ``--assemble`` turns the stored records into
``dit_step.md`` and ``dit_step.png``. A stock eager step at 32,760 tokens takes about a minute on 2 cores:
keep each locked run to a few rows (``--rows``) and ``--repeats 2``.

``--profile`` adds one profiled call of the last row (torch.profiler, inductor kernels named) and prints
where its time goes, grouped: sparse kernel, block selection, int8 matmuls, other matmuls, dense
attention, inductor-fused code, layout copies, the rest.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"
ROWS_FILE = RESULTS / "dit_step_rows.jsonl"
ROWS = ("stock_eager", "stock_compiled", "boost_dense", "boost_sparse", "boost_int8", "boost_sparse_int8",
        "boost_sparse_int8_attn8")
GRIDS = {32760: (21, 30, 52), 4096: (4, 32, 32), 16380: (21, 30, 26)}
WAN_13B = dict(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16, out_channels=16,
               text_dim=4096, freq_dim=256, ffn_dim=8960, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
               eps=1e-6)


def build_stock(layers: int):
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    return WanTransformer3DModel(num_layers=layers, **WAN_13B).eval()


def inputs(grid):
    f, h, w = grid
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 16, f, 2 * h, 2 * w, generator=g)
    ctx = torch.randn(1, 512, 4096, generator=g)
    return x, torch.tensor([500.0]), ctx


def cpu_model() -> str:
    """``lscpu``'s model name and CPU family (the ratios depend on the CPU)."""
    info = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, val = line.partition(":")
            info.setdefault(key.strip(), val.strip())
    except OSError:
        return platform.processor()
    return f"{info.get('model name', '?')} (family {info.get('cpu family', '?')})"


def base_row(row: str) -> str:
    """``boost_x_eager`` -> ``boost_x``; other names unchanged."""
    return row[: -len("_eager")] if row.startswith("boost") and row.endswith("_eager") else row


def boost_config(row: str):
    from lite_boost.config import BoostConfig, QuantConfig, SparseConfig

    base = base_row(row)
    sparse = SparseConfig(sparsity=0.8) if "sparse" in base else None
    quant = QuantConfig("int8_dynamic") if "int8" in base else None
    attention = {"precision": "int8"} if base.endswith("_attn8") else {}
    return BoostConfig(sparse=sparse, quant=quant, attention=attention)


def make_row(row: str, stock):
    import lite_boost

    model = copy.deepcopy(stock)
    if row.startswith("boost"):
        lite_boost.boost(model, boost_config(row))
    if row == "stock_compiled" or (row.startswith("boost") and not row.endswith("_eager")):
        model.compile_repeated_blocks(fullgraph=True)
    return model


def call(model, args):
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model(*args).sample
    return time.perf_counter() - t0, out


def sparse_info(model):
    state = getattr(model, "_lite_boost", None)
    sp = state.extras.get("sparse") if state is not None else None
    if sp is None or not sp.events:
        return None
    e = sp.events[-1]
    return {"effective_sparsity": round(e.effective_sparsity, 4), "backend": e.backend, "path": e.path}


# ------------------------------------------------------------------------------------------- profile
GROUPS = (  # (group, substrings of profiler event names), first match wins
    ("sparse kernel", ("rain_fusion_attention",)),
    ("int8 matmuls", ("_int_mm",)),
    ("dense attention (SDPA)", ("scaled_dot_product", "flash_attention")),
    ("fp32 matmuls", ("aten::addmm", "aten::mm", "aten::bmm", "aten::matmul", "mkl_linear", "mkldnn")),
    ("layout copies / gathers", ("index_select", "index_copy", "aten::copy_", "aten::gather", "aten::cat",
                                 "clone", "contiguous")),
    ("inductor-fused code", ("cpp_fused", "CompiledFxGraph", "graph_")),
)


def profile_row(model, args, top=30):
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        wall, _ = call(model, args)
    events = prof.key_averages()
    print(events.table(sort_by="self_cpu_time_total", row_limit=top, max_name_column_width=80))
    groups = {g: 0.0 for g, _ in GROUPS}
    groups["other"] = 0.0
    selector_ops = ("aten::softmax", "aten::_softmax", "aten::topk", "aten::sort", "aten::sum", "aten::amax",
                    "aten::scatter", "aten::linalg_vector_norm")
    in_selector = 0.0
    for ev in events:
        name, t = ev.key, ev.self_cpu_time_total / 1e6
        for g, keys in GROUPS:
            if any(k in name for k in keys):
                groups[g] += t
                break
        else:
            groups["other"] += t
        if any(name.startswith(k) for k in selector_ops):
            in_selector += t
    total = sum(groups.values())
    print(f"\nwall {wall:.2f} s, profiled self CPU time {total:.2f} s (per thread pool: approximate shares)")
    for g, t in sorted(groups.items(), key=lambda kv: -kv[1]):
        print(f"  {g:28s} {t:7.2f} s  {100 * t / total:5.1f}%")
    return {"wall_s": wall, "groups_s": groups}


# ------------------------------------------------------------------------------------------- assemble
def label(row: str) -> str:
    return LABELS[base_row(row)] + (" (eager)" if row != base_row(row) else "")


LABELS = {"stock_eager": "stock eager", "stock_compiled": "stock compiled", "boost_dense": "boost dense",
          "boost_sparse": "boost sparse 0.8", "boost_int8": "boost int8", "boost_sparse_int8": "boost sparse 0.8 + int8",
          "boost_sparse_int8_attn8": "boost sparse 0.8 + int8 + int8 attention"}


def assemble(path=ROWS_FILE):
    recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    by_shape = {}
    for r in recs:
        by_shape.setdefault((r["tokens"], r["layers"]), []).append(r)
    lines = []
    for (tokens, layers), rs in sorted(by_shape.items(), key=lambda kv: (-kv[0][0], kv[0][1])):
        lines += [f"### {tokens:,} tokens, {layers} block(s), fp32, {rs[0]['threads']} threads", "",
                  "| row | step (s) | vs stock eager (same run) | vs stock compiled | single runs (s) | stock eager in that run (s) | "
                  "rel. error vs stock | cosine | effective sparsity | load before / after | run |",
                  "|---|---:|---:|---:|---|---:|---:|---:|---:|---|---|"]
        compiled = {r["run"]: r["median_s"] for r in rs if r["row"] == "stock_compiled"}
        for r in sorted(rs, key=lambda r: (ROWS.index(base_row(r["row"])), r["row"], r["run"])):
            vs_c = f"{compiled[r['run']] / r['median_s']:.2f}x" if r["run"] in compiled else "-"
            sp = r.get("sparse") or {}
            lines.append(
                f"| {label(r['row'])} | {r['median_s']:.2f} | **{r['speedup_vs_stock_eager']:.2f}x** | {vs_c} | "
                f"{', '.join(f'{t:.2f}' for t in r['times_s'])} | {r['stock_eager_median_s']:.2f} | "
                f"{r['rel_err']:.1e} | {r['cosine']:.6f} | {sp.get('effective_sparsity', '-')} | "
                f"{r['load_before']:.2f} / {r['load_after']:.2f} | {r['run']} |")
        lines.append("")
    text = "\n".join(lines)
    (RESULTS / "dit_step.md").write_text(text + "\n")
    print(text)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot (pip install matplotlib)")
        return text
    shapes = sorted(by_shape, key=lambda s: -s[0])
    fig, axes = plt.subplots(1, len(shapes), figsize=(6 * len(shapes), 3.8), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        latest = {}
        for r in by_shape[shape]:
            latest[r["row"]] = r  # the last run of each row
        names = sorted(latest, key=lambda n: (ROWS.index(base_row(n)), n))
        vals = [latest[n]["speedup_vs_stock_eager"] for n in names]
        ax.barh([label(n) for n in names], vals, color=["#999" if n.startswith("stock") else "#2a7" for n in names])
        for i, v in enumerate(vals):
            ax.text(v, i, f" {v:.2f}x", va="center")
        ax.axvline(1.0, color="k", lw=0.8)
        ax.invert_yaxis()
        ax.set_xlabel("speed-up per step vs stock eager (same run)")
        ax.set_title(f"Wan2.1-1.3B dims, {shape[0]:,} tokens, {shape[1]} block(s), fp32 CPU")
        ax.set_xlim(0, max(vals) * 1.25)
    fig.tight_layout()
    fig.savefig(RESULTS / "dit_step.png", dpi=120)
    print(f"wrote {RESULTS / 'dit_step.png'}")
    return text


# ------------------------------------------------------------------------------------------- main
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default=",".join(ROWS[1:]), help=f"comma list from {list(ROWS)} (+ '_eager' variants "
                                                              "of the boost rows); stock_eager is always run")
    ap.add_argument("--tokens", type=int, default=32760, choices=sorted(GRIDS))
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--profile", action="store_true", help="one profiled call of the last row after the timing")
    ap.add_argument("--profile-only", default=None, metavar="ROW",
                    help="build only ROW, warm it up, time one call and profile one (no baseline, nothing recorded)")
    ap.add_argument("--no-record", action="store_true", help="do not append to dit_step_rows.jsonl")
    ap.add_argument("--assemble", action="store_true", help="only build dit_step.md / .png from the stored rows")
    args = ap.parse_args(argv)
    if args.assemble:
        assemble()
        return 0
    warnings.simplefilter("ignore")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(args.threads)
    if args.profile:
        import torch._inductor.config as ic

        ic.cpp.enable_kernel_profile = True  # name each inductor C++ kernel in the profile
    if args.profile_only:
        if base_row(args.profile_only) not in ROWS:
            raise SystemExit(f"--profile-only: unknown row {args.profile_only!r}; rows: {list(ROWS)}")
        model = make_row(args.profile_only, build_stock(args.layers))
        x = inputs(GRIDS[args.tokens])
        print(f"warm-up {call(model, x)[0]:.2f} s, timed call {call(model, x)[0]:.2f} s, load {os.getloadavg()[0]:.2f}",
              flush=True)
        profile_row(model, x)
        return 0
    rows = ["stock_eager"] + [r.strip() for r in args.rows.split(",") if r.strip() and r.strip() != "stock_eager"]
    for r in rows:
        if base_row(r) not in ROWS:
            raise SystemExit(f"--rows: unknown row {r!r}; rows: {list(ROWS)} (+ '_eager' variants of the boost rows)")
    grid = GRIDS[args.tokens]
    load_before = os.getloadavg()[0]
    stock = build_stock(args.layers)
    x = inputs(grid)
    models = {r: make_row(r, stock) for r in rows}
    warm, outs = {}, {}
    for r in rows:
        warm[r], outs[r] = call(models[r], x)
        print(f"warm-up {r:22s} {warm[r]:7.2f} s", flush=True)
    times = {r: [] for r in rows}
    for i in range(args.repeats):
        for r in rows:
            times[r].append(call(models[r], x)[0])
        print(f"round {i + 1}/{args.repeats}: " + ", ".join(f"{r} {times[r][-1]:.2f}" for r in rows), flush=True)
    load_after = os.getloadavg()[0]
    base = statistics.median(times["stock_eager"])
    ref = outs["stock_eager"].double().flatten()
    run_id = time.strftime("%Y-%m-%dT%H:%M:%S")
    records = []
    for r in rows:
        med = statistics.median(times[r])
        o = outs[r].double().flatten()
        rec = {"run": run_id, "row": r, "tokens": args.tokens, "grid": grid, "layers": args.layers, "threads": args.threads,
               "repeats": args.repeats, "median_s": med, "times_s": times[r], "warmup_s": warm[r],
               "stock_eager_median_s": base, "speedup_vs_stock_eager": base / med,
               "rel_err": float((o - ref).norm() / ref.norm()),
               "cosine": float(torch.nn.functional.cosine_similarity(o, ref, dim=0)),
               "sparse": sparse_info(models[r]), "load_before": load_before, "load_after": load_after,
               "torch": torch.__version__, "machine": platform.machine(), "cpus": os.cpu_count(),
               "cpu_model": cpu_model()}
        records.append(rec)
        print(f"{r:22s} median {med:7.2f} s  {base / med:5.2f}x  rel err {rec['rel_err']:.1e}  "
              f"sparse {rec['sparse']}", flush=True)
    print(f"load average {load_before:.2f} before, {load_after:.2f} after")
    if len(rows) >= 3:  # the last boosted row against the one before it (e.g. int8 attention on / off)
        a, b = rows[-2], rows[-1]
        print(f"{b} vs {a}: {statistics.median(times[a]) / statistics.median(times[b]):.2f}x faster")
    if not args.no_record:
        RESULTS.mkdir(parents=True, exist_ok=True)
        with ROWS_FILE.open("a") as fh:
            for rec in records:
                fh.write(json.dumps(rec) + "\n")
    if args.profile:
        profile_row(models[rows[-1]], x)
    return 0


if __name__ == "__main__":
    sys.exit(main())
