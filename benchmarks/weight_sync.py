"""Weights between two jobs: ours against the loopback's limit and Arrow Flight, whole and as changes.

Two parts, one run:

1. How much changes per publish. The real SmolLM2-135M-Instruct trains on the quickstart's task (one process,
   on-policy: v = 1, a publish per iteration, no warm-up: the rate from the first step) at the learning rates of
   configs/quickstart.yaml (2e-5), paper_gsm8k_* (5e-6) and paper_deepscaler_* (1e-6), `--iterations` each; after
   every iteration the sampler's bfloat16 and int8 copies (`models.quantize.sampler_copy`) are compared with the
   last one, bit for bit: the fraction of elements a publish of changes carries. The first publish is reported
   apart (Adam's first step moves every weight with a gradient by the full rate); the figure is the median of the
   others.
2. The transfer. A sender and a receiver process (benchmarks/weight_sync_peers.py: 2 emulated CPU devices each,
   over loopback) move bf16 params of each `--sizes-mb` in buckets of `--bucket-mb`: raw socket, Arrow Flight,
   ours whole (host path and device to device), and the changes at the fractions part 1 measured, as indices +
   values (ours) and as XOR + zstd. Every path `--repeats` times, side by side; min and median of each.

    python benchmarks/weight_sync.py                               # 256 MiB and 1 GiB, 3 repeats, ~15 min
    python benchmarks/weight_sync.py --sizes-mb 64 --repeats 1 --fractions gsm8k=0.02   # quick, no training

Prints a table, then one JSON line: raw_socket_gb_s, ours_gb_s (the default path, device to device, at the
largest size), flight_gb_s, ours_over_raw, delta_fraction_quickstart, delta_fraction_gsm8k_lr,
delta_speedup_gsm8k_lr (whole copy time / changes time at the GSM8K rate's fraction), and every figure. On
loopback the figures are memory copies and the kernel's socket work on a shared 2-core host, not a network.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(1, str(Path(__file__).parent.parent))  # this checkout's jgrpo, installed or not (children too)

ROOT = Path(__file__).resolve().parent.parent
RATES = {"quickstart": 2e-5, "gsm8k": 5e-6, "deepscaler": 1e-6}  # the configs' optim.learning_rate


def measure_fractions(args) -> dict:
    """Part 1, in this process: {rate name: {"bfloat16": [fraction per publish], "int8": [...], "float32": [...]}}."""
    import jax
    import numpy as np

    from jgrpo.config.loading import load_config
    from jgrpo.models.quantize import sampler_copy
    from jgrpo.training.trainer import Trainer

    out = {}
    for name, rate in RATES.items():
        with tempfile.TemporaryDirectory() as run_dir:
            config = load_config(ROOT / "configs/quickstart.yaml", [
                f"run.output_dir={run_dir}", f"optim.learning_rate={rate}", "optim.warmup_steps=0",
                "grpo.behaviour_refresh=1", f"run.iterations={args.iterations}", "run.eval_before=false",
                "run.eval_every=0", "checkpoint.every=1000000", "logging.progress_bar=false",
                "logging.samples_every=0"])
            trainer = Trainer(config)
            copies = {dtype: jax.jit(sampler_copy(dtype, config.model.compute_dtype))
                      for dtype in ("bfloat16", "int8", "float32")}
            bits = {dtype: _bits(copy(trainer.state.params)) for dtype, copy in copies.items()}
            fractions = {dtype: [] for dtype in copies}
            try:
                for _ in range(args.iterations):
                    trainer.train_iteration()
                    for dtype, copy in copies.items():
                        now = _bits(copy(trainer.state.params))
                        changed = sum(int(np.count_nonzero(a != b)) for a, b in zip(now, bits[dtype], strict=True))
                        fractions[dtype].append(changed / sum(a.size for a in now))
                        bits[dtype] = now
            finally:
                trainer.close()
        out[name] = fractions
        print(f"{name} (lr {rate:g}): bf16 changed per publish {[f'{f:.4f}' for f in fractions['bfloat16']]}",
              file=sys.stderr)
    return out


def _bits(tree) -> list:
    import jax
    import numpy as np

    return [np.asarray(x).reshape(-1).view({1: np.uint8, 2: np.uint16, 4: np.uint32}[x.dtype.itemsize])
            for x in jax.tree.leaves(tree)]


def typical(fractions: list[float]) -> float:
    """The fraction a publish carries in a run: the median after the first (Adam's first step is every weight)."""
    return statistics.median(fractions[1:] or fractions)


def transfer(args, fractions: dict[str, float]) -> list[dict]:
    """Part 2: the sender and receiver processes; one record per size and repeat."""
    ports = {}
    for name in ("control", "raw"):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports[name] = s.getsockname()[1]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get(
           "PYTHONPATH", "")]), "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} "
           "--xla_force_host_platform_device_count=2"}
    common = ["--ports", json.dumps(ports), "--sizes-mb", *map(str, args.sizes_mb), "--bucket-mb",
              str(args.bucket_mb), "--repeats", str(args.repeats), "--fractions",
              *(f"{k}={v}" for k, v in fractions.items())]
    procs = {role: subprocess.Popen([sys.executable, __file__, "--peer", role, *common], env=env, cwd=ROOT,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for role in ("receiver", "sender")}
    done = {role: proc.communicate() for role, proc in procs.items()}
    failed = [f"the {role} failed:\n{done[role][1][-3000:]}" for role, proc in procs.items() if proc.returncode]
    if failed:
        sys.exit("\n".join(failed))
    return json.loads(done["sender"][0].strip().splitlines()[-1])


def summarise(records: list[dict], fractions: dict[str, float]) -> dict:
    """Per size and path: GB/s (min and median over the repeats; the best is the fastest)."""
    out = {}
    for size in sorted({r["size_mb"] for r in records}):
        rows = [r for r in records if r["size_mb"] == size]
        gb = rows[0]["bytes"] / 1e9
        paths = [k for k in rows[0] if k not in ("size_mb", "bytes", "repeat") and not k.endswith(
            ("_bytes", "_fraction"))]
        out[size] = {path: {"best_gb_s": gb / min(r[path] for r in rows),
                            "median_gb_s": gb / statistics.median(r[path] for r in rows),
                            "median_s": statistics.median(r[path] for r in rows),
                            **({"wire_bytes": statistics.median(r[f"{path}_bytes"] for r in rows)}
                               if f"{path}_bytes" in rows[0] else {})}
                     for path in paths}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes-mb", type=int, nargs="+", default=[256, 1024])
    p.add_argument("--bucket-mb", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--iterations", type=int, default=5, help="training iterations per learning rate (part 1)")
    p.add_argument("--fractions", nargs="*", default=None, metavar="NAME=FRACTION",
                   help="skip part 1: the changed fractions to send (e.g. gsm8k=0.02)")
    p.add_argument("--peer", choices=["sender", "receiver", "fractions"], help=argparse.SUPPRESS)
    p.add_argument("--ports", default="{}", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.peer in ("sender", "receiver"):
        from weight_sync_peers import serve

        args.fractions = [(k, float(v)) for k, v in (item.split("=") for item in args.fractions)]
        serve(args.peer, args, json.loads(args.ports))
        return
    if args.peer == "fractions":
        print(json.dumps(measure_fractions(args)))
        return
    measured = None
    if args.fractions is None:  # part 1 in a process of its own: its memory is gone before part 2 starts
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        out = subprocess.run([sys.executable, __file__, "--peer", "fractions", "--iterations", str(args.iterations)],
                             env=env, cwd=ROOT, stdout=subprocess.PIPE, text=True)
        if out.returncode:
            sys.exit(f"measuring the changed fractions failed ({out.returncode})")
        measured = json.loads(out.stdout.strip().splitlines()[-1])
        fractions = {name: typical(f["bfloat16"]) for name, f in measured.items()}
    else:
        fractions = {k: float(v) for k, v in (item.split("=") for item in args.fractions)}
    summary = summarise(transfer(args, fractions), fractions)
    if measured:
        print("| learning rate | bf16: first publish | bf16: later (median) | int8: later | float32: later |")
        print("|---|---:|---:|---:|---:|")
        for name, f in measured.items():
            print(f"| {name} ({RATES[name]:g}) | {f['bfloat16'][0]:.2%} | {typical(f['bfloat16']):.2%} "
                  f"| {typical(f['int8']):.2%} | {typical(f['float32']):.2%} |")
    print("\n| params | path | GB/s best | GB/s median | s median | vs raw (median) | bytes on the wire |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for size, paths in summary.items():
        raw = paths["raw"]["median_gb_s"]
        for path, f in paths.items():
            wire = f"{f['wire_bytes'] / 2**20:.1f} MiB" if "wire_bytes" in f else ""
            print(f"| {size} MiB | {path} | {f['best_gb_s']:.2f} | {f['median_gb_s']:.2f} | {f['median_s']:.3f} "
                  f"| {f['median_gb_s'] / raw:.2f} | {wire} |")
    largest = summary[max(summary)]
    out = {"raw_socket_gb_s": largest["raw"]["median_gb_s"], "ours_gb_s": largest["ours"]["median_gb_s"],
           "flight_gb_s": largest["flight"]["median_gb_s"],
           "ours_over_raw": largest["ours"]["median_gb_s"] / largest["raw"]["median_gb_s"]}
    for name, fraction in fractions.items():
        key = f"{name}_lr" if name != "quickstart" else name
        out[f"delta_fraction_{key}"] = fraction
        if f"changes_{name}" in largest:
            out[f"delta_speedup_{key}"] = largest["ours"]["median_s"] / largest[f"changes_{name}"]["median_s"]
            out[f"xor_zstd_speedup_{key}"] = largest["ours"]["median_s"] / largest[f"xor_zstd_{name}"]["median_s"]
    out.update(sizes_mb=args.sizes_mb, bucket_mb=args.bucket_mb, repeats=args.repeats, by_size=summary,
               measured_fractions=measured)
    print(json.dumps(out))


if __name__ == "__main__":
    sys.exit(main())
