"""Moving row-batched data between this process's host memory and global arrays on the mesh.

With one process, "local rows" are all rows. With several (multi-host), each process holds a contiguous
block of the global rows (its prompts and their samples), computes what only the host can compute
(detokenisation, rewards) for those rows, and contributes them back to one global array.

A mesh may hold the devices of some processes only (`mesh.rollout_devices` across processes: the sampler's
processes, then the trainer's). Every process still runs every call (a program on devices it does not hold
runs nothing there), and the arrays of such a mesh reach the hosts through collectives over all processes:
`to_global_rows` gathers every process's rows and places them from the hosts that hold the mesh, `local_rows`
gathers the rows from them, `fetch` brings any value to every host. Rows then lie in process order (process p's
block is the p-th), whatever the mesh.
"""

from __future__ import annotations

import json

import jax
import numpy as np
from jax.sharding import Mesh

from jgrpo.parallel.mesh import Rules, row_sharding


def to_global_rows(local: np.ndarray, mesh: Mesh, rules: Rules, global_rows: int) -> jax.Array:
    """This process's rows -> a global [global_rows, ...] array, sharded by rows when the devices divide them.

    When they do not (e.g. 4 prompts on 8 devices), the array is replicated: every process gathers all
    processes' rows and places them in process order along the mesh (see `process_rank`).
    """
    local = np.asarray(local)
    global_shape = (global_rows,) + local.shape[1:]
    sharding = row_sharding(mesh, rules, global_shape)
    if not spans_all_processes(mesh):
        rows = np.concatenate(list(_process_blocks(local, global_rows)))  # in process order
        return jax.make_array_from_callback(global_shape, sharding, lambda index: rows[index], dtype=rows.dtype)
    if jax.process_count() > 1 and sharding.is_fully_replicated:
        blocks = _process_blocks(local, global_rows)
        ordered = [blocks[p] for p in sorted(range(len(blocks)), key=lambda p: process_rank(mesh, p))]
        local = np.concatenate(ordered)
    return jax.make_array_from_process_local_data(sharding, local, global_shape)


def spans_all_processes(mesh: Mesh) -> bool:
    """Whether every process holds devices of `mesh` (always, with one process)."""
    return _on_every_process(mesh.devices.flat)


def _held_by_all(x: jax.Array) -> bool:
    """Whether every process holds a part of `x`: the same answer on every process (unlike what it can address)."""
    return _on_every_process(x.sharding.device_set)


def _on_every_process(devices) -> bool:
    return len({d.process_index for d in devices}) == jax.process_count()


def row_block(mesh: Mesh) -> int:
    """Which block of a row-sharded array's rows this process holds (`process_rank`), in process order when the
    mesh leaves processes out (see the module doc)."""
    return process_rank(mesh) if spans_all_processes(mesh) else jax.process_index()


def _process_blocks(local: np.ndarray, global_rows: int) -> np.ndarray:
    """Every process's rows on every host, [processes, local rows, ...] (a collective: each holds its block)."""
    from jax.experimental import multihost_utils

    if global_rows % jax.process_count() or local.shape[0] != global_rows // jax.process_count():
        raise ValueError(f"{global_rows} rows cannot be split evenly over {jax.process_count()} processes "
                         f"(this one has {local.shape[0]})")
    return np.asarray(multihost_utils.process_allgather(local))


def fetch(tree):
    """`tree`'s arrays as numpy on every host: `jax.device_get` where this process can read them whole; an array
    split over several processes (a pod's rows, or a mesh that leaves processes out) is gathered from the processes
    that hold it (a collective: every process calls it, in the same order)."""
    def one(x):
        if not isinstance(x, jax.Array):
            return jax.device_get(x)
        # Decided alike on every process (not by what this one can address: a process holding all of an array that
        # others hold none of reads it whole), as the gather is a collective.
        if not _held_by_all(x):
            return _gather_whole(x)
        if x.is_fully_addressable:  # one process (held by all and addressable here: nobody else holds any)
            return jax.device_get(x)
        if x.sharding.is_fully_replicated:  # every device holds all of it, this process's first one too
            return np.asarray(x.addressable_data(0))
        return _gather_whole(x)  # split over every process (a pod's rows)

    return jax.tree.map(one, tree)


def move_rows(tree, mesh: Mesh, rules: Rules):
    """Row-batched global arrays onto `mesh`, rows sharded (`row_sharding`): a device transfer, or through the
    hosts when the two meshes belong to other processes (JAX moves arrays between processes only as equal
    shardings; a batch's records are small next to the weights, which cross as such: `parallel/weights/`)."""
    def one(x):
        sharding = row_sharding(mesh, rules, x.shape)
        if {d.process_index for d in x.sharding.device_set} == {d.process_index for d in mesh.devices.flat}:
            return jax.device_put(x, sharding)
        whole = _gather_whole(x)
        return jax.make_array_from_callback(x.shape, sharding, lambda index: whole[index], dtype=whole.dtype)

    return jax.tree.map(one, tree)


