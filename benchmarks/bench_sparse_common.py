"""Shared helpers of the sparse-attention benchmarks: timing, grids, markdown tables."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"

# sequence length -> (t, h, w) latent grid used to lay the tokens out
GRIDS = {
    8192: (8, 32, 32),
    16384: (16, 32, 32),
    32760: (21, 30, 52),  # Wan2.1 480x832, 81 frames
}


def timed(fn):
    """Run ``fn`` once; return (seconds, result)."""
    t0 = time.perf_counter()
    res = fn()
    return time.perf_counter() - t0, res


def median(xs):
    return statistics.median(xs)


def environment() -> str:
    return (f"torch {torch.__version__}, {platform.machine()}, {torch.get_num_threads()} threads, "
            f"{os.cpu_count()} visible cores (shared with other jobs: compare ratios, not absolute times)")


def markdown_table(headers, rows) -> str:
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    for r in rows:
        out.append("| " + " | ".join(str(x) for x in r) + " |")
    return "\n".join(out)


def write(name: str, text: str, data=None):
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.md").write_text(text + "\n", encoding="utf-8")
    if data is not None:
        (RESULTS / f"{name}.json").write_text(json.dumps(data, indent=2), encoding="utf-8")
    print(text)
