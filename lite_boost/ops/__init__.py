"""Tensor operators. This package knows nothing of models or of torch.distributed."""

from .attention import (
    AttentionBackendError,
    attention,
    attention_backend,
    available_backends,
    backend_report,
    select_backend,
)
from .rope import RopeCache, apply_rotary_emb, rope_tables

__all__ = [
    "AttentionBackendError",
    "attention",
    "attention_backend",
    "available_backends",
    "backend_report",
    "select_backend",
    "RopeCache",
    "apply_rotary_emb",
    "rope_tables",
    "rain_fusion_attention",
    "sparse_attention",
    "sparse_backend",
    "select_sparse_backend",
    "available_sparse_backends",
    "SparseBackendError",
    "SparseStats",
    "BlockSelection",
]

# Block-sparse names load lazily: they pull in FlexAttention and the sparse layout machinery,
# which dense attention users never need.
_LAZY = {
    "rain_fusion_attention": "rain_fusion",
    "sparse_backend": "rain_fusion",
    "select_sparse_backend": "rain_fusion",
    "available_sparse_backends": "rain_fusion",
    "SparseBackendError": "rain_fusion",
    "sparse_attention": "sparse",
    "SparseStats": "sparse",
    "BlockSelection": "sparse",
}


def __getattr__(name):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'lite_boost.ops' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f".{module}", __name__), name)
