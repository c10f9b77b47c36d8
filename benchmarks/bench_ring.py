"""Ring attention / USP benchmark: ours vs diffusers' ring and Ulysses on gloo, and the comm volume at scale.

    flock /tmp/lite_boost_cpu.lock python benchmarks/bench_ring.py --part timing    # 2 processes (~3 min)
    python benchmarks/bench_ring.py --part volume                                  # 8 processes, counted bytes
    python benchmarks/bench_ring.py --part timing --quick                          # small shape, one round

Tables (markdown, printed and written to benchmarks/results/ring_*.md):

1. timing: one transformer forward of the same small-but-wide Wan transformer (2 layers, 6 heads x
   128, fp32, 1 thread per process) and shape, at 1 process and at 2 gloo processes: lite_boost's
   Ulysses, Ring (p2p, overlapped) and Ring (allgather), diffusers' Ulysses
   (``ContextParallelConfig(ulysses_degree=2)``) and diffusers' ring (``ring_degree=2``). Every
   variant lives in the same two processes and the calls rotate (each round calls every variant once,
   in a rotating order), so they share the machine's load; medians over rounds. Reported: wall time
   (slowest rank), speed-up over one process (the boosted one for ours, stock diffusers for theirs),
   peak memory growth per rank during the forward (peak RSS above the RSS at the call's start, glibc
   set to mmap every allocation of 1 MiB or more so freed tensors leave the RSS; busiest rank), the
   seconds our p2p ring spent blocked in ``wait()`` (communication not hidden behind compute), and
   the max abs difference from the one-process output.
   diffusers' ring does not run on CPU as shipped: its ``native`` backend raises ``Native attention
   does not support return_lse=True`` and ``_native_flash`` calls
   ``aten._scaled_dot_product_flash_attention``, which has no CPU kernel (the errors are reproduced
   and printed). The table runs it with a small patch: diffusers' ``_native_flash`` forward op served
   by aten's CPU flash kernel (``_scaled_dot_product_flash_attention_for_cpu``, same outputs, with
   the log-sum-exp), everything else (its all_gather of K/V, its loop, its merge) unchanged; its
   Ulysses runs with the ``torch.accelerator.device_count`` patch of bench_parallel.py.
2. volume: bytes each rank sends per self-attention layer, counted by the communicators during one
   Ulysses / Ring / USP attention call on 8 gloo processes at a scaled-down shape (no padding), then
   scaled linearly (the volume is S x H x D x bytes times a layout factor) to Wan2.1-14B at 720p
   (75,600 tokens, 40 heads x 128, bf16), next to the formulas of the design notes.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
RESULTS = os.path.join(ROOT, "benchmarks", "results")

SHAPE = (6, 128, 2, 3072, (4, 33, 39))  # heads, head_dim, layers, ffn, latent grid: 5,148 tokens
QUICK_SHAPE = (6, 128, 2, 3072, (2, 22, 26))  # 1,144 tokens
VARIANTS_1 = ("ours", "diffusers")
VARIANTS_2 = ("ours_ulysses", "ours_ring_p2p", "ours_ring_allgather", "diffusers_ulysses", "diffusers_ring")


# ---------------------------------------------------------------------------------------- memory
def _mmap_big_allocations() -> None:
    """glibc: every allocation >= 1 MiB is its own mmap (no dynamic threshold), so a freed tensor leaves
    the RSS and the RSS tracks live memory."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


class PeakGrowth:
    """Peak RSS growth over a with-block: the kernel's high-water mark (VmHWM), reset at entry."""

    def __enter__(self):
        import gc

        gc.collect()
        try:
            import ctypes

            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):
            pass
        with open("/proc/self/clear_refs", "w") as fh:  # resets VmHWM to the current RSS
            fh.write("5")
        self.base = self._status("VmRSS")
        return self

    @staticmethod
    def _status(key: str) -> int:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
        return 0

    def __exit__(self, *exc):
        self.growth = self._status("VmHWM") - self.base


