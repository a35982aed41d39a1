"""The record a rollout returns: one batch of prompts, sampled and scored, per token and per row.

`samples` is the sampler's record (`jgrpo.sampling.state.SampleOutput`), global arrays on the sampling mesh with
rows b*G .. b*G+G-1 the group of prompt b: per token [R, N] the tokens, the loss mask (tokens the sampler drew),
lp_alpha (their log-probs under the sampling distribution) and the weights version that drew each one; per row
[R] the lengths and whether the row was truncated. The rest is this process's view of its own rows: its prompts,
the decoded completions, the reward functions' scores and the reward table the advantages are computed from.

The training step is built from this record as a whole (`StepFunctions.assemble(prompts, rollout.samples,
rewards)`): a per-token field the sampler adds (environment masks, routing ids, packing segments) reaches the
step batch through it, without another argument on the way.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jgrpo.data import PromptBatch
from jgrpo.rewards.scorer import RewardResult
from jgrpo.sampling.state import SampleOutput


@dataclasses.dataclass
class Rollout:
    prompts: PromptBatch  # this process's prompts, in row-group order
    samples: SampleOutput  # global arrays: per token [R, N], per row [R]
    rewards: np.ndarray  # [rows, 1 + F] float32, this process's rows: total, each reward column (`reward_table`)
    completions: list[str]  # this process's rows, decoded
    scores: RewardResult  # of those rows
    sample_seconds: float
    score_seconds: float
    metrics: dict = dataclasses.field(default_factory=dict)  # env/* of multi-turn episodes
