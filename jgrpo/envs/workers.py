"""Environments of a batch's episodes, run in `env.num_workers` worker processes with a per-call timeout.

Episode e lives on worker e % num_workers (its environment instance keeps the episode's state between calls),
so a worker runs its episodes' calls one at a time, in the order they were submitted. `submit` sends a call
without waiting; `result(e)` waits for episode e's call. A call that raises, returns something malformed, runs
past `env.timeout_s` or whose worker dies is an `Outcome` with an error, never an exception: the driver fails that
episode (`env.on_failure`). A worker killed for a timeout or found dead loses its other episodes' state too: they
fail with it ("its worker was restarted"), and a fresh worker takes the next episodes.

With `num_workers: 0` the calls run in this process when submitted (no timeout; for debugging and tests).
"""

from __future__ import annotations

import logging
import sys
import time
import weakref
from collections import deque
from multiprocessing.connection import wait
from typing import Any, NamedTuple

from jgrpo.config.errors import ConfigError
from jgrpo.envs.worker import EpisodeHost
from jgrpo.parallel.subprocesses import ChildProcess

log = logging.getLogger("jgrpo.envs")

STARTUP_TIMEOUT_S = 120.0


class Outcome(NamedTuple):
    value: Any  # reset: messages; step: StepResult (None on an error)
    error: str | None = None
    seconds: float = 0.0  # from submission to the answer


class _Process(ChildProcess):
    def __init__(self, config):
        super().__init__("jgrpo.envs.worker")
        self.outbox.send(("init", config))
        self.ready = False
        self.queue: deque = deque()  # (episode, message, submitted) not sent yet
        self.current: tuple | None = None  # (episode, submitted, deadline) in flight
        self.episodes: set[int] = set()


def _kill_all(processes: list[_Process]) -> None:
    for p in processes:
        p.kill()


