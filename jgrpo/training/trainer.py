"""The GRPO loop of docs/algorithm.md §5 (paper Algorithm 1): on-policy and off-policy, with checkpoints and metrics.

    behaviour <- current <- init ; reference <- init            (reference only when beta > 0)
    for iteration k = 0, 1, ...:
      if k % v == 0: behaviour <- current                        the only weight sync (v = 1: no copy; adaptive
                                                                  v: when Theorem 1 says so, jgrpo.rl.behaviour_refresh)
      prompts <- next batch of B (a new epoch first swaps the reference when grpo.swap_reference)
      completions, lp_alpha <- sample(behaviour, prompts, G each)    (jitted, SAMPLE_RULES layout; with
                                  rollout.mode=window, at the refresh for all v iterations: jgrpo.rollout.sources)
      rewards <- verifiable reward (host)       (dynamic sampling: more prompts for groups with signal)
      A <- group advantages (device)
      lp_ref <- logprobs(reference) if beta > 0 ; lp_k <- logprobs(current) if the ratio mode needs it
      repeat i times, for each of the minibatches: current <- optimiser step (donated params / opt state)

Shapes stay fixed so nothing recompiles after the first iteration: B*G rows, max_new_tokens, and a prompt
width that only grows (to the next `sampler.prompt_bucket` multiple) when a longer prompt arrives; the
width is part of the checkpoint so a resumed run compiles the same programs.
"""

from __future__ import annotations

import functools
import logging
import time

import jax
import jax.numpy as jnp
from etils import epath

from jgrpo.config import Config, ConfigError
from jgrpo.config.loading import to_dict
from jgrpo.data import build_prompt_iterator, pad_id_for
from jgrpo.models.attention_backends import resolve_attention
from jgrpo.models.frozen_base import FrozenBase
from jgrpo.models.hf import load_model, load_tokenizer
from jgrpo.parallel.host_arrays import to_global_rows
from jgrpo.parallel.mesh import (
    SAMPLE_RULES,
    TRAIN_RULES,
    make_meshes,
    mesh_platform,
    replicated,
    replicated_key,
    row_sharding,
)
from jgrpo.rewards import RewardScorer
from jgrpo.rollout.dynamic_sampling import Round, fill_batch
from jgrpo.rollout.evaluator import Evaluator
from jgrpo.rollout.sampling_weights import SamplingPolicy
from jgrpo.rollout.sources import DataExhausted, RolloutSource, sample_root
from jgrpo.sampling.sampler import Sampler, stop_ids_for
from jgrpo.training.checkpoint import Checkpointer, PreemptionFlag, RunCounters, TrainState, latest_data_state
from jgrpo.training.fingerprint import fingerprint
from jgrpo.training.iteration_record import count_updates, iteration_metrics, sample_dump
from jgrpo.training.metrics_log import MetricsLogger
from jgrpo.training.optimizer import learning_rate_schedule, make_optimizer
from jgrpo.training.preflight import check_before_loading
from jgrpo.training.steps import StepFunctions

log = logging.getLogger(__name__)


class TrainingDiverged(RuntimeError):
    """Too many optimiser steps in a row had a non-finite loss or gradient."""


