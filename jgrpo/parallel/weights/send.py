"""The trainer's side of the weights between two jobs: each published version to the rollout processes a trainer
process serves, whole or as its changes since the version they hold, then checked.

A publish is a header ("weights": the version, the version its changes apply to or none, the leaves, what to pull
from with `rollout.weight_transfer: jax`), buckets ("weights_bucket", the last one marked) and an answer from
every rollout process ("weights_applied"), then the trainer's verdict ("weights_verdict").

- Whole: every leaf's rows, cut into buckets (`buckets.py`). Bucket k + 1 is read off the devices (its
  device-to-host copies started) before bucket k is sent: the host holds two buckets, the receiver two more (the
  one its reader fills, the one it places).
- Changes (`rollout.weight_delta`, after a whole copy the rollout job confirmed): leaf by leaf, the elements whose
  bits changed (`changes.py`), in chunks of at most a bucket; a leaf whose changes would not be smaller enough
  than itself goes whole (`always`: not smaller; `auto`: more than AUTO_MAX_BYTES_FRACTION of it).

The check: the fingerprint (`parallel/fingerprint.py`) of the version the rollout job now holds must be the
trainer's. Both sides keep each leaf's fingerprint and add the change of every publish of changes to it (sums over
the changes only); the first publish of changes after a whole copy computes it in full on both sides, which checks
the whole copy too. Each rollout process answers its part (the blocks it holds, `held_fingerprint`), the trainer
processes add them up (a small collective of their job). A mismatch (a change lost or corrupted on the way, a
rollout job holding another version) is counted and healed at once by a whole copy of the same version.

With several processes every trainer process calls `publish` (gathers, the device path of changes and the sums are
collectives of its job), also one with no live channel: it computes and sends nothing, so the others' collectives
complete. Every decision is made from figures all processes hold alike.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import numpy as np

from jgrpo.parallel.channel import Channel, ChannelClosed
from jgrpo.parallel.fingerprint import fingerprint, held_fingerprint
from jgrpo.parallel.host_arrays import global_sum
from jgrpo.parallel.weights.buckets import Piece, aliases_host, bucket_plan, leaf_specs, read_piece, start_host_copy
from jgrpo.parallel.weights.buckets import whole_on_one_device as on_first_device
from jgrpo.parallel.weights.changes import leaf_changes
from jgrpo.parallel.weights.choice import MeasuredChoice
from jgrpo.parallel.weights.device_transfer import DeviceTransfer

log = logging.getLogger(__name__)

# rollout.weight_delta auto: a leaf goes as its changes while they take at most this fraction of its bytes (each
# change is an int32 index and a value: bfloat16 changes pay below a third of the elements changed).
AUTO_MAX_BYTES_FRACTION = 0.5


class WeightsDiverged(RuntimeError):
    """The rollout job's weights differ from the trainer's even after a whole copy: not a lost change."""


class Base(NamedTuple):
    """The version the rollout job holds, as the trainer sent it: the base of the next changes."""

    params: object
    version: int
    fingerprints: list[int] | None  # per leaf; None until a publish of changes computes them


class WeightSender:
    """What a trainer process knows of the rollout job's weights across publishes, and how it sends one.
    `answer(channel, kind, version, bucket)` returns the body of the next message of `kind` for `version` (and
    `bucket`) from `channel` (the caller's read loop, which keeps what else arrives meanwhile) or raises
    ChannelClosed."""

    def __init__(self, *, bucket_bytes: int, delta: str = "never", transfer: DeviceTransfer | None = None,
                 answer: Callable[[Channel, str, int, int | None], dict] | None = None, pull_timeout_s: float = 1800.0):
        if delta not in ("never", "always", "auto"):
            raise ValueError(f"delta={delta!r}: never, always or auto")
        self.bucket_bytes, self.delta, self.transfer = bucket_bytes, delta, transfer
        self.answer, self.pull_timeout_s = answer, pull_timeout_s
        self.base: Base | None = None  # None: the next publish is whole
        self.mismatches = 0  # publishes the rollout job's fingerprint did not match (each healed by a whole copy)
        self.whole_copies = 0
        self.choice = MeasuredChoice()  # rollout.weight_delta auto

    def forget(self) -> None:
        """A new or restarted rollout job: it holds nothing, the next publish is whole."""
        self.base = None

    def publish(self, channels: Sequence[Channel], params, version: int, *, rollouts: int, extra: dict | None = None,
                tamper: Callable[[dict], None] | None = None) -> dict:
        """Send `version` of `params` (the sampler's copy, on this job's devices, never donated) to `channels` and
        check that the `rollouts` processes of the rollout job hold it. Returns {"bytes" (summed over the
        channels), "seconds", "buckets", "peak_bucket_bytes", "kind" ("whole" or "changes"), "changed_fraction"
        (None for a whole copy), "verified" (False: no answer from every rollout process)}. `tamper(bucket body)`:
        a test's hook on every bucket before it goes."""
        start = time.perf_counter()
        if self.delta == "never" or self.base is None:
            kind = "whole"
        else:
            kind = self.choice.next() if self.delta == "auto" else "changes"
        stats = self._send(channels, params, version, kind, extra, tamper)
        verdict = self._verdict(channels, version, stats.pop("expected"), rollouts)
        if verdict is False:
            self.mismatches += 1
            log.warning("two jobs: the rollout job's weights of version %d differ from the trainer's (after %s): "
                        "sending them whole", version, kind)
            again = self._send(channels, params, version, "whole", extra, tamper)
            if self._verdict(channels, version, again.pop("expected"), rollouts) is False:
                raise WeightsDiverged(f"the rollout job refused the whole copy of version {version}")
            stats = {**again, "bytes": stats["bytes"] + again["bytes"], "changed_fraction": stats["changed_fraction"],
                     "healed": True}
            kind, verdict = "whole", True
        self.whole_copies += kind == "whole"
        fingerprints = stats.pop("fingerprints")
        self.base = Base(params, version, fingerprints) if verdict else None
        seconds = time.perf_counter() - start
        if self.delta == "auto" and verdict and not stats.pop("healed", False):  # (all processes alike)
            self.choice.record(kind, seconds)
        return {**stats, "seconds": seconds, "kind": kind, "verified": bool(verdict)}

    # ------------------------------------------------------------------ sending

    def _send(self, channels, params, version: int, kind: str, extra, tamper) -> dict:
        leaves = jax.tree.leaves(params)
        live = [c for c in channels if not c.is_closed]
        device_to_device = self.transfer is not None and kind == "whole"
        if device_to_device and live:
            self.transfer.start(live[0].local_ip)
        _each(live, "weights", {"version": version, "base": self.base.version if kind == "changes" else None,
                                "leaves": leaf_specs(params), "extra": extra or {},
                                "pull_from": self.transfer.address if device_to_device else None})
        stream = _Stream(self, live, version, tamper, device_to_device)
        if kind == "whole":
            stream.whole(leaves)
            expected = fingerprints = None
        else:
            fingerprints = self.base.fingerprints or _fingerprints(jax.tree.leaves(self.base.params))
            expected = stream.changes(leaves, jax.tree.leaves(self.base.params), fingerprints)
            fingerprints = expected
        stream.finish()
        changed = None if kind == "whole" else stream.changed / max(1, sum(x.size for x in leaves))
        return {"bytes": stream.sent, "buckets": stream.buckets, "peak_bucket_bytes": stream.peak,
                "changed_fraction": changed, "expected": expected, "fingerprints": fingerprints}

    def _offer(self, channel: Channel, frame: dict) -> int:
        arrays = frame["arrays"]
        specs = [(list(a.shape), a.dtype.name) for a in arrays]
        size = channel.send("weights_bucket", {**frame, "arrays": [], "pull": self.transfer.offer(
            arrays, self.pull_timeout_s), "specs": specs})
        self.answer(channel, "weights_pulled", frame["version"], frame["bucket"])
        return size + sum(a.nbytes for a in arrays)

    # ------------------------------------------------------------------ checking

    def _verdict(self, channels, version: int, expected: list[int] | None, rollouts: int) -> bool | None:
        """True when every rollout process applied the version (and, for changes, their fingerprint parts add up
        to `expected`), False when one could not or the sum differs, None when one did not answer (gone: it gets a
        whole copy when it is back). Every trainer process takes part."""
        width = len(expected) if expected is not None else 0
        held, answered, refused, live = np.zeros(width, np.int64), 0, 0, []
        for channel in channels:
            if channel.is_closed:
                continue
            try:
                body = self.answer(channel, "weights_applied", version, None)
            except ChannelClosed:
                continue
            live.append(channel)
            answered += 1
            if not body["applied"]:  # it could not apply them (it holds another version than their base)
                refused += 1
            elif expected is not None:
                held = (held + np.asarray(body["parts"], np.int64)) % 2**32
        total = global_sum(np.asarray([answered, refused, *held.tolist()], np.int64))
        if total[0] == 0 or total[0] != rollouts:
            verdict = None
        else:
            verdict = bool(total[1] == 0 and (expected is None or (total[2:] % 2**32 == np.asarray(expected)).all()))
        for channel in live:
            try:
                channel.send("weights_verdict", {"version": version, "ok": bool(verdict)})
            except ChannelClosed:
                pass
        return verdict


class _Stream:
    """The buckets of one publish as they fill: items are added, a full bucket goes out (`send`)."""

    def __init__(self, sender: WeightSender, live: list[Channel], version: int, tamper, device_to_device: bool):
        self.sender, self.live, self.version, self.tamper = sender, live, version, tamper
        self.device_to_device = device_to_device
        self.sent = self.buckets = self.peak = self.changed = 0
        self._frame = self._empty()

    def _empty(self) -> dict:
        return {"version": self.version, "bucket": 0, "pieces": [], "arrays": [], "changed": [], "indices": [],
                "values": [], "last": False, "room": self.sender.bucket_bytes}

    def whole(self, leaves) -> None:
        """Every leaf's rows, bucket k + 1 read off the devices while bucket k goes."""
        alias = aliases_host(leaves) and not self.device_to_device  # (pulled device to device: device arrays)
        plan = bucket_plan(leaves, self.sender.bucket_bytes)
        ahead = self._read(leaves, plan[0], alias) if plan else None
        for i in range(len(plan)):
            parts, ahead = ahead, self._read(leaves, plan[i + 1], alias) if i + 1 < len(plan) else None
            for piece, array in parts:
                self._frame["pieces"].append(list(piece))
                self._frame["arrays"].append(array if self.device_to_device else np.asarray(array))
            if i + 1 < len(plan):
                self.send()
            del parts

    def _read(self, leaves, pieces: list[Piece], alias: bool) -> list[tuple[Piece, jax.Array]]:
        parts = [part for p in pieces for part in read_piece(leaves[p.leaf], p, alias=alias)]
        if self.device_to_device:
            return [(piece, on_first_device(array)) for piece, array in parts]
        if not alias:  # (on CPU the host view is the buffer itself: nothing to copy)
            start_host_copy([array for _, array in parts])
        return parts

    def changes(self, leaves, base_leaves, fingerprints: list[int]) -> list[int]:
        """Leaf by leaf, what changed since the base; returns the new version's fingerprints."""
        out = list(fingerprints)
        limit = 1.0 if self.sender.delta == "always" else AUTO_MAX_BYTES_FRACTION
        for i, (new, old) in enumerate(zip(leaves, base_leaves, strict=True)):
            found = leaf_changes(new, old)
            n = len(found.indices)
            if not n:
                continue
            self.changed += n
            out[i] = (out[i] + found.fingerprint) % 2**32
            entry = found.indices.dtype.itemsize + np.dtype(new.dtype).itemsize
            if new.ndim == 0 or n * entry > limit * new.nbytes:  # no smaller as changes: the leaf's rows
                for bucket in bucket_plan([new], self.sender.bucket_bytes):
                    for piece in bucket:
                        self._add_rows(Piece(i, piece.start, piece.stop), new)
                continue
            per_bucket = max(1, self.sender.bucket_bytes // entry)
            for first in range(0, n, per_bucket):
                if self._frame["room"] < min(n - first, per_bucket) * entry and self._frame["changed"] + \
                        self._frame["pieces"]:
                    self.send()
                last = min(n, first + per_bucket)
                self._frame["changed"].append(i)
                self._frame["indices"].append(found.indices[first:last])
                self._frame["values"].append(found.values[first:last])
                self._frame["room"] -= (last - first) * entry
        return out

    def _add_rows(self, piece: Piece, leaf) -> None:
        size = (piece.stop - piece.start) * (leaf.nbytes // max(1, leaf.shape[0] if leaf.ndim else 1))
        if self._frame["room"] < size and self._frame["changed"] + self._frame["pieces"]:
            self.send()
        for part, array in read_piece(leaf, piece, alias=aliases_host([leaf])):
            self._frame["pieces"].append([piece.leaf, part.start, part.stop])
            self._frame["arrays"].append(np.asarray(array))
        self._frame["room"] -= size

    def send(self, last: bool = False) -> None:
        frame, self._frame = self._frame, self._empty()
        frame.pop("room")
        frame.update(bucket=self.buckets, last=last)
        self.buckets += 1
        self.peak = max(self.peak, sum(a.nbytes for key in ("arrays", "indices", "values") for a in frame[key]))
        if self.tamper is not None:
            self.tamper(frame)
        if self.device_to_device and frame["arrays"]:  # (every process gathered its pieces, with channels or not)
            self.sent += _each(self.live, self.sender._offer, frame)
        else:
            self.sent += _each(self.live, "weights_bucket", frame)

    def finish(self) -> None:
        self.send(last=True)


def _fingerprints(leaves) -> list[int]:
    """Each leaf's fingerprint: from this process's blocks where it holds every leaf whole (no collective), else
    over the job (a collective)."""
    if all(x.is_fully_addressable for x in leaves):
        return held_fingerprint(leaves)
    return fingerprint(leaves)


def _each(live: list[Channel], what, body) -> int:
    """Send `body` as `what` (a kind, or a function of the channel and body) to each live channel; one that fails
    is dropped from `live` (the caller goes on with the others)."""
    total = 0
    for channel in list(live):
        try:
            total += what(channel, body) if callable(what) else channel.send(what, body)
        except ChannelClosed as e:
            live.remove(channel)
            log.warning("two jobs: a rollout process is gone (%s); it gets the weights when it is back", e)
    return total
