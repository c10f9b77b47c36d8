"""The documentation: generated pages current, the site builds strictly, the README short and honest.

The strict build is what turns a broken link, a missing anchor, a page left out of the nav or an API
reference to a name that no longer exists into a failure (mkdocs.yml: ``strict`` + ``validation``).
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _gen_docs():
    spec = importlib.util.spec_from_file_location("gen_docs", ROOT / "scripts" / "gen_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _mkdocs_build(config_dir: Path, site_dir: Path) -> subprocess.CompletedProcess:
    for name in ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python"):
        pytest.importorskip(name, reason="the docs extra is not installed (pip install -e '.[docs]')")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site_dir)],
                          cwd=config_dir, env=env, capture_output=True, text=True, timeout=300)


def test_generated_pages_are_current():
    gen = _gen_docs()
    stale = gen.stale()
    assert not stale, f"stale generated documentation {stale}: run `python scripts/gen_docs.py`"


def test_generated_pages_follow_the_code():
    """The CLI page lists every option of the parser; the matrix has one row per registered family."""
    gen = _gen_docs()
    from lite_boost.cli import build_parser
    from lite_boost.registry import families

    cli = gen.render_cli()
    generate = build_parser()._subparsers._group_actions[0].choices["generate"]
    for action in generate._actions:
        if action.help == "show this help message and exit":
            continue
        for flag in action.option_strings:
            assert f"`{flag}`" in cli, flag
    matrix = gen.render_matrix()
    rows = [ln for ln in matrix.splitlines() if ln.startswith("| `")]
    assert [r.split("`")[1] for r in rows] == [f.name for f in families()]
    for fam, row in zip(families(), rows):
        cells = [c.strip() for c in row.strip("|").split("|")[1:]]
        assert cells == ["yes" if fam.supports(f) else "no" for f in fam.features], fam.name


def test_mkdocs_build_strict(tmp_path):
    result = _mkdocs_build(ROOT, tmp_path / "site")
    assert result.returncode == 0, result.stdout + result.stderr
    site = tmp_path / "site"
    # the figures are served from benchmarks/results/ by the hook, and the API page rendered docstrings
    assert (site / "benchmarks" / "results" / "dit_step.png").is_file()
    api = (site / "reference" / "api" / "index.html").read_text()
    assert "ParallelManager" in api and "sequence / CFG parallel" in api


def test_mkdocs_strict_build_fails_on_a_broken_anchor(tmp_path):
    """The site's validation settings are live: a link to a missing heading fails the build."""
    copy = tmp_path / "repo"
    copy.mkdir()
    shutil.copy(ROOT / "mkdocs.yml", copy)
    shutil.copytree(ROOT / "docs", copy / "docs")
    (copy / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "mkdocs_hooks.py", copy / "scripts")
    (copy / "lite_boost").symlink_to(ROOT / "lite_boost")
    (copy / "benchmarks").symlink_to(ROOT / "benchmarks")
    page = copy / "docs" / "hardware.md"
    page.write_text(page.read_text() + "\nSee [the caching guide](guides/caching.md#no-such-heading).\n")
    result = _mkdocs_build(copy, tmp_path / "site")
    assert result.returncode != 0
    assert "no-such-heading" in result.stdout + result.stderr


def test_every_benchmark_figure_is_in_the_docs():
    pages = "\n".join(p.read_text() for p in (ROOT / "docs").rglob("*.md"))
    shown = set(re.findall(r"results/([\w.-]+\.png)", pages))
    figures = {p.name for p in (ROOT / "benchmarks" / "results").glob("*.png")}
    assert figures - shown == set(), f"figures not on any docs page: {sorted(figures - shown)}"


def test_readme_is_short_and_links_into_the_docs():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.encode()) <= 15 * 1024, f"README.md is {len(readme.encode())} bytes; keep it <= 15 KB"
    # the README's test command is the one CI runs
    ci = (ROOT / ".ci" / "run").read_text()
    assert "bash scripts/test.sh" in ci.splitlines()[-1]
    quick = readme.split("## Quick start", 1)[1].split("```", 2)[1]
    assert "bash scripts/test.sh" in quick.splitlines()[2]
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme)
    assert any(link.startswith("docs/") for link in links)
    for link in links:
        if "://" not in link:
            assert (ROOT / link).exists(), f"README links to missing {link}"
