"""Compare runs: reward, accuracy, KL and step time curves side by side.

    python -m jgrpo.plot RUN_DIR [RUN_DIR ...] -o FILE.png [--smooth N] [--x iteration|wallclock]

Each RUN_DIR is a training run directory holding metrics.jsonl. One panel per quantity, one line
per run (labelled by the directory name); a quantity a run did not log is simply absent from it.
The held-out panels (greedy accuracy, pass@1) show the iterations where `run.eval_every` evaluated.
`--x wallclock` puts cumulative training time on the x axis (the sum of time/iteration minus the
time spent evaluating, so runs that evaluate at different rates stay comparable).
"""

from __future__ import annotations

import argparse
import sys

from jgrpo.config.errors import exits_on_user_error
from jgrpo.training.curves import X_AXES, plot_runs


@exits_on_user_error
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jgrpo.plot", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dirs", nargs="+", help="training run directories (each with metrics.jsonl)")
    parser.add_argument("-o", "--output", required=True, help="image file to write, e.g. curves.png")
    parser.add_argument("--smooth", type=int, default=1, help="moving-average window in iterations")
    parser.add_argument("--x", choices=tuple(X_AXES), default="iteration", help="x axis: iteration or wallclock")
    args = parser.parse_args(argv)
    if args.smooth < 1:
        parser.error(f"--smooth={args.smooth} must be >= 1 (1 = no smoothing)")
    out = plot_runs(args.run_dirs, args.output, smooth=args.smooth, x_axis=args.x)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
