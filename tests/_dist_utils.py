"""Launch small gloo process groups for tests.

``run_ranks(fn, world_size, *args)`` starts ``world_size`` spawned processes, each calling
``fn(rank, world_size, init_method, *args)`` with the torchrun variables set (RANK, LOCAL_RANK,
WORLD_SIZE) and a private ``file://`` rendezvous, so parallel pytest workers never collide on ports.
It returns the per-rank return values (pickled through files) and raises with every failing rank's
traceback. A hard deadline kills stragglers (only the processes it started) so a test never hangs.
"""

from __future__ import annotations

import os
import pickle
import socket
import subprocess
import sys
import tempfile
import time
import traceback

import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn, rank, world_size, init_method, out_dir, args, threads):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    os.environ.pop("MASTER_ADDR", None)
    os.environ.pop("MASTER_PORT", None)
    import torch

    torch.set_num_threads(threads)
    path = os.path.join(out_dir, f"rank{rank}.pkl")
    try:
        result = fn(rank, world_size, init_method, *args)
        payload = ("ok", result)
    except BaseException:  # noqa: BLE001 - reported to the parent
        payload = ("error", traceback.format_exc())
    with open(path + ".tmp", "wb") as fh:
        pickle.dump(payload, fh)
    os.replace(path + ".tmp", path)
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            if payload[0] == "ok":
                dist.barrier()  # let every peer finish before tearing gloo down
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass
    sys.exit(0 if payload[0] == "ok" else 1)


def run_ranks(fn, world_size: int, *args, timeout: float = 240.0, threads: int = 1):
    """Run ``fn(rank, world_size, init_method, *args)`` on ``world_size`` gloo ranks; return results."""
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="lb_dist_") as tmp:
        init_method = "file://" + os.path.join(tmp, "rendezvous")
        procs = [
            ctx.Process(target=_entry, args=(fn, r, world_size, init_method, tmp, args, threads), daemon=False)
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for r in hung:
            procs[r].kill()
            procs[r].join(5)
        results, errors = [], []
        for r in range(world_size):
            path = os.path.join(tmp, f"rank{r}.pkl")
            if os.path.exists(path):
                with open(path, "rb") as fh:
                    status, value = pickle.load(fh)
            else:
                status, value = "error", f"no result (exit code {procs[r].exitcode})"
            if status != "ok":
                errors.append(f"--- rank {r} ---\n{value}")
            results.append(value)
        if hung:
            errors.insert(0, f"ranks {hung} still running after {timeout}s were killed")
        if errors:
            raise AssertionError("distributed test failed:\n" + "\n".join(errors))
        return results


def launch_fault_workers(worker: str, mode: str, world: int, faulty: int, timeout_s: float):
    """Start ``world`` torchrun-style processes of the script ``worker`` (rank env, a free port, one
    thread each) with arguments ``mode faulty timeout_s``; output captured. Returns the Popen list."""
    port = free_port()
    procs = []
    for r in range(world):
        env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
        procs.append(subprocess.Popen([sys.executable, worker, mode, str(faulty), str(timeout_s)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    return procs


def stop_workers(procs) -> None:
    """Kill the still-running processes of ``launch_fault_workers`` and reap every one (output drained)."""
    for p in procs:
        if p.poll() is None:
            p.kill()
        try:
            p.communicate(timeout=10)
        except Exception:  # noqa: BLE001 - already reaped or unkillable: nothing more to do
            pass


def parallel_record(model, mesh, got, ref, seen, stats) -> dict:
    """The per-case record the family parallel-parity tests share: the output's max abs difference from
    the one-process reference, what the hooked block saw, the collectives counted by ``stats``, the CFG
    split's counters, the sparse paths taken, and the mesh's degrees."""
    import math

    extras = model._lite_boost.extras
    par, sparse = extras.get("parallel"), extras.get("sparse")
    return {
        "maxdiff": (got - ref).abs().max().item() if got.shape == ref.shape else math.inf,
        "ref_abs": ref.abs().max().item(),
        "seen": sorted(set(seen)),
        "calls": dict(stats.calls),
        "cfg_calls": dict(par.cfg.calls) if par is not None and par.cfg is not None else None,
        "sparse_paths": sorted({e.path for e in sparse.events}) if sparse is not None else None,
        "sparse_effective": sparse.mean_effective_sparsity() if sparse is not None else None,
        "sequence_degree": mesh.sequence_degree,
        "ring_degree": mesh.ring_degree,
    }
