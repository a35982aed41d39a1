"""Sampling with LoRA adapters, side by side: unmerged (base + the low-rank term every decode step) vs merged
once per behaviour refresh (W + alpha/r A B, then the plain model), vs the base model alone.

SmolLM2-135M-Instruct in float32, adapters of rank 16 on all seven projections with random non-zero B (trained
adapters cost the same), each configuration's rows forced to the full length at temperature 1 (as
benchmarks/sampler.py). Each program runs once untimed (compilation) and then `--repeats` times; the median
counts. The merged side's time per refresh is the merge (timed on its own) plus one sampling; with v > 1 the merge
is paid once for v samplings. Merging also holds a second full copy of the weights while the behaviour policy
lives (the unmerged sampler reads the one base every policy shares): jgrpo samples unmerged (docs/lora.md).

    python benchmarks/lora_sampling.py [--configs 32x128] [--rank 16]

Prints a table, then one JSON line with every figure.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path

import jgrpo  # noqa: F401 - first: it keeps jax on the CPU quietly where libtpu has no TPU

sys.path.insert(0, str(Path(__file__).parent))
from sampler import MODEL, PROMPT_WIDTH, prompts  # noqa: E402

from jgrpo.config.errors import exits_on_user_error  # noqa: E402


def _timed(fn, repeats: int) -> float:
    import jax

    jax.block_until_ready(fn())  # compile
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@exits_on_user_error
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", default="32x128", help="comma-separated ROWSxNEW_TOKENS")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()

    import jax

    from jgrpo.data.prompts import left_pad, pad_id_for
    from jgrpo.models.hf import load_model, load_tokenizer
    from jgrpo.models.llm import abstract_model
    from jgrpo.models.lora import LORA_TARGETS, merge_adapters, split_adapters, without_lora
    from jgrpo.sampling.sampler import Prompts, Sampler

    tokenizer = load_tokenizer(MODEL)
    graphdef, params, cfg = load_model(MODEL, lora=(args.rank, 2.0 * args.rank, LORA_TARGETS))
    keys = iter(jax.random.split(jax.random.key(1), len(params["layers"])))
    params = {**params, "layers": {k: (0.01 * jax.random.normal(next(keys), v.shape) if k.endswith("_lora_b") else v)
                                   for k, v in params["layers"].items()}}
    base_graphdef = abstract_model(without_lora(cfg))[0]
    base = split_adapters(params)[1]
    merge = jax.jit(functools.partial(merge_adapters, scale=cfg.lora_scale))
    merge_s = _timed(lambda: merge(params), args.repeats)
    merged = merge(params)

    rows_out = []
    for config in args.configs.split(","):
        rows, new = (int(x) for x in config.split("x"))
        tokens, mask = left_pad(prompts(tokenizer, rows), pad_id=pad_id_for(tokenizer), bucket=PROMPT_WIDTH)

        def sample(g, w, rows=rows, new=new, tokens=tokens, mask=mask):
            sampler = Sampler(g, max_new_tokens=new, pad_id=tokenizer.pad_token_id)
            return lambda: sampler.generate(w, Prompts(tokens, mask), jax.random.key(0))

        seconds = {"base": _timed(sample(base_graphdef, base), args.repeats),
                   "unmerged": _timed(sample(graphdef, params), args.repeats),
                   "merged": _timed(sample(base_graphdef, merged), args.repeats)}
        rows_out.append({"rows": rows, "new_tokens": new, "seconds": seconds, "merge_s": merge_s,
                         "tokens_per_s": {k: rows * new / s for k, s in seconds.items()}})

    print(f"| rows x new tokens | base tok/s | LoRA r{args.rank} unmerged tok/s | merged tok/s (+ {merge_s:.2f} s "
          "merge per refresh) | unmerged vs merged, v=1 | v=10 |")
    print("|---|---|---|---|---|---|")
    for r in rows_out:
        s, t = r["seconds"], r["tokens_per_s"]
        ratio = {v: (s["merged"] + merge_s / v) / s["unmerged"] for v in (1, 10)}
        print(f"| {r['rows']} x {r['new_tokens']} | {t['base']:.0f} | {t['unmerged']:.0f} | {t['merged']:.0f} | "
              f"{ratio[1]:.2f}x | {ratio[10]:.2f}x |")
    print(json.dumps({"benchmark": "lora_sampling", "model": MODEL, "rank": args.rank, "results": rows_out}))


if __name__ == "__main__":
    sys.exit(main())
