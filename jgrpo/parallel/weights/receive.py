"""The rollout job's side of the weights between two jobs: a version announced by the trainer's "weights" header,
read bucket by bucket, built beside the version that samples, answered ("weights_applied": applied or not, and
for changes this process's part of the fingerprint), and handed over whole only once the trainer's verdict says
it is the one (`send.py` has the protocol).

A whole copy is laid out piece by piece as it arrives (`buckets.LeafAssembly`). Changes start from the version held
(`header["base"]`, which must be the one this side holds: else they are read, dropped, and answered "not
applied"), set in the spares of the leaves they touch (`changes.Spares`); the leaves that did not change are the
very arrays of the version before (no copy). The fingerprint parts are kept per leaf across publishes and moved by
each publish's changes; the first publish of changes after a whole copy computes them in full.

Nothing here is a collective of the rollout job: its producer thread runs the job's programs meanwhile, in an
order this thread cannot share.
"""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

import jax

from jgrpo.parallel.channel import Channel, ChannelClosed
from jgrpo.parallel.fingerprint import held_fingerprint
from jgrpo.parallel.weights.buckets import LeafAssembly, Piece, WeightsRefused, check_specs, leaf_specs
from jgrpo.parallel.weights.changes import Changes, Spares
from jgrpo.parallel.weights.device_transfer import DeviceTransfer

log = logging.getLogger(__name__)


class Held(NamedTuple):
    params: Any  # the version that samples, laid out in the receiver's shardings
    version: int
    parts: list[int] | None  # this process's part of each leaf's fingerprint; None until changes need them


class WeightReceiver:
    """`receive(channel, header)`: the version the header announces, or None when the trainer found it wrong (a
    whole copy of it follows). `like`: the sampler copy's shapes and dtypes; `shardings`: a matching pytree."""

    def __init__(self, like, shardings, *, transfer: DeviceTransfer | None = None):
        self.expected = leaf_specs(like)
        self.like_leaves, self.treedef = jax.tree.flatten(like)
        self.shardings = jax.tree.leaves(shardings)
        self.transfer = transfer
        self.held: Held | None = None  # the last version the trainer confirmed
        self.spares = Spares()
        self.refused = 0  # versions the trainer found wrong here (each followed by a whole copy)
        self._changed: list[int] = []  # the leaves the last version rebuilt (their spares are due)

    def forget(self) -> None:
        """A new trainer (or this job's new connection): what is held is no base for its changes."""
        self.held = None
        self.spares.clear()

    def receive(self, channel: Channel, header: dict, timeout: float | None = None):
        if header.get("pull_from"):
            if self.transfer is None:
                raise WeightsRefused("the trainer sends its weights device to device (rollout.weight_transfer: jax) "
                                     "and this job has no transfer server")
            self.transfer.start(channel.local_ip)
        check_specs(self.expected, header["leaves"])
        base = header.get("base")
        applies = base is None or (self.held is not None and self.held.version == base)
        if not applies:
            log.warning("the trainer sent the changes since version %s, this job holds %s: a whole copy follows",
                        base, None if self.held is None else self.held.version)
        leaves, parts = self._build(channel, header, timeout, applies)
        channel.send("weights_applied", {"version": header["version"], "applied": applies, "parts": parts})
        kind, verdict = channel.recv(timeout)
        if kind != "weights_verdict" or verdict["version"] != header["version"]:
            raise ChannelClosed(f"expected the trainer's verdict on version {header['version']}, got a {kind!r}")
        if not verdict["ok"]:
            self.refused += 1
            self.spares.clear()  # (some were written with the refused changes)
            return None
        params = jax.tree.unflatten(self.treedef, leaves)
        self.held = Held(params, header["version"], parts)
        return params

    def refill_spares(self) -> None:
        """Copy the held version's changed leaves into spares for the next changes: call it after the version
        went to the sampler, outside the trainer's wait (a no-op until changes come)."""
        if self.held is not None and self.held.parts is not None:
            leaves = jax.tree.leaves(self.held.params)
            self.spares.refill({i: leaves[i] for i in self._changed})
            self._changed = []

    def _build(self, channel: Channel, header: dict, timeout, applies: bool) -> tuple[list, list[int] | None]:
        """Read every bucket; (the new version's leaves, this process's fingerprint parts: None for a whole copy)."""
        whole = header.get("base") is None
        pieces = LeafAssembly(self.like_leaves, self.shardings)
        changes: dict[int, list[Changes]] = {}
        while True:
            kind, body = channel.recv(timeout)
            if kind != "weights_bucket" or body["version"] != header["version"]:
                raise ChannelClosed(f"expected bucket of version {header['version']}, got a {kind!r} message")
            arrays = self._arrays(channel, header, body, timeout)
            if applies:
                for piece, array in zip(body["pieces"], arrays, strict=True):
                    try:
                        pieces.add(Piece(*piece), array)
                    except ValueError as e:
                        raise ChannelClosed(str(e)) from None
                for leaf, indices, values in zip(body["changed"], body["indices"], body["values"], strict=True):
                    changes.setdefault(leaf, []).append(Changes(indices, values, 0))
            if body["last"]:
                break
        if not applies:
            return [], None
        if whole:
            missing = [i for i in range(len(self.like_leaves)) if i not in pieces.done]
            if missing:
                raise ChannelClosed(f"the trainer's weights arrived without leaves {missing[:5]}")
            self.spares.clear()
            return [pieces.done[i] for i in range(len(self.like_leaves))], None
        before = jax.tree.leaves(self.held.params)
        parts = list(self.held.parts) if self.held.parts is not None else held_fingerprint(before)
        leaves = list(before)
        for i, found in changes.items():
            leaves[i], change = self.spares.apply(i, before[i], found)
            parts[i] = (parts[i] + change) % 2**32
        for i, leaf in pieces.done.items():  # leaves that came whole (their changes would not be smaller)
            leaves[i] = leaf
            parts[i] = held_fingerprint([leaf])[0]
        self._changed = sorted(set(changes) | set(pieces.done))
        return leaves, parts

    def _arrays(self, channel: Channel, header: dict, body: dict, timeout) -> list:
        """A bucket's whole pieces: in the frame, or pulled device to device (then "weights_pulled" is answered)."""
        if "pull" not in body:
            return body["arrays"]
        try:
            arrays = self.transfer.pull(header["pull_from"], body["pull"], body["specs"], timeout)
        except (RuntimeError, TimeoutError, OSError) as e:  # a sender gone mid-pull: as a closed channel
            raise ChannelClosed(f"pulling bucket {body['bucket']} from {header['pull_from']} failed: {e}") from e
        channel.send("weights_pulled", {"version": header["version"], "bucket": body["bucket"]})
        return arrays