# ---------------------------------------------------------------------------------------- diffusers
def diffusers_ring_cpu_patch():
    """Serve diffusers' ``_native_flash`` forward op with aten's CPU flash kernel (returns the lse)."""
    import torch
    from diffusers.models import attention_dispatch as ad

    def forward_op(ctx, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                   enable_gqa=False, return_lse=False, _save_ctx=True, _parallel_config=None):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), dropout_p, is_causal, scale=scale)
        out = out.transpose(1, 2).contiguous()
        lse = lse.transpose(1, 2).contiguous()
        return (out, lse) if return_lse else out

    ad._native_flash_attention_forward_op = forward_op


def diffusers_ring_errors(shape) -> list[str]:
    """Why diffusers' ring cannot run on CPU as shipped: the error of each CP-capable native backend."""
    from bench_parallel import launch

    status, res = launch(_diffusers_ring_error_worker, 2, shape, timeout=600)
    return res[0] if status == "ok" else [f"launch failed: {res}"]


def _diffusers_ring_error_worker(rank, world, init_method, shape):
    import datetime

    import torch
    import torch.distributed as dist
    from diffusers import ContextParallelConfig

    from bench_parallel import _build

    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    torch.accelerator.device_count = lambda: 1
    small = (shape[0], 16, 1, 64, (2, 4, 4))
    errors = []
    for backend in ("native", "_native_flash"):
        model, (x, t, ctx) = _build(small)
        model.set_attention_backend(backend)
        model.enable_parallelism(config=ContextParallelConfig(ring_degree=2))
        try:
            with torch.no_grad():
                model(x, t, ctx)
            errors.append(f"{backend}: runs")
        except Exception as exc:  # noqa: BLE001 - reported
            msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            errors.append(f"`{backend}`: {type(exc).__name__}: {msg[:160]}")
        dist.barrier()
    return errors


# ---------------------------------------------------------------------------------------- workers
def _wait_clock():
    """Wrap RingShift.wait to add up the seconds spent blocked in it (communication not hidden)."""
    from lite_boost.parallel import comm

    spent = [0.0]
    inner = comm.RingShift.wait

    def wait(self):
        t0 = time.perf_counter()
        try:
            return inner(self)
        finally:
            spent[0] += time.perf_counter() - t0

    comm.RingShift.wait = wait
    return spent


def timing_worker(rank, world, init_method, shape, rounds):
    _mmap_big_allocations()
    import datetime

    import torch
    import torch.distributed as dist

    import lite_boost
    from bench_parallel import _build

    models = {}
    if world == 1:
        models["ours"], (x, t, ctx) = _build(shape)
        lite_boost.boost(models["ours"])
        models["diffusers"], _ = _build(shape)
    else:
        from diffusers import ContextParallelConfig

        from lite_boost.parallel import ParallelManager, initialize_usp

        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=900))
        for name, par in (("ours_ulysses", {}), ("ours_ring_p2p", {"ring_degree": 2}),
                          ("ours_ring_allgather", {"ring_degree": 2, "rotate_method": "allgather"})):
            models[name], (x, t, ctx) = _build(shape)
            mesh = initialize_usp({"parallel": dict(par, timeout_s=900)})
            ParallelManager(models[name], mesh=mesh)
        torch.accelerator.device_count = lambda: 1  # diffusers computes rank % device_count
        diffusers_ring_cpu_patch()
        models["diffusers_ulysses"], _ = _build(shape)
        models["diffusers_ulysses"].enable_parallelism(config=ContextParallelConfig(ulysses_degree=world))
        models["diffusers_ring"], _ = _build(shape)
        models["diffusers_ring"].set_attention_backend("_native_flash")
        models["diffusers_ring"].enable_parallelism(config=ContextParallelConfig(ring_degree=world))
    waited = _wait_clock()
    names = list(models)
    rec = {n: {"wall": [], "mem": [], "wait": []} for n in names}
    outs = {}
    with torch.no_grad():
        for rnd in range(rounds + 1):  # round 0 warms every variant up (not recorded)
            order = names[rnd % len(names):] + names[:rnd % len(names)]
            for name in order:
                if dist.is_initialized():
                    dist.barrier()
                waited[0] = 0.0
                with PeakGrowth() as mem:
                    t0 = time.perf_counter()
                    out = models[name](x, t, ctx, return_dict=False)[0]
                    dt = time.perf_counter() - t0
                outs[name] = out
                if rnd:
                    rec[name]["wall"].append(dt)
                    rec[name]["mem"].append(mem.growth)
                    rec[name]["wait"].append(waited[0])
    return rec, ({n: o for n, o in outs.items()} if rank == 0 else None)


