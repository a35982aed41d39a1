"""The GRPO loop of docs/algorithm.md §5 (paper Algorithm 1): on-policy and off-policy, with checkpoints and metrics.

    behaviour <- current <- init ; reference <- init            (reference only when beta > 0)
    for iteration k = 0, 1, ...:
      collect          prompts <- next batch of B (a new epoch first swaps the reference when grpo.swap_reference);
                       completions, lp_alpha <- sample(behaviour, prompts, G each); rewards <- verifiable
                       rewards (host). jgrpo.rollout.collector: sync, window (v iterations sampled at once) or
                       async; DAPO dynamic sampling adds prompts until the groups carry signal
      build the batch  A <- group advantages; lp_ref <- logprobs(reference) if beta > 0; lp_k <- logprobs(current)
                       when a later update needs it (jgrpo.training.steps)
      update           repeat i times, for each of the minibatches: current <- optimiser step
      conclude         the metrics record; behaviour <- current when iteration k + 1 must sample from a fresh
                       copy (every v iterations, or adaptively from Theorem 1: jgrpo.rl.behaviour_refresh; the
                       only weight sync); held-out evaluation; checkpoint

Shapes stay fixed so nothing recompiles after the first iteration: B*G rows, max_new_tokens, and a prompt
width that only grows (to the next `sampler.prompt_bucket` multiple) when a longer prompt arrives; the
width is part of the checkpoint so a resumed run compiles the same programs.
"""

from __future__ import annotations

import logging
import time

import jax
from etils import epath

from jgrpo.config import Config, ConfigError
from jgrpo.config.loading import to_dict
from jgrpo.parallel.fingerprint import fingerprint
from jgrpo.parallel.mesh import make_meshes, replicated, replicated_key
from jgrpo.rollout.collector import Collected, Collector
from jgrpo.rollout.episodes import EpisodeRunner
from jgrpo.rollout.evaluator import Evaluator
from jgrpo.rollout.remote import RolloutJobLost
from jgrpo.rollout.run_parts import load_run_parts
from jgrpo.rollout.sampling_weights import Refresh, SamplingWeights
from jgrpo.rollout.scoring import Scoring
from jgrpo.rollout.sources import DataExhausted, RolloutSource, sample_root
from jgrpo.training.checkpoint import PreemptionFlag, RunCounters, TrainState, latest_data_state
from jgrpo.training.checkpoint_split import make_checkpointer
from jgrpo.training.iteration_record import IterationFacts, count_updates, iteration_metrics, sample_dump
from jgrpo.training.metrics_log import MetricsLogger
from jgrpo.training.preflight import check_before_loading
from jgrpo.training.programs import step_functions
from jgrpo.training.step_batch import StepBatch

log = logging.getLogger(__name__)


class TrainingDiverged(RuntimeError):
    """Too many optimiser steps in a row had a non-finite loss or gradient."""


