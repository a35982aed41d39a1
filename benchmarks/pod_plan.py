"""Two jobs at pod scale, predicted: a trainer slice and a rollout slice, from `jgrpo.plan`'s roofline.

For a config and pairs of slices (trainer, rollout), the planner compiles the run's programs for each slice
deviceless (XLA's TPU compiler, no TPU); the trainer slice's training programs (log-prob passes, update) and
the rollout slice's sampling give each side's roofline seconds per iteration, T_t and T_s. The weights cross
the data-center network once per publish: every rollout host receives the sampling copy (parameters x
`sampler.weights_dtype`'s bytes; `--changed-fraction f`: only the changes, f x (4 index bytes + the value's) per
element) through the pipelined stages of `roofline.weight_sync_seconds` (per host: device to host, the link at
min(chips per host x `dcn_gbps`, one TCP connection) x `--channel-efficiency`, host to device; the slowest sets
the pace, one bucket fills the pipe), T_w. Then, per iteration:

    two jobs on-policy (rollout.max_staleness 0):  T_s + T_w + T_t      (sampling waits for each update)
    two jobs async (max_staleness >= 1):            max(T_s, T_t + T_w) (the trainer sends while it waits)

and, for reference, one job on the trainer slice alone (T_s + T_t there, sync). Roofline: a lower bound for
each program, so the ratios are the figures to plan with, not the seconds.

    python benchmarks/pod_plan.py configs/paper_deepscaler_r1distill15b_on_policy.yaml \
        --pairs v5p:4x4x4,v5p:2x2x4 v5p:2x4x4,v5p:2x4x4 \
        --trainer-overrides v5p:4x4x4=mesh.data=4,grpo.micro_batches=4

`--trainer-overrides TOPOLOGY=k=v,k=v` plans that topology's trainer side with more overrides (its rollout side
keeps the config's; the one-job column is the trainer side's plan): rows per micro-batch that split over a
larger slice's chips.

Prints a table, then one JSON line. Each compile takes minutes on a 2-core machine for a 1.5B model.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent))  # this checkout's jgrpo, installed or not (children too)

from jgrpo.config.loading import load_config  # noqa: E402
from jgrpo.planning.roofline import CHIPS, weight_sync_seconds  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
BYTES = {"float32": 4, "bfloat16": 2, "int8": 1}


def plan(config: str, topology: str, overrides: list[str]) -> dict:
    out = subprocess.run([sys.executable, "-m", "jgrpo.plan", config, *overrides, "--topology", topology],
                         capture_output=True, text=True, cwd=ROOT)
    if out.returncode:
        raise SystemExit(f"jgrpo.plan {topology} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])["plans"][0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("config")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--pairs", nargs="+", required=True, help="TRAINER_TOPOLOGY,ROLLOUT_TOPOLOGY ...")
    p.add_argument("--trainer-overrides", nargs="*", default=[], metavar="TOPOLOGY=K=V,K=V",
                   help="more overrides for a topology's trainer side, e.g. v5p:4x4x4=mesh.data=4,grpo.micro_batches=4")
    p.add_argument("--channel-efficiency", type=float, default=1.0,
                   help="the share of one TCP connection jgrpo's channel reaches (ours_over_raw, weight_sync.py)")
    p.add_argument("--changed-fraction", type=float, default=None,
                   help="publishes of changes (rollout.weight_delta): the fraction of elements each one carries")
    args = p.parse_args()
    config = load_config(ROOT / args.config if not Path(args.config).is_absolute() else args.config, args.overrides)
    extra = {t: o.split(",") for t, o in (item.split("=", 1) for item in args.trainer_overrides)}
    plans: dict[tuple[str, tuple[str, ...]], dict] = {}

    def planned(topology: str, more: list[str]) -> dict:
        key = (topology, tuple(more))
        if key not in plans:
            plans[key] = plan(args.config, topology, args.overrides + more)
            print(f"planned {topology} {' '.join(more)}: {plans[key]['compile_s']:.0f} s to compile", file=sys.stderr)
        return plans[key]

    rows = []
    for pair in args.pairs:
        trainer_topology, rollout_topology = pair.split(",")
        trainer, rollout = planned(trainer_topology, extra.get(trainer_topology, [])), planned(rollout_topology, [])
        chip = CHIPS[rollout["topology"].split(":")[0]]
        value = BYTES[config.sampler.weights_dtype]
        weights = trainer["parameters"] * value
        wire = weights if args.changed_fraction is None else weights * args.changed_fraction * (4 + value) / value
        sync = weight_sync_seconds(wire, dcn_gbps=chip.dcn_gbps * rollout["chips"] / rollout["hosts"],
                                   bucket_bytes=config.rollout.sync_bucket_mb << 20,
                                   channel_efficiency=args.channel_efficiency)
        t_s, t_t, t_w = rollout["roofline"]["sample_s"], trainer["roofline"]["train_s"], sync["seconds"]
        one_job = trainer["roofline"]["sample_s"] + t_t
        rows.append({"trainer": trainer["topology"], "trainer_overrides": extra.get(trainer_topology, []),
                     "rollout": rollout["topology"], "fits": [trainer["fits"], rollout["fits"]], "sample_s": t_s,
                     "train_s": t_t, "update_mfu": trainer["roofline"]["update_mfu"], "weight_sync_s": t_w,
                     "weight_sync_bound_by": sync["bound_by"], "weights_gb": weights / 1e9, "wire_gb": wire / 1e9,
                     "on_policy_s": t_s + t_w + t_t, "async_s": max(t_s, t_t + t_w),
                     "one_job_trainer_slice_s": one_job})
    print("| trainer slice | rollout slice | fits | T_s sampling | T_t training (update MFU at best) | T_w weights "
          "over DCN | two jobs on-policy | two jobs async | async gain | one job on the trainer slice |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        fits = "yes" if all(r["fits"]) else "no"
        trainer = " ".join([r["trainer"], *r["trainer_overrides"]])
        print(f"| {trainer} | {r['rollout']} | {fits} | {r['sample_s']:.2f} s | {r['train_s']:.2f} s "
              f"({r['update_mfu']:.0%}) "
              f"| {r['weight_sync_s']:.3f} s ({r['wire_gb']:.2f} GB, {r['weight_sync_bound_by']}) "
              f"| {r['on_policy_s']:.2f} s "
              f"| {r['async_s']:.2f} s | {r['on_policy_s'] / r['async_s']:.2f}x "
              f"| {r['one_job_trainer_slice_s']:.2f} s |")
    print(json.dumps({"config": args.config, "rows": rows}))


if __name__ == "__main__":
    sys.exit(main())
