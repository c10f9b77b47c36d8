"""Build description of the Ascend operator library (``csrc/npu/``), used by :mod:`lite_boost.ops._ext`.

(Kernel availability at run time, which needs the loaded library's status, is :mod:`._ext_npu`.)

The Ascend kernels register ``torch.ops.lite_boost.*`` for the PrivateUse1 (NPU) dispatch key. They
are compiled only where CANN and torch_npu are found: :func:`npu_build_config` returns the keyword
arguments of ``torch.utils.cpp_extension.load`` for them, or a sentence saying why they cannot be
built here. Nothing in this module imports torch_npu at import time.

What is compiled:
    csrc/npu/npu_kernels.cpp     device glue (current NPU stream, caching-allocator workspace,
                                 OpCommand launch) + TORCH_LIBRARY_IMPL(lite_boost, PrivateUse1)
    csrc/npu/aclnn_translate.cpp checks, aclTensor arguments, two-phase aclnn call (also run on CPU
                                 against the aclnn test double in tests/)
    csrc/npu/opapi_loader.cpp    aclnn entry points resolved from CANN's libopapi.so at run time
    csrc/common.cpp              the operators' shared argument validation

Include and library paths come from torch_npu's own extension helper
(``torch_npu.utils.cpp_extension.NpuExtension``), which knows where torch_npu ships its headers
(including its copy of the CANN acl headers) and ``libtorch_npu``. The aclnn entry points are not
linked: like torch_npu, the kernels look them up in ``libopapi.so`` / ``libnnopbase.so`` on first
use, so a CANN without ``aclnnRainFusionAttention`` still loads the library (that one op then
raises saying which entry is missing).
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path

__all__ = ["NPU_SOURCES", "npu_sources", "npu_build_config"]

NPU_SOURCES = ("npu/npu_kernels.cpp", "npu/aclnn_translate.cpp", "npu/opapi_loader.cpp", "common.cpp")


def npu_sources(csrc: Path) -> list[str]:
    return [str(Path(csrc) / s) for s in NPU_SOURCES]


def _cann_home() -> str | None:
    for var in ("ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME"):
        if os.environ.get(var):
            return os.environ[var]
    return None


def _torch_npu_paths(torch_npu) -> tuple[list[str], list[str], list[str]]:
    """(include dirs, library dirs, libraries) of torch_npu, preferably from its extension helper."""
    root = Path(torch_npu.__file__).resolve().parent
    try:
        helper = importlib.import_module("torch_npu.utils.cpp_extension")
        ext = helper.NpuExtension("lite_boost_npu_probe", [])
        includes, lib_dirs, libs = list(ext.include_dirs), list(ext.library_dirs), list(ext.libraries)
    except Exception:  # noqa: BLE001 - older/newer helpers: fall back to torch_npu's documented layout
        includes, lib_dirs, libs = [str(root / "include")], [str(root / "lib")], ["torch_npu"]
    acl = root / "include" / "third_party" / "acl" / "inc"  # torch_npu's copy of the CANN acl headers
    if acl.is_dir() and str(acl) not in includes:
        includes.append(str(acl))
    return includes, lib_dirs, libs


def npu_build_config(csrc: Path):
    """Keyword arguments for ``cpp_extension.load`` (sources included), or why the NPU build is impossible."""
    csrc = Path(csrc)
    missing = [s for s in npu_sources(csrc) if not Path(s).is_file()]
    if missing:
        return f"sources missing: {', '.join(missing)}"
    if _cann_home() is None:
        return "CANN not found (ASCEND_HOME_PATH / ASCEND_TOOLKIT_HOME unset; source CANN's set_env.sh)"
    try:
        torch_npu = importlib.import_module("torch_npu")
    except (ImportError, RuntimeError, OSError) as exc:
        return f"torch_npu is not importable ({exc.__class__.__name__}: {exc})"
    includes, lib_dirs, libs = _torch_npu_paths(torch_npu)
    torch_libs = {"c10", "torch", "torch_cpu", "torch_python"}  # linked by cpp_extension already
    ldflags = [f"-L{d}" for d in lib_dirs] + [f"-Wl,-rpath,{d}" for d in lib_dirs]
    ldflags += [f"-l{lib}" for lib in libs if lib not in torch_libs] + ["-ldl"]
    return {
        "sources": npu_sources(csrc),
        "extra_include_paths": [str(csrc)] + includes,
        # torch_npu's log/exception macros use __FILENAME__, which its own build defines per file.
        "extra_cflags": ["-O2", "-D__FILENAME__=__FILE__"],
        "extra_ldflags": ldflags,
    }
