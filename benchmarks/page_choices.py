"""The paged sampler's per-backend choices on this machine: `sampler.page_size` and `sampler.shrink`, side by side.

SmolLM2-135M-Instruct on the GSM8K-style prompts of benchmarks/paged_kv.py, G = 16, temperature 1, at the model's
own lengths; every variant compiled first, then the timed calls interleaved round by round (each variant sees the
same machine), the same key in every variant (the same tokens up to rounding). Prints each variant's median
seconds and tokens/s, then one JSON line.

    python benchmarks/page_choices.py                          # page sizes 8, 16, 32, 64 x shrink 0, 3
    python benchmarks/page_choices.py --prompts 2 --new 128 --rounds 2
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent))  # this checkout's jgrpo, installed or not
sys.path.insert(1, str(Path(__file__).parent))

from paged_kv import QUESTIONS, SYSTEM  # noqa: E402 - benchmarks/ modules import nothing heavy


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--new", type=int, default=256, help="max new tokens")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--page-sizes", type=int, nargs="+", default=[8, 16, 32, 64])
    parser.add_argument("--shrink", type=int, nargs="+", default=[0, 3])
    args = parser.parse_args()
    import jax
    import numpy as np

    from jgrpo.data.prompts import chat_prompt_ids, left_pad, pad_id_for
    from jgrpo.models.hf import load_model, load_tokenizer
    from jgrpo.sampling.sampler import Prompts, Sampler, SamplingMethod, stop_ids_for

    tokenizer = load_tokenizer("smollm2-135m-instruct")
    graphdef, params, _ = load_model("smollm2-135m-instruct")
    questions = [json.loads(line)["question"] for line in QUESTIONS.read_text().splitlines() if line.strip()]
    tokens, mask = left_pad([chat_prompt_ids(tokenizer, q, SYSTEM) for q in questions[:args.prompts]],
                            pad_id=pad_id_for(tokenizer), bucket=16)
    prompts = Prompts(tokens, mask)
    variants = {}
    for page_size, shrink in itertools.product(args.page_sizes, args.shrink):
        sampler = Sampler(graphdef, max_new_tokens=args.new, num_samples=16, method=SamplingMethod(temperature=1.0),
                          stop_ids=stop_ids_for(tokenizer), pad_id=pad_id_for(tokenizer), page_size=page_size,
                          shrink=shrink)
        start = time.perf_counter()
        jax.block_until_ready(sampler.generate(params, prompts, jax.random.key(0)).tokens)
        variants[(page_size, shrink)] = {"sampler": sampler, "compile_s": time.perf_counter() - start, "s": []}
    lengths = None
    for _ in range(args.rounds):
        for v in variants.values():
            start = time.perf_counter()
            out = v["sampler"].generate(params, prompts, jax.random.key(1))
            jax.block_until_ready(out.tokens)
            v["s"].append(time.perf_counter() - start)
            lengths = np.asarray(out.lengths)
    tokens_total = int(lengths.sum())
    print(f"{args.prompts} prompts x 16 rows, own lengths mean {lengths.mean():.0f}, max {lengths.max()} of {args.new}")
    print(f"{'page':>5s} {'shrink':>7s} {'first call s':>13s} {'median s':>9s} {'tokens/s':>9s}")
    record = {}
    for (page_size, shrink), v in variants.items():
        median = statistics.median(v["s"])
        print(f"{page_size:5d} {shrink:7d} {v['compile_s']:13.1f} {median:9.2f} {tokens_total / median:9.1f}")
        record[f"page_{page_size}_shrink_{shrink}"] = {"first_s": round(v["compile_s"], 2),
                                                       "median_s": round(median, 3), "runs_s": v["s"]}
    print(json.dumps({"tokens": tokens_total, "variants": record}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
