"""Parallel VAE speed and memory: 2 processes x 1 thread vs 1 process x 1 thread, plus a Wan2.1 model.

    flock /tmp/lite_boost_cpu.lock python benchmarks/bench_vae.py --height 128 --width 128 --repeats 3
    flock /tmp/lite_boost_cpu.lock python benchmarks/bench_vae.py --vae wan2.2-5b --latent-frames 3 --kinds decode

``--vae small`` (default): the small trained Wan VAE of the seam study (random weights if absent).
``--vae wan2.2-5b``: the 48-channel VAE of Wan2.2-TI2V-5B at its released size (base_dim 160, decoder
base_dim 256, z_dim 48, residual up / down blocks, patch 2, 16x spatial; 705 M parameters), random
weights, decoding random latents.

Two gloo ranks are spawned. Each repeat, for each mode (exact, chunked at the adapter's default
overlap) and each call (decode of 21 latent frames, encode of the 81-frame video):
rank 0 runs the stock sequential call while rank 1 waits in a barrier (the 1 x 1 baseline), then both
run the parallel call (the 2 x 1 run; its time is the slower rank's). Runs are interleaved and the
medians and their ratio are reported, with the peak resident-memory growth of each rank during
the call (sampled every 5 ms), the bytes each rank sent and the collectives issued.

``--model-only`` prints the Wan2.1-VAE estimate alone: FLOPs of the real Wan2.1 VAE config at
480x832x81 counted on the meta device, the exact mode's halo bytes from the shapes its hooks see,
and an explicitly assumed accelerator (sustained conv throughput, link bandwidth, collective
latency) -> modelled decode time on 1, 2, 4, 8 devices. It is a model, not a measurement.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))
WEIGHTS = os.path.join(ROOT, "tests", "data", "wan_vae_small")
# AutoencoderKLWan of Wan-AI/Wan2.2-TI2V-5B-Diffusers (vae/config.json; latents_mean / std left at the
# defaults: they do not enter decode / encode)
WAN22_5B_VAE = dict(base_dim=160, decoder_base_dim=256, z_dim=48, dim_mult=[1, 2, 4, 4], num_res_blocks=2,
                    attn_scales=[], temperal_downsample=[False, True, True], dropout=0.0, is_residual=True,
                    in_channels=12, out_channels=12, patch_size=2, scale_factor_spatial=16, scale_factor_temporal=4)
VAES = ("small", "wan2.2-5b")


def build_vae(args):
    """The benchmarked VAE: ``args.vae`` "small" (trained weights if present) or "wan2.2-5b" (random)."""
    from diffusers import AutoencoderKLWan

    torch.manual_seed(0)
    if args.vae == "wan2.2-5b":
        return AutoencoderKLWan(**WAN22_5B_VAE).eval()
    if os.path.exists(os.path.join(args.weights, "config.json")):
        return AutoencoderKLWan.from_pretrained(args.weights).eval()
    from train_small_wan_vae import SMALL_WAN_VAE

    return AutoencoderKLWan(**SMALL_WAN_VAE).eval()


def vae_desc(args) -> str:
    if args.vae == "wan2.2-5b":
        return "Wan2.2-TI2V-5B VAE (48 channels, released size, random weights; random latents)"
    return f"small trained Wan VAE ({os.path.relpath(args.weights, ROOT)})"


# ------------------------------------------------------------------------------------------ memory
def _rss() -> int:
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def _trim() -> None:
    """Hand freed heap pages back to the OS (glibc) so RSS growth reflects the next call's own peak."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class PeakRSS:
    """Peak RSS growth (bytes) over a with-block, sampled by a thread (freed heap trimmed first)."""

    def __init__(self, trim: bool = True):
        self.trim = trim  # False under --malloc keep (trimming would hand the kept memory back)

    def __enter__(self):
        import gc

        gc.collect()
        if self.trim:
            _trim()
        self.base = self.peak = _rss()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self):
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, _rss())

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, _rss())
        self.growth = self.peak - self.base


def _setup_process(rank, args):
    """Per-rank process setup shared by the baseline and the parallel runs (so both get it):
    ``--pin`` binds rank r to CPU core r (one core per rank, as an HPC launcher would; ``--pin both``
    alternates unpinned and pinned repeats, see ``_set_pin``);
    ``--malloc keep`` stops glibc from returning freed memory to the OS (no mmap'd chunks, no
    trimming), so a call's big temporaries (slow_conv3d's im2col buffers) are not page-faulted
    afresh every time."""
    args.all_cores = sorted(os.sched_getaffinity(0))
    if args.malloc == "keep":
        keep_freed_memory()


