"""Backend overrides shared by the dense and block-sparse dispatchers.

Precedence: the call's ``backend=`` argument, then a ``with force(name):`` block, then an environment
variable ("auto" or empty = automatic).

A ``force`` block is context-local in eager code (a ``ContextVar``: threads and asyncio tasks never
see each other's choice). Code traced by ``torch.compile`` cannot read a ``ContextVar``, so the block
also records its value in a thread-local mirror that the traced code reads instead: dynamo guards on
that value, so entering or leaving a block around a compiled call selects (or compiles) the graph of
the new backend, and the backend itself becomes a constant of the graph. Two differences apply to
compiled code only: asyncio tasks sharing one thread see the innermost block entered on that thread,
and the environment variable is read when the graph is traced (changing it later does not recompile).

:func:`raise_when_run` lets traced code defer a dispatch error to the moment the graph runs, so a
forced backend that cannot run raises its own clear exception from a compiled model too (dynamo would
otherwise turn an exception raised while tracing into one of its own errors).
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import threading
from typing import Iterator, Sequence

import torch

from ._errors import AttentionBackendError, SparseBackendError

__all__ = ["BackendOverride", "raise_when_run"]


class _ThreadMirror(threading.local):
    """Per-thread copy of the innermost ``force`` value, readable (and guarded) by dynamo."""

    def __init__(self):
        # an instance attribute (set per thread): dynamo guards it, not a class-level default
        self.value: str | None = None


class BackendOverride:
    """The forced-backend state of one dispatcher.

    Args:
        names: accepted backend names (checked case-insensitively).
        env_var: environment variable that forces a backend for the whole process.
        context_label: how a ``force`` block is named in messages, e.g. "attention_backend(...)".
    """

    def __init__(self, names: Sequence[str], env_var: str, context_label: str):
        self.names = tuple(names)
        self.env_var = env_var
        self.context_label = context_label
        self._forced: contextvars.ContextVar[str | None] = contextvars.ContextVar(f"lite_boost_{env_var}", default=None)
        self._mirror = _ThreadMirror()

    def check(self, name, argument: str) -> str:
        """Normalised ``name`` or a ValueError naming ``argument`` and the accepted values."""
        if not isinstance(name, str) or name.lower() not in self.names:
            raise ValueError(f"{argument} must be one of {list(self.names)} (or None for automatic), got {name!r}")
        return name.lower()

    def current(self) -> str | None:
        """The backend forced by the innermost active ``force`` block (None outside any)."""
        if torch.compiler.is_compiling():
            return self._mirror.value
        return self._forced.get()

    def requested(self, backend: str | None) -> tuple[str | None, str]:
        """(forced name or None, how it was forced) for a call that passed ``backend``."""
        if backend is not None:
            return self.check(backend, "backend"), "requested by the call"
        forced = self.current()
        if forced is not None:
            return forced, f"forced by {self.context_label}"
        env = os.environ.get(self.env_var, "").strip()
        if env and env.lower() != "auto":
            return self.check(env, f"environment variable {self.env_var}"), f"forced by {self.env_var}"
        return None, "automatic"

    @contextlib.contextmanager
    def force(self, name: str | None) -> Iterator[None]:
        """Force ``name`` inside a ``with`` block (``None`` restores the automatic choice)."""
        value = None if name is None else self.check(name, "name")
        token = self._forced.set(value)
        previous = self._mirror.value
        self._mirror.value = value
        try:
            yield
        finally:
            self._mirror.value = previous
            self._forced.reset(token)


# ------------------------------------------------------------------------------ deferred errors
def _error_class(kind: str) -> type:
    return {"attention": AttentionBackendError, "sparse": SparseBackendError}.get(kind, RuntimeError)


# A Python custom op (own namespace, separate from the C++ ``torch.ops.lite_boost`` library): opaque to
# dynamo and inductor, it is recorded in the graph and raises only when the graph runs.
@torch.library.custom_op("lite_boost_graph::raise_dispatch_error", mutates_args=())
def _raise_dispatch_error(like: torch.Tensor, kind: str, message: str) -> torch.Tensor:
    raise _error_class(kind)(message)


@_raise_dispatch_error.register_fake
def _(like, kind, message):
    return torch.empty_like(like)


def raise_when_run(kind: str, message: str, like: torch.Tensor) -> torch.Tensor:
    """Raise the ``kind`` ("attention" or "sparse") dispatch error now, or when the traced graph runs.

    Eager: raises at once. While tracing: returns a placeholder shaped like ``like`` from an op that
    raises the same exception with the same message when the compiled graph executes.
    """
    if torch.compiler.is_compiling():
        return torch.ops.lite_boost_graph.raise_dispatch_error(like, kind, message)
    raise _error_class(kind)(message)
