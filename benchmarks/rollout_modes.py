"""Iteration time of the rollout modes, side by side: sync vs window vs async, on shared devices and split in half,
and async as two jobs (`rollout.role: trainer` + `rollout`, each with half the devices, over loopback).

The real SmolLM2-135M-Instruct trains on the quickstart's task (2-digit addition, G = 8, temperature 0.7) on an
emulated CPU mesh of `--devices` devices (default 4; fsdp over all, or `mesh.rollout_devices` = half: the
sampler on the first half, the trainer on the rest), v = 4 for sync and window, `rollout.max_staleness`
(default 2, publish every iteration) for async. Each configuration runs in its own process for 2 v
iterations; the first v (compilation, the first window) are warm-up and the wall-clock of the last v is
reported, per iteration, with the trainer's phase times (sample, update, weight sync; async: the trainer's
wait for the producer and the producer's idle time). No checkpoints, no evaluation.

    python benchmarks/rollout_modes.py                          # all seven, ~25-30 min on 2 cores
    python benchmarks/rollout_modes.py --modes async            # async: one job shared, split, and two jobs
    python benchmarks/rollout_modes.py --new 64 --prompts 4     # longer completions
    python benchmarks/rollout_modes.py --devices 8              # the 8-device mesh, split 4+4 (> 18 GB RAM)

Every emulated device holds its own copies of what is replicated on it, so memory grows with the device count:
8 devices took SmolLM2's runs past 18 GB of resident memory on a 24 GB host. On a host whose cores are shared
by all the emulated devices, sampling and training compete for the same cores even on disjoint sub-meshes:
the overlap async makes is capped by the cores, not the devices (see docs/benchmarks.md for the pod-scale
estimate). Prints a table, then one JSON line with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(1, str(Path(__file__).parent.parent))  # this checkout's jgrpo, installed or not (children too)
from hardware import usable_cores  # noqa: E402

from jgrpo.config.errors import exits_on_user_error  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MODES = ("sync", "window", "async")


def overrides(args, mode: str, rollout_devices: int, run_dir: str, role: str = "both") -> list[str]:
    common = [f"run.output_dir={run_dir}", f"run.iterations={2 * args.v}", "run.eval_before=false",
              "run.eval_every=0", "checkpoint.every=1000000", "logging.progress_bar=false", "logging.samples_every=0",
              f"data.batch_size={args.prompts}", f"sampler.max_new_tokens={args.new}",
              f"mesh.rollout_devices={rollout_devices}", f"rollout.mode={mode}", f"rollout.role={role}"]
    if role != "both":
        common.append(f"rollout.endpoint={args.endpoint}")
    if mode == "async":
        return [*common, "grpo.behaviour_refresh=1", f"rollout.max_staleness={args.max_staleness}"]
    return [*common, f"grpo.behaviour_refresh={args.v}"]


def child(args) -> None:
    """One configuration in this process: train, then print the warm iterations' figures as JSON."""
    from jgrpo.config.loading import load_config
    from jgrpo.training.trainer import Trainer

    with tempfile.TemporaryDirectory() as run_dir:
        run_dir = args.run_dir or run_dir  # two jobs: the same directory in both configs (the trainer's)
        config = load_config(str(ROOT / "configs/quickstart.yaml"),
                             overrides(args, args.child, args.rollout_devices, run_dir, args.role))
        trainer = Trainer(config)
        try:
            assert trainer.run() == "done"
        finally:
            trainer.close()
        records = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    warm = [r for r in records if r["iteration"] > args.v]  # the first v: compilation and the first window
    phases = {}
    for r in warm:  # completion tokens trained per second
        r["tokens_per_s"] = r["completion/length_mean"] * args.prompts * 8 / r["time/iteration"]
    for key in ("time/iteration", "tokens_per_s", "time/sample", "time/update", "time/weight_sync",
                "rollout/trainer_wait", "rollout/producer_idle", "rollout/staleness"):
        values = [r[key] for r in warm if key in r]
        if values:
            phases[key] = statistics.mean(values)
    phases["peak_memory_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux: KiB
    print(json.dumps(phases))


@exits_on_user_error
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--v", type=int, default=4)
    p.add_argument("--max-staleness", type=int, default=2)
    p.add_argument("--prompts", type=int, default=4, help="prompts per iteration (x G = 8 rows)")
    p.add_argument("--new", type=int, default=32, help="max new tokens")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="the one-job modes to run")
    p.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    p.add_argument("--devices", type=int, default=4, help="emulated CPU devices (even: the split is half + half)")
    p.add_argument("--rollout-devices", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--role", default="both", help=argparse.SUPPRESS)
    p.add_argument("--endpoint", default="", help=argparse.SUPPRESS)
    p.add_argument("--run-dir", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return
    if args.devices < 2 or args.devices % 2:
        p.error("--devices must be even and at least 2 (the split placement gives each side half)")
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={args.devices}"
    env = {**os.environ, "XLA_FLAGS": flags}
    half = args.devices // 2
    placements = {"shared": 0, f"split {half}+{half}": half}
    print(f"{usable_cores()} cores, load average {os.getloadavg()[0]:.1f}; {args.devices} emulated devices, "
          f"{args.prompts} prompts x 8 samples, {args.new} new tokens, v = {args.v}, "
          f"async max_staleness {args.max_staleness}",
          file=sys.stderr)
    results = {}
    for placement, rollout_devices in placements.items():
        for mode in args.modes:
            start = time.perf_counter()
            cmd = [sys.executable, __file__, "--child", mode, "--rollout-devices", str(rollout_devices),
                   "--v", str(args.v), "--max-staleness", str(args.max_staleness), "--prompts", str(args.prompts),
                   "--new", str(args.new)]
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
            if done.returncode:
                results[f"{placement}/{mode}"] = {"error": done.stderr.strip().splitlines()[-1]}
            else:
                results[f"{placement}/{mode}"] = json.loads(done.stdout.strip().splitlines()[-1])
            print(f"{placement} {mode}: {time.perf_counter() - start:.0f} s", file=sys.stderr)
    start = time.perf_counter()
    results[f"two jobs {half}+{half}/async"] = two_jobs(args, env, half)
    print(f"two jobs {half}+{half} async: {time.perf_counter() - start:.0f} s", file=sys.stderr)
    first = "sync" if "sync" in args.modes else args.modes[0]
    base = results[f"shared/{first}"].get("time/iteration")
    split_async = results[f"split {half}+{half}/async"].get("tokens_per_s")
    print(f"\n| placement | mode | s / iteration | vs shared {first} | tokens/s | vs split async | sample | update "
          "| weight sync | trainer waits | producer idle | staleness | peak memory |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, r in results.items():
        placement, mode = name.split("/")
        if "error" in r:
            print(f"| {placement} | {mode} | failed: {r['error']} |||||||||||")
            continue
        cells = [r.get(k) for k in ("time/sample", "time/update", "time/weight_sync", "rollout/trainer_wait",
                                    "rollout/producer_idle", "rollout/staleness")]
        text = " | ".join("" if c is None else f"{c:.2f}" for c in cells)
        versus = f"{r['tokens_per_s'] / split_async:.2f}x" if split_async else ""
        print(f"| {placement} | {mode} | {r['time/iteration']:.2f} | {base / r['time/iteration']:.2f}x "
              f"| {r['tokens_per_s']:.0f} | {versus} | {text} | {r['peak_memory_gb']:.1f} GB |")
    print(json.dumps({"args": vars(args), "results": results}))


def two_jobs(args, env: dict, devices: int) -> dict:
    """Async as two jobs (`rollout.role`): a trainer process and a rollout process with `devices` devices each,
    joined over loopback; the trainer's figures (peak memory: the trainer process's)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        endpoint = f"127.0.0.1:{s.getsockname()[1]}"
    env = {**env, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}"}
    with tempfile.TemporaryDirectory() as run_dir:
        common = ["--v", str(args.v), "--max-staleness", str(args.max_staleness), "--prompts", str(args.prompts),
                  "--new", str(args.new), "--endpoint", endpoint, "--run-dir", run_dir]
        trainer = subprocess.Popen([sys.executable, __file__, "--child", "async", "--role", "trainer", *common],
                                   env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
        job = overrides(argparse.Namespace(**{**vars(args), "endpoint": endpoint}), "async", 0, run_dir, "rollout")
        rollout = subprocess.Popen([sys.executable, "-m", "jgrpo.train", "configs/quickstart.yaml", *job],
                                   env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT)
        out, err = trainer.communicate()
        _, rollout_err = rollout.communicate()
    if trainer.returncode or rollout.returncode:
        return {"error": (err or rollout_err).strip().splitlines()[-1]}
    return json.loads(out.strip().splitlines()[-1])


if __name__ == "__main__":
    sys.exit(main())
