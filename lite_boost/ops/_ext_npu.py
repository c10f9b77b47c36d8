"""The Ascend operator library at run time: which ``torch.ops.lite_boost`` ops have their NPU kernel.

The build description (sources, CANN / torch_npu paths) is :mod:`._ext_npu_build`, re-exported here;
it is kept apart so that the loader (:mod:`._ext`) and this module, which asks the loader for its
status, do not import each other.
"""

from __future__ import annotations

from ._ext_npu_build import NPU_SOURCES, npu_build_config, npu_sources

__all__ = ["NPU_SOURCES", "npu_sources", "npu_build_config", "has_npu_kernel", "npu_kernel_reason"]


def has_npu_kernel(op: str) -> bool:
    """Whether ``lite_boost::<op>`` has an Ascend (PrivateUse1) kernel registered in this process."""
    import torch

    try:
        return bool(torch._C._dispatch_has_kernel_for_dispatch_key(f"lite_boost::{op}", "PrivateUse1"))
    except RuntimeError:  # the operator itself is not registered
        return False


def _assume_constant(fn):
    """Kernel availability is fixed for the process: torch.compile evaluates it once at trace time."""
    try:
        import torch

        return torch.compiler.assume_constant_result(fn)
    except (ImportError, AttributeError):  # pragma: no cover - older torch
        return fn


@_assume_constant
def npu_kernel_reason(op: str) -> str | None:
    """None if ``torch.ops.lite_boost.<op>`` has its Ascend kernel (loading the library at first use), else why not."""
    from . import _ext

    st = _ext.status()
    if not st.loaded:
        return f"the lite_boost operator library is not built ({st.reason})"
    if not has_npu_kernel(op):
        return f"its Ascend kernel is not built ({st.npu})"
    return None
