"""An environment worker process: `python -m jgrpo.envs.worker` (started by `jgrpo.envs.workers`, not by people).

It reads `("init", config)` once (it builds one environment to fail early: a class that does not build is a
setup error, answered `("setup_error", message)`), then `("reset", episode, row, seed)`, `("step", episode,
turn)` and `("forget", episodes)` (no answer) on stdin, and answers `(episode, "ok", value)` or `(episode,
"error", "<what went wrong>")` on its original stdout; environments that print go to stderr. One environment
instance per episode lives here between its calls. The parent kills a worker whose call runs past
`env.timeout_s`; a worker exits when its parent disappears or closes stdin.
"""

from __future__ import annotations

import math
import numbers
import os

from jgrpo.envs.base import StepResult
from jgrpo.parallel.subprocesses import child_pipes


def checked_messages(messages, what: str) -> list[dict]:
    if not isinstance(messages, list | tuple) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages):
        raise TypeError(f"{what} must return a list of messages {{'role': str, 'content': str}}, got "
                        f"{messages!r:.120}")
    return [dict(m) for m in messages]


def checked_step(result) -> StepResult:
    """`step`'s return value as a StepResult, or TypeError saying what is wrong with it."""
    if not isinstance(result, tuple) or not 1 <= len(result) <= 4:
        raise TypeError(f"step must return (reply, reward, done[, info]), got {result!r:.120}")
    result = StepResult(*result)
    reply = result.reply
    if reply and all(isinstance(x, int) and not isinstance(x, bool) for x in reply):
        reply = [int(x) for x in reply]
    else:
        reply = checked_messages(reply, "step's reply")
    reward = result.reward
    if reward is not None:
        if not isinstance(reward, numbers.Real) or not math.isfinite(float(reward)):
            raise TypeError(f"step's reward must be a finite number or None, got {reward!r:.60}")
        reward = float(reward)
    if not isinstance(result.done, bool):
        raise TypeError(f"step's done must be a bool, got {result.done!r:.60}")
    info = dict(result.info or {})
    return StepResult(reply, reward, result.done, {str(k): float(v) for k, v in info.items()})


class EpisodeHost:
    """The episodes' environment instances and the calls on them (also used in-process, `env.num_workers: 0`)."""

    def __init__(self, config):
        from jgrpo.envs.builtin import environment_class

        self.config, self.cls = config, environment_class(config.env.name)
        self.cls(config)  # builds, or raises: a setup error
        self.episodes = {}

    def call(self, op: str, episode: int, *args):
        if op == "reset":
            env = self.episodes[episode] = self.cls(self.config)
            return checked_messages(env.reset(*args), "reset")
        if op == "step":
            return checked_step(self.episodes[episode].step(*args))
        raise ValueError(f"unknown operation {op!r}")


def main() -> None:
    inbox, outbox = child_pipes()
    _, config = inbox.recv()
    try:
        host = EpisodeHost(config)
    except BaseException as e:  # noqa: BLE001 - reported to the parent as a setup error
        outbox.send(("setup_error", f"{type(e).__name__}: {e}"[:2000]))
        return
    outbox.send(("ready", os.getpid()))
    while True:
        try:
            message = inbox.recv()
        except EOFError:
            return
        if message[0] == "forget":
            for episode in message[1]:
                host.episodes.pop(episode, None)
            continue
        op, episode, *args = message
        try:
            outbox.send((episode, "ok", host.call(op, episode, *args)))
        except BaseException as e:  # noqa: BLE001 - an environment's failure fails its episode, never the worker
            outbox.send((episode, "error", f"{op} raised {type(e).__name__}: {e}"[:2000]))


if __name__ == "__main__":
    main()
