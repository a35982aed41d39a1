"""Run the off-policy toolbox study (docs/offpolicy_study.md): every configuration x every seed, resumable.

    python experiments/offpolicy/run.py [--out runs/offpolicy] [--seeds 0 1 2] [--workers 2] [--only NAME ...]
    python experiments/offpolicy/report.py          # table + figures from experiments/offpolicy/results

Each run is `python -m jgrpo.train experiments/offpolicy/base.yaml` plus its overrides, in OUT/seed<S>/<name>
(checkpoints, log). A finished run's metrics.jsonl and config.yaml are copied to RESULTS/seed<S>/<name>/
(default experiments/offpolicy/results, committed: what the report reads). A run with results is skipped; one
that was interrupted resumes from its last checkpoint in OUT (every 10 iterations), so the study runs in parts:
stop it any time and start it again. Runs go seed by seed (all configurations of seed 0 first), `--workers`
at a time, each pinned to its own core (`--cores`, default 0, 1, ...; taskset, one XLA thread) so that their
seconds per iteration compare. The untrained model is evaluated once (OUT/untrained_eval.json).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

from jgrpo.config.errors import exits_on_user_error  # noqa: E402

HERE = Path(__file__).resolve().parent
BASE = HERE / "base.yaml"

# name -> overrides on top of base.yaml (v = 10, masking on). The order is the table's.
RUNS = {
    "onpolicy": ["grpo.behaviour_refresh=1", "grpo.mask_zero_variance=false"],
    "onpolicy_masked": ["grpo.behaviour_refresh=1"],
    "v10_behaviour": [],
    "v10_recentred": ["grpo.off_policy_ratio=recentred"],
    "v10_current": ["grpo.off_policy_ratio=current"],
    "v10_tis": ["grpo.off_policy_ratio=current", "grpo.truncated_is=token", "grpo.truncated_is_cap=2.0"],
    "v10_mis": ["grpo.masked_is=token"],
    "v10_seqmask": ["grpo.sequence_mask_delta=0.1"],
    "v10_cispo": ["grpo.policy_loss=cispo"],
    "v10_m2po": ["grpo.m2po_tau=0.04", "grpo.m2po_form=clipped"],  # as run in the study's table (mask + clip)
    "v10_m2po_paper": ["grpo.m2po_tau=0.04"],  # the paper's form: the mask instead of the clip
    "adaptive": ["grpo.behaviour_refresh=adaptive", "grpo.refresh_tv=0.2", "grpo.refresh_max_iterations=10"],
}
ITERATIONS = 60


RESULTS = HERE / "results"


def finished(run_dir: Path) -> bool:
    """The run's metrics reach the last iteration with its held-out evaluation."""
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        return False
    last = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return any(r.get("iteration") == ITERATIONS and "eval/greedy_accuracy" in r for r in last)


def command(run_dir: Path, seed: int, overrides: list[str]) -> list[str]:
    return [sys.executable, "-m", "jgrpo.train", str(BASE), f"run.output_dir={run_dir}", f"run.seed={seed}",
            f"data.shuffle_seed={seed}", f"run.iterations={ITERATIONS}", *overrides]


def pinned(cmd: list[str], core: int | None) -> tuple[list[str], dict]:
    env = dict(os.environ)
    if core is None or shutil.which("taskset") is None:
        return cmd, env
    env["XLA_FLAGS"] = f"--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1 {env.get('XLA_FLAGS', '')}"
    return ["taskset", "-c", str(core), *cmd], env


@exits_on_user_error
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/offpolicy", type=Path)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--results", default=RESULTS, type=Path, help="where finished runs' metrics are kept")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--only", nargs="+", choices=list(RUNS), help="these configurations only")
    parser.add_argument("--no-pin", action="store_true", help="do not pin runs to cores")
    parser.add_argument("--cores", type=int, nargs="+", help="pin the workers to these cores (default 0 .. workers-1)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)

    args.results.mkdir(parents=True, exist_ok=True)
    untrained = args.results / "untrained_eval.json"
    if not untrained.is_file():
        cmd, env = pinned([sys.executable, "-m", "jgrpo.eval", str(BASE)], None if args.no_pin else 0)
        lines = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout.strip().splitlines()
        untrained.write_text(lines[-1] + "\n")

    todo: queue.Queue = queue.Queue()
    for seed in args.seeds:
        for name, overrides in RUNS.items():
            run_dir = args.out / f"seed{seed}" / name
            if (args.only is None or name in args.only) and not finished(args.results / f"seed{seed}" / name):
                todo.put((run_dir, seed, overrides))
    print(f"{todo.qsize()} runs to do, {args.workers} at a time", flush=True)
    failures = []

    def worker(core: int) -> None:
        while True:
            try:
                run_dir, seed, overrides = todo.get_nowait()
            except queue.Empty:
                return
            run_dir.mkdir(parents=True, exist_ok=True)
            cmd, env = pinned(command(run_dir, seed, overrides), None if args.no_pin else core)
            start = time.time()
            with open(run_dir.parent / f"{run_dir.name}.log", "a") as log:
                code = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
            print(f"{run_dir}: exit {code} after {time.time() - start:.0f} s", flush=True)
            if code != 0 or not finished(run_dir):
                failures.append(str(run_dir))
                continue
            kept = args.results / run_dir.parent.name / run_dir.name
            kept.mkdir(parents=True, exist_ok=True)
            for name in ("metrics.jsonl", "config.yaml"):
                shutil.copy2(run_dir / name, kept / name)

    cores = args.cores or list(range(args.workers))
    threads = [threading.Thread(target=worker, args=(core,)) for core in cores[:args.workers]]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failures:
        print(f"failed (see their .log): {failures}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
