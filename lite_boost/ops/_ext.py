"""Build and load the compiled operator library (``csrc/``): ``torch.ops.lite_boost.*``.

The library registers two operators, ``rain_fusion_attention`` and ``prompt_flash_attention``
(schemas and Meta kernels in ``csrc/ops.cpp``, CPU kernels in ``csrc/cpu/``). Ascend kernels
(``csrc/npu/``) are a second library, built only where CANN and torch_npu are found.

It is compiled with the installed torch (``torch.utils.cpp_extension``, ninja) into a cache
directory keyed by torch version, Python version and machine, ahead of time by
``scripts/setup.sh`` (``python -m lite_boost.ops._ext``) or else at first use. A file lock makes
concurrent first uses (several test workers, torchrun ranks) build once and then share the result.

Nothing here runs at ``import lite_boost``. When the library cannot be built or loaded (no C++
compiler, build error, ``LITE_BOOST_EXT=0``), :func:`load` warns once saying why and returns a
status whose ``reason`` the backend registries report; the Python backends then serve. With
``LITE_BOOST_REQUIRE_EXT=1`` (set by CI) that failure raises instead, so C++ tests cannot be
skipped silently.

Environment:
    LITE_BOOST_EXT=0            never build or load the library (use the Python backends).
    LITE_BOOST_REQUIRE_EXT=1    a library that cannot be built or loaded is an error.
    LITE_BOOST_EXT_DIR          cache root (default ``~/.cache/lite_boost/ext``; or $XDG_CACHE_HOME).
    LITE_BOOST_EXT_VERBOSE=1    show the compiler output.
    MAX_JOBS                    parallel compile jobs (default 2).
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import os
import platform
import shutil
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["ExtStatus", "load", "status", "cpu_kernel_reason", "csrc_dir", "cache_dir", "require_ext", "REQUIRE_ENV", "DISABLE_ENV"]

LIB_NAME = "lite_boost_ops"
NPU_LIB_NAME = "lite_boost_npu"
REQUIRE_ENV = "LITE_BOOST_REQUIRE_EXT"
DISABLE_ENV = "LITE_BOOST_EXT"
OPS = ("rain_fusion_attention", "prompt_flash_attention")


@dataclass(frozen=True)
class ExtStatus:
    """Outcome of building/loading the operator library."""

    loaded: bool
    reason: str | None = None            # why not loaded (None when loaded)
    path: str | None = None              # the loaded shared library
    kernels: dict = field(default_factory=dict)  # op name -> tuple of dispatch keys with a kernel
    npu: str | None = None               # NPU library: "loaded" or why not

    def summary(self) -> str:
        if not self.loaded:
            return f"not built: {self.reason}"
        keys = sorted({k for ks in self.kernels.values() for k in ks})
        return f"loaded ({', '.join(keys)}) from {self.path}; npu kernels: {self.npu}"


def require_ext() -> bool:
    return os.environ.get(REQUIRE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def csrc_dir() -> Path:
    return Path(__file__).resolve().parents[2] / "csrc"


def _machine_tag() -> str:
    """Compiled with -march=native: key the cache by CPU model and flags too."""
    info = platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            wanted = [ln for ln in fh.read().splitlines() if ln.startswith(("model name", "flags"))][:2]
        info += "|" + "|".join(wanted)
    except OSError:
        info += "|" + platform.processor()
    return hashlib.sha1(info.encode()).hexdigest()[:10]


def cache_dir() -> Path:
    import torch

    root = os.environ.get("LITE_BOOST_EXT_DIR")
    if root:
        base = Path(root)
    else:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lite_boost" / "ext"
    # the torch install location is part of the key: two venvs with the same torch version would otherwise
    # keep rebuilding over each other (the compile flags name the torch include path)
    where = hashlib.sha1(str(Path(torch.__file__).resolve().parent).encode()).hexdigest()[:6]
    tag = f"torch{torch.__version__}-py{sys.version_info[0]}{sys.version_info[1]}-{platform.machine()}-{_machine_tag()}-{where}"
    return base / tag.replace("+", "_")


def _cpu_sources(src: Path) -> list[str]:
    return [str(src / "ops.cpp"), str(src / "common.cpp")] + sorted(str(p) for p in (src / "cpu").glob("*.cpp"))


def _compiler() -> str | None:
    cxx = os.environ.get("CXX", "c++")
    return shutil.which(cxx)


class _FileLock:
    """Exclusive advisory lock on a file (POSIX fcntl; elsewhere a no-op, cpp_extension's baton remains)."""

    def __init__(self, path: Path):
        self.path = path
        self.fh = None

    def __enter__(self):
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.fh = open(self.path, "a+")
        try:
            import fcntl

            fcntl.flock(self.fh.fileno(), fcntl.LOCK_EX)
        except ImportError:
            pass
        return self

    def __exit__(self, *exc):
        try:
            import fcntl

            fcntl.flock(self.fh.fileno(), fcntl.LOCK_UN)
        except ImportError:
            pass
        self.fh.close()


def _build(name: str, sources: list[str], build_dir: Path, **kwargs) -> str:
    """Compile (or reuse) one library with torch.utils.cpp_extension and load it into torch.ops."""
    from torch.utils import cpp_extension

    build_dir.mkdir(parents=True, exist_ok=True)
    env_path = os.environ.get("PATH", "")
    bindir = str(Path(sys.executable).parent)  # the venv's ninja when the venv is not activated
    if bindir not in env_path.split(os.pathsep):
        os.environ["PATH"] = bindir + os.pathsep + env_path
    os.environ.setdefault("MAX_JOBS", "2")
    verbose = os.environ.get("LITE_BOOST_EXT_VERBOSE", "") == "1"
    with _FileLock(build_dir / "lite_boost_build.lock"):
        path = cpp_extension.load(name=name, sources=sources, build_directory=str(build_dir), is_python_module=False,
                                  verbose=verbose, **kwargs)
    return str(path) if isinstance(path, (str, os.PathLike)) else str(build_dir / f"{name}.so")


def _kernels() -> dict:
    import torch

    out = {}
    for op in OPS:
        keys = []
        for key in ("CPU", "Meta", "PrivateUse1", "CUDA"):
            try:
                if torch._C._dispatch_has_kernel_for_dispatch_key(f"lite_boost::{op}", key):
                    keys.append("NPU" if key == "PrivateUse1" else key)
            except RuntimeError:
                pass
        out[op] = tuple(keys)
    return out


def _npu_config():
    """(build kwargs or None, reason) for the Ascend library; its sources are owned by ``_ext_npu_build``."""
    if not (os.environ.get("ASCEND_HOME_PATH") or os.environ.get("ASCEND_TOOLKIT_HOME")):
        return None, "not built: CANN not found (ASCEND_HOME_PATH / ASCEND_TOOLKIT_HOME unset)"
    try:
        importlib.import_module("torch_npu")
    except (ImportError, RuntimeError, OSError) as exc:
        return None, f"not built: torch_npu is not importable ({exc.__class__.__name__}: {exc})"
    try:
        mod = importlib.import_module("lite_boost.ops._ext_npu_build")
    except ImportError as exc:
        return None, f"not built: no NPU build description ({exc})"
    cfg = mod.npu_build_config(csrc_dir())
    if isinstance(cfg, str):
        return None, f"not built: {cfg}"
    return cfg, None


def _load_npu(build_root: Path) -> str:
    cfg, why = _npu_config()
    if cfg is None:
        return why
    try:
        _build(NPU_LIB_NAME, build_dir=build_root / "npu", **cfg)
    except Exception as exc:  # noqa: BLE001 - reported, the CPU library stays usable
        msg = f"build failed: {exc.__class__.__name__}: {str(exc).strip()[-500:]}"
        if require_ext():
            raise RuntimeError(f"lite_boost NPU operator library: {msg}") from exc
        warnings.warn(f"lite_boost: the Ascend operator library is unavailable ({msg})", RuntimeWarning, stacklevel=3)
        return msg
    return "loaded"


def _fail(reason: str) -> ExtStatus:
    if require_ext():
        raise RuntimeError(f"lite_boost operator library is required ({REQUIRE_ENV}=1) but unavailable: {reason}")
    warnings.warn(f"lite_boost: the C++ operator library is unavailable ({reason}); "
                  "the Python backends serve instead", RuntimeWarning, stacklevel=3)
    return ExtStatus(False, reason)


@functools.lru_cache(maxsize=None)
def load() -> ExtStatus:
    """Build (if needed) and load the library once per process; never raises unless required by CI."""
    if os.environ.get(DISABLE_ENV, "").strip().lower() in ("0", "false", "no", "off"):
        if require_ext():
            raise RuntimeError(f"{DISABLE_ENV}=0 disables the operator library but {REQUIRE_ENV}=1 requires it")
        return ExtStatus(False, f"disabled by {DISABLE_ENV}=0")
    src = csrc_dir()
    if not (src / "ops.cpp").is_file():
        return _fail(f"C++ sources not found at {src} (install lite-boost from a source checkout)")
    if _compiler() is None:
        return _fail(f"no C++ compiler found ({os.environ.get('CXX', 'c++')!r} is not on PATH)")
    try:
        build_root = cache_dir()
        path = _build(LIB_NAME, _cpu_sources(src), build_root,
                      extra_cflags=["-O3", "-march=native", "-fopenmp", "-std=c++17"],
                      extra_ldflags=["-fopenmp"])
    except Exception as exc:  # noqa: BLE001 - any build/load failure means "use the Python backends"
        text = str(exc).strip()
        return _fail(f"build failed: {exc.__class__.__name__}: {text[-800:]}")
    npu = _load_npu(build_root)
    return ExtStatus(True, None, path, _kernels(), npu)


def _assume_constant(fn):
    """Library availability is fixed for the process: torch.compile evaluates it once at trace time."""
    try:
        import torch

        return torch.compiler.assume_constant_result(fn)
    except (ImportError, AttributeError):  # pragma: no cover - older torch
        return fn


@_assume_constant
def cpu_kernel_reason(op: str) -> str | None:
    """None if ``torch.ops.lite_boost.<op>`` has a CPU kernel (building the library at first use), else why not.

    Raises when the library is required (``LITE_BOOST_REQUIRE_EXT=1``) but cannot be built.
    """
    st = load()
    if not st.loaded:
        return f"the lite_boost C++ operator library is not built ({st.reason})"
    if "CPU" not in st.kernels.get(op, ()):
        return f"torch.ops.lite_boost.{op} has no CPU kernel"
    return None


def status() -> ExtStatus:
    """Like :func:`load` but never raises (for reports)."""
    try:
        return load()
    except Exception as exc:  # noqa: BLE001
        return ExtStatus(False, str(exc))


def main(argv=None) -> int:
    """``python -m lite_boost.ops._ext``: build ahead of time and print the status."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m lite_boost.ops._ext", description=__doc__.splitlines()[0])
    parser.add_argument("--require", action="store_true", help="exit 1 when the library cannot be built")
    args = parser.parse_args(argv)
    if args.require:
        os.environ[REQUIRE_ENV] = "1"
    try:
        st = load()
    except RuntimeError as exc:
        print(f"lite_boost operator library: {exc}", file=sys.stderr)
        return 1
    print(f"lite_boost operator library: {st.summary()}")
    return 0 if st.loaded or not args.require else 1


if __name__ == "__main__":
    raise SystemExit(main())
