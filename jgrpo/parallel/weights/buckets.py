"""Weights cut into buckets of bounded host memory (`rollout.sync_bucket_mb`): which rows of which leaf go in
each bucket, how the sender reads them off its devices, and how the receiver lays them out on its own.

The sender walks the leaves in tree order and cuts them into pieces (rows along a leaf's first axis) that fill
buckets of at most `bucket_bytes`; a leaf larger than a bucket is split over several. Rows, not flat elements:
no index reaches 2**31 (a stacked MoE weight has more elements than that), and a piece of a leaf sharded along
another axis is a slice of each shard.

Reading a piece: with one process, from the device whose shard holds those rows whole (on CPU that shard's own
buffer, whose host view is no copy at all); else sliced on the devices and gathered on this process's first
device (over its devices and, with several processes, an all-gather of the job: every process takes part, in
the same order). Then `copy_to_host_async`: the device-to-host copy of bucket k + 1 runs while bucket k is sent.
Placing: each piece is laid out in the receiver's sharding as it arrives (each process places its own devices'
shards, no collective); a shard whose rows come in several pieces waits on its device (not the host) until the
last one.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jgrpo.parallel.channel import host_buffer


class Piece(NamedTuple):
    leaf: int  # index in tree order
    start: int  # rows [start, stop) along the leaf's first axis (a scalar is one row)
    stop: int


class WeightsRefused(ValueError):
    """The sender's params are not the ones this side expects (another model or weights dtype)."""


def rows_of(shape) -> tuple[int, int]:
    """(rows, elements per row) of a leaf cut along its first axis."""
    shape = tuple(shape) or (1,)
    return shape[0], int(np.prod(shape[1:], dtype=np.int64))


