"""Which params sample each iteration, and how they reach the sampler's devices.

- v = 1 (sync or window): the current params, resharded into the sampling layout (a copy only where the
  sampler's weights dtype differs);
- v > 1 or adaptive: the behaviour copy, refreshed when `behaviour_refresh.RefreshPolicy` says so (docs/algorithm.md
  §5 and §14): behaviour <- current is the only weight sync;
- `rollout.mode: async`: versions of the current params published to the producer thread every
  `rollout.publish_every` iterations (`jgrpo.rollout.async_producer`); the batches come from its queue.

With `mesh.rollout_devices` the sampling layout lies on the sampler's sub-mesh, so every refresh or publish
is one copy across sub-meshes (`time/weight_sync`).
"""

from __future__ import annotations

import logging
import time

import jax
import jax.numpy as jnp

from jgrpo.models.llm import param_logical_axes
from jgrpo.parallel.mesh import SAMPLE_RULES, logical_shardings, param_copier
from jgrpo.rl.behaviour_refresh import RefreshPolicy
from jgrpo.rollout.async_producer import AsyncRollouts

log = logging.getLogger(__name__)


class SamplingPolicy:
    """The sampling side of the trainer's state: the behaviour copy's refreshes, or the async producer."""

    def __init__(self, config, params, *, rollouts, frozen, train_mesh, sample_mesh):
        self.config, self.rollouts, self.frozen = config, rollouts, frozen
        self.shardings = logical_shardings(param_logical_axes(params), sample_mesh, SAMPLE_RULES, shapes=params)
        # A real copy (new buffers) even where the two layouts agree: the current params get donated.
        self.copy = param_copier(self.shardings, config.sampler.weights_dtype,
                                 other_devices=sample_mesh is not train_mesh)
        self.refresh_policy = RefreshPolicy(config.grpo)
        self.producer: AsyncRollouts | None = None  # rollout.mode=async: started at the first iteration
        self._taken_data_state = None

    def behaviour(self, state):
        """The params that sample: the separate copy when v > 1, else the current params themselves."""
        return state.behaviour if self.config.grpo.keeps_behaviour_copy else state.params

    def abstract_copy(self, params):
        """The behaviour copy's shapes, dtypes (`sampler.weights_dtype` for floating leaves) and shardings."""
        dtype = jnp.dtype(self.config.sampler.weights_dtype)
        return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(
            x.shape, dtype if jnp.issubdtype(x.dtype, jnp.floating) else x.dtype, sharding=s), params, self.shardings)

    def data_state(self) -> dict:
        """The prompt iterator's state of the batches trained on (not of those sampled ahead)."""
        return self._taken_data_state if self._taken_data_state is not None else self.rollouts.data_state()

    def set_data_state(self, data_state: dict) -> None:
        """A resume: the iterator back to the state of the batches trained on (any in flight are drawn again)."""
        self.rollouts.set_data_state(data_state)
        self._taken_data_state = None

    def first_round(self, state, k: int, timings: dict):
        """Iteration k's batch, sampled and scored: (round, sampling params or None, refreshed?, metrics)."""
        c = self.config
        if c.rollout.mode == "async":  # the producer sampled it with a published version
            if self.producer is None:
                self._start(state)
            try:
                produced, metrics = self.producer.take(k)
            finally:  # dropped batches are consumed too, also when the data then runs out
                counters, producer = state.counters, self.producer
                counters.batches_drawn, counters.stale_dropped = producer.taken, producer.dropped
                self._taken_data_state = producer.taken_data_state or self._taken_data_state
            state.behaviour_version = produced.version
            return produced.round, None, False, metrics
        t = time.perf_counter()
        refreshed = self._refresh_behaviour(state, k)
        if c.grpo.behaviour_refresh == 1 and c.sampler.weights_dtype != c.model.param_dtype:
            sample_params = self.copy(self.behaviour(state))
        else:  # the behaviour copy is in the sampling layout already; v = 1 reshards the current params
            sample_params = jax.device_put(self.behaviour(state), self.shardings)
        sample_params = jax.block_until_ready(self.frozen.join_sample(sample_params))
        timings["weight_sync"] = time.perf_counter() - t
        return self.rollouts.first_round(sample_params, k, state.counters), sample_params, refreshed, {}

    def after_iteration(self, state, timings: dict) -> None:
        """Async: the current params to the producer, every rollout.publish_every iterations."""
        if self.producer is not None and state.iteration % self.config.rollout.publish_every == 0:
            t = time.perf_counter()
            self.producer.publish(jax.block_until_ready(self._published(state)), state.iteration)
            timings["weight_sync"] = time.perf_counter() - t

    def stop(self) -> str | None:
        """Stop the async producer, if any; returns its staleness summary for the log."""
        if self.producer is None:
            return None
        producer, self.producer = self.producer, None
        producer.close()
        return (f"async rollouts: staleness (iterations: batches) {producer.histogram()}; {producer.dropped} "
                f"dropped as staler than rollout.max_staleness={self.config.rollout.max_staleness}")

    def _start(self, state) -> None:
        """Async rollouts from the state's data position, the current params published as their version."""
        if self._taken_data_state is not None:  # restarted after `stop`: the batches sampled ahead are dropped
            self.rollouts.set_data_state(self._taken_data_state)
        self.producer = AsyncRollouts(self.rollouts, max_staleness=self.config.rollout.max_staleness,
                                      first_index=state.counters.batches_drawn, dropped=state.counters.stale_dropped,
                                      prompt_width=state.counters.prompt_width)
        self.producer.publish(self._published(state), state.iteration)

    def _published(self, state):
        """A copy of the current params in the sampling layout (with LoRA joined with the sampling base)."""
        return self.frozen.join_sample(self.copy(state.params))

    def _refresh_behaviour(self, state, k: int) -> bool:
        """behaviour <- current when `RefreshPolicy.due` (a copy in the sampling layout, which survives the
        donated updates); returns whether this iteration samples from a fresh copy."""
        s = state
        if not self.config.grpo.keeps_behaviour_copy:  # on-policy: the current params sample
            s.behaviour_version = k
            return False
        why = self.refresh_policy.due(k, s.behaviour_version, s.behaviour is not None, s.counters.refresh_requested)
        if why is None:
            return False
        s.behaviour = self.copy(s.params)
        s.behaviour_version = k
        s.counters.behaviour_refreshes += 1
        s.counters.refresh_requested = 0
        log.info("iteration %d: behaviour <- current params (%s)", k + 1, why)
        return True
