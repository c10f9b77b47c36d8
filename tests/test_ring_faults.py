"""Ring attention faults: a rank that dies or hangs mid-ring makes the others raise within timeout_s.

Ranks are plain subprocesses with the torchrun variables (tests/_dist_utils.launch_fault_workers), so
nothing but lite_boost's own timeouts can end a healthy rank. The healthy ranks' error must name the
collective ('ring_kv'), the group (ring, its global ranks) and the seconds waited.
"""

import os
import re
import time

import pytest

from _dist_utils import HERE, launch_fault_workers, stop_workers

WORKER = os.path.join(HERE, "_dist_ring_fault_worker.py")
TIMEOUT_S = 4.0


def _run(mode, world, faulty, limit):
    procs = launch_fault_workers(WORKER, mode, world, faulty, TIMEOUT_S)
    start = time.monotonic()
    try:
        codes, logs = {}, {}
        for r, p in enumerate(procs):
            if r == faulty and mode == "hang":
                continue
            try:
                out, _ = p.communicate(timeout=max(0.1, limit - (time.monotonic() - start)))
            except Exception:  # noqa: BLE001 - still running: a hang
                p.kill()
                out, _ = p.communicate(timeout=10)
                codes[r] = None
            else:
                codes[r] = p.returncode
            logs[r] = out
        return codes, logs
    finally:
        stop_workers(procs)


def test_healthy_ring_exits_zero():
    codes, logs = _run("ok", 3, -1, 120)
    assert all(c == 0 for c in codes.values()), (codes, logs)


@pytest.mark.parametrize("mode, world", [("die", 2), ("hang", 3)])
def test_faulty_rank_mid_ring_makes_the_others_raise_naming_the_collective(mode, world):
    faulty = 1
    codes, logs = _run(mode, world, faulty, 90 + TIMEOUT_S)  # start-up + the timeout + slack on a loaded machine
    for r in range(world):
        if r == faulty:
            continue
        assert codes[r] is not None, f"rank {r} still running after a {mode} fault (hang)"
        assert codes[r] != 0, (r, logs[r][-2000:])
        m = re.search(r"CollectiveError: collective '(\w+)' on the ring group \(global ranks \[([\d, ]+)\], this rank "
                      r"(\d) of (\d)\) failed after ([\d.]+)s", logs[r])
        assert m, logs[r][-3000:]
        assert m.group(1) == "ring_kv" and m.group(2) == ", ".join(str(i) for i in range(world))
        assert int(m.group(3)) == r and int(m.group(4)) == world
        waited = float(m.group(5))
        if mode == "hang":  # the wait ends at the timeout, not before, not much after
            assert TIMEOUT_S - 0.5 <= waited <= 3 * TIMEOUT_S, waited
        else:  # a dead peer closes the connection: no need to wait for the timeout
            assert waited <= 3 * TIMEOUT_S, waited
