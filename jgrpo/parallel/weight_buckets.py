"""Params moved between two jobs over a `Channel` in buckets of bounded host memory (`rollout.sync_bucket_mb`).

The sender walks the leaves in tree order and cuts them into pieces (a leaf's flat element range) that fill
buckets of at most `bucket_bytes`; a leaf larger than a bucket is split over several. Per bucket it reads only
that bucket's pieces from its devices (a slice of the flat leaf, taken on the device), sends them as one frame
and lets them go, so its host holds one bucket at a time. The receiver puts each piece on its devices as it
arrives; a split leaf's pieces wait there (not on the host) until the last one, then are joined and laid out in
the receiver's sharding. The first frame lists every leaf (path, shape, dtype): a receiver that expects other
params refuses, naming the first leaf that differs. Bit for bit: the bytes are the sender's, in its dtype.
"""

from __future__ import annotations

import functools
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jgrpo.parallel.channel import Channel, ChannelClosed


class Piece(NamedTuple):
    leaf: int  # index in tree order
    start: int  # flat element range [start, stop)
    stop: int


def bucket_plan(leaves, bucket_bytes: int) -> list[list[Piece]]:
    """The pieces of each bucket: leaves in order, each bucket at most `bucket_bytes` (at least one element)."""
    buckets, current, room = [], [], bucket_bytes
    for i, leaf in enumerate(leaves):
        itemsize, size = np.dtype(leaf.dtype).itemsize, int(np.prod(leaf.shape, dtype=np.int64))
        start = 0
        while start < size or (size == 0 and start == 0):
            if room < itemsize and current:
                buckets.append(current)
                current, room = [], bucket_bytes
            stop = min(size, start + max(1, room // itemsize))
            current.append(Piece(i, start, stop))
            room -= (stop - start) * itemsize
            if size == 0:
                break
            start = stop
    if current:
        buckets.append(current)
    return buckets


def leaf_specs(tree) -> list[dict]:
    """Each leaf's path, shape and dtype, in tree order (what sender and receiver compare)."""
    return [{"path": jax.tree_util.keystr(path), "shape": list(leaf.shape), "dtype": np.dtype(leaf.dtype).name}
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]]


@functools.partial(jax.jit, static_argnums=2)
def _piece(x, start, size: int):
    """Elements [start, start + size) of the flat leaf: a new array, taken on the device (one program per size)."""
    return jax.lax.dynamic_slice_in_dim(x.reshape(-1), start, size)


def send_weights(channel: Channel, params, *, version: int, bucket_bytes: int, extra: dict | None = None) -> dict:
    """Send `params` (a pytree of arrays, on this process's devices) as `version`; `extra` rides on the first
    frame. Returns {"bytes", "seconds", "buckets", "peak_bucket_bytes"}."""
    start = time.perf_counter()
    leaves = jax.tree.leaves(params)
    plan = bucket_plan(leaves, bucket_bytes)
    channel.send("weights", {"version": version, "buckets": len(plan), "leaves": leaf_specs(params),
                             "extra": extra or {}})
    sent, peak = 0, 0
    for i, pieces in enumerate(plan):
        arrays = []
        for p in pieces:
            # Never np.asarray(leaf): a jax array keeps its host copy for as long as it lives (the published
            # params live until the next publish), so the host would end up holding all of them.
            arrays.append(np.asarray(_piece(leaves[p.leaf], p.start, p.stop - p.start)))
        peak = max(peak, sum(a.nbytes for a in arrays))
        sent += channel.send("weights_bucket", {"version": version, "bucket": i,
                                                "pieces": [tuple(p) for p in pieces], "arrays": arrays})
        del arrays
    return {"bytes": sent, "seconds": time.perf_counter() - start, "buckets": len(plan), "peak_bucket_bytes": peak}


class WeightsRefused(ValueError):
    """The sender's params are not the ones this side expects (another model or weights dtype)."""


def receive_weights(channel: Channel, header: dict, like, shardings, *, timeout: float | None = None) -> Any:
    """The params announced by `header` (the body of a "weights" message already received) read from `channel`:
    a pytree like `like` (shapes and dtypes) laid out in `shardings` (a matching pytree)."""
    expected = leaf_specs(like)
    for i, (want, got) in enumerate(zip(expected, header["leaves"], strict=False)):
        if want != got:
            raise WeightsRefused(f"leaf {i} {want['path']}: this job expects {want['shape']} {want['dtype']}, the "
                                 f"trainer sent {got['path']} {got['shape']} {got['dtype']}")
    if len(expected) != len(header["leaves"]):
        raise WeightsRefused(f"this job expects {len(expected)} param leaves, the trainer sent "
                             f"{len(header['leaves'])}")
    leaves, treedef = jax.tree.flatten(like)
    targets = jax.tree.leaves(shardings)
    done: list[Any] = [None] * len(leaves)
    parts: dict[int, list] = {}
    for _ in range(header["buckets"]):
        kind, body = channel.recv(timeout)
        if kind != "weights_bucket" or body["version"] != header["version"]:
            raise ChannelClosed(f"expected bucket of version {header['version']}, got a {kind!r} message")
        for (leaf, start, stop), array in zip(body["pieces"], body["arrays"], strict=True):
            shape = tuple(leaves[leaf].shape)
            if start == 0 and stop == array.size == int(np.prod(shape, dtype=np.int64)):
                done[leaf] = jax.device_put(array.reshape(shape), targets[leaf])
                continue
            parts.setdefault(leaf, []).append(jax.device_put(array))  # on the device until the leaf is whole
            if stop == int(np.prod(shape, dtype=np.int64)):
                done[leaf] = jax.device_put(jnp.concatenate(parts.pop(leaf)).reshape(shape), targets[leaf])
    missing = [i for i, x in enumerate(done) if x is None]
    if missing:
        raise ChannelClosed(f"the trainer's weights arrived without leaves {missing[:5]}")
    return jax.tree.unflatten(treedef, done)