class Trainer:
    """Owns the model, data, rewards, state and sinks of one run; `run()` trains to `run.iterations`."""

    def __init__(self, config: Config):
        self.config = config
        check_before_loading(config)  # the cheap checks first: a bad invocation fails before any model loads
        # The trainer's mesh, and the sampler's: the same one, or disjoint sub-meshes (`mesh.rollout_devices`).
        self.meshes = make_meshes(config.mesh)
        if config.rollout.mode == "async" and config.rollout.role == "both" and jax.process_count() > 1:
            raise ConfigError(f"rollout.mode=async in one job needs one process (this run has "
                              f"{jax.process_count()}): the producer thread's programs would reach the processes in "
                              "different orders. Run two jobs instead (rollout.role: trainer and rollout)")
        params = self._load()
        g = config.grpo
        self.total_iterations = min(config.run.iterations, len(self.data))
        self.shuffles, self.reward_names = g.shuffles_minibatches, config.reward.component_names()
        if self.total_iterations < config.run.iterations:
            log.warning("the data has %d batches (data.epochs=%d), fewer than run.iterations=%d: stopping there",
                        len(self.data), config.data.epochs, config.run.iterations)
        self.steps, self.schedule = step_functions(config, graphdef=self.graphdef, params=params, mesh=self.mesh,
                                                   method=self.sampler.method, iterations=self.total_iterations,
                                                   frozen=self.frozen.train)
        root = jax.jit(lambda: sample_root(config.run.seed), out_shardings=replicated(self.sample_mesh))()
        scoring = Scoring(self.tokenizer, self.scorer, config.reward, config.completion_tokens)
        self.episodes = (EpisodeRunner.from_config(config, sampler=self.sampler, tokenizer=self.tokenizer)
                         if config.env.on else None)  # rows are multi-turn episodes with an environment
        source = RolloutSource(config, data=self.data, sampler=self.sampler, scoring=scoring, root=root,
                               episodes=self.episodes)
        weights = SamplingWeights(config, params, frozen=self.frozen, train_mesh=self.mesh,
                                  sample_mesh=self.sample_mesh)
        self.collector = Collector(config, source=source, weights=weights, train_mesh=self.mesh)
        # The reference is the initial params (a copy: the current params are donated to every update) until a
        # swap replaces it; without beta there is no reference at all. LoRA's is the base alone (no adapters), or
        # with swaps a frozen copy of the adapters (B = 0: the base exactly), so a swap changes no program.
        self.initial_reference = None
        if g.beta > 0:
            lora_base_only = self.frozen.lora and not g.swap_reference
            self.initial_reference = {"layers": {}} if lora_base_only else self.steps.copy_params(params)
        self.state = TrainState(params=params, opt_state=self.steps.init_opt_state(params), behaviour=None,
                                reference=None,  # set only after a swap (then it is checkpointed)
                                rng=replicated_key(config.run.seed, self.mesh),  # restored with this sharding
                                iteration=0, epoch=0, behaviour_version=0, data_state=self.data.get_state(),
                                counters=RunCounters())
        # (a LoRA base's fingerprint where the trainer's processes hold it: only they write checkpoints)
        holds = any(d.process_index == jax.process_index() for d in self.mesh.devices.flat)
        base = (config.model.name, fingerprint(self.frozen.train)) if self.frozen.lora and holds else None
        self.checkpointer = make_checkpointer(self.run_dir, config.checkpoint, self.mesh,
                                              resolved_config=to_dict(config), base=base)
        self.evaluator, self.eval_episodes = None, self.episodes
        if config.run.eval_every or config.run.eval_before:
            if self.episodes is not None and config.rollout.mode == "async" and config.rollout.role == "both":
                # The producer thread plays its episodes while an evaluation plays others: each its own workers.
                self.eval_episodes = EpisodeRunner.from_config(config, sampler=self.sampler, tokenizer=self.tokenizer)
            self.evaluator = Evaluator(config, self.sampler.replace(mesh=self.mesh), self.tokenizer, scorer=self.scorer,
                                       episodes=self.eval_episodes)

    def _load(self):
        """Tokenizer, data, rewards, then the model and its sampler (`load_run_parts`); returns the params that
        train."""
        c = self.config

        def check_resume(data):
            if c.checkpoint.resume and (saved := latest_data_state(self.run_dir)) is not None:
                data.check_state(saved)

        parts = load_run_parts(c, self.mesh, self.sample_mesh, check_resume)
        self.parts = parts._replace(params=None)  # the params live in the state (each update donates them)
        return parts.params

    # The run's parts (`rollout.run_parts.RunParts`), by name.

    @property
    def tokenizer(self):
        return self.parts.tokenizer

    @property
    def data(self):
        """The prompt iterator."""
        return self.parts.data

    @property
    def scorer(self):
        return self.parts.scorer

    @property
    def graphdef(self):
        return self.parts.graphdef

    @property
    def model_config(self):
        return self.parts.model_config

    @property
    def frozen(self):
        """The LoRA base (`models.frozen_base.FrozenBase`; nothing frozen without LoRA)."""
        return self.parts.frozen

    @property
    def sampler(self):
        return self.parts.sampler

    @property
    def mesh(self):
        """The trainer's mesh."""
        return self.meshes[0]

    @property
    def sample_mesh(self):
        """The sampler's mesh: the trainer's, or disjoint devices (`mesh.rollout_devices`)."""
        return self.meshes[1]

    @property
    def weights(self):
        """The params that sample and when they refresh (`rollout.sampling_weights.SamplingWeights`), which the
        collector holds."""
        return self.collector.weights

    @property
    def run_dir(self) -> epath.Path:
        """The run's folder: a local one or a bucket (gs://...)."""
        return epath.Path(self.config.run.output_dir)

    # ---------------------------------------------------------------- state

    @property
    def reference(self):
        """The reference policy's whole params (LoRA: its adapters, if any, joined with the base)."""
        return self.frozen.join(self._reference_own())

    def _reference_own(self):
        return self.state.reference if self.state.reference is not None else self.initial_reference

    def maybe_resume(self) -> bool:
        """Restore the latest complete checkpoint of the run directory (if any and checkpoint.resume)."""
        if not self.config.checkpoint.resume:
            return False
        target = TrainState(**{**vars(self.state), "behaviour": self.weights.abstract_copy(self.state.params)})
        restored = self.checkpointer.restore(target)
        if restored is None:
            return False
        self.state = restored
        if restored.reference is not None:  # swapped before: the initial params are no longer the reference
            self.initial_reference = None
        self.collector.set_data_state(restored.data_state)
        self.collector.set_stream(restored.rollout_stream)
        log.info("resumed from iteration %d (epoch %d) in %s", restored.iteration, restored.epoch, self.run_dir)
        return True

    # ---------------------------------------------------------------- loop

    def run(self) -> str:
        """Train until run.iterations (or the data ends); returns "done" or "preempted"."""
        self.maybe_resume()
        status, run_over = "done", False
        preemption = PreemptionFlag().install()
        logger = MetricsLogger(self.run_dir, self.config.logging, self.total_iterations,
                               start_iteration=self.state.iteration, run_config=to_dict(self.config))
        try:
            while self.state.iteration < self.total_iterations:
                if preemption.requested():
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
                except RolloutJobLost:  # two jobs: the rollout job stayed away; nothing trained is lost
                    self._save(force=True)
                    raise
                logger.log(self.state.iteration, record)
            self._save(force=True)
            run_over = status == "done"
        finally:
            preemption.uninstall()
            summary = self.collector.stop(run_over)  # (two jobs: the rollout job waits for a resume unless over)
            if summary:
                logger.write(summary)
            self.checkpointer.close()
            logger.close()
        return status

    def close(self) -> None:
        """Stop the rollout producer, finish any background checkpoint write and stop the reward workers."""
        self.collector.stop()
        self.checkpointer.close()
        self.scorer.close()
        if self.episodes is not None:
            self.episodes.close()
        if self.eval_episodes is not self.episodes:  # one-job async: the evaluator's own environment workers
            self.eval_episodes.close()

    def train_iteration(self, logger: MetricsLogger | None = None) -> dict:
        """One iteration of the loop (the module doc; paper Algorithm 1); returns its metrics record."""
        timings, started = {}, time.perf_counter()
        shuffle_key = self._split_rng() if self.shuffles else None  # before dynamic sampling's keys
        collected = self.collect(timings)
        step_batch = self.build_step_batch(collected, timings)
        update_metrics = self.update(step_batch, shuffle_key, timings)
        return self.conclude(collected, update_metrics, timings, started, logger)

    def collect(self, timings: dict) -> Collected:
        """This iteration's prompts, sampled by the behaviour policy and scored (the rollout room); a batch of a
        new epoch first completes the previous one."""
        collected = self.collector.collect(self.state, timings)
        self._refresh(collected.refresh)
        self.state.rng, self.state.behaviour_version = collected.rng, collected.version
        self._enter_epoch(collected.rollout.prompts.epoch)
        return collected

    def build_step_batch(self, collected: Collected, timings: dict) -> StepBatch:
        """The update's batch: the collected prompts, samples and rewards, and the log-probs it needs."""
        start = time.perf_counter()
        batch = self.steps.build(*collected.inputs, reference=self._reference_own(), current=self.state.params,
                                 frozen=self.frozen.train)
        timings["logprobs"] = time.perf_counter() - start
        return batch

    def update(self, batch: StepBatch, shuffle_key, timings: dict) -> list[dict]:
        """grpo.inner_steps passes over the batch, each grpo.num_minibatches optimiser steps; their metrics."""
        s, start = self.state, time.perf_counter()
        s.params, s.opt_state, update_metrics = self.steps.update(s.params, s.opt_state, batch, shuffle_key,
                                                                  frozen=self.frozen.train)
        timings["update"] = time.perf_counter() - start
        return update_metrics

    def conclude(self, collected: Collected, update_metrics: list[dict], timings: dict, started: float,
                 logger: MetricsLogger | None) -> dict:
        """After the updates: counters, behaviour <- current when iteration k + 1 needs a fresh copy (the one
        place this is decided), evaluation, checkpoint, and iteration k's record."""
        c, g, s = self.config, self.config.grpo, self.state
        k, version = s.iteration, collected.version
        refreshes, steps_before = s.counters.behaviour_refreshes, s.counters.optimizer_steps
        skipped, empty = count_updates(s.counters, update_metrics, skip_empty=c.optim.skip_empty_steps,
                                       iteration=k + 1)
        # The rates of this iteration's first and last applied updates (the schedule counts applied steps only).
        lr = float(self.schedule(steps_before))
        lr_last = float(self.schedule(max(s.counters.optimizer_steps - 1, steps_before)))
        s.iteration = k + 1
        after = self.collector.after_update(s, update_metrics, s.iteration == self.total_iterations, timings)
        self._refresh(after.refresh)
        s.counters.refresh_requested = after.pending  # after the last iteration, for a run resumed to go on
        eval_metrics = self._maybe_eval(timings)
        timings["checkpoint"] = self._save()
        timings["iteration"] = time.perf_counter() - started
        facts = IterationFacts(self.reward_names, timings, staleness=k - version,
                               behaviour_is_current=version == k, lr=lr, lr_last=lr_last, inner_steps=g.inner_steps)
        inputs = collected.inputs
        record = iteration_metrics(collected.rollout, update_metrics, facts, inputs.rewards, inputs.prompt_mask)
        record.update({**eval_metrics, **collected.rollout.metrics, **collected.metrics, "epoch": s.epoch,
                       "behaviour_version": version,
                       "optim/steps": s.counters.optimizer_steps, "nonfinite/skipped": skipped,
                       "nonfinite/total": s.counters.nonfinite_total, "loss/empty_steps": empty,
                       "behaviour/refreshed": float(self.weights.copy_kind == "behaviour" and version == k),
                       "behaviour/refreshes": refreshes})
        if logger is not None and logger.should_dump_samples(s.iteration):
            logger.log_samples(s.iteration, sample_dump(collected.rollout, g.num_generations))
        self._check_finite(record, logger)
        return record

    # ---------------------------------------------------------------- helpers of the loop

    def _refresh(self, refresh: Refresh | None) -> None:
        """Store a behaviour refresh (`SamplingWeights.refresh_for`) in the state, which the trainer owns."""
        if refresh is not None:
            s = self.state
            s.behaviour, s.behaviour_version = refresh.behaviour, refresh.version
            s.counters.behaviour_refreshes += 1
            s.counters.refresh_requested = 0  # (a checkpoint of an earlier version may hold a pending request)

    def _split_rng(self) -> jax.Array:
        self.state.rng, key = jax.random.split(self.state.rng)
        return key

    def _check_finite(self, record: dict, logger: MetricsLogger | None) -> None:
        """max_nonfinite_steps skipped updates in a row stop the run, after a checkpoint."""
        s, c = self.state, self.config
        if s.counters.nonfinite_in_a_row < c.run.max_nonfinite_steps:
            return
        self._save(force=True)
        if logger is not None:
            logger.log(s.iteration, record)
        raise TrainingDiverged(
            f"{s.counters.nonfinite_in_a_row} optimiser steps in a row had a NaN/inf loss or gradient "
            f"(run.max_nonfinite_steps={c.run.max_nonfinite_steps}); each was skipped. Stopped after "
            f"saving iteration {s.iteration} to {self.checkpointer.directory}. Lower optim.learning_rate, "
            "check the rewards, or resume from an earlier checkpoint."
        )

    def _save(self, force: bool = False) -> float:
        it = self.state.iteration
        if not (force or self.checkpointer.should_save(it, last=it == self.total_iterations)):
            return 0.0
        t = time.perf_counter()
        self.state.data_state = self.collector.data_state()
        self.state.rollout_stream = self.collector.stream_snapshot(it)  # (in flight: the sampler's state)
        self.checkpointer.save(self.state)
        self.state.rollout_stream = None
        return time.perf_counter() - t

    def _enter_epoch(self, epoch: int) -> None:
        """A batch of a new epoch: the previous one is complete (paper Algorithm 1, outer loop)."""
        if epoch > self.state.epoch:
            self.state.epoch = epoch
            if self.config.grpo.swap_reference and self.config.grpo.beta > 0:
                self.state.reference = self.steps.copy_params(self.state.params)
                self.initial_reference = None  # not a fourth copy of the params for the rest of the run
                log.info("epoch %d: reference <- current params", epoch)

    def _maybe_eval(self, timings: dict) -> dict:
        every, it = self.config.run.eval_every, self.state.iteration
        if self.evaluator is None or (it != self.total_iterations and (not every or it % every)):
            return {}  # evaluates every `eval_every` iterations and after the last one
        # In between, on the first run.eval_prompts test prompts; after the last iteration, on all of them.
        return self._evaluate(timings, prompts=0 if it == self.total_iterations else self.config.run.eval_prompts)

    def _evaluate(self, timings: dict, prompts: int = 0) -> dict:
        t = time.perf_counter()
        metrics = self.evaluator.evaluate(self.frozen.join(self.state.params), prompts=prompts)
        timings["eval"] = time.perf_counter() - t
        return {f"eval/{k}": v for k, v in metrics.items()}