def timing_table(shape, rounds):
    from bench_parallel import _md, launch

    res = {}
    for world in (1, 2):
        status, out = launch(timing_worker, world, shape, rounds)
        if status != "ok":
            raise RuntimeError(f"timing run at {world} process(es) failed: {out}")
        res[world] = out
    one = res[1][0][0]
    ref = res[1][0][1]["ours"]
    ref_stock = res[1][0][1]["diffusers"]
    rows = []
    base = {"ours": statistics.median(one["ours"]["wall"]), "diffusers": statistics.median(one["diffusers"]["wall"])}
    for name, label in (("ours", "lite_boost, 1 process"), ("diffusers", "stock diffusers, 1 process")):
        rows.append([label, f"{base[name]:.3f}", "1.00x", f"{base['ours'] / base[name]:.2f}x",
                     f"{statistics.median(one[name]['mem']) / 2**20:.1f}", "-",
                     "0" if name == "ours" else f"{(ref_stock - ref).abs().max().item():.1e}"])
    labels = {"ours_ulysses": "lite_boost Ulysses 2", "ours_ring_p2p": "lite_boost Ring 2 (p2p, overlapped)",
              "ours_ring_allgather": "lite_boost Ring 2 (allgather)",
              "diffusers_ulysses": "diffusers Ulysses 2 (device_count patch)",
              "diffusers_ring": "diffusers ring 2 (CPU flash-kernel patch)"}
    ranks = [r[0] for r in res[2]]
    for name in VARIANTS_2:
        wall = [max(v) for v in zip(*(r[name]["wall"] for r in ranks))]  # the slowest rank sets the call
        mem = max(statistics.median(r[name]["mem"]) for r in ranks)
        wait = max(statistics.median(r[name]["wait"]) for r in ranks)
        b = base["ours"] if name.startswith("ours") else base["diffusers"]
        diff = (res[2][0][1][name] - ref).abs().max().item()
        rows.append([labels[name], f"{statistics.median(wall):.3f}", f"**{b / statistics.median(wall):.2f}x**",
                     f"{base['ours'] / statistics.median(wall):.2f}x", f"{mem / 2**20:.1f}", f"{wait * 1e3:.1f}" if name.startswith("ours_ring_p2p") else "-", f"{diff:.1e}"])
    heads, head_dim, layers, _, grid = shape
    table = _md(["variant", "forward wall (s, median)", "speed-up vs its own 1 process",
                 "speed-up vs lite_boost 1 process", "peak memory growth per rank (MiB)",
                 "p2p wait (ms per forward)", "max abs diff vs lite_boost 1 proc"], rows)
    return table + (
        f"\n\n{layers} layers, {heads} heads x {head_dim}, {math.prod(grid):,} tokens, fp32, 1 thread per process; "
        f"{rounds} rounds, every variant once per round in a rotating order, in the same processes. Speed-up: ours vs "
        "lite_boost's one process, diffusers vs stock diffusers' one process.")


# ---------------------------------------------------------------------------------------- volume
LAYOUTS_8 = ((8, 1), (1, 8), (4, 2), (2, 4))
BIG = (75_600, 40, 128, 2)  # Wan2.1-14B 720p: tokens, heads, head_dim, bf16 bytes
SMALL = (8 * 48, 8, 16, 4)  # scaled down: tokens (no padding on 8 ranks), heads (divisible by 8), head_dim, fp32


def volume_worker(rank, world, init_method):
    import torch

    from lite_boost.models.wan import DenseAttention
    from lite_boost.parallel import SequenceShardInfo, initialize_usp
    from lite_boost.parallel.ring import sequence_parallel_attention

    S, H, D, _ = SMALL
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, S, H, D, generator=g) for _ in range(3))
    out = {}
    for u, r in LAYOUTS_8:
        mesh = initialize_usp({"parallel": {"ulysses_degree": u, "ring_degree": r, "timeout_s": 600}},
                              init_method=init_method)
        info = SequenceShardInfo(world)
        info.set(S)
        ql, kl, vl = (mesh.sequence.shard(x, 1) for x in (q, k, v))
        uly, ring = mesh.ulysses.enable_stats(), mesh.ring.enable_stats()
        uly.reset()
        ring.reset()
        sequence_parallel_attention(DenseAttention(), mesh.ulysses, mesh.ring, info)(ql, kl, vl)
        out[(u, r)] = {"ulysses": uly.bytes_sent.get("qkv_to_heads", 0) + uly.bytes_sent.get("heads_to_seq", 0),
                       "ring": ring.bytes_sent.get("ring_kv", 0)}
        mesh.ulysses.stats = mesh.ring.stats = None
    return out


