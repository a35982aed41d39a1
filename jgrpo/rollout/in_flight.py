"""Rollouts that never drain (`rollout.weight_updates: in_flight`): one pool of slots keeps decoding across batch
boundaries and weight updates, and hands the trainer each batch when its last row is done.

The producer thread drives a stream (`jgrpo.sampling.stream`): lanes of B prompts, a slot whose row stops taking
the oldest batch's next waiting row. Between two decode chunks (`sampler.decode_chunk` steps) it

1. takes the version the schedule puts in effect (below), waiting for it if the trainer has not published it yet;
2. fills free lanes with the next batches the staleness bound allows: batch j (trained at iteration j - dropped)
   starts only with a version v >= j - dropped - max_staleness, so no token of it is staler than the bound;
3. decodes one chunk with that version's params (the keys/values computed before stay: PipelineRL's choice; every
   token records the version that drew it and its log-prob, which the loss takes as the behaviour policy's);
4. reads which rows completed (one flag per row); a batch whose rows are all done is read off the devices, scored
   and queued for the trainer in batch order (a batch that completes before an older one waits for it).

The schedule. Version k takes effect at the first chunk boundary at which the batches of iterations
0 .. k - 1 + lag are complete (lag = `rollout.in_flight_lag`; with `publish_every` p, versions are the multiples
of p), one version per boundary (when a chunk completes two batches, the next version waits for the next
boundary: every version is in effect for at least a chunk). Every input of that rule is the sampler's own
progress, so the same config gives the same tokens whatever the timing of the trainer, the network or the reward
functions (tested with injected delays): a late version makes the sampler wait at its boundary, as a slow
environment does under `env.resume_after`; an early one waits for its boundary. The trainer has had the batches
version k trains on since `lag` batches before the boundary: that is its time to train before the sampler waits.
Lanes: max_staleness - lag + 1, the most batches step 2 ever lets start beyond the last batch handed over.

Keys are async's: batch j's prompt b, sample g draws token t with fold_in(fold_in(fold_in(sample_root, j),
b * G + g), t), so a batch that no update reaches draws what between-batches sampling draws with that version.

Exact resume: at each checkpoint (iteration v, a multiple of `checkpoint.every`) the trainer saves, beside its
own state, the producer's state at the boundary where version v takes effect (`in_flight_snapshot`: the pool with
its keys/values, the batches sampled and not yet taken; the trainer waits for the sampler to reach that boundary,
which with lag 1 is the completion of the batch it trains next). A run killed and resumed from that checkpoint
goes on from there bit for bit (tested with kill -9). A checkpoint at another iteration (a preemption's, or the
run's last when it is not a multiple) has no snapshot: its resume samples the batches in flight again from their
start with the restored version (each prompt still trained once; not the tokens of the run that was not killed).
"""

from __future__ import annotations

import dataclasses
import logging
import time

import jax
import numpy as np

from jgrpo.data import bucketed_length
from jgrpo.parallel.host_arrays import fetch, local_rows, to_global_rows
from jgrpo.parallel.mesh import SAMPLE_RULES
from jgrpo.rollout.async_producer import AsyncRollouts
from jgrpo.rollout.in_flight_snapshot import Flight, restore_flight, take_snapshot
from jgrpo.rollout.in_flight_snapshot import rows_of as _rows
from jgrpo.rollout.intake import Produced
from jgrpo.rollout.scoring import prompt_arrays
from jgrpo.rollout.slot_metrics import versions_per_row
from jgrpo.sampling.stream import batch_rows

log = logging.getLogger(__name__)


