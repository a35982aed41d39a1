"""An iteration's scored samples, and what changes on the sampling side after its updates: the trainer's two calls
into the rollout room.

`collect(state, timings)`: the batch for iteration k, sampled with the params `SamplingWeights` gives (sync or
window, `sources`), or taken from the async producer (`async_producer`), then topped up by DAPO dynamic sampling
(`dynamic_sampling`) when on. It returns a `Collected` (the record, the version of the params that sampled it, the
run's rng after the extra rounds' keys, metrics); of the trainer's state it only advances the run counters that
follow the data (the prompt width, and the async producer's batches drawn and dropped).

`after_update(state, update_metrics, last, timings)`: behaviour <- current if iteration k + 1 must sample from a
fresh copy (the one place this is decided, `SamplingWeights.refresh_for`), and the async producer's new published
copy.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import NamedTuple

import jax

from jgrpo.parallel.host_arrays import move_rows, to_global_rows
from jgrpo.parallel.mesh import SAMPLE_RULES, TRAIN_RULES
from jgrpo.rollout.async_producer import AsyncRollouts
from jgrpo.rollout.dynamic_sampling import fill_batch
from jgrpo.rollout.in_flight import InFlightRollouts
from jgrpo.rollout.intake import Intake
from jgrpo.rollout.records import Rollout
from jgrpo.rollout.remote import RemoteRollouts
from jgrpo.rollout.sampling_weights import Refresh, SamplingWeights
from jgrpo.rollout.sources import DataExhausted, RolloutSource
from jgrpo.sampling.state import SampleOutput

log = logging.getLogger(__name__)


class TrainingInputs(NamedTuple):
    """The batch on the trainer's devices: what `StepFunctions.build` takes."""

    prompt_tokens: jax.Array  # [B, P]
    prompt_mask: jax.Array  # [B, P]
    samples: SampleOutput  # per token [R, N], per row [R]
    rewards: jax.Array  # [R, 1 + F] the reward table


class Collected(NamedTuple):
    rollout: Rollout  # this process's view: prompts, completions, scores (samples: on the trainer's devices)
    inputs: TrainingInputs
    version: int  # the iteration count of the params that sampled it (behaviour_version)
    refresh: Refresh | None  # a behaviour copy made for this iteration (the run's first, or after a resume)
    rng: jax.Array  # the run's rng after dynamic sampling's keys
    metrics: dict  # rollout/* (async) and dynamic/* metrics


class AfterUpdate(NamedTuple):
    refresh: Refresh | None  # behaviour <- current, for the next iteration
    pending: int  # after the run's last iteration: adaptive v's request, kept for a run resumed to go on


