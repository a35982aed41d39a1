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

import jax

from jgrpo.rollout.records import Rollout

log = logging.getLogger(__name__)

AGREE_POLL_S = 0.5  # several processes: how often process 0 tells the others it is still waiting


class Produced(NamedTuple):
    rollout: Rollout  # the batch, sampled and scored
    version: int  # the iteration count of the params that sampled it
    index: int  # j: the batch's place in the order drawn (its key is fold_in(sample_root, j))
    data_state: dict  # the prompt iterator's state right after this batch


class Intake:
    """The trainer's side of batches sampled elsewhere (a producer thread here, or a rollout job over a channel):
    taken in order, each judged against the staleness bound, too stale ones dropped and counted. Subclasses give
    `_next` (the next batch, blocking) and `_count_drop` (a drop the sampling side must hear of)."""

    def __init__(self, *, max_staleness: int, first_index: int, dropped: int):
        self.max_staleness = max_staleness
        self.taken = first_index  # batches the trainer took, trained or dropped
        self.taken_data_state = None  # the prompt iterator's state after the last of them
        self.dropped = dropped  # batches dropped as too stale, over the run (checkpointed)
        self.staleness_counts: collections.Counter = collections.Counter()  # staleness -> batches trained

    def _next(self) -> tuple[Produced | BaseException, int, float]:
        """(the next batch or the error that ended its sampling, batches queued before it, sampler idle seconds)."""
        raise NotImplementedError

    def _count_drop(self) -> None:
        self.dropped += 1

    def take(self, iteration: int) -> tuple[Produced, dict]:
        """The next batch for iteration `iteration` (blocks until sampled) and the rollout metrics."""
        start, idle = time.perf_counter(), 0.0
        while True:
            item, depth, idle_before = self._next()
            idle += idle_before
            if isinstance(item, BaseException):
                raise item
            self.taken, self.taken_data_state = item.index + 1, item.data_state
            staleness = iteration - item.version
            if staleness <= self.max_staleness:
                break
            self._count_drop()
            log.warning("iteration %d: dropped a batch sampled by version %d (%d iterations stale > "
                        "rollout.max_staleness=%d)", iteration + 1, item.version, staleness, self.max_staleness)
        self.staleness_counts[staleness] += 1
        metrics = {"rollout/staleness": float(staleness), "rollout/queue_depth": float(depth),
                   "rollout/producer_idle": idle, "rollout/trainer_wait": time.perf_counter() - start,
                   "rollout/dropped": float(self.dropped)}
        return item, metrics

    def histogram(self) -> str:
        """'staleness: batches' over this process's run, e.g. '0: 3, 1: 57'."""
        return ", ".join(f"{s}: {n}" for s, n in sorted(self.staleness_counts.items()))


class AsyncRollouts(Intake):
    """The producer thread and its queue. `publish` before the first `take`; `close` when done."""

    def __init__(self, source, *, max_staleness: int, first_index: int, dropped: int, prompt_width: int,
                 agree=None):
        super().__init__(max_staleness=max_staleness, first_index=first_index, dropped=dropped)
        self.source = source
        # A rollout job of several processes: they must sample the same batch with the same version, so process 0
        # decides and `agree` (host_arrays.broadcast_json) hands its decision to the others, which keep each
        # published version until a decision has passed it.
        self._agree, self._leads = agree, agree is None or jax.process_index() == 0
        self._recent: dict = {}  # followers: version -> params
        self._next_index = first_index  # the index of the next batch to draw
        self.idle_seconds = 0.0  # the producer's waits for a newer publish since the last `take`
        self._queue: collections.deque = collections.deque()
        self._cond = threading.Condition()
        self._params, self._version = None, -1
        self._stopping = False
        self._width = types.SimpleNamespace(prompt_width=prompt_width)  # the producer's own padded width
        self._thread = threading.Thread(target=self._produce, name="jgrpo-rollouts", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ trainer side

    def publish(self, params, version: int, dropped: int | None = None) -> None:
        """Newer params for the producer (a copy the trainer never donates); the older ones are released.
        `dropped`: the batches the trainer dropped so far, where it is not this object (a rollout job's)."""
        with self._cond:
            self._params, self._version = params, version
            if not self._leads:
                self._recent[version] = params
            if dropped is not None:
                self.dropped = dropped
            self._cond.notify_all()

    def _next(self):
        with self._cond:
            while not self._queue:
                self._cond.wait()
            depth = len(self._queue)
            item = self._queue.popleft()
            idle, self.idle_seconds = self.idle_seconds, 0.0
            self._cond.notify_all()
        return item, depth, idle

    def next_sampled(self, timeout: float | None = None):
        """A rollout job's forwarding: the next batch as queued (no staleness judged: the trainer does that), or
        None after `timeout` seconds; (item, queued behind it, idle seconds)."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._queue, timeout):
                return None
        return self._next()

    @property
    def drawn(self) -> int:
        """The index after the last batch drawn from the data (sampled, or being sampled)."""
        with self._cond:
            return self._next_index

    def _count_drop(self) -> None:
        with self._cond:
            self.dropped += 1
            self._cond.notify_all()

    def close(self) -> None:
        """Stop the producer (after the batch it is sampling, if any) and wait for it."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join()

    # ------------------------------------------------------------------ producer side

    def _may_sample(self) -> bool:
        """The next batch would be trained at iteration next - dropped: sample it only with fresh enough params."""
        return self._params is not None and self._next_index - self.dropped - self._version <= self.max_staleness

    def _decide(self):
        """(params, version, index) of the next batch to sample, or None to stop: the newest params once fresh
        enough. With several processes process 0 decides and the others follow; while it waits it says "not
        yet" every AGREE_POLL_S (no collective waits longer), and a follower waits to have the version chosen."""
        while True:
            decision, params = None, None  # None: not yet (only with several processes)
            if self._leads:
                with self._cond:
                    waited = time.perf_counter()
                    ready = self._cond.wait_for(lambda: self._stopping or self._may_sample(),
                                                AGREE_POLL_S if self._agree is not None else None)
                    self.idle_seconds += time.perf_counter() - waited
                    if self._stopping:
                        decision = "stop"
                    elif ready:
                        decision, params = [self._version, self.dropped], self._params
            if self._agree is not None:
                decision = self._agree(decision)
            if decision is not None:
                break
        if decision == "stop":
            return None
        version, dropped = decision
        with self._cond:
            if not self._leads:
                # The trainer sends every version to every process at the same publish: it is on its way.
                self._cond.wait_for(lambda: version in self._recent)
                params, self.dropped = self._recent[version], dropped
                self._recent = {v: p for v, p in self._recent.items() if v >= version}
            index = self._next_index
            self._next_index += 1
        return params, version, index

    def _produce(self) -> None:
        while True:
            decided = self._decide()
            if decided is None:
                return
            params, version, index = decided
            del decided
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
