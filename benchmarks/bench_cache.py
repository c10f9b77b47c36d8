"""Step caching on the tiny random-weight Wan: denoising speed-up and PSNR vs the uncached run.

Run in parts, each under the shared lock and each a few minutes on 2 cores; every finished row is
appended (and flushed) to ``--rows`` at once, so a killed run keeps what it measured; ``--assemble``
writes the markdown table from the rows (the latest row of each part and setting wins):

    flock /tmp/lite_boost_cpu.lock .venv/bin/python benchmarks/bench_cache.py --part calibrate
    flock /tmp/lite_boost_cpu.lock .venv/bin/python benchmarks/bench_cache.py --part single --methods first_block_cache,mag_cache
    flock /tmp/lite_boost_cpu.lock .venv/bin/python benchmarks/bench_cache.py --part single --methods taylorseer_cache,pyramid_attention_broadcast,sea_cache
    flock /tmp/lite_boost_cpu.lock .venv/bin/python benchmarks/bench_cache.py --part sparse
    flock /tmp/lite_boost_cpu.lock .venv/bin/python benchmarks/bench_cache.py --part parallel
    .venv/bin/python benchmarks/bench_cache.py --assemble

``calibrate`` runs the model once uncached per data-driven method and stores what the settings are
chosen from (``--calibration``): MagCache's magnitude ratios (diffusers' calibration run) and the
range of First-Block Cache's statistic (relative L1 change of the first block's residual between
consecutive calls of a branch), whose quantiles become the thresholds, so that every First-Block
Cache row really skips work.

For each setting the boosted uncached pipeline and the boosted cached pipeline run interleaved in
one process (``--repeats`` times each after a warm-up, latent output, so the VAE is not timed): the
table gives their median denoising times, the ratio, how many transformer calls reused cached
blocks, how many self-attentions were computed, and the PSNR of the cached latents against the
uncached ones (peak = the uncached latents' max - min). ``sparse`` repeats one or two settings per
method with block-sparse attention (sparsity 0.8; baseline = sparse uncached); ``parallel`` runs
them on 2 processes (gloo, Ulysses sequence degree 2; baseline = the same 2 ranks uncached).

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
import re
import statistics
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

# Narrow and attention-heavy, like the main job: Wan's head_dim 128 and patch, 4 blocks so that a
# first-block cache has blocks to skip; the transformer is all that is timed (latent output).
SPEC = dict(heads=2, head_dim=128, layers=4, ffn_dim=256)
SHAPE = (192, 256, 17)  # 5 x 12 x 16 = 960 tokens
STEPS = 10
SPARSE = {"sparse_type": "rf_v2", "sparsity": 0.8, "block_size": 128}
TAYLOR = "taylor_factors_dtype=float32"
METHODS = ("first_block_cache", "mag_cache", "taylorseer_cache", "pyramid_attention_broadcast", "sea_cache")

# {fbc_lo} / {fbc_mid} / {fbc_hi}: First-Block-Cache thresholds from the calibrated statistic's quantiles;
# {mag}: the calibrated magnitude ratios. Settings marked sparse / parallel also run in those parts.
SETTINGS = [  # per method, the one also run in the sparse / parallel parts first (see --per-method)
    ("first_block_cache:threshold={fbc_mid}", ("sparse", "parallel")),
    ("first_block_cache:threshold={fbc_hi}", ()),
    ("first_block_cache:threshold={fbc_lo}", ()),
    ("mag_cache:threshold=0.03,{mag}", ("sparse", "parallel")),
    ("mag_cache:threshold=0.01,{mag}", ()),
    ("mag_cache:threshold=0.1,{mag}", ()),
    ("taylorseer_cache:cache_interval=2,disable_cache_before_step=2," + TAYLOR, ("sparse", "parallel")),
    ("taylorseer_cache:cache_interval=4,disable_cache_before_step=2," + TAYLOR, ()),
    ("pyramid_attention_broadcast:spatial_attention_block_skip_range=2", ("sparse", "parallel")),
    ("pyramid_attention_broadcast:spatial_attention_block_skip_range=3,cross_attention_block_skip_range=3", ()),
    ("sea_cache:threshold=0.2", ("sparse", "parallel")),
    ("sea_cache:threshold=0.4", ()),
]
FBC_QUANTILES = {"fbc_lo": 0.25, "fbc_mid": 0.5, "fbc_hi": 0.75}


def _pipe():
    from lite_boost.demo import TinyWanSpec, tiny_wan_pipeline

    return tiny_wan_pipeline("t2v", spec=TinyWanSpec(**SPEC))


def _tokens() -> int:
    h, w, f = SHAPE
    return ((f - 1) // 4 + 1) * (h // 16) * (w // 16)


def _kwargs():
    h, w, f = SHAPE
    return dict(prompt="a red fox runs through fresh snow", negative_prompt="blurry", height=h, width=w,
                num_frames=f, num_inference_steps=STEPS, guidance_scale=5.0, output_type="latent",
                generator=torch.Generator().manual_seed(0))


def psnr(x: torch.Tensor, ref: torch.Tensor) -> float:
    mse = float(((x.double() - ref.double()) ** 2).mean())
    peak = float(ref.max() - ref.min())
    return math.inf if mse == 0 else 10 * math.log10(peak * peak / mse)


def _load() -> str:
    return "load {:.2f} {:.2f} {:.2f}".format(*os.getloadavg())


def _timed(pipe, counter=None):
    with torch.inference_mode(), (counter or contextlib.nullcontext()):
        t0 = time.perf_counter()
        out = pipe(**_kwargs()).frames
        return time.perf_counter() - t0, out


# ------------------------------------------------------------------------------------ calibration
def calibrate() -> dict:
    """MagCache ratios (diffusers' calibration run) and First-Block Cache's statistic range."""
    import lite_boost

    pipe = lite_boost.boost(_pipe(), {"cache": f"mag_cache:calibrate=true,num_inference_steps={STEPS}"})
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        _timed(pipe)
    ratios = json.loads(re.search(r"\[[0-9][0-9., e+-]*\]", buf.getvalue()).group(0))  # first (cond) branch
    # First-Block Cache with a threshold below any change: computes every call and logs the statistic
    pipe = lite_boost.boost(_pipe(), {"cache": "first_block_cache:threshold=1e-9"})
    _timed(pipe)
    stats = sorted(d.statistic for d in pipe.transformer._lite_boost.extras["cache"].decisions
                   if d.statistic is not None)
    q = {k: float(torch.quantile(torch.tensor(stats, dtype=torch.float64), v)) for k, v in FBC_QUANTILES.items()}
    return {"mag": "num_inference_steps={},mag_ratios={}".format(STEPS, "/".join(f"{r:.5f}" for r in ratios)),
            "fbc_stat_min": stats[0], "fbc_stat_max": stats[-1], "fbc_stat_n": len(stats),
            **{k: float(f"{v:.3g}") for k, v in q.items()}}


def settings_for(part: str, cal: dict, methods, per_method: int | None = None, skip: int = 0) -> list[str]:
    """The part's settings of ``methods``: per method, settings skip .. skip + per_method - 1 (all if None)."""
    out, seen = [], {}
    for template, parts in SETTINGS:
        method = template.split(":")[0]
        if method not in methods or (part != "single" and part not in parts):
            continue
        i = seen[method] = seen.get(method, -1) + 1
        if i < skip or (per_method is not None and i >= skip + per_method):
            continue
        out.append(template.format(mag=cal["mag"], **{k: cal[k] for k in FBC_QUANTILES}))
    return out


# ------------------------------------------------------------------------------------ measurement
def compare(spec: str, repeats: int, sparse=None, pipes=None):
    """Median denoise time uncached vs cached (interleaved), reuse counts, PSNR. Returns a dict.

    ``pipes``: (uncached, cached) pipelines, the uncached one already warmed up (it is shared by the
    settings of a part; the same weights as the cached one).
    """
    import lite_boost
    from lite_boost.cache import count_block_work

    load = _load()
    base_cfg = {"sparse": sparse} if sparse else {}
    base = pipes[0] if pipes else lite_boost.boost(_pipe(), base_cfg)
    cached = pipes[1] if pipes else lite_boost.boost(_pipe(), dict(base_cfg, cache=spec))
    if not pipes:
        _timed(base)
    _timed(cached)  # warm-up (one-time costs)
    tb, tc = [], []
    for _ in range(repeats):
        t, ref = _timed(base)
        tb.append(t)
        work = count_block_work([cached.transformer])
        t, out = _timed(cached, work)
        tc.append(t)
    mb, mc = statistics.median(tb), statistics.median(tc)
    return {"setting": spec, "uncached_s": mb, "cached_s": mc, "speedup": mb / mc,
            "reused_calls": f"{work.calls - work.ffn_runs}/{work.calls}",
            "attn_computed": f"{work.attn_runs}/{work.calls * work.attn_total_per_call}",
            "psnr_db": psnr(out, ref), "repeats": repeats, "load_before": load, "load_after": _load(),
            "threads": torch.get_num_threads()}


def _append(path: str, row: dict) -> None:
    with open(path, "a") as fh:
        fh.write(json.dumps(row) + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    print(json.dumps(row), flush=True)


# ------------------------------------------------------------------------------------ 2 processes
def _rank(rank, world, init_method, specs, repeats, threads, rows_path, extra, shape_steps):
    global SHAPE, STEPS
    SHAPE, STEPS = shape_steps  # the parent's (a spawned child re-imports this module)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(threads)
    import lite_boost  # noqa: F401
    from lite_boost.parallel import ParallelManager, initialize_usp

    cfg = {"parallel": {"timeout_s": 600}}
    mesh = initialize_usp(cfg, init_method=init_method)
    base = ParallelManager(_pipe(), cfg, mesh=mesh)
    _timed(base)  # warm-up
    for spec in specs:
        cached = ParallelManager(_pipe(), dict(cfg, cache=spec), mesh=mesh)
        row = compare(spec, repeats, pipes=(base, cached))
        if rank == 0:
            _append(rows_path, {**extra, **row, "processes": world, "threads": threads})
    mesh.destroy()


def run_two_processes(specs, repeats, threads, rows_path, extra):
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_rank, args=(2, "file://" + os.path.join(tmp, "rdzv"), specs, repeats, threads,
                                        rows_path, extra, (SHAPE, STEPS)), nprocs=2, start_method="spawn")


# ------------------------------------------------------------------------------------ report
PART_TITLES = {
    "single": ("One process, dense attention (baseline: boosted, uncached)", "uncached"),
    "sparse": ("With block-sparse attention, sparsity 0.8 (baseline: boosted sparse, uncached)", "sparse uncached"),
    "parallel": ("2 processes, Ulysses sequence degree 2 over gloo, 1 thread each (baseline: the same 2 ranks, "
                 "uncached)", "2 ranks uncached"),
}


def table(rows, baseline: str) -> str:
    lines = [f"| setting | {baseline} (s) | cached (s) | speed-up | calls with blocks reused | self-attention "
             "computed | PSNR vs uncached (dB) | load before / after |",
             "|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        p = "inf" if math.isinf(r["psnr_db"]) else f"{r['psnr_db']:.1f}"
        s = r["setting"]
        if "mag_ratios=" in s:
            s = s.split(",num_inference_steps")[0] + " (calibrated mag_ratios)"
        s = s.replace("," + TAYLOR, " (fp32 factors)")
        load = f"{r['load_before'].split()[1]} / {r['load_after'].split()[1]}"
        lines.append(f"| `{s}` | {r['uncached_s']:.2f} | {r['cached_s']:.2f} | {r['speedup']:.2f}x | "
                     f"{r['reused_calls']} | {r['attn_computed']} | {p} | {load} |")
    return "\n".join(lines)


def assemble(rows_path: str, cal: dict, out: str) -> str:
    latest: dict = {}
    with open(rows_path) as fh:
        for line in fh:
            if line.strip():
                r = json.loads(line)
                latest[(r["part"], r["setting"])] = r  # a later run of the same setting replaces it
    order = {t.split(":")[0]: i for i, (t, _) in enumerate(SETTINGS)}
    h, w, f = SHAPE
    md = ["# Step caching (lite_boost.boost + diffusers cache hooks)", "",
          f"Tiny random-weight Wan T2V: transformer {SPEC['layers']} blocks x {SPEC['heads']} heads x "
          f"{SPEC['head_dim']} (ffn {SPEC['ffn_dim']}, patch 1x2x2), {h} x {w}, {f} frames = {_tokens():,} tokens, "
          f"{STEPS} steps with CFG 5, float32, CPU; denoising only (latent output, the VAE is not timed); "
          "baseline and cached pipelines in the same process, interleaved, medians of the stated repeats after a "
          "warm-up; load averages (1 min) as read before and after each row; each part ran under the shared "
          "benchmark lock on a 2-core machine that other engineers' jobs also used.", "",
          "**Random weights do not show how a trained model's steps evolve**: the reuse counts and PSNR show the "
          "mechanism and its cost, not the quality / speed trade-off of a real checkpoint, where thresholds must "
          "be re-tuned.", "",
          f"Calibration on this model (`--part calibrate`): First-Block Cache's statistic (relative L1 change of "
          f"the first block's residual between consecutive calls of a branch) ranged {cal['fbc_stat_min']:.3f} - "
          f"{cal['fbc_stat_max']:.3f} over {cal['fbc_stat_n']} calls; its thresholds are the 25 / 50 / 75% "
          f"quantiles ({cal['fbc_lo']} / {cal['fbc_mid']} / {cal['fbc_hi']}). MagCache's `mag_ratios` come from "
          "diffusers' calibration run on this model."]
    for part, (title, base) in PART_TITLES.items():
        rows = sorted((r for (p, _), r in latest.items() if p == part),
                      key=lambda r: (order.get(r["setting"].split(":")[0], 99), r["setting"]))
        if not rows:
            continue
        threads = rows[0]["threads"]
        md += ["", f"## {title}", "", f"{threads} thread(s){' per process' if part == 'parallel' else ''}, "
               f"medians of {rows[0]['repeats']}.", "", table(rows, base)]
    text = "\n".join(md) + "\n"
    with open(out, "w") as fh:
        fh.write(text)
    return text


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", choices=["calibrate", "single", "sparse", "parallel"], default=None)
    ap.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated subset of {', '.join(METHODS)}")
    ap.add_argument("--per-method", type=int, default=None, help="at most this many settings per method")
    ap.add_argument("--skip", type=int, default=0, help="skip each method's first settings (with --per-method)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rows", default=os.path.join(HERE, "results", "cache_rows.jsonl"))
    ap.add_argument("--calibration", default=os.path.join(HERE, "results", "cache_calibration.json"))
    ap.add_argument("--assemble", action="store_true", help="write --out from the rows measured so far")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "cache.md"))
    args = ap.parse_args()
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    bad = [m for m in methods if m not in METHODS]
    if bad:
        ap.error(f"--methods: unknown {bad}; choose from {list(METHODS)}")
    if args.part is None and not args.assemble:
        ap.error("give --part and/or --assemble")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(args.threads)
    os.makedirs(os.path.dirname(args.rows), exist_ok=True)

    if args.part == "calibrate":
        cal = {**calibrate(), "load": _load()}
        with open(args.calibration, "w") as fh:
            json.dump(cal, fh, indent=1)
        print(json.dumps(cal, indent=1))
    elif args.part is not None:
        with open(args.calibration) as fh:
            cal = json.load(fh)
        specs = settings_for(args.part, cal, methods, args.per_method, args.skip)
        extra = {"part": args.part, "tokens": _tokens(), "steps": STEPS, "spec": SPEC,
                 "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
        if args.part == "parallel":
            run_two_processes(specs, args.repeats, max(1, args.threads // 2), args.rows, extra)
        else:
            import lite_boost

            base_cfg = {"sparse": SPARSE} if args.part == "sparse" else {}
            base = lite_boost.boost(_pipe(), base_cfg)
            _timed(base)  # warm-up, once for the part
            for spec in specs:
                cached = lite_boost.boost(_pipe(), dict(base_cfg, cache=spec))
                _append(args.rows, {**extra, **compare(spec, args.repeats, pipes=(base, cached))})
                del cached
    if args.assemble:
        with open(args.calibration) as fh:
            cal = json.load(fh)
        print(assemble(args.rows, cal, args.out))


if __name__ == "__main__":
    main()
