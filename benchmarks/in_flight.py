"""Rollouts that never drain, measured: sync, async between batches and async in flight, side by side in one run.

The real SmolLM2-135M-Instruct trains on the quickstart's task (its prompts, G = 8, temperature 0.7) with
`sampler.max_new_tokens` 256 by default: the model's own lengths, mostly a few tokens and a tail that runs to the
limit (the histogram is printed). Async runs as two jobs (`rollout.role`: a trainer process and a rollout process,
each pinned to its own core with `taskset`, sharing nothing but the loopback link, so the overlap is real here) at
`rollout.max_staleness` 2, publishing every iteration; between batches (`rollout.weight_updates: between_batches`)
and in flight (`in_flight`, lag 1) differ in nothing else. Sync runs as one job on both cores. Each configuration
trains `--iterations`; the first `--warm` (compilation) are left out and the others' completion tokens over their
wall-clock are its tokens/s. No checkpoints, no evaluation.

    python benchmarks/in_flight.py                      # ~30 min on 2 cores
    python benchmarks/in_flight.py --slots 12           # the sampler's slots (default: one batch's rows)

Prints a table, then one JSON line with slot_utilization_in_flight, slot_utilization_between_batches,
tokens_per_s_ratio (in flight / between batches) and tokens_per_s_vs_sync.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's jgrpo, installed or not
RUNS = ("sync", "between_batches", "in_flight")


def overrides(args, run: str, run_dir: str, role: str = "both", endpoint: str = "") -> list[str]:
    common = [f"run.output_dir={run_dir}", f"run.iterations={args.iterations}", "run.eval_before=false",
              "run.eval_every=0", "checkpoint.every=1000000", "logging.progress_bar=false", "logging.samples_every=0",
              f"data.batch_size={args.prompts}", f"sampler.max_new_tokens={args.new}", "grpo.behaviour_refresh=1",
              f"sampler.slots={args.slots}", f"model.remat={args.remat}"]
    if run == "sync":
        return common
    common += ["rollout.mode=async", f"rollout.max_staleness={args.max_staleness}", f"rollout.weight_updates={run}",
               f"rollout.role={role}"]
    return common + ([f"rollout.endpoint={endpoint}"] if endpoint else [])


def child(args) -> None:
    """The trainer of one configuration, in this process: train, then print its figures and the rows' lengths."""
    from jgrpo.config.loading import load_config
    from jgrpo.rollout.collector import Collector
    from jgrpo.training.trainer import Trainer

    lengths, collect = {}, Collector.collect

    def keep_lengths(self, state, timings):
        out = collect(self, state, timings)
        lengths[state.iteration] = np.asarray(out.inputs.samples.lengths).tolist()
        return out

    Collector.collect = keep_lengths
    config = load_config(str(ROOT / "configs/quickstart.yaml"),
                         overrides(args, args.child, args.run_dir, args.role, args.endpoint))
    trainer = Trainer(config)
    try:
        assert trainer.run() == "done"
    finally:
        trainer.close()
    records = [json.loads(line) for line in (Path(args.run_dir) / "metrics.jsonl").read_text().splitlines()]
    warm = [r for r in records if r["iteration"] > args.warm]
    seconds = sum(r["time/iteration"] for r in warm)
    tokens = sum(sum(lengths[r["iteration"] - 1]) for r in warm)
    out = {"tokens_per_s": tokens / seconds, "s_per_iteration": seconds / len(warm),
           "lengths": [n for r in warm for n in lengths[r["iteration"] - 1]]}
    for key in ("rollout/slot_utilization", "rollout/versions_per_row", "rollout/versions_per_row_max",
                "rollout/staleness", "rollout/trainer_wait", "rollout/producer_idle", "time/sample", "time/update"):
        values = [r[key] for r in warm if key in r]
        if values:
            out[key] = statistics.mean(values)
    print(json.dumps(out))


def _pinned(cores: str) -> list[str]:
    return ["taskset", "-c", cores] if shutil.which("taskset") else []


