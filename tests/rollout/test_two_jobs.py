"""Two jobs (`rollout.role: trainer|rollout`): a trainer job and a rollout job joined by a TCP channel, each its own
process with 2 CPU devices, as on two slices. The one-job reference is async with `mesh.rollout_devices` of the
same sizes (2 + 2 devices), run alongside.

At max_staleness 0 the rollout job samples batch j only with the weights of version j (the trainer's publish
after iteration j), with the key fold_in(sample_root, j): so the two-job run's tokens are the one-job run's, and
its params end within rounding of them, also with the rollout job killed (-9) in the middle and restarted,
and the trainer preempted (SIGTERM) and started again.
"""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest

from jgrpo.config import ConfigError
from jgrpo.config.loading import to_dict
from jgrpo.parallel.channel import ChannelClosed, connect
from jgrpo.rollout.process_links import split_rollout
from jgrpo.rollout.remote import CODEC, RemoteRollouts, RolloutJobLost, config_differences
from jgrpo.training.metrics_log import read_jsonl, read_metrics
from jgrpo.training.trainer import Trainer
from tests.helpers import ROOT, child_xla_flags, tiny_config
from tests.parallel.test_multihost import _finish, _free_port, _params

ASYNC = ["reward.functions=[tests.helpers:space_fraction]", "rollout.mode=async", "rollout.max_staleness=0",
         "grpo.beta=0.04", "optim.learning_rate=1e-2", "checkpoint.every=5", "logging.samples_every=1"]


@pytest.mark.parametrize("overrides, message", [
    (["rollout.role=trainer", "rollout.mode=async"], r"rollout.endpoint='' is not allowed: host:port"),
    (["rollout.role=rollout", "rollout.endpoint=h:1"], r"rollout.mode='sync' is not allowed: async with rollout.role"),
    (["rollout.role=trainer", "rollout.endpoint=h:1", "rollout.mode=async", "mesh.rollout_devices=2"],
     r"mesh.rollout_devices=2 is not allowed: 0 with rollout.role=trainer"),
    (["rollout.sync_bucket_mb=0"], r"rollout.sync_bucket_mb=0"),
    (["rollout.wait_timeout_s=0"], r"rollout.wait_timeout_s=0"),
])
def test_two_job_config_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        tiny_config(None, *overrides)


def test_a_rollout_job_with_another_config_is_refused_naming_the_keys():
    port = _free_port()
    trainer = tiny_config(None, *ASYNC, "rollout.role=trainer", f"rollout.endpoint=127.0.0.1:{port}")
    rollout = tiny_config(None, *ASYNC, "rollout.role=rollout", f"rollout.endpoint=127.0.0.1:{port}", "grpo.beta=0.1",
                          "sampler.temperature=0.7")
    assert config_differences(to_dict(trainer), to_dict(rollout)) == ["grpo.beta", "sampler.temperature"]
    mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
    intake = RemoteRollouts(trainer, first_index=0, dropped=0, data_state={}, prompt_width=16, train_mesh=mesh)
    try:
        channel = connect(f"127.0.0.1:{port}", CODEC, wait_s=10)
        channel.send("hello", {"config": to_dict(rollout)})
        kind, body = channel.recv(timeout=30)
        assert kind == "refused"
        assert "differs from the trainer's in grpo.beta, sampler.temperature (all keys but" in body["reason"]
    finally:
        intake.close()


def test_a_trainer_without_its_rollout_job_saves_and_stops_naming_the_endpoint(tmp_path):
    port = _free_port()
    config = tiny_config(tmp_path, *ASYNC, "rollout.role=trainer", f"rollout.endpoint=127.0.0.1:{port}",
                         "rollout.wait_timeout_s=1", "run.iterations=2")
    trainer = Trainer(config)
    try:
        with pytest.raises(RolloutJobLost, match=f"no rollout job connected to 127.0.0.1:{port} for 1 s"):
            trainer.run()
    finally:
        trainer.close()
    assert (tmp_path / "checkpoints" / "0").is_dir()  # saved before it stopped


