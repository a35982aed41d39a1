"""A version as its changes since the one before (`rollout.weight_delta`): the elements whose bits differ, as
flat indices and new values, found on the trainer's side and applied on the rollout job's.

Between two publishes most of the sampler's weights keep their value: a step moves a weight by about the learning
rate, and in bfloat16 (8 bits of mantissa) or int8 (a 127th of the channel's largest weight) only the ones that
cross a rounding boundary change. The sender compares the new copy with the last one the rollout job holds, bit
for bit (so -0.0 and NaN payloads count too), and takes each changed leaf's flat indices (int32; int64 on the
host for a leaf of 2**31 elements or more) and new values, with the fingerprint's change, sum (new - old bits)
x (2 i + 1) over them (`parallel/fingerprint.py`): the fingerprint of the new version is the old one's plus
that, so a publish of changes is checked in time proportional to the changes, not to the weights.

Where the leaves' buffers are host memory (CPU) numpy finds and applies the changes in place of the device
buffers; elsewhere (TPU, GPU, or leaves spread over processes) jitted programs do, the changes padded to a power
of two (one program per leaf shape and size, not per publish).

The receiver applies changes to spares: a copy of each shard it holds, made after the version before was
accepted, outside the trainer's wait (`Spares.refill`). The version that samples is never touched: the new one
is built beside it (in the spares) and swapped in whole.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jgrpo.parallel.channel import host_buffer
from jgrpo.parallel.fingerprint import counted_shards
from jgrpo.parallel.weights.copies import copy_on_its_device

FLAT_LIMIT = 2**31  # a leaf with more elements: int64 indices (on the host; the device path refuses, see below)
MIN_ENTRIES = 1024  # the smallest padded size of a leaf's changes on a device (fewer sizes, fewer programs)


class Changes(NamedTuple):
    """One leaf's changes: flat indices (int32 or int64) and the new values, and their fingerprint change."""

    indices: np.ndarray
    values: np.ndarray
    fingerprint: int  # sum over the changes of (new - old bits) x (2 i + 1), mod 2**32


def on_host(x: jax.Array) -> bool:
    """Whether numpy can read `x`'s buffers in place: a CPU array held whole by this process."""
    return x.is_fully_addressable and all(d.platform == "cpu" for d in x.sharding.device_set)


# ---------------------------------------------------------------------------------------------- the sender's side


