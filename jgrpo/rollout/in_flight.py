"""Rollouts that never drain (`rollout.weight_updates: in_flight`): one pool of slots keeps decoding across batch
boundaries and weight updates, and hands the trainer each batch when its last row is done.

The producer thread drives a stream (`jgrpo.sampling.stream`): lanes of B prompts, a slot whose row stops taking
the oldest batch's next waiting row. Between two decode chunks (`sampler.decode_chunk` steps) it

1. takes the version the schedule puts in effect (below), waiting for it if the trainer has not published it yet;
2. fills free lanes with the next batches the staleness bound allows: batch j (trained at iteration j - dropped)
   starts only with a version v >= j - dropped - max_staleness, so no token of it is staler than the bound;
3. decodes one chunk with that version's params (the keys/values computed before stay: PipelineRL's choice; every
   token records the version that drew it and its log-prob, which the loss takes as the behaviour policy's);
4. drains the rows that completed; a batch whose rows are all done is scored and queued for the trainer in batch
   order (a batch that completes before an older one waits for it).

The schedule. Version k takes effect at the first chunk boundary at which the batches of iterations
0 .. k - 1 + lag are complete (lag = `rollout.in_flight_lag`; with `publish_every` p, the newest multiple of p
due). Every input of that rule is the sampler's own progress, so the same config gives the same tokens whatever
the timing of the trainer, the network or the reward functions (tested with injected delays): a late version
makes the sampler wait at its boundary, as a slow environment does under `env.resume_after`; an early one waits
for its boundary. The trainer has had the batches version k trains on since `lag` batches before the boundary:
that is its time to train before the sampler waits. Lanes: max_staleness - lag + 1, the most batches step 2 ever
lets start beyond the last batch handed over.

Keys are async's: batch j's prompt b, sample g draws token t with fold_in(fold_in(fold_in(sample_root, j),
b * G + g), t), so a batch that no update reaches draws what between-batches sampling draws with that version.

Resume: as between batches, the checkpoint keeps the data position of the batches the trainer took; the batches
in flight are drawn again from there with the restored params, so after a resume the rows in flight at the kill
are sampled again from their start with the newest version (no batch lost or trained twice; not the same tokens as
the run that was not killed).
"""

from __future__ import annotations

import dataclasses
import logging
import time

import jax
import numpy as np

from jgrpo.data import bucketed_length
from jgrpo.parallel.host_arrays import local_rows, to_global_rows
from jgrpo.parallel.mesh import SAMPLE_RULES
from jgrpo.rollout.async_producer import AsyncRollouts
from jgrpo.rollout.collect import prompt_arrays
from jgrpo.rollout.intake import Produced
from jgrpo.rollout.slot_metrics import versions_per_row
from jgrpo.sampling.stream import batch_rows

log = logging.getLogger(__name__)


class InFlightRollouts(AsyncRollouts):
    """The in-flight producer thread; the trainer's side (`publish`, `take`, `close`) is `AsyncRollouts`'."""

    def __init__(self, source, *, max_staleness: int, lag: int, publish_every: int, first_index: int,
                 dropped: int, first_version: int):
        if jax.process_count() > 1:
            raise ValueError("rollout.weight_updates=in_flight runs on one process for now (several processes "
                             "sample between batches)")
        if source.episodes is not None:
            raise ValueError("rollout.weight_updates=in_flight samples single-turn rows; multi-turn episodes "
                             "(env.name) sample between batches")
        self.lag, self.publish_every, self.first_version = lag, publish_every, first_version
        self.versions: dict[int, object] = {}  # published params not yet superseded by the schedule
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
        B, G = c.data.batch_size, c.grpo.num_generations
        sampler = src.sampler.replace(slots=c.sampler.slots or B * G)  # one iteration's rows decode at once
        width = bucketed_length(c.data.max_prompt_length, c.sampler.prompt_bucket)  # every batch fits
        lanes = self.max_staleness - self.lag + 1
        version = self.first_version
        params = self._params_of(version)
        if params is None:
            return
        state = sampler.open_stream(params, lanes=lanes, batch=B, prompt_len=width)
        in_lane: dict[int, tuple] = {}  # lane -> (batch index, batch, data state after it, started at)
        finished_rows: dict[int, object] = {}  # pool row -> its output (numpy), until its batch is complete
        complete: dict[int, Produced] = {}  # batches done, waiting for an older one to be handed over
        handed = self._next_index  # the next batch to hand over
        mark = (0, 0, time.perf_counter())  # (busy, clock, wall) when the last batch was handed over
        while True:
            due = self._due(handed)
            if due > version:
                params = self._params_of(due)
                if params is None:
                    return
                version = due
            for lane in range(lanes):
                with self._cond:
                    if self._stopping:
                        return
                    may = self._next_index - self.dropped - version <= self.max_staleness
                    index = self._next_index
                if lane in in_lane or not may:
                    continue
                batch = src.next_batch(index)
                data_state = src.data.get_state()
                prompts = prompt_arrays(batch.token_ids, width=width, pad_id=src.pad_id, mesh=src.mesh,
                                        global_prompts=B)
                state = sampler.refill(params, state, lane, prompts, src.sample_key(index), index)
                in_lane[lane] = (index, batch, data_state, time.perf_counter())
                with self._cond:
                    self._next_index += 1
            if not in_lane:  # cannot happen with 1 <= lag <= max_staleness - publish_every + 1 (config checks)
                raise RuntimeError(f"the in-flight schedule stalled at version {version}, batch {self._next_index}")
            state = sampler.advance(params, state, chunks=1, version=version)
            rows, out, state = sampler.drain(state)
            for i, r in enumerate(rows):
                finished_rows[int(r)] = out.map(lambda x, i=i: x[i])
            for lane, (index, batch, data_state, _) in list(in_lane.items()):
                mine = batch_rows(state.spec, lane)
                if all(int(r) in finished_rows for r in mine):
                    rows_out = [finished_rows.pop(int(r)) for r in mine]
                    complete[index] = self._scored(rows_out, index, batch, data_state)
                    del in_lane[lane]
            while handed in complete:
                busy, clock = (int(x) for x in jax.device_get((state.pool.busy, state.pool.clock)))
                item = complete.pop(handed)
                steps = max(clock - mark[1], 1)
                metrics = {**item.metrics, "rollout/slot_utilization": (busy - mark[0]) / (steps * sampler.slots)}
                rollout = dataclasses.replace(item.rollout, sample_seconds=time.perf_counter() - mark[2])
                mark = (busy, clock, time.perf_counter())
                with self._cond:
                    self._queue.append(item._replace(rollout=rollout, metrics=metrics))
                    self._cond.notify_all()
                handed += 1

    def _scored(self, rows_out: list, index: int, batch, data_state) -> Produced:
        """A complete batch's rows (numpy, in batch order) as global arrays, scored."""
        src = self.source
        fields = {f: np.stack([getattr(r, f) for r in rows_out]) for f in rows_out[0]._fields
                  if getattr(rows_out[0], f) is not None}
        host = rows_out[0].map(lambda _: None)._replace(**fields)
        samples = host.map(lambda x: to_global_rows(x, src.mesh, SAMPLE_RULES, len(rows_out)))
        rollout = src.scoring.score(samples, batch, local_rows(samples.tokens), local_rows(samples.lengths))
        drawn = host.loss_mask
        oldest = int(host.version[drawn].min()) if drawn.any() else self.first_version
        return Produced(rollout, oldest, index, data_state, versions_per_row(host.version, drawn))
