"""The command-line entrypoints end to end on the tiny config, in fresh processes where it matters.

- a run killed (SIGKILL) after a checkpoint and resumed, and a run stopped by SIGTERM and resumed, both end
  bit-for-bit equal to an uninterrupted run (params, optimiser state, behaviour params, rng, data position,
  metrics), with v = 4 so the behaviour params must come back from the checkpoint;
- eval prints its numbers, export writes an HF directory that transformers loads with the same logits,
  plot draws the run.
"""

import json
import math
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from jgrpo.training.metrics_log import read_metrics
from tests.helpers import ROOT

OVERRIDES = [
    "reward.functions=[tests.helpers:space_fraction]",
    "grpo.behaviour_refresh=4", "grpo.inner_steps=2", "grpo.beta=0.1",
    "run.iterations=6", "checkpoint.every=3", "logging.samples_every=0",
]


@pytest.fixture(scope="module")
def env():
    env = dict(os.environ)
    env.update(
        JAX_PLATFORMS="cpu",
        XLA_FLAGS="--xla_force_host_platform_device_count=8",
        PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]),
        # JAX_COMPILATION_CACHE_DIR: the suite's (tests/conftest.py), inherited: only the first process compiles.
    )
    return env


def _train(run_dir, env, *extra, config="configs/tiny.yaml"):
    cmd = [sys.executable, "-m", "jgrpo.train", config, f"run.output_dir={run_dir}", *OVERRIDES, *extra]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(proc, timeout=600):
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out


def _wait_for(predicate, proc, timeout=600):
    deadline = time.time() + timeout
    while not predicate():
        if proc.poll() is not None:
            raise AssertionError(f"training exited early ({proc.returncode}):\n{proc.stdout.read()[-3000:]}")
        if time.time() > deadline:
            raise AssertionError("timed out waiting for the training process")
        time.sleep(0.1)


def _checkpoint_meta(run_dir, step):
    return json.loads((run_dir / "checkpoints" / str(step) / "meta" / "metadata").read_text())


def _final_state(run_dir):
    meta = _checkpoint_meta(run_dir, 6)
    data = json.loads((run_dir / "checkpoints" / "6" / "data" / "metadata").read_text())
    # Fingerprints are exact wrap-around sums of every array's bits: equal fingerprints = equal arrays.
    return meta["fingerprints"], meta["counters"], meta["behaviour_version"], data


def _metrics(run_dir):
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "throughput/")) and k != "env/wait_s"}
            for r in read_metrics(run_dir)]


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory, env):
    run_dir = tmp_path_factory.mktemp("straight")
    code, out = _finish(_train(run_dir, env))
    assert code == 0, out[-3000:]
    return run_dir


TOOLS = ("env.num_workers=1", "env.max_turns=2", "env.max_total_tokens=96")  # with configs/tiny_tools.yaml


@pytest.fixture(scope="module")
def straight_tools_run(tmp_path_factory, env):
    run_dir = tmp_path_factory.mktemp("straight_tools")
    code, out = _finish(_train(run_dir, env, *TOOLS, config="configs/tiny_tools.yaml"))
    assert code == 0, out[-3000:]
    # configs/tiny_tools.yaml as shipped: a random model's tool calls answered with errors, every turn paused and
    # resumed, in every iteration.
    records = read_metrics(run_dir)
    assert len(records) == 6 and all(r["env/pauses"] > 0 and r["env/tool_call_errors/bad_json"] > 0 for r in records)
    assert all(math.isfinite(r["loss/loss"]) for r in records)
    return run_dir


@pytest.mark.parametrize("config", ["tiny", "tiny_tools"])
def test_killed_then_resumed_equals_uninterrupted(tmp_path, env, request, config):
    straight_run = request.getfixturevalue("straight_run" if config == "tiny" else "straight_tools_run")
    extra = TOOLS if config == "tiny_tools" else ()
    killed = tmp_path / "killed"
    proc = _train(killed, env, *extra, config=f"configs/{config}.yaml")
    _wait_for(lambda: (killed / "checkpoints" / "3").is_dir(), proc)
    proc.send_signal(signal.SIGKILL)  # no chance to save anything more
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert not (killed / "checkpoints" / "6").exists()
    code, out = _finish(_train(killed, env, *extra, config=f"configs/{config}.yaml"))
    assert code == 0, out[-3000:]
    assert "resumed from iteration 3" in out
    assert _final_state(killed) == _final_state(straight_run)
    assert _metrics(killed) == _metrics(straight_run)
    assert _final_state(killed)[2] == 4  # behaviour refreshed at iteration 4 (0-based), restored at resume


