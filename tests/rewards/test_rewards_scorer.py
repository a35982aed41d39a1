"""The reward scorer: weights, grouping, and containment of reward functions that fail, hang, spin or crash.

The misbehaving functions below live in this module so the worker processes can import them by name.
"""

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from jgrpo.config import RewardConfig
from jgrpo.rewards import RewardScorer
from jgrpo.rewards.registry import reward_path

HERE = Path(__file__).parent


def flaky(prompt, completion, reference):
    """1.0, unless the completion asks for a particular way of failing."""
    if completion == "boom":
        raise ValueError("boom requested")
    if completion == "hang":
        while True:
            time.sleep(1000)
    if completion == "spin":
        while True:  # pure-Python busy loop: holds the GIL, only a process kill stops it
            pass
    if completion == "crash":
        os._exit(3)
    if completion == "none":
        return None
    if completion == "nan":
        return float("nan")
    return 1.0


RETURNS = {  # completion -> what `typed` returns; None of the non-numbers may count as a reward
    "str": "0.5", "none": None, "nan": float("nan"), "inf": float("inf"), "list": [1.0], "vector": np.ones(1),
    "complex": 1j, "dict": {"value": 1.0},
    "true": True, "false": False, "np32": np.float32(0.25), "int": 3, "zero_d": np.array(0.75),
}


def typed(prompt, completion, reference):
    return RETURNS[completion]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def _wait_dead(pids, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if not any(_alive(p) for p in pids):
            return True
        time.sleep(0.1)
    return False


def test_weights_grouping_and_metrics():
    config = RewardConfig(functions=("exact_numeric", "format"), weights=(1.0, 0.5), num_workers=1)
    with RewardScorer(config) as scorer:
        # 2 prompts x G=3 completions; rows b*G .. b*G+G-1 belong to prompt b.
        completions = ["1", "<think>a</think><answer>1</answer>", "2", "2", "7", "<think>a</think><answer>2</answer>"]
        result = scorer.score(["p0", "p1"], completions, [{"answer": "1"}, {"answer": "2"}])
    np.testing.assert_array_equal(result.per_function["exact_numeric"], [1, 1, 0, 1, 0, 1])
    np.testing.assert_array_equal(result.per_function["format"], [0, 1, 0, 0, 0, 1])
    np.testing.assert_allclose(result.total, [1, 1.5, 0, 1, 0, 1.5])
    assert result.total.dtype == np.float32 and result.failures == {"exact_numeric": 0, "format": 0}
    metrics = result.metrics()
    assert metrics["reward/exact_numeric"] == pytest.approx(4 / 6)
    assert metrics["reward/format/failures"] == 0.0


def test_bad_configs_fail_when_the_scorer_is_built():
    with pytest.raises(ValueError, match="unknown reward function 'gsm8'"):
        RewardScorer(RewardConfig(functions=("gsm8",)))
    with pytest.raises(ValueError, match="twice"):
        RewardScorer(RewardConfig(functions=("gsm8k", "gsm8k"), weights=(1.0, 1.0)))

    def local(prompt, completion, reference):
        return 1.0

    with pytest.raises(ValueError, match="module-level"):
        reward_path(local)
    local.__module__, local.__qualname__ = "__main__", "local"
    with pytest.raises(ValueError, match="__main__"):
        reward_path(local)


@pytest.mark.timeout(120)
def test_failing_hanging_spinning_and_crashing_rewards_are_contained(caplog):
    config = RewardConfig(functions=("exact_numeric", f"{__name__}:flaky"), weights=(1.0, 0.5),
                          timeout_s=1.0, num_workers=2)
    completions = ["42", "boom", "hang", "spin", "crash", "none", "nan", "42"]
    with RewardScorer(config) as scorer:
        scorer.score(["warm-up"], ["1"], [{"answer": "1"}])  # workers started and ready
        pids_before = set(scorer._pool.pids)
        start = time.monotonic()
        with caplog.at_level(logging.INFO, logger="jgrpo.rewards"):
            result = scorer.score(["q"], completions, [{"answer": "42"}])
        elapsed = time.monotonic() - start
        name = f"{__name__}:flaky"
        np.testing.assert_array_equal(result.per_function[name], [1, 0, 0, 0, 0, 0, 0, 1])
        np.testing.assert_array_equal(result.per_function["exact_numeric"], [1, 0, 0, 0, 0, 0, 0, 1])
        np.testing.assert_allclose(result.total, [1.5, 0, 0, 0, 0, 0, 0, 1.5])
        assert result.failures == {"exact_numeric": 0, name: 6}
        assert result.timeouts == {"exact_numeric": 0, name: 2}
        # Two 1 s timeouts plus worker restarts; a hung call would never return at all.
        assert elapsed < 45, elapsed
        assert any("gave 0 to 6 of 8 samples (2 timed out" in r.getMessage() for r in caplog.records)
        # The stuck and crashed workers were killed and replaced.
        replaced = pids_before - set(scorer._pool.pids)
        assert replaced and _wait_dead(replaced, 10)

        # The next batch is not blocked by anything left over.
        start = time.monotonic()
        result = scorer.score(["q"], ["42", "41"], [{"answer": "42"}])
        np.testing.assert_array_equal(result.total, [1.5, 0.5])
        assert sum(result.failures.values()) == 0
        assert time.monotonic() - start < 20
        pids = scorer._pool.pids
    assert _wait_dead(pids, 10), "close() must stop the workers"


def _run_script(code: str, **kwargs) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), *sys.path]))
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE,
                            text=True, env=env, **kwargs)


