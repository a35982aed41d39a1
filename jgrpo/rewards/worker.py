"""A reward worker process: `python -m jgrpo.rewards.worker PATH...` (started by pool.py, not by people).

It reads `(task_id, function_path, prompt, completion, reference)` messages on stdin and answers
`(task_id, "ok", value)` or `(task_id, "error", "<kind>: <detail>")` on its original stdout (kinds: "raised
KeyError", "not a number (str)", "not finite (nan)", ...). Reward functions that print
go to stderr instead, so they cannot corrupt the protocol. The parent kills a worker whose call runs past the
timeout; a worker also exits when its parent disappears or closes stdin.
"""

from __future__ import annotations

import math
import numbers
import os
import sys

import numpy as np

from jgrpo.parallel.subprocesses import child_pipes


class NotAReward(Exception):
    """What a reward function returned is not a finite real number; the message starts with its kind."""


def as_reward(value: object) -> float:
    """A reward function's value as a float, or NotAReward("<kind>: <detail>").

    Accepted: int, float (any `numbers.Real`), numpy real scalars, 0-d real arrays (numpy or jax), and bool
    (True = 1.0, False = 0.0: `return answer == gold` is a reward). Not converted: strings, even '0.5' (a
    reward that returns text is a bug to surface, not to parse), None, containers, complex numbers; NaN and
    infinities are not finite. The kind ("not a number (str)", "not finite (nan)") groups failures in the log.
    """
    if isinstance(value, bool | numbers.Real):
        reward = float(value)
    else:
        array = np.asarray(value) if hasattr(value, "__array__") or isinstance(value, np.generic) else None
        if array is None or array.shape != () or array.dtype.kind not in "biuf":
            shape = f" of shape {array.shape}" if array is not None else ""
            raise NotAReward(f"not a number ({type(value).__name__}{shape}): returned {value!r:.60}")
        reward = float(array)
    if not math.isfinite(reward):
        raise NotAReward(f"not finite ({reward}): returned {value!r:.60}")
    return reward


def main(paths: list[str]) -> None:
    inbox, outbox = child_pipes()

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
            outbox.send((task_id, "ok", as_reward(fn(prompt, completion, reference))))
        except NotAReward as e:
            outbox.send((task_id, "error", str(e)[:2000]))
        except BaseException as e:  # noqa: BLE001 - any failure of a reward is reported, never fatal
            outbox.send((task_id, "error", f"raised {type(e).__name__}: {e}"[:2000]))


if __name__ == "__main__":
    main(sys.argv[1:])