def volume_table():
    from bench_parallel import _md, launch

    from lite_boost.parallel.ring import usp_bytes_per_layer

    status, res = launch(volume_worker, 8, timeout=1200)
    if status != "ok":
        raise RuntimeError(f"volume run failed: {res}")
    S, H, D, b = SMALL
    scale = (BIG[0] * BIG[1] * BIG[2] * BIG[3]) / (S * H * D * b)
    rows = []
    for u, r in LAYOUTS_8:
        per_rank = [x[(u, r)] for x in res]
        uly = max(p["ulysses"] for p in per_rank) * scale / 1e6
        ring = max(p["ring"] for p in per_rank) * scale / 1e6
        spread = max(p["ulysses"] + p["ring"] for p in per_rank) - min(p["ulysses"] + p["ring"] for p in per_rank)
        f = usp_bytes_per_layer(*BIG[:3], u, r, element_size=BIG[3])
        name = {(8, 1): "Ulysses 8", (1, 8): "Ring 8", (4, 2): "USP 4 x 2", (2, 4): "USP 2 x 4"}[(u, r)]
        rows.append([name, f"{uly:.0f}", f"{ring:.0f}", f"{uly + ring:.0f}", f"{f['total'] / 1e6:.0f}",
                     "all_to_all (exposed)" if r == 1 else ("p2p, overlapped with compute" if u == 1 else
                                                            "all_to_all inside a node + p2p across, overlapped"),
                     "yes" if spread == 0 else f"no ({spread} B)"])
    return _md(["layout (8 ranks)", "Ulysses MB / rank / layer", "Ring MB / rank / layer", "total MB", "formula MB",
                "what moves", "equal on every rank"], rows) + (
        f"\n\nCounted on 8 gloo processes during one attention call at {S} tokens x {H} heads x {D} (fp32), scaled "
        f"by {scale:,.1f} = (75,600 x 40 x 128 x 2 B) / ({S} x {H} x {D} x 4 B) to Wan2.1-14B at 720p in bf16; "
        "formulas: Ulysses 4(u-1)/(u^2 r) S H D b, Ring 2(r-1)/(u r) S H D b (design notes, section 10).")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=["timing", "volume", "errors"], required=True)
    ap.add_argument("--quick", action="store_true", help="small shape, one round")
    ap.add_argument("--rounds", type=int, default=None)
    args = ap.parse_args()
    os.makedirs(RESULTS, exist_ok=True)
    import torch

    load = os.getloadavg()[0]
    head = (f"torch {torch.__version__}, gloo on CPU, {os.cpu_count()} cores (load average {load:.1f} at start)")
    suffix = "_quick" if args.quick else ""
    if args.part == "timing":
        shape = QUICK_SHAPE if args.quick else SHAPE
        rounds = args.rounds or (1 if args.quick else 3)
        errors = diffusers_ring_errors(shape)
        text = (f"## Ring attention at 2 processes vs diffusers\n\n{head}.\n\n{timing_table(shape, rounds)}\n\n"
                "diffusers' ring as shipped, on CPU (2 gloo processes, same model): " + "; ".join(errors) + "\n")
    elif args.part == "errors":
        text = "diffusers' ring on CPU: " + "; ".join(diffusers_ring_errors(QUICK_SHAPE)) + "\n"
    else:
        text = f"## Comm volume per self-attention layer, Wan2.1-14B 720p, 8 ranks\n\n{head}.\n\n{volume_table()}\n"
    print("\n" + text)
    with open(os.path.join(RESULTS, f"ring_{args.part}{suffix}.md"), "w") as fh:
        fh.write(text)


if __name__ == "__main__":
    main()
