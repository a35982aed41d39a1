"""Moving row-batched data between this process's host memory and global arrays on the mesh.

With one process, "local rows" are all rows. With several (multi-host), each process holds a contiguous
block of the global rows (its prompts and their samples), computes what only the host can compute
(detokenisation, rewards) for those rows, and contributes them back to one global array.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from jgrpo.mesh import Rules, logical_to_spec


def row_sharding(mesh: Mesh, rules: Rules, shape: tuple[int, ...]) -> NamedSharding:
    """Rows (axis 0) over the data-parallel axes when they divide the row count; everything else replicated."""
    return NamedSharding(mesh, logical_to_spec(("batch",) + (None,) * (len(shape) - 1), rules, shape, mesh))


def to_global_rows(local: np.ndarray, mesh: Mesh, rules: Rules, global_rows: int) -> jax.Array:
    """This process's rows -> a global [global_rows, ...] array sharded by rows."""
    local = np.asarray(local)
    global_shape = (global_rows,) + local.shape[1:]
    sharding = row_sharding(mesh, rules, global_shape)
    if jax.process_count() > 1 and sharding.is_fully_replicated:
        raise ValueError(
            f"{global_rows} rows cannot be split over the data-parallel devices; with several processes the "
            "batch (data.batch_size, times grpo.num_generations for samples) must be divisible by them"
        )
    return jax.make_array_from_process_local_data(sharding, local, global_shape)


def local_rows(array: jax.Array) -> np.ndarray:
    """The rows of a row-sharded global array that live on this process, in order, as numpy."""
    if array.is_fully_addressable:
        return np.asarray(array)
    blocks = {}
    for shard in array.addressable_shards:
        rows, *rest = shard.index
        if any(s != slice(None) and (s.start, s.stop) != (0, dim) for s, dim in zip(rest, array.shape[1:],
                                                                                    strict=True)):
            raise ValueError(f"array of shape {array.shape} is sharded along more than its rows: {shard.index}")
        blocks.setdefault(rows.start or 0, np.asarray(shard.data))
    return np.concatenate([blocks[start] for start in sorted(blocks)])


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