class EnvironmentWorkers:
    """The environments of the episodes in flight (`forget` them when they are over)."""

    def __init__(self, config):
        self.config, self.timeout_s = config, config.env.timeout_s
        self.results: dict[int, Outcome] = {}
        self.lost: dict[int, str] = {}  # episodes whose environment died with its worker: why
        self.local = None
        if config.env.num_workers == 0:
            try:
                self.local = EpisodeHost(config)
            except Exception as e:  # the user's environment: its failure to build is a setup error  # noqa: BLE001
                raise ConfigError(f"env.name={config.env.name}: the environment does not build: "
                                  f"{type(e).__name__}: {e}") from e
        self.processes = [] if self.local else [_Process(config) for _ in range(config.env.num_workers)]
        self._finalizer = weakref.finalize(self, _kill_all, self.processes)
        for slot in range(len(self.processes)):
            self._await_ready(slot)

    def close(self) -> None:
        self._finalizer()

    def _await_ready(self, slot: int) -> None:
        p = self.processes[slot]
        if not p.inbox.poll(STARTUP_TIMEOUT_S):
            raise RuntimeError(f"an environment worker did not start in {STARTUP_TIMEOUT_S:g} s; run `"
                               f"{sys.executable} -m jgrpo.envs.worker` to see why")
        try:
            message = p.inbox.recv()
        except EOFError:
            raise RuntimeError(f"an environment worker exited at start (code {p.proc.wait()}); its stderr above "
                               "says why") from None
        if message[0] == "setup_error":
            self.close()
            raise ConfigError(f"env.name={self.config.env.name}: the environment does not build: {message[1]}")
        p.ready = True

    def submit(self, episode: int, op: str, *args) -> None:
        """Start `op` ("reset" or "step") on `episode`'s environment; `result(episode)` collects it."""
        submitted = time.monotonic()
        if self.local is not None:
            try:
                value, error = self.local.call(op, episode, *args), None
            except Exception as e:  # noqa: BLE001 - an environment's failure fails its episode
                value, error = None, f"{op} raised {type(e).__name__}: {e}"
            self.results[episode] = Outcome(value, error, time.monotonic() - submitted)
            return
        if episode in self.lost:
            self.results[episode] = Outcome(None, self.lost[episode])
            return
        p = self.processes[episode % len(self.processes)]
        p.episodes.add(episode)
        p.queue.append((episode, (op, episode, *args), submitted))
        self._pump(0.0)

    def result(self, episode: int) -> Outcome:
        """Episode `episode`'s answer, waiting for it (at most the timeout of each call queued before it)."""
        while episode not in self.results:
            self._pump(None)
        return self.results.pop(episode)

    def forget(self, episodes) -> None:
        """The episodes are over: their environments are deleted (in the workers, once their calls are done)."""
        episodes = set(episodes)
        for e in episodes:
            self.results.pop(e, None)
            self.lost.pop(e, None)
        if self.local is not None:
            for e in episodes:
                self.local.episodes.pop(e, None)
            return
        for p in self.processes:
            mine = p.episodes & episodes
            if mine:
                p.episodes -= mine
                p.queue.append((None, ("forget", sorted(mine)), time.monotonic()))
        self._pump(0.0)

    # ------------------------------------------------------------------ the processes

    def _send_next(self, slot: int) -> None:
        p = self.processes[slot]
        while p.current is None and p.queue:
            episode, message, submitted = p.queue.popleft()
            try:
                p.outbox.send(message)
            except OSError:
                self._fail_worker(slot, f"its worker died (exit code {p.proc.poll()})")
                return
            except Exception as e:  # noqa: BLE001 - e.g. a row that cannot be pickled
                self.results[episode] = Outcome(None, f"cannot send the call: {type(e).__name__}: {e}")
                continue
            if episode is not None:  # a call (`forget` has no answer)
                p.current = (episode, submitted, time.monotonic() + self.timeout_s)

    def _pump(self, timeout: float | None = None) -> None:
        """Send what is queued, receive what has arrived (waiting up to `timeout`, None: until something
        arrives or a deadline passes), and fail the calls past their deadline."""
        for slot in range(len(self.processes)):
            self._send_next(slot)
        busy = [p for p in self.processes if p.current is not None]
        if not busy:
            return
        if timeout is None:
            timeout = max(0.0, min(p.current[2] for p in busy) - time.monotonic())
        by_conn = {p.inbox: slot for slot, p in enumerate(self.processes) if p.current is not None}
        for conn in wait(list(by_conn), timeout=timeout):
            slot = by_conn[conn]
            p = self.processes[slot]
            try:
                episode, status, value = conn.recv()
            except (EOFError, OSError):
                self._fail_worker(slot, f"its worker died (exit code {p.proc.poll()})")
                continue
            _, submitted, _ = p.current
            p.current = None
            self.results[episode] = Outcome(value if status == "ok" else None, None if status == "ok" else value,
                                            time.monotonic() - submitted)
            self._send_next(slot)
        now = time.monotonic()
        for slot, p in enumerate(self.processes):
            if p.current is not None and p.current[2] <= now:
                self._fail_worker(slot, f"no answer after env.timeout_s={self.timeout_s:g} s")

    def _fail_worker(self, slot: int, why: str) -> None:
        """The worker's call in flight fails with `why`, its queued calls with it, and its other episodes lose
        their state (their next call fails); a fresh worker replaces it."""
        p = self.processes[slot]
        lost = f"its worker was restarted ({why})"
        if p.current is not None:
            episode, submitted, _ = p.current
            self.results[episode] = Outcome(None, why, time.monotonic() - submitted)
        for episode, _, submitted in p.queue:
            if episode is not None:
                self.results[episode] = Outcome(None, lost, time.monotonic() - submitted)
        self.lost.update({e: lost for e in p.episodes if e not in self.results})
        self._restart(slot, why)

    def _restart(self, slot: int, why: str) -> None:
        if why:
            log.warning("environment worker %d restarted: %s", slot, why)
        self.processes[slot].kill()
        self.processes[slot] = _Process(self.config)
        self._await_ready(slot)
