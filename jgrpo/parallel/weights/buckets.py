"""Params moved between two jobs over a `Channel` in buckets of bounded host memory (`rollout.sync_bucket_mb`).

The sender walks the leaves in tree order and cuts them into pieces (rows along a leaf's first axis) that fill
buckets of at most `bucket_bytes`; a leaf larger than a bucket is split over several. Per bucket it reads only
that bucket's pieces from its devices (a slice of the leaf, taken on the device), sends them as one frame
and lets them go, so its host holds one bucket at a time. The receiver puts each piece on its devices as it
arrives; a split leaf's pieces wait there (not on the host) until the last one, then are joined and laid out in
the receiver's sharding. With several processes on a side, each sender process gathers every bucket and sends
it to the receiver processes it serves (none, one or several), and each receiver process places its own devices'
shards. The first frame lists every leaf (path, shape, dtype): a receiver that expects other params refuses,
naming the first leaf that differs. Bit for bit: the bytes are the sender's, in its dtype.

With a `DeviceTransfer` (`rollout.weight_transfer: jax`) a bucket's pieces do not cross the host: the sender
gathers each on its first device and offers it to its peer's transfer server; the bucket's frame carries only
the id to pull, and the receiver, once it has pulled, answers "weights_pulled" so that the sender goes on to
the next bucket (`device_transfer.py`).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jgrpo.parallel.channel import Channel, ChannelClosed
from jgrpo.parallel.weights.device_transfer import DeviceTransfer, whole_on_one_device


class Piece(NamedTuple):
    leaf: int  # index in tree order
    start: int  # rows [start, stop) along the leaf's first axis (a scalar is one row)
    stop: int


def _rows(shape) -> tuple[int, int]:
    """(rows, elements per row) of a leaf cut along its first axis."""
    shape = tuple(shape) or (1,)
    return shape[0], int(np.prod(shape[1:], dtype=np.int64))


def bucket_plan(leaves, bucket_bytes: int) -> list[list[Piece]]:
    """The pieces of each bucket: leaves in order, cut along their first axis so that a bucket holds at most
    `bucket_bytes`, or one row where a row is larger (a stacked layer weight's row is one layer's matrix).
    Rows, not flat elements: no index reaches 2**31 (a stacked MoE weight has more elements than that), and a
    piece of a leaf sharded along another axis is a slice of each shard."""
    buckets, current, room = [], [], bucket_bytes
    for i, leaf in enumerate(leaves):
        rows, per_row = _rows(leaf.shape)
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


@functools.partial(jax.jit, static_argnums=2)
def _piece(x, start, size: int):
    """Rows [start, start + size) of the leaf: always a new array, taken on the device (one program per size)."""
    if x.ndim == 0:
        return x.reshape(1)  # a scalar is one row (and a new array, as every piece)
    return jax.lax.dynamic_slice_in_dim(x, start, size, axis=0)


def send_weights(channels: Sequence[Channel], params, *, version: int, bucket_bytes: int,
                 extra: dict | None = None, transfer: DeviceTransfer | None = None,
                 pulled: Callable[[Channel, int], None] | None = None, pull_timeout_s: float = 1800.0) -> dict:
    """Send `params` (a pytree of arrays, on this job's devices) as `version` to each of `channels` (those of a
    rollout job's processes this trainer process serves: none, one or several); `extra` rides on the first
    frame. Returns {"bytes" (summed over the channels), "seconds", "buckets", "peak_bucket_bytes"}; raises
    ChannelClosed once all buckets are gone if a peer went away (the others got every bucket). With several
    processes every one must call it (the gathers are collectives), also one with no channel or only closed ones:
    it gathers and sends nothing, so the others' gathers still complete.

    With `transfer` the pieces are offered device to device, once per channel (each offer lapses after
    `pull_timeout_s`), and `pulled(channel, bucket)` returns once that receiver says it has pulled the bucket (the
    caller reads the channel: other messages may come first)."""
    start = time.perf_counter()
    leaves = jax.tree.leaves(params)
    plan = bucket_plan(leaves, bucket_bytes)
    live, lost = [c for c in channels if not c.is_closed], []

    def each(action, *args) -> int:
        """`action(channel, *args)` on each live channel; one that fails is dropped (and said at the end)."""
        total = 0
        for channel in list(live):
            try:
                total += action(channel, *args) or 0
            except ChannelClosed as e:
                live.remove(channel)
                lost.append(e)
        return total

    def offer(channel: Channel, frame: dict, arrays: list) -> int:
        specs = [(list(a.shape), a.dtype.name) for a in arrays]
        channel.send("weights_bucket", {**frame, "pull": transfer.offer(arrays, pull_timeout_s), "specs": specs})
        pulled(channel, frame["bucket"])
        return sum(a.nbytes for a in arrays)

    if transfer is not None and live:
        transfer.start(live[0].local_ip)
    each(_send, "weights", {"version": version, "buckets": len(plan), "leaves": leaf_specs(params),
                            "extra": extra or {}, "pull_from": transfer.address if transfer else None})
    sent, peak = 0, 0
    for i, pieces in enumerate(plan):
        arrays = []
        for p in pieces:
            piece = _piece(leaves[p.leaf], p.start, p.stop - p.start)
            # Never np.asarray(leaf): a jax array keeps its host copy for as long as it lives (the published
            # params live until the next publish), so the host would end up holding all of them.
            arrays.append(whole_on_one_device(piece) if transfer else _on_host(piece))
        peak = max(peak, sum(a.nbytes for a in arrays))
        frame = {"version": version, "bucket": i, "pieces": [tuple(p) for p in pieces]}
        if transfer is None:
            sent += each(_send, "weights_bucket", {**frame, "arrays": arrays})
        else:  # (every process gathered its pieces above, with channels or not)
            sent += each(offer, frame, arrays)
        del arrays
    if lost:
        raise lost[0]
    return {"bytes": sent, "seconds": time.perf_counter() - start, "buckets": len(plan), "peak_bucket_bytes": peak}


def _send(channel: Channel, kind: str, body) -> int:
    return channel.send(kind, body)


def _on_host(x: jax.Array) -> np.ndarray:
    """The whole array on this host: with several processes every one gathers it (a collective over the
    sender's processes, each of which then sends it to its own peer)."""
    if x.is_fully_addressable:
        return np.asarray(x)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def _placed(x, sharding) -> jax.Array:
    """`x` (a host array, or one on a local device) laid out in `sharding`, which may span other processes'
    devices too: each process places the shards of its own devices."""
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


class WeightsRefused(ValueError):
    """The sender's params are not the ones this side expects (another model or weights dtype)."""


def receive_weights(channel: Channel, header: dict, like, shardings, *, timeout: float | None = None,
                    transfer: DeviceTransfer | None = None) -> Any:
    """The params announced by `header` (the body of a "weights" message already received) read from `channel`:
    a pytree like `like` (shapes and dtypes) laid out in `shardings` (a matching pytree). A sender that offers
    its buckets device to device (`pull_from` in the header) needs this job's `transfer`."""
    if header.get("pull_from"):
        if transfer is None:
            raise WeightsRefused("the trainer sends its weights device to device (rollout.weight_transfer: jax) and "
                                 "this job has no transfer server")
        transfer.start(channel.local_ip)
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
        if "pull" in body:
            try:
                arrays = transfer.pull(header["pull_from"], body["pull"], body["specs"], timeout)
            except (RuntimeError, TimeoutError, OSError) as e:  # a sender gone mid-pull: as a closed channel
                raise ChannelClosed(f"pulling bucket {body['bucket']} from {header['pull_from']} failed: {e}") from e
            channel.send("weights_pulled", {"version": header["version"], "bucket": body["bucket"]})
        else:
            arrays = body["arrays"]
        for (leaf, start, stop), array in zip(body["pieces"], arrays, strict=True):
            shape = tuple(leaves[leaf].shape)
            rows, per_row = _rows(shape)
            if array.size != (stop - start) * per_row:
                raise ChannelClosed(f"leaf {leaf}: rows {start}-{stop} came with {array.size} elements")
            if start == 0 and stop == rows:
                done[leaf] = _placed(array.reshape(shape), targets[leaf])
                continue
            parts.setdefault(leaf, []).append(jax.device_put(array))  # on the device until the leaf is whole
            if stop == rows:
                done[leaf] = _placed(jnp.concatenate(parts.pop(leaf)), targets[leaf])
    missing = [i for i, x in enumerate(done) if x is None]
    if missing:
        raise ChannelClosed(f"the trainer's weights arrived without leaves {missing[:5]}")
    return jax.tree.unflatten(treedef, done)
