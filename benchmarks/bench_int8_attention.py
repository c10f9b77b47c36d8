"""One attention call at int8 (``precision="int8"``) against the same kernel in fp32: speed and error.

    flock /tmp/lite_boost_bench.lock python benchmarks/bench_int8_attention.py           # S 16,384 and 32,760
    flock /tmp/lite_boost_bench.lock python benchmarks/bench_int8_attention.py --quick   # S 4,096, 2 heads

Shape: B = 1, 12 heads x 128 (Wan2.1-1.3B), float32 inputs, BNSD, two threads. The C++ kernel
(``torch.ops.lite_boost.rain_fusion_attention``) runs at ``precision="auto"`` (fp32 GEMMs on oneDNN's brgemm)
and ``"int8"`` (int8 Q K^T after smoothing K, fp32 softmax, bf16 P V) on the same selection: every block
(dense: the kernel ``lite_boost.ops.attention(precision="int8")`` runs on the CPU) and sparsity 0.8
(``ceil(0.2 * blocks)`` KV blocks per query block of 128 tokens, neighbouring query blocks sharing their
selection as video masks mostly do). Inputs: Gaussian q / v and keys with a per-channel offset (4x their
spread, as DiT keys have), the hard case for quantization (no attention peaks to hide the error).
Error of the int8 output against the fp32 output of the same selection: cosine similarity, relative L1
(SageAttention's metric), relative L2. Protocol: one warm-up call per row, then ``--repeats`` interleaved
rounds, medians. The record names the CPU (``/proc/cpuinfo`` model name and family), threads, load average
before / after (the machine may be shared), date. Results: benchmarks/results/int8_attention.{md,json}.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_dit_step import cpu_model  # noqa: E402
from bench_sparse_common import markdown_table, write  # noqa: E402

from lite_boost.ops import _ext  # noqa: E402

BLOCK = 128


def problem(s, heads, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, heads, s, d, generator=g)
    k = torch.randn(1, heads, s, d, generator=g) + 4.0 * torch.randn(1, heads, 1, d, generator=g)
    v = torch.randn(1, heads, s, d, generator=g)
    return q, k, v


def selection(s, heads, sparsity, seed=1):
    nb = math.ceil(s / BLOCK)
    keep = nb if sparsity == 0 else max(1, math.ceil((1 - sparsity) * nb))
    if keep == nb:
        return torch.arange(nb).expand(nb, heads, nb).contiguous(), torch.full((nb, heads), nb)
    g = torch.Generator().manual_seed(seed)
    pairs = -(-nb // 2)
    rows = torch.stack([torch.randperm(nb, generator=g)[:keep].sort().values for _ in range(pairs * heads)])
    idx = rows.view(pairs, heads, keep).repeat_interleave(2, 0)[:nb].contiguous()
    return idx, torch.full((nb, heads), keep)


def run(q, k, v, idx, num, precision):
    t0 = time.perf_counter()
    out, _ = torch.ops.lite_boost.rain_fusion_attention(q, k, v, idx, num, [BLOCK, BLOCK], q_input_layout="BNSD",
                                                        kv_input_layout="BNSD", precision=precision)
    return time.perf_counter() - t0, out


def errors(out, ref):
    o, r = out.double().flatten(), ref.double().flatten()
    return {"cosine": float(torch.nn.functional.cosine_similarity(o, r, dim=0)),
            "rel_l1": float((o - r).abs().sum() / r.abs().sum()), "rel_l2": float((o - r).norm() / r.norm())}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq", default="16384,32760")
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        args.seq, args.heads = "4096", 2
    torch.set_num_threads(args.threads)
    st = _ext.load()
    if not st.loaded:
        raise SystemExit(f"the C++ operator library is not built: {st.reason}")
    load_before = os.getloadavg()[0]
    records, table = [], []
    for s in (int(x) for x in args.seq.split(",")):
        q, k, v = problem(s, args.heads, 128)
        for sparsity in (0.0, 0.8):
            idx, num = selection(s, args.heads, sparsity)
            rows = {p: [] for p in ("auto", "int8")}
            outs = {p: run(q, k, v, idx, num, p)[1] for p in rows}  # warm-up, and the outputs compared
            for _ in range(args.repeats):
                for p in rows:
                    rows[p].append(run(q, k, v, idx, num, p)[0])
            med = {p: statistics.median(t) for p, t in rows.items()}
            err = errors(outs["int8"], outs["auto"])
            rec = {"seq": s, "heads": args.heads, "head_dim": 128, "dtype": "float32", "sparsity": sparsity,
                   "fp32_s": med["auto"], "int8_s": med["int8"], "speedup": med["auto"] / med["int8"],
                   "fp32_runs": rows["auto"], "int8_runs": rows["int8"], **err}
            records.append(rec)
            table.append([f"{s:,}", args.heads, sparsity, f"{med['auto']:.2f}", f"{med['int8']:.2f}",
                          f"**{rec['speedup']:.2f}x**", f"{err['cosine']:.6f}", f"{err['rel_l1']:.2e}",
                          f"{err['rel_l2']:.2e}"])
            print(table[-1], flush=True)
    load_after = os.getloadavg()[0]
    env = {"cpu": cpu_model(), "threads": args.threads, "torch": torch.__version__, "repeats": args.repeats,
           "load_before": load_before, "load_after": load_after, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    text = (f"CPU: {env['cpu']}, {env['threads']} threads, torch {env['torch']}, {env['date']}, load average "
            f"{load_before:.2f} before / {load_after:.2f} after (shared machine), medians of {args.repeats} "
            "interleaved rounds after a warm-up.\n\n"
            + markdown_table(["S", "heads", "sparsity", "fp32 kernel s", "int8 kernel s", "int8 speed-up",
                              "cosine vs fp32", "rel. L1 vs fp32", "rel. L2 vs fp32"], table))
    write("int8_attention" + ("_quick" if args.quick else ""), text, {"env": env, "rows": records})
    return 0


if __name__ == "__main__":
    sys.exit(main())
