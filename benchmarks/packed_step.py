"""The train step padded vs trimmed vs packed (`model.packing`), side by side in one run (#40's Measure).

    python benchmarks/packed_step.py [--rows 32] [--group 8] [--micro-batches 4] [--new-tokens 256] [--prompt 64]
                                     [--row-buckets 0.25,0.5,0.75,0.875]

SmolLM2-135M-Instruct (float32, its real weights) on this machine's CPU. Per length distribution (the rollout
benchmark's arithmetic and gsm8k histograms at 256 new tokens, benchmarks/packing.py, and every row at full
length): random prompt tokens (real lengths drawn from half the prompt width to all of it, left-padded) and
completions of the drawn lengths, then the trainer's train step: `StepFunctions.build` (the reference's log-prob
pass: beta > 0) and `update` (one optimiser step over `--micro-batches` micro-batches; lp_k is the behaviour's
here, so no pi_k pass), three ways:
  - padded: every completion padded to N (today's default);
  - trimmed: every completion padded to the batch's longest, rounded up to 64 (a second baseline; in a run it
    compiles a program per trimmed width; where a row reaches N it is the padded program, not run twice);
  - packed: the host plans, then the packed passes and the packed update, each packed micro-batch computing only
    its rows in use rounded up to a bucket (`--row-buckets`, default `model.packing_row_buckets`'; "" for all rows).
Useful tokens/s = (real prompt tokens once per group + real completion tokens) / seconds, best of `--repeats`
after a compiling call, the three alternating; the packed time includes planning on the host. Also the packed
step's loss and gradient norm against the padded one's (the same numbers), its micro-batches and fill, and the
bound (padded completion slots / real completion tokens).

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
from jgrpo.config import ModelConfig  # noqa: E402


def measure(name: str, args, graphdef, params) -> dict:
    import jax
    import jax.numpy as jnp
    import optax

    from jgrpo.config import GRPOConfig, MeshConfig
    from jgrpo.parallel.mesh import make_mesh
    from jgrpo.sampling.methods import SamplingMethod
    from jgrpo.sampling.state import SampleOutput
    from jgrpo.training.step_options import StepOptions
    from jgrpo.training.steps import StepFunctions

    rng = np.random.default_rng(0)
    R, G, N, P = args.rows, args.group, args.new_tokens, args.prompt
    B = R // G
    lengths = draw_lengths(name, R, N, rng)
    prompt_lengths = rng.integers(P // 2, P + 1, B)
    prompt_mask = np.arange(P)[None] >= (P - prompt_lengths)[:, None]
    prompt_tokens = np.where(prompt_mask, rng.integers(3, 49152, (B, P)), 0).astype(np.int32)
    mask = np.arange(N)[None] < lengths[:, None]
    tokens = np.where(mask, rng.integers(3, 49152, (R, N)), 0).astype(np.int32)
    rewards = jnp.asarray(rng.integers(0, 2, R), jnp.float32)
    trimmed = min(N, -(-int(lengths.max()) // 64) * 64)
    grpo = GRPOConfig(num_generations=G, beta=0.04, micro_batches=args.micro_batches)
    mesh = make_mesh(MeshConfig())

    def step_functions(packing, width):
        options = StepOptions(grpo=grpo, method=SamplingMethod(), new_tokens=width, logprob_chunk=256,
                              packing=packing, packing_row_buckets=args.row_buckets if packing else ())
        return StepFunctions(graphdef=graphdef, params=params, mesh=mesh, optimizer=optax.sgd(1e-6), options=options)

    def samples(width, logprobs):
        m = jnp.asarray(mask[:, :width])
        return SampleOutput(tokens=jnp.asarray(tokens[:, :width]), logprobs=jnp.asarray(logprobs[:, :width]),
                            completion_mask=m, lengths=jnp.asarray(lengths, jnp.int32), truncated=jnp.zeros(R, bool),
                            loss_mask=m, version=jnp.where(m, 0, -1).astype(jnp.int32))

    ways = {"padded": (step_functions(False, N), N), "trimmed": (step_functions(False, trimmed), trimmed),
            "packed": (step_functions(True, N), N)}
    if trimmed == N:  # a row at the limit: the trimmed program is the padded one (its time is padded's)
        del ways["trimmed"]
    padded_steps = ways["padded"][0]
    placed = padded_steps.copy_params(params)
    # The sampler's log-probs: the model's own, slightly off (a behaviour policy near pi_theta: ratios near 1).
    batch, _ = padded_steps.assemble(jnp.asarray(prompt_tokens), jnp.asarray(prompt_mask),
                                     samples(N, np.zeros((R, N), np.float32)), rewards)
    own = np.asarray(padded_steps.passes.pi_k(placed, batch)).reshape(R, N)
    behaviour = np.where(mask, own + rng.normal(0, 0.05, (R, N)), 0.0).astype(np.float32)
    out = {}

    def call(way):
        steps, width = ways[way]
        fresh, opt_state = steps.copy_params(placed), steps.init_opt_state(placed)
        jax.block_until_ready((fresh, opt_state))
        start = time.perf_counter()
        batch = steps.build(jnp.asarray(prompt_tokens), jnp.asarray(prompt_mask), samples(width, behaviour), rewards,
                            reference=placed, current=placed)
        new, _, metrics = steps.update(fresh, opt_state, batch)
        jax.block_until_ready(new)
        seconds = time.perf_counter() - start
        out[way] = metrics[0]
        return seconds

    seconds = {}
    for _ in range(args.rounds):  # alternating, so a slow spell of the machine hits all three
        for way in ways:
            call(way)  # compiles (the first time)
            s = min(call(way) for _ in range(args.repeats))
            seconds[way] = min(seconds.get(way, s), s)
    seconds.setdefault("trimmed", seconds["padded"])
    useful = int(prompt_lengths.sum()) + int(lengths.sum())
    packed, padded = out["packed"], out["padded"]
    return {"lengths": name, "mean_length": float(lengths.mean()), "trimmed_width": trimmed,
            **{f"{way}_s": s for way, s in seconds.items()},
            **{f"{way}_tokens_per_s": useful / s for way, s in seconds.items()},
            "speedup": seconds["padded"] / seconds["packed"], "trimmed_speedup": seconds["padded"] / seconds["trimmed"],
            "packed_micro_batches": float(packed["packing_micro_batches"]), "fill": float(packed["packing_fill"]),
            "prompt_fill": float(packed["packing_prompt_fill"]), "bound": R * N / lengths.sum(),
            "rows_computed": float(packed["packing_rows_computed"]),
            "loss_diff": abs(float(packed["loss"]) - float(padded["loss"])),
            "grad_norm": float(padded["grad_norm"]),
            "grad_norm_rel_diff": abs(float(packed["grad_norm"]) / float(padded["grad_norm"]) - 1)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=32, help="completions per batch (B x G)")
    p.add_argument("--group", type=int, default=8, help="G, completions per prompt")
    p.add_argument("--micro-batches", type=int, default=4, help="padded micro-batches of the pass")
    p.add_argument("--new-tokens", type=int, default=256, help="N = max_new_tokens")
    p.add_argument("--prompt", type=int, default=64, help="P, the prompt width")
    p.add_argument("--repeats", type=int, default=1, help="timed calls per way and round")
    p.add_argument("--rounds", type=int, default=2, help="rounds of the three ways, alternating")
    p.add_argument("--lengths", default=",".join((*HISTOGRAMS, "full")))
    p.add_argument("--row-buckets", default=",".join(str(f) for f in ModelConfig().packing_row_buckets),
                   help="model.packing_row_buckets of the packed way, comma-separated ('' for every row)")
    args = p.parse_args(argv)
    args.row_buckets = tuple(float(f) for f in args.row_buckets.split(",") if f)
    from jgrpo.models.hf import load_model

    graphdef, params, _ = load_model("smollm2-135m-instruct")
    print(f"SmolLM2-135M float32, {args.rows} rows (groups of {args.group}), {args.micro_batches} padded micro-batches "
          f"of {args.rows // args.micro_batches} x ({args.prompt} + {args.new_tokens})", file=sys.stderr)
    print("| lengths | mean | bound | padded s | trimmed s (width) | packed s (micro-batches, fill, rows computed) "
          "| useful tok/s padded | trimmed | packed | packed / padded | trimmed / padded | loss, grad norm diff |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    results = []
    for name in args.lengths.split(","):
        r = measure(name, args, graphdef, params)
        results.append(r)
        print(f"| {name} | {r['mean_length']:.0f} | {r['bound']:.2f}x | {r['padded_s']:.2f} | {r['trimmed_s']:.2f} "
              f"({r['trimmed_width']}) | {r['packed_s']:.2f} ({r['packed_micro_batches']:.0f}, {r['fill']:.2f}, "
              f"{r['rows_computed']:.2f}) | "
              f"{r['padded_tokens_per_s']:.0f} | {r['trimmed_tokens_per_s']:.0f} | {r['packed_tokens_per_s']:.0f} | "
              f"**{r['speedup']:.2f}x** | {r['trimmed_speedup']:.2f}x | {r['loss_diff']:.1e}, "
              f"{r['grad_norm_rel_diff']:.1e} |", flush=True)
    print(json.dumps({"packed_step": results, "args": vars(args)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