class InFlightRollouts(AsyncRollouts):
    """The in-flight producer thread; the trainer's side (`publish`, `take`, `close`) is `AsyncRollouts`'."""

    def __init__(self, source, *, max_staleness: int, lag: int, publish_every: int, first_index: int,
                 dropped: int, first_version: int, recompute: bool = False, snapshot_every: int = 0,
                 restored: dict | None = None):
        if jax.process_count() > 1:
            raise ValueError("rollout.weight_updates=in_flight runs on one process for now (several processes "
                             "sample between batches)")
        if source.episodes is not None:
            raise ValueError("rollout.weight_updates=in_flight samples single-turn rows; multi-turn episodes "
                             "(env.name) sample between batches")
        self.lag, self.publish_every, self.first_version = lag, publish_every, first_version
        self.recompute = recompute  # rollout.in_flight_kv: recompute (else keep)
        self.versions: dict[int, object] = {}  # published params not yet superseded by the schedule
        # Exact resume: the state at each boundary where a version that is a multiple of `snapshot_every` (the
        # trainer's checkpoint.every) takes effect, until the trainer's checkpoint takes it; `restored`: the one
        # a resumed run starts from (`in_flight_snapshot`).
        self.snapshot_every, self._restored, self._snapshots, self._skip = snapshot_every, restored, {}, None
        self._given = first_version  # the last version whose snapshot the trainer took
        super().__init__(source, max_staleness=max_staleness, first_index=first_index, dropped=dropped,
                         prompt_width=0)

    def publish(self, params, version: int, dropped: int | None = None) -> None:
        with self._cond:
            self.versions[version] = params
            if dropped is not None:
                self.dropped = dropped
            self._cond.notify_all()

    # ------------------------------------------------------------------ the schedule

    def _due(self, handed: int) -> int:
        """The version in effect once `handed` batches from the first are complete: the newest published multiple
        of publish_every <= iterations handed - lag (at least the version the stream started with)."""
        iterations = handed - self.dropped
        newest = (iterations - self.lag) // self.publish_every * self.publish_every
        return max(self.first_version, newest)

    def _params_of(self, version: int):
        """Version `version`'s params, waiting for its publish (the wait is idle time); None once stopping."""
        with self._cond:
            waited = time.perf_counter()
            self._cond.wait_for(lambda: self._stopping or version in self.versions)
            self.idle_seconds += time.perf_counter() - waited
            if self._stopping:
                return None
            self.versions = {v: p for v, p in self.versions.items() if v >= version}
            return self.versions[version]

    # ------------------------------------------------------------------ the producer thread

    def _produce(self) -> None:
        try:
            self._stream()
        except BaseException as e:  # noqa: BLE001 - handed to the trainer, which raises it (DataExhausted too)
            with self._cond:
                self._queue.append(e)
                self._cond.notify_all()

    def _stream(self) -> None:
        src, c = self.source, self.source.config
        B = c.data.batch_size
        sampler = src.sampler.replace(slots=c.sampler.slots or B * c.grpo.num_generations)  # one batch's rows
        width = bucketed_length(c.data.max_prompt_length, c.sampler.prompt_bucket)  # every batch fits
        lanes = self.max_staleness - self.lag + 1
        params = self._params_of(self.first_version)
        if params is None:
            return
        state = sampler.open_stream(params, lanes=lanes, batch=B, prompt_len=width)
        f = Flight(state, self.first_version, params, handed=self._next_index)
        if self._restored is not None:
            f = self._restore(f, self._restored)
            self._restored = None
        while True:
            if self._due(f.handed) > f.version:  # the next version takes effect (one per boundary)
                due = (f.version // self.publish_every + 1) * self.publish_every
                if self.snapshot_every and due % self.snapshot_every == 0 and due != self._skip:
                    self._keep_snapshot(due, f)
                f.params = self._params_of(due)
                if f.params is None:
                    return
                f.version = due
                if self.recompute:
                    f.state = sampler.recompute(f.params, f.state, self._store_prompts(f, width, sampler))
            for lane in range(lanes):
                with self._cond:
                    if self._stopping:
                        return
                    may = self._next_index - self.dropped - f.version <= self.max_staleness
                    index = self._next_index
                if lane in f.in_lane or not may:
                    continue
                batch = src.next_batch(index)
                prompts = prompt_arrays(batch.token_ids, width=width, pad_id=src.pad_id, mesh=src.mesh,
                                        global_prompts=B)
                f.state = sampler.refill(f.params, f.state, lane, prompts, src.sample_key(index), index)
                f.in_lane[lane] = (index, batch, src.data.get_state())
                with self._cond:
                    self._next_index += 1
            if not f.in_lane:  # cannot happen with 1 <= lag <= max_staleness - publish_every + 1 (config checks)
                raise RuntimeError(f"the in-flight schedule stalled at version {f.version}, batch {self._next_index}")
            f.state = sampler.advance(f.params, f.state, chunks=1, version=f.version)
            finished = np.asarray(fetch(f.state.pool.rows.finished)).reshape(-1)  # (the rows' outputs: once, below)
            for lane, (index, batch, data_state) in list(f.in_lane.items()):
                mine = batch_rows(f.state.spec, lane)
                if finished[mine].all():  # the batch is complete: its rows read, its lane free for the next one
                    f.complete[index] = (_rows(f.state, mine), batch, data_state)
                    f.state = dataclasses.replace(f.state, drained=f.state.drained | np.isin(
                        np.arange(len(finished)), mine))
                    del f.in_lane[lane]
            while f.handed in f.complete:
                rows, batch, data_state = f.complete.pop(f.handed)
                busy, clock = (int(x) for x in jax.device_get((f.state.pool.busy, f.state.pool.clock)))
                utilization = (busy - f.mark[0]) / (max(clock - f.mark[1], 1) * sampler.slots)
                item = self._scored(rows, f.handed, batch, data_state, {"rollout/slot_utilization": utilization})
                item = item._replace(rollout=dataclasses.replace(item.rollout,
                                                                 sample_seconds=time.perf_counter() - f.wall))
                f.mark, f.wall = (busy, clock), time.perf_counter()
                with self._cond:
                    self._queue.append(item)
                    self._cond.notify_all()
                f.handed += 1

    def _store_prompts(self, f: Flight, width: int, sampler):
        """The stream's prompts in its store's order (queue q's entries lane by lane: lane m's batch prompts
        q * B/Q ..), a free lane's entries a one-token stand-in (their keys/values are not written)."""
        plan = f.state.spec.plan
        Q, lanes = plan.queues, plan.lanes
        n = plan.rows_per_queue // plan.num_samples // lanes
        by_lane = {lane: batch.token_ids for lane, (_, batch, _) in f.in_lane.items()}
        ids = [by_lane[m][q * n + i] if m in by_lane else [sampler.pad_id]
               for q in range(Q) for m in range(lanes) for i in range(n)]
        src = self.source
        return prompt_arrays(ids, width=width, pad_id=src.pad_id, mesh=src.mesh, global_prompts=len(ids))

    def _scored(self, host, index: int, batch, data_state, metrics: dict) -> Produced:
        """A complete batch's rows (numpy SampleOutput, in batch order) as global arrays, scored."""
        src = self.source
        samples = host.map(lambda x: to_global_rows(x, src.mesh, SAMPLE_RULES, len(host.tokens)))
        rollout = src.scoring.score(samples, batch, local_rows(samples.tokens), local_rows(samples.lengths))
        drawn = host.loss_mask
        oldest = int(host.version[drawn].min()) if drawn.any() else self.first_version
        return Produced(rollout, oldest, index, data_state, {**versions_per_row(host.version, drawn), **metrics})

    # ------------------------------------------------------------------ exact resume

    def snapshot(self, version: int) -> dict | None:
        """The trainer's checkpoint at iteration `version` (a multiple of `snapshot_every`): the sampler's state at
        the boundary where version `version` takes effect, once it is there (None if the producer stopped
        first, e.g. the data ran out). The trainer trains nothing meanwhile, so the batches queued then are those
        it has not taken."""
        with self._cond:
            if version <= self._given:  # (the run's final save of a step it saved already)
                return None
            self._cond.wait_for(lambda: version in self._snapshots or self._stopping or self._failed())
            kept = self._snapshots.pop(version, None)
            self._snapshots = {v: s for v, s in self._snapshots.items() if v > version}
            self._given = version
            return kept

    def _failed(self) -> bool:
        return any(isinstance(item, BaseException) for item in self._queue) or not self._thread.is_alive()

    def _keep_snapshot(self, version: int, f: Flight) -> None:
        with self._cond:
            queued = list(self._queue)
        kept = take_snapshot(f, queued, self._next_index)
        with self._cond:
            self._snapshots[version] = kept
            self._cond.notify_all()

    def _restore(self, f: Flight, saved: dict) -> Flight:
        """The producer as it was at the boundary of the snapshot: its pool, its lanes' batches (read again from
        the data, from the trainer's position), and the batches it had sampled that the trainer had not taken
        (scored again, queued)."""
        src, meta = self.source, saved["meta"]
        f, rows_of_batch = restore_flight(f, saved)
        batches = {}
        for index in range(self._next_index, meta["next_index"]):  # read again, in order: the iterator as it was
            batches[index] = (src.next_batch(index), src.data.get_state())
        self._next_index = meta["next_index"]
        f.in_lane = {int(lane): (index, *batches[index]) for lane, index in meta["lanes"].items()}
        for entry in meta["batches"]:  # sampled, not taken by the trainer: queued in order, or waiting for one
            index, rows = entry["index"], rows_of_batch[entry["index"]]
            if index < f.handed:
                item = self._scored(rows, index, *batches[index], {})
                self._queue.append(item._replace(version=entry["version"], metrics=entry["metrics"]))
            else:
                f.complete[index] = (rows, *batches[index])
        self._skip = self.first_version  # (its checkpoint is written: not taken again)
        return f
