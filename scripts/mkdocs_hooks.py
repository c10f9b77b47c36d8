"""MkDocs hooks for the lite_boost site (mkdocs.yml `hooks:`).

The benchmark figures live beside their data in benchmarks/results/; the site serves them as
``benchmarks/results/<name>.png`` without a copy in docs/, so a re-run benchmark updates the site and a
page that names a missing figure fails the strict build.
"""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File

RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results"


def on_files(files, config):
    for png in sorted(RESULTS.glob("*.png")):
        files.append(File.generated(config, f"benchmarks/results/{png.name}", abs_src_path=str(png)))
    return files
