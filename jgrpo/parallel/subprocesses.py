"""Python worker processes that talk to their parent over pipes: the reward workers (`jgrpo.rewards.pool`) and the
environment workers (`jgrpo.envs.workers`).

A worker is a fresh interpreter (`python -m MODULE ...`, not a fork: nothing of JAX's state is copied into it)
whose stdin and stdout carry pickled messages (`multiprocessing.connection.Connection`). `ChildProcess` is the
parent's side, `child_pipes` the worker's: it moves the worker's own prints to stderr (so they cannot corrupt the
protocol), leaves Ctrl-C to the parent, and exits when the parent disappears.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection

log = logging.getLogger("jgrpo")


class ChildProcess:
    """`python -m module *args` with `inbox` (its answers) and `outbox` (our messages) connections."""

    def __init__(self, module: str, *args: str):
        env = dict(os.environ)
        # Custom modules importable here (e.g. via the current directory) must be importable there too.
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))
        self.proc = subprocess.Popen([sys.executable, "-m", module, *args], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=env)
        self.inbox = Connection(os.dup(self.proc.stdout.fileno()), writable=False)
        self.outbox = Connection(os.dup(self.proc.stdin.fileno()), readable=False)
        self.proc.stdout.close()
        self.proc.stdin.close()

    def kill(self) -> None:
        for conn in (self.inbox, self.outbox):
            try:
                conn.close()
            except OSError:
                pass
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # unkillable (D state); nothing more we can do
            log.error("worker process %d did not exit after SIGKILL", self.proc.pid)


def exit_when_orphaned(parent_pid: int) -> None:
    # A parent killed with SIGKILL runs no cleanup; without this an endlessly looping worker would outlive it.
    while os.getppid() == parent_pid:
        time.sleep(1.0)
    os._exit(0)


def child_pipes() -> tuple[Connection, Connection]:
    """In the worker: (inbox, outbox) on its original stdin / stdout; its prints go to stderr from here on."""
    inbox = Connection(os.dup(0), writable=False)
    outbox = Connection(os.dup(1), readable=False)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it then kills us
    threading.Thread(target=exit_when_orphaned, args=(os.getppid(),), daemon=True).start()
    return inbox, outbox
