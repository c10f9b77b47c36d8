"""Lazy import of optional kernel packages (flash_attn, sageattention, spas_sage_attn, torch_npu, ...)."""

from __future__ import annotations

import functools
import importlib
import importlib.util

__all__ = ["import_optional", "module_or_none", "cuda_capability"]


@functools.lru_cache(maxsize=None)
def import_optional(module: str):
    """Import ``module`` or return the reason it cannot be imported (a str)."""
    try:
        if importlib.util.find_spec(module) is None:
            return f"{module} is not installed"
    except (ImportError, ValueError) as exc:  # a broken parent package
        return f"{module} cannot be located ({exc.__class__.__name__}: {exc})"
    try:
        return importlib.import_module(module)
    except (ImportError, RuntimeError, OSError) as exc:
        return f"{module} is installed but failed to import ({exc.__class__.__name__}: {exc})"


def module_or_none(module: str):
    mod = import_optional(module)
    return None if isinstance(mod, str) else mod


def cuda_capability(device=None) -> tuple[int, int] | None:
    """(major, minor) of a CUDA device (the current one when ``device`` is None), or None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    if device is not None and getattr(device, "type", "cuda") != "cuda":
        return None
    return tuple(torch.cuda.get_device_capability(device))