def leaf_changes(new: jax.Array, old: jax.Array) -> Changes:
    """The elements of leaf `new` whose bits differ from `old`'s (same shape, dtype and sharding), in flat order.
    Every process of the sender's job calls it for the same leaves (the device path is a collective)."""
    if on_host(new):
        found = [_host_changes(s.data, t.data, offsets, new.shape) for (s, offsets), t in
                 zip(counted_shards(new), [t for t, _ in counted_shards(old)], strict=True)]
        indices = np.concatenate([c.indices for c in found])
        return Changes(indices if new.size >= FLAT_LIMIT else indices.astype(np.int32),
                       np.concatenate([c.values for c in found]), sum(c.fingerprint for c in found) % 2**32)
    rows, per_row = (new.shape[0], new.size // new.shape[0]) if new.ndim and new.shape[0] else (1, new.size)
    step = max(1, (FLAT_LIMIT // 2) // max(1, per_row))  # rows per block: its flat indices fit int32
    found = [_block_changes(new, old, start, min(rows, start + step) - start, per_row)
             for start in range(0, rows, step)]
    indices = np.concatenate([c.indices for c in found])
    return Changes(indices if new.size >= FLAT_LIMIT else indices.astype(np.int32),
                   np.concatenate([c.values for c in found]), sum(c.fingerprint for c in found) % 2**32)


def _block_changes(new: jax.Array, old: jax.Array, start: int, size: int, per_row: int) -> Changes:
    """The changes in rows [start, start + size) of a leaf on the devices (int32 in the block, int64 out)."""
    if start or size != (new.shape[0] if new.ndim else 1):
        new, old = _row_block(new, start, size), _row_block(old, start, size)
    gathered = _gathered(new)
    count = int(np.asarray(_on_one_device(_count(new, old, gathered))))
    padded = min(new.size, max(MIN_ENTRIES, 1 << (max(count, 1) - 1).bit_length()))
    indices, values, change, total = (np.asarray(_on_one_device(a)) for a in _entries(new, old, padded, gathered))
    # The block's flat indices -> the leaf's: sum (n - o)(2 (offset + i) + 1) = change + 2 offset sum (n - o).
    offset = start * per_row
    return Changes(indices[:count].astype(np.int64) + offset, values[:count],
                   (int(change) + 2 * offset * int(total)) % 2**32)


@functools.partial(jax.jit, static_argnums=2)
def _row_block(x, start, size: int):
    return jax.lax.dynamic_slice_in_dim(x, start, size, axis=0)


def _host_changes(new: jax.Array, old: jax.Array, offsets: list[int], shape) -> Changes:
    """The changes in one block of a CPU leaf (a shard's host view: no copy), with the leaf's flat indices."""
    a, b = np.asarray(new), np.asarray(old)
    local = np.flatnonzero(_host_bits(a) != _host_bits(b))
    if not shape or a.shape[1:] == tuple(shape[1:]):  # a run of whole rows
        flat = local + (offsets[0] * int(np.prod(shape[1:], dtype=np.int64)) if shape else 0)
    else:
        where = np.unravel_index(local, a.shape)
        flat = np.ravel_multi_index(tuple(w + o for w, o in zip(where, offsets, strict=True)), shape)
    values = a.reshape(-1)[local]
    return Changes(flat, values, _fingerprint_change(_host_bits(values), _host_bits(b.reshape(-1)[local]), flat))


def _host_bits(x: np.ndarray) -> np.ndarray:
    return x.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[x.dtype.itemsize]) if x.dtype != np.bool_ else x


def _fingerprint_change(new_bits: np.ndarray, old_bits: np.ndarray, indices: np.ndarray) -> int:
    weights = indices.astype(np.uint64) * np.uint64(2) + np.uint64(1)
    return int(((new_bits.astype(np.uint64) - old_bits.astype(np.uint64)) * weights).sum(dtype=np.uint64)) % 2**32


def _device_bits(x: jax.Array) -> jax.Array:
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint8)
    return jax.lax.bitcast_convert_type(x, {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize])


def _gathered(x: jax.Array):
    """Where a small result of `x`'s leaf goes: replicated over its mesh, so every process holds it whole."""
    mesh = getattr(x.sharding, "mesh", None)
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()) if mesh is not None else x.sharding


def _on_one_device(x: jax.Array) -> jax.Array:
    return x.addressable_shards[0].data


@functools.partial(jax.jit, static_argnums=2)
def _count(new, old, gathered):
    differ = _device_bits(new) != _device_bits(old)
    return jax.lax.with_sharding_constraint(jnp.sum(differ, dtype=jnp.int32), gathered)


@functools.partial(jax.jit, static_argnums=(2, 3))
def _entries(new, old, size: int, gathered):
    """(indices, values, fingerprint change, sum of the bit differences) of the first `size` changed elements
    (the rest: index 0, weight 0)."""
    a, b = _device_bits(new).reshape(-1), _device_bits(old).reshape(-1)
    (indices,) = jnp.nonzero(a != b, size=size, fill_value=0)
    real = jnp.arange(size) < jnp.sum(a != b)
    weights = indices.astype(jnp.uint32) * jnp.uint32(2) + jnp.uint32(1)
    difference = jnp.where(real, a[indices].astype(jnp.uint32) - b[indices].astype(jnp.uint32), jnp.uint32(0))
    constrain = functools.partial(jax.lax.with_sharding_constraint, shardings=gathered)
    change, total = jnp.sum(difference * weights, dtype=jnp.uint32), jnp.sum(difference, dtype=jnp.uint32)
    return constrain(indices), constrain(new.reshape(-1)[indices]), constrain(change), constrain(total)


# ---------------------------------------------------------------------------------------------- the receiver's side


