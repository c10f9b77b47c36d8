"""Faults and bad input: no hangs, clear errors before any collective.

A rank that raises, dies or stalls makes every other rank exit non-zero within the configured
collective timeout. Ranks are plain subprocesses launched with the torchrun variables (RANK,
LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), so nothing but lite_boost's own timeout handling
can end a healthy rank (no supervisor kills it).
"""

import os
import subprocess
import time

import pytest
import torch.distributed as dist

from lite_boost.config import ConfigError, ParallelConfig
from lite_boost.parallel import init_mesh

from _dist_utils import HERE, launch_fault_workers

WORKER = os.path.join(HERE, "_dist_fault_worker.py")
TIMEOUT_S = 4.0


def _launch(mode, world, faulty):
    return launch_fault_workers(WORKER, mode, world, faulty, TIMEOUT_S)


def _wait(procs, ranks, limit):
    """Wait for ``ranks`` to exit within ``limit`` seconds; returns {rank: (exit code, seconds)}."""
    start = time.monotonic()
    out = {}
    for r in ranks:
        try:
            procs[r].wait(timeout=max(0.1, limit - (time.monotonic() - start)))
        except subprocess.TimeoutExpired:
            pass
        out[r] = (procs[r].poll(), time.monotonic() - start)
    return out


def _cleanup(procs):
    for p in procs:
        if p.poll() is None:
            p.kill()
        try:
            p.communicate(timeout=10)
        except Exception:  # noqa: BLE001
            pass


def test_healthy_run_exits_zero():
    procs = _launch("ok", 2, -1)
    try:
        res = _wait(procs, [0, 1], 120)
        logs = [p.communicate()[0] for p in procs]
        assert all(code == 0 for code, _ in res.values()), (res, logs)
    finally:
        _cleanup(procs)


@pytest.mark.parametrize("mode, world", [("raise", 3), ("die", 3), ("hang", 3), ("pipe_raise", 3), ("pipe_die", 2),
                                         ("pipe_hang", 2)])
def test_faulty_rank_makes_others_exit_nonzero(mode, world):
    faulty = 1
    procs = _launch(mode, world, faulty)
    healthy = [r for r in range(world) if r != faulty]
    try:
        # start-up (imports, rendezvous) plus the collective timeout plus slack on a loaded machine
        res = _wait(procs, healthy, 90 + TIMEOUT_S)
        for r in healthy:
            code, _ = res[r]
            assert code is not None, f"rank {r} still running after a {mode} fault (hang)"
            assert code != 0, f"rank {r} exited 0 after a {mode} fault"
        if not mode.endswith("hang"):
            assert procs[faulty].wait(timeout=30) != 0
    finally:
        _cleanup(procs)


# ---------------------------------------------------------------- validation before any collective
def _env(world, **extra):
    env = {"WORLD_SIZE": str(world), "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    env.update(extra)
    return env


@pytest.mark.parametrize(
    "config, world, match",
    [
        (ParallelConfig(sequence_degree=3), 4, r"valid sequence_degree for this cfg_degree: \[4\]"),
        (ParallelConfig(cfg_degree=2), 3, r"valid cfg_degree values: \[1\]"),
        (ParallelConfig(cfg_degree=2, sequence_degree=1), 4, r"valid sequence_degree for this cfg_degree: \[2\]"),
    ],
)
def test_bad_degrees_fail_before_any_collective(config, world, match):
    with pytest.raises(ConfigError, match=match):
        init_mesh(config, env=_env(world))
    assert not dist.is_initialized()


def test_bad_config_values_name_the_field():
    with pytest.raises(ConfigError, match="cfg_degree must be one of"):
        ParallelConfig(cfg_degree=3)
    with pytest.raises(ConfigError, match="timeout_s"):
        ParallelConfig(timeout_s=0)
    with pytest.raises(ConfigError, match="backend must be one of"):
        ParallelConfig(backend="mpi")
    with pytest.raises(ConfigError, match="config must be"):
        init_mesh(42, env=_env(1))


def test_bad_environment_fails_clearly():
    with pytest.raises(ConfigError, match="WORLD_SIZE must be an integer"):
        init_mesh(None, env=_env("two"))
    with pytest.raises(ConfigError, match="RANK=5 must be < WORLD_SIZE=2"):
        init_mesh(None, env=_env(2, RANK="5"))
    env = _env(2)
    del env["MASTER_PORT"]
    with pytest.raises(ConfigError, match="MASTER_PORT not set"):
        init_mesh(None, env=env)
    with pytest.raises(ConfigError, match="valid device types for 'nccl'"):
        init_mesh(ParallelConfig(backend="nccl"), env=_env(2), device="cpu")
    assert not dist.is_initialized()


def test_world_size_one_needs_no_process_group():
    mesh = init_mesh(None, env={})
    assert mesh.world_size == 1 and mesh.sequence.size == 1 and mesh.cfg.size == 1 and not mesh.is_distributed
    assert not dist.is_initialized()
    mesh.destroy()