def run_one(args, run: str) -> dict:
    """One configuration: sync as one job on both cores; async as a trainer on core 0 and a rollout job on core 1."""
    me = [sys.executable, __file__, "--iterations", str(args.iterations), "--warm", str(args.warm), "--prompts",
          str(args.prompts), "--new", str(args.new), "--slots", str(args.slots), "--max-staleness",
          str(args.max_staleness), "--remat", args.remat]
    with tempfile.TemporaryDirectory() as run_dir:
        if run == "sync":
            done = subprocess.run([*_pinned("0,1"), *me, "--child", run, "--run-dir", run_dir], capture_output=True,
                                  text=True, cwd=ROOT)
            if done.returncode:
                return {"error": done.stderr.strip().splitlines()[-1]}
            return json.loads(done.stdout.strip().splitlines()[-1])
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            endpoint = f"127.0.0.1:{s.getsockname()[1]}"
        trainer = subprocess.Popen([*_pinned("0"), *me, "--child", run, "--run-dir", run_dir, "--role", "trainer",
                                    "--endpoint", endpoint], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   text=True, cwd=ROOT)
        job = overrides(args, run, run_dir, "rollout", endpoint)
        rollout = subprocess.Popen([*_pinned("1"), sys.executable, "-m", "jgrpo.train", "configs/quickstart.yaml",
                                    *job], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT)
        out, err = trainer.communicate()
        if trainer.returncode:  # the rollout job would wait rollout.wait_timeout_s for it to come back
            rollout.kill()
        _, rollout_err = rollout.communicate()
    if trainer.returncode or rollout.returncode:
        return {"error": (err if trainer.returncode else rollout_err).strip().splitlines()[-1]}
    return json.loads(out.strip().splitlines()[-1])


def histogram(lengths, new: int) -> dict:
    edges = [e for e in (1, 2, 5, 9, 17, 33, 65, 129) if e < new] + [new, new + 1]  # the last bin: at the limit
    counts, _ = np.histogram(lengths, bins=edges)
    return {f"{lo}-{hi - 1}": int(c) for lo, hi, c in zip(edges[:-1], edges[1:], counts, strict=True)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iterations", type=int, default=10)
    p.add_argument("--warm", type=int, default=2, help="first iterations left out (compilation)")
    p.add_argument("--prompts", type=int, default=3, help="prompts per iteration (x G = 8 rows; the quickstart's 3)")
    p.add_argument("--new", type=int, default=256, help="max new tokens")
    p.add_argument("--slots", type=int, default=0, help="the sampler's slots (0: one batch's rows)")
    p.add_argument("--max-staleness", type=int, default=2)
    p.add_argument("--remat", default="full", help="model.remat: the quickstart's none takes SmolLM2's training of "
                   "24 rows x 352 tokens to 17 GB, two jobs past this machine's 24 GB")
    p.add_argument("--runs", nargs="+", choices=RUNS, default=list(RUNS))
    p.add_argument("--child", choices=RUNS, help=argparse.SUPPRESS)
    p.add_argument("--role", default="both", help=argparse.SUPPRESS)
    p.add_argument("--endpoint", default="", help=argparse.SUPPRESS)
    p.add_argument("--run-dir", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return
    print(f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}; {args.prompts} prompts x 8, {args.new} new tokens, "
          f"max_staleness {args.max_staleness}, slots {args.slots or 'one batch'}", file=sys.stderr)
    results = {}
    for run in args.runs:
        start = time.perf_counter()
        results[run] = run_one(args, run)
        print(f"{run}: {time.perf_counter() - start:.0f} s", file=sys.stderr)
    print("\n| run | tokens/s | s / iteration | slot utilization | versions per row (max) | staleness | trainer waits "
          "| producer idle |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for run, r in results.items():
        if "error" in r:
            print(f"| {run} | failed: {r['error']} |||||||")
            continue
        cell = lambda k, f="{:.2f}", r=r: "" if k not in r else f.format(r[k])  # noqa: E731
        print(f"| {run} | {r['tokens_per_s']:.1f} | {r['s_per_iteration']:.1f} | {cell('rollout/slot_utilization')} "
              f"| {cell('rollout/versions_per_row')} ({cell('rollout/versions_per_row_max', '{:.0f}')}) "
              f"| {cell('rollout/staleness')} | {cell('rollout/trainer_wait')} | {cell('rollout/producer_idle')} |")
    summary = {"args": {k: v for k, v in vars(args).items() if k not in ("child", "role", "endpoint", "run_dir")}}
    ok = {run: r for run, r in results.items() if "error" not in r}
    for run, r in ok.items():
        summary[f"length_histogram_{run}"] = histogram(r.pop("lengths"), args.new)
    if {"in_flight", "between_batches"} <= set(ok):
        inf, bb = ok["in_flight"], ok["between_batches"]
        summary.update(slot_utilization_in_flight=inf.get("rollout/slot_utilization"),
                       slot_utilization_between_batches=bb.get("rollout/slot_utilization"),
                       tokens_per_s_ratio=inf["tokens_per_s"] / bb["tokens_per_s"])
        if "sync" in ok:
            summary["tokens_per_s_vs_sync"] = inf["tokens_per_s"] / ok["sync"]["tokens_per_s"]
    summary["results"] = results
    print(json.dumps(summary))


if __name__ == "__main__":
    sys.exit(main())
