"""Prompts -> sampled, decoded and scored completions: the one path the trainer and the evaluator share.

`prompt_arrays` pads this process's prompts to the run's width and makes them global arrays in the sampling
layout; `sample_and_score` samples G completions per prompt on the mesh, and `Scoring.score` decodes this
process's rows on the host, scores them with the reward functions (which never raise: see `jgrpo.rewards`) and
tables the rewards the advantages are computed from. The result is one `Rollout` record (`records`).
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jgrpo.config import RewardConfig
from jgrpo.data.prompts import left_pad
from jgrpo.parallel.host_arrays import gather_json, local_rows, to_global_rows
from jgrpo.parallel.mesh import SAMPLE_RULES
from jgrpo.rewards import RewardScorer
from jgrpo.rewards.overlong import overlong_punishment
from jgrpo.rewards.scorer import RewardResult
from jgrpo.rollout.records import Rollout
from jgrpo.sampling.sampler import Prompts, SampleOutput, Sampler

__all__ = ["Scoring", "prompt_arrays", "reward_table", "sample_and_score"]


def prompt_arrays(token_ids: Sequence[Sequence[int]], *, width: int, pad_id: int, mesh,
                  global_prompts: int) -> Prompts:
    """This process's prompts, left-padded to `width` -> global prompts (tokens [B, width], mask [B, width])."""
    tokens, mask = left_pad(token_ids, pad_id=pad_id, length=width)
    return Prompts(to_global_rows(tokens, mesh, SAMPLE_RULES, global_prompts),
                   to_global_rows(mask, mesh, SAMPLE_RULES, global_prompts))


@dataclasses.dataclass(frozen=True)
class Scoring:
    """How sampled rows become rewards: decoded with the tokenizer, scored by the reward functions, tabled as the
    advantages want them (`reward_table`)."""

    tokenizer: Any
    scorer: RewardScorer
    reward: RewardConfig
    max_new_tokens: int

    def score(self, samples: SampleOutput, batch, tokens: np.ndarray, lengths: np.ndarray,
              sample_seconds: float = 0.0) -> Rollout:
        """`samples` as one record, with this process's rows of them (`tokens`, `lengths`: host arrays, the
        rows of `batch`'s prompts in order) decoded and scored."""
        start = time.perf_counter()
        completions = self.tokenizer.batch_decode(
            [row[:n] for row, n in zip(tokens, np.asarray(lengths), strict=True)], skip_special_tokens=True)
        scores = self.scorer.score(batch.questions, completions, batch.references)
        table = reward_table(scores, np.asarray(lengths), self.reward, self.max_new_tokens)
        return Rollout(batch, samples, table, completions, scores, sample_seconds, time.perf_counter() - start)


    def score_episodes(self, out: SampleOutput, episodes, batch, mesh, on_failure: str,
                       sample_seconds: float = 0.0) -> Rollout:
        """Played episodes as one record: `out` (numpy rows, `EpisodeRunner.run`) as global arrays with `valid`
        (False for failed episodes under `env.on_failure: mask`); each episode's reward the sum of its
        environment's rewards, plus `reward.functions` on its last turn when the last step gave none; a failed
        episode's reward 0. `completions` are the whole trajectories (special tokens shown)."""
        start = time.perf_counter()
        R = len(episodes)
        last = [ep.last_text for ep in episodes]
        G = R // len(batch)
        scores = self.scorer.score([q for q in batch.questions for _ in range(G)], last,
                                   [r for r in batch.references for _ in range(G)])
        by_functions = np.asarray([not ep.final_reward for ep in episodes])
        failed = np.asarray([ep.failed is not None for ep in episodes])
        env_reward = np.asarray([ep.reward for ep in episodes], np.float32)
        total = np.where(failed, 0.0, env_reward + np.where(by_functions, scores.total, 0.0)).astype(np.float32)
        per_function = {f: np.where(failed | ~by_functions, 0.0, v).astype(np.float32)
                        for f, v in scores.per_function.items()}
        scores = RewardResult(total, {**per_function, "env": np.where(failed, 0.0, env_reward)}, scores.failures,
                              scores.timeouts)
        out = out._replace(truncated=np.asarray([ep.truncated for ep in episodes]),
                           valid=~failed if on_failure == "mask" else np.ones(R, bool))
        samples = out.map(lambda x: to_global_rows(np.asarray(x), mesh, SAMPLE_RULES, R * jax.process_count()))
        completions = self.tokenizer.batch_decode([row[:n] for row, n in zip(out.tokens, out.lengths, strict=True)],
                                                  skip_special_tokens=False)
        table = reward_table(scores, np.asarray(out.lengths), self.reward, self.max_new_tokens)
        return Rollout(batch, samples, table, completions, scores, sample_seconds, time.perf_counter() - start,
                       episode_metrics(episodes))


