"""Step caching on the tiny random-weight Wan: denoising speed-up and PSNR vs the uncached run.

    flock /tmp/lite_boost_cpu.lock .venv/bin/python benchmarks/bench_cache.py [--threads 2] [--repeats 3]

For each diffusers cache method (through ``lite_boost.boost(pipe, {"cache": ...})``) at 2-3 settings:
the boosted uncached pipeline and the boosted cached pipeline run interleaved in the same process
(``--repeats`` times each, latent output, so the VAE is not timed); the table gives the median
denoising time of each, their ratio, the share of transformer calls whose blocks were reused, and
the PSNR of the cached output latents against the uncached ones (peak = the uncached latents'
max - min). Then the same with block-sparse attention (sparsity 0.8, baseline = sparse uncached),
and under 2 processes (Ulysses over 2 ranks, baseline = the same 2 ranks uncached).

Random weights do not show how a trained model's activations evolve from step to step: the skip
rates and PSNR here show that the mechanism works and what it costs, not the quality/speed
trade-off on a real checkpoint (thresholds have to be re-tuned there).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import statistics
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

SPEC = dict(heads=4, head_dim=32, layers=6, ffn_dim=256)
SHAPE = (128, 224, 17)  # 5 x 8 x 14 = 560 tokens
STEPS = 10

SETTINGS = [
    "first_block_cache:threshold=0.1",
    "first_block_cache:threshold=0.2",
    "mag_cache:threshold=0.03,{mag}",
    "mag_cache:threshold=0.1,{mag}",
    "taylorseer_cache:cache_interval=2,disable_cache_before_step=2,taylor_factors_dtype=float32",
    "taylorseer_cache:cache_interval=4,disable_cache_before_step=2,taylor_factors_dtype=float32",
    "pyramid_attention_broadcast:spatial_attention_block_skip_range=2",
    "pyramid_attention_broadcast:spatial_attention_block_skip_range=3,cross_attention_block_skip_range=3",
    "sea_cache:threshold=0.2",
    "sea_cache:threshold=0.4",
]
SPARSE_SETTINGS = ["first_block_cache:threshold=0.15",
                   "taylorseer_cache:cache_interval=2,disable_cache_before_step=2,taylor_factors_dtype=float32"]
PARALLEL_SETTINGS = ["first_block_cache:threshold=0.15",
                     "taylorseer_cache:cache_interval=2,disable_cache_before_step=2,taylor_factors_dtype=float32"]
SPARSE = {"sparse_type": "rf_v2", "sparsity": 0.8, "block_size": 128}


def _pipe():
    from lite_boost.demo import TinyWanSpec, tiny_wan_pipeline

    return tiny_wan_pipeline("t2v", spec=TinyWanSpec(**SPEC))


def _kwargs():
    h, w, f = SHAPE
    return dict(prompt="a red fox runs through fresh snow", negative_prompt="blurry", height=h, width=w,
                num_frames=f, num_inference_steps=STEPS, guidance_scale=5.0, output_type="latent",
                generator=torch.Generator().manual_seed(0))


def psnr(x: torch.Tensor, ref: torch.Tensor) -> float:
    mse = float(((x.double() - ref.double()) ** 2).mean())
    peak = float(ref.max() - ref.min())
    return math.inf if mse == 0 else 10 * math.log10(peak * peak / mse)


def _timed(pipe, counter=None):
    with torch.inference_mode(), (counter or contextlib.nullcontext()):
        t0 = time.perf_counter()
        out = pipe(**_kwargs()).frames
        return time.perf_counter() - t0, out


def calibrate_mag_ratios() -> str:
    """One uncached calibration run of diffusers' MagCache on the benchmark model (ratios it prints)."""
    import lite_boost

    pipe = lite_boost.boost(_pipe(), {"cache": f"mag_cache:calibrate=true,num_inference_steps={STEPS}"})
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        _timed(pipe)
    text = buf.getvalue()
    import re

    ratios = json.loads(re.search(r"\[[0-9][0-9., e+-]*\]", text).group(0))  # the first (cond) branch's list
    return "num_inference_steps={},mag_ratios={}".format(STEPS, "/".join(f"{r:.5f}" for r in ratios))


