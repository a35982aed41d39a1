"""Routing replay on the tiny Qwen3-MoE: how far the trainer's log-probs are from the sampler's, with and without.

    python experiments/moe_replay.py [--iterations 6] [--out runs/moe_replay]

Runs `configs/tiny_moe.yaml` (2 layers, 8 experts, 2 per token) for each of: float32 and bfloat16 compute, routing
replay none and rollout, and the tiny dense Llama of the same width in bfloat16 (the floor: the mismatch rounding
leaves without any routing). Prints, per iteration, `moe/routing_mismatch` (the share of top-k sets the trainer's
router picks differently from the sampler's) and `moe/lp_mismatch` (mean |lp - lp_alpha| over the sampled tokens;
for the dense model `mismatch/logprob_mean`), and writes them to OUT/moe_replay.json. Same seed everywhere, so the
first iteration samples the same prompts from the same initial weights in every run of one dtype.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNS = {  # name -> overrides of configs/tiny_moe.yaml
    "float32, replay none": ["model.routing_replay=none"],
    "float32, replay rollout": ["model.routing_replay=rollout"],
    "bfloat16, replay none": ["model.compute_dtype=bfloat16", "model.routing_replay=none"],
    "bfloat16, replay rollout": ["model.compute_dtype=bfloat16", "model.routing_replay=rollout"],
    "bfloat16, dense (floor)": ["model.compute_dtype=bfloat16", "model.name=tiny-random-llama",
                                "model.routing_replay=none"],
}


def run(name: str, overrides: list[str], iterations: int, out: Path) -> list[dict]:
    run_dir = out / name.replace(", ", "_").replace(" ", "_").replace("(", "").replace(")", "")
    command = [sys.executable, "-m", "jgrpo.train", str(ROOT / "configs" / "tiny_moe.yaml"), *overrides,
               f"run.iterations={iterations}", f"run.output_dir={run_dir}", "checkpoint.every=0",
               "logging.samples_every=0", "run.eval_every=0"]
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run, never a resumed one
    subprocess.run(command, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [{"iteration": r["iteration"], "routing_mismatch": r.get("moe/routing_mismatch"),
             "lp_mismatch": r.get("moe/lp_mismatch", r.get("mismatch/logprob_mean"))} for r in records]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=6)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "moe_replay")
    args = parser.parse_args()
    results = {name: run(name, overrides, args.iterations, args.out) for name, overrides in RUNS.items()}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "moe_replay.json").write_text(json.dumps(results, indent=1))
    print("| run | " + " | ".join(f"it {i + 1}" for i in range(args.iterations)) + " | mean |")
    print("|---|" + "---:|" * (args.iterations + 1))
    for metric in ("routing_mismatch", "lp_mismatch"):
        for name, records in results.items():
            values = [r[metric] for r in records]
            if all(v is None for v in values):
                continue
            mean = sum(v for v in values if v is not None) / sum(v is not None for v in values)
            cells = " | ".join("-" if v is None else f"{v:.3g}" for v in values)
            print(f"| {metric}: {name} | {cells} | {mean:.3g} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
