"""Sampling from a float32, bfloat16 or int8 copy of the policy (and an int8 KV cache), side by side: how far the
sampler's log-probs are from the trained weights', what the copy costs, how fast the CPU decodes.

The quickstart (configs/quickstart.yaml: SmolLM2-135M-Instruct on 2-digit sums, float32 compute) with
`grpo.behaviour_refresh=1`, so that every iteration makes the sampler's copy of the current params (a cast, or
int8 quantization: `sampler.weights_dtype`; `+embeddings`: `sampler.quantize_embeddings`; `+cache`:
`sampler.kv_cache_dtype=int8`), for
`--iterations` iterations with the same seed (the same keys and, at iteration 1, the same params) for each. Per
variant, over the iterations after the first (which compiles):
`mismatch/logprob_mean` / `_max`, |lp - lp_alpha| between the float32 trainer forward and the sampler on the
sampled tokens (the first update of each iteration runs at the params that sampled); the copy's seconds
(`time/weight_sync`) against the update's (`time/update`; target <= 5%); decoded tokens per second
(`time/sample`, reported only: the CPU multiplies in float32 whatever the weights are stored in).

    python benchmarks/quantized_sampling.py [--iterations 4] [--weights float32,bfloat16,int8,int8+embeddings,...]

Prints a table, then one JSON line with every figure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import jgrpo  # noqa: F401 - first: it keeps jax on the CPU quietly where libtpu has no TPU
from jgrpo.config.errors import exits_on_user_error


def run(variant: str, iterations: int, run_dir: Path) -> dict:
    from jgrpo.config.loading import load_config
    from jgrpo.training.trainer import Trainer

    dtype, *extras = variant.split("+")  # e.g. int8+embeddings+cache
    config = load_config("configs/quickstart.yaml", [
        f"sampler.weights_dtype={dtype}", f"sampler.quantize_embeddings={'embeddings' in extras}",
        f"sampler.kv_cache_dtype={'int8' if 'cache' in extras else 'auto'}",
        "grpo.behaviour_refresh=1", f"run.iterations={iterations}",
        "run.eval_before=false", "run.eval_every=0", "checkpoint.every=0", "logging.samples_every=0",
        "logging.tensorboard=false", f"run.output_dir={run_dir}"])
    trainer = Trainer(config)
    try:
        records = [trainer.train_iteration() for _ in range(iterations)][1:]  # the first compiles
    finally:
        trainer.close()
    rows = config.data.batch_size * config.grpo.num_generations

    def median(key):
        return statistics.median(r[key] for r in records)

    tokens = [r["completion/length_mean"] * rows / r["time/sample"] for r in records]
    return {"weights": variant, "lp_mismatch_mean": statistics.mean(r["mismatch/logprob_mean"] for r in records),
            "lp_mismatch_max": max(r["mismatch/logprob_max"] for r in records),
            "copy_s": median("time/weight_sync"), "update_s": median("time/update"),
            "copy_over_update": median("time/weight_sync") / median("time/update"),
            "decode_tokens_per_s": statistics.median(tokens)}


@exits_on_user_error
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iterations", type=int, default=4)
    p.add_argument("--weights", default="float32,bfloat16,int8,int8+embeddings,float32+cache,int8+cache")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = [run(variant, args.iterations, Path(tmp) / variant) for variant in args.weights.split(",")]
    print(f"{'weights (+cache)':20} {'mean |lp - lp_alpha|':>21} {'max':>9} {'copy s':>8} {'update s':>9} "
          f"{'copy/update':>12} {'decode tok/s':>13}")
    for r in results:
        print(f"{r['weights']:20} {r['lp_mismatch_mean']:21.2e} {r['lp_mismatch_max']:9.2e} {r['copy_s']:8.3f} "
              f"{r['update_s']:9.3f} {r['copy_over_update']:12.1%} {r['decode_tokens_per_s']:13.0f}")
    print(json.dumps({"quantized_sampling": results}))


if __name__ == "__main__":
    main()
