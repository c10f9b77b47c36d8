"""Per-rank peak memory and step time of each weight layout, measured and as the planner predicts them.

    flock /tmp/lite_boost_bench.lock python benchmarks/bench_memory.py              # layouts at 1, 2, 4 ranks
    python benchmarks/bench_memory.py --rounds 3 --append                           # 3 more interleaved rounds
    python benchmarks/bench_memory.py --layouts ulysses2,fsdp2 --calls 2            # a subset
    python benchmarks/bench_memory.py --layouts fsdp4,tp4 --append                  # add to memory.json

At Wan2.1-14B block dimensions (40 heads x 128, hidden 5120, FFN 13824, text_dim 4096) with a few blocks
(default 2: what fits this machine at 4 processes), bfloat16, one transformer call at a short sequence.
Every rank is a fresh process (gloo, one thread each) started with ``MALLOC_MMAP_THRESHOLD_=65536`` so
that glibc maps every tensor of 64 KiB or more on its own and unmaps it when freed: the resident set then
follows the live tensors. Measured per rank: the resident-set growth from building the model and applying
the layout (weights), the peak of one call over the resident set before it (the kernel's high-water mark
reset through /proc/self/clear_refs just before the call), the peak over the process's baseline (before
the model), and the median call time over ``--calls`` calls after a warm-up. ``--rounds R`` runs every layout R
times, interleaved (round 1: each layout once, then round 2, ...), each run in fresh processes: the table's
step time is the median over the rounds (each round's time is the median over ranks), and beside it the ratio
to the replicated run of the same round (median over rounds); the memory columns come from round 1, and the
spread of the peak over the rounds is recorded. Predicted: lite_boost.memory's
per-rank weights, FSDP gather working set (gloo's measured multiple) and activations for the same layout
(from the unsharded module's counts), plus ``HOST_LIBRARIES_BYTES``: the process's baseline is read after
``import torch``, so what it loads afterwards (diffusers, lite_boost, the operator library) is in every
measured column.

    python benchmarks/bench_memory.py --repredict     # the stored measurements against the current planner

Results: benchmarks/results/memory.md and memory.json (with lscpu model, threads, load, date). The table
then extrapolates, marked as such, to the full 40-block Wan2.1-14B (with its UMT5-XXL text encoder, 81 x
480 x 832) and to MiniMax-H3 (diffusers' MiniMaxH3Transformer3DModel defaults, 50 blocks) on 8 ranks:
the planner's numbers only, no run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
RESULTS = os.path.join(ROOT, "benchmarks", "results")

# name -> (world size, ParallelConfig fields, offload)
LAYOUTS = {
    "replicated": (1, {}, False),
    "offload": (1, {}, True),
    "ulysses2": (2, {}, False),
    "fsdp2": (2, {"fsdp_degree": 2}, False),  # the fsdp ranks split the sequence too (Ulysses 2 x FSDP 2)
    "tp2": (2, {"tp_degree": 2}, False),
    "ulysses4": (4, {}, False),
    "ulysses4_fsdp2": (4, {"fsdp_degree": 2}, False),
    "fsdp4": (4, {"fsdp_degree": 4}, False),  # Ulysses 4 x FSDP 4
    "tp4": (4, {"tp_degree": 4}, False),
    "tp2_ulysses2": (4, {"tp_degree": 2}, False),
    "fsdp2_offload": (2, {"fsdp_degree": 2}, True),  # Ulysses 2 x FSDP 2 with FSDP2's CPUOffloadPolicy
    "tp2_ulysses2_fsdp2": (4, {"tp_degree": 2, "fsdp_degree": 2}, False),  # the 2-D (fsdp, tp) mesh
}
DIMS = dict(num_attention_heads=40, attention_head_dim=128, ffn_dim=13824, text_dim=4096, freq_dim=256)


def _status(key: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")


# ---------------------------------------------------------------------------------------- a rank
def worker(args) -> None:
    import torch

    torch.set_num_threads(1)
    base = _status("VmRSS")
    from diffusers import WanTransformer3DModel

    import lite_boost
    world = LAYOUTS[args.layout][0]
    torch.manual_seed(0)
    with torch.device("meta"):
        model = WanTransformer3DModel(num_layers=args.blocks, **DIMS)
    model = model.to_empty(device="cpu").to(torch.bfloat16).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
    frames, height, width = args.shape
    pred = predict(args.layout, model, args.shape)
    _, fields, offload = LAYOUTS[args.layout]
    config = {"parallel": {"timeout_s": 600, "vae_parallel": "off", **fields}}
    if offload:
        config["offload"] = True
    if world > 1:
        model = lite_boost.ParallelManager(model, config)
    else:
        model = lite_boost.boost(model, config)
    built = _status("VmRSS")
    gen = torch.Generator().manual_seed(1)
    lat = torch.randn(1, 16, (frames - 1) // 4 + 1, height // 8, width // 8, generator=gen).to(torch.bfloat16)
    ctx = torch.randn(1, 512, 4096, generator=gen).to(torch.bfloat16)
    t = torch.tensor([500.0])

    def call():
        with torch.no_grad():
            return model(hidden_states=lat, timestep=t, encoder_hidden_states=ctx, return_dict=False)[0]

    call()
    times = []
    before = _status("VmRSS")
    _reset_peak()
    for _ in range(args.calls):
        if world > 1:
            torch.distributed.barrier()
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    peak = _status("VmHWM")
    print(json.dumps({"rank": int(os.environ.get("RANK", 0)), "weights_measured": built - base,
                      "call_peak_measured": peak - before, "peak_over_baseline": peak - base, **pred,
                      "call_s": statistics.median(times)}), flush=True)
    if world > 1:
        torch.distributed.destroy_process_group()


def predict(name: str, model, shape) -> dict:
    """The planner's numbers for layout ``name`` of ``model`` (any device, meta included) at ``shape``."""
    from lite_boost.memory import HOST_LIBRARIES_BYTES, Layout, ModelDims, estimate, token_count

    world, fields, offload = LAYOUTS[name]
    dims = ModelDims.from_module(model, dtype_bytes=2)
    tokens = token_count(dims, *shape)
    tp = fields.get("tp_degree", 1)
    layout = Layout(tp=tp, ulysses=world // tp, fsdp=fields.get("fsdp_degree", 1), offload=offload)
    host = estimate(dims, layout, tokens, backend="gloo").host_weights
    # on the CPU the host is the device and offload moves nothing (an upload to the host is the same tensor): the
    # resident set is the same layout's without offload; host_weights_predicted is what would wait in host memory
    # on an accelerator
    est = estimate(dims, Layout(tp=tp, ulysses=world // tp, fsdp=fields.get("fsdp_degree", 1)), tokens, backend="gloo")
    return {"tokens": tokens, "weights_predicted": est.weights, "gather_predicted": est.gather,
            "activations_predicted": est.activations, "total_predicted": est.total,
            "host_weights_predicted": host, "host_libraries": HOST_LIBRARIES_BYTES}


def repredict(args) -> None:
    """Recompute the predicted fields of RESULTS/OUT.json with the current planner; the measurements stay."""
    import torch
    from diffusers import WanTransformer3DModel

    path = os.path.join(RESULTS, f"{args.out}.json")
    with open(path) as fh:
        old = json.load(fh)
    args.blocks, args.shape, args.loads = old["blocks"], tuple(old["shape"]), old.get("loads", {})
    args.rounds_record = old.get("rounds", {})
    with torch.device("meta"):
        model = WanTransformer3DModel(num_layers=args.blocks, **old["dims"])
    for name, rows in old["results"].items():
        if not isinstance(rows, str):
            pred = predict(name, model, args.shape)
            for r in rows:
                r.update(pred)
    write(args, old["results"], old["load_before"], old["load_after"], date=old["date"], lscpu=old["lscpu"])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_layout(name: str, args) -> list[dict]:
    world = LAYOUTS[name][0]
    port = _free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1",
                   PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        if world > 1:
            env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(port))
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--layout", name, "--blocks", str(args.blocks),
               "--calls", str(args.calls), "--shape", "x".join(map(str, args.shape))]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    rows = []
    for p in procs:
        out, err = p.communicate(timeout=1800)
        if p.returncode != 0:
            raise RuntimeError(f"{name}: a rank failed:\n{err[-3000:]}")
        rows.append(json.loads(out.strip().splitlines()[-1]))
    return rows


def _lscpu() -> dict:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except OSError:
        return {}
    keep = ("Model name", "CPU family", "Model", "CPU(s)")
    return {k.strip(): v.strip() for k, v in (ln.split(":", 1) for ln in out.splitlines() if ":" in ln)
            if k.strip() in keep}


def extrapolate() -> list[str]:
    """The planner's per-rank numbers for the full models on 8 ranks (no run)."""
    from lite_boost.memory import dims_for_family, meta_model, ModelDims, plan_layouts, token_count
    from lite_boost.registry import families

    lines = []
    wan = next(f for f in families() if f.name == "wan")
    dims, shape = dims_for_family(wan)
    mm = ModelDims.from_module(meta_model("diffusers", "MiniMaxH3Transformer3DModel"), name="MiniMax-H3 (transformer)")
    lines.append("\nMiniMax-H3: the transformer only (its text encoder and audio stream are not counted), its video tokens "
                 "taken like Wan's (4 x 8 x 8 VAE, 1 x 2 x 2 patches), text in cross-attention.")
    for d, shp, mem in ((dims, shape, "24GiB"), (dims, (81, 720, 1280), "24GiB"), (mm, shape, "24GiB"),
                        (mm, shape, "64GiB")):
        tokens = token_count(d, *shp)
        plan = plan_layouts(d, 8, tokens, mem, shape=shp)
        lines.append(f"\n**Extrapolated (planner only, not measured)**: {d.name}, 8 ranks, {shp[0]} x {shp[1]} x "
                     f"{shp[2]} ({tokens} tokens), {mem} per device, bf16; FSDP gather as assumed for NCCL / HCCL "
                     "(2 x (f - 1) / f blocks, not measured; gloo would hold 4 blocks)\n")
        lines.append("| layout | weights GiB | text enc GiB | FSDP gather GiB | activations GiB | total GiB | fits | "
                     "moved per call GiB | host w. GiB |")
        lines.append("|---|---|---|---|---|---|---|---|---|")
        for e in plan.rows:
            mark = " (recommended)" if e is plan.recommended else ""
            lines.append(f"| {e.layout.label()}{mark} | {e.weights / 2**30:.2f} | {e.text_encoder / 2**30:.2f} | "
                         f"{e.gather / 2**30:.2f} | {e.activations / 2**30:.2f} | {e.total / 2**30:.2f} | "
                         f"{'yes' if e.fits else 'no'} | {e.traffic / 2**30:.2f} | {e.host_weights / 2**30:.2f} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--layout", default=None)
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--blocks", type=int, default=2)
    ap.add_argument("--calls", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=1,
                    help="run every layout this many times, interleaved (the step time is the median over rounds)")
    ap.add_argument("--shape", default="9x160x256", help="FRAMESxHEIGHTxWIDTH (default: 480 tokens)")
    ap.add_argument("--out", default="memory")
    ap.add_argument("--append", action="store_true",
                    help="add to the layouts already in RESULTS/OUT.json (one layout per run on a shared machine)")
    ap.add_argument("--repredict", action="store_true",
                    help="no run: the measurements in RESULTS/OUT.json against the current planner "
                         "(rewrites it and the .md)")
    args = ap.parse_args()
    args.shape = tuple(int(x) for x in args.shape.split("x"))
    if args.rounds < 1:
        ap.error(f"--rounds must be >= 1, got {args.rounds}")
    if args.repredict:
        repredict(args)
        return
    if args.blocks < 2:  # the planner finds the blocks as a list of two or more
        ap.error(f"--blocks must be >= 2, got {args.blocks}")
    if args.worker:
        worker(args)
        return
    load0 = os.getloadavg()
    results, loads = {}, {}
    path = os.path.join(RESULTS, f"{args.out}.json")
    if args.append and os.path.exists(path):
        with open(path) as fh:
            old = json.load(fh)
        results, loads = old["results"], old.get("loads", {})
        load0 = tuple(old["load_before"])
    args.loads = loads
    args.rounds_record = rounds = old.get("rounds", {}) if args.append and os.path.exists(path) else {}
    names = args.layouts.split(",")
    for _ in range(args.rounds):
        for name in names:  # interleaved: every layout once per round, in fresh processes
            t0 = time.time()
            before = os.getloadavg()
            try:
                rows = run_layout(name, args)
            except Exception as exc:  # a layout this installation cannot run: say so in the table
                rows = str(exc).strip().splitlines()[-1][:300]
            after = os.getloadavg()
            if name not in results or isinstance(results[name], str):
                results[name] = rows  # memory columns: the first round that ran
                loads[name] = [round(before[0], 2), round(after[0], 2)]
            if not isinstance(rows, str):
                rounds.setdefault(name, []).append(
                    {"call_s": statistics.median(r["call_s"] for r in rows),
                     "peak_over_baseline": max(r["peak_over_baseline"] for r in rows),
                     "load": [round(before[0], 2), round(after[0], 2)],
                     "round": len(rounds.get(name, []))})  # the k-th run of each layout: round k
            print(name, f"{time.time() - t0:.0f}s", rows if isinstance(rows, str) else
                  [(r["call_peak_measured"] >> 20, r["activations_predicted"] >> 20, round(r["call_s"], 2))
                   for r in rows], flush=True)
            write(args, results, load0, os.getloadavg(), extrapolated=False)  # what has run so far
    write(args, results, load0, os.getloadavg())


def _call_cell(rows, rounds, by_round) -> str:
    """'call s | time / replicated | rounds' cells: medians over the interleaved rounds when recorded."""
    if not rounds:
        return f"{statistics.median(r['call_s'] for r in rows):.2f} | | 1"
    times = [r["call_s"] for r in rounds]
    cell = f"{statistics.median(times):.2f}" + (f" ({min(times):.2f}-{max(times):.2f})" if len(times) > 1 else "")
    ratios = [r["call_s"] / by_round[r["round"]] for r in rounds if r["round"] in by_round]
    return f"{cell} | {statistics.median(ratios):.2f}x | {len(times)}" if ratios else f"{cell} | | {len(times)}"


def write(args, results, load0, load1, extrapolated=True, date=None, lscpu=None) -> None:
    record = {"lscpu": lscpu or _lscpu(),
              "date": date or datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "threads_per_rank": 1, "dtype": "bfloat16", "blocks": args.blocks, "shape": args.shape,
              "dims": DIMS, "load_before": load0, "load_after": load1, "loads": getattr(args, "loads", {}),
              "rounds": getattr(args, "rounds_record", {}), "results": results}
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, f"{args.out}.json"), "w") as fh:
        json.dump(record, fh, indent=1)
    mib = lambda b: f"{b / 2**20:.0f}"  # noqa: E731
    cpu = record["lscpu"]
    lines = [f"# Per-rank memory and step time by weight layout\n",
             f"Wan2.1-14B block dims ({DIMS['num_attention_heads']} heads x {DIMS['attention_head_dim']}, FFN "
             f"{DIMS['ffn_dim']}), {args.blocks} blocks, bf16, {args.shape[0]} x {args.shape[1]} x {args.shape[2]} "
             f"({next(iter(r for r in results.values() if not isinstance(r, str)))[0]['tokens']} tokens), one "
             f"transformer call; gloo, 1 thread per rank; {cpu.get('Model name', '?')} (family {cpu.get('CPU family', '?')}"
             f", model {cpu.get('Model', '?')}), {record['date']}; load average {load0[0]:.1f} before, {load1[0]:.1f} "
             "after (a shared machine: the times are indicative). MiB per rank (rank 0; the max over ranks in "
             "brackets when they differ by more than 1 MiB).\n",
             "| layout | ranks | at rest measured | at rest predicted | call peak measured | gather + activations "
             "predicted | peak over baseline | peak predicted | peak error | call s | time / replicated | rounds | load |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    rounds = record["rounds"]
    by_round = {r["round"]: r["call_s"] for r in rounds.get("replicated", [])}
    for name, rows in results.items():
        if isinstance(rows, str):
            lines.append(f"| {name} | {LAYOUTS[name][0]} | not run: {rows} | | | | | | | | | | |")
            continue
        r0 = rows[0]

        def cell(key):
            top = max(r[key] for r in rows)
            return mib(r0[key]) + (f" ({mib(top)})" if top - r0[key] > 2**20 else "")

        host = r0.get("host_libraries", 0)
        peak_pred = r0["total_predicted"] + host
        err = max((peak_pred - r["peak_over_baseline"]) / r["peak_over_baseline"] for r in rows)
        lines.append(f"| {name} | {len(rows)} | {cell('weights_measured')} | {mib(r0['weights_predicted'] + host)} | "
                     f"{cell('call_peak_measured')} | {mib(r0.get('gather_predicted', 0) + r0['activations_predicted'])} "
                     f"| {cell('peak_over_baseline')} | {mib(peak_pred)} | {err:+.1%} | "
                     f"{_call_cell(rows, rounds.get(name), by_round)} | "
                     f"{'-'.join(str(x) for x in record['loads'].get(name, []))} |")
    lines.append("\nat rest measured: resident-set growth from building the model and applying the layout (it includes "
                 "the libraries the process loads after its baseline: diffusers, lite_boost, the operator library); at "
                 "rest predicted: the planner's weights + HOST_LIBRARIES_BYTES; call peak: the high-water mark of a call "
                 "over the resident set before it; gather + activations predicted: FSDP's gather working set (gloo: 4 "
                 "blocks) + the peak activations; peak over baseline: the high-water mark over the process before the "
                 "model (weights, the call, and what the warm-up call leaves: RoPE tables, kernel and collective "
                 "buffers); peak predicted: the planner's device total + HOST_LIBRARIES_BYTES; peak error: (predicted - "
                 "measured) / measured, the worst rank; call s: the median "
                 "over ranks of each rank's median call (with --rounds: the median over the interleaved rounds, their "
                 "range in brackets); time / replicated: the median over rounds of this layout's time divided by the "
                 "replicated run's time in the same round; rounds: how many interleaved runs; load: the 1-minute load average before and after the layout "
                 "ran (2 cores shared with other work: the times are noisy, the memory is not).")
    if extrapolated:
        lines += extrapolate()
    with open(os.path.join(RESULTS, f"{args.out}.md"), "w") as fh:
        fh.write("\n".join(lines) + "\n")
    if extrapolated:
        print("\n".join(lines))


if __name__ == "__main__":
    main()
