"""Held-out evaluation of any params: greedy accuracy and pass@1 over k samples on the test split (with an
environment: of episodes, with their turns and tool-call validity).

Used by the trainer (`run.eval_every`, and before the first iteration with `run.eval_before`) and by
`python -m jgrpo.eval`. Metric names are legal TensorBoard tags: `pass_at_1`, `pass_at_k` (any of k correct).
"""

from __future__ import annotations

import collections
import dataclasses

import jax
import numpy as np

from jgrpo.config import Config
from jgrpo.data import bucketed_length, build_prompt_iterator
from jgrpo.parallel.host_arrays import global_max, global_sum
from jgrpo.parallel.mesh import replicated_key
from jgrpo.rewards import RewardScorer
from jgrpo.rollout.collect import Scoring, prompt_arrays, sample_and_score
from jgrpo.rollout.episodes import EpisodeRunner
from jgrpo.sampling.methods import SamplingMethod
from jgrpo.sampling.sampler import Sampler


class Evaluator:
    """Greedy accuracy and pass@1 over k samples on the test split, for any params of the model.

    `sampler` is the run's (its model, stop and pad ids, mesh, `sampler.*` options and sampling method): greedy
    evaluation runs it at temperature 0 with one sample per prompt, pass@k with `run.eval_samples` samples."""

    def __init__(self, config: Config, sampler: Sampler, tokenizer, scorer: RewardScorer | None = None,
                 episodes: EpisodeRunner | None = None):
        if config.run.eval_batch_size:
            config = dataclasses.replace(config, data=dataclasses.replace(config.data,
                                                                          batch_size=config.run.eval_batch_size))
        self.config, self.tokenizer, self.mesh = config, tokenizer, sampler.mesh
        self.data = list(build_prompt_iterator(config, tokenizer, split="test", shuffle=False, epochs=1,
                                               drop_remainder=False))
        self.batch_size = config.data.batch_size
        longest = max(len(ids) for batch in self.data for ids in batch.token_ids)
        # One width and one (padded) batch size for every test batch: two compiled samplers, whatever the data.
        self.width = global_max(bucketed_length(longest, config.sampler.prompt_bucket))
        self.pad_id = sampler.pad_id
        self.scorer = scorer or RewardScorer(config.reward)
        self._own_scorer = scorer is None
        self.scoring = Scoring(tokenizer, self.scorer, config.reward, config.completion_tokens)
        self.modes = {"greedy": sampler.replace(method=SamplingMethod(temperature=0.0), num_samples=1)}
        if config.run.eval_samples:
            self.modes["sampled"] = sampler.replace(num_samples=config.run.eval_samples)
        # Multi-turn (env.name): each mode's episodes, on the run's environment workers.
        self.episodes = {mode: episodes.using(s) for mode, s in self.modes.items()} if episodes else None

    def prompt_count(self) -> int:
        """Test prompts over all processes."""
        return int(global_sum(np.asarray([sum(len(batch) for batch in self.data)], np.int64))[0])

    def close(self) -> None:
        if self._own_scorer:
            self.scorer.close()

    def evaluate(self, params) -> dict[str, float]:
        totals, self.env_counts = {}, collections.Counter()
        for mode, sampler in self.modes.items():
            correct, reward_sum, any_correct, prompts = self._run(params, sampler, mode)
            totals[mode] = global_sum(np.asarray([correct, reward_sum, any_correct, prompts], np.float64))
        g_correct, _, _, prompts = totals["greedy"]
        metrics = {"greedy_accuracy": float(g_correct / prompts), "prompts": int(prompts)}
        if self.episodes is not None:  # greedy episodes: turns, and how many tool calls were well-formed
            counts = self.env_counts
            calls = counts["tool_calls"]
            errors = sum(v for k, v in counts.items() if k.startswith("tool_call_errors/"))
            metrics.update({"turns": counts["turns"] / counts["episodes"],
                            "tool_call_validity": calls / (calls + errors) if calls + errors else 0.0})
        if "sampled" in totals:
            s_correct, s_reward, s_any, _ = totals["sampled"]
            k = self.modes["sampled"].num_samples
            metrics.update({"pass_at_1": float(s_correct / (prompts * k)), f"pass_at_{k}": float(s_any / prompts),
                            "reward_mean": float(s_reward / (prompts * k))})
        return metrics

    def _run(self, params, sampler: Sampler, mode: str):
        correct = reward_sum = any_correct = prompts = 0.0
        key = replicated_key(self.config.run.seed + 1, self.mesh)
        local_size = self.batch_size // jax.process_count()
        for index, batch in enumerate(self.data):
            real = len(batch)
            key_i = jax.random.fold_in(key, index)
            if self.episodes is not None:
                rollout = self._episodes(params, self.episodes[mode], batch, local_size, key_i, mode == "greedy")
                first = rollout.scores.total[:real * sampler.num_samples]  # the environment's and the functions'
            else:
                ids = list(batch.token_ids) + [batch.token_ids[-1]] * (local_size - real)  # pad a short last batch
                padded = prompt_arrays(ids, width=self.width, pad_id=self.pad_id, mesh=self.mesh,
                                       global_prompts=self.batch_size)
                rollout = sample_and_score(sampler, params, padded, batch, key_i, self.scoring)
                first = rollout.scores.per_function[self.config.reward.functions[0]]
            first = first.reshape(real, sampler.num_samples) >= 1.0
            correct += first.sum()
            any_correct += first.any(axis=1).sum()
            reward_sum += rollout.scores.total[:real * sampler.num_samples].sum()
            prompts += real
        return correct, reward_sum, any_correct, prompts

    def _episodes(self, params, runner: EpisodeRunner, batch, local_size: int, key, count: bool):
        """A test batch's episodes (a short last batch padded with its last prompt, those rows not counted)."""
        short = local_size - len(batch)
        padded = dataclasses.replace(batch, **{f: list(getattr(batch, f)) + [getattr(batch, f)[-1]] * short
                                               for f in ("token_ids", "texts", "questions", "references")})
        opened = runner.open(padded)
        longest = max(len(ids) for ids in opened.token_ids)
        prompts = prompt_arrays(opened.token_ids, width=global_max(bucketed_length(longest,
                                                                                   self.config.sampler.prompt_bucket)),
                                pad_id=self.pad_id, mesh=self.mesh, global_prompts=self.batch_size)
        out, episodes = runner.run(params, prompts, opened, key)
        if count:
            for ep in episodes[:len(batch) * runner.group]:
                self.env_counts.update({"episodes": 1, "turns": ep.turns, "tool_calls": ep.counts["tool_calls"]})
                self.env_counts.update({k: v for k, v in ep.counts.items() if k.startswith("tool_call_errors/")})
        return self.scoring.score_episodes(out, episodes, opened, self.mesh, "zero_reward")