def keep_freed_memory() -> None:
    """glibc: no mmap'd chunks and no trimming, so freed memory stays with the process."""
    import ctypes

    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]  # int mallopt(int param, int value)
    m_trim_threshold, m_mmap_max = -1, -4
    if not (libc.mallopt(m_mmap_max, 0) and libc.mallopt(m_trim_threshold, 2**31 - 1)):
        raise SystemExit("mallopt failed")


def run_two_ranks(rank_fn, args, prefix: str) -> list:
    """Spawn ``rank_fn(rank, 2, init_file, args, tmpdir)`` on 2 processes; return what each rank pickled
    to ``tmpdir/rank<r>.pkl``."""
    import pickle

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        init_file = os.path.join(tmp, "rdzv")
        procs = [ctx.Process(target=rank_fn, args=(r, 2, init_file, args, tmp)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        if any(p.exitcode for p in procs):
            raise SystemExit(f"a rank failed: exit codes {[p.exitcode for p in procs]}")
        per_rank = []
        for r in range(2):
            with open(os.path.join(tmp, f"rank{r}.pkl"), "rb") as fh:
                per_rank.append(pickle.load(fh))
    return per_rank


def _set_pin(rank, args, on: bool) -> None:
    """Bind this rank to its own core (on) or let it run on every core it started with (off)."""
    cores = args.all_cores
    os.sched_setaffinity(0, {cores[rank % len(cores)]} if on else set(cores))


def _pin_states(args) -> list:
    return {"no": [False], "yes": [True], "both": [False, True]}[args.pin]


def _setup_desc(args) -> str:
    pin = {"no": "ranks not pinned", "yes": "ranks pinned to one core each",
           "both": "each repeat unpinned, then with ranks pinned to one core each (interleaved)"}[args.pin]
    return (pin + "; glibc malloc "
            + ("keeping freed memory (mmap off, no trim)" if args.malloc == "keep" else "defaults"))


# ------------------------------------------------------------------------------------------ rank body
def _rank(rank, world, init_file, args, out_dir):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    _setup_process(rank, args)
    import torch.distributed as dist
    from train_small_wan_vae import procedural_video

    from lite_boost.parallel.groups import init_mesh
    from lite_boost.parallel.vae import parallelize_vae, unparallelize_vae

    mesh = init_mesh({"timeout_s": 1800}, init_method="file://" + init_file)
    vae = build_vae(args)
    frames = 1 + 4 * (args.latent_frames - 1)
    video = procedural_video(torch.Generator().manual_seed(5), frames, args.height, args.width).unsqueeze(0)
    z_dim, scale = vae.config.z_dim, vae.spatial_compression_ratio
    random_latents = args.random_latents or args.vae == "wan2.2-5b"
    with torch.no_grad():
        z = vae._encode(video)[:, :z_dim].contiguous() if not random_latents else None
    if z is None:
        z = torch.randn(1, z_dim, args.latent_frames, args.height // scale, args.width // scale,
                        generator=torch.Generator().manual_seed(6))
    calls = {"decode": lambda: vae.decode(z).sample, "encode": lambda: vae.encode(video).latent_dist.mean}
    res = []
    stats = mesh.world.enable_stats()
    with torch.no_grad():
        for rep, pin in ((r, p) for r in range(args.repeats) for p in _pin_states(args)):
            _set_pin(rank, args, pin)
            for kind in args.kinds:
                dist.barrier()
                base_t = base_mem = base_cpu = None
                if rank == 0:  # the 1 x 1 baseline: stock sequential call, rank 1 waits in the barrier
                    with PeakRSS(trim=args.malloc != "keep") as m:
                        t0, c0 = time.perf_counter(), time.process_time()
                        ref = calls[kind]()
                        base_t, base_cpu = time.perf_counter() - t0, time.process_time() - c0
                    base_mem = m.growth
                dist.barrier()
                for mode, overlap in args.runs:
                    runner = parallelize_vae(vae, mesh.world, mode=mode, overlap=overlap)
                    stats.reset()
                    dist.barrier()
                    with PeakRSS(trim=args.malloc != "keep") as m:
                        t0, c0 = time.perf_counter(), time.process_time()
                        out = calls[kind]()
                        par_t, par_cpu = time.perf_counter() - t0, time.process_time() - c0
                    dist.barrier()
                    sent = sum(stats.bytes_sent.values())
                    ncoll = sum(stats.calls.values())
                    unparallelize_vae(vae)
                    diff = (out - ref).abs().max().item() if rank == 0 else None
                    res.append(dict(rep=rep, pin=pin, mode=mode, kind=kind, base_t=base_t, base_mem=base_mem, par_t=par_t,
                                    base_cpu=base_cpu, par_cpu=par_cpu,
                                    par_mem=m.growth, sent=sent, collectives=ncoll,
                                    overlap=runner.overlap_for(kind) if mode == "chunked" else None, diff=diff,
                                    shape=tuple(out.shape)))
                    del out
    import pickle

    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as fh:
        pickle.dump(res, fh)
    dist.barrier()
    dist.destroy_process_group()


def measure(args):
    per_rank = run_two_ranks(_rank, args, "lb_bench_vae_")
    rows = []
    for mode, overlap, kind, pin in ((m, o, k, p) for m, o in args.runs for k in args.kinds for p in _pin_states(args)):
        def pick(rs):
            return [x for x in rs if x["mode"] == mode and x["kind"] == kind and x["pin"] == pin
                    and (overlap is None or x["overlap"] == overlap)]

        r0, r1 = pick(per_rank[0]), pick(per_rank[1])
        base = statistics.median(x["base_t"] for x in r0)
        par = statistics.median(max(a["par_t"], b["par_t"]) for a, b in zip(r0, r1))
        cpu_ratio = statistics.median(x["base_cpu"] for x in r0) / statistics.median(
            max(a["par_cpu"], b["par_cpu"]) for a, b in zip(r0, r1))
        rows.append(dict(mode=mode, kind=kind, pin=pin, base=base, par=par, speedup=base / par, cpu_ratio=cpu_ratio,
                         base_mem=max(x["base_mem"] for x in r0) / 2**20,
                         mem0=max(x["par_mem"] for x in r0) / 2**20, mem1=max(x["par_mem"] for x in r1) / 2**20,
                         sent=max(x["sent"] for x in r0 + r1) / 2**20, coll=r0[0]["collectives"],
                         overlap=r0[0]["overlap"], diff=max(x["diff"] for x in r0), shape=r0[0]["shape"],
                         runs=[(round(a["base_t"], 2), round(max(a["par_t"], b["par_t"]), 2)) for a, b in zip(r0, r1)]))
    return rows


# ------------------------------------------------------------------------------------------ Wan2.1 model
def wan21_model(args):
    """FLOPs and exact-mode halo bytes of the real Wan2.1 VAE decode at 480x832x81, on the meta device."""
    from diffusers import AutoencoderKLWan
    from torch.utils.flop_counter import FlopCounterMode

    from lite_boost.parallel.vae import vae_adapter_for

    with torch.device("meta"):
        vae = AutoencoderKLWan().eval()  # Wan2.1 config: base_dim 96, dim_mult [1, 2, 4, 4], z_dim 16
    ad = vae_adapter_for(vae)
    layout = ad.spatial_layout("decode")
    halo_elems = [0]

    rows_of = dict((id(m), r) for m, r in layout.halo)
    for first, second in layout.pairs:  # one exchange of both convs' rows before the first
        rows_of[id(first)] += rows_of[id(second)]
        rows_of[id(second)] = 0

    def pre(mod, a):
        x = a[0]
        rows = rows_of[id(mod)]
        per_row = x.numel() // x.shape[-2]
        cache = a[1] if len(a) > 1 and isinstance(a[1], torch.Tensor) else None
        if cache is not None:
            per_row += cache.numel() // cache.shape[-2]
        halo_elems[0] += 2 * rows * per_row  # one boundary: rows each way

    hs = [m.register_forward_pre_hook(pre) for m, _ in layout.halo]
    h, w, n = 60, 104, 21
    z = torch.empty(1, 16, n, h, w, device="meta")
    fc = FlopCounterMode(display=False)
    with torch.no_grad(), fc:
        vae._decode(z)
    for hh in hs:
        hh.remove()
    flops = fc.get_total_flops()
    dec_frames = 1 + 4 * (n - 1)
    video_bytes = 3 * dec_frames * h * 8 * w * 8 * 2  # bf16 output
    # assumptions of the model (not measurements)
    tput = args.assume_tflops * 1e12
    bw = args.assume_gbps * 1e9
    lat = args.assume_latency_us * 1e-6
    # one all_to_all per frame call for each conv pair, other halo conv and stride-2 conv (1 row, not counted
    # in the bytes above: < 1%)
    n_halo_colls = (len(layout.halo) - len(layout.pairs) + len(layout.bottom_halo)) * n
    ov = ad.default_overlap
    lines = [f"Wan2.1 VAE decode, 480x832, 81 frames (21 latent frames), bf16: {flops / 1e12:.1f} TFLOP "
             f"(counted on the meta device); exact-mode halo rows sent by an inner rank {halo_elems[0] * 2 / 2**20:.0f} MiB "
             f"(bf16) in {n_halo_colls} all_to_alls; output video {video_bytes / 2**20:.0f} MiB.",
             f"Assumed device (a model, not a measurement): {args.assume_tflops:.0f} TFLOP/s sustained on these "
             f"convolutions, {args.assume_gbps:.0f} GB/s per link, {args.assume_latency_us:.0f} us per collective.",
             "", "| devices | exact: modelled s (speedup) | chunked overlap %d: modelled s (speedup) |" % ov, "|---|---|---|"]
    t1 = flops / tput
    for P in (1, 2, 4, 8):
        if P == 1:
            lines.append(f"| 1 | {t1:.2f} (1.00x) | {t1:.2f} (1.00x) |")
            continue
        # exact: compute / P (+ 2 halo rows per band per conv ignored: < 1% at 60 latent rows / 8),
        # each rank exchanges with 2 neighbours, one collective per conv per frame, gather of the video
        t_ex = t1 / P + halo_elems[0] * 2 / bw + n_halo_colls * lat + video_bytes * (P - 1) / P / bw
        # the adapter's chunk cost (a fresh call's first frame is cheap) of the busiest rank over the whole
        worst = max(ad.chunk_cost(c.warm_start, c.start, c.stop, "decode") for c in _plan(n, P, ov, ad))
        t_ch = t1 * worst / ad.chunk_cost(0, 0, n, "decode") + video_bytes * (P - 1) / P / bw + lat
        lines.append(f"| {P} | {t_ex:.2f} ({t1 / t_ex:.2f}x) | {t_ch:.2f} ({t1 / t_ch:.2f}x) |")
    return "\n".join(lines)


def _plan(n, P, ov, ad):
    from lite_boost.parallel.vae import plan_chunks

    return plan_chunks(n, P, overlap=ov, cost=ad.chunk_cost_fn("decode")).chunks


def add_common_args(p):
    """The arguments bench_vae.py and bench_vae_phases.py share: frame size, length, repeats, calls, weights, malloc."""
    p.add_argument("--height", type=int, default=128)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--latent-frames", type=int, default=21)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--kinds", default="decode,encode")
    p.add_argument("--weights", default=WEIGHTS)
    p.add_argument("--malloc", choices=["default", "keep"], default="default",
                   help="keep: glibc keeps freed memory (no page faults per call), in every run")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(p)
    p.add_argument("--modes", default="exact,chunked")
    p.add_argument("--overlaps", default="", help="chunked overlaps to run (default: the adapter's default)")
    p.add_argument("--pin", nargs="?", const="yes", default="no", choices=["no", "yes", "both"],
                   help="bind rank r to CPU core r (baseline and parallel alike); both: alternate unpinned and "
                        "pinned repeats in the same processes")
    p.add_argument("--vae", choices=VAES, default="small",
                   help="small: the trained small Wan VAE; wan2.2-5b: Wan2.2-TI2V-5B's VAE, released size, random")
    p.add_argument("--random-latents", action="store_true", help="decode random latents instead of encoded video")
    p.add_argument("--model-only", action="store_true")
    p.add_argument("--assume-tflops", type=float, default=100.0)
    p.add_argument("--assume-gbps", type=float, default=50.0)
    p.add_argument("--assume-latency-us", type=float, default=30.0)
    args = p.parse_args(argv)
    args.modes = args.modes.split(",")
    ovs = [int(v) for v in args.overlaps.split(",") if v] or [None]
    args.runs = [(m, o) for m in args.modes for o in (ovs if m == "chunked" else [None])]
    args.kinds = args.kinds.split(",")
    if not args.model_only:
        args.load_before = f"{os.getloadavg()[0]:.2f}"
        rows = measure(args)
        print(f"load average before / after: {args.load_before} / {os.getloadavg()[0]:.2f}; "
              f"{vae_desc(args)}, fp32, {args.latent_frames} latent frames -> "
              f"{1 + 4 * (args.latent_frames - 1)} x {args.height} x {args.width} video; 1 process x 1 thread vs "
              f"2 processes x 1 thread (gloo); {_setup_desc(args)}; median of {args.repeats} interleaved runs\n")
        print("| mode | call | 1x1 s | 2x1 s | speedup | max abs diff vs 1x1 | peak RSS growth MiB 1x1 / r0 / r1 "
              "| MiB sent per rank | collectives | CPU-time ratio |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            mode = r["mode"] + (f" (overlap {r['overlap']})" if r["overlap"] else "")
            mode += " (default)" if r["mode"] == "chunked" and not args.overlaps else ""
            mode += (", pinned" if r["pin"] else ", not pinned") if args.pin == "both" else ""
            print(f"| {mode} | {r['kind']} | {r['base']:.2f} | {r['par']:.2f} | {r['speedup']:.2f}x | {r['diff']:.1e} | "
                  f"{r['base_mem']:.0f} / {r['mem0']:.0f} / {r['mem1']:.0f} | {r['sent']:.1f} | {r['coll']} | "
                  f"{r['cpu_ratio']:.2f}x |")
        print("\nruns (1x1 s, 2x1 s):", {f"{r['mode']}{r['overlap'] or ''}/{r['kind']}" + ("/pinned" if r["pin"] else ""): r["runs"]
                                         for r in rows})
    print()
    print(wan21_model(args))


if __name__ == "__main__":
    main()
