"""DAPO dynamic sampling (docs/algorithm.md §15): fill the batch with groups that carry a learning signal.

A group whose G rewards are all equal has zero advantage everywhere: masked (paper eq. 8) it only shrinks
the batch. DAPO (arXiv 2503.14476 §3.2) samples more prompts until the batch is full of groups with signal.
Here, after the iteration's first round of B prompts, while any process is short of groups with signal, up
to `grpo.dynamic_sampling_rounds` extra rounds each draw `grpo.dynamic_sampling_oversample` more batches of
B prompts from the data iterator and sample them with the same behaviour params. The batch keeps the groups
with signal in the order they were sampled; if it is still short, it is topped up with the first round's
zero-variance groups, which stay masked (and counted): every program keeps its shapes.

Each process selects among its own prompts (the rows it decoded and scored), so with several processes the
batch is the union of per-process fills; every process takes the same number of rounds. The data iterator
advances past every drawn batch and the checkpoint keeps that state, so a resumed run draws what the
uninterrupted one draws. This is the entry point the rollout engine serves for dynamic sampling.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from jgrpo.parallel.host_arrays import global_max, global_sum, local_rows, to_global_rows
from jgrpo.parallel.mesh import SAMPLE_RULES
from jgrpo.rewards.scorer import RewardResult
from jgrpo.rl.routing_replay import right_aligned
from jgrpo.rollout.records import Rollout
from jgrpo.sampling.state import SampleOutput


def groups_with_signal(table: np.ndarray, group_size: int, per_reward: bool) -> np.ndarray:
    """[groups] bool: the group's rewards differ (the complement of `advantages.group_advantages`'s zero variance:
    the total reward, or with `per_reward` any reward column, is not constant in the group)."""
    columns = table[:, 1:] if per_reward else table[:, :1]
    grouped = columns.reshape(-1, group_size, columns.shape[1])
    return ~np.all(grouped == grouped[:, :1], axis=(1, 2))


def fill_batch(first: Rollout, draw: Callable[[], Rollout | None], *, group_size: int, rounds: int, oversample: int,
               per_reward: bool, mesh) -> tuple[Rollout, dict]:
    """The iteration's batch: `first` with its zero-variance groups replaced by groups with signal from extra
    rounds (`draw()` samples the next batch of prompts; None = the data is exhausted). Returns the batch (its
    samples as global arrays in the sampling layout) and `dynamic/*` metrics."""
    wanted = len(first.prompts)
    drawn = [first]
    signal = [groups_with_signal(first.rewards, group_size, per_reward)]
    extra = 0
    exhausted = False

    def short_anywhere() -> bool:  # every process runs the same sampling programs, so all take the same rounds
        have = sum(int(s.sum()) for s in signal)
        return global_max(max(0, wanted - have)) > 0

    while extra < rounds and not exhausted and short_anywhere():
        extra += 1
        for _ in range(oversample):
            more = draw()
            if more is None:
                exhausted = True
                break
            drawn.append(more)
            signal.append(groups_with_signal(more.rewards, group_size, per_reward))
    chosen = [(r, i) for r, s in enumerate(signal) for i in np.flatnonzero(s)][:wanted]
    short = wanted - len(chosen)
    chosen += [(0, i) for i in np.flatnonzero(~signal[0])[:short]]  # masked zero-variance groups, counted
    counts = global_sum(np.asarray([len(first.prompts), int(signal[0].sum()), short], np.int64))  # over processes
    metrics = {"dynamic/extra_rounds": float(extra), "dynamic/prompts_sampled": float(counts[0] * len(drawn)),
               "dynamic/first_round_signal_frac": float(counts[1] / counts[0]),
               "dynamic/short_groups": float(counts[2]), "dynamic/data_exhausted": float(exhausted)}
    return _gather(drawn, chosen, group_size, mesh), metrics


def _gather(drawn: list[Rollout], chosen: list[tuple[int, int]], group_size: int, mesh) -> Rollout:
    """The chosen (round, group) pairs of this process as one Rollout; samples rebuilt as global arrays."""
    rows = [(r, i * group_size + j) for r, i in chosen for j in range(group_size)]

    def pick(values_of):  # values_of(round) -> this process's row-indexed values of that round
        values = [values_of(d) for d in drawn]
        return [values[r][row] for r, row in rows]

    def stacked(values_of):
        return np.stack(pick(values_of))

    def prompt_records(values_of):  # rounds' prompts may be padded to different widths: align to the widest
        width = max(values_of(d).shape[1] for d in drawn)
        return stacked(lambda d: right_aligned(values_of(d), width))

    first = drawn[0]
    prompts = dataclasses.replace(
        first.prompts, **{field: [getattr(drawn[r].prompts, field)[i] for r, i in chosen]
                          for field in ("token_ids", "texts", "questions", "references")},
        epoch=drawn[-1].prompts.epoch)
    global_rows = first.samples.tokens.shape[0]
    samples = SampleOutput(*(None if getattr(first.samples, f) is None else to_global_rows(
        (prompt_records if f == "prompt_routing" else stacked)(lambda d, f=f: local_rows(getattr(d.samples, f))),
        mesh, SAMPLE_RULES, global_rows) for f in SampleOutput._fields))
    scores = RewardResult(
        total=stacked(lambda d: d.scores.total),
        per_function={name: stacked(lambda d, n=name: d.scores.per_function[n]) for name in first.scores.per_function},
        failures={name: sum(d.scores.failures[name] for d in drawn) for name in first.scores.failures},
        timeouts={name: sum(d.scores.timeouts[name] for d in drawn) for name in first.scores.timeouts},
    )
    return Rollout(prompts, samples, stacked(lambda d: d.rewards), pick(lambda d: d.completions), scores,
                   sum(d.sample_seconds for d in drawn), sum(d.score_seconds for d in drawn))
