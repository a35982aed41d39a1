"""Per-iteration metrics to JSONL, TensorBoard and (optionally) Weights & Biases, a console progress bar, and
sample dumps.

Only process 0 writes; every other process gets a logger whose methods do nothing, so the trainer
calls it unconditionally. Files in the run directory:

    metrics.jsonl   one JSON object per iteration: {"iteration": k, "reward/mean": ..., ...}
    samples.jsonl   every `logging.samples_every` iterations: prompts, completions, rewards
    tensorboard/    the same scalars as the JSONL, for `tensorboard --logdir RUN_DIR`
    wandb/          with `logging.wandb_project`: the W&B run (config, scalars, sample tables; wandb_sink.py)

On resume from iteration k, lines for iterations > k (written after the checkpoint the run resumes
from) are dropped, so the files describe exactly one history. The run directory may be a bucket
(gs://...): paths go through etils.epath, and since objects cannot be appended to, a JSONL file there is
rewritten whole at each write (one short line per iteration).
"""

from __future__ import annotations

import collections
import json
import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
from etils import epath

from jgrpo.config import LoggingConfig

METRICS_FILE = "metrics.jsonl"
SAMPLES_FILE = "samples.jsonl"

# Shown in the progress bar, in this order, when present: (metric key, label, format).
REWARD_WINDOW = 5  # iterations in the bar's running mean reward (avg5)
PROGRESS_KEYS = (
    ("reward/mean", "reward", "{:.3f}"),
    ("accuracy", "acc", "{:.2f}"),
    ("kl/mean", "kl", "{:.2e}"),
    ("completion/length_mean", "len", "{:.0f}"),
    ("time/iteration", "s/it", "{:.1f}"),
    ("throughput/tokens_per_s", "tok/s", "{:.0f}"),
)


def _plain(value: Any) -> Any:
    """numpy / jax scalars -> Python numbers (JSON and TensorBoard want plain floats)."""
    if isinstance(value, (jax.Array, np.ndarray, np.generic)):
        value = np.asarray(value)
        if value.size != 1:
            raise ValueError(f"metric values must be scalars, got shape {value.shape}")
        value = value.item()
    return value


def read_jsonl(path: str | Path) -> list[dict]:
    path = epath.Path(path)
    if not path.is_file():
        return []
    with path.open() as f:
        return [json.loads(line) for line in f if line.strip()]


def read_metrics(run_dir: str | Path) -> list[dict]:
    """All iteration records of a run, in order."""
    return read_jsonl(epath.Path(run_dir) / METRICS_FILE)


class _JsonlFile:
    """An append-only JSON-lines file that first drops the records of iterations > `keep_through`.

    Local files are appended to; object stores (gs://, s3://) cannot append, so there the whole file is
    rewritten at each write.
    """

    def __init__(self, path: epath.Path, keep_through: int):
        self.path = path
        self.lines = [json.dumps(r) + "\n" for r in read_jsonl(path) if r.get("iteration", 0) <= keep_through]
        path.write_text("".join(self.lines))
        self._local = "://" not in str(path)
        self._file = path.open("a") if self._local else None

    def write(self, records: Sequence[Mapping[str, Any]]) -> None:
        lines = [json.dumps(r) + "\n" for r in records]
        if self._local:
            self._file.write("".join(lines))
            self._file.flush()
        else:
            self.lines.extend(lines)
            self.path.write_text("".join(self.lines))

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


