"""Where the chunked parallel VAE's time goes: per-rank, per-phase wall and CPU time vs the cost model.

    flock /tmp/lite_boost_cpu.lock python benchmarks/bench_vae_phases.py --kinds decode --repeats 3

Two gloo ranks, 1 thread each, the trained small Wan VAE, fp32, 21 latent frames (81 x H x W video).
Each repeat and call kind (decode / encode), interleaved:

* ``baseline``: rank 0 runs the stock sequential call while rank 1 waits in a barrier;
* ``solo r``: rank r runs exactly its chunk(s) of the chunked plan (the adapter's ``run_chunk``, the
  default overlap) while the other rank waits: the rank's own work with the machine to itself;
* ``both stock``: both ranks run the stock call at the same time (identical work: the slowdown
  over ``baseline`` is what two busy cores cost each other, with no parallel-VAE code involved);
* ``chunked``: the real parallel call (``parallelize_vae(mode="chunked")``), with the runner's
  phase timers on (``ParallelVAE.record_phases``: each chunk, concat/pad, gather, stitch).

Every network call (``vae.decoder`` / ``vae.encoder`` forward: one latent frame / one group of
video frames) is timed by hooks: wall, this thread's CPU time, its system time and minor page
faults. Each call is labelled ``first`` (a fresh call's first unit: frame 0, or a chunk's first
warm-up frame / replayed video frame), ``warm`` (warm-up output that is dropped) or ``own``.
The report compares each rank's measured work with the plan's cost model
(``VAEAdapter.chunk_cost`` x the baseline's median later-unit time). Prints Markdown.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))
sys.path.insert(0, HERE)
from bench_vae import add_common_args, keep_freed_memory, run_two_ranks  # noqa: E402


def _setup_process(rank, args):
    """Per-rank process setup shared by the baseline and the parallel runs (so both get it):
    ``--pin`` binds rank r to CPU core r (one core per rank, as an HPC launcher would);
    ``--malloc keep`` stops glibc from returning freed memory to the OS (no mmap'd chunks, no
    trimming), so a call's big temporaries (slow_conv3d's im2col buffers) are not page-faulted
    afresh every time."""
    if args.pin:
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cores[rank % len(cores)]})
    if args.malloc == "keep":
        keep_freed_memory()


def _setup_desc(args) -> str:
    return (("ranks pinned to one core each" if args.pin else "ranks not pinned") + "; glibc malloc "
            + ("keeping freed memory (mmap off, no trim)" if args.malloc == "keep" else "defaults"))


class CallTimer:
    """Forward hooks on a network module: one record per call (wall, thread CPU, sys, minor faults)."""

    def __init__(self, module):
        self.records: list[dict] = []
        self.on = False
        self._h = [module.register_forward_pre_hook(self._pre), module.register_forward_hook(self._post)]

    @staticmethod
    def _now():
        ru = resource.getrusage(resource.RUSAGE_THREAD)
        return time.perf_counter(), time.thread_time(), ru.ru_stime, ru.ru_minflt

    def _pre(self, mod, args):
        if self.on:
            self._t0 = self._now()

    def _post(self, mod, args, out):
        if self.on:
            t1 = self._now()
            w, c, s, f = (b - a for a, b in zip(self._t0, t1))
            self.records.append(dict(wall=w, cpu=c, sys=s, minflt=f, frames=args[0].shape[2]))

    def start(self):
        self.records = []
        self.on = True

    def stop(self):
        self.on = False
        return self.records


def _timed(fn):
    ru0 = resource.getrusage(resource.RUSAGE_THREAD)
    t0, c0 = time.perf_counter(), time.thread_time()
    out = fn()
    t1, c1 = time.perf_counter(), time.thread_time()
    ru1 = resource.getrusage(resource.RUSAGE_THREAD)
    return out, dict(wall=t1 - t0, cpu=c1 - c0, sys=ru1.ru_stime - ru0.ru_stime, minflt=ru1.ru_minflt - ru0.ru_minflt)


def _labels(chunks, n_calls_per_chunk, kind):
    """first / warm / own for each network call of the given chunk runs, in order."""
    out = []
    for c, n in zip(chunks, n_calls_per_chunk):
        for j in range(n):
            if j == 0:
                out.append("first")
            elif kind == "decode":
                out.append("warm" if c.warm_start + j < c.start else "own")
            else:  # encode: call 0 = frame 0 (w == 0) or the replayed video frame; call j = group w - 1 + j
                grp = j if c.warm_start == 0 else c.warm_start - 1 + j
                out.append("warm" if grp < c.start else "own")
    return out


def _rank(rank, world, init_file, args, out_dir):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    _setup_process(rank, args)
    import pickle

    import torch.distributed as dist
    from diffusers import AutoencoderKLWan
    from train_small_wan_vae import procedural_video

    from lite_boost.parallel.groups import init_mesh
    from lite_boost.parallel.vae import parallelize_vae, plan_chunks, unparallelize_vae, vae_adapter_for

    mesh = init_mesh({"timeout_s": 1800}, init_method="file://" + init_file)
    vae = AutoencoderKLWan.from_pretrained(args.weights).eval()
    ad = vae_adapter_for(vae)
    frames = 1 + 4 * (args.latent_frames - 1)
    video = procedural_video(torch.Generator().manual_seed(5), frames, args.height, args.width).unsqueeze(0)
    with torch.no_grad():
        z = vae._encode(video)[:, :16].contiguous()
    inputs = {"decode": z, "encode": video}
    stock = {"decode": lambda: vae.decode(z).sample, "encode": lambda: vae.encode(video).latent_dist.mean}
    nets = {"decode": CallTimer(vae.decoder), "encode": CallTimer(vae.encoder)}
    res = []

    def record(kind, what, rep, fn, chunks=None):
        ct = nets[kind]
        ct.start()
        out, tot = _timed(fn)
        calls = ct.stop()
        res.append(dict(kind=kind, what=what, rep=rep, total=tot, calls=calls, chunks=chunks))
        return out

    with torch.no_grad():
        for rep in range(args.repeats):
            for kind in args.kinds:
                inner = getattr(vae, ad.decode_method if kind == "decode" else ad.encode_method)
                ov = ad.default_overlap if kind == "decode" else ad.default_encode_overlap
                plan = plan_chunks(ad.num_units(inputs[kind], kind), world, overlap=ov, cost=ad.chunk_cost_fn(kind))
                mine = plan.for_rank(rank)
                dist.barrier()
                if rank == 0:
                    record(kind, "baseline", rep, stock[kind])
                dist.barrier()
                for r in range(world):  # each rank's own chunk work, alone on the machine
                    if rank == r:
                        record(kind, "solo", rep, lambda: [ad.run_chunk(inner, inputs[kind], c, kind) for c in mine],
                               chunks=mine)
                    dist.barrier()
                if args.both_stock:
                    record(kind, "both stock", rep, stock[kind])
                    dist.barrier()
                runner = parallelize_vae(vae, mesh.world, mode="chunked")
                runner.record_phases = True
                dist.barrier()
                record(kind, "chunked", rep, stock[kind], chunks=mine)
                res[-1]["phases"] = runner.last_phases
                dist.barrier()
                unparallelize_vae(vae)
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as fh:
        pickle.dump(dict(res=res, plan={k: plan_chunks(ad.num_units(inputs[k], k), world,
                                                         overlap=ad.default_overlap if k == "decode" else ad.default_encode_overlap,
                                                         cost=ad.chunk_cost_fn(k)) for k in args.kinds}), fh)
    dist.barrier()
    dist.destroy_process_group()


def _med(xs):
    xs = list(xs)
    return statistics.median(xs) if xs else 0.0


def report(per_rank, args):
    from diffusers import AutoencoderKLWan

    from lite_boost.parallel.vae import vae_adapter_for

    with torch.device("meta"):
        ad = vae_adapter_for(AutoencoderKLWan.from_pretrained(args.weights))
    lines = []
    for kind in args.kinds:
        plan = per_rank[0]["plan"][kind]
        base = [x for x in per_rank[0]["res"] if x["kind"] == kind and x["what"] == "baseline"]
        later = _med(_med(c["wall"] for c in b["calls"][1:]) for b in base)
        later_cpu = _med(_med(c["cpu"] for c in b["calls"][1:]) for b in base)
        first = _med(b["calls"][0]["wall"] for b in base)
        base_tot = _med(b["total"]["wall"] for b in base)
        base_cpu = _med(b["total"]["cpu"] for b in base)
        base_calls = _med(sum(c["wall"] for c in b["calls"]) for b in base)
        n_units = len(base[0]["calls"])
        full_cost = ad.chunk_cost(0, 0, plan.num_frames, kind)
        lines += [f"### {kind}: plan {plan.describe()}", "",
                  f"Baseline (1 process x 1 thread, stock call): {base_tot:.2f} s wall, {base_cpu:.2f} s CPU; "
                  f"{n_units} network calls = {base_calls:.2f} s, outside them {base_tot - base_calls:.3f} s; "
                  f"first call {first * 1e3:.0f} ms = {first / later:.2f} of a later unit (cost model "
                  f"{ad.chunk_cost(0, 0, 1, kind):.2f}); later unit median {later * 1e3:.0f} ms wall / "
                  f"{later_cpu * 1e3:.0f} ms CPU; whole call = {base_tot / later:.2f} later units "
                  f"(cost model {full_cost:.2f}).", ""]
        # both-stock contention
        if args.both_stock:
            both = [max(a["total"]["wall"], b["total"]["wall"]) for a, b in zip(
                *[[x for x in pr["res"] if x["kind"] == kind and x["what"] == "both stock"] for pr in per_rank])]
            both_cpu = [_med(x["total"]["cpu"] for x in pr["res"] if x["kind"] == kind and x["what"] == "both stock")
                        for pr in per_rank]
            lines += [f"Both ranks running the stock call at once: {_med(both):.2f} s wall (slower rank) = "
                      f"{_med(both) / base_tot:.3f}x the baseline; CPU per rank {both_cpu[0]:.2f} / {both_cpu[1]:.2f} s = "
                      f"{both_cpu[0] / base_cpu:.3f}x / {both_cpu[1] / base_cpu:.3f}x (two busy cores' mutual slowdown).", ""]
        hdr = ("| rank | run | first | warm-up calls | own calls | calls sum | outside calls | concat/pad | gather "
               "| stitch | total wall | total CPU | sys | minor faults | model units | model s | measured / model |")
        lines += [hdr, "|" + "---|" * (hdr.count("|") - 1)]
        worst = {"solo": 0.0, "chunked": 0.0}
        worst_cpu = {"solo": 0.0, "chunked": 0.0}
        for r, pr in enumerate(per_rank):
            mine = plan.for_rank(r)
            units = sum(ad.chunk_cost(c.warm_start, c.start, c.stop, kind) for c in mine)
            for what in ("solo", "chunked"):
                runs = [x for x in pr["res"] if x["kind"] == kind and x["what"] == what]
                if not runs:
                    continue
                cats = {"first": [], "warm": [], "own": []}
                ncat = {"first": 0, "warm": 0, "own": 0}
                sums, outside, tots, cpus, syss, flts = [], [], [], [], [], []
                ph = {"concat_pad": [], "gather": [], "stitch": []}
                for x in runs:
                    calls = x["calls"]
                    if mine:
                        per_chunk = _split_calls(calls, mine, ad, kind)
                        labels = _labels(mine, per_chunk, kind)
                    else:
                        labels = []
                    for cat in cats:
                        sel = [c["wall"] for c, lab in zip(calls, labels) if lab == cat]
                        cats[cat].append(sum(sel))
                        ncat[cat] = len(sel)
                    s = sum(c["wall"] for c in calls)
                    sums.append(s)
                    chunk_wall = sum(p["wall"] for p in x.get("phases") or [] if p["name"] == "chunk") \
                        if what == "chunked" else x["total"]["wall"]
                    outside.append(chunk_wall - s)
                    for k in ph:
                        ph[k].append(sum(p["wall"] for p in x.get("phases") or [] if p["name"] == k))
                    tots.append(x["total"]["wall"])
                    cpus.append(x["total"]["cpu"])
                    syss.append(x["total"]["sys"])
                    flts.append(x["total"]["minflt"])
                model_s = units * later
                tot = _med(tots)
                work = tot - (_med(ph["gather"]) if what == "chunked" else 0.0)
                worst[what] = max(worst[what], _med(tots))
                worst_cpu[what] = max(worst_cpu[what], _med(cpus))
                fmt = lambda v: f"{v:.2f}"  # noqa: E731
                phs = [fmt(_med(ph[k])) if what == "chunked" else "" for k in ("concat_pad", "gather", "stitch")]
                lines.append(
                    f"| {r} | {what} | {fmt(_med(cats['first']))} | {fmt(_med(cats['warm']))} ({ncat['warm']}) | "
                    f"{fmt(_med(cats['own']))} ({ncat['own']}) | {fmt(_med(sums))} | {fmt(_med(outside))} | "
                    + " | ".join(phs) + f" | {fmt(tot)} | {fmt(_med(cpus))} | {fmt(_med(syss))} | {_med(flts):.0f} | "
                    f"{units:.2f} | {model_s:.2f} | {work / model_s:.3f} |")
        lines += ["", f"Speed-up: solo work (the slower rank alone) {base_tot / worst['solo']:.3f}x; chunked call "
                      f"{base_tot / worst['chunked']:.3f}x wall, {base_cpu / worst_cpu['chunked']:.3f}x CPU; "
                      f"cost model {full_cost / max(sum(ad.chunk_cost(c.warm_start, c.start, c.stop, kind) for c in plan.for_rank(r)) for r in range(2)):.3f}x.",
                  ""]
        runs_line = {what: [round(x["total"]["wall"], 2) for x in per_rank[0]["res"] if x["kind"] == kind and x["what"] == what]
                     for what in ("baseline", "solo", "both stock", "chunked")}
        runs_line["rank 1"] = {what: [round(x["total"]["wall"], 2) for x in per_rank[1]["res"]
                                      if x["kind"] == kind and x["what"] == what] for what in ("solo", "both stock", "chunked")}
        lines += [f"runs, rank 0 (s): {runs_line}", ""]
    return "\n".join(lines)


def _split_calls(calls, chunks, ad, kind):
    """How many network calls each chunk run made (decode: stop - warm_start; encode: groups + replay)."""
    out = []
    for c in chunks:
        if kind == "decode":
            out.append(c.stop - c.warm_start)
        else:
            out.append(c.stop - c.warm_start + (1 if c.warm_start > 0 else 0))
    if sum(out) != len(calls):
        raise RuntimeError(f"expected {sum(out)} network calls for {chunks}, timed {len(calls)}")
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(p)
    p.add_argument("--no-both-stock", dest="both_stock", action="store_false")
    p.add_argument("--pin", action="store_true", help="bind rank r to CPU core r (baseline and parallel alike)")
    args = p.parse_args(argv)
    args.kinds = args.kinds.split(",")
    load0 = os.getloadavg()[0]
    per_rank = run_two_ranks(_rank, args, "lb_bench_vae_ph_")
    print(f"load average before / after: {load0:.2f} / {os.getloadavg()[0]:.2f}; trained small Wan VAE, fp32, "
          f"{args.latent_frames} latent frames -> {1 + 4 * (args.latent_frames - 1)} x {args.height} x {args.width}; "
          f"2 gloo ranks x 1 thread; {_setup_desc(args)}; medians of {args.repeats} interleaved repeats; times in s\n")
    print(report(per_rank, args))


if __name__ == "__main__":
    main()