@pytest.mark.timeout(120)
def test_interpreter_exit_is_not_held_up_and_leaves_no_workers():
    proc = _run_script("""
        from jgrpo.config import RewardConfig
        from jgrpo.rewards import RewardScorer
        scorer = RewardScorer(RewardConfig(functions=("test_rewards_scorer:flaky",), timeout_s=0.5))
        result = scorer.score(["q"], ["hang", "1"], [{}])
        print(*scorer._pool.pids, int(result.timeouts["test_rewards_scorer:flaky"]), flush=True)
        # exits without close(): the finalizer must kill the workers, nothing may wait on them
    """)
    out, _ = proc.communicate(timeout=90)
    assert proc.returncode == 0
    *pids, timeouts = map(int, out.split())
    assert timeouts == 1
    assert _wait_dead(pids, 10)


@pytest.mark.timeout(120)
def test_workers_exit_when_their_parent_is_killed_mid_call():
    proc = _run_script("""
        from jgrpo.config import RewardConfig
        from jgrpo.rewards import RewardScorer
        scorer = RewardScorer(RewardConfig(functions=("test_rewards_scorer:flaky",), timeout_s=300, num_workers=1))
        scorer.score(["q"], ["1"], [{}])
        print(*scorer._pool.pids, flush=True)
        scorer.score(["q"], ["hang"], [{}])  # killed with SIGKILL while the worker sleeps in here
    """)
    pids = [int(p) for p in proc.stdout.readline().split()]
    assert pids and all(_alive(p) for p in pids)
    time.sleep(0.5)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert _wait_dead(pids, 15), "an orphaned worker must notice and exit"


@pytest.mark.timeout(120)
def test_workers_that_cannot_start_give_a_clear_error():
    from jgrpo.rewards.pool import RewardWorkerPool

    pool = RewardWorkerPool(["no_such_module_xyz:fn"], num_workers=1, timeout_s=1.0)
    with pytest.raises(RuntimeError, match="reward workers fail to start"):
        pool.run([("no_such_module_xyz:fn", "p", "c", {})])
    with pytest.raises(RuntimeError, match="closed"):
        pool.run([])


def test_reward_values_must_be_real_numbers_and_each_kind_of_failure_is_logged_once(caplog):
    """docs/guide.md: a value that is not a finite real number scores 0 and is counted as a failure."""
    name = f"{__name__}:typed"
    completions = list(RETURNS)
    with RewardScorer(RewardConfig(functions=(name,), num_workers=1)) as scorer:
        with caplog.at_level(logging.WARNING, logger="jgrpo.rewards"):
            first = scorer.score(["q"], completions, [{}])
            second = scorer.score(["q"], completions, [{}])
    expected = [0, 0, 0, 0, 0, 0, 0, 0, 1.0, 0.0, 0.25, 3.0, 0.75]  # bool counts (True = 1), '0.5' does not
    for result in (first, second):
        np.testing.assert_array_equal(result.per_function[name], np.asarray(expected, np.float32))
        assert result.failures[name] == 8 and result.metrics()[f"reward/{name}/failures"] == 8.0
    kinds = {"not a number (str): returned '0.5'": "'str'", "not a number (NoneType)": "'none'",
             "not finite (nan)": "'nan'", "not finite (inf)": "'inf'", "not a number (list)": "'list'",
             "not a number (ndarray of shape (1,))": "'vector'", "not a number (complex)": "'complex'",
             "not a number (dict)": "'dict'"}
    messages = [r.getMessage() for r in caplog.records]
    for kind, completion in kinds.items():
        logged = [m for m in messages if kind in m]
        assert len(logged) == 1, (kind, logged)  # once, though two batches had it
        assert logged[0].endswith(f"The completion: {completion}")
