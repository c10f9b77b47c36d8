"""Exceptions shared by every layer of lite_boost, and the one check config and cache both need (this module
imports nothing of lite_boost)."""

from __future__ import annotations

__all__ = ["ConfigError", "LoaderError", "PerformanceWarning", "check_regexes"]


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field and the accepted values."""


class LoaderError(ConfigError):
    """A diffusers loader or processor call (``fuse_lora``, ``set_attn_processor``, ``load_ip_adapter``, ...) that a
    boosted model cannot take as boosted; raised before anything changes, naming the boost option and what to do."""


class PerformanceWarning(UserWarning):
    """A requested option runs correctly here but is known to be slower than not using it on this hardware; the
    message names the option, why, and what to use instead."""


def check_regexes(where: str, value, allow_empty: bool = False) -> tuple[str, ...]:
    """A regular expression or a list of them (non-empty strings, each compiling) -> tuple; ConfigError naming ``where``."""
    import re

    vals = [value] if isinstance(value, str) else value
    if not isinstance(vals, (list, tuple)) or not all(isinstance(x, str) and x for x in vals):
        raise ConfigError(f"{where} must be a regular expression or a list of them (non-empty strings), got {value!r}")
    if not vals and not allow_empty:
        raise ConfigError(f"{where} must list at least one regular expression, got {value!r}")
    for x in vals:
        try:
            re.compile(x)
        except re.error as exc:
            raise ConfigError(f"{where}: {x!r} is not a valid regular expression ({exc})") from None
    return tuple(vals)