class Spares:
    """Per leaf and shard, a copy of the version held, into which the next changes are written (host arrays on
    CPU, device arrays elsewhere). A leaf without spares (the first changes after a whole copy) gets them on the
    spot."""

    def __init__(self):
        self._spares: dict[int, dict] = {}  # leaf -> device -> copy of the held shard

    def refill(self, leaves: dict[int, jax.Array]) -> None:
        """Copies of the held version's shards of these leaves (index -> leaf): after it was accepted."""
        for i, leaf in leaves.items():
            self._spares[i] = {s.device: _copy_of(s.data) for s in leaf.addressable_shards}

    def clear(self) -> None:
        self._spares.clear()

    def apply(self, i: int, leaf: jax.Array, changes: list[Changes]) -> tuple[jax.Array, int]:
        """Leaf `i` of the held version (`leaf`, not a scalar) with `changes` set, built in its spares; and this
        process's part of the fingerprint change (over the blocks it counts: `counted_shards`)."""
        if i not in self._spares:
            self.refill({i: leaf})
        spares, counted = self._spares.pop(i), {s.device for s, _ in counted_shards(leaf)}
        shape, part, shards = leaf.shape, 0, []
        for shard in leaf.addressable_shards:
            block = spares[shard.device]
            for chunk in changes:
                positions, values, flat = _inside(chunk, shape, shard.index)
                if shard.device in counted:
                    part += _block_change(block, positions, values, flat)
                block = _set(block, positions, values)
            shards.append(jax.device_put(block, shard.device) if isinstance(block, np.ndarray) else block)
        return jax.make_array_from_single_device_arrays(shape, leaf.sharding, shards), part % 2**32


def _copy_of(x: jax.Array):
    """A spare: a host copy (aligned, so that `device_put` takes it without a copy) or a device copy."""
    if not on_host(x):
        return copy_on_its_device(x)
    src = np.asarray(x)
    out = host_buffer(src.shape, src.dtype)
    np.copyto(out, src)
    return out


def _inside(changes: Changes, shape, index) -> tuple[tuple[np.ndarray, ...], np.ndarray, np.ndarray]:
    """The changes that fall in the shard at `index`: (their positions in it: one flat index where the shard is a
    run of whole rows, else one per axis; their values; their flat indices in the leaf)."""
    bounds = [s.indices(n)[:2] for s, n in zip(index, shape, strict=True)]
    if all(b == (0, n) for b, n in zip(bounds[1:], shape[1:], strict=True)):  # whole rows: one flat run
        per_row = int(np.prod(shape[1:], dtype=np.int64))
        first, last = bounds[0][0] * per_row, bounds[0][1] * per_row
        inside = (changes.indices >= first) & (changes.indices < last)
        flat = changes.indices[inside]
        return (flat - first,), changes.values[inside], flat
    where = np.unravel_index(changes.indices, shape)
    inside = np.ones(len(changes.values), bool)
    for axis, (first, last) in zip(where, bounds, strict=True):
        inside &= (axis >= first) & (axis < last)
    positions = tuple(axis[inside] - first for axis, (first, _) in zip(where, bounds, strict=True))
    return positions, changes.values[inside], changes.indices[inside]


def _block_change(block, positions, values, flat) -> int:
    """Sum over the changes in this block of (new - held bits) x (2 g + 1), g the flat index in the whole leaf."""
    if not len(values):
        return 0
    if isinstance(block, np.ndarray):
        held = _shaped(block, positions)[positions]
    else:
        held = np.asarray(_gather(block, _padded(positions)))[:len(values)]
    return _fingerprint_change(_host_bits(np.asarray(values)), _host_bits(held), flat)


def _shaped(block, positions):
    """The block as its positions index it: flat (one index) or as it is."""
    return block.reshape(-1) if len(positions) == 1 and block.ndim != 1 else block


def _set(block, positions, values):
    """The block with `values` at `positions`: in place for a host spare, a donated scatter for a device one
    (padded to a power of two past the block's end, where the scatter drops it: one program per size)."""
    if isinstance(block, np.ndarray):
        _shaped(block, positions)[positions] = values
        return block
    if not len(values):
        return block
    padded = _padded(positions, _shaped(block, positions).shape)
    extra = np.zeros(len(padded[0]) - len(values), values.dtype)
    return _scatter(block, padded, np.concatenate([values, extra]))


def _padded(positions, shape=None) -> tuple[np.ndarray, ...]:
    """Positions padded to a power of two (at least MIN_ENTRIES): with `shape`, past its end; else at 0."""
    size = max(MIN_ENTRIES, 1 << (max(len(positions[0]), 1) - 1).bit_length())
    out = []
    for axis, p in enumerate(positions):
        padded = np.full(size, shape[axis] if shape is not None else 0, np.int32)
        padded[:len(p)] = p
        out.append(padded)
    return tuple(out)


@jax.jit
def _gather(block, positions):
    return (block.reshape(-1) if len(positions) == 1 else block)[positions]


@functools.partial(jax.jit, donate_argnums=0)
def _scatter(block, positions, values):
    if len(positions) == 1:  # flat positions in a run of whole rows
        return block.reshape(-1).at[positions].set(values, mode="drop").reshape(block.shape)
    return block.at[positions].set(values, mode="drop")
