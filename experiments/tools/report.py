"""The quickstart_tools seeds table (docs/experiments.md) from experiments/tools/run.sh's run directories.

    python experiments/tools/report.py [OUT]      # default runs/tools
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main() -> int:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "runs/tools")
    print("| run | held-out greedy accuracy | held-out pass@1 (sampled) | tool-call validity | training reward, "
          "first 5 -> last 5 iterations | turns after |")
    print("|---|---|---|---|---|---|")
    for seed_dir in sorted(out.glob("seed*")):
        records = [json.loads(line) for line in (seed_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
        evals = [r for r in records if "eval/greedy_accuracy" in r]
        rewards = [r["reward/mean"] for r in records if "reward/mean" in r]
        if len(evals) < 2 or len(rewards) < 10:
            print(f"| {seed_dir.name} | (unfinished: {len(rewards)} iterations) | | | | |")
            continue
        before, after = evals[0], evals[-1]

        def change(key, b=before, a=after):
            return f"{b[key]:.2f} -> {a[key]:.2f}"

        print(f"| {seed_dir.name} | {change('eval/greedy_accuracy')} | {change('eval/pass_at_1')} | "
              f"{change('eval/tool_call_validity')} | {sum(rewards[:5]) / 5:.2f} -> {sum(rewards[-5:]) / 5:.2f} | "
              f"{after['eval/turns']:.2f} |")
    no_tool = out / "no_tool.json"
    if no_tool.is_file():
        result = json.loads(no_tool.read_text())
        accuracy = result.get("greedy_accuracy", result.get("eval/greedy_accuracy"))
        print(f"| untrained, env.tools=[] | {accuracy} | - | - |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
