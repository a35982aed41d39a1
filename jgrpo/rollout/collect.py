"""Prompts -> sampled, decoded and scored completions: the one path the trainer and the evaluator share.

`prompt_arrays` pads this process's prompts to the run's width and makes them global arrays in the sampling
layout; `sample_and_score` samples G completions per prompt on the mesh, decodes this process's rows on the
host and scores them with the reward functions (which never raise: see `jgrpo.rewards`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import NamedTuple

import jax
import numpy as np

from jgrpo.config import RewardConfig
from jgrpo.data.prompts import left_pad
from jgrpo.parallel.host_arrays import local_rows, to_global_rows
from jgrpo.parallel.mesh import SAMPLE_RULES
from jgrpo.rewards import RewardScorer
from jgrpo.rewards.overlong import overlong_punishment
from jgrpo.rewards.scorer import RewardResult
from jgrpo.sampling.sampler import Prompts, SampleOutput, Sampler


class Rollout(NamedTuple):
    output: SampleOutput  # global arrays on the mesh; rows b*G .. b*G+G-1 are prompt b's samples
    completions: list[str]  # this process's scored rows, decoded
    scores: RewardResult  # of those rows
    sample_seconds: float
    score_seconds: float


def prompt_arrays(token_ids: Sequence[Sequence[int]], *, width: int, pad_id: int, mesh,
                  global_prompts: int) -> Prompts:
    """This process's prompts, left-padded to `width` -> global prompts (tokens [B, width], mask [B, width])."""
    tokens, mask = left_pad(token_ids, pad_id=pad_id, length=width)
    return Prompts(to_global_rows(tokens, mesh, SAMPLE_RULES, global_prompts),
                   to_global_rows(mask, mesh, SAMPLE_RULES, global_prompts))


def sample_and_score(sampler: Sampler, params, prompts: Prompts, batch, key: jax.Array, *, tokenizer,
                     scorer: RewardScorer) -> Rollout:
    """Sample the sampler's G completions of every prompt and score this process's first len(batch) prompts'.

    `batch` (questions, references) may hold fewer prompts than this process's rows of `prompts`: the rows past
    it are padding (a short last evaluation batch) and are neither decoded nor scored.
    """
    start = time.perf_counter()
    out = sampler.generate(params, prompts, key)
    rows = len(batch) * sampler.num_samples
    tokens, lengths = local_rows(out.tokens)[:rows], local_rows(out.lengths)[:rows]
    sampled = time.perf_counter()
    return score_rows(out, tokens, lengths, batch, tokenizer=tokenizer, scorer=scorer, sample_seconds=sampled - start)


def score_rows(output: SampleOutput, tokens: np.ndarray, lengths: np.ndarray, batch, *, tokenizer,
               scorer: RewardScorer, sample_seconds: float) -> Rollout:
    """Decode and score this process's rows (`tokens`, `lengths`, of `batch`'s prompts in order) of `output`."""
    start = time.perf_counter()
    completions = tokenizer.batch_decode([row[:n] for row, n in zip(tokens, np.asarray(lengths), strict=True)],
                                         skip_special_tokens=True)
    scores = scorer.score(batch.questions, completions, batch.references)
    return Rollout(output, completions, scores, sample_seconds, time.perf_counter() - start)


def reward_table(scores: RewardResult, output: SampleOutput, reward: RewardConfig, max_new_tokens: int) -> np.ndarray:
    """This process's rows of [total, each reward function, overlong punishment (when on)], float32: the
    rewards the advantages are computed from (`advantages.group_advantages`)."""
    columns = [scores.per_function[f] for f in reward.functions]
    total = scores.total
    if reward.overlong_buffer:
        lengths = local_rows(output.lengths)[:len(total)]
        punishment = overlong_punishment(lengths, max_new_tokens=max_new_tokens, buffer=reward.overlong_buffer,
                                         penalty=reward.overlong_penalty)
        columns.append(punishment)
        total = total + punishment
    return np.stack([total] + columns, axis=1).astype(np.float32)