class MetricsLogger:
    """Write one record per iteration to every sink; a no-op on processes other than 0."""

    def __init__(
        self,
        run_dir: str | Path,
        config: LoggingConfig,
        total_iterations: int,
        start_iteration: int = 0,
        enabled: bool | None = None,
        run_config: Mapping[str, Any] | None = None,
    ):
        self.config = config
        self.run_dir = epath.Path(run_dir)
        self.enabled = jax.process_index() == 0 if enabled is None else enabled
        self._tb = None
        self._wandb = None
        self._held_out = None  # the latest held-out greedy accuracy, shown in the bar until the next evaluation
        # The last few iterations' mean rewards: one iteration's mean over a few prompts is often 0.000 early on,
        # their running mean shows the trend (the bar's avg5).
        self._recent_rewards: collections.deque = collections.deque(maxlen=REWARD_WINDOW)
        self._bar = None
        self._metrics_file = None
        self._samples_file = None
        if not self.enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # A run that starts at iteration 0 has no checkpoint: records of an earlier attempt (the evaluation
        # before training included) are dropped, as a resumed run drops those written after its checkpoint.
        keep_through = start_iteration if start_iteration > 0 else -1
        self._metrics_file = _JsonlFile(self.run_dir / METRICS_FILE, keep_through)
        self._samples_file = _JsonlFile(self.run_dir / SAMPLES_FILE, keep_through)
        if config.tensorboard:
            from tensorboardX import SummaryWriter

            # purge_step hides events of iterations the resumed run is about to redo.
            self._tb = SummaryWriter(str(self.run_dir / "tensorboard"), purge_step=start_iteration + 1)
        if config.wandb_project and config.wandb_mode != "disabled":
            from jgrpo.training.wandb_sink import WandbSink

            self._wandb = WandbSink(self.run_dir, config, run_config or {})
        if config.progress_bar:
            from tqdm import tqdm

            self._bar = tqdm(total=total_iterations, initial=start_iteration, desc="GRPO", unit="it",
                             dynamic_ncols=True)

    def log(self, iteration: int, metrics: Mapping[str, Any]) -> dict:
        """Record the metrics of `iteration` (1-based: the number of iterations completed). Returns the record."""
        record = {"iteration": int(iteration), **{k: _plain(v) for k, v in metrics.items()}}
        if not self.enabled:
            return record
        self._metrics_file.write([record])
        if self._tb is not None:
            for key, value in record.items():
                # NaN (e.g. a KL mean over no tokens when every group had equal rewards) stays in the JSONL only.
                if (key != "iteration" and isinstance(value, (int, float)) and not isinstance(value, bool)
                        and math.isfinite(value)):
                    self._tb.add_scalar(tensorboard_tag(key), value, iteration)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(iteration, record)
        if isinstance(record.get("eval/greedy_accuracy"), (int, float)):
            self._held_out = record["eval/greedy_accuracy"]
        if isinstance(record.get("reward/mean"), (int, float)) and math.isfinite(record["reward/mean"]):
            self._recent_rewards.append(record["reward/mean"])
        if self._bar is not None:
            self._bar.set_postfix_str(self._bar_text(record), refresh=False)
            self._bar.update(iteration - self._bar.n)
        return record

    def _bar_text(self, record: Mapping[str, Any]) -> str:
        """progress_summary(record) with the running mean reward after the iteration's and the latest held-out
        accuracy at the end, e.g. 'reward=0.000 avg5=0.183 acc=0.00 ... held-out=0.44'."""
        recent = sum(self._recent_rewards) / len(self._recent_rewards) if self._recent_rewards else None
        held_out = "" if self._held_out is None else f"held-out={self._held_out:.2f}"
        return " ".join(part for part in (progress_summary(record, recent), held_out) if part)

    def should_dump_samples(self, iteration: int) -> bool:
        every = self.config.samples_every
        return self.enabled and every > 0 and (iteration % every == 0 or iteration == 1)

    def log_samples(self, iteration: int, samples: Sequence[Mapping[str, Any]]) -> None:
        """Append prompts / completions / rewards of `iteration` to samples.jsonl."""
        if not self.enabled:
            return
        rows = [{k: _plain(v) for k, v in sample.items()} for sample in samples]
        self._samples_file.write([{"iteration": int(iteration), **row} for row in rows])
        if self._wandb is not None:
            self._wandb.log_samples(iteration, rows)

    def write(self, message: str) -> None:
        """A console line that does not break the progress bar."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(message)
        else:
            print(message, flush=True)

    def close(self) -> None:
        if not self.enabled:
            return
        for f in (self._metrics_file, self._samples_file):
            f.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.close()
        if self._bar is not None:
            self._bar.close()

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def tensorboard_tag(key: str) -> str:
    """`key` as a legal TensorBoard tag: characters outside [-/\\w.] become "_" (a custom reward named
    "pkg.module:fn" is the tag reward/pkg.module_fn); metrics.jsonl keeps the exact name."""
    return re.sub(r"[^-/\w.]", "_", key)


def progress_summary(record: Mapping[str, Any], recent_reward: float | None = None) -> str:
    """The key numbers of one record as a short line, e.g. 'reward=0.412 acc=0.38 kl=1.2e-03 len=31'; with
    `recent_reward` (the mean over the last REWARD_WINDOW iterations) 'avg5=...' after the reward."""
    parts = []
    for key, label, fmt in PROGRESS_KEYS:
        value = record.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            parts.append(f"{label}=" + (fmt.format(value) if math.isfinite(value) else str(value)))
            if key == "reward/mean" and recent_reward is not None:
                parts.append(f"avg{REWARD_WINDOW}={recent_reward:.3f}")
    return " ".join(parts)


HELD_OUT_KEYS = (("eval/greedy_accuracy", "greedy accuracy"), ("eval/pass_at_1", "pass@1 (sampled)"))


def held_out_comparison(records: Sequence[Mapping[str, Any]]) -> str | None:
    """The first and last held-out evaluations of a run side by side, and a one-line verdict on greedy accuracy.

    None when the run evaluated fewer than twice (see `run.eval_before` and `run.eval_every`).
    """
    evaluated = [r for r in records if isinstance(r.get("eval/greedy_accuracy"), (int, float))]
    if len(evaluated) < 2:
        return None
    first, last = evaluated[0], evaluated[-1]
    prompts = last.get("eval/prompts", "?")
    lines = [f"held-out test split ({prompts} prompts)   iteration {first['iteration']:>4}   "
             f"iteration {last['iteration']:>4}"]
    for key, label in HELD_OUT_KEYS:
        if key in first and key in last:
            lines.append(f"  {label:<33} {first[key]:>14.3f}   {last[key]:>14.3f}")
    rise = 100 * (last["eval/greedy_accuracy"] - first["eval/greedy_accuracy"])
    verdict = "rose" if rise > 0 else "did not rise"
    lines.append(f"greedy accuracy {verdict}: {first['eval/greedy_accuracy']:.2f} -> "
                 f"{last['eval/greedy_accuracy']:.2f} ({rise:+.0f} points)")
    return "\n".join(lines)