class Collector:
    """The trainer's rollout room: prompts, weights, sampler and rewards behind one call per iteration."""

    def __init__(self, config, *, source: RolloutSource, weights: SamplingWeights, train_mesh):
        self.config, self.source, self.weights, self.train_mesh = config, source, weights, train_mesh
        self.rows = config.data.batch_size * config.grpo.num_generations
        # rollout.mode=async: where the batches come from, started at the first iteration: a producer thread here
        # (between batches or in flight), or two jobs' channel to the rollout job (`RemoteRollouts`, which produces
        # nothing itself): each an `Intake`, the trainer's side of batches sampled elsewhere.
        self.intake: Intake | None = None
        self._taken_data_state = None
        self._restored_stream = None  # in flight: the sampler's state a resumed run starts from (`set_stream`)

    def collect(self, state, timings: dict) -> Collected:
        """Iteration `state.iteration`'s batch, sampled and scored (see the module doc)."""
        c, k = self.config, state.iteration
        metrics, rng, refresh = {}, state.rng, None
        if c.rollout.mode == "async":
            rollout, version, metrics = self._take(state)
            params = None
        else:
            start = time.perf_counter()
            # The run's first iteration, or a resume without a fresh behaviour copy (`refresh_for`).
            refresh = self.weights.refresh_for(state, k, state.counters.refresh_requested)
            params = self.weights.for_sampling(state, refresh)
            if self.weights.copy_kind != "behaviour":
                version = k  # on-policy: the current params
            else:
                version = refresh.version if refresh is not None else state.behaviour_version
            timings["weight_sync"] = timings.get("weight_sync", 0.0) + time.perf_counter() - start
            _add_quantize(timings, self.weights)
            rollout = self.source.first(params, k, state.counters, version)
        g = c.grpo
        if g.dynamic_sampling_rounds:  # DAPO: replace zero-variance groups by newly sampled groups with signal
            rngs = [rng]

            def draw() -> Rollout | None:
                try:
                    batch = self.source.next_batch(k)
                except DataExhausted as e:
                    log.warning("dynamic sampling: %s", e)
                    return None
                rngs[0], key = jax.random.split(rngs[0])
                prompts = self.source.prompt_arrays(batch, state.counters)
                return self.source.sample(params, batch, prompts, key, version)

            rollout, dynamic = fill_batch(rollout, draw, group_size=g.num_generations,
                                          rounds=g.dynamic_sampling_rounds, oversample=g.dynamic_sampling_oversample,
                                          per_reward=g.advantage_reward_normalisation == "per_reward",
                                          mesh=self.source.mesh)
            metrics.update(dynamic)
            rng = rngs[0]
        timings["sample"] = rollout.sample_seconds
        rollout, inputs = self._for_training(rollout, state.counters, timings)
        return Collected(rollout, inputs, version, refresh, rng, metrics)

    def _for_training(self, rollout: Rollout, counters, timings: dict) -> tuple[Rollout, TrainingInputs]:
        """The batch as global arrays on the trainer's devices (the samples move there when the sampler has its
        own devices, `mesh.rollout_devices`)."""
        start = time.perf_counter()
        prompts = self.source.prompt_arrays(rollout.prompts, counters, self.train_mesh)
        samples = rollout.samples
        if self.source.mesh is not self.train_mesh:
            samples = move_rows(samples, self.train_mesh, SAMPLE_RULES)
        rewards = to_global_rows(rollout.rewards, self.train_mesh, TRAIN_RULES, self.rows)
        timings["reward"] = rollout.score_seconds + time.perf_counter() - start
        return (dataclasses.replace(rollout, samples=samples),
                TrainingInputs(prompts.tokens, prompts.mask, samples, rewards))

    def after_update(self, state, update_metrics: list[dict], last: bool, timings: dict) -> AfterUpdate:
        """After iteration k's updates (`state.iteration` is k + 1 already): the behaviour copy iteration k + 1
        samples from, if it needs a fresh one (adaptive v judges k's `update_metrics`; none after the run's
        `last` iteration), and the async producer's newer published copy."""
        start = time.perf_counter()
        requested, why = self.weights.policy.request(update_metrics)  # (adaptive v only)
        if why:
            log.info("iteration %d: %s: the behaviour policy refreshes before the next sampling", state.iteration, why)
        refresh = None if last else self.weights.refresh_for(state, state.iteration, requested)
        publishes = self.intake is not None and state.iteration % self.config.rollout.publish_every == 0
        if publishes:
            self.intake.publish(jax.block_until_ready(self._published(state)), state.iteration)
        if publishes or refresh is not None:
            timings["weight_sync"] = timings.get("weight_sync", 0.0) + time.perf_counter() - start
            _add_quantize(timings, self.weights)
        # A request is consumed by refresh_for at once, except after the last iteration (there is no next one).
        return AfterUpdate(refresh, requested if last else 0)

    # ------------------------------------------------------------------ async rollouts

    def _take(self, state):
        """The producer's batch for iteration k: (rollout, version, metrics). The run counters follow the batches
        the producer handed over (trained or dropped as too stale)."""
        if self.intake is None:
            self._start(state)
        try:
            produced, metrics = self.intake.take(state.iteration)
        finally:  # dropped batches are consumed too, also when the data then runs out
            counters, intake = state.counters, self.intake
            counters.batches_drawn, counters.stale_dropped = intake.taken, intake.dropped
            self._taken_data_state = intake.taken_data_state or self._taken_data_state
        return produced.rollout, produced.version, metrics

    def _start(self, state) -> None:
        """Async rollouts from the state's data position, the current params published as their version."""
        if self._taken_data_state is not None:  # restarted after `stop`: the batches sampled ahead are dropped
            self.source.set_data_state(self._taken_data_state)
        counters = state.counters
        if self.config.rollout.role == "trainer":  # two jobs: the batches come from the rollout job
            self.intake = RemoteRollouts(self.config, first_index=counters.batches_drawn,
                                         dropped=counters.stale_dropped, data_state=self.data_state(),
                                         prompt_width=counters.prompt_width, train_mesh=self.train_mesh)
        elif self.config.rollout.weight_updates == "in_flight":
            r = self.config.rollout
            self.intake = InFlightRollouts(self.source, max_staleness=r.max_staleness, lag=r.in_flight_lag,
                                           publish_every=r.publish_every, first_index=counters.batches_drawn,
                                           dropped=counters.stale_dropped, first_version=state.iteration,
                                           recompute=r.in_flight_kv == "recompute",
                                           snapshot_every=self.config.checkpoint.every,
                                           restored=self._restored_stream)
            self._restored_stream = None
        else:
            self.intake = AsyncRollouts(self.source, max_staleness=self.config.rollout.max_staleness,
                                        first_index=counters.batches_drawn, dropped=counters.stale_dropped,
                                        prompt_width=counters.prompt_width)
        self.intake.publish(self._published(state), state.iteration)

    def _published(self, state):
        """The copy the producer samples with; a rollout job joins LoRA's base to it itself."""
        return self.weights.published(state, with_base=not isinstance(self.intake, RemoteRollouts))

    def data_state(self) -> dict:
        """The prompt iterator's state of the batches trained on (not of those sampled ahead)."""
        return self._taken_data_state if self._taken_data_state is not None else self.source.data_state()

    def set_data_state(self, data_state: dict) -> None:
        """A resume: the iterator back to the state of the batches trained on (any in flight are drawn again)."""
        self.source.set_data_state(data_state)
        self._taken_data_state = None

    def stream_snapshot(self, iteration: int) -> dict | None:
        """In flight: the sampler's state for the checkpoint of `iteration` (`InFlightRollouts.snapshot`), or None
        (other modes, or an iteration that is not a multiple of checkpoint.every: its resume is not exact)."""
        every = self.config.checkpoint.every
        if not isinstance(self.intake, InFlightRollouts) or not every or iteration % every:
            return None
        return self.intake.snapshot(iteration)

    def set_stream(self, snapshot: dict | None) -> None:
        """A resume: the in-flight sampler starts from the checkpoint's snapshot (None: from the data position)."""
        self._restored_stream = snapshot

    def stop(self, run_over: bool = True) -> str | None:
        """Stop the async producer, if any; returns its staleness summary for the log. Two jobs: `run_over`
        ends the rollout job too, else (preempted, failed) it waits for the trainer to resume."""
        if self.intake is None:
            return None
        intake, self.intake = self.intake, None
        if isinstance(intake, RemoteRollouts):
            intake.close(run_over)
        else:
            intake.close()
        return (f"async rollouts: staleness (iterations: batches) {intake.histogram()}; {intake.dropped} "
                f"dropped as staler than rollout.max_staleness={self.config.rollout.max_staleness}")


def _add_quantize(timings: dict, weights) -> None:
    """`time/quantize`: the int8 copies' seconds since the last report (part of `time/weight_sync`)."""
    seconds = weights.take_quantize_seconds()
    if seconds:
        timings["quantize"] = timings.get("quantize", 0.0) + seconds
