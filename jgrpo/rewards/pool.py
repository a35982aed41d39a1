"""A persistent pool of reward worker processes with a per-call timeout.

Why processes: a Python thread cannot be stopped, so a reward stuck in a loop (or in C code holding the GIL)
would run forever and slow or hang training. A worker process running past its deadline is killed and
replaced; its call counts as a timeout. Workers are separate interpreters (`python -m jgrpo.rewards.worker`),
not forks, so nothing of JAX's state is copied into them, and they are killed when the pool is closed,
garbage collected, or the interpreter exits.
"""

from __future__ import annotations

import logging
import sys
import time
import weakref
from collections import deque
from multiprocessing.connection import wait
from typing import NamedTuple

from jgrpo.parallel.subprocesses import ChildProcess

log = logging.getLogger("jgrpo.rewards")

MAX_STARTUP_FAILURES = 3


class Outcome(NamedTuple):
    value: float  # 0.0 unless status == "ok"
    status: str  # "ok" | "error" | "timeout" | "crash"
    message: str = ""


class _Worker(ChildProcess):
    def __init__(self, paths: list[str], startup_timeout_s: float):
        super().__init__("jgrpo.rewards.worker", *paths)
        self.ready = False
        self.task: int | None = None
        self.deadline = time.monotonic() + startup_timeout_s  # ready-by, then done-by for the current task


def _kill_all(workers: list[_Worker]) -> None:
    for w in workers:
        w.kill()


class RewardWorkerPool:
    """Runs `(function_path, prompt, completion, reference)` calls on `num_workers` processes, each call
    limited to `timeout_s` seconds (counted from when a ready worker receives it)."""

    def __init__(self, paths: list[str], *, num_workers: int, timeout_s: float, startup_timeout_s: float = 120.0):
        if num_workers < 1:
            raise ValueError(f"num_workers={num_workers} must be >= 1")
        self.paths = list(paths)
        self.timeout_s = timeout_s
        self.startup_timeout_s = startup_timeout_s
        self._workers = [_Worker(self.paths, startup_timeout_s) for _ in range(num_workers)]
        self._startup_failures = 0
        self._finalizer = weakref.finalize(self, _kill_all, self._workers)

    @property
    def pids(self) -> list[int]:
        return [w.proc.pid for w in self._workers]

    def close(self) -> None:
        self._finalizer()

    def _replace(self, slot: int) -> None:
        self._workers[slot].kill()
        self._workers[slot] = _Worker(self.paths, self.startup_timeout_s)

    def _startup_failed(self, slot: int, why: str) -> None:
        self._startup_failures += 1
        if self._startup_failures > MAX_STARTUP_FAILURES:
            self.close()
            raise RuntimeError(f"reward workers fail to start ({why}); run `{sys.executable} -m "
                               f"jgrpo.rewards.worker {' '.join(self.paths)}` to see the error")
        log.warning("reward worker failed to start (%s); starting another", why)
        self._replace(slot)

    def run(self, calls: list[tuple[str, str, str, dict]]) -> list[Outcome]:
        """One Outcome per call, in order. Never raises because of what a reward function does."""
        if not self._finalizer.alive:
            raise RuntimeError("the reward worker pool is closed")
        results: list[Outcome | None] = [None] * len(calls)
        queue = deque(range(len(calls)))
        remaining = len(calls)
        while remaining:
            for slot, w in enumerate(self._workers):
                if w.ready and w.task is None and queue:
                    i = queue.popleft()
                    try:
                        w.outbox.send((i, *calls[i]))
                    except OSError:  # the worker died while idle: retry the call on a fresh one
                        queue.appendleft(i)
                        self._replace(slot)
                        continue
                    except Exception as e:  # noqa: BLE001 - e.g. a reference that cannot be pickled
                        results[i] = Outcome(0.0, "error", f"cannot send the call: {type(e).__name__}: {e}")
                        remaining -= 1
                        continue
                    w.task, w.deadline = i, time.monotonic() + self.timeout_s
            if not remaining:
                break
            wait_s = max(0.0, min(w.deadline for w in self._workers) - time.monotonic())
            by_conn = {w.inbox: slot for slot, w in enumerate(self._workers)}
            for conn in wait(list(by_conn), timeout=wait_s):
                slot = by_conn[conn]
                w = self._workers[slot]
                try:
                    message = conn.recv()
                except (EOFError, OSError):
                    code = w.proc.poll()
                    if not w.ready:
                        self._startup_failed(slot, f"exit code {code}")
                    elif w.task is None:
                        self._replace(slot)
                    else:
                        results[w.task] = Outcome(0.0, "crash", f"worker process died (exit code {code})")
                        remaining -= 1
                        self._replace(slot)
                    continue
                if message[0] == "ready":
                    w.ready, w.deadline = True, float("inf")
                    self._startup_failures = 0
                    continue
                task_id, status, payload = message
                results[task_id] = Outcome(payload, "ok") if status == "ok" else Outcome(0.0, status, payload)
                remaining -= 1
                w.task, w.deadline = None, float("inf")
            now = time.monotonic()
            for slot, w in enumerate(self._workers):
                if w.deadline > now:
                    continue
                if w.task is not None:
                    results[w.task] = Outcome(0.0, "timeout", f"no result after {self.timeout_s:g} s")
                    remaining -= 1
                    self._replace(slot)
                elif not w.ready:
                    self._startup_failed(slot, f"not ready after {self.startup_timeout_s:g} s")
        return results  # type: ignore[return-value]
