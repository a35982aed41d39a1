"""Prompts -> sampled, decoded and scored completions: the one path the trainer and the evaluator share.

`prompt_arrays` pads this process's prompts to the run's width and makes them global arrays in the sampling
layout; `sample_and_score` samples G completions per prompt on the mesh, and `Scoring.score` decodes this
process's rows on the host, scores them with the reward functions (which never raise: see `jgrpo.rewards`) and
tables the rewards the advantages are computed from. The result is one `Rollout` record (`records`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jgrpo.config import RewardConfig
from jgrpo.data.prompts import left_pad
from jgrpo.parallel.host_arrays import local_rows, to_global_rows
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
