"""Peak memory of per-token log-probs + entropy, forward and backward: chunked (jgrpo.rl.logprobs) vs full logits.

Memory is read from XLA's compiled memory analysis (`jit(...).lower(...).compile().memory_analysis()`),
which is deterministic and needs no run: temp = intermediate buffers; peak = arguments + outputs +
temps - aliased. Both programs compute the same scalar (a weighted sum of log-probs and entropies) and
its gradient w.r.t. the hidden states and the unembedding, i.e. what the trainer differentiates.

    python benchmarks/logprobs_memory.py [--batch 8 --length 512 --dim 576 --vocab 49152 151936 --chunk 32 64 128 256]

Prints a table, then one JSON line with every figure.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys

import jax
import jax.numpy as jnp

from jgrpo.config.errors import exits_on_user_error  # noqa: E402
from jgrpo.rl.logprobs import token_logprobs


def naive_token_logprobs(hidden, unembedding, targets):
    """The straightforward way: all [B, T, V] float32 logits at once."""
    logits = jnp.einsum("btd,dv->btv", hidden, unembedding, preferred_element_type=jnp.float32)  # [B, T, V]
    logp = jax.nn.log_softmax(logits, axis=-1)
    entropy = -jnp.sum(jnp.exp(logp) * logp, axis=-1)
    return jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0], entropy


def compiled_memory(fn, batch, length, dim, vocab, dtype) -> dict:
    hidden = jax.ShapeDtypeStruct((batch, length, dim), dtype)
    unembedding = jax.ShapeDtypeStruct((dim, vocab), dtype)
    targets = jax.ShapeDtypeStruct((batch, length), jnp.int32)
    weights = jax.ShapeDtypeStruct((batch, length), jnp.float32)

    def objective(h, u, t, w):
        lp, ent = fn(h, u, t)
        return jnp.sum(w * lp) + 0.01 * jnp.sum(w * ent)

    grad = jax.jit(jax.value_and_grad(objective, argnums=(0, 1)))
    stats = grad.lower(hidden, unembedding, targets, weights).compile().memory_analysis()
    peak = (stats.argument_size_in_bytes + stats.output_size_in_bytes + stats.temp_size_in_bytes
            - stats.alias_size_in_bytes)
    return {"temp_bytes": int(stats.temp_size_in_bytes), "peak_bytes": int(peak)}


@exits_on_user_error
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--dim", type=int, default=576)
    parser.add_argument("--vocab", type=int, nargs="+", default=[49152, 151936])
    parser.add_argument("--chunk", type=int, nargs="+", default=[32, 64, 128, 256])
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = parser.parse_args()
    dtype = jnp.dtype(args.dtype)
    shape = dict(batch=args.batch, length=args.length, dim=args.dim)

    rows = []
    for vocab in args.vocab:
        naive = compiled_memory(naive_token_logprobs, **shape, vocab=vocab, dtype=dtype)
        rows.append({"vocab": vocab, "method": "naive", "chunk": None, **naive, "peak_vs_naive": 1.0})
        for chunk in args.chunk:
            fn = lambda h, u, t, chunk=chunk: token_logprobs(h, u, t, chunk=chunk)
            got = compiled_memory(fn, **shape, vocab=vocab, dtype=dtype)
            rows.append({"vocab": vocab, "method": "chunked", "chunk": chunk, **got,
                         "peak_vs_naive": got["peak_bytes"] / naive["peak_bytes"]})

    mib = 2**20
    print(f"per-token log-probs + entropy, forward + backward, B={args.batch} T={args.length} D={args.dim} "
          f"{args.dtype}, backend {jax.default_backend()}")
    print(f"{'vocab':>8} {'method':>8} {'chunk':>6} {'temp MiB':>10} {'peak MiB':>10} {'peak / naive':>13}")
    for r in rows:
        print(f"{r['vocab']:>8} {r['method']:>8} {r['chunk'] or '-':>6} {r['temp_bytes'] / mib:>10.1f} "
              f"{r['peak_bytes'] / mib:>10.1f} {r['peak_vs_naive']:>13.3f}")
    print(json.dumps({"benchmark": "logprobs_memory", "backend": jax.default_backend(), "jax": jax.__version__,
                      "machine": platform.machine(), "dtype": args.dtype, **shape, "rows": rows}))


if __name__ == "__main__":
    sys.exit(main())
