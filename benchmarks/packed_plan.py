"""The update's TPU roofline padded vs packed (`model.packing`) at a length distribution's packing, compiled here.

    python benchmarks/packed_plan.py [CONFIG] [--topology v5e:2x4] [--micro-batches 1,8] [--lengths gsm8k]

For each `grpo.micro_batches` u: the update of CONFIG (default the GSM8K Qwen2.5-0.5B config) compiled for the
topology by XLA's TPU compiler (deviceless, as `jgrpo.plan`), padded and packed. The packed update's loop runs the
micro-batches a minibatch's plan uses, so its cost is taken at the counts the plan gives for the lengths: 64
batches drawn from the rollout benchmark's histogram (benchmarks/packing.py, scaled to the config's
max_new_tokens; prompts of half to all of the prompt width), each planned with the shipped planner at the
config's packed sizes. Per chip: matmul TFLOPs, HBM GB, the roofline seconds (the largest of compute, HBM and
ICI time at the chip's peaks, `jgrpo.planning.roofline`), the packed one averaged over the drawn batches, and
the live memory (the packed one is its buffer's: the same at any count; a program the compiler refuses for
memory shows what it asked for, and no cost). Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from packing import draw_lengths  # noqa: E402 - benchmarks/packing.py, host only

import jgrpo  # noqa: E402, F401 - first: it keeps jax on the CPU quietly where libtpu has no TPU


def plan_counts(config, lengths_name: str, batches: int, shards: int) -> list[int]:
    """The packed micro-batches of each minibatch of `batches` drawn batches, as the trainer would plan them."""
    from jgrpo.data import bucketed_length
    from jgrpo.training.packed_passes import packed_sizes
    from jgrpo.training.packing import plan_packing

    g = config.grpo
    B, G, N = config.data.batch_size, g.num_generations, config.completion_tokens
    P = bucketed_length(config.data.max_prompt_length, config.sampler.prompt_bucket)
    R, M = B * G, g.num_minibatches
    sizes = packed_sizes(rows=R // (M * g.micro_batches), new_tokens=N, prompt_width=P, group_size=G,
                         groups=B // M, shards=shards, width=config.model.packing_width)
    rng = np.random.default_rng(0)
    counts = []
    for _ in range(batches):
        lengths = draw_lengths(lengths_name, R, N, rng).reshape(M, -1)
        prompts = rng.integers(P // 2, P + 1, B).reshape(M, -1)
        for m in range(M):
            counts.append(plan_packing(lengths[m], sizes, G, prompt_lengths=prompts[m]).micro_batches)
    return counts


def update_cost(config, devices, chip, counts=(None,)) -> dict:
    """The update compiled once for `devices`: per-chip cost and roofline seconds (averaged over the packed
    micro-batch `counts`; None: a padded update), and its live bytes (the same at any count)."""
    from jgrpo.planning.abstract_run import lower_iteration
    from jgrpo.planning.fit import refused_bytes
    from jgrpo.planning.hlo_cost import HloCost
    from jgrpo.planning.hlo_inspect import summary
    from jgrpo.planning.roofline import bounds

    (program,) = lower_iteration(config, devices, names=("update",)).programs
    try:
        compiled = program.lowered.compile()
    except Exception as e:  # noqa: BLE001 - XLA's runtime error: a refusal for memory is a result here
        if refused_bytes(str(e)) is None:
            raise
        return {"flops": float("nan"), "hbm_bytes": float("nan"), "seconds": float("nan"),
                "live_bytes": refused_bytes(str(e)), "refused": str(e).strip().splitlines()[0]}
    text, memory = compiled.as_text(), compiled.memory_analysis()
    costs = {}
    for n in sorted(set(counts), key=str):
        cost = HloCost(text, n)
        flops, hbm = cost.flops, cost.bytes
        costs[n] = flops, hbm, max(bounds(flops, hbm, summary(cost).get("collective_bytes", 0.0), chip).values())
    flops, hbm, seconds = (float(np.mean([costs[n][i] for n in counts])) for i in range(3))
    live = (memory.argument_size_in_bytes - program.resident_argument_bytes + memory.temp_size_in_bytes
            + memory.output_size_in_bytes - memory.alias_size_in_bytes)
    return {"flops": flops, "hbm_bytes": hbm, "seconds": seconds, "live_bytes": int(live)}


def main(argv: list[str] | None = None) -> int:
    from jgrpo.config.loading import load_config
    from jgrpo.plan import abstract_run, topology_devices
    from jgrpo.training.packed_passes import data_shards

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("config", nargs="?", default="configs/paper_gsm8k_qwen05b_on_policy.yaml")
    p.add_argument("--topology", default="v5e:2x4")
    p.add_argument("--micro-batches", default="1,8", help="grpo.micro_batches values to compare at")
    p.add_argument("--lengths", default="gsm8k", help="a histogram of benchmarks/packing.py")
    p.add_argument("--batches", type=int, default=64)
    args = p.parse_args(argv)
    devices, chip = topology_devices(args.topology)
    print(f"{args.config} on {args.topology}, the update per chip; packed at {args.lengths} lengths "
          f"({args.batches} drawn batches)", file=sys.stderr)
    print("| micro-batches | padded TFLOP | packed TFLOP | padded HBM GB | packed | padded ms "
          "| packed ms (micro-batches used) | packed / padded time | padded GiB live | packed |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    results = []
    for u in (int(x) for x in args.micro_batches.split(",")):
        base = ["checkpoint.every=0", f"grpo.micro_batches={u}"]
        padded_config = load_config(args.config, base)
        packed_config = load_config(args.config, [*base, "model.packing=true"])
        run = abstract_run(packed_config, devices)
        R = packed_config.data.batch_size * packed_config.grpo.num_generations
        counts = plan_counts(packed_config, args.lengths, args.batches, data_shards(run.mesh, run.steps.model.rules,
                                                                                   run.steps.assembly.chunks, R))
        padded, packed = update_cost(padded_config, devices, chip), update_cost(packed_config, devices, chip, counts)
        r = {"micro_batches": u, "packed_micro_batches_mean": float(np.mean(counts)), "padded": padded,
             "packed": packed, "time_ratio": packed["seconds"] / padded["seconds"]}
        results.append(r)
        print(f"| {u} | {padded['flops'] / 1e12:.3f} | {packed['flops'] / 1e12:.3f} | "
              f"{padded['hbm_bytes'] / 1e9:.2f} | {packed['hbm_bytes'] / 1e9:.2f} | "
              f"{padded['seconds'] * 1e3:.1f} | {packed['seconds'] * 1e3:.1f} "
              f"({r['packed_micro_batches_mean']:.2f}) | **{r['time_ratio']:.2f}x** | "
              f"{padded['live_bytes'] / 2**30:.2f} | {packed['live_bytes'] / 2**30:.2f} |", flush=True)
    print(json.dumps({"packed_plan": results, "args": vars(args)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