def test_sigterm_saves_and_resume_is_exact(tmp_path, env, straight_run):
    stopped = tmp_path / "stopped"
    proc = _train(stopped, env)
    _wait_for(lambda: len(read_metrics(stopped)) >= 1, proc)
    proc.send_signal(signal.SIGTERM)
    code, out = _finish(proc)
    assert code == 0, out[-3000:]
    assert "preemption requested" in out
    steps = sorted(int(p.name) for p in (stopped / "checkpoints").iterdir() if p.name.isdigit())
    assert steps and steps[-1] < 6, steps
    code, out = _finish(_train(stopped, env))
    assert code == 0, out[-3000:]
    assert f"resumed from iteration {steps[-1]}" in out
    assert _final_state(stopped) == _final_state(straight_run)
    assert _metrics(stopped) == _metrics(straight_run)


def test_eval_prints_accuracy_and_pass_at_1(straight_run, env):
    proc = subprocess.run([sys.executable, "-m", "jgrpo.eval", str(straight_run), "run.eval_samples=2",
                           "reward.functions=[exact_numeric]"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["source"].endswith("at iteration 6")
    assert result["prompts"] == 8  # data.num_test_examples of the tiny config
    for key in ("greedy_accuracy", "pass_at_1", "pass_at_2"):
        assert 0.0 <= result[key] <= 1.0
    assert result["pass_at_1"] <= result["pass_at_2"]


def test_export_loads_in_transformers_with_the_same_logits(straight_run, tmp_path, monkeypatch):
    import jax
    import torch
    from transformers import AutoModelForCausalLM

    from jgrpo.config.loading import load_config
    from jgrpo.export import main as export_main
    from jgrpo.models.hf import load_model
    from jgrpo.models.llm import forward, position_ids_from_mask
    from jgrpo.training.checkpoint import Checkpointer

    monkeypatch.setenv("JGRPO_COMPILATION_CACHE", "0")
    assert export_main([str(straight_run), str(tmp_path / "hf")]) == 0
    config = load_config(straight_run / "config.yaml")
    graphdef, initial, _ = load_model(config.model.name)
    params, iteration = Checkpointer(straight_run, config.checkpoint, read_only=True).restore_params(initial)
    assert iteration == 6
    assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(initial),
                                                        strict=True))
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", torch_dtype=torch.float32)
    tokens = np.array([[1, 504, 3458, 314, 216, 28, 1065, 42]], np.int32)
    mask = np.ones_like(tokens, bool)
    hidden, _ = forward(graphdef, params, tokens, position_ids_from_mask(mask), mask)
    ours = np.asarray(hidden @ np.asarray(params["embed"]).T)
    with torch.no_grad():
        theirs = model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-4)


def test_plot_draws_the_run(straight_run, tmp_path):
    from jgrpo.plot import main as plot_main

    out = tmp_path / "run.png"
    assert plot_main([str(straight_run), "-o", str(out)]) == 0
    assert out.read_bytes()[:4] == b"\x89PNG"


def test_bad_override_is_a_clear_error(env):
    proc = subprocess.run([sys.executable, "-m", "jgrpo.train", "configs/tiny.yaml", "grpo.betta=0.1"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert "unknown config key 'grpo.betta'" in proc.stderr and "beta" in proc.stderr


@pytest.mark.slow
def test_quickstart_evaluates_before_and_after_two_iterations_of_real_smollm2(tmp_path):
    # As a user runs it: one CPU device (no emulated mesh), real weights, the README command.
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", JGRPO_COMPILATION_CACHE="0")
    proc = subprocess.run([sys.executable, "-m", "jgrpo.train", "configs/quickstart.yaml",
                           f"run.output_dir={tmp_path}", "run.iterations=2", "data.num_test_examples=25"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "GRPO" in proc.stderr and "reward=" in proc.stderr  # the progress bar with its key numbers
    records = read_metrics(tmp_path)
    assert [r["iteration"] for r in records] == [0, 1, 2]  # 0: the held-out evaluation before training
    assert [r["iteration"] for r in records if "eval/greedy_accuracy" in r] == [0, 2]  # before and after
    assert "held-out test split (25 prompts)" in proc.stdout and "greedy accuracy" in proc.stdout
    assert (tmp_path / "curves.png").read_bytes()[:4] == b"\x89PNG"
    assert "nan" not in (proc.stdout + proc.stderr).lower().replace("nanmean", "")
    for record in records[1:]:
        for key in ("reward/mean", "loss/loss", "entropy/mean", "completion/length_mean", "time/update"):
            assert np.isfinite(record[key]), (key, record[key])
    # v = 4: the first iteration samples and updates at the same params, so the mismatch is measured there
    assert 0 < records[1]["mismatch/logprob_max"] < 1e-3  # sampler vs trainer (docs/algorithm.md §6)
    assert (tmp_path / "checkpoints" / "2").is_dir() and (tmp_path / "config.yaml").is_file()


def test_a_model_that_cannot_be_fetched_is_one_paragraph_without_a_traceback(env, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "jgrpo.train", "configs/tiny.yaml", "model.name=no-such-org/no-model",
                           f"run.output_dir={tmp_path}"],
                          cwd=ROOT, env={**env, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "error: model 'no-such-org/no-model' is not a built-in name" in proc.stderr
    assert "Traceback" not in proc.stderr
