"""The command-line entrypoints end to end on the tiny config, in fresh processes where it matters.

- a run killed (SIGKILL) after a checkpoint and resumed, and a run stopped by SIGTERM and resumed, both end
  bit-for-bit equal to an uninterrupted run (params, optimiser state, behaviour params, rng, data position,
  metrics), with v = 4 so the behaviour params must come back from the checkpoint;
- eval prints its numbers, export writes an HF directory that transformers loads with the same logits,
  plot draws the run.
"""

import json
import signal
import subprocess
import sys

import numpy as np
import pytest

from jgrpo.training.metrics_log import read_metrics
from tests.entrypoints.runs import final_state, finish, killed_then_resumed, metrics, train, wait_for
from tests.helpers import ROOT


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory, env):
    run_dir = tmp_path_factory.mktemp("straight")
    code, out = finish(train(run_dir, env))
    assert code == 0, out[-3000:]
    return run_dir


def test_killed_then_resumed_equals_uninterrupted(tmp_path, env, straight_run):
    killed_then_resumed(tmp_path, env, straight_run)


def test_sigterm_saves_and_resume_is_exact(tmp_path, env, straight_run):
    stopped = tmp_path / "stopped"
    proc = train(stopped, env)
    wait_for(lambda: len(read_metrics(stopped)) >= 1, proc)
    proc.send_signal(signal.SIGTERM)
    code, out = finish(proc)
    assert code == 0, out[-3000:]
    assert "preemption requested" in out
    steps = sorted(int(p.name) for p in (stopped / "checkpoints").iterdir() if p.name.isdigit())
    assert steps and steps[-1] < 6, steps
    code, out = finish(train(stopped, env))
    assert code == 0, out[-3000:]
    assert f"resumed from iteration {steps[-1]}" in out
    assert final_state(stopped) == final_state(straight_run)
    assert metrics(stopped) == metrics(straight_run)


def test_eval_prints_accuracy_pass_at_k_and_maj_at_k(straight_run, env, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "jgrpo.eval", str(straight_run), "run.eval_samples=3",
                           "--report", str(tmp_path / "report.json"), "--samples", "2", "--reward", "exact_numeric",
                           "--k", "1,2"],  # the flags win over the overrides: 2 samples
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert json.loads((tmp_path / "report.json").read_text())["datasets"][result["data"]] == {
        k: v for k, v in result.items() if k not in ("source", "data")}
    assert "| data | greedy_accuracy |" in proc.stdout
    assert result["source"].endswith("at iteration 6")
    assert result["prompts"] == 8  # data.num_test_examples of the tiny config
    assert "pass_at_3" not in result
    for key in ("greedy_accuracy", "pass_at_1", "pass_at_2", "maj_at_1", "maj_at_2", "greedy_truncated",
                "sampled_truncated"):
        assert 0.0 <= result[key] <= 1.0
    assert result["pass_at_1"] <= result["pass_at_2"]
    assert 1 <= result["greedy_length"] <= 8 and 1 <= result["sampled_length"] <= 8  # sampler.max_new_tokens


def test_eval_on_given_files_in_the_gsm8k_and_math_formats(straight_run, env, tmp_path):
    gsm8k, math = tmp_path / "gsm8k.jsonl", tmp_path / "math.jsonl"
    gsm8k.write_text("".join(json.dumps({"question": f"What is {a} + {a}?", "answer": f"{a} + {a} = {2 * a}\n"
                                                                                       f"#### {2 * a}", "type": t})
                             + "\n" for a, t in ((1, "sum"), (2, "sum"), (3, "double sum"))))
    math.write_text("".join(json.dumps({"problem": f"Compute $\\frac{{{2 * a}}}{{2}}$.", "answer": str(a),
                                        "type": "sum"}) + "\n" for a in (4, 5)))
    proc = subprocess.run([sys.executable, "-m", "jgrpo.eval", str(straight_run), "--data", str(gsm8k), "--data",
                           str(math), "--reward", "math_verify", "--samples", "2", "--group-by", "type"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = [json.loads(line) for line in proc.stdout.strip().splitlines() if line.startswith("{")]
    assert [(r["data"], r["prompts"]) for r in lines] == [(str(gsm8k), 3), (str(math), 2)]
    assert all("maj_at_2" in r and "pass_at_2" in r for r in lines)
    # --group-by type: each value's scores too (a legal tag: "double sum" -> double_sum); they add up to the whole.
    by_type = lines[0]
    assert (by_type["type/sum/prompts"], by_type["type/double_sum/prompts"]) == (2, 1)
    for metric in ("greedy_accuracy", "pass_at_1", "pass_at_2", "maj_at_2"):
        parts = 2 * by_type[f"type/sum/{metric}"] + by_type[f"type/double_sum/{metric}"]
        assert parts == pytest.approx(3 * by_type[metric]), metric
    assert lines[1]["type/sum/prompts"] == 2 and "type/double_sum/prompts" not in lines[1]
    assert f"| {gsm8k} [type=double_sum] |" in proc.stdout  # a table row per group
    report = json.loads((straight_run / "eval.json").read_text())  # a run directory's default report
    assert list(report["datasets"]) == [str(gsm8k), str(math)]


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


def test_a_model_that_cannot_be_fetched_is_one_paragraph_without_a_traceback(env, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "jgrpo.train", "configs/tiny.yaml", "model.name=no-such-org/no-model",
                           f"run.output_dir={tmp_path}"],
                          cwd=ROOT, env={**env, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "error: model 'no-such-org/no-model' is not a built-in name" in proc.stderr
    assert "Traceback" not in proc.stderr
