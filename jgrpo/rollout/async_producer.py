"""Bounded-staleness asynchronous rollouts (`rollout.mode: async`): a producer thread samples while the trainer trains.

The trainer publishes a copy of its params every `rollout.publish_every` iterations (`publish(params, version)`,
the version being the number of iterations those params have trained: pi_k has version k). The producer thread
takes the next prompt batch from the data, samples and scores it with the newest published params and queues
it with that version; the trainer takes the queued batches in order (`take`). A batch trained at iteration k
that version p sampled is k - p iterations stale, and the loss corrects for it like any off-policy batch
(its recorded lp_alpha, `grpo.off_policy_ratio`; `recentred` is AReaL's decoupled objective with pi_k as the
proximal policy).

Staleness is bounded at the source, as AReaL does: the producer samples the batch that iteration k will train
only with a version p >= k - max_staleness, and otherwise waits for a newer publish (that wait is its idle
time). A batch that is staler anyway when taken is dropped and counted. With max_staleness = 0 the producer
waits for every publish: exactly sync at v = 1 (the same keys, so the same tokens; tested).

Keys: the j-th batch drawn samples with `fold_in(sample_root, j)`, the key sync gives iteration j.

Resume: a checkpoint keeps the data iterator's state after the last batch the trainer took and the count of
batches taken (`RunCounters.batches_drawn`). Batches in the queue or being sampled are not checkpointed: they
are regenerated, i.e. a resumed run draws the same prompts again and samples them with the same keys from the
restored params. No batch the trainer accepted is lost or trained twice.

Where the producer's programs run: on shared devices they interleave with the trainer's (a GPU or TPU runs one
program at a time; XLA CPU shares one thread pool), so the overlap is of host work only (decoding, scoring,
dispatch). Sampling and training overlap for real with `mesh.rollout_devices` (disjoint sub-meshes).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
import types
from typing import NamedTuple

from jgrpo.rollout.records import Rollout

log = logging.getLogger(__name__)


class Produced(NamedTuple):
    rollout: Rollout  # the batch, sampled and scored
    version: int  # the iteration count of the params that sampled it
    index: int  # j: the batch's place in the order drawn (its key is fold_in(sample_root, j))
    data_state: dict  # the prompt iterator's state right after this batch


class AsyncRollouts:
    """The producer thread and its queue. `publish` before the first `take`; `close` when done."""

    def __init__(self, source, *, max_staleness: int, first_index: int, dropped: int, prompt_width: int):
        self.source, self.max_staleness = source, max_staleness
        self._next = first_index  # the index of the next batch to draw
        self.taken = first_index  # batches the trainer took from the queue, trained or dropped
        self.taken_data_state = None  # the prompt iterator's state after the last of them
        self.dropped = dropped  # batches dropped as too stale, over the run (checkpointed)
        self.staleness_counts: collections.Counter = collections.Counter()  # staleness -> batches trained
        self.idle_seconds = 0.0  # the producer's waits for a newer publish since the last `take`
        self._queue: collections.deque = collections.deque()
        self._cond = threading.Condition()
        self._params, self._version = None, -1
        self._stopping = False
        self._width = types.SimpleNamespace(prompt_width=prompt_width)  # the producer's own padded width
        self._thread = threading.Thread(target=self._produce, name="jgrpo-rollouts", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ trainer side

    def publish(self, params, version: int) -> None:
        """Newer params for the producer (a copy the trainer never donates); the older ones are released."""
        with self._cond:
            self._params, self._version = params, version
            self._cond.notify_all()

    def take(self, iteration: int) -> tuple[Produced, dict]:
        """The next batch for iteration `iteration` (blocks until sampled) and the rollout metrics."""
        start = time.perf_counter()
        while True:
            with self._cond:
                while not self._queue:
                    self._cond.wait()
                depth = len(self._queue)
                item = self._queue.popleft()
                self._cond.notify_all()
            if isinstance(item, BaseException):
                raise item
            self.taken, self.taken_data_state = item.index + 1, item.data_state
            staleness = iteration - item.version
            if staleness <= self.max_staleness:
                break
            with self._cond:
                self.dropped += 1
                self._cond.notify_all()
            log.warning("iteration %d: dropped a batch sampled by version %d (%d iterations stale > "
                        "rollout.max_staleness=%d)", iteration + 1, item.version, staleness, self.max_staleness)
        self.staleness_counts[staleness] += 1
        with self._cond:
            idle, self.idle_seconds = self.idle_seconds, 0.0
        metrics = {"rollout/staleness": float(staleness), "rollout/queue_depth": float(depth),
                   "rollout/producer_idle": idle, "rollout/trainer_wait": time.perf_counter() - start,
                   "rollout/dropped": float(self.dropped)}
        return item, metrics

    def histogram(self) -> str:
        """'staleness: batches' over this process's run, e.g. '0: 3, 1: 57'."""
        return ", ".join(f"{s}: {n}" for s, n in sorted(self.staleness_counts.items()))

    def close(self) -> None:
        """Stop the producer (after the batch it is sampling, if any) and wait for it."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join()

    # ------------------------------------------------------------------ producer side

    def _may_sample(self) -> bool:
        """The next batch would be trained at iteration next - dropped: sample it only with fresh enough params."""
        return self._params is not None and self._next - self.dropped - self._version <= self.max_staleness

    def _produce(self) -> None:
        while True:
            with self._cond:
                waited = time.perf_counter()
                while not self._stopping and not self._may_sample():
                    self._cond.wait()
                self.idle_seconds += time.perf_counter() - waited
                if self._stopping:
                    return
                params, version, index = self._params, self._version, self._next
                self._next += 1
            try:
                batch = self.source.next_batch(index)
                data_state = self.source.data.get_state()
                prompts = self.source.prompt_arrays(batch, self._width)
                item = Produced(self.source.sample(params, batch, prompts, self.source.sample_key(index), version),
                                version, index, data_state)
            except BaseException as e:  # noqa: BLE001 - handed to the trainer, which raises it (DataExhausted too)
                item = e
            del params
            with self._cond:
                self._queue.append(item)
                self._cond.notify_all()
            if isinstance(item, BaseException):
                return
