"""Which params sample each iteration, how they reach the sampler's devices, and when the behaviour copy refreshes.

- v = 1 (sync or window): the current params, resharded into the sampling layout (a copy only where the
  sampler's weights dtype differs);
- v > 1 or adaptive: the behaviour copy, refreshed when `behaviour_refresh.RefreshPolicy` says so (docs/algorithm.md
  §5 and §14): behaviour <- current is the only weight sync;
- `rollout.mode: async`: copies of the current params published to the producer thread every
  `rollout.publish_every` iterations (`jgrpo.rollout.async_producer`).

The refresh is decided at one point, `refresh_for(state, k, requested)`: at the end of iteration k - 1, with that
iteration's update metrics (adaptive v), for the iteration k that samples next; and when a run starts or resumes
without a fresh copy. It returns the new copy and its version; the trainer, which owns the state, stores them.
With `mesh.rollout_devices` the sampling layout lies on the sampler's sub-mesh, so every refresh or publish
is one copy across sub-meshes (`time/weight_sync`).
"""

from __future__ import annotations

import logging
import time
from typing import Any, NamedTuple

import jax

from jgrpo.models.llm import param_logical_axes
from jgrpo.models.quantize import sampler_copy
from jgrpo.parallel.mesh import SAMPLE_RULES, logical_shardings
from jgrpo.parallel.weights.copies import param_copier, param_mover
from jgrpo.parallel.weights.process_crossing import ProcessCrossing
from jgrpo.rl.behaviour_refresh import RefreshPolicy

log = logging.getLogger(__name__)


class Refresh(NamedTuple):
    """behaviour <- current: the new copy (in the sampling layout) and the first iteration it samples."""

    behaviour: Any
    version: int


def sampling_copy(config) -> str | None:
    """Which copy of the current params the sampler reads, besides them (decided once, for the trainer and the
    planner alike): "behaviour" (v > 1 or adaptive: the behaviour policy), "published" (async rollouts: the
    producer's copy), "cast" (v = 1 with another weights dtype: a cast, or int8 quantization, every iteration) or
    None (v = 1: the current params, resharded)."""
    if config.rollout.mode == "async":
        return "published"
    if config.grpo.keeps_behaviour_copy:
        return "behaviour"
    return "cast" if config.sampler.weights_dtype != config.model.param_dtype else None


class SamplingWeights:
    """The params the sampler reads: which, in which layout and dtype, and when the behaviour copy refreshes."""

    def __init__(self, config, params, *, frozen, train_mesh, sample_mesh):
        self.config, self.frozen = config, frozen
        self.copy_kind = sampling_copy(config)
        # The sampler's copy: cast to `sampler.weights_dtype`, or int8 values and scales (models/quantize.py).
        self.convert = sampler_copy(config.sampler.weights_dtype, config.model.compute_dtype,
                                    config.sampler.quantize_embeddings)
        copied = jax.eval_shape(self.convert, params)
        self.shardings = logical_shardings(param_logical_axes(copied), sample_mesh, SAMPLE_RULES, shapes=copied)
        # v = 1 in the weights' own dtype: the current params, resharded (no conversion).
        self.resharding = logical_shardings(param_logical_axes(params), sample_mesh, SAMPLE_RULES, shapes=params)
        # A real copy (new buffers) even where the two layouts agree: the current params get donated.
        source = None if sample_mesh is train_mesh else train_mesh
        copy = param_copier(self.shardings, self.convert, source=source)
        self.reshard = param_mover(self.resharding, train_mesh)
        # int8: the copy is the quantization (with mesh.rollout_devices, and the move of its int8 bytes), timed as
        # `time/quantize` (part of `time/weight_sync`); `take_quantize_seconds` hands the sum over.
        self.quantize_seconds = 0.0
        timed = self._timed if config.sampler.weights_dtype == "int8" else (lambda f: f)
        self.copy = timed(copy)
        # The sampler on other processes (`ProcessCrossing`): the behaviour copy stays on the trainer's processes,
        # which checkpoint it, as the crossing's twin; it crosses when it samples (again only after a refresh).
        self.crossing = copy if isinstance(copy, ProcessCrossing) else None
        self.twin = timed(copy.twin) if self.crossing else None
        self._sent = (None, None)  # (version, the behaviour copy on the sampler's devices)
        self.policy = RefreshPolicy(config.grpo)
        g = config.grpo
        quantized = [f"sampler.{key}=int8" for key in ("weights_dtype", "kv_cache_dtype")
                     if getattr(config.sampler, key) == "int8"]
        if quantized and g.truncated_is == "none" and g.masked_is == "none":
            log.warning("%s samples from a quantized policy, whose log-probs differ from the trained weights' "
                        "(mismatch/logprob_mean), and no correction is set: grpo.truncated_is=none and "
                        "grpo.masked_is=none. Set grpo.masked_is: token (or grpo.truncated_is: token with "
                        "grpo.off_policy_ratio: current); docs/algorithm.md", " and ".join(quantized))

    def _timed(self, copy):
        def timed(params):
            start = time.perf_counter()
            out = jax.block_until_ready(copy(params))
            self.quantize_seconds += time.perf_counter() - start
            return out

        return timed

    def take_quantize_seconds(self) -> float:
        """Seconds spent quantizing since the last call (0 without int8 weights)."""
        seconds, self.quantize_seconds = self.quantize_seconds, 0.0
        return seconds

    def for_sampling(self, state, refresh: Refresh | None = None):
        """The params that sample iteration `state.iteration`, in the sampling layout (LoRA: with the sampling
        base joined): the behaviour copy (`refresh`'s when one was just made), or the current params (cast, or
        resharded)."""
        if self.copy_kind == "behaviour":
            params = refresh.behaviour if refresh is not None else state.behaviour
            if self.crossing is not None:
                version = refresh.version if refresh is not None else state.behaviour_version
                if self._sent[0] != version:
                    self._sent = (version, self.crossing.send(params))
                params = self._sent[1]
        elif self.copy_kind == "cast":
            params = self.copy(state.params)
        else:  # v = 1: the current params, resharded
            params = self.reshard(state.params)
        return jax.block_until_ready(self.frozen.join_sample(params))

    def published(self, state, *, with_base: bool = True):
        """A copy of the current params for the async producer (never donated), with LoRA's sampling base; without
        it for a rollout job (`rollout.role`), which holds the base itself: only the adapters cross."""
        copy = self.copy(state.params)
        return self.frozen.join_sample(copy) if with_base else copy

    def refresh_for(self, state, k: int, requested: int = 0) -> Refresh | None:
        """behaviour <- current when iteration k must sample from a fresh copy (`RefreshPolicy.due`; `requested`:
        adaptive v's verdict on the updates before, `RefreshPolicy.request`). None: no copy is kept, or the copy
        is fresh for k already, or it serves k too."""
        if self.copy_kind != "behaviour":
            return None
        has_copy = state.behaviour is not None
        if has_copy and state.behaviour_version == k:
            return None
        why = self.policy.due(k, state.behaviour_version, has_copy, requested)
        if why is None:
            return None
        log.info("iteration %d: behaviour <- current params (%s)", k + 1, why)
        return Refresh((self.twin or self.copy)(state.params), k)

    def abstract_copy(self, params):
        """The behaviour copy's shapes, dtypes (`sampler.weights_dtype`; int8: values and scales) and shardings."""
        shardings = self.crossing.twin_shardings if self.crossing else self.shardings
        return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                            jax.eval_shape(self.convert, params), shardings)
