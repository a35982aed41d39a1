"""Content fingerprints of arrays: what a checkpoint records to detect corruption, what names a LoRA base, and
what tells two jobs that the rollout job's weights are the trainer's (`held_fingerprint`: each process sums the
parts it holds, with no collective, and the parts of all processes add up to `fingerprint`)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np


def _words(x: jax.Array) -> jax.Array:
    """The array's bits as uint32 words: one per element, two (a trailing axis) for 8-byte dtypes."""
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    if x.dtype.itemsize == 8:
        return jax.lax.bitcast_convert_type(x, jnp.uint32)
    word = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize]
    return jax.lax.bitcast_convert_type(x, word).astype(jnp.uint32)


def _fingerprint_one(x: jax.Array) -> jax.Array:
    """Sum of the array's bits weighted by (2 * flat index + 1), wrapping mod 2**32: one uint32.

    Integer wrap-around sums are exact in any order, so the value does not depend on the sharding or the
    reduction order: a checkpoint written on one mesh verifies on another. Weights catch swapped elements.
    """
    bits = _words(x).reshape(-1)
    weights = jnp.arange(bits.size, dtype=jnp.uint32) * jnp.uint32(2) + jnp.uint32(1)
    return jnp.sum(bits * weights, dtype=jnp.uint32)


@functools.partial(jax.jit, static_argnums=2)
def _block_fingerprint(block: jax.Array, offsets: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """`_fingerprint_one`'s terms for the elements of `block`, the part of an array of `shape` that starts at
    `offsets` (uint32, one per axis): their flat indices are the whole array's, so the parts' sums add up to the
    whole's fingerprint (mod 2**32)."""
    bits = _words(block)
    if bits.ndim > block.ndim:  # an 8-byte dtype: each element's two words are one more axis
        shape, offsets = (*shape, 2), jnp.concatenate([offsets, jnp.zeros(1, jnp.uint32)])
    index = jnp.zeros(bits.shape, jnp.uint32)
    stride = 1
    for axis in reversed(range(bits.ndim)):
        position = jax.lax.broadcasted_iota(jnp.uint32, bits.shape, axis) + offsets[axis]
        index = index + position * jnp.uint32(stride % 2**32)
        stride *= shape[axis]
    return jnp.sum(bits * (index * jnp.uint32(2) + jnp.uint32(1)), dtype=jnp.uint32)


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


def held_fingerprint(tree) -> list[int]:
    """This process's part of each leaf's `fingerprint`: the sum over the shards it holds, each distinct block of
    a leaf counted once over all processes (replicas: the one on the lowest device id). Summed over the processes
    (mod 2**32) it is `fingerprint(tree)`. Runs only on this process's devices: no collective, so a thread may
    call it while another runs the job's programs. On CPU a shard's buffer is host memory: numpy reads it in
    place (`host_block_fingerprint`), several times faster than XLA:CPU's reduction."""
    out = []
    for x in jax.tree.leaves(tree):
        total = 0
        for shard, offsets in counted_shards(x):
            if shard.device.platform == "cpu":
                total += host_block_fingerprint(np.asarray(shard.data), offsets, x.shape)
            else:
                start = jax.device_put(np.asarray(offsets, np.uint32), shard.device)
                total += int(_block_fingerprint(shard.data, start, tuple(x.shape)))
        out.append(total % 2**32)
    return out


def counted_shards(x: jax.Array) -> list[tuple]:
    """(shard, its offsets) of the blocks of `x` this process counts: each distinct block once over all processes,
    where the lowest device id holding it is."""
    counted: dict = {}
    for device, index in sorted(x.sharding.devices_indices_map(x.shape).items(), key=lambda d: d[0].id):
        counted.setdefault(_key(index, x.shape), device)
    return [(shard, [s.indices(n)[0] for s, n in zip(shard.index, x.shape, strict=True)])
            for shard in x.addressable_shards if counted[_key(shard.index, x.shape)] == shard.device]


def host_block_fingerprint(block: np.ndarray, offsets, shape) -> int:
    """`_block_fingerprint` of a host array, from its sums along each axis: with g = sum_d (o_d + i_d) s_d the
    flat index, sum b (2 g + 1) = S + 2 sum_d s_d (o_d S + sum_i i M_d[i]), M_d the sums over every axis but d
    and S the total; one pass per axis, no temporaries of the block's size (uint64 wraps: exact mod 2**32)."""
    bits = _host_words(block)
    if bits.ndim > block.ndim:
        shape, offsets = (*shape, 2), [*offsets, 0]
    if bits.ndim == 0:
        return int(bits) % 2**32
    strides = np.cumprod([1, *shape[::-1]], dtype=object)[:-1][::-1]  # python ints: no overflow
    total = int(bits.sum(dtype=np.uint64))
    out = total
    for axis in range(bits.ndim):
        others = tuple(a for a in range(bits.ndim) if a != axis)
        marginal = bits.sum(axis=others, dtype=np.uint64) if others else bits.astype(np.uint64)
        weighted = int((np.arange(marginal.size, dtype=np.uint64) * marginal).sum(dtype=np.uint64))
        out += 2 * int(strides[axis]) * (int(offsets[axis]) * total + weighted)
    return out % 2**32


def _host_words(x: np.ndarray) -> np.ndarray:
    if x.dtype == np.bool_:
        return x.view(np.uint8)
    if x.dtype.itemsize == 8:
        return x.view(np.uint32).reshape(*x.shape, 2)
    return x.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[x.dtype.itemsize])


def _key(index: tuple[slice, ...], shape) -> tuple:
    return tuple(s.indices(n) for s, n in zip(index, shape, strict=True))
