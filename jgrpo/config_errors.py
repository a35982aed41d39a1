"""The config's error type and the one check every section's `__post_init__` uses."""

from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """A config key or value that cannot be accepted; the message names it."""


def check(cond: bool, field: str, value: Any, allowed: str) -> None:
    if not cond:
        raise ConfigError(f"{field}={value!r} is not allowed: {allowed}")