def process_rank(mesh: Mesh, process: int | None = None) -> int:
    """Position of `process` (default: this one) among the processes in the mesh's device order.

    Row-sharded arrays give each process the rows of its own devices, so process rows are contiguous blocks
    in this order; the replicated fallback above and `local_rows` use it too, which keeps a prompt and its
    samples on the same process whatever layout each array gets.
    """
    process = jax.process_index() if process is None else process
    owners = [d.process_index for d in mesh.devices.flat]
    order = list(dict.fromkeys(owners))
    runs = sum(1 for i, p in enumerate(owners) if i == 0 or owners[i - 1] != p)
    if runs != len(order):
        raise ValueError("each process's devices must be contiguous in the mesh (rows are split by process); "
                         f"got device owners {owners}")
    return order.index(process)


def local_rows(array: jax.Array) -> np.ndarray:
    """The rows of a row-sharded (or replicated) global array that belong to this process, in order, as numpy."""
    if not _held_by_all(array):  # first: process 0 may address all of a sampler's array, yet the gather is collective
        return _rows_from_other_processes(array)
    if array.is_fully_addressable:
        return np.asarray(array)
    blocks = {}
    for shard in array.addressable_shards:
        rows, *rest = shard.index
        if any(s != slice(None) and (s.start, s.stop) != (0, dim) for s, dim in zip(rest, array.shape[1:],
                                                                                    strict=True)):
            raise ValueError(f"array of shape {array.shape} is sharded along more than its rows: {shard.index}")
        blocks.setdefault(rows.start or 0, np.asarray(shard.data))
    held = np.concatenate([blocks[start] for start in sorted(blocks)])
    if held.shape[0] == array.shape[0] and array.sharding.is_fully_replicated:
        # Replicated over processes: every process holds all rows; its own are its block in process order.
        mesh = array.sharding.mesh
        count = len({d.process_index for d in mesh.devices.flat})
        size = array.shape[0] // count
        start = process_rank(mesh) * size
        return held[start:start + size]
    return held


def global_max(value: int) -> int:
    """The largest `value` over all processes (e.g. the padded prompt width every process must use)."""
    if jax.process_count() == 1:
        return int(value)
    from jax.experimental import multihost_utils

    return int(np.max(multihost_utils.process_allgather(np.asarray([value], np.int64))))


def global_sum(values: np.ndarray) -> np.ndarray:
    """Element-wise sum of a small host array over all processes (e.g. per-process failure counts)."""
    values = np.asarray(values)
    if jax.process_count() == 1:
        return values
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(values)).sum(axis=0)


def broadcast_json(value):
    """Process 0's `value` (anything JSON can hold) on every process; the others' `value` is ignored. A
    collective: every process calls it, in the same order as its other collectives."""
    if jax.process_count() == 1:
        return value
    from jax.experimental import multihost_utils

    mine = np.frombuffer(json.dumps(value).encode(), np.uint8) if jax.process_index() == 0 else np.zeros(0, np.uint8)
    size = int(np.asarray(multihost_utils.broadcast_one_to_all(np.asarray([mine.size], np.int64)))[0])
    data = np.zeros(size, np.uint8)
    data[:mine.size] = mine
    return json.loads(bytes(np.asarray(multihost_utils.broadcast_one_to_all(data), np.uint8)))


def gather_json(value) -> list:
    """Every process's `value` (anything JSON can hold), in process order; a collective like `broadcast_json`."""
    if jax.process_count() == 1:
        return [value]
    from jax.experimental import multihost_utils

    mine = np.frombuffer(json.dumps(value).encode(), np.uint8)
    size = global_max(mine.size)
    data = np.zeros(size + 8, np.uint8)
    data[:8] = np.frombuffer(np.int64(mine.size).tobytes(), np.uint8)
    data[8:8 + mine.size] = mine
    rows = np.asarray(multihost_utils.process_allgather(data), np.uint8)
    return [json.loads(bytes(row[8:8 + int(row[:8].view(np.int64)[0])])) for row in rows]


def _rows_from_other_processes(array: jax.Array) -> np.ndarray:
    """`local_rows` of an array whose mesh leaves processes out: this process's block of the rows (process order)."""
    size = array.shape[0] // jax.process_count()
    return _gather_whole(array)[jax.process_index() * size:(jax.process_index() + 1) * size]


def _gather_whole(array: jax.Array) -> np.ndarray:
    """The whole of `array` on every host, from the shards each process holds (a collective over all processes;
    for the small arrays a step hands the hosts: samples, metrics)."""
    from jax.experimental import multihost_utils

    held = np.zeros(array.shape, array.dtype)
    for shard in array.addressable_shards:
        held[shard.index] = np.asarray(shard.data)
    # Which process holds each element follows from the sharding alone (the same on every process): one gather.
    owner = np.zeros(array.shape, np.int32)
    for device, index in array.sharding.devices_indices_map(array.shape).items():
        owner[index] = device.process_index
    gathered = np.asarray(multihost_utils.process_allgather(held))  # [processes, ...]
    return np.take_along_axis(gathered, owner[None], axis=0)[0]
