"""The quickstart_tools seeds table (docs/experiments.md) from experiments/tools/run.sh's run directories.

    python experiments/tools/report.py [OUT]      # default runs/tools
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main() -> int:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "runs/tools")
    print("| run | held-out greedy accuracy before -> after | tool-call validity before -> after | turns after |")
    print("|---|---|---|---|")
    for seed_dir in sorted(out.glob("seed*")):
        records = [json.loads(line) for line in (seed_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
        evals = [r for r in records if "eval/greedy_accuracy" in r]
        before, after = evals[0], evals[-1]
        print(f"| {seed_dir.name} | {before['eval/greedy_accuracy']:.2f} -> {after['eval/greedy_accuracy']:.2f} | "
              f"{before['eval/tool_call_validity']:.2f} -> {after['eval/tool_call_validity']:.2f} | "
              f"{after['eval/turns']:.2f} |")
    no_tool = out / "no_tool.json"
    if no_tool.is_file():
        result = json.loads(no_tool.read_text())
        accuracy = result.get("greedy_accuracy", result.get("eval/greedy_accuracy"))
        print(f"| untrained, env.tools=[] | {accuracy} | - | - |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
