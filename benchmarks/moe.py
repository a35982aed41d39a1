"""The mixture-of-experts block, side by side: `model.moe_impl` sorted_tiles vs ragged vs dense.

One MoE block (jgrpo.models.moe.moe_mlp: router, top-k, SwiGLU experts, gate-weighted sum) forward + backward
(gradients of the input and every weight, as a training step needs) on random tokens, each implementation
jitted and timed in alternating rounds (best of `--rounds`), in one run. Also one forward at a decode step's size
(`--decode-tokens`, the sampler's slots). Tokens/s = tokens / seconds.

    python benchmarks/moe.py                       # E = 16, k = 2, 2048 tokens, hidden 256, expert units 512
    python benchmarks/moe.py --experts 64 --k 4

Prints a table, then one JSON line. Target (#38): sorted_tiles >= 2x dense forward + backward at E = 16, k = 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import jax
import jax.numpy as jnp
from hardware import usable_cores  # benchmarks/ is on sys.path when run as a script

from jgrpo.models.moe import IMPLEMENTATIONS, moe_mlp

IMPLS = tuple(IMPLEMENTATIONS)  # sorted_tiles, ragged, dense


def weights(experts: int, hidden: int, units: int) -> dict:
    keys = jax.random.split(jax.random.key(0), 4)
    scale = hidden ** -0.5
    return {"router": jax.random.normal(keys[0], (hidden, experts)) * scale,
            "experts_gate": jax.random.normal(keys[1], (experts, hidden, units)) * scale,
            "experts_up": jax.random.normal(keys[2], (experts, hidden, units)) * scale,
            "experts_down": jax.random.normal(keys[3], (experts, units, hidden)) * units ** -0.5}


def programs(k: int):
    """{impl: (train step: forward + backward, forward only)}, jitted."""

    def loss(h, p, impl):
        out, _, _ = moe_mlp(h, p, k=k, norm_topk_prob=True, impl=impl)
        return jnp.mean(out.astype(jnp.float32) ** 2)

    def forward(h, p, impl):
        return moe_mlp(h, p, k=k, norm_topk_prob=True, impl=impl)[0]

    train = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=2)
    return {impl: (lambda h, p, i=impl: train(h, p, i), jax.jit(lambda h, p, i=impl: forward(h, p, i)))
            for impl in IMPLS}


def best_times(calls: dict, rounds: int) -> dict:
    """{name: best seconds} of each zero-argument call, compiled first, then timed in alternating rounds."""
    for call in calls.values():
        jax.block_until_ready(call())
    best = {name: float("inf") for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            start = time.perf_counter()
            jax.block_until_ready(call())
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--k", type=int, default=2, help="experts per token")
    p.add_argument("--tokens", type=int, default=2048, help="tokens of the training forward + backward")
    p.add_argument("--decode-tokens", type=int, default=64, help="tokens of the decode-step forward")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--units", type=int, default=512, help="each expert's hidden units (moe_intermediate_size)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    dtype = jnp.dtype(args.dtype)
    params = jax.tree.map(lambda x: x.astype(dtype), weights(args.experts, args.hidden, args.units))
    h = jax.random.normal(jax.random.key(1), (1, args.tokens, args.hidden), dtype)
    h_decode = h[:, :args.decode_tokens]
    fns = programs(args.k)
    train = best_times({impl: (lambda f=fns[impl][0]: f(h, params)) for impl in IMPLS}, args.rounds)
    decode = best_times({impl: (lambda f=fns[impl][1]: f(h_decode, params)) for impl in IMPLS}, args.rounds)
    print(f"{usable_cores()} cores, {jax.devices()[0].platform}; E = {args.experts}, k = {args.k}, hidden "
          f"{args.hidden}, expert units {args.units}, {args.dtype}", file=sys.stderr)
    print(f"\n| moe_impl | train fwd+bwd tok/s ({args.tokens} tokens) | vs dense | decode fwd tok/s "
          f"({args.decode_tokens} tokens) | vs dense |")
    print("|---|---:|---:|---:|---:|")
    for impl in IMPLS:
        print(f"| {impl} | {args.tokens / train[impl]:.0f} | {train['dense'] / train[impl]:.2f}x | "
              f"{args.decode_tokens / decode[impl]:.0f} | {decode['dense'] / decode[impl]:.2f}x |")
    print(json.dumps({"args": vars(args), "platform": jax.devices()[0].platform, "train_s": train,
                      "decode_s": decode}))


if __name__ == "__main__":
    main()
