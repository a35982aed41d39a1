"""Multi-turn episodes over several processes: each plays its own rows' environments, all drive one slot pool.

A run of `configs/tiny_tools.yaml` with `tests.envs.scripted_envs:Lengths` (episodes whose turns, lengths and
rewards follow the sampled tokens) and stop ids on a quarter of the vocabulary (turns of 1 to ~40 tokens, pausing
at different boundaries), as 2 processes x 2 devices, equals one process with 4 devices: the same episodes
(every env/* metric), rewards, loss and, after the update, params (to rounding: sums over processes in another
order). In CI: fewer slots than episodes, so paused episodes give their slots away and resume in others (the
answers of one process's environments reach the other's calls). Under `pod`: the sampler on its own process
(`mesh.rollout_devices`), window mode, `env.schedule: turn_sync` and a held-out evaluation of episodes; and two
jobs, the episodes played by a rollout job of 2 processes.
"""

import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from jgrpo.training.metrics_log import read_metrics
from tests.helpers import ROOT, child_xla_flags
from tests.parallel.test_multihost import _free_port, _params

STOPS = "[" + ",".join(str(i) for i in range(0, 49152, 4)) + "]"
OVERRIDES = ["env.name=tests.envs.scripted_envs:Lengths", "env.turn_prefix=", f"sampler.stop_token_ids={STOPS}",
             "logging.samples_every=0", "optim.eps=1e-5"]


def _run(run_dir, iterations, processes, *overrides, devices=2, name=None):
    """`python -m jgrpo.train` of the tools config as `processes` processes of `devices` devices, or (1, devices)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JGRPO_")}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "jgrpo.train", "configs/tiny_tools.yaml", f"run.output_dir={run_dir}",
           f"run.iterations={iterations}", f"checkpoint.every={iterations}", *OVERRIDES, *overrides]
    if isinstance(processes, tuple):
        worlds = [dict(env, XLA_FLAGS=child_xla_flags(processes[1]))]
    else:
        coordinator = f"127.0.0.1:{_free_port()}"
        worlds = [dict(env, XLA_FLAGS=child_xla_flags(devices), JGRPO_COORDINATOR=coordinator,
                       JGRPO_NUM_PROCESSES=str(processes), JGRPO_PROCESS_ID=str(i)) for i in range(processes)]
    # Output to files: a full pipe would stall its process.
    logs = [run_dir.parent / f"{name or run_dir.name}_process{i}.log" for i in range(len(worlds))]
    return [(subprocess.Popen(cmd, cwd=ROOT, env=world, stdout=log.open("w"), stderr=subprocess.STDOUT), log)
            for world, log in zip(worlds, logs, strict=True)]


def _finish(procs):
    for proc, log in procs:
        assert proc.wait(timeout=900) == 0, log.read_text()[-4000:]


def _same_runs(split, one, iterations):
    records, reference = read_metrics(split), read_metrics(one)
    assert [r["iteration"] for r in records] == [r["iteration"] for r in reference]  # (0: run.eval_before)
    assert records[-1]["iteration"] == iterations
    for got, want in zip(records, reference, strict=True):
        env_keys = sorted(k for k in want if k.startswith(("env/", "eval/")) and k != "env/wait_s")
        assert sorted(k for k in got if k.startswith(("env/", "eval/")) and k != "env/wait_s") == env_keys
        trained = ["completion/length_mean", "completion/length_max", "reward/mean", "reward/std"] * bool(
            got["iteration"])
        for key in env_keys + trained:
            np.testing.assert_allclose(got[key], want[key], rtol=1e-6, err_msg=f"{key} at {got['iteration']}")
        if got["iteration"]:
            np.testing.assert_allclose(got["loss/loss"], want["loss/loss"], rtol=0, atol=1e-6)
    trained = [r for r in reference if r["iteration"]]
    assert any(r["env/pauses"] > 0 for r in trained) and all(r["reward/std"] > 0 for r in trained)
    assert all(r["env/turns"] % 1 for r in trained)  # episodes of a batch end after different numbers of turns
    # Adam makes a gradient entry that is ~0 up to rounding a step of +-lr: eps (OVERRIDES) keeps such steps small.
    for (path, w), g in zip(jax.tree.leaves_with_path(_params(one, iterations)),
                            jax.tree.leaves(_params(split, iterations)), strict=True):
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-5, err_msg=jax.tree_util.keystr(path))


@pytest.mark.slow
def test_episodes_over_two_processes_equal_one_process(tmp_path):
    # 8 episodes (2 prompts x 4) in 4 slots: paused episodes are parked and resume in free slots.
    split, one = tmp_path / "split", tmp_path / "one"
    reference = _run(one, 1, (1, 4), "sampler.slots=4")  # alongside
    _finish(_run(split, 1, 2, "sampler.slots=4"))
    _finish(reference)
    _same_runs(split, one, 1)


@pytest.mark.pod
@pytest.mark.slow
def test_episodes_with_the_sampler_on_its_own_process_equal_one_process(tmp_path):
    overrides = ("mesh.rollout_devices=2", "rollout.mode=window", "grpo.behaviour_refresh=2",
                 "env.schedule=turn_sync", "run.eval_before=true")
    split, one = tmp_path / "split", tmp_path / "one"
    reference = _run(one, 2, (1, 4), *overrides)
    _finish(_run(split, 2, 2, *overrides))
    _finish(reference)
    _same_runs(split, one, 2)
    assert "eval/turns" in read_metrics(split)[0]


@pytest.mark.pod
@pytest.mark.slow
def test_episodes_in_a_rollout_job_of_two_processes_equal_one_job(tmp_path):
    # Two jobs: a trainer job (1 process x 2 devices) and a rollout job of 2 processes x 1 device, which play the
    # episodes (each rollout process its rows' environments) and send the records; at max_staleness 0, as one job
    # with the sampler on 2 of its 4 devices.
    common = ("rollout.mode=async", "rollout.max_staleness=0")
    endpoint = f"rollout.endpoint=127.0.0.1:{_free_port()}"
    split, one = tmp_path / "two_jobs", tmp_path / "one"
    reference = _run(one, 2, (1, 4), *common, "mesh.rollout_devices=2")
    trainer = _run(split, 2, (1, 2), *common, "rollout.role=trainer", endpoint)
    rollout = _run(split, 2, 2, *common, "rollout.role=rollout", endpoint, devices=1, name="rollout_job")
    _finish(trainer + rollout)
    _finish(reference)
    _same_runs(split, one, 2)