def compare(spec: str, repeats: int, sparse=None, pipes=None):
    """Median denoise time uncached vs cached (interleaved), skip share, PSNR. Returns a dict."""
    import lite_boost
    from lite_boost.cache import count_block_work

    base_cfg = {"sparse": sparse} if sparse else {}
    base = pipes[0] if pipes else lite_boost.boost(_pipe(), base_cfg)
    cached = pipes[1] if pipes else lite_boost.boost(_pipe(), dict(base_cfg, cache=spec))
    _timed(base), _timed(cached)  # warm-up (one-time costs)
    tb, tc = [], []
    for _ in range(repeats):
        t, ref = _timed(base)
        tb.append(t)
        work = count_block_work([cached.transformer])
        t, out = _timed(cached, work)
        tc.append(t)
    mb, mc = statistics.median(tb), statistics.median(tc)
    return {"setting": spec, "uncached_s": mb, "cached_s": mc, "speedup": mb / mc,
            "reused_calls": f"{work.calls - work.ffn_runs}/{work.calls}", "psnr_db": psnr(out, ref)}


# ------------------------------------------------------------------------------------ 2 processes
def _rank(rank, world, init_method, specs, repeats, threads, out_path):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(threads)
    import lite_boost  # noqa: F401
    from lite_boost.parallel import ParallelManager, initialize_usp

    mesh = initialize_usp({"parallel": {"timeout_s": 600}}, init_method=init_method)
    rows = []
    base = ParallelManager(_pipe(), {"parallel": {"timeout_s": 600}}, mesh=mesh)
    for spec in specs:
        cached = ParallelManager(_pipe(), {"parallel": {"timeout_s": 600}, "cache": spec}, mesh=mesh)
        rows.append(compare(spec, repeats, pipes=(base, cached)))
    if rank == 0:
        with open(out_path, "w") as fh:
            json.dump(rows, fh)
    mesh.destroy()


def run_two_processes(specs, repeats, threads):
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "rows.json")
        mp.start_processes(_rank, args=(2, "file://" + os.path.join(tmp, "rdzv"), specs, repeats, threads, out_path),
                           nprocs=2, start_method="spawn")
        with open(out_path) as fh:
            return json.load(fh)


# ------------------------------------------------------------------------------------ report
def table(rows, baseline: str) -> str:
    lines = [f"| setting | {baseline} (s) | cached (s) | speed-up | calls with blocks reused | PSNR vs uncached (dB) |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        p = "inf" if math.isinf(r["psnr_db"]) else f"{r['psnr_db']:.1f}"
        s = r["setting"]
        if "mag_ratios=" in s:
            s = s.split(",num_inference_steps")[0] + " (calibrated mag_ratios)"
        lines.append(f"| `{s}` | {r['uncached_s']:.2f} | {r['cached_s']:.2f} | {r['speedup']:.2f}x | "
                     f"{r['reused_calls']} | {p} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="one setting per method, no sparse / 2-process tables")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "cache.md"))
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(args.threads)

    mag = calibrate_mag_ratios()
    settings = [s.format(mag=mag) for s in SETTINGS]
    if args.quick:
        settings = settings[::2]
    rows = [compare(s, args.repeats) for s in settings]
    h, w, f = SHAPE
    head = (f"tiny random-weight Wan T2V ({SPEC['layers']} blocks, {SPEC['heads']} heads x {SPEC['head_dim']}, "
            f"ffn {SPEC['ffn_dim']}), {h}x{w}, {f} frames = {(f // 4 + 1) * (h // 16) * (w // 16)} tokens, "
            f"{STEPS} steps, CFG 5, float32, CPU, {args.threads} threads, median of {args.repeats} interleaved runs; "
            "denoising only (latent output)")
    md = ["# Step caching (lite_boost.boost + diffusers cache hooks)", "", head, "",
          "Random weights do not show how a trained model's steps evolve: skip rates and PSNR here show the "
          "mechanism and its cost, not the quality / speed trade-off of a real checkpoint.", "",
          "## One process, dense attention (baseline: boosted, uncached)", "", table(rows, "uncached")]
    if not args.quick:
        srows = [compare(s, args.repeats, sparse=SPARSE) for s in SPARSE_SETTINGS]
        md += ["", "## With block-sparse attention, sparsity 0.8 (baseline: boosted sparse, uncached)", "",
               table(srows, "sparse uncached")]
        prows = run_two_processes(PARALLEL_SETTINGS, args.repeats, max(1, args.threads // 2))
        md += ["", f"## 2 processes, Ulysses sequence degree 2, {max(1, args.threads // 2)} thread(s) each "
               "(baseline: the same 2 ranks, uncached)", "", table(prows, "uncached")]
    text = "\n".join(md) + "\n"
    print(text)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as fh:
        fh.write(text)


if __name__ == "__main__":
    main()
