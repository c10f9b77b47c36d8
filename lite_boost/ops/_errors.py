"""Dispatch errors of the dense and block-sparse attention backends (re-exported by their modules)."""

from __future__ import annotations

__all__ = ["AttentionBackendError", "SparseBackendError"]


class AttentionBackendError(RuntimeError):
    """The requested attention backend cannot run this call; the message says why."""


class SparseBackendError(RuntimeError):
    """The requested block-sparse backend cannot run this call; the message says why."""
