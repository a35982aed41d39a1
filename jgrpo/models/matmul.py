"""The 2-D matmul every weight projection of the model goes through (`llm`, `lora`)."""

from __future__ import annotations

import math

import jax


def dense(x: jax.Array, w: jax.Array, contract: int = 1) -> jax.Array:
    """x [..., *in] times w [*in, *out], with `in` the last `contract` dims of x, as one 2-D matmul.

    Same numbers as the einsum, but XLA:CPU runs a [rows, in] x [in, out] dot (and its two gradient dots)
    faster than a batched einsum over [B, T, ...] (measured: docs/benchmarks.md#training-step); merging leading
    dims keeps any sharding of B or heads.
    """
    lead, inner = x.shape[: x.ndim - contract], w.shape[:contract]
    size = math.prod(inner)
    y = x.reshape(-1, size) @ w.reshape(size, -1)
    return y.reshape(*lead, *w.shape[contract:])
