"""Process start-up shared by every entrypoint: log format and the on-disk cache of compiled programs.

Compiled programs are cached in $JAX_COMPILATION_CACHE_DIR when set, else $JGRPO_CACHE/xla or
~/.cache/jgrpo/xla (JGRPO_COMPILATION_CACHE=0 turns the cache off), so a restarted run skips compiling.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

NOISY_LOGGERS = ("absl", "jax", "orbax", "jax._src")


def setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    for noisy in NOISY_LOGGERS:
        logging.getLogger(noisy).setLevel(logging.WARNING)


def enable_compilation_cache() -> None:
    import jax

    if os.environ.get("JGRPO_COMPILATION_CACHE", "1") == "0" or os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return
    root = Path(os.environ.get("JGRPO_CACHE", Path.home() / ".cache" / "jgrpo"))
    jax.config.update("jax_compilation_cache_dir", str(root / "xla"))
