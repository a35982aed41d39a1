"""Compare runs: reward, accuracy, KL and step time curves side by side.

    python -m jgrpo.plot RUN_DIR [RUN_DIR ...] -o FILE.png [--smooth N]

Each RUN_DIR is a training run directory holding metrics.jsonl. One panel per quantity, one line
per run (labelled by the directory name); a quantity a run did not log is simply absent from it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from jgrpo.metrics import METRICS_FILE, read_metrics

PANELS = (
    ("reward/mean", "mean reward"),
    ("accuracy", "accuracy"),
    ("kl/mean", "KL to reference"),
    ("time/iteration", "seconds per iteration"),
)


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


def plot_runs(run_dirs: list[str | Path], out_file: str | Path, smooth: int = 1) -> Path:
    """Draw the panels for `run_dirs` into `out_file` (PNG, or any format matplotlib knows by extension)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = []
    for run_dir in run_dirs:
        records = read_metrics(run_dir)
        if not records:
            raise FileNotFoundError(f"{Path(run_dir) / METRICS_FILE}: no metrics (is this a jgrpo run directory?)")
        runs.append((Path(run_dir).name or str(run_dir), records))

    fig, axes = plt.subplots(1, len(PANELS), figsize=(4.5 * len(PANELS), 3.6), squeeze=False)
    for ax, (key, title) in zip(axes[0], PANELS, strict=True):
        drawn = False
        for label, records in runs:
            points = [(r["iteration"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
            if not points:
                continue
            x, y = np.array(points, dtype=np.float64).T
            ax.plot(x, _smooth(y, smooth), label=label, linewidth=1.5)
            drawn = True
        ax.set_title(title)
        ax.set_xlabel("iteration")
        ax.grid(alpha=0.3)
        if drawn:
            ax.legend(fontsize="small")
        else:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="gray")
    fig.tight_layout()
    out_file = Path(out_file)
    out_file.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_file, dpi=110)
    plt.close(fig)
    return out_file


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jgrpo.plot", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dirs", nargs="+", help="training run directories (each with metrics.jsonl)")
    parser.add_argument("-o", "--output", required=True, help="image file to write, e.g. curves.png")
    parser.add_argument("--smooth", type=int, default=1, help="moving-average window in iterations")
    args = parser.parse_args(argv)
    try:
        out = plot_runs(args.run_dirs, args.output, smooth=args.smooth)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
