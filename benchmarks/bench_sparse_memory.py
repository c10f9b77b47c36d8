"""Peak memory of sparse_attention vs dense SDPA (CPU), each measured in a fresh process.

    python benchmarks/bench_sparse_memory.py           # S = 16384, 12 heads, D = 128, fp32 and bf16
    python benchmarks/bench_sparse_memory.py --quick   # S = 8192, 4 heads, fp32

sparse_attention runs at sparsity 0.8 with keep_sink=False (default selector) on each block-sparse
backend ("cpp", "flex", "gather"); sparsity 0 = ``rain_fusion_attention`` with every block selected
on the C++ kernel (sparse_attention itself would run SDPA there).

Method: the child process sets MALLOC_MMAP_THRESHOLD_ so every large tensor is an mmap that is
returned to the OS when freed (RSS then follows live tensors), records its RSS before creating the
inputs, warms the operator up (compilation, caches), resets the kernel's peak-RSS counter
(``/proc/self/clear_refs``), runs the operator once and reads VmHWM. "peak" = q + k + v plus VmHWM
minus the RSS just before the measured call (so modules and compiled code loaded by the warm-up do
not count): inputs + output + working memory. Writes benchmarks/results/sparse_memory.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from bench_sparse_common import markdown_table, write

CHILD = r"""
import json, sys, torch, torch.nn.functional as F
torch.set_num_threads(2)
def status(key):
    for line in open('/proc/self/status'):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
method, s, heads, dtype, grid = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), getattr(torch, sys.argv[4]), tuple(json.loads(sys.argv[5]))
sparsity = float(sys.argv[6])
base = status('VmRSS')
q, k, v = (torch.randn(1, heads, s, 128).to(dtype) for _ in range(3))
if method == 'sdpa':
    run = lambda: F.scaled_dot_product_attention(q, k, v)
else:
    from lite_boost.ops.sparse import sparse_attention
    if sparsity == 0.0:  # every block selected: sparse_attention would run SDPA, so call the kernel itself
        from lite_boost.ops.rain_fusion import rain_fusion_attention
        nb = -(-s // 128)
        idx = torch.arange(nb).expand(nb, heads, nb).contiguous(); num = torch.full((nb, heads), nb)
        run = lambda: rain_fusion_attention(q, k, v, idx, num, [128, 128], q_input_layout='BNSD',
                                            kv_input_layout='BNSD', backend=method)[0]
    else:
        run = lambda: sparse_attention(q, k, v, head_num=heads, sparse_type='rf_v2', block_size=128,
                                       latent_shape_q=grid, sparsity=sparsity, window=(2, 8, 8), keep_sink=False,
                                       backend=method)
out = run(); del out
open('/proc/self/clear_refs', 'w').write('5')
before = status('VmRSS')
out = run()
peak = status('VmHWM')
print(json.dumps(dict(base=base, before=before, peak=peak, inputs=3 * q.numel() * q.element_size(),
                      output=out.numel() * out.element_size())))
"""


def measure(method, s, heads, dtype, grid, sparsity=0.8):
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="2")
    res = subprocess.run([sys.executable, "-c", CHILD, method, str(s), str(heads), dtype, json.dumps(grid), str(sparsity)],
                         capture_output=True, text=True, env=env, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--backends", default="cpp,flex,gather", help="comma list of block-sparse backends at s=0.8")
    args = ap.parse_args()
    if args.quick:
        cases = [(8192, 4, "float32", (8, 32, 32))]
    else:
        cases = [(16384, 12, "float32", (16, 32, 32)), (16384, 12, "bfloat16", (16, 32, 32))]
    rows, data = [], []
    mib = 1 << 20
    methods = [("cpp", 0.0)] + [(b, 0.8) for b in args.backends.split(",")]
    for s, heads, dtype, grid in cases:
        dense = measure("sdpa", s, heads, dtype, grid)
        # warm-up leaves imported modules and compiled code resident: count only what the timed call adds
        dp = dense["inputs"] + dense["peak"] - dense["before"]
        for method, sparsity in methods:
            sparse = measure(method, s, heads, dtype, grid, sparsity)
            sp = sparse["inputs"] + sparse["peak"] - sparse["before"]
            data.append(dict(S=s, heads=heads, dtype=dtype, backend=method, sparsity=sparsity, dense=dense,
                             sparse=sparse, ratio=sp / dp))
            rows.append([s, heads, dtype, method, sparsity, f"{dense['inputs'] / mib:.0f}", f"{dp / mib:.0f}",
                         f"{sp / mib:.0f}", f"{sp / dp:.2f}x"])
            print(rows[-1], flush=True)
    headers = ["S", "heads", "dtype", "backend", "sparsity", "q+k+v MiB", "dense SDPA peak MiB",
               "sparse_attention peak MiB", "ratio"]
    text = ("### Peak memory: sparse_attention vs dense SDPA (CPU)\n\nPeak = inputs + output + working memory "
            "(q+k+v plus VmHWM above the RSS just before the measured call), one fresh process per measurement, D=128, "
            "window (2, 8, 8), block 128, keep_sink=False, 2 threads.\n\n" + markdown_table(headers, rows))
    write("sparse_memory_quick" if args.quick else "sparse_memory", text, data)


if __name__ == "__main__":
    main()
