"""The torchrun examples: one process (== boost) in-process, and 2 ranks under torchrun."""

import os
import subprocess
import sys

import pytest

from _dist_utils import ROOT
from conftest import LAUNCHER_ENV

EXAMPLES = os.path.join(ROOT, "examples")


@pytest.fixture
def examples_path(monkeypatch):
    for name in LAUNCHER_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.syspath_prepend(EXAMPLES)


def test_t2v_example_single_process(examples_path, tmp_path):
    import wan_t2v

    frames = wan_t2v.main(["--steps", "1", "--output", str(tmp_path / "t2v.gif")])
    assert (tmp_path / "t2v.gif").stat().st_size > 0


def test_example_rejects_bad_degrees(examples_path, tmp_path, monkeypatch):
    import wan_t2v

    monkeypatch.setenv("WORLD_SIZE", "2")
    from lite_boost.config import ConfigError

    with pytest.raises(ConfigError, match="valid sequence_degree"):
        wan_t2v.main(["--sequence-degree", "3", "--output", str(tmp_path / "x.gif")])
    assert not (tmp_path / "x.gif").exists()


@pytest.mark.slow
def test_i2v_example_under_torchrun_cfg2(tmp_path):
    out = tmp_path / "i2v.gif"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    for name in LAUNCHER_ENV:
        env.pop(name, None)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         os.path.join(EXAMPLES, "wan_i2v.py"), "--cfg-degree", "2", "--steps", "2", "--timeout", "120",
         "--output", str(out)],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    written = [line for line in proc.stdout.splitlines() if "->" in line]
    assert len(written) == 1 and written[0].startswith("[rank 0]"), proc.stdout  # only rank 0 writes
    assert out.stat().st_size > 0
