"""Errors in what the user gave jgrpo, the one check every config section's `__post_init__` uses, and the one
way every entrypoint reports them.

A `UserError` is bad input (a config key or value, a path, a data row, a reward function's setup), not a bug:
its message is the whole story, one short paragraph saying what is wrong, where (config key, file:line,
function) and what to do. Entrypoints catch it at the top (`exits_on_user_error`) and print `error: <message>`
to stderr with exit status 2 and no traceback; anything else keeps its traceback, because it is a bug in jgrpo.
`JGRPO_DEBUG=1` shows the traceback of user errors too.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from typing import Any

EXIT_USER_ERROR = 2  # what argparse uses for a bad command line, too


class UserError(Exception):
    """Bad input from the person running jgrpo; the message names the problem and the fix."""


class ConfigError(UserError, ValueError):
    """A config key or value that cannot be accepted (or a config file that cannot be read); the message names it."""


class DataError(UserError, ValueError):
    """A data source or row that cannot be used; the message names the file and row."""


class RewardSetupError(UserError, ValueError):
    """A reward function that cannot be found or imported (what it returns while training is never an error)."""


class PathError(UserError, OSError):
    """A path the run needs that is missing, of the wrong kind, or not writable."""


def check(cond: bool, field: str, value: Any, allowed: str) -> None:
    if not cond:
        raise ConfigError(f"{field}={value!r} is not allowed: {allowed}")


def exits_on_user_error(main: Callable[..., int]) -> Callable[..., int]:
    """Wrap an entrypoint's `main`: a UserError becomes one paragraph on stderr and exit status 2."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs) -> int:
        try:
            return main(*args, **kwargs)
        except UserError as e:
            if os.environ.get("JGRPO_DEBUG", "") not in ("", "0"):
                raise
            # One line, unwrapped: the terminal wraps it, and a grep for a path or a key still finds it whole.
            print(f"error: {e}", file=sys.stderr, flush=True)
            return EXIT_USER_ERROR

    return wrapper
