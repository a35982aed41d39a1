"""A one-job async run with weights updated in flight (`rollout.weight_updates: in_flight`), killed with SIGKILL
after its checkpoint at iteration 3 and resumed, ends bit for bit equal to the uninterrupted run: the checkpoint
keeps the sampler's pool at the boundary where version 3 took effect (rows in flight with their keys/values, the
batches sampled and not trained), so each prompt is trained once and every token is the one the uninterrupted run
drew (its own module: a worker of its own under xdist)."""

import signal

import pytest

from jgrpo.training.metrics_log import read_metrics
from tests.entrypoints.runs import final_state, finish, train, wait_for

IN_FLIGHT = ("rollout.mode=async", "rollout.weight_updates=in_flight", "rollout.max_staleness=2",
             "grpo.behaviour_refresh=1", "grpo.off_policy_ratio=recentred", "sampler.max_new_tokens=16",
             "sampler.decode_chunk=2")
TIMING = ("rollout/producer_idle", "rollout/trainer_wait", "rollout/queue_depth")  # when, not what


def _metrics(run_dir):
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "throughput/")) and k not in TIMING}
            for r in read_metrics(run_dir)]


@pytest.fixture(scope="module")
def straight_in_flight_run(tmp_path_factory, env):
    run_dir = tmp_path_factory.mktemp("straight_in_flight")
    code, out = finish(train(run_dir, env, *IN_FLIGHT))
    assert code == 0, out[-3000:]
    return run_dir


def test_killed_then_resumed_in_flight_equals_uninterrupted(tmp_path, env, straight_in_flight_run):
    records = _metrics(straight_in_flight_run)
    assert max(r["rollout/versions_per_row_max"] for r in records) >= 2  # rows spanned versions
    killed = tmp_path / "killed"
    proc = train(killed, env, *IN_FLIGHT)
    wait_for(lambda: (killed / "checkpoints" / "3").is_dir(), proc)
    proc.send_signal(signal.SIGKILL)  # no chance to save anything more
    proc.wait()
    assert not (killed / "checkpoints" / "6").exists()
    code, out = finish(train(killed, env, *IN_FLIGHT))
    assert code == 0, out[-3000:]
    assert "resumed from iteration 3" in out
    assert final_state(killed) == final_state(straight_in_flight_run)  # params, optimiser, rng, counters, data
    assert _metrics(killed) == records  # the same tokens, rewards and losses in every iteration
