"""A multi-turn run (configs/tiny_tools.yaml: every turn pauses for the calculator and resumes) killed with SIGKILL
and resumed ends bit-for-bit equal to the uninterrupted run (its own module: a worker of its own under xdist)."""

import math

import pytest

from jgrpo.training.metrics_log import read_metrics
from tests.entrypoints.runs import finish, killed_then_resumed, train

TOOLS = ("env.num_workers=1", "env.max_turns=2", "env.max_total_tokens=96")  # with configs/tiny_tools.yaml


@pytest.fixture(scope="module")
def straight_tools_run(tmp_path_factory, env):
    run_dir = tmp_path_factory.mktemp("straight_tools")
    code, out = finish(train(run_dir, env, *TOOLS, config="configs/tiny_tools.yaml"))
    assert code == 0, out[-3000:]
    # configs/tiny_tools.yaml as shipped: a random model's tool calls answered with errors, every turn paused and
    # resumed, in every iteration.
    records = read_metrics(run_dir)
    assert len(records) == 6 and all(r["env/pauses"] > 0 and r["env/tool_call_errors/bad_json"] > 0 for r in records)
    assert all(math.isfinite(r["loss/loss"]) for r in records)
    return run_dir


def test_killed_then_resumed_equals_uninterrupted(tmp_path, env, straight_tools_run):
    killed_then_resumed(tmp_path, env, straight_tools_run, *TOOLS, config="configs/tiny_tools.yaml")
