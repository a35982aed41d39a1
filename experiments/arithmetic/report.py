"""Summarise the issue #6 runs: a markdown table per run and the two figures under docs/.

    python experiments/arithmetic/report.py [OUT_DIR] [--docs docs/experiments]

OUT_DIR (default runs/arithmetic) holds one run directory per configuration (written by run_all.sh) and
untrained_eval.json (the untrained model on the same test split). Per run: held-out greedy accuracy and
pass@1 at the last evaluation and at their best, the mean training reward over the last 10 iterations,
the median seconds per iteration (warm iterations, evaluation excluded), and the Theorem 1 diagnostics
averaged over iterations (TV(pi_theta, alpha), TV(pi_k, alpha), the weight M, staleness).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from jgrpo.config.errors import exits_on_user_error  # noqa: E402
from jgrpo.training.curves import plot_runs, with_training_time
from jgrpo.training.metrics_log import read_metrics

RUN_ORDER = ("v1_i1", "v1_i1_masked", "v4_i1", "v10_i1", "v10_i1_recentred", "v10_i1_current", "v1_i4")


def _mean(values):
    values = [v for v in values if isinstance(v, (int, float)) and v == v]
    return statistics.mean(values) if values else float("nan")


def summarise(records: list[dict]) -> dict:
    evals = [r for r in records if "eval/greedy_accuracy" in r]
    warm = [with_training_time(r)["time/training"] for r in records[1:]]
    out = {"iterations": records[-1]["iteration"] if records else 0,
           "reward_last10": _mean([r["reward/mean"] for r in records[-10:]]),
           "s_per_iteration": statistics.median(warm) if warm else float("nan"),
           "tv_theta_alpha": _mean([r.get("theorem1/tv_theta_alpha") for r in records]),
           "tv_k_alpha": _mean([r.get("theorem1/tv_k_alpha") for r in records]),
           "M": _mean([r.get("theorem1/tv_weight_M") for r in records]),
           "staleness": _mean([r.get("theorem1/staleness") for r in records]),
           "skipped_steps": sum(int(r.get("nonfinite/skipped", 0)) for r in records)}
    for key, name in (("eval/greedy_accuracy", "greedy"), ("eval/pass_at_1", "pass1")):
        if evals:
            best = max(evals, key=lambda r: r[key])
            out |= {f"{name}_final": evals[-1][key], f"{name}_best": best[key], f"{name}_best_at": best["iteration"]}
    return out


@exits_on_user_error
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", nargs="?", default="runs/arithmetic", type=Path)
    parser.add_argument("--docs", default="docs/experiments", type=Path, help="where the figures are written")
    args = parser.parse_args(argv)
    runs = [args.out_dir / name for name in RUN_ORDER if (args.out_dir / name / "metrics.jsonl").is_file()]
    if not runs:
        print(f"error: no run directories with metrics.jsonl under {args.out_dir}", file=sys.stderr)
        return 2
    untrained = args.out_dir / "untrained_eval.json"
    if untrained.is_file():
        base = json.loads(untrained.read_text())
        print(f"untrained: greedy {base['greedy_accuracy']:.2f}, pass@1 {base['pass_at_1']:.3f} "
              f"over {base['prompts']} test prompts\n")
    print("| run | iterations | greedy final | greedy best (it) | pass@1 final | pass@1 best (it) | train reward "
          "(last 10) | s/iteration | TV(pi_theta, alpha) | TV(pi_k, alpha) | M | staleness | skipped |")
    print("|" + "---|" * 13)
    table = {}
    for run in runs:
        s = table[run.name] = summarise(read_metrics(run))
        print(f"| {run.name} | {s['iterations']} | {s.get('greedy_final', float('nan')):.2f} | "
              f"{s.get('greedy_best', float('nan')):.2f} ({s.get('greedy_best_at', '-')}) | "
              f"{s.get('pass1_final', float('nan')):.3f} | {s.get('pass1_best', float('nan')):.3f} "
              f"({s.get('pass1_best_at', '-')}) | {s['reward_last10']:.3f} | {s['s_per_iteration']:.1f} | "
              f"{s['tv_theta_alpha']:.4f} | {s['tv_k_alpha']:.4f} | {s['M']:.2f} | {s['staleness']:.1f} | "
              f"{s['skipped_steps']} |")
    for axis in ("iteration", "wallclock"):
        print(f"wrote {plot_runs(runs, args.docs / f'arithmetic_{axis}.png', smooth=5, x_axis=axis)}")
    print(json.dumps(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
