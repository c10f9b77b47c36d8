"""The import layering of pyproject.toml's import-linter contracts holds (and can fail)."""

import ast
import os
import subprocess
import sys

import pytest

from _dist_utils import ROOT

importlinter = pytest.importorskip("importlinter", reason="import-linter is in the test extra")


def _lint(config: str, cwd: str):
    env = dict(os.environ, PYTHONPATH=ROOT)
    code = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"
    return subprocess.run([sys.executable, "-c", code, config, "--no-cache", "--no-logo"], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def test_import_contracts_are_kept():
    res = _lint(os.path.join(ROOT, "pyproject.toml"), ROOT)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "0 broken" in res.stdout, res.stdout


def test_a_broken_contract_is_reported(tmp_path):
    """The checker really looks: a contract the code breaks (parallel may not import ops) fails."""
    (tmp_path / "contracts.toml").write_text(
        '[tool.importlinter]\nroot_package = "lite_boost"\n\n'
        '[[tool.importlinter.contracts]]\nname = "parallel imports no ops"\ntype = "forbidden"\n'
        'source_modules = ["lite_boost.parallel"]\nforbidden_modules = ["lite_boost.ops"]\n')
    res = _lint(str(tmp_path / "contracts.toml"), str(tmp_path))
    assert res.returncode != 0 and "BROKEN" in res.stdout, res.stdout + res.stderr


def test_ops_import_no_torch_distributed():
    """ops/ knows nothing of torch.distributed (import-linter cannot forbid a subpackage of an external one)."""
    ops = os.path.join(ROOT, "lite_boost", "ops")
    offenders = []
    for name in sorted(os.listdir(ops)):
        if not name.endswith(".py"):
            continue
        tree = ast.parse(open(os.path.join(ops, name), encoding="utf-8").read())
        for node in ast.walk(tree):
            mods = ([a.name for a in node.names] if isinstance(node, ast.Import)
                    else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{name}: {m}" for m in mods if m == "torch.distributed" or m.startswith("torch.distributed.")]
    assert offenders == []
