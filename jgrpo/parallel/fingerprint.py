"""Content fingerprints of arrays: what a checkpoint records to detect corruption, and what names a LoRA base."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _fingerprint_one(x: jax.Array) -> jax.Array:
    """Sum of the array's bits weighted by (2 * flat index + 1), wrapping mod 2**32: one uint32.

    Integer wrap-around sums are exact in any order, so the value does not depend on the sharding or the
    reduction order: a checkpoint written on one mesh verifies on another. Weights catch swapped elements.
    """
    x = x.reshape(-1)
    if x.dtype == jnp.bool_:
        bits = x.astype(jnp.uint32)
    elif x.dtype.itemsize == 8:
        bits = jax.lax.bitcast_convert_type(x, jnp.uint32).reshape(-1)
    else:
        word = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize]
        bits = jax.lax.bitcast_convert_type(x, word).astype(jnp.uint32)
    weights = jnp.arange(bits.size, dtype=jnp.uint32) * jnp.uint32(2) + jnp.uint32(1)
    return jnp.sum(bits * weights, dtype=jnp.uint32)


_fingerprint_many = jax.jit(lambda leaves: [_fingerprint_one(x) for x in leaves])


def fingerprint(tree) -> list[int]:
    """Content fingerprints of every array in `tree`, as plain ints for JSON.

    One jitted call per set of devices: leaves may live on different devices (an optimiser's step count is
    often on one device while the params span the mesh), and one jit cannot mix them.
    """
    leaves = jax.tree.leaves(tree)
    groups: dict = {}
    for i, x in enumerate(leaves):
        devices = frozenset(x.sharding.device_set) if isinstance(x, jax.Array) else None
        groups.setdefault(devices, []).append(i)
    out = [0] * len(leaves)
    for indices in groups.values():
        values = jax.device_get(_fingerprint_many([leaves[i] for i in indices]))
        for i, v in zip(indices, values, strict=True):
            out[i] = int(v)
    return out
