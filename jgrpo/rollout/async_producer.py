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

import jax

from jgrpo.parallel.host_arrays import local_rows
from jgrpo.rollout.intake import Intake, Produced
from jgrpo.rollout.slot_metrics import generate_utilization, versions_per_row

log = logging.getLogger(__name__)

AGREE_POLL_S = 0.5  # several processes: how often process 0 tells the others it is still waiting


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

    def _metrics(self, rollout, prompts) -> dict:
        """rollout/versions_per_row and slot_utilization of a batch sampled to its end with one version."""
        samples, sampler = rollout.samples, self.source.sampler
        plan = sampler.spec(*prompts.tokens.shape, sampler.cfg).plan if sampler.cfg is not None else None
        lengths = local_rows(samples.lengths)
        slots, queues = (plan.slots, plan.queues) if plan is not None else (sampler.slots or len(lengths), 1)
        return {**versions_per_row(local_rows(samples.version), local_rows(samples.loss_mask)),
                "rollout/slot_utilization": generate_utilization(lengths, slots, queues)}

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
                rollout = self.source.sample(params, batch, prompts, self.source.sample_key(index), version)
                item = Produced(rollout, version, index, data_state, self._metrics(rollout, prompts))
            except BaseException as e:  # noqa: BLE001 - handed to the trainer, which raises it (DataExhausted too)
                item = e
            del params
            with self._cond:
                self._queue.append(item)
                self._cond.notify_all()
            if isinstance(item, BaseException):
                return
