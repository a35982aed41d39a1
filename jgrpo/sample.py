"""`python -m jgrpo.sample MODEL --prompt TEXT ...`: chat completions from any model the loader accepts.

Each prompt is wrapped in the tokenizer's chat template (as a user turn, with the assistant header
appended), all prompts are sampled in one batch with the on-device sampler, and every completion is
printed. `--temperature 0` is greedy.
"""

from __future__ import annotations

import argparse
import sys
import time

import jax

from jgrpo.config import ConfigError, SamplerConfig
from jgrpo.config.errors import exits_on_user_error
from jgrpo.data.prompts import chat_prompt_ids, left_pad, pad_id_for
from jgrpo.models.attention_backends import resolve_attention
from jgrpo.models.hf import load_model, load_tokenizer
from jgrpo.models.llm import ModelOptions
from jgrpo.models.moe import resolve_moe_impl
from jgrpo.sampling.sampler import Prompts, Sampler, stop_ids_for


def parse_args(argv=None) -> argparse.Namespace:
    defaults = SamplerConfig()
    p = argparse.ArgumentParser(prog="python -m jgrpo.sample", description=__doc__.splitlines()[0])
    p.add_argument("model", help="built-in name (smollm2-135m-instruct, tiny-random-llama), HF directory or .gguf")
    p.add_argument("--prompt", action="append", required=True, help="a user message; repeat for a batch")
    p.add_argument("--system", default=None, help="optional system message for every prompt")
    p.add_argument("--max-new-tokens", type=int, default=defaults.max_new_tokens)
    p.add_argument("--temperature", type=float, default=defaults.temperature, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=defaults.top_k, help="0 = off")
    p.add_argument("--top-p", type=float, default=defaults.top_p, help="1 = off")
    p.add_argument("--min-p", type=float, default=defaults.min_p, help="0 = off")
    p.add_argument("--num-samples", type=int, default=1, help="completions per prompt")
    p.add_argument("--stop-id", type=int, action="append", default=[], help="extra stop token id (repeatable)")
    p.add_argument("--max-prompt-length", type=int, default=None, help="longer prompts are an error")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    return p.parse_args(argv)


@exits_on_user_error
def main(argv=None) -> int:
    args = parse_args(argv)
    config = SamplerConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                           max_new_tokens=args.max_new_tokens, stop_token_ids=tuple(args.stop_id))
    if args.num_samples < 1:
        raise ConfigError(f"--num-samples={args.num_samples} must be >= 1")
    platform = jax.devices()[0].platform
    tokenizer = load_tokenizer(args.model)
    graphdef, params, cfg = load_model(args.model, ModelOptions(param_dtype=args.dtype, compute_dtype=args.dtype,
                                                            attention=resolve_attention("auto", platform),
                                                            moe_impl=resolve_moe_impl("auto", platform)))
    pad_id = pad_id_for(tokenizer)
    stop_ids = stop_ids_for(tokenizer, config.stop_token_ids)
    prompt_ids = [chat_prompt_ids(tokenizer, text, args.system) for text in args.prompt]
    tokens, mask = left_pad(prompt_ids, pad_id=pad_id, bucket=config.prompt_bucket,
                            max_length=args.max_prompt_length)
    start = time.perf_counter()
    sampler = Sampler.from_config(config, graphdef=graphdef, num_samples=args.num_samples, stop_ids=stop_ids,
                                  pad_id=pad_id, mesh=None, cfg=cfg)
    out = sampler.generate(params, Prompts(tokens, mask), jax.random.key(args.seed))
    out = jax.device_get(out)
    seconds = time.perf_counter() - start
    for row in range(out.tokens.shape[0]):
        prompt, sample = divmod(row, args.num_samples)
        ids = out.tokens[row, : out.lengths[row]].tolist()
        text = tokenizer.decode(ids, skip_special_tokens=True)
        ending = "max_new_tokens reached" if out.truncated[row] else "stopped"
        print(f"=== prompt {prompt} sample {sample} ({out.lengths[row]} tokens, {ending}) ===")
        print(f">>> {args.prompt[prompt]}")
        print(text.strip())
    total = int(out.lengths.sum())
    print(f"--- {total} tokens in {seconds:.1f} s including compilation ({total / seconds:.1f} tok/s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
