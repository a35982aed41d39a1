"""How much padding packing removes: the packing plan (jgrpo/training/packing.py) on recorded length distributions.

    python benchmarks/packing.py [--rows 32] [--group 8] [--micro-batches 4] [--new-tokens 256] [--widths 1,2,4]
                                 [--row-buckets 0.25,0.5,0.75,0.875]

The update, the reference pass and the lp_k pass pad every completion to N = max_new_tokens. This script draws
the completion lengths of many minibatches from the distributions the rollout benchmark recorded for SmolLM2-135M
at 256 new tokens (docs/benchmarks.md, the length histograms: the quickstart's arithmetic prompts and GSM8K-style
prompts), plus every row at full length, plans each minibatch with the shipped planner at packed widths W = f x N
and K = r / f rows (K x W = r x N: a packed micro-batch never needs more memory than a padded one), and prints:
  - the padded fill (real tokens / R x N slots) and the bound (R x N / real tokens: what removing all padding
    could save);
  - the packed fill (real tokens / slots of the micro-batches used), micro-batches used per minibatch (mean,
    max of U) and the plan's saving (padded micro-batches / packed ones): the ratio of slots the train step
    computes, which its tokens/s can approach, not pass.
A host computation, the same on any machine. The train step's tokens/s padded vs packed comes with the packed
forward (the packing issue's Measure section).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jgrpo.training.packing import PackedSizes, plan_packing  # noqa: E402

# Rows per bin of 32 tokens (1-32, ..., 225-256), SmolLM2-135M at 256 new tokens (docs/benchmarks.md).
HISTOGRAMS = {
    "arithmetic": [46, 13, 12, 10, 2, 1, 1, 11],  # mean 70; the 225-256 bin is mostly rows at the limit
    "gsm8k": [2, 3, 5, 4, 5, 4, 9, 32],  # mean 195
}


def draw_lengths(name: str, count: int, new_tokens: int, rng) -> np.ndarray:
    """`count` lengths from a histogram over 8 bins of new_tokens / 8; the last bin's rows sit at the limit
    (the truncated share), the others uniform within their bin."""
    if name == "full":
        return np.full(count, new_tokens)
    weights = np.asarray(HISTOGRAMS[name], float)
    bins = rng.choice(len(weights), size=count, p=weights / weights.sum())
    width = new_tokens // len(weights)
    lengths = bins * width + rng.integers(1, width + 1, count)
    return np.where(bins == len(weights) - 1, new_tokens, lengths)


def measure(name: str, *, rows: int, group: int, micro_batches: int, new_tokens: int, batches: int, factor: int,
            seed: int = 0, row_buckets: tuple[float, ...] = ()) -> dict:
    rng = np.random.default_rng(seed)  # the same lengths for every width
    r = rows // micro_batches  # padded rows per micro-batch
    K = r // factor
    buckets = sorted({max(1, int(np.ceil(f * K))) for f in row_buckets} | {K})
    real = padded = packed_slots = bucket_slots = 0
    used = []
    for _ in range(batches):
        lengths = draw_lengths(name, rows, new_tokens, rng)
        plan = plan_packing(lengths, PackedSizes(rows=r // factor, width=factor * new_tokens,
                                                 micro_batches=micro_batches), group)
        real += int(lengths.sum())
        padded += rows * new_tokens
        packed_slots += plan.micro_batches * r * new_tokens
        used.append(plan.micro_batches)
        for u in range(plan.micro_batches):
            in_use = int((plan.row[u] >= 0).any(-1).sum())
            bucket_slots += min(b for b in buckets if b >= in_use) * factor * new_tokens
    return {"lengths": name, "width": factor * new_tokens, "packed_rows": r // factor,
            "mean_length": real / (batches * rows), "padded_fill": real / padded,
            "bound": padded / real, "packed_fill": real / packed_slots,
            "micro_batches_mean": float(np.mean(used)), "micro_batches_max": int(np.max(used)),
            "saving": padded / packed_slots, "row_bucket_saving": padded / bucket_slots}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=32, help="completions per minibatch (B x G)")
    p.add_argument("--group", type=int, default=8, help="G, completions per prompt")
    p.add_argument("--micro-batches", type=int, default=4, help="U, padded micro-batches per minibatch")
    p.add_argument("--new-tokens", type=int, default=256, help="N = max_new_tokens")
    p.add_argument("--widths", default="1,2,4", help="packed widths as multiples f of N (K = r / f rows)")
    p.add_argument("--batches", type=int, default=200, help="minibatches drawn per distribution")
    p.add_argument("--row-buckets", default="", help="fractions of K: also print the row-bucket ceiling")
    args = p.parse_args(argv)
    r = args.rows // args.micro_batches
    print(f"{args.rows} rows (groups of {args.group}) in {args.micro_batches} micro-batches of {r} x "
          f"{args.new_tokens} padded; {args.batches} minibatches per distribution")
    row_buckets = tuple(float(f) for f in args.row_buckets.split(",") if f)
    extra = (" row buckets |", "---:|") if row_buckets else ("", "")
    print("| lengths | mean | padded fill | bound | packed K x W | packed fill | micro-batches used (mean, max) | "
          f"saving |{extra[0]}")
    print(f"|---|---:|---:|---:|---|---:|---|---:|{extra[1]}")
    results = []
    for factor in (int(f) for f in args.widths.split(",")):
        if r % factor or (r // factor) * factor < args.group:
            print(f"| (W = {factor} N: {r} rows do not make whole rows of {factor} N, or a group of {args.group} at "
                  "full length would not fit one micro-batch) |")
            continue
        for name in (*HISTOGRAMS, "full"):
            res = measure(name, rows=args.rows, group=args.group, micro_batches=args.micro_batches,
                          new_tokens=args.new_tokens, batches=args.batches, factor=factor, row_buckets=row_buckets)
            results.append(res)
            print(f"| {name} | {res['mean_length']:.0f} | {res['padded_fill']:.2f} | {res['bound']:.2f}x | "
                  f"{res['packed_rows']} x {res['width']} | {res['packed_fill']:.2f} | "
                  f"{res['micro_batches_mean']:.2f}, {res['micro_batches_max']} of {args.micro_batches} | "
                  f"{res['saving']:.2f}x |" + (f" {res['row_bucket_saving']:.2f}x |" if row_buckets else ""))
    print(json.dumps({"packing": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
