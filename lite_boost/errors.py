"""Exceptions shared by every layer of lite_boost (this module imports nothing of lite_boost)."""

from __future__ import annotations

__all__ = ["ConfigError"]


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field and the accepted values."""
