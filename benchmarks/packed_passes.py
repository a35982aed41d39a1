"""The reference log-prob pass padded vs packed (`model.packing`), side by side in one run.

    python benchmarks/packed_passes.py [--rows 32] [--group 8] [--micro-batches 4] [--new-tokens 256] [--prompt 64]

SmolLM2-135M-Instruct (float32, its real weights) on this machine's CPU. Per length distribution (the rollout
benchmark's arithmetic and gsm8k histograms at 256 new tokens, benchmarks/packing.py, and every row at full
length): random prompt tokens (real lengths drawn from half the prompt width to all of it, left-padded) and
completions of the drawn lengths, then the reference pass of the trainer's StepFunctions (`kind="kl"`, what
beta > 0 runs every iteration), padded (C micro-batches of r rows x N) and packed (the host plan, then the
micro-batches that hold tokens). Useful tokens/s = (real prompt tokens once per group + real completion tokens) /
seconds, best of `--repeats` after a compiling call; the packed time includes planning on the host. Also the
largest difference between the two passes' log-probs at real tokens (the same numbers). The pi_k pass is the same
program with another `kind`; the update is not yet packed (#40).

Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(1, str(Path(__file__).parent.parent))
from packing import HISTOGRAMS, draw_lengths  # noqa: E402 - benchmarks/packing.py, host only

import jgrpo  # noqa: E402, F401 - first: it keeps jax on the CPU quietly where libtpu has no TPU


def best_seconds(call, repeats: int) -> float:
    call()  # compiles
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return min(times)


def measure(name: str, args, graphdef, params) -> dict:
    import jax
    import jax.numpy as jnp
    import optax

    from jgrpo.config import GRPOConfig, MeshConfig
    from jgrpo.parallel.mesh import make_mesh
    from jgrpo.sampling.methods import SamplingMethod
    from jgrpo.sampling.pool import SampleOutput
    from jgrpo.training.steps import StepFunctions, StepOptions

    rng = np.random.default_rng(0)
    R, G, N, P = args.rows, args.group, args.new_tokens, args.prompt
    B = R // G
    lengths = draw_lengths(name, R, N, rng)
    prompt_lengths = rng.integers(P // 2, P + 1, B)
    prompt_mask = np.arange(P)[None] >= (P - prompt_lengths)[:, None]
    prompt_tokens = np.where(prompt_mask, rng.integers(3, 49152, (B, P)), 0).astype(np.int32)
    mask = np.arange(N)[None] < lengths[:, None]
    tokens = np.where(mask, rng.integers(3, 49152, (R, N)), 0).astype(np.int32)
    samples = SampleOutput(tokens=jnp.asarray(tokens), logprobs=jnp.zeros((R, N), jnp.float32),
                           completion_mask=jnp.asarray(mask), lengths=jnp.asarray(lengths, jnp.int32),
                           truncated=jnp.zeros(R, bool), loss_mask=jnp.asarray(mask),
                           version=jnp.where(jnp.asarray(mask), 0, -1).astype(jnp.int32))
    grpo = GRPOConfig(num_generations=G, beta=0.04, micro_batches=args.micro_batches)
    steps = {packing: StepFunctions(graphdef=graphdef, params=params, mesh=make_mesh(MeshConfig()),
                                    optimizer=optax.sgd(1.0),
                                    options=StepOptions(grpo=grpo, method=SamplingMethod(), new_tokens=N,
                                                        logprob_chunk=256, packing=packing))
             for packing in (False, True)}
    placed = steps[False].copy_params(params)
    batch, _ = steps[False].assemble(jnp.asarray(prompt_tokens), jnp.asarray(prompt_mask), samples,
                                     jnp.zeros(R, jnp.float32))
    out = {}

    def padded():
        out[False] = jax.block_until_ready(steps[False].reference_logprobs(placed, batch))

    def packed():
        plan = steps[True].pack(jnp.asarray(prompt_tokens), jnp.asarray(prompt_mask), samples, batch)
        out[True] = jax.block_until_ready(steps[True].reference_logprobs_packed(placed, plan, rows=R))
        out["used"] = int(plan.count)

    seconds = {}
    for _ in range(2):  # alternating, so a slow spell of the machine hits both
        for packing, call in ((False, padded), (True, packed)):
            s = best_seconds(call, args.repeats)
            seconds[packing] = min(seconds.get(packing, s), s)
    useful = int(prompt_lengths.sum()) + int(lengths.sum())
    real = mask.reshape(out[False].shape)
    diff = float(np.abs(np.asarray(out[True]) - np.asarray(out[False]))[real].max())
    return {"lengths": name, "mean_length": float(lengths.mean()), "padded_s": seconds[False],
            "packed_s": seconds[True], "padded_tokens_per_s": useful / seconds[False],
            "packed_tokens_per_s": useful / seconds[True], "speedup": seconds[False] / seconds[True],
            "packed_micro_batches": out["used"], "bound": R * N / lengths.sum(), "max_abs_diff": diff}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=32, help="completions per batch (B x G)")
    p.add_argument("--group", type=int, default=8, help="G, completions per prompt")
    p.add_argument("--micro-batches", type=int, default=4, help="padded micro-batches of the pass")
    p.add_argument("--new-tokens", type=int, default=256, help="N = max_new_tokens")
    p.add_argument("--prompt", type=int, default=64, help="P, the prompt width")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--lengths", default=",".join((*HISTOGRAMS, "full")))
    args = p.parse_args(argv)
    from jgrpo.models.hf import load_model

    graphdef, params, _ = load_model("smollm2-135m-instruct")
    print(f"SmolLM2-135M float32, {args.rows} rows (groups of {args.group}), {args.micro_batches} padded micro-batches "
          f"of {args.rows // args.micro_batches} x ({args.prompt} + {args.new_tokens})", file=sys.stderr)
    print("| lengths | mean | bound | padded s | packed s (micro-batches) | useful tok/s padded | packed | speed-up | "
          "max diff |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    results = []
    for name in args.lengths.split(","):
        r = measure(name, args, graphdef, params)
        results.append(r)
        print(f"| {name} | {r['mean_length']:.0f} | {r['bound']:.2f}x | {r['padded_s']:.2f} | {r['packed_s']:.2f} "
              f"({r['packed_micro_batches']}) | {r['padded_tokens_per_s']:.0f} | {r['packed_tokens_per_s']:.0f} | "
              f"{r['speedup']:.2f}x | {r['max_abs_diff']:.1e} |", flush=True)
    print(json.dumps({"packed_passes": results, "args": vars(args)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
