"""Top-k / top-p thresholds by sort (lax.top_k) vs by bisection, side by side: `sampler.threshold_search`.

    python benchmarks/threshold_search.py [--rows 192] [--vocab 49152] [--repeats 5]

Times `SamplingMethod.process_logits` (the sampler's per-step call) and its gradient (what the trainer's update
differentiates through) on [rows, vocab] float32 logits, per method and search; prints the median seconds
and the ratio sort / bisect. XLA:CPU lowers lax.top_k to a sort of the whole row even for k = 3.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jgrpo.config.errors import exits_on_user_error  # noqa: E402
from jgrpo.sampling.methods import SamplingMethod  # noqa: E402

METHODS = {"top_k=3": dict(top_k=3), "top_k=50": dict(top_k=50), "top_p=0.9": dict(top_p=0.9),
           "top_k=50 top_p=0.9": dict(top_k=50, top_p=0.9)}


def seconds(fn, x, repeats: int) -> float:
    jax.block_until_ready(fn(x))  # compiles
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(x))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@exits_on_user_error
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=192)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    x = jax.random.normal(jax.random.key(0), (args.rows, args.vocab)) * 3
    print(f"{jax.devices()[0].platform}, [{args.rows}, {args.vocab}] float32 logits, median of {args.repeats}\n")
    print("| method | pass | sort s | bisect s | sort / bisect |\n|---|---|---|---|---|")
    for name, kwargs in METHODS.items():
        row = {}
        for search in ("sort", "bisect"):
            method = SamplingMethod(**kwargs, threshold_search=search)
            forward = jax.jit(method.process_logits)
            finite_sum = lambda x, m=method: jnp.sum(jnp.where(jnp.isfinite(y := m.process_logits(x)), y, 0.0))  # noqa: E731
            row[search] = (seconds(forward, x, args.repeats), seconds(jax.jit(jax.grad(finite_sum)), x, args.repeats))
        for i, kind in enumerate(("forward", "gradient")):
            sort, bisect = row["sort"][i], row["bisect"][i]
            print(f"| {name} | {kind} | {sort:.3f} | {bisect:.3f} | {sort / bisect:.1f}x |")


if __name__ == "__main__":
    sys.exit(main())