def episode_metrics(episodes) -> dict:
    """env/*: per episode means (turns, reward, truncated, failed) and per batch sums (pauses, tool calls, the
    environments' counters, failures by kind), and the time the hosts waited for environments: over the episodes
    of every process (each plays its own rows'; a collective with several)."""
    counts = collections.Counter()  # the environments' own counters (`info`), and the runner's
    for ep in episodes:
        counts.update(ep.counts)
    totals = collections.Counter(episodes=len(episodes), turns=sum(ep.turns for ep in episodes),
                                 pauses=sum(ep.pauses for ep in episodes), reward=sum(ep.reward for ep in episodes),
                                 truncated=sum(ep.truncated for ep in episodes),
                                 failed=sum(ep.failed is not None for ep in episodes))
    if jax.process_count() > 1:
        parts = gather_json([{k: float(v) for k, v in c.items()} for c in (totals, counts)])
        totals, counts = collections.Counter(), collections.Counter()  # update, not +: keeps zeros and negatives
        for part_totals, part_counts in parts:
            totals.update(part_totals)
            counts.update(part_counts)
    n = totals["episodes"]
    metrics = {"env/turns": totals["turns"] / n, "env/pauses": float(totals["pauses"]),
               "env/reward": totals["reward"] / n, "env/truncated": totals["truncated"] / n,
               "env/failed": totals["failed"] / n,
               "env/tool_calls": float(counts.pop("tool_calls", 0)), "env/wait_s": float(counts.pop("wait_s", 0.0))}
    metrics.update({f"env/{k}": float(v) for k, v in counts.items()})
    return metrics


def sample_and_score(sampler: Sampler, params, prompts: Prompts, batch, key: jax.Array, scoring: Scoring,
                     version: int = 0) -> Rollout:
    """Sample the sampler's G completions of every prompt and score this process's first len(batch) prompts'.

    `batch` (questions, references) may hold fewer prompts than this process's rows of `prompts`: the rows past
    it are padding (a short last evaluation batch) and are neither decoded nor scored.
    """
    start = time.perf_counter()
    samples = sampler.generate(params, prompts, key, version)
    rows = len(batch) * sampler.num_samples
    tokens, lengths = local_rows(samples.tokens)[:rows], local_rows(samples.lengths)[:rows]
    return scoring.score(samples, batch, tokens, lengths, time.perf_counter() - start)


def reward_table(scores: RewardResult, lengths: np.ndarray, reward: RewardConfig, max_new_tokens: int) -> np.ndarray:
    """This process's rows of [total, each reward function, overlong punishment (when on)], float32: the
    rewards the advantages are computed from (`advantages.group_advantages`). `lengths`: the rows' tokens."""
    columns = [scores.per_function[f] for f in reward.functions]
    total = scores.total
    if reward.overlong_buffer:
        punishment = overlong_punishment(lengths[:len(total)], max_new_tokens=max_new_tokens,
                                         buffer=reward.overlong_buffer, penalty=reward.overlong_penalty)
        columns.append(punishment)
        total = total + punishment
    return np.stack([total] + columns, axis=1).astype(np.float32)
