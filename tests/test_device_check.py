"""The prepared accelerator check (scripts/device_check.sh) runs end to end as a dry run on the CPU."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_device_check_dry_run(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable, PYTHONPATH=str(ROOT))
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "device_check.sh"), "--dry-run"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    steps = (tmp_path / "steps.md").read_text()
    for name in ("env", "tests", "dispatch", "flex", "wan", "fp8", "rope"):
        assert f"- step `{name}`: rc=0" in steps, steps
    report = (tmp_path / "device_check.md").read_text()
    for heading in ("### dense attention dispatch", "### block-sparse (gather) vs SDPA", "### Wan transformer parity",
                    "### fp8 vs bf16"):
        assert heading in report, report
    assert "fp8 refused here, as documented" in report and "| int8_dynamic |" in report
    assert "| float32 | boost dense |" in report and "tests collected" in (tmp_path / "tests.log").read_text()
    assert (tmp_path / "rope.md").exists()
