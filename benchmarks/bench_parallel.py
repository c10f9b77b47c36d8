"""Sequence / CFG parallelism benchmark: traffic by counting, step time vs one process, diffusers side by side.

    python benchmarks/bench_parallel.py            # full run (several minutes on 2 CPU cores)
    python benchmarks/bench_parallel.py --quick    # smaller shapes, one round

Tables (markdown, printed and written to benchmarks/results/parallel_*.md):

1. traffic: bytes each rank sends and collectives per transformer layer, counted by the
   Communicator during a real forward, vs the Ulysses lower bound 4 (P-1)/P^2 * B S H D * bytes
   (q, k, v out and the attention output back; the local 1/P never leaves the rank);
2. Ulysses step time: one transformer forward, 2 processes x 1 thread vs 1 process x 1 thread (gloo
   on CPU), ours and diffusers' own Ulysses (``enable_parallelism``) side by side, on a small-but-wide
   Wan transformer (2 layers, 6 heads x 128) and on shapes diffusers cannot run (uneven heads/tokens).
   Every parallel output is also compared with the single-process output (max abs diff);
3. CFG parallel: a pipeline call with CFG, cfg 2 on 2 processes vs 1 process;
4. the expected scaling for 1/2/4/8 devices (a model from FLOPs and bytes, parameters stated).

Runs are interleaved (every configuration once per round) and medians reported, because the CPU
is shared with other work; ratios are computed within the same round.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import pickle
import statistics
import sys
import tempfile
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
RESULTS = os.path.join(ROOT, "benchmarks", "results")

# name -> (heads, head_dim, layers, ffn_dim, latent grid (F, H, W) in tokens)
SHAPES = {
    "wide_even": (6, 128, 2, 3072, (4, 33, 39)),  # 5,148 tokens, 6 heads: divisible by 2
    "wide_uneven_tokens": (6, 128, 2, 3072, (3, 37, 47)),  # 5,217 tokens: odd
    "wide_uneven_heads": (5, 128, 2, 3072, (4, 33, 39)),  # 5 heads on 2 ranks
}
QUICK_SHAPES = {
    "wide_even": (6, 128, 2, 3072, (2, 22, 26)),  # 1,144 tokens
    "wide_uneven_tokens": (6, 128, 2, 3072, (3, 15, 25)),  # 1,125 tokens
    "wide_uneven_heads": (5, 128, 2, 3072, (2, 22, 26)),
}


# ---------------------------------------------------------------------------------------- workers
def _build(shape, seed=0):
    import torch
    from diffusers import WanTransformer3DModel

    heads, head_dim, layers, ffn, grid = shape
    torch.manual_seed(seed)
    model = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=heads, attention_head_dim=head_dim,
                                  in_channels=16, out_channels=16, text_dim=64, freq_dim=64, ffn_dim=ffn,
                                  num_layers=layers, rope_max_seq_len=1024).eval()
    g = torch.Generator().manual_seed(1)
    f, h, w = grid
    x = torch.randn(1, 16, f, 2 * h, 2 * w, generator=g)
    ctx = torch.randn(1, 512, 64, generator=g)
    t = torch.tensor([700])
    return model, (x, t, ctx)


def transformer_worker(rank, world, init_method, impl, shape, reps):
    """Time ``reps`` forwards; returns (times, output, traffic per forward)."""
    import torch
    import torch.distributed as dist

    model, (x, t, ctx) = _build(shape)
    stats = None
    if impl == "ours":
        import lite_boost
        from lite_boost.parallel import ParallelManager

        if world == 1:
            lite_boost.boost(model)
        else:
            ParallelManager(model, {"parallel": {"timeout_s": 900}}, init_method=init_method)
            stats = model._lite_boost.extras["parallel"].mesh.sequence.enable_stats()
    elif impl == "diffusers" and world > 1:
        from diffusers import ContextParallelConfig

        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=900))
        torch.accelerator.device_count = lambda: 1  # diffusers computes rank % device_count
        model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=world))
    times, cpu = [], []
    out = None
    with torch.no_grad():
        for i in range(reps + 1):  # first call warms caches and allocators
            if dist.is_initialized():
                dist.barrier()
            if stats is not None:
                stats.reset()
            t0, c0 = time.perf_counter(), time.process_time()
            out = model(x, t, ctx, return_dict=False)[0]
            dt, dc = time.perf_counter() - t0, time.process_time() - c0
            if i:
                times.append(dt)
                cpu.append(dc)
    traffic = None
    if stats is not None:
        traffic = {"calls": dict(stats.calls), "bytes_sent": dict(stats.bytes_sent)}
    return times, (out if rank == 0 else None), traffic, cpu


def paired_worker(rank, world, init_method, shape, reps):
    """Ours and diffusers' Ulysses in the SAME processes, called alternately (paired under equal load).

    world 1: lite_boost.boost vs stock diffusers; world 2: ParallelManager vs enable_parallelism on
    one process group. Returns {"ours": [s...], "diffusers": [s...]} (call wall times) and CPU times.
    """
    import torch
    import torch.distributed as dist

    ours, (x, t, ctx) = _build(shape)
    theirs, _ = _build(shape)
    if world == 1:
        import lite_boost

        lite_boost.boost(ours)
    else:
        from diffusers import ContextParallelConfig

        from lite_boost.parallel import ParallelManager, initialize_usp

        mesh = initialize_usp({"parallel": {"timeout_s": 900}}, init_method=init_method)
        ParallelManager(ours, mesh=mesh)
        torch.accelerator.device_count = lambda: 1  # diffusers computes rank % device_count
        theirs.enable_parallelism(config=ContextParallelConfig(ulysses_degree=world))
    wall = {"ours": [], "diffusers": []}
    cpu = {"ours": [], "diffusers": []}
    outs = {}
    with torch.no_grad():
        for i in range(reps + 1):
            order = (("ours", ours), ("diffusers", theirs)) if i % 2 == 0 else (("diffusers", theirs), ("ours", ours))
            for name, model in order:
                if dist.is_initialized():
                    dist.barrier()
                t0, c0 = time.perf_counter(), time.process_time()
                outs[name] = model(x, t, ctx, return_dict=False)[0]
                if i:
                    wall[name].append(time.perf_counter() - t0)
                    cpu[name].append(time.process_time() - c0)
    diff = (outs["ours"] - outs["diffusers"]).abs().max().item()
    return wall, cpu, diff


def paired_table(shape, reps):
    """Paired ours-vs-diffusers timing (even shape, the one both run), 1 and 2 processes."""
    res = {}
    for world in (1, 2):
        status, out = launch(paired_worker, world, shape, reps)
        if status != "ok":
            return f"paired benchmark failed: {out}"
        wall = {k: [max(v) for v in zip(*(r[0][k] for r in out))] for k in ("ours", "diffusers")}
        cpu = {k: [max(v) for v in zip(*(r[1][k] for r in out))] for k in ("ours", "diffusers")}
        res[world] = (wall, cpu, max(r[2] for r in out))
        print(f"  paired x{world}: ours {statistics.median(wall['ours']):.3f}s diffusers "
              f"{statistics.median(wall['diffusers']):.3f}s", flush=True)
    rows = []
    for impl in ("ours", "diffusers"):
        w1, w2 = res[1][0][impl], res[2][0][impl]
        c1, c2 = res[1][1][impl], res[2][1][impl]
        rows.append([impl, f"{statistics.median(w1):.3f}", f"{min(w1):.3f}", f"{statistics.median(w2):.3f}",
                     f"{min(w2):.3f}", f"**{statistics.median(w1) / statistics.median(w2):.2f}x**",
                     f"**{min(w1) / min(w2):.2f}x**", f"**{statistics.median(c1) / statistics.median(c2):.2f}x**"])
    pair = [a / b for a, b in zip(res[2][0]["ours"], res[2][0]["diffusers"])]
    heads, head_dim, layers, _, grid = shape
    return _md(["impl", "1 proc median (s)", "1 proc best (s)", "2 procs median (s)", "2 procs best (s)",
                "speed-up (medians)", "speed-up (best)", "CPU-time speed-up"], rows) + (
        f"\n\n{layers} layers, {heads} heads x {head_dim}, {math.prod(grid):,} tokens; {reps} calls of each, "
        f"alternating ours / diffusers in the same processes. Paired 2-process ratio ours/diffusers per call: "
        f"median {statistics.median(pair):.3f} (min {min(pair):.3f}, max {max(pair):.3f}); "
        f"max abs diff ours vs diffusers output: 1 proc {res[1][2]:.1e}, 2 procs {res[2][2]:.1e}.")


def cfg_worker(rank, world, init_method, shape, steps, reps):
    import torch
    import torch.distributed as dist

    import lite_boost
    from lite_boost.demo import TinyWanSpec, tiny_wan_pipeline
    from lite_boost.parallel import ParallelManager

    heads, head_dim, layers, ffn, (f, h, w) = shape
    pipe = tiny_wan_pipeline("t2v", spec=TinyWanSpec(heads=heads, head_dim=head_dim, layers=layers, ffn_dim=ffn))
    if world == 1:
        lite_boost.boost(pipe)
    else:
        ParallelManager(pipe, {"parallel": {"cfg_degree": 2, "timeout_s": 900}}, init_method=init_method)
    kw = dict(prompt="a fox in the snow", negative_prompt="blurry", height=16 * h, width=16 * w,
              num_frames=4 * (f - 1) + 1, num_inference_steps=steps, guidance_scale=5.0, output_type="latent")
    times, cpu = [], []
    out = None
    for i in range(reps + 1):
        if dist.is_initialized():
            dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        out = pipe(generator=torch.Generator().manual_seed(0), **kw).frames
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        if i:
            times.append(dt)
            cpu.append(dc)
    return times, (out if rank == 0 else None), None, cpu


# ---------------------------------------------------------------------------------------- launcher
def _entry(fn, rank, world, init_method, out_dir, args):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    import torch

    torch.set_num_threads(1)
    try:
        payload = ("ok", fn(rank, world, init_method, *args))
    except BaseException:  # noqa: BLE001
        payload = ("error", traceback.format_exc())
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as fh:
        pickle.dump(payload, fh)
    import torch.distributed as dist

    if dist.is_initialized():
        if payload[0] == "ok":
            dist.barrier()  # let every peer finish before tearing gloo down
        dist.destroy_process_group()


def launch(fn, world, *args, timeout=1800):
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="lb_bench_") as tmp:
        init = "file://" + os.path.join(tmp, "rdzv")
        procs = [ctx.Process(target=_entry, args=(fn, r, world, init, tmp, args)) for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.kill()
        results = []
        for r in range(world):
            path = os.path.join(tmp, f"rank{r}.pkl")
            if not os.path.exists(path):
                return ("error", f"rank {r} produced no result")
            with open(path, "rb") as fh:
                status, value = pickle.load(fh)
            if status != "ok":
                return ("error", value.strip().splitlines()[-1])
            results.append(value)
        return ("ok", results)


# ---------------------------------------------------------------------------------------- tables
def _md(headers, rows):
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def lower_bound_per_layer(heads, head_dim, tokens, degree, elem=4):
    return 4 * (degree - 1) / degree**2 * tokens * heads * head_dim * elem


def traffic_table(shapes):
    """Counted bytes per layer vs the lower bound, 2, 3 and 4 ranks (one forward each)."""
    rows = []
    for name, shape in shapes.items():
        heads, head_dim, layers, _, grid = shape
        tokens = math.prod(grid)
        for world in (2, 3, 4):
            status, res = launch(transformer_worker, world, "ours", shape, 1)
            if status != "ok":
                rows.append([name, world, "error: " + res] + [""] * 6)
                continue
            per_rank, calls_per_layer, gathers = [], set(), set()
            for _, _, traffic, _ in res:
                calls, sent = traffic["calls"], traffic["bytes_sent"]
                per_rank.append((sent.get("qkv_to_heads", 0) + sent.get("heads_to_seq", 0)) / layers)
                calls_per_layer.add((calls.get("qkv_to_heads", 0) + calls.get("heads_to_seq", 0)) / layers)
                gathers.add(calls.get("gather", 0))
            total = sum(per_rank)
            bound = world * lower_bound_per_layer(heads, head_dim, tokens, world)
            rows.append([name, world, f"{tokens:,} / {heads}", ", ".join(f"{c:g}" for c in sorted(calls_per_layer)),
                         f"{total / 2**20:.3f}", f"{bound / 2**20:.3f}", f"{total / bound:.4f}",
                         f"{max(per_rank) / (total / world):.3f}", ", ".join(str(g) for g in sorted(gathers))])
    return _md(["shape", "ranks", "tokens / heads", "collectives per layer per rank", "MiB sent per layer, all ranks (counted)",
                "lower bound MiB", "counted / bound", "busiest rank / mean", "gathers per forward"], rows) + (
        "\n\nLower bound: every rank must send (P-1)/P of its q, k, v shard and of its output share,"
        " 4 (P-1)/P^2 x S H D x 4 bytes per rank (fp32). Above 1.0000 only by the zero padding of the last shard"
        " (tokens not divisible by P); uneven heads move the same total but not evenly (busiest rank > 1).")


def _round_stats(res, world):
    """Median wall seconds (slowest rank per call) and median CPU seconds (busiest rank) of one launch."""
    if world == 1:
        return statistics.median(res[0][0]), statistics.median(res[0][3])
    wall = [max(ts) for ts in zip(*(r[0] for r in res))]
    cpu = [max(cs) for cs in zip(*(r[3] for r in res))]
    return statistics.median(wall), statistics.median(cpu)


def timing_table(shapes, rounds, reps):
    """Interleaved rounds: single / ours x2 / diffusers single / diffusers x2 per shape."""
    per = {}  # (shape, impl, world) -> list of (wall, cpu) per round
    outs = {}
    errors = {}
    configs = [("ours", 1), ("ours", 2), ("diffusers", 1), ("diffusers", 2)]
    for rnd in range(rounds):
        for name, shape in shapes.items():
            for impl, world in configs:
                key = (name, impl, world)
                if key in errors:
                    continue
                status, res = launch(transformer_worker, world, impl, shape, reps)
                if status != "ok":
                    errors[key] = res
                    print(f"  round {rnd} {name:20s} {impl:9s} x{world}: FAILS {res}", flush=True)
                    continue
                per.setdefault(key, []).append(_round_stats(res, world))
                outs[key] = res[0][1]
                w, c = per[key][-1]
                print(f"  round {rnd} {name:20s} {impl:9s} x{world}: wall {w:.3f}s cpu {c:.3f}s", flush=True)
    rows = []
    for name, shape in shapes.items():
        heads, head_dim, layers, _, grid = shape
        ref = outs.get((name, "ours", 1))
        for impl in ("ours", "diffusers"):
            one, two = per.get((name, impl, 1)), per.get((name, impl, 2))
            row = [name, f"{math.prod(grid):,}", f"{heads}x{head_dim}", impl]
            if (name, impl, 2) in errors or not one or not two:
                err = errors.get((name, impl, 2), "not run")
                row += [f"{statistics.median(w for w, _ in one):.3f}" if one else "-", "fails: " + err[:90],
                        "-", "-", "-", "-"]
                rows.append(row)
                continue
            wall_ratio = statistics.median(a[0] / b[0] for a, b in zip(one, two))
            cpu_ratio = statistics.median(a[1] / b[1] for a, b in zip(one, two))
            diff = (outs[(name, impl, 2)] - ref).abs().max().item() if ref is not None else float("nan")
            row += [f"{statistics.median(w for w, _ in one):.3f}", f"{statistics.median(w for w, _ in two):.3f}",
                    f"**{wall_ratio:.2f}x**", f"{statistics.median(c for _, c in two):.3f}",
                    f"**{cpu_ratio:.2f}x**", f"{diff:.1e}"]
            rows.append(row)
    table = _md(["shape", "tokens", "heads", "impl", "1 proc wall (s)", "2 procs wall (s)", "wall speed-up",
                 "2 procs CPU-s (busiest rank)", "CPU-time speed-up", "max abs diff vs ours 1 proc"], rows)
    return table, per, errors


def cfg_table(shape, rounds, reps, steps):
    per = {1: [], 2: []}
    outs = {}
    for rnd in range(rounds):
        for world in (1, 2):
            status, res = launch(cfg_worker, world, shape, steps, reps)
            if status != "ok":
                return f"cfg benchmark failed: {res}"
            per[world].append(_round_stats(res, world))
            outs[world] = res[0][1]
            print(f"  round {rnd} cfg x{world}: wall {per[world][-1][0]:.3f}s cpu {per[world][-1][1]:.3f}s", flush=True)
    wall_ratio = statistics.median(a[0] / b[0] for a, b in zip(per[1], per[2]))
    cpu_ratio = statistics.median(a[1] / b[1] for a, b in zip(per[1], per[2]))
    diff = (outs[2] - outs[1]).abs().max().item()
    heads, head_dim, layers, _, grid = shape
    return _md(["pipeline call", "tokens", "1 proc wall (s)", "cfg 2 x 2 procs wall (s)", "wall speed-up",
                "1 proc CPU-s", "cfg 2 CPU-s (busiest rank)", "CPU-time speed-up", "max abs diff latents"],
               [[f"T2V, {steps} step(s), guidance 5, {layers} layers {heads}x{head_dim}", f"{math.prod(grid):,}",
                 f"{statistics.median(w for w, _ in per[1]):.3f}", f"{statistics.median(w for w, _ in per[2]):.3f}",
                 f"**{wall_ratio:.2f}x**", f"{statistics.median(c for _, c in per[1]):.3f}",
                 f"{statistics.median(c for _, c in per[2]):.3f}", f"**{cpu_ratio:.2f}x**", f"{diff:.1e}"]])


def scaling_table():
    """Expected step-time scaling (a model, not a measurement): Wan2.1-14B, 720p, 81 frames, bf16."""
    S, H, D, L, dim, ffn = 75_600, 40, 128, 40, 5120, 13_824
    flops_layer = 4 * S * S * H * D + 2 * S * dim * (4 * dim) + 2 * S * dim * 2 * ffn + 2 * S * 512 * dim * 2
    peak = 400e12  # sustained bf16 FLOP/s of one H100/910B-class device (assumption)
    rows = []
    for link, bw in (("NVLink/HCCS 150 GB/s", 150e9), ("PCIe 20 GB/s", 20e9)):
        for P in (1, 2, 4, 8):
            compute = L * flops_layer / P / peak
            comm = L * lower_bound_per_layer(H, D, S, P, elem=2) / bw if P > 1 else 0.0
            t = compute + comm
            t1 = L * flops_layer / peak
            rows.append([link, P, f"{compute:.2f}", f"{comm:.2f}", f"{t:.2f}", f"{t1 / t:.2f}x",
                         f"{t1 / t / P * 100:.0f}%"])
    return _md(["interconnect", "devices (sequence)", "compute s/forward", "all_to_all s/forward",
                "s/forward", "speed-up", "efficiency"], rows) + (
        "\n\nModel: compute = FLOPs/(P x 400 TFLOP/s); traffic = the counted Ulysses volume (equal to the lower"
        " bound, table 1) 4(P-1)/P^2 x S H D x 2 bytes per layer, without overlap. CFG parallel (cfg 2) halves"
        " the per-step work again with one output exchange per step (~S x 64 x 2 bytes, negligible). Not measured"
        " on devices.")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small shapes, one round")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--skip", nargs="*", default=[], choices=["traffic", "timing", "paired", "cfg", "scaling"])
    args = ap.parse_args()
    shapes = QUICK_SHAPES if args.quick else SHAPES
    rounds = args.rounds or (1 if args.quick else 3)
    reps = args.reps or (2 if args.quick else 3)
    os.makedirs(RESULTS, exist_ok=True)
    import torch

    load = os.getloadavg()[0]
    header = (f"torch {torch.__version__}, gloo on CPU, {os.cpu_count()} cores shared with other jobs (load average "
              f"{load:.1f} at start), 1 thread per process, fp32; {rounds} interleaved rounds x {reps} timed calls "
              "after 1 warm-up; medians. Wall time needs one free core per process; CPU-s (process CPU time of the "
              "busiest rank) shows the work per rank independently of the contention.")
    sections = []
    if "traffic" not in args.skip:
        print("traffic ...", flush=True)
        t = traffic_table({k: v for k, v in shapes.items()})
        sections.append(("traffic", "Ulysses traffic per transformer layer (counted) vs lower bound", t))
    if "timing" not in args.skip:
        print("timing ...", flush=True)
        t, _, _ = timing_table(shapes, rounds, reps)
        sections.append(("ulysses", "Transformer forward, 2 processes x 1 thread vs 1 process x 1 thread", t))
    if "paired" not in args.skip:
        print("paired ...", flush=True)
        t = paired_table(shapes["wide_even"], reps=max(4, 3 * reps))
        sections.append(("paired", "Ours vs diffusers' Ulysses, paired in the same processes", t))
    if "cfg" not in args.skip:
        print("cfg ...", flush=True)
        shape = shapes["wide_even"]
        t = cfg_table(shape, rounds, max(1, reps - 1), steps=1 if not args.quick else 2)
        sections.append(("cfg", "CFG parallel (cfg 2) pipeline call vs 1 process", t))
    if "scaling" not in args.skip:
        sections.append(("scaling", "Expected scaling model, Wan2.1-14B 720p (75,600 tokens)", scaling_table()))
    for key, title, table in sections:
        head = header
        if key == "paired":
            head = header.split(";")[0] + "; one launch per process count, calls alternate (see below)."
        elif key == "scaling":
            head = "A model from FLOPs and the counted traffic, not a measurement."
        elif key == "traffic":
            head = header.split(";")[0] + "; one forward per launch, bytes counted by the Communicator."
        text = f"## {title}\n\n{head}\n\n{table}\n"
        print("\n" + text)
        suffix = "_quick" if args.quick else ""
        with open(os.path.join(RESULTS, f"parallel_{key}{suffix}.md"), "w") as fh:
            fh.write(text)


if __name__ == "__main__":
    main()
