"""The trainer's side of batches sampled elsewhere (`Intake`): a producer thread in this job
(`async_producer.AsyncRollouts`, `in_flight.InFlightRollouts`) or a rollout job over a channel (`remote`). Batches
are taken in order, each judged against the staleness bound: a batch whose oldest token was drawn by params more
than `rollout.max_staleness` iterations older than those it would train is dropped and counted.
"""

from __future__ import annotations

import collections
import logging
import time
from typing import NamedTuple

from jgrpo.rollout.records import Rollout

log = logging.getLogger(__name__)


class Produced(NamedTuple):
    rollout: Rollout  # the batch, sampled and scored
    version: int  # the iteration count of the params that sampled it (in flight: that drew its oldest token)
    index: int  # j: the batch's place in the order drawn (its key is fold_in(sample_root, j))
    data_state: dict  # the prompt iterator's state right after this batch
    metrics: dict | None = None  # rollout/* the producer measured while sampling it (versions per row, slots used)


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
        metrics = {**(item.metrics or {}), "rollout/staleness": float(staleness), "rollout/queue_depth": float(depth),
                   "rollout/producer_idle": idle, "rollout/trainer_wait": time.perf_counter() - start,
                   "rollout/dropped": float(self.dropped)}
        return item, metrics
    def histogram(self) -> str:
        """'staleness: batches' over this process's run, e.g. '0: 3, 1: 57'."""
        return ", ".join(f"{s}: {n}" for s, n in sorted(self.staleness_counts.items()))
