"""The run comparison figure: reward, accuracy, KL, held-out and step-time curves, one panel per quantity.

`plot_runs` draws it for `python -m jgrpo.plot` and at the end of every training run (RUN_DIR/curves.png).
One line per run (labelled by the directory name); a quantity a run did not log is simply absent from its
panel, and a quantity no run logged gets no panel (nor does `accuracy` where it equals the mean reward at every
iteration: one 0/1 reward function). The held-out panels (greedy accuracy, pass@1) mark each evaluation's point.
`x_axis="wallclock"` puts cumulative training time on the x axis (the sum of time/iteration minus the time spent
evaluating, so runs that evaluate at different rates stay comparable).
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
from etils import epath

from jgrpo.config.errors import PathError
from jgrpo.training.metrics_log import METRICS_FILE, read_metrics

PANELS = (
    ("reward/mean", "mean reward"),
    ("accuracy", "accuracy"),
    ("kl/mean", "KL to reference"),
    ("eval/greedy_accuracy", "held-out greedy accuracy"),
    ("eval/pass_at_1", "held-out pass@1"),
    ("time/training", "seconds per iteration (without evaluation)"),
)
X_AXES = {"iteration": "iteration", "wallclock": "training time (s)"}


def with_training_time(record: dict) -> dict:
    """The record plus time/training: its iteration's time without the held-out evaluation it ran."""
    if "time/iteration" not in record:
        return record
    return record | {"time/training": float(record["time/iteration"]) - float(record.get("time/eval", 0.0))}


def _x_values(records: list[dict], axis: str) -> dict[int, float]:
    """Iteration -> x coordinate of that iteration's record."""
    if axis == "iteration":
        return {r["iteration"]: float(r["iteration"]) for r in records}
    elapsed, out = 0.0, {}
    for r in sorted(records, key=lambda r: r["iteration"]):
        elapsed += with_training_time(r).get("time/training", 0.0)
        out[r["iteration"]] = elapsed
    return out


def _smooth(values: np.ndarray, window: int) -> np.ndarray:
    """Trailing moving average that ignores NaN (a skipped step) and keeps the curve's length."""
    if window <= 1:
        return values
    out = np.empty_like(values)
    for i in range(len(values)):
        chunk = values[max(0, i - window + 1) : i + 1]
        finite = chunk[np.isfinite(chunk)]
        out[i] = finite.mean() if finite.size else np.nan
    return out


def panels_with_data(runs: list[tuple[str, list[dict]]]) -> list[tuple[str, str]]:
    """The PANELS some run logged, without `accuracy` when it repeats `reward/mean` in every record."""
    def logged(key):
        return any(isinstance(r.get(key), (int, float)) for _, records in runs for r in records)

    repeats = all(r.get("accuracy") == r.get("reward/mean") for _, records in runs for r in records)
    return [(key, title) for key, title in PANELS if logged(key) and not (key == "accuracy" and repeats)]


def plot_runs(run_dirs: list[str | Path], out_file: str | Path, smooth: int = 1,
              x_axis: str = "iteration") -> epath.Path:
    """Draw the panels for `run_dirs` into `out_file` (PNG, or any format matplotlib knows by extension)."""
    if x_axis not in X_AXES:
        raise ValueError(f"x_axis must be one of {tuple(X_AXES)}, got '{x_axis}'")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = []
    for run_dir in run_dirs:
        records = read_metrics(run_dir)
        if not records:
            raise PathError(f"{epath.Path(run_dir) / METRICS_FILE}: no metrics (is it a jgrpo run directory?)")
        runs.append((epath.Path(run_dir).name or str(run_dir), [with_training_time(r) for r in records]))

    panels = panels_with_data(runs)
    if not panels:
        raise PathError(f"{', '.join(map(str, run_dirs))}: the metrics hold none of the plotted quantities "
                        f"({', '.join(key for key, _ in PANELS)})")
    columns = min(3, len(panels))
    rows = -(-len(panels) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(4.8 * columns, 3.6 * rows), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    for ax, (key, title) in zip(axes.flat, panels, strict=False):
        drawn = False
        for label, records in runs:
            xs = _x_values(records, x_axis)
            points = [(xs[r["iteration"]], r[key]) for r in records if isinstance(r.get(key), (int, float))]
            if not points:
                continue
            x, y = np.array(points, dtype=np.float64).T
            sparse = key.startswith("eval/")  # evaluated every few iterations: mark the points
            ax.plot(x, y if sparse else _smooth(y, smooth), label=label, linewidth=1.5, marker="o" if sparse else None,
                    markersize=3)
            drawn = True
        ax.set_title(title)
        ax.set_xlabel(X_AXES[x_axis])
        ax.grid(alpha=0.3)
        if drawn:
            ax.legend(fontsize="small")
    fig.tight_layout()
    out_file = epath.Path(out_file)  # a local path or a bucket (gs://...), like the run directories
    out_file.parent.mkdir(parents=True, exist_ok=True)
    image = io.BytesIO()
    fig.savefig(image, dpi=110, format=out_file.suffix.lstrip(".") or "png")
    plt.close(fig)
    out_file.write_bytes(image.getvalue())
    return out_file