def bucket_plan(leaves, bucket_bytes: int) -> list[list[Piece]]:
    """The pieces of each bucket: leaves in order, cut along their first axis so that a bucket holds at most
    `bucket_bytes`, or one row where a row is larger (a stacked layer weight's row is one layer's matrix)."""
    buckets, current, room = [], [], bucket_bytes
    for i, leaf in enumerate(leaves):
        rows, per_row = rows_of(leaf.shape)
        row_bytes = max(1, per_row * np.dtype(leaf.dtype).itemsize)
        start = 0
        while True:
            if room < row_bytes and current and rows:
                buckets.append(current)
                current, room = [], bucket_bytes
            stop = min(rows, start + max(1, room // row_bytes))
            current.append(Piece(i, start, stop))
            room -= (stop - start) * row_bytes
            start = stop
            if start >= rows:
                break
    if current:
        buckets.append(current)
    return buckets


def leaf_specs(tree) -> list[dict]:
    """Each leaf's path, shape and dtype, in tree order (what sender and receiver compare)."""
    return [{"path": jax.tree_util.keystr(path), "shape": list(leaf.shape), "dtype": np.dtype(leaf.dtype).name}
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]]


def check_specs(expected: list[dict], sent: list[dict]) -> None:
    """Refuse weights whose leaves are not the expected ones, naming the first that differs."""
    for i, (want, got) in enumerate(zip(expected, sent, strict=False)):
        if want != got:
            raise WeightsRefused(f"leaf {i} {want['path']}: this job expects {want['shape']} {want['dtype']}, the "
                                 f"trainer sent {got['path']} {got['shape']} {got['dtype']}")
    if len(expected) != len(sent):
        raise WeightsRefused(f"this job expects {len(expected)} param leaves, the trainer sent {len(sent)}")


# ---------------------------------------------------------------------------------------------- the sender's side


@functools.partial(jax.jit, static_argnums=2)
def _rows(x, start, size: int):
    """Rows [start, start + size) of the leaf: always a new array, taken on the device (one program per size)."""
    if x.ndim == 0:
        return x.reshape(1)  # a scalar is one row (and a new array, as every piece)
    return jax.lax.dynamic_slice_in_dim(x, start, size, axis=0)


def whole_on_one_device(x: jax.Array) -> jax.Array:
    """`x` whole on this process's first device: all-gathered on its own devices (across processes when it spans
    several: a collective every process of the job takes part in), never through the host."""
    device = jax.local_devices()[0]
    mesh = getattr(x.sharding, "mesh", None)
    if len(x.sharding.device_set) == 1 or mesh is None:
        return x if x.sharding.device_set == {device} else jax.device_put(x, device)
    whole = jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    return next(s.data for s in whole.addressable_shards if s.device == device)


def read_piece(x: jax.Array, piece: Piece, *, alias: bool) -> list[tuple[Piece, jax.Array | np.ndarray]]:
    """The rows of `piece` of leaf `x`, each part whole on one device of this process: with one process, a part
    per shard that holds whole rows (no gather); else one part, gathered (every process alike: see the module
    doc). `alias` (CPU, where a shard's host view is its device buffer): a part is a view of the shard's host
    view; elsewhere a part is always a new array, because a jax array keeps its host copy for as long as it lives
    (the published params live until the next publish: the host would end up holding all of them)."""
    _, start, stop = piece
    if x.ndim and x.is_fully_addressable:
        parts, covered = [], start
        for shard in sorted(x.addressable_shards, key=lambda s: (s.index[0].indices(x.shape[0])[0], s.device.id)):
            first, last, _ = shard.index[0].indices(x.shape[0])
            whole_rows = all(s.indices(n) == (0, n, 1) for s, n in zip(shard.index[1:], x.shape[1:], strict=True))
            if not whole_rows or not first <= covered < last:
                continue
            end = min(stop, last)
            if alias:  # the shard's host view, cut on the host (a view: no copy)
                part = np.asarray(shard.data)[covered - first:end - first]
            else:
                part = _rows(shard.data, covered - first, end - covered)
            parts.append((Piece(piece.leaf, covered, end), part))
            covered = end
            if covered == stop:
                return parts
    return [(piece, whole_on_one_device(_rows(x, start, stop - start)))]


def start_host_copy(arrays: list[jax.Array]) -> list[jax.Array]:
    """Start the device-to-host copies of a bucket's pieces (they run while the bucket before is sent)."""
    for a in arrays:
        a.copy_to_host_async()
    return arrays


def aliases_host(leaves) -> bool:
    """Whether a device buffer is host memory here (CPU): then a piece may be the shard itself (`read_piece`)."""
    return all(d.platform == "cpu" for x in leaves[:1] for d in x.sharding.device_set)


# ---------------------------------------------------------------------------------------------- the receiver's side


def placed(x, sharding) -> jax.Array:
    """`x` (a host array, or one on a local device) laid out in `sharding`, which may span other processes'
    devices too: each process places the shards of its own devices (no collective). A host array aligned as the
    channel's frames are is not copied on CPU: the device buffer is the frame's memory."""
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


class LeafAssembly:
    """The leaves of one version as their pieces (rows) arrive: each local device's shard of a leaf is cut out of
    the pieces that hold its rows (a view of the host array: on CPU, aligned, it becomes the device buffer without
    a copy) and put on its device. A shard whose rows come in several pieces is joined on its device, or on CPU,
    where a device buffer is host memory anyway, in a host buffer its pieces are copied into as they come (numpy's
    copy, and the pieces' frames go back to the channel at once). A leaf is done when all its local shards are."""

    def __init__(self, like_leaves, shardings):
        self.shapes = [tuple(x.shape) for x in like_leaves]
        self.shardings = shardings
        self.done: dict[int, jax.Array] = {}
        self._shards: dict[int, dict] = {}  # leaf -> device -> the shard (done), its parts, or its host buffer
        self._rows_in: dict[int, int] = {}  # leaf -> rows received

    def add(self, piece: Piece, array) -> None:
        leaf, start, stop = piece
        shape = self.shapes[leaf]
        rows, per_row = rows_of(shape)
        if not 0 <= start < stop <= rows or array.size != (stop - start) * per_row:
            raise ValueError(f"leaf {leaf}: rows {start}-{stop} of {rows} came with {array.size} elements")
        array = array.reshape((stop - start, *shape[1:]) if shape else ())
        sharding = self.shardings[leaf]
        shards = self._shards.setdefault(leaf, {})
        for device, index in sharding.addressable_devices_indices_map(shape).items():
            first, last = index[0].indices(rows)[:2] if shape else (0, 1)
            low, high = max(first, start), min(last, stop)
            if low >= high:
                continue
            block = array[(slice(low - start, high - start), *index[1:])] if shape else array
            if (low, high) == (first, last):  # the whole shard in this piece
                shards[device] = jax.device_put(block, device)
            elif device.platform == "cpu" and isinstance(block, np.ndarray):
                buffer = shards.setdefault(device, host_buffer((last - first, *block.shape[1:]), block.dtype))
                buffer[low - first:high - first] = block
            else:
                shards.setdefault(device, []).append((low, jax.device_put(block, device)))
        self._rows_in[leaf] = self._rows_in.get(leaf, 0) + stop - start
        if self._rows_in[leaf] == rows:
            done = [_joined(shard, device) for device, shard in self._shards.pop(leaf).items()]
            self.done[leaf] = jax.make_array_from_single_device_arrays(shape, sharding, done)


def _joined(shard, device) -> jax.Array:
    """A shard from what its pieces left: itself, a host buffer, or parts on its device, joined in row order."""
    if isinstance(shard, np.ndarray):
        return jax.device_put(shard, device)
    if isinstance(shard, list):
        return jnp.concatenate([part for _, part in sorted(shard, key=lambda p: p[0])])
    return shard