def _job(run_dir, role, *overrides, devices=2, process=None):
    """`python -m jgrpo.train` as one process of a job; `process` = (coordinator, count, index) of its world."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JGRPO_")}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=child_xla_flags(devices),
               PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]))
    if process is not None:
        coordinator, count, index = process
        env.update(JGRPO_COORDINATOR=coordinator, JGRPO_NUM_PROCESSES=str(count), JGRPO_PROCESS_ID=str(index))
    cmd = [sys.executable, "-m", "jgrpo.train", "configs/tiny.yaml", f"run.output_dir={run_dir}", "run.iterations=5",
           *ASYNC, f"rollout.role={role}", *overrides]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_for_record(run_dir, iteration, procs, timeout=300):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (run_dir / "metrics.jsonl").is_file() and len(read_metrics(run_dir)) >= iteration:
            return
        for proc in procs:
            if proc.poll() is not None:
                out, _ = proc.communicate()
                pytest.fail(f"a job exited with {proc.returncode} before iteration {iteration}:\n{out[-4000:]}")
        time.sleep(0.2)
    pytest.fail(f"no record of iteration {iteration} in {timeout} s")


def _prompts_by_iteration(run_dir) -> list[list[str]]:
    rows = read_jsonl(run_dir / "samples.jsonl")
    by = {}
    for row in rows:
        by.setdefault(row["iteration"], []).append(row["prompt"])
    return [sorted(set(by[k])) for k in sorted(by)]


def test_two_jobs_match_one_job_and_survive_a_killed_rollout_job(tmp_path):
    one, two = tmp_path / "one_job", tmp_path / "two_jobs"
    endpoint = f"rollout.endpoint=127.0.0.1:{_free_port()}"
    reference = _job(one, "both", "mesh.rollout_devices=2", devices=4)
    trainer = _job(two, "trainer", endpoint)
    rollout = _job(two, "rollout", endpoint)
    _wait_for_record(two, 2, [trainer, rollout])
    rollout.kill()  # -9: no goodbye, the socket just closes
    rollout.communicate()
    restarted = _job(two, "rollout", endpoint)
    _wait_for_record(two, 3, [trainer, restarted])
    # A preempted trainer saves and exits 0; the rollout job waits for it (it is not the run's end) and the
    # trainer started again resumes from its checkpoint.
    trainer.send_signal(signal.SIGTERM)
    log, _ = trainer.communicate(timeout=600)
    assert trainer.returncode == 0 and "preemption requested" in log, log[-4000:]
    # The trainer saw the job go, and told the new one to start at the first batch it had not received.
    assert "lost rollout process 0" in log, log[-4000:]
    starts = re.findall(r"the rollout job at \S+ starts at batch (\d+)", log)
    assert len(starts) == 2 and starts[0] == "0" and int(starts[1]) >= 2, starts
    time.sleep(2)
    assert restarted.poll() is None, "the rollout job ended with the preempted trainer"
    resumed = _job(two, "trainer", endpoint)
    _finish([resumed, restarted, reference], timeout=600)

    # Each prompt trained once, in the one-job run's order, and the same tokens: the same params up to rounding.
    assert _prompts_by_iteration(two) == _prompts_by_iteration(one)
    assert len({p for it in _prompts_by_iteration(two) for p in it}) == 5 * 4
    got, want = _params(two, 5), _params(one, 5)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-6)
    for r, ref in zip(read_metrics(two), read_metrics(one), strict=True):
        for key in ("reward/mean", "loss/loss", "kl/mean", "optim/steps", "completion/length_mean"):
            np.testing.assert_allclose(r[key], ref[key], rtol=1e-5, atol=1e-7, err_msg=f"{key} at {r['iteration']}")
    assert read_metrics(two)[-1]["kl/mean"] > 0  # the params moved away from the reference
    records = read_metrics(two)
    assert [r["iteration"] for r in records] == [1, 2, 3, 4, 5]
    assert all(r["rollout/staleness"] == 0 and r["rollout/dropped"] == 0 for r in records)
    assert all(r["rollout/weight_sync_gb"] > 0 for r in records)
    # The rollout job writes nothing of its own under run.output_dir.
    assert sorted(p.name for p in two.iterdir()) == sorted(p.name for p in one.iterdir())
    assert json.loads((two / "metrics.jsonl").read_text().splitlines()[0])["iteration"] == 1


def test_two_jobs_with_lora_sample_what_one_job_samples(tmp_path):
    """LoRA over two jobs: the rollout job loads the frozen base itself and receives only the adapters (here in
    bfloat16 and, after the first publish, as their changes): it samples what one-job async samples on as many
    devices, the same completions to the same prompts, and the trainer ends with the same adapters."""
    one, two = tmp_path / "one_job", tmp_path / "two_jobs"
    endpoint = f"rollout.endpoint=127.0.0.1:{_free_port()}"
    lora = ["model.lora.rank=4", "sampler.weights_dtype=bfloat16", "rollout.weight_delta=always", "run.iterations=2",
            "checkpoint.every=2"]
    jobs = [_job(one, "both", *lora), _job(two, "trainer", endpoint, *lora), _job(two, "rollout", endpoint, *lora)]
    _finish(jobs, timeout=600)
    assert read_jsonl(two / "samples.jsonl") == read_jsonl(one / "samples.jsonl")
    for g, w in zip(jax.tree.leaves(_params(two, 2)), jax.tree.leaves(_params(one, 2)), strict=True):
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-6)
    records = read_metrics(two)
    assert [r["rollout/weight_as_changes"] for r in records] == [0.0, 1.0]  # whole once, then changes
    assert all(r["rollout/weight_mismatches"] == 0 for r in records)
    # The adapters alone cross (a few KB); the tiny model's whole sampling copy would be 6 MB.
    assert 0 < max(r["rollout/weight_sync_gb"] for r in records) < 1e-4


# ---------------------------------------------------------------- pod: `python -m pytest tests -m pod` (not in CI)


def _trained_each_prompt_once_within_the_bound(two, one) -> list[dict]:
    """Six iterations at staleness <= 1, each of 24 prompts trained once, in the one-job run's order; the records."""
    records = read_metrics(two)
    assert [r["iteration"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert all(r["rollout/staleness"] <= 1 for r in records)
    assert _prompts_by_iteration(two) == _prompts_by_iteration(one)
    assert len({p for it in _prompts_by_iteration(two) for p in it}) == 6 * 4
    return records


@pytest.mark.pod
@pytest.mark.slow
def test_two_jobs_at_staleness_1_keep_the_bound_and_train_each_prompt_once(tmp_path):
    one, two = tmp_path / "one_job", tmp_path / "two_jobs"
    endpoint = f"rollout.endpoint=127.0.0.1:{_free_port()}"
    stale = ["rollout.max_staleness=1", "run.iterations=6"]
    reference = _job(one, "both", "mesh.rollout_devices=2", *stale, devices=4)
    # Weights device to device (rollout.weight_transfer: jax): at staleness 1 batches arrive while the trainer
    # waits for each bucket's "weights_pulled", and must still be trained in order.
    jax_transfer = [*stale, "rollout.weight_transfer=jax"]
    jobs = [_job(two, "trainer", endpoint, *jax_transfer), _job(two, "rollout", endpoint, *jax_transfer)]
    _finish([*jobs, reference], timeout=600)
    records = _trained_each_prompt_once_within_the_bound(two, one)
    assert records[-1]["rollout/dropped"] == 0


@pytest.mark.pod
@pytest.mark.slow
def test_a_killed_trainer_resumes_and_the_rollout_job_discards_what_it_sampled_ahead(tmp_path):
    one, two = tmp_path / "one_job", tmp_path / "two_jobs"
    endpoint = f"rollout.endpoint=127.0.0.1:{_free_port()}"
    stale = ["rollout.max_staleness=1", "run.iterations=6", "checkpoint.every=1", "checkpoint.async_save=false"]
    reference = _job(one, "both", "mesh.rollout_devices=2", *stale, devices=4)
    trainer, rollout = _job(two, "trainer", endpoint, *stale), _job(two, "rollout", endpoint, *stale)
    _wait_for_record(two, 3, [trainer, rollout])
    trainer.kill()
    trainer.communicate()
    restarted = _job(two, "trainer", endpoint, *stale)
    _finish([restarted, rollout, reference], timeout=600)
    records = _trained_each_prompt_once_within_the_bound(two, one)
    # Sampled ahead for the first trainer (up to the staleness bound), then discarded: its weights are gone.
    assert records[-1]["rollout/discarded_on_resume"] >= 1


@pytest.mark.pod
@pytest.mark.slow
@pytest.mark.parametrize("trainers, rollouts", [(2, 2), (2, 1), (1, 2)])
def test_several_processes_per_job_sample_and_train_as_one_process_per_job(tmp_path, trainers, rollouts):
    """2 + 2 processes (each rollout process sends its rows to its trainer process), 2 trainer + 1 rollout (the
    rollout process cuts its record in two) and 1 + 2 (the trainer process joins two), against 1 + 1."""
    one, two = tmp_path / "one_each", tmp_path / "several"
    # As tests/parallel/test_multihost.py: a small learning rate and a larger Adam eps, so that a gradient entry
    # that is ~0 up to the collectives' rounding does not become a step of +-lr with either sign.
    first = ["run.iterations=3", "checkpoint.every=1", "checkpoint.keep=3", "optim.learning_rate=1e-4",
             "optim.eps=1e-5"]
    e1, e2 = (f"rollout.endpoint=127.0.0.1:{_free_port()}" for _ in range(2))
    reference = [_job(one, role, e1, *first, devices=1) for role in ("trainer", "rollout")]
    counts = {"trainer": trainers, "rollout": rollouts}
    worlds = {role: f"127.0.0.1:{_free_port()}" for role in counts}
    # The multi-process jobs move the weights device to device (each trainer process gathers every bucket on its
    # first device across the processes, the rollout processes it serves pull it); the reference through the host.
    jobs = [_job(two, role, e2, *first, "rollout.weight_transfer=jax", devices=1,
                 process=None if n == 1 else (worlds[role], n, i)) for role, n in counts.items() for i in range(n)]
    _finish([*jobs, *reference], timeout=900)
    # Trainer process 0 logs its own prompts (the first 4 / trainers of each batch): the same prompts, iterations.
    for mine, theirs in zip(_prompts_by_iteration(two), _prompts_by_iteration(one), strict=True):
        assert len(mine) == 4 // trainers and set(mine) <= set(theirs)
    # After the first iteration the same params up to the collectives' rounding (later ones sample from params
    # that differ by rounding, and a draw near a boundary may then differ).
    for g, w in zip(jax.tree.leaves(_params(two, 1)), jax.tree.leaves(_params(one, 1)), strict=True):
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-6)
    assert [r["iteration"] for r in read_metrics(two)] == [1, 2, 3]
    moved = max(float(np.abs(a - b).max()) for a, b in zip(jax.tree.leaves(_params(two, 3)),
                                                          jax.tree.leaves(_params(two, 1)), strict=True))
    assert moved > 1e-5, "the params did not change: the comparison would prove nothing"


def test_a_trainer_process_joins_the_parts_of_two_rollout_processes_in_row_order(tmp_path):
    """1 trainer process, 2 rollout processes (spoken for by this test): each sends its rows of a batch as a part;
    the trainer takes the batch once both parts are in, joined in the rollout processes' order. A connection of an
    older attempt (a job since restarted) is closed when the new one's links are adopted."""
    from jgrpo.parallel.mesh import make_mesh
    from tests.rollout.test_process_links import _rollout

    port = _free_port()
    config = tiny_config(tmp_path, *ASYNC, "rollout.role=trainer", f"rollout.endpoint=127.0.0.1:{port}")
    intake = RemoteRollouts(config, first_index=0, dropped=0, data_state=None, prompt_width=8,
                            train_mesh=make_mesh(config.mesh))
    whole = _rollout(prompts=config.data.batch_size, group=config.grpo.num_generations)
    whole.samples = whole.samples._replace(prompt_routing=None)
    parts = split_rollout(whole, 2)

    def link(process, job, processes=2):
        channel = connect(f"127.0.0.1:{port}", CODEC, wait_s=10)
        channel.send("hello", {"config": to_dict(config), "processes": processes, "process": process, "job": job})
        return channel

    def send(channel, index, part):
        channel.send("record", {"index": index, "version": index, "data_state": {"next": index + 1}, "queued": 0,
                                "idle": 0.0, "rollout": part})

    try:
        old = link(0, "old")
        assert old.recv(timeout=30)[0] == "welcome"
        # The old job is replaced before its other process connects; its part of batch 0 is dropped.
        new = [link(p, "new") for p in (1, 0)]
        assert [c.recv(timeout=30)[0] for c in new] == ["welcome", "welcome"]
        taken = {}

        def take():
            taken["produced"], _ = intake.take(0)

        taker = threading.Thread(target=take)
        taker.start()
        assert [c.recv(timeout=30)[0] for c in new] == ["start", "start"]
        with pytest.raises(ChannelClosed):
            old.recv(timeout=30)
        send(new[0], 0, parts[1])  # rollout process 1's part first: joined in row order all the same
        send(new[1], 0, parts[0])
        taker.join(timeout=60)
        produced = taken["produced"]
        assert (produced.index, produced.version, produced.data_state) == (0, 0, {"next": 1})
        assert produced.rollout.completions == whole.completions and produced.rollout.prompts == whole.prompts
        np.testing.assert_array_equal(np.asarray(produced.rollout.samples.tokens), whole.samples.tokens)
        assert produced.rollout.scores.failures == whole.scores.failures
    finally:
        intake.close()
