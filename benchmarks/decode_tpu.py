"""The sampler's decode loop on a TPU, unrolled vs scanned layers (`sampler.decode_layers`), and the cost of one
token draw per `sampler.draw`, with libtpu's compiler.

    python benchmarks/decode_tpu.py [--runs CONFIG@TOPOLOGY ...] [--draws-only] [--out results.json]

For each run (default: the paper's GSM8K config, Qwen2.5-0.5B with 24 layers, on v5e-8, and its DeepScaleR
config, R1-Distill-1.5B with 28 layers, on v5p-8) and each layer loop, compiles the sampler program (no TPU
needed) and prints per chip: compile seconds, the HBM bytes of the last decode step (the costliest trip, from
the compiled HLO), what a step must read at least (the sampling weights and the filled KV cache), their ratio,
HBM-to-HBM copies of weight- or cache-sized buffers inside loops, and the program's temporary memory.
Compile time is this machine's (2 cores: compare the two loops with each other, not with other machines).
Then, on one v5e chip, the HBM bytes and temporary memory of drawing one token per row from [rows, 151936]
logits (Qwen's vocabulary) with each draw method (the sampled distribution is the same: tests prove it).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jgrpo.config.errors import exits_on_user_error  # noqa: E402
from jgrpo.config.loading import load_config  # noqa: E402
from jgrpo.data import bucketed_length  # noqa: E402
from jgrpo.plan import GIB, topology_devices  # noqa: E402
from jgrpo.planning.abstract_run import lower_iteration, per_chip_bytes  # noqa: E402
from jgrpo.planning.fit import compile_program  # noqa: E402

RUNS = ("configs/paper_gsm8k_qwen05b_on_policy.yaml@v5e:2x4",
        "configs/paper_deepscaler_r1distill15b_on_policy.yaml@v5p:2x2x2")


def filled_cache_bytes(config, run) -> float:
    """Per chip, the keys and values of every slot a last decode step reads (prompt + generated)."""
    c, cfg, mesh = config, run.cfg, run.mesh
    rows = c.data.batch_size * c.grpo.num_generations
    rows_per_chip = rows / math.gcd(rows, mesh.shape["data"] * mesh.shape["fsdp"])
    kv_heads = cfg.num_kv_heads / (mesh.shape["tensor"] if cfg.num_kv_heads % mesh.shape["tensor"] == 0 else 1)
    slots = bucketed_length(c.data.max_prompt_length, c.sampler.prompt_bucket) + c.sampler.max_new_tokens
    itemsize = 2 if cfg.compute_dtype == "bfloat16" else 4
    return 2 * cfg.num_layers * rows_per_chip * kv_heads * slots * cfg.head_dim * itemsize


def measure(config_path: str, topology: str, decode_layers: str, overrides=()) -> dict:
    config = load_config(config_path, [f"sampler.decode_layers={decode_layers}", "run.eval_every=0", *overrides])
    devices, _ = topology_devices(topology)
    iteration = lower_iteration(config, devices, names=("sample",))
    (program,) = iteration.programs
    report = compile_program(program.name, program.lowered, program.resident_argument_bytes)
    weights = per_chip_bytes(iteration.run.sample_params)
    cache = filled_cache_bytes(config, iteration.run)
    copies = report.loops["loop_big_copies"]
    return {
        "config": os.path.basename(config_path), "topology": topology, "decode_layers": decode_layers,
        "layers": iteration.run.cfg.num_layers, "compile_s": round(report.compile_s, 1),
        "step_gb": report.step_bytes / 1e9, "weights_gb": weights / 1e9, "kv_cache_gb": cache / 1e9,
        "step_over_minimum": report.step_bytes / (weights + cache),
        "copies_in_loops": len(copies), "temp_gib": report.temp_bytes / GIB,
    }


def measure_draws(topology: str = "v5e:2x2", vocab: int = 151936, rows=(16, 256)) -> list[dict]:
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    from jgrpo.planning.hlo_cost import HloCost
    from jgrpo.sampling.methods import DRAWS, SamplingMethod

    device = topology_devices(topology)[0][0]
    results = []
    for r in rows:
        logits = jax.ShapeDtypeStruct((r, vocab), jnp.float32, sharding=SingleDeviceSharding(device))
        keys = jax.ShapeDtypeStruct((r,), jax.eval_shape(lambda: jax.random.key(0)).dtype,
                                    sharding=SingleDeviceSharding(device))
        for draw in DRAWS:
            method = SamplingMethod(temperature=0.1, draw=draw)
            compiled = jax.jit(lambda x, k, m=method: m.choose(m.process_logits(x), k)).lower(logits, keys).compile()
            results.append({"rows": r, "draw": draw, "hbm_mb": HloCost(compiled.as_text()).bytes / 1e6,
                            "logits_mb": r * vocab * 4 / 1e6,
                            "temp_mb": compiled.memory_analysis().temp_size_in_bytes / 1e6})
    return results


@exits_on_user_error
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", nargs="+", default=RUNS, help="CONFIG@TOPOLOGY pairs")
    parser.add_argument("--layers", nargs="+", default=("unrolled", "scanned"))
    parser.add_argument("--draws-only", action="store_true", help="only the draw table")
    parser.add_argument("--skip-draws", action="store_true", help="no draw table")
    parser.add_argument("--set", nargs="*", default=(), help="config overrides, e.g. sampler.slots=64")
    parser.add_argument("--out", help="write the results as JSON here too")
    args = parser.parse_args()
    results = []
    print("| rows | draw | HBM MB per draw | logits MB | temp MB |\n|---|---|---|---|---|")
    for r in () if args.skip_draws else measure_draws():
        results.append(r)
        print(f"| {r['rows']} | {r['draw']} | {r['hbm_mb']:.1f} | {r['logits_mb']:.1f} | {r['temp_mb']:.1f} |",
              flush=True)
    if args.draws_only:
        args.runs = ()
    print("| config | topology | layers | loop | compile s | last step GB | weights + KV GB | ratio | copies in "
          "loops | temp GiB |\n|---|---|---|---|---|---|---|---|---|---|")
    for run in args.runs:
        config_path, topology = run.split("@")
        for decode_layers in args.layers:
            r = measure(config_path, topology, decode_layers, args.set)
            results.append(r)
            print(f"| {r['config']} | {topology} | {r['layers']} | {decode_layers} | {r['compile_s']} | "
                  f"{r['step_gb']:.3f} | {r['weights_gb'] + r['kv_cache_gb']:.3f} | {r['step_over_minimum']:.2f} | "
                  f"{r['copies_in_loops']} | {r['temp_gib']:.2f} |", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
