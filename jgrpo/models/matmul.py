"""The 2-D matmul every weight projection of the model goes through (`llm`, `lora`), float or int8."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def dense(x: jax.Array, w: jax.Array, contract: int = 1, scale: jax.Array | None = None) -> jax.Array:
    """x [..., *in] times w [*in, *out], with `in` the last `contract` dims of x, as one 2-D matmul.

    With `scale` ([1.., *out] float32), w is int8 (models/quantize.py): (x @ w) * scale, w converted to x's dtype
    inside the matmul (so a decode step reads its int8 bytes), accumulated in float32, scaled per output channel.

    Same numbers as the einsum, but XLA:CPU runs a [rows, in] x [in, out] dot (and its two gradient dots)
    faster than a batched einsum over [B, T, ...] (measured: docs/benchmarks.md#training-step); merging leading
    dims keeps any sharding of B or heads.
    """
    lead, inner = x.shape[: x.ndim - contract], w.shape[:contract]
    size = math.prod(inner)
    if scale is None:
        y = x.reshape(-1, size) @ w.reshape(size, -1)
    else:
        y = jnp.matmul(x.reshape(-1, size), w.reshape(size, -1).astype(x.dtype), preferred_element_type=jnp.float32)
        y = (y * scale.reshape(1, -1)).astype(x.dtype)
    return y.reshape(*lead, *w.shape[contract:])
