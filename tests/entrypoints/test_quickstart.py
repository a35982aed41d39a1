"""The README's quickstart command on the real SmolLM2 weights, as a user runs it (its own module: the suite's
longest test gets a worker of its own under xdist)."""

import os
import subprocess
import sys

import numpy as np
import pytest

from jgrpo.training.metrics_log import read_metrics
from tests.helpers import ROOT


@pytest.mark.slow
def test_quickstart_evaluates_before_and_after_two_iterations_of_real_smollm2(tmp_path):
    # As a user runs it: one CPU device (no emulated mesh), real weights, the README command.
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", JGRPO_COMPILATION_CACHE="0")
    proc = subprocess.run([sys.executable, "-m", "jgrpo.train", "configs/quickstart.yaml",
                           f"run.output_dir={tmp_path}", "run.iterations=2", "data.num_test_examples=25"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "GRPO" in proc.stderr and "reward=" in proc.stderr and "avg5=" in proc.stderr  # the bar: key numbers
    assert "held-out=" in proc.stderr  # the latest held-out accuracy (iteration 0's until the next evaluation)
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


