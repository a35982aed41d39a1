"""Two jobs of different process counts: which rollout process's rows reach which trainer process, and back.

Each job splits a batch's prompts over its own processes in order (the data pipeline's `np.array_split`), so
each process holds one contiguous block of the batch's rows, its groups whole. When one job's process count is a
multiple of the other's, each block of the job with more processes lies inside one block of the other: a
rollout process sends the part of its record that a trainer process trains to that process, for each trainer
process whose block meets its own (`rollout_targets`), and a trainer process joins the parts it gets, in row
order (`trainer_sources`, `join_rollouts`). Weights go the other way: every rollout process takes them from the
first trainer process it sends rows to, so with more rollout processes each trainer process sends to several,
and with more trainer processes some send to none (they still take part in the gathers before each bucket).

Equal counts are the one-to-one case: rollout process i and trainer process i, a whole record each.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jgrpo.rewards.scorer import RewardResult
from jgrpo.rollout.records import Rollout


def link_problem(trainers: int, rollouts: int) -> str | None:
    """Why the two jobs cannot be linked, or None."""
    if max(trainers, rollouts) % min(trainers, rollouts):
        return (f"the trainer job has {trainers} processes and the rollout job {rollouts}: one count must be a "
                "multiple of the other (each process of the larger job then holds rows of one process of the smaller)")
    return None


def rollout_targets(process: int, trainers: int, rollouts: int) -> list[int]:
    """The trainer processes rollout process `process` sends rows to, in row order (the first sends it weights)."""
    if rollouts >= trainers:
        return [process // (rollouts // trainers)]
    per = trainers // rollouts
    return list(range(process * per, (process + 1) * per))


def trainer_sources(process: int, trainers: int, rollouts: int) -> list[int]:
    """The rollout processes trainer process `process` takes rows from, in row order."""
    if rollouts >= trainers:
        per = rollouts // trainers
        return list(range(process * per, (process + 1) * per))
    return [process // (trainers // rollouts)]


def weight_peers(process: int, trainers: int, rollouts: int) -> list[int]:
    """The rollout processes trainer process `process` sends weights to (those whose first target it is)."""
    return [j for j in trainer_sources(process, trainers, rollouts)
            if rollout_targets(j, trainers, rollouts)[0] == process]


def split_rollout(rollout: Rollout, parts: int) -> list[Rollout]:
    """This process's record (its rows as numpy) cut into `parts` records of equal, whole groups, in row order.
    Reward failure counts go with the first part (joined again they add up); the metrics go with every part."""
    prompts = len(rollout.prompts)
    if parts == 1:
        return [rollout]
    if prompts % parts:
        raise ValueError(f"{prompts} prompts do not split into {parts} equal parts")
    rows = len(rollout.completions)
    per, group = prompts // parts, rows // prompts
    out = []
    for p in range(parts):
        cut, prompt_cut = slice(p * per * group, (p + 1) * per * group), slice(p * per, (p + 1) * per)
        prompt_batch = dataclasses.replace(rollout.prompts, **{
            field: getattr(rollout.prompts, field)[prompt_cut]
            for field in ("token_ids", "texts", "questions", "references")})
        s = rollout.scores
        scores = RewardResult(s.total[cut], {k: v[cut] for k, v in s.per_function.items()},
                              {k: v if p == 0 else 0 for k, v in s.failures.items()},
                              {k: v if p == 0 else 0 for k, v in s.timeouts.items()})
        out.append(Rollout(prompt_batch, rollout.samples.map(lambda x, cut=cut: np.asarray(x)[cut]),
                           np.asarray(rollout.rewards)[cut], rollout.completions[cut], scores,
                           rollout.sample_seconds, rollout.score_seconds, dict(rollout.metrics)))
    return out


def join_rollouts(parts: list[Rollout]) -> Rollout:
    """The inverse of `split_rollout`: records of consecutive row blocks as one (the first part's metrics)."""
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    prompts = dataclasses.replace(first.prompts, **{
        field: [x for part in parts for x in getattr(part.prompts, field)]
        for field in ("token_ids", "texts", "questions", "references")})
    samples = jax.tree.map(lambda *rows: np.concatenate([np.asarray(r) for r in rows]), *(p.samples for p in parts))
    scores = RewardResult(
        np.concatenate([p.scores.total for p in parts]),
        {k: np.concatenate([p.scores.per_function[k] for p in parts]) for k in first.scores.per_function},
        {k: sum(p.scores.failures[k] for p in parts) for k in first.scores.failures},
        {k: sum(p.scores.timeouts[k] for p in parts) for k in first.scores.timeouts})
    return Rollout(prompts, samples, np.concatenate([np.asarray(p.rewards) for p in parts]),
                   [c for p in parts for c in p.completions], scores, max(p.sample_seconds for p in parts),
                   max(p.score_seconds for p in parts), dict(first.metrics))
