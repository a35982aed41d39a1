"""Environments for the tests, importable by the worker processes (`scripted_envs:Class`)."""

import os
import time

from jgrpo.envs.base import Environment, StepResult


class Scripted(Environment):
    """Replies "go on (t)" until the row's `turns` turns (default 3) are done; reward 0.25 per turn and 1 at the
    end. `JGRPO_TEST_LATENCY` seconds (environment variable) of sleep per step: a slow environment."""

    def reset(self, row, seed):
        self.turns, self.seen = int(row.get("turns", 3)), 0
        return [{"role": "user", "content": f"{row['question']} (seed {seed % 1000})"}]

    def step(self, turn):
        time.sleep(float(os.environ.get("JGRPO_TEST_LATENCY", "0")))
        self.seen += 1
        if self.seen >= self.turns:
            return StepResult([], 1.0, True)
        return StepResult([{"role": "user", "content": f"go on ({self.seen})"}], 0.25, False)


class Raises(Scripted):
    def step(self, turn):
        raise RuntimeError("the environment broke")


class RaisesOnSecondRow(Scripted):
    def reset(self, row, seed):
        if "2" in row["question"]:
            raise KeyError("no such row")
        return super().reset(row, seed)


class Hangs(Scripted):
    def step(self, turn):
        time.sleep(3600)


class Exits(Scripted):
    def step(self, turn):
        os._exit(3)


class BadReturn(Scripted):
    def step(self, turn):
        return "not a step result"


class DoesNotBuild(Environment):
    def __init__(self, config):
        raise ImportError("the simulator is not installed")


def pays_for_any_text(prompt, completion, reference):
    """A reward function (`reward.functions`): 1 for a non-empty scored text, 0 for an empty one."""
    return float(bool(completion.strip()))


class Lengths(Environment):
    """Answers each turn with its length in characters until a turn's length is a multiple of 3 or 3 turns are
    done; reward 0.1 per reply and (the last turn's length mod 5) / 4 at the end: episodes whose turns, lengths and
    rewards follow the sampled tokens (a group's spread)."""

    def reset(self, row, seed):
        self.seen = 0
        return [{"role": "user", "content": f"{row['question']} (seed {seed % 1000})"}]

    def step(self, turn):
        self.seen += 1
        n = len(turn.text)
        if n % 3 == 0 or self.seen >= 3:
            return StepResult([], (n % 5) / 4, True)
        return StepResult([{"role": "user", "content": f"{n} characters"}], 0.1, False)
