"""torch.compile with lite_boost: per-step denoising time, compile time and recompiles of a Wan pipeline.

Variants (each its own pipeline built from the same seed, so the weights are identical):

* ``stock eager``            diffusers as shipped;
* ``boosted eager``          ``lite_boost.boost(pipe)``;
* ``stock compiled``         diffusers' recipe: ``transformer.compile_repeated_blocks(fullgraph=True)``
                             (``--mode full``: ``torch.compile(transformer, fullgraph=True)``);
* ``boosted compiled``       boost, then the same compile;
* ``boosted sparse eager`` / ``boosted sparse compiled``  with ``SparseConfig(sparsity=0.8)``.

Per-step time is the median over the timed runs of the denoising steps 1..N-1 (step 0 also encodes the
prompt), measured with ``callback_on_step_end``; every step is two transformer calls (CFG). The runs are
interleaved round-robin across the variants so machine noise hits them alike. The first (warm-up) run
of each variant gives the compile overhead (its first step minus the median step) and the number of
graphs inductor compiled over that whole N-step run (recompiles = graphs - 1). Output latents of the
compiled variants are compared with their eager twin.

    flock /tmp/lite_boost_cpu.lock python benchmarks/bench_compile.py            # 3,840 tokens
    flock /tmp/lite_boost_cpu.lock python benchmarks/bench_compile.py --quick
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

import lite_boost
from lite_boost.config import BoostConfig, SparseConfig
from lite_boost.demo import DEMO_NEGATIVE_PROMPT, DEMO_PROMPT, TinyWanSpec, tiny_wan_pipeline


class CountingInductor:
    """``torch.compile`` backend = inductor, counting the graphs it is asked to compile."""

    def __init__(self):
        self.graphs = 0

    def __call__(self, gm, example_inputs):
        from torch._inductor.compile_fx import compile_fx

        self.graphs += 1
        return compile_fx(gm, example_inputs)


def build(name, spec, mode, sparsity):
    pipe = tiny_wan_pipeline("t2v", spec=spec, seed=0)
    counter = None
    if "boosted" in name:
        sparse = SparseConfig(sparsity=sparsity) if "sparse" in name else None
        lite_boost.boost(pipe, BoostConfig(sparse=sparse))
    if "compiled" in name:
        counter = CountingInductor()
        if mode == "regional":
            pipe.transformer.compile_repeated_blocks(fullgraph=True, backend=counter)
        else:
            pipe.transformer = torch.compile(pipe.transformer, fullgraph=True, backend=counter)
    return pipe, counter


def run(pipe, args):
    marks = []

    def on_step_end(p, i, t, kw):
        marks.append(time.perf_counter())
        return kw

    g = torch.Generator().manual_seed(0)
    start = time.perf_counter()
    with torch.no_grad():
        out = pipe(prompt=DEMO_PROMPT, negative_prompt=DEMO_NEGATIVE_PROMPT, height=args.height, width=args.width,
                   num_frames=args.frames, num_inference_steps=args.steps, guidance_scale=5.0, generator=g,
                   output_type="latent", callback_on_step_end=on_step_end).frames
    steps = [b - a for a, b in zip([start] + marks[:-1], marks)]
    return steps, out


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--height", type=int, default=320)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--frames", type=int, default=21)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per variant (after one warm-up run)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--sparsity", type=float, default=0.8)
    ap.add_argument("--mode", choices=("regional", "full"), default="regional")
    ap.add_argument("--variants", default="stock eager,boosted eager,stock compiled,boosted compiled,"
                                          "boosted sparse eager,boosted sparse compiled")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=None, help="markdown table path (default benchmarks/results/compile_<mode>.md)")
    args = ap.parse_args(argv)
    if args.quick:
        args.height, args.width, args.frames, args.repeats = 160, 256, 9, 2
    warnings.simplefilter("ignore")
    torch.set_num_threads(args.threads)
    spec = TinyWanSpec(heads=args.heads, head_dim=args.head_dim, layers=args.layers, ffn_dim=4 * args.heads * args.head_dim)
    tokens = ((args.frames - 1) // 4 + 1) * (args.height // 16) * (args.width // 16)
    names = [n.strip() for n in args.variants.split(",") if n.strip()]

    pipes, warm = {}, {}
    for name in names:  # warm-up run: compiles (and JIT kernels) happen here
        pipe, counter = build(name, spec, args.mode, args.sparsity)
        steps, out = run(pipe, args)
        pipes[name] = pipe
        warm[name] = {"first_step": steps[0], "graphs": counter.graphs if counter else None, "out": out}
        print(f"warm-up {name:26s} first step {steps[0]:7.2f} s  graphs {warm[name]['graphs']}", flush=True)
    timed = {n: [] for n in names}
    for r in range(args.repeats):
        for name in names:
            steps, _ = run(pipes[name], args)
            timed[name] += steps[1:]
        print(f"round {r + 1}/{args.repeats} done", flush=True)

    base = statistics.median(timed[names[0]])
    rows, record = [], []
    for name in names:
        med = statistics.median(timed[name])
        first = warm[name]["first_step"]
        twin = name.replace("compiled", "eager")
        diff = None
        if "compiled" in name and twin in warm:
            diff = (warm[name]["out"] - warm[twin]["out"]).abs().max().item()
        graphs = warm[name]["graphs"]
        rows.append(f"| {name} | {med:.3f} | {base / med:.2f}x | "
                    + (f"{first - med:.1f}" if graphs is not None else "-") + " | "
                    + (f"{graphs - 1}" if graphs is not None else "-") + " | "
                    + (f"{diff:.1e}" if diff is not None else "-") + " |")
        record.append({"variant": name, "step_s_median": med, "speedup_vs_first": base / med,
                       "first_step_s": first, "graphs": graphs, "max_abs_diff_vs_eager": diff,
                       "step_samples": timed[name]})
    header = (f"Wan transformer {args.layers} layers, {args.heads} heads x {args.head_dim}, {tokens} tokens "
              f"({args.frames}x{args.height}x{args.width}), fp32, CPU, {args.threads} threads, {args.steps} steps, "
              f"CFG; compile = {'compile_repeated_blocks(fullgraph=True)' if args.mode == 'regional' else 'torch.compile(transformer, fullgraph=True)'}, "
              f"inductor; torch {torch.__version__}; medians of {args.repeats} interleaved runs x {args.steps - 1} steps")
    table = "\n".join([header, "",
                       f"| variant | step (s) | vs {names[0]} | compile overhead (s) | recompiles in {args.steps}-step run | max abs diff vs eager |",
                       "|---|---|---|---|---|---|", *rows])
    print(table)
    out = Path(args.out) if args.out else Path(__file__).parent / "results" / f"compile_{args.mode}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(table + "\n")
    out.with_suffix(".json").write_text(json.dumps({"args": vars(args), "tokens": tokens, "rows": record}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