class Trainer:
    """Owns the model, data, rewards, state and sinks of one run; `run()` trains to `run.iterations`."""

    def __init__(self, config: Config):
        self.config = config
        check_before_loading(config)  # the cheap checks first: a bad invocation fails before any model loads
        self.run_dir = epath.Path(config.run.output_dir)  # a local folder or a bucket (gs://...)
        # The trainer's mesh, and the sampler's: the same one, or disjoint sub-meshes (`mesh.rollout_devices`).
        self.mesh, self.sample_mesh = make_meshes(config.mesh)
        if config.rollout.mode == "async" and jax.process_count() > 1:
            raise ConfigError(f"rollout.mode=async needs one process (this run has {jax.process_count()}): the "
                              "producer thread's programs would reach the processes in different orders")
        m, g = config.model, config.grpo
        # Tokenizer, data and rewards before the weights: a bad data row or a resume onto other data fails in
        # seconds, not after the model has loaded.
        self.tokenizer = load_tokenizer(m.name)
        self.pad_id = pad_id_for(self.tokenizer)
        self.stop_ids = stop_ids_for(self.tokenizer, config.sampler.stop_token_ids)
        self.data = build_prompt_iterator(config, self.tokenizer)
        if config.checkpoint.resume and (saved := latest_data_state(self.run_dir)) is not None:
            self.data.check_state(saved)
        self.scorer = RewardScorer(config.reward)
        self.graphdef, params, self.model_config = load_model(
            m.name, param_dtype=m.param_dtype, compute_dtype=m.compute_dtype, remat=m.remat, mesh=self.mesh,
            rules=TRAIN_RULES, attention=resolve_attention(m.attention, mesh_platform(self.mesh)),
            lora=(m.lora.rank, m.lora.alpha, m.lora.targets), seed=config.run.seed,
        )
        # With LoRA the params that train (and every policy's own copy) are the adapters; the base is frozen.
        params, self.frozen = FrozenBase.split(params, m.lora.rank > 0, self.mesh, config.sampler.weights_dtype)
        self.sampler = Sampler.from_config(config.sampler, graphdef=self.graphdef, num_samples=g.num_generations,
                                           stop_ids=self.stop_ids, pad_id=self.pad_id, mesh=self.sample_mesh,
                                           cfg=self.model_config)
        self.method = self.sampler.method  # the trainer's log-probs process the logits as the sampler does
        root = jax.jit(lambda: sample_root(config.run.seed), out_shardings=replicated(self.sample_mesh))()
        self.rollouts = RolloutSource(config, data=self.data, sampler=self.sampler, tokenizer=self.tokenizer,
                                      scorer=self.scorer, root=root)
        self.total_iterations = min(config.run.iterations, len(self.data))
        if self.total_iterations < config.run.iterations:
            log.warning("the data has %d batches (data.epochs=%d), fewer than run.iterations=%d: stopping there",
                        len(self.data), config.data.epochs, config.run.iterations)
        self.updates_per_iteration = g.inner_steps * g.num_minibatches
        total_updates = self.total_iterations * self.updates_per_iteration
        optimizer = make_optimizer(config.optim, total_updates)
        self.schedule = learning_rate_schedule(config.optim, total_updates)
        self.steps = StepFunctions(graphdef=self.graphdef, params=params, mesh=self.mesh, grpo=g,
                                   optimizer=optimizer, method=self.method, logprob_chunk=m.logprob_chunk,
                                   new_tokens=config.sampler.max_new_tokens, share_prompts=m.share_prompts,
                                   skip_empty_steps=config.optim.skip_empty_steps,
                                   reward_weights=config.reward.component_weights(), frozen=self.frozen.train,
                                   on_policy=config.samples_on_policy)
        self.steps.check_rows(config.data.batch_size * g.num_generations)
        self.sampling = SamplingPolicy(config, params, rollouts=self.rollouts, frozen=self.frozen,
                                       train_mesh=self.mesh, sample_mesh=self.sample_mesh)
        self.sample_shardings = self.sampling.shardings
        # The reference is the initial params (a copy: the current params are donated to every update) until a
        # swap replaces it; without beta there is no reference at all. LoRA's is the base alone (no adapters), or
        # with swaps a frozen copy of the adapters (B = 0: the base exactly), so a swap changes no program.
        self.initial_reference = None
        if g.beta > 0:
            lora_base_only = self.frozen.lora and not g.swap_reference
            self.initial_reference = {"layers": {}} if lora_base_only else self.steps.copy_params(params)
        self.state = TrainState(
            params=params,
            opt_state=self.steps.init_opt_state(params),
            behaviour=None,
            reference=None,  # set only after a swap (then it is checkpointed)
            # On the whole mesh, replicated: the checkpoint restores it with this same sharding.
            rng=replicated_key(config.run.seed, self.mesh),
            iteration=0,
            epoch=0,
            behaviour_version=0,
            data_state=self.data.get_state(),
            counters=RunCounters(),
        )
        base = (m.name, fingerprint(self.frozen.train)) if self.frozen.lora else None
        self.checkpointer = Checkpointer(self.run_dir, config.checkpoint, resolved_config=to_dict(config), base=base)
        self.preemption = PreemptionFlag()
        self.evaluator = None
        if config.run.eval_every or config.run.eval_before:
            self.evaluator = Evaluator(config, self.sampler.replace(mesh=self.mesh), self.tokenizer, scorer=self.scorer)

    # ---------------------------------------------------------------- state

    @property
    def reference(self):
        own = self.state.reference if self.state.reference is not None else self.initial_reference
        return self.frozen.join(own)

    def maybe_resume(self) -> bool:
        """Restore the latest complete checkpoint of the run directory (if any and checkpoint.resume)."""
        if not self.config.checkpoint.resume:
            return False
        target = TrainState(**{**vars(self.state), "behaviour": self.sampling.abstract_copy(self.state.params)})
        restored = self.checkpointer.restore(target)
        if restored is None:
            return False
        self.state = restored
        if restored.reference is not None:  # swapped before: the initial params are no longer the reference
            self.initial_reference = None
        self.sampling.set_data_state(restored.data_state)
        log.info("resumed from iteration %d (epoch %d) in %s", restored.iteration, restored.epoch, self.run_dir)
        return True

    # ---------------------------------------------------------------- loop

    def run(self) -> str:
        """Train until run.iterations (or the data ends); returns "done" or "preempted"."""
        self.maybe_resume()
        start = self.state.iteration
        status = "done"
        self.preemption.install()
        logger = MetricsLogger(self.run_dir, self.config.logging, self.total_iterations, start_iteration=start)
        try:
            while self.state.iteration < self.total_iterations:
                if self.preemption.requested():
                    status = "preempted"
                    logger.write(f"preemption requested: saving at iteration {self.state.iteration} and exiting")
                    break
                if self.state.iteration == 0 and self.config.run.eval_before and self.evaluator is not None:
                    logger.write(f"evaluating the untrained model on {self.evaluator.prompt_count()} held-out prompts")
                    timings = {}
                    before = self._evaluate(timings)
                    logger.log(0, {**before, "time/eval": timings["eval"]})
                    logger.write(f"before training: held-out greedy accuracy {before['eval/greedy_accuracy']:.3f}")
                try:
                    record = self.train_iteration(logger)
                except DataExhausted as e:  # dynamic sampling draws extra batches: the data may end early
                    logger.write(f"stopping: {e}")
                    break
                logger.log(self.state.iteration, record)
            self._save(force=True)
        finally:
            self.preemption.uninstall()
            summary = self.sampling.stop()
            if summary:
                logger.write(summary)
            self.checkpointer.close()
            logger.close()
        return status

    def close(self) -> None:
        """Stop the rollout producer, finish any background checkpoint write and stop the reward workers."""
        self.sampling.stop()
        self.checkpointer.close()
        self.scorer.close()

    def _save(self, force: bool = False) -> float:
        it = self.state.iteration
        if not (force or self.checkpointer.should_save(it, last=it == self.total_iterations)):
            return 0.0
        t = time.perf_counter()
        self.state.data_state = self.sampling.data_state()
        self.checkpointer.save(self.state)
        return time.perf_counter() - t

    def _enter_epoch(self, batch) -> None:
        """A batch of a new epoch: the previous one is complete (paper Algorithm 1, outer loop)."""
        if batch.epoch > self.state.epoch:
            self.state.epoch = batch.epoch
            if self.config.grpo.swap_reference and self.config.grpo.beta > 0:
                self.state.reference = self.steps.copy_params(self.state.params)
                self.initial_reference = None  # not a fourth copy of the params for the rest of the run
                log.info("epoch %d: reference <- current params", batch.epoch)

    def _draw_round(self, sample_params) -> Round | None:
        """Dynamic sampling's next batch of prompts, sampled and scored; None when the data is exhausted."""
        try:
            batch = self.rollouts.next_batch(self.state.iteration)
        except DataExhausted as e:
            log.warning("dynamic sampling: %s", e)
            return None
        self._enter_epoch(batch)
        self.state.rng, key = jax.random.split(self.state.rng)
        prompts = self.rollouts.prompt_arrays(batch, self.state.counters)
        return self.rollouts.sample_round(sample_params, batch, prompts, key)

    def train_iteration(self, logger: MetricsLogger | None = None) -> dict:
        """One iteration of the loop; returns its metrics record (without the iteration number)."""
        c, g, s = self.config, self.config.grpo, self.state
        k, G = s.iteration, g.num_generations
        timings = {}
        t_start = time.perf_counter()

        sampled, sample_params, refreshed, rollout_metrics = self.sampling.first_round(s, k, timings)
        self._enter_epoch(sampled.batch)
        prompt_tokens, prompt_mask, _ = self.rollouts.prompt_arrays(sampled.batch, s.counters, self.mesh)
        if g.shuffles_minibatches:
            s.rng, shuffle_key = jax.random.split(s.rng)
        dynamic = {}
        if g.dynamic_sampling_rounds:  # DAPO: replace zero-variance groups by newly sampled groups with signal
            sampled, dynamic = fill_batch(sampled, functools.partial(self._draw_round, sample_params),
                                          group_size=G,
                                          rounds=g.dynamic_sampling_rounds, oversample=g.dynamic_sampling_oversample,
                                          per_reward=g.advantage_reward_normalisation == "per_reward", mesh=self.mesh)
            prompt_tokens, prompt_mask, _ = self.rollouts.prompt_arrays(sampled.batch, s.counters, self.mesh)
        del sample_params
        batch, out, completions, result = sampled.batch, *sampled.rollout[:3]
        if self.sample_mesh is not self.mesh:  # disaggregated: the samples move to the trainer's devices
            out = jax.device_put(out, jax.tree.map(lambda x: row_sharding(self.mesh, SAMPLE_RULES, x.shape), out))
        timings["sample"] = sampled.rollout.sample_seconds

        t = time.perf_counter()
        reward_table = to_global_rows(sampled.table, self.mesh, TRAIN_RULES, c.data.batch_size * G)  # [R, 1+F]
        timings["reward"] = sampled.rollout.score_seconds + time.perf_counter() - t

        t = time.perf_counter()
        step_batch, _ = self.steps.assemble(prompt_tokens, prompt_mask, out.tokens, out.completion_mask,
                                            out.logprobs, reward_table, out.truncated)
        if g.beta > 0:
            step_batch = step_batch._replace(lp_ref=self.steps.reference_logprobs(self.reference, step_batch))
        if self.steps.lp_k_source == "computed":
            step_batch = step_batch._replace(lp_k=self.steps.logprobs(self.frozen.join(s.params), step_batch))
        if g.m2po_tau is not None:
            step_batch = step_batch._replace(m2po_drop=self.steps.m2po_mask(step_batch))
        jax.block_until_ready(step_batch)
        timings["logprobs"] = time.perf_counter() - t

        t = time.perf_counter()
        update_metrics = []
        for inner in range(g.inner_steps):
            dealt = step_batch
            if inner and g.shuffles_minibatches:  # whole groups re-dealt to the minibatches, from the run's rng
                dealt = self.steps.shuffle_groups(step_batch, jax.random.fold_in(shuffle_key, inner))
            for minibatch in range(g.num_minibatches):
                first = inner == 0 and minibatch == 0
                s.params, s.opt_state, m = self.steps.train_step(s.params, s.opt_state, dealt, jnp.int32(minibatch),
                                                                 jnp.bool_(first), frozen=self.frozen.train)
                update_metrics.append(m)
        update_metrics = jax.device_get(update_metrics)
        timings["update"] = time.perf_counter() - t

        steps_before = s.counters.optimizer_steps
        skipped, empty = count_updates(s.counters, update_metrics, skip_empty=c.optim.skip_empty_steps,
                                        iteration=k + 1)
        s.counters.refresh_requested, why = self.sampling.refresh_policy.request(update_metrics)  # (adaptive v only)
        if why:
            log.info("iteration %d: %s: the behaviour policy refreshes before the next sampling", k + 1, why)
        # The rates of this iteration's first and last applied updates (the schedule counts applied steps only).
        lr = float(self.schedule(steps_before))
        lr_last = float(self.schedule(max(s.counters.optimizer_steps - 1, steps_before)))
        s.iteration = k + 1
        s.data_state = self.sampling.data_state()
        self.sampling.after_iteration(s, timings)
        eval_metrics = self._maybe_eval(timings)
        timings["checkpoint"] = self._save()
        timings["iteration"] = time.perf_counter() - t_start
        record = iteration_metrics(
            update_metrics=update_metrics, reward_table=reward_table, reward_names=c.reward.component_names(),
            result=result, out=out, timings=timings, staleness=k - s.behaviour_version,
            behaviour_is_current=s.behaviour_version == k, lr=lr, lr_last=lr_last, prompt_mask=prompt_mask,
            inner_steps=g.inner_steps,
        )
        record.update(eval_metrics)
        record.update(dynamic)
        record.update(rollout_metrics)
        record.update({"epoch": s.epoch, "behaviour_version": s.behaviour_version, "optim/steps":
                       s.counters.optimizer_steps, "nonfinite/skipped": skipped,
                       "nonfinite/total": s.counters.nonfinite_total, "loss/empty_steps": empty,
                       "behaviour/refreshed": float(refreshed), "behaviour/refreshes": s.counters.behaviour_refreshes})
        if logger is not None and logger.should_dump_samples(s.iteration):
            logger.log_samples(s.iteration, sample_dump(batch, completions, result, g.num_generations))
        if s.counters.nonfinite_in_a_row >= c.run.max_nonfinite_steps:
            self._save(force=True)
            if logger is not None:
                logger.log(s.iteration, record)
            raise TrainingDiverged(
                f"{s.counters.nonfinite_in_a_row} optimiser steps in a row had a NaN/inf loss or gradient "
                f"(run.max_nonfinite_steps={c.run.max_nonfinite_steps}); each was skipped. Stopped after "
                f"saving iteration {s.iteration} to {self.checkpointer.directory}. Lower optim.learning_rate, "
                "check the rewards, or resume from an earlier checkpoint."
            )
        return record

    def _maybe_eval(self, timings: dict) -> dict:
        every, it = self.config.run.eval_every, self.state.iteration
        if self.evaluator is None or (it != self.total_iterations and (not every or it % every)):
            return {}  # evaluates every `eval_every` iterations and after the last one
        return self._evaluate(timings)

    def _evaluate(self, timings: dict) -> dict:
        t = time.perf_counter()
        metrics = self.evaluator.evaluate(self.frozen.join(self.state.params))
        timings["eval"] = time.perf_counter() - t
        return {f"eval/{k}": v for k, v in metrics.items()}
