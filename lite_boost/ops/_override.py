"""Backend overrides shared by the dense and block-sparse dispatchers.

Precedence: the call's ``backend=`` argument, then a ``with force(name):`` block (context-local,
so threads and asyncio tasks never see each other's choice), then an environment variable
("auto" or empty = automatic).
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from typing import Iterator, Sequence

__all__ = ["BackendOverride"]


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

    def check(self, name, argument: str) -> str:
        """Normalised ``name`` or a ValueError naming ``argument`` and the accepted values."""
        if not isinstance(name, str) or name.lower() not in self.names:
            raise ValueError(f"{argument} must be one of {list(self.names)} (or None for automatic), got {name!r}")
        return name.lower()

    def requested(self, backend: str | None) -> tuple[str | None, str]:
        """(forced name or None, how it was forced) for a call that passed ``backend``."""
        if backend is not None:
            return self.check(backend, "backend"), "requested by the call"
        forced = self._forced.get()
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
        try:
            yield
        finally:
            self._forced.reset(token)
