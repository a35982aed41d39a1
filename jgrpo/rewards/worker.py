"""A reward worker process: `python -m jgrpo.rewards.worker PATH...` (started by pool.py, not by people).

It reads `(task_id, function_path, prompt, completion, reference)` messages on stdin and answers
`(task_id, "ok", value)` or `(task_id, "error", message)` on its original stdout. Reward functions that print
go to stderr instead, so they cannot corrupt the protocol. The parent kills a worker whose call runs past the
timeout; a worker also exits when its parent disappears or closes stdin.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import threading
import time
from multiprocessing.connection import Connection


def _exit_when_orphaned(parent_pid: int) -> None:
    # A parent killed with SIGKILL runs no cleanup; without this an endlessly looping worker would outlive it.
    while os.getppid() == parent_pid:
        time.sleep(1.0)
    os._exit(0)


def _as_reward(value: object) -> float:
    if isinstance(value, bool):
        return float(value)
    try:
        reward = float(value)  # numpy scalars, ints, floats
    except (TypeError, ValueError):
        raise TypeError(f"reward functions must return a number, got {type(value).__name__}") from None
    if not math.isfinite(reward):
        raise ValueError(f"reward functions must return a finite number, got {reward}")
    return reward


def main(paths: list[str]) -> None:
    inbox = Connection(os.dup(0), writable=False)
    outbox = Connection(os.dup(1), readable=False)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it then kills us
    threading.Thread(target=_exit_when_orphaned, args=(os.getppid(),), daemon=True).start()

    from jgrpo.rewards.registry import get_reward

    functions = {path: get_reward(path) for path in paths}  # import everything before saying ready
    outbox.send(("ready", os.getpid()))
    while True:
        try:
            task_id, path, prompt, completion, reference = inbox.recv()
        except EOFError:
            return
        try:
            fn = functions.get(path) or functions.setdefault(path, get_reward(path))
            outbox.send((task_id, "ok", _as_reward(fn(prompt, completion, reference))))
        except BaseException as e:  # noqa: BLE001 - any failure of a reward is reported, never fatal
            outbox.send((task_id, "error", f"{type(e).__name__}: {e}"[:2000]))


if __name__ == "__main__":
    main(sys.argv[1:])
