"""Environment workers: answers in order, and every failure contained as an Outcome (never an exception), the
worker replaced; a class that does not build is a config error at start."""

import time

import pytest

from jgrpo.config import Config, ConfigError, EnvConfig
from jgrpo.envs.base import Turn
from jgrpo.envs.workers import EnvironmentWorkers

TURN = Turn(0, (1, 2), "text", (), None, False)
ROW = {"question": "q1"}



def workers(name, num_workers=1, timeout_s=2.0):
    return EnvironmentWorkers(Config(env=EnvConfig(name=f"tests.envs.scripted_envs:{name}", num_workers=num_workers,
                                                   timeout_s=timeout_s)))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_episodes_keep_their_state_between_calls(num_workers):
    w = workers("Scripted", num_workers)
    try:
        for e in range(3):
            w.submit(e, "reset", {"question": f"q{e}", "turns": 2}, 1000 + e)
        assert [w.result(e).value for e in range(3)] == [[{"role": "user", "content": f"q{e} (seed {e})"}]
                                                         for e in range(3)]
        for e in range(3):
            w.submit(e, "step", TURN)
        first = [w.result(e).value for e in range(3)]
        assert all(not r.done and r.reward == 0.25 and r.reply[0]["content"] == "go on (1)" for r in first)
        for e in range(3):
            w.submit(e, "step", TURN)
        assert all(w.result(e).value.done for e in range(3))
    finally:
        w.close()


@pytest.mark.parametrize("name, error", [("Raises", "step raised RuntimeError: the environment broke"),
                                         ("BadReturn", "step must return"),
                                         ("Hangs", "no answer after env.timeout_s=1 s"),
                                         ("Exits", "its worker died")])
def test_failures_are_outcomes_and_the_worker_is_replaced(name, error):
    w = workers(name, timeout_s=1.0)
    try:
        for e in range(2):
            w.submit(e, "reset", ROW, e)
            assert w.result(e).error is None
        started = time.monotonic()
        w.submit(0, "step", TURN)
        w.submit(1, "step", TURN)  # queued behind episode 0 on the same worker
        first, second = w.result(0), w.result(1)
        assert error in first.error and first.value is None
        assert second.error is not None  # its call failed too, or its worker (and state) went with episode 0's
        assert time.monotonic() - started < 30
        # The next batch runs on a healthy worker.
        w.forget([0, 1])
        w.submit(5, "reset", ROW, 5)
        assert w.result(5).error is None
    finally:
        w.close()


def test_a_reset_that_raises_fails_only_its_episode():
    w = workers("RaisesOnSecondRow", 0)
    w.submit(0, "reset", {"question": "q1"}, 0)
    w.submit(1, "reset", {"question": "q2"}, 0)
    assert w.result(0).error is None
    assert "reset raised KeyError" in w.result(1).error


@pytest.mark.parametrize("num_workers", [0, 1])
def test_an_environment_that_does_not_build_is_a_config_error(num_workers):
    with pytest.raises(ConfigError, match="does not build: ImportError: the simulator is not installed"):
        workers("DoesNotBuild", num_workers)
    with pytest.raises(ConfigError, match="does not build: ValueError: the environment module 'no_such_module'"):
        EnvironmentWorkers(Config(env=EnvConfig(name="no_such_module:X", num_workers=num_workers)))
