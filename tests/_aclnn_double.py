"""Builds and loads the aclnn test double with lite_boost's Ascend translation (test-only extension).

Sources: csrc/npu/aclnn_translate.cpp (the C++ that runs on an NPU), csrc/common.cpp (the operator's
argument validation it calls) and tests/aclnn_double/aclnn_double.cpp (the double of the aclnn entry
points plus test hooks). Built with torch.utils.cpp_extension into a cache directory keyed by the
torch version and the sources' hash, under a file lock, so concurrent test processes build it once.
The result registers ``torch.ops.lite_boost_aclnn_double`` (it never touches ``torch.ops.lite_boost``).
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import os
import pathlib
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
SOURCES = [
    ROOT / "csrc" / "npu" / "aclnn_translate.cpp",
    ROOT / "csrc" / "common.cpp",
    ROOT / "tests" / "aclnn_double" / "aclnn_double.cpp",
]
HEADERS = [
    ROOT / "csrc" / "npu" / "aclnn_api.h",
    ROOT / "csrc" / "npu" / "aclnn_translate.h",
    ROOT / "csrc" / "npu" / "device_glue.h",
    ROOT / "csrc" / "common.h",
]


def _cache_dir() -> pathlib.Path:
    digest = hashlib.sha256()
    for path in SOURCES + HEADERS:
        digest.update(path.read_bytes())
    if os.environ.get("LITE_BOOST_EXT_DIR"):  # the operator library's cache root (lite_boost/ops/_ext.py)
        base = pathlib.Path(os.environ["LITE_BOOST_EXT_DIR"])
    else:
        base = pathlib.Path(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")) / "lite_boost"
    tag = f"torch{torch.__version__.replace('+', '_')}-{digest.hexdigest()[:16]}"
    return base / "aclnn_double" / tag


@functools.lru_cache(maxsize=None)
def load():
    """Build (once per source version) and load the double; returns torch.ops.lite_boost_aclnn_double."""
    from torch.utils import cpp_extension

    build = _cache_dir()
    bindir = os.path.dirname(sys.executable)  # the venv's ninja when the venv is not activated
    if bindir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
    os.environ.setdefault("MAX_JOBS", "2")
    build.mkdir(parents=True, exist_ok=True)
    with open(build / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            cpp_extension.load(
                name="lite_boost_aclnn_double",
                sources=[str(s) for s in SOURCES],
                extra_include_paths=[str(ROOT / "csrc")],
                extra_cflags=["-O0"],  # test-only: compile time matters, not speed
                build_directory=str(build),
                is_python_module=False,
                verbose=False,
            )
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return torch.ops.lite_boost_aclnn_double
