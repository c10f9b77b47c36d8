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
]


def __getattr__(name):  # lazy: the sparse ops pull in more machinery than dense attention needs
    if name == "rain_fusion_attention":
        from .rain_fusion import rain_fusion_attention

        return rain_fusion_attention
    if name == "sparse_attention":
        from .sparse import sparse_attention

        return sparse_attention
    raise AttributeError(f"module 'lite_boost.ops' has no attribute {name!r}")
