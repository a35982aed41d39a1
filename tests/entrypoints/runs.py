"""Training runs in fresh processes, for the entrypoint tests: start one, wait for it, read its final state."""

import json
import signal
import subprocess
import sys
import time

from jgrpo.training.metrics_log import read_metrics
from tests.helpers import ROOT

OVERRIDES = [
    "reward.functions=[tests.helpers:space_fraction]",
    "grpo.behaviour_refresh=4", "grpo.inner_steps=2", "grpo.beta=0.1",
    "run.iterations=6", "checkpoint.every=3", "logging.samples_every=0",
]


def train(run_dir, env, *extra, config="configs/tiny.yaml"):
    cmd = [sys.executable, "-m", "jgrpo.train", config, f"run.output_dir={run_dir}", *OVERRIDES, *extra]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(proc, timeout=600):
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out


def wait_for(predicate, proc, timeout=600):
    deadline = time.time() + timeout
    while not predicate():
        if proc.poll() is not None:
            raise AssertionError(f"training exited early ({proc.returncode}):\n{proc.stdout.read()[-3000:]}")
        if time.time() > deadline:
            raise AssertionError("timed out waiting for the training process")
        time.sleep(0.1)


def checkpoint_meta(run_dir, step):
    return json.loads((run_dir / "checkpoints" / str(step) / "meta" / "metadata").read_text())


def final_state(run_dir):
    meta = checkpoint_meta(run_dir, 6)
    data = json.loads((run_dir / "checkpoints" / "6" / "data" / "metadata").read_text())
    # Fingerprints are exact wrap-around sums of every array's bits: equal fingerprints = equal arrays.
    return meta["fingerprints"], meta["counters"], meta["behaviour_version"], data


def metrics(run_dir):
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "throughput/")) and k != "env/wait_s"}
            for r in read_metrics(run_dir)]


def killed_then_resumed(tmp_path, env, straight_run, *extra, config="configs/tiny.yaml"):
    """A run killed (SIGKILL) after its checkpoint at iteration 3 and resumed ends bit-for-bit equal to
    `straight_run`, the same run uninterrupted."""
    killed = tmp_path / "killed"
    proc = train(killed, env, *extra, config=config)
    wait_for(lambda: (killed / "checkpoints" / "3").is_dir(), proc)
    proc.send_signal(signal.SIGKILL)  # no chance to save anything more
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert not (killed / "checkpoints" / "6").exists()
    code, out = finish(train(killed, env, *extra, config=config))
    assert code == 0, out[-3000:]
    assert "resumed from iteration 3" in out
    assert final_state(killed) == final_state(straight_run)
    assert metrics(killed) == metrics(straight_run)
    assert final_state(killed)[2] == 4  # behaviour refreshed at iteration 4 (0-based), restored at resume
