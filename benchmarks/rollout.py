"""Static vs continuous batching, side by side: useful tokens/s of the rollout sampler at the same slot count.

SmolLM2-135M-Instruct (float32) answers prompts at temperature 1 with the tokenizer's stop ids and `--new` new
tokens, so completion lengths are the model's own, not forced. `--task` picks the prompts, i.e. the length
distribution:

- gsm8k: GSM8K-style questions (tests/testdata/gsm8k_sample.jsonl) with the paper configs' system prompt ("reason
  step by step"); SmolLM2 rambles, so most rows run to the limit;
- arithmetic: the quickstart's own prompts (2-digit additions, " Answer with the number only."): most rows
  stop after a few tokens, a tail runs long.

The same R = prompts x samples rows are sampled two ways with S slots:

- static: R / S calls of `generate` with S rows each; a call decodes until its longest row stops;
- continuous: one call with `slots=S`; a slot whose row stops takes the next pending row.

Useful tokens = generated tokens up to and including each row's stop token. A second table forces every row
to full length (no stop ids): there continuous batching has nothing to win, and the ratio shows its overhead.
Both modes give every row the same key, so they sample the same distribution and, up to float rounding, the
same tokens. The rounding differs (a static call prefills fewer prompts at once; a continuous row attends over
the ring in rotated order), so over hundreds of tokens at temperature 1 a draw within rounding of a boundary
can flip and the row go its own way (static batching does the same at another batch size). Each mode's useful
tokens are its own; the table counts the rows whose tokens differ. Each mode runs once untimed (compilation),
then `--repeats` times alternating with the other mode, repeat i with key i in both modes (different rows per
repeat, the same rows for both modes): useful tokens/s is each repeat's own tokens over its own seconds (median
shown), and the speed-up is the median of the paired repeats' ratios. The decode-step column counts the steps
each mode needs for its lengths: at equal cost per step, their ratio bounds the gain.

    python benchmarks/rollout.py                       # gsm8k, 16 prompts x 4 samples, 16 slots, 256 new tokens
    python benchmarks/rollout.py --task arithmetic --prompts 8 --new 128

Prints the tables and the length histogram, then one JSON line with every figure.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
from hardware import usable_cores  # benchmarks/ is on sys.path when run as a script

from jgrpo.config.errors import exits_on_user_error  # noqa: E402

MODEL = "smollm2-135m-instruct"
QUESTIONS = Path(__file__).resolve().parent.parent / "tests" / "testdata" / "gsm8k_sample.jsonl"
# The system prompt of configs/paper_gsm8k_qwen05b_*.yaml: the completions the trainer would sample.
SYSTEM = "Please reason step by step, and write the final answer as a number after '####'."
# configs/quickstart.yaml's instruction (no system prompt).
ARITHMETIC_SUFFIX = " Answer with the number only."


@functools.cache
def _model():
    from jgrpo.models.hf import load_model, load_tokenizer

    return load_tokenizer(MODEL), *load_model(MODEL)[:2]  # tokenizer, graphdef, params


def _prompts(tokenizer, task: str, count: int) -> tuple[np.ndarray, np.ndarray]:
    from jgrpo.data.prompts import chat_prompt_ids, left_pad, pad_id_for
    from jgrpo.data.tasks import arithmetic_examples

    if task == "gsm8k":
        questions = [json.loads(line)["question"] for line in QUESTIONS.read_text().splitlines() if line.strip()]
        ids = [chat_prompt_ids(tokenizer, questions[i % len(questions)], SYSTEM) for i in range(count)]
    else:
        problems = arithmetic_examples(digits=2, operators="+", split="train", count=count, seed=0)
        ids = [chat_prompt_ids(tokenizer, e.question + ARITHMETIC_SUFFIX) for e in problems]
    return left_pad(ids, pad_id=pad_id_for(tokenizer), bucket=16)


def runner(mode: str, *, task: str, prompts: int, samples: int, slots: int, new: int, forced: bool):
    """A function key -> outputs that samples every row once in `mode` (compiled by a first call here).

    Static calls number their prompts by their place in the whole set (`prompt_index`), so both modes give
    every row the same key and therefore the same tokens and lengths: the two modes do the same useful work.
    """
    import jax

    from jgrpo.data.prompts import pad_id_for
    from jgrpo.sampling.sampler import Prompts, Sampler, stop_ids_for

    tokenizer, graphdef, params = _model()
    tokens, mask = _prompts(tokenizer, task, prompts)
    stops = () if forced else stop_ids_for(tokenizer)
    sampler = Sampler(graphdef, max_new_tokens=new, num_samples=samples, stop_ids=stops, pad_id=pad_id_for(tokenizer))
    per_call = slots // samples  # static: prompts per call, so that a call has `slots` rows

    def once(key):
        if mode == "continuous":
            return [sampler.replace(slots=slots).generate(params, Prompts(tokens, mask), key)]
        return [sampler.generate(params, Prompts(tokens[i:i + per_call], mask[i:i + per_call],
                                                 np.arange(i, i + per_call)), key)
                for i in range(0, prompts, per_call)]

    jax.block_until_ready(once(jax.random.key(0)))  # compile
    return once


def timed(once, seed: int) -> tuple[float, np.ndarray, np.ndarray]:
    """(seconds, lengths [R], tokens [R, N]) of one call of `once`."""
    import jax

    start = time.perf_counter()
    outs = jax.block_until_ready(once(jax.random.key(seed)))
    seconds = time.perf_counter() - start
    return seconds, *(np.concatenate([np.asarray(getattr(o, f)) for o in outs]) for f in ("lengths", "tokens"))


def decode_steps(lengths, slots: int) -> tuple[int, int]:
    """(static, continuous) decode steps for these row lengths: static runs each batch of `slots` rows to its
    longest row; continuous refills a slot as soon as its row stops, until every row is done."""
    static = sum(int(max(lengths[i:i + slots])) - 1 for i in range(0, len(lengths), slots))
    left = [int(n) - 1 for n in lengths[slots:]][::-1]  # decode steps each pending row needs
    busy = [int(n) - 1 for n in lengths[:slots]]
    steps = 0
    while any(busy) or left:
        steps += 1
        busy = [max(b - 1, 0) for b in busy]
        for i in [i for i, b in enumerate(busy) if b == 0]:
            if left:
                busy[i] = left.pop()
    return static, steps


def histogram(lengths, new: int, bins: int = 8) -> str:
    edges = np.linspace(0, new, bins + 1).astype(int)
    counts, _ = np.histogram(lengths, bins=edges)
    width = max(counts.max(), 1)
    return "\n".join(f"  {lo + 1:4d}-{hi:4d} {'#' * int(40 * c / width):40s} {c}"
                     for lo, hi, c in zip(edges[:-1], edges[1:], counts, strict=True))


@exits_on_user_error
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task", choices=("gsm8k", "arithmetic"), default="gsm8k", help="the prompts (see above)")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--samples", type=int, default=4, help="completions per prompt")
    p.add_argument("--slots", type=int, default=16, help="rows decoded at once, both modes")
    p.add_argument("--new", type=int, default=256, help="max new tokens")
    p.add_argument("--forced-new", type=int, default=128, help="new tokens of the forced-length table (0 = skip)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per mode, alternating (the median is shown)")
    args = p.parse_args()
    if args.slots % args.samples or args.prompts % (args.slots // args.samples):
        p.error("--slots must be a multiple of --samples, and --prompts a multiple of slots / samples")

    load = os.getloadavg()[0]
    print(f"{usable_cores()} cores, load average {load:.1f}; {args.task}: {args.prompts} prompts x {args.samples} "
          f"samples = {args.prompts * args.samples} rows, {args.slots} slots", file=sys.stderr)
    shape = dict(task=args.task, prompts=args.prompts, samples=args.samples, slots=args.slots)
    results = {}
    for forced, new in ((False, args.new), (True, args.forced_new)):
        if new == 0:
            continue
        table = "forced" if forced else "stops"
        runs = {mode: runner(mode, **shape, new=new, forced=forced) for mode in ("static", "continuous")}
        # Repeat i samples every row with key i in both modes (alternating, so a shared machine's load hits both
        # alike); each repeat's useful tokens/s is its own tokens over its own seconds, and the ratio is paired.
        r = results[table] = {"seconds": {m: [] for m in runs}, "useful_tokens": {m: [] for m in runs},
                              "decode_steps": {m: [] for m in runs}, "lengths": {m: [] for m in runs}, "differ": []}
        for repeat in range(args.repeats):
            tokens = {}
            for mode, once in runs.items():
                seconds, lengths, tokens[mode] = timed(once, 1 + repeat)
                r["seconds"][mode].append(seconds)
                r["useful_tokens"][mode].append(int(lengths.sum()))
                r["decode_steps"][mode].append(decode_steps(lengths, args.slots)[mode == "continuous"])
                r["lengths"][mode].append(lengths.tolist())
            r["differ"].append(int((tokens["static"] != tokens["continuous"]).any(axis=1).sum()))
        speed = {m: [t / s for t, s in zip(r["useful_tokens"][m], r["seconds"][m], strict=True)] for m in runs}
        r["useful_tokens_per_s"] = {m: float(np.median(v)) for m, v in speed.items()}
        r["paired_ratios"] = [c / s for c, s in zip(speed["continuous"], speed["static"], strict=True)]

    rows = args.prompts * args.samples
    print("\n| lengths | mode | seconds | useful tokens | useful tokens/s | vs static | decode steps | "
          "rows unlike static |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for table, r in results.items():
        label = "model's own" if table == "stops" else f"forced {args.forced_new}"
        for mode, speed in r["useful_tokens_per_s"].items():
            ratio = "1.00x" if mode == "static" else \
                f"{np.median(r['paired_ratios']):.2f}x ({', '.join(f'{x:.2f}' for x in r['paired_ratios'])})"
            differ = "" if mode == "static" else " / ".join(str(d) for d in r["differ"]) + f" of {rows}"
            cells = [" / ".join(f"{x:.1f}" for x in r["seconds"][mode]),
                     " / ".join(str(x) for x in r["useful_tokens"][mode]), f"{speed:.1f}", ratio,
                     " / ".join(str(x) for x in r["decode_steps"][mode]), differ]
            print(f"| {label} | {mode} | " + " | ".join(cells) + " |")
    print("(per repeat, separated by /; useful tokens/s: the median of the repeats; vs static: the median of the "
          "paired repeats' ratios, each in brackets)")
    lengths = np.concatenate(results["stops"]["lengths"]["static"])
    print(f"\nCompletion lengths at temperature 1 (stop ids, at most {args.new} new tokens; static, all repeats):")
    print(histogram(lengths, args.new))
    print(f"  mean {lengths.mean():.0f}, median {np.median(lengths):.0f}, max {lengths.max()}, "
          f"{(lengths == args.new).mean():.0%} truncated; the decode steps bound continuous batching's gain at "
          f"{np.divide(*decode_steps(lengths, args.slots)):.2f}x on these rows (at equal cost per step)")
    print(json.dumps({"args": vars(args), "load_average": load, "results": results}))


if __name__ == "__main__":
    sys.exit(main())
