"""Two jobs of different process counts: the links between their processes, and a record cut and joined."""

import numpy as np
import pytest

from jgrpo.data import PromptBatch
from jgrpo.rewards.scorer import RewardResult
from jgrpo.rollout.process_links import (
    join_rollouts,
    link_problem,
    rollout_targets,
    split_rollout,
    trainer_sources,
    weight_peers,
)
from jgrpo.rollout.records import Rollout
from jgrpo.sampling.state import SampleOutput

COUNTS = [(1, 1), (2, 2), (1, 2), (2, 1), (1, 4), (4, 1), (2, 8), (8, 2), (4, 16), (16, 4)]


@pytest.mark.parametrize("trainers, rollouts", COUNTS)
def test_each_trainer_process_gets_exactly_its_rows_and_each_rollout_process_one_weight_source(trainers, rollouts):
    batch = np.arange(trainers * rollouts * 3)  # prompts; both jobs split them in order (np.array_split)
    trainer_rows, rollout_rows = np.array_split(batch, trainers), np.array_split(batch, rollouts)
    received = {i: [] for i in range(trainers)}
    for j in range(rollouts):  # each rollout process cuts its rows in equal parts, one per target, in order
        targets = rollout_targets(j, trainers, rollouts)
        for i, part in zip(targets, np.array_split(rollout_rows[j], len(targets)), strict=True):
            received[i].append((j, part))
        # One weight source per rollout process: the first trainer process it sends rows to.
        assert [i for i in range(trainers) if j in weight_peers(i, trainers, rollouts)] == [targets[0]]
    for i in range(trainers):  # a trainer process joins its parts in the order of its sources: its own rows
        assert [j for j, _ in received[i]] == trainer_sources(i, trainers, rollouts)
        np.testing.assert_array_equal(np.concatenate([part for _, part in received[i]]), trainer_rows[i])


def test_counts_that_do_not_divide_are_refused_naming_both():
    assert link_problem(4, 16) is None and link_problem(3, 1) is None
    assert "trainer job has 2 processes and the rollout job 3" in link_problem(2, 3)


def _rollout(prompts: int, group: int) -> Rollout:
    rows, rng = prompts * group, np.random.default_rng(0)
    samples = SampleOutput(tokens=rng.integers(0, 9, (rows, 5)), logprobs=rng.normal(size=(rows, 5)),
                           completion_mask=rng.random((rows, 5)) > 0.3, lengths=rng.integers(1, 5, rows),
                           truncated=rng.random(rows) > 0.5, loss_mask=rng.random((rows, 5)) > 0.3,
                           version=rng.integers(0, 3, (rows, 5)), prompt_routing=rng.integers(0, 8, (rows, 4, 2, 2)))
    batch = PromptBatch([[i, i + 1] for i in range(prompts)], [f"t{i}" for i in range(prompts)],
                        [f"q{i}" for i in range(prompts)], [{"answer": str(i)} for i in range(prompts)], 1, 7)
    scores = RewardResult(rng.normal(size=rows), {"f": rng.normal(size=rows)}, {"f": 3}, {"f": 1})
    return Rollout(batch, samples, rng.normal(size=(rows, 2)), [f"c{r}" for r in range(rows)], scores, 1.5, 0.5,
                   {"rollout/discarded_on_resume": 2.0})


def test_a_record_split_in_row_blocks_and_joined_again_is_the_record():
    whole = _rollout(prompts=4, group=3)
    parts = split_rollout(whole, 2)
    assert [len(p.prompts) for p in parts] == [2, 2] and [len(p.completions) for p in parts] == [6, 6]
    assert parts[1].completions[0] == "c6" and parts[1].prompts.texts[0] == "t2"
    assert parts[1].samples.valid is None and parts[1].samples.tokens.shape == (6, 5)
    assert [p.scores.failures["f"] for p in parts] == [3, 0]  # counted once
    joined = join_rollouts(parts)
    assert joined.prompts == whole.prompts and joined.completions == whole.completions
    for got, want in zip(joined.samples, whole.samples, strict=True):
        assert (got is None) == (want is None)
        if got is not None:
            np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(joined.rewards, whole.rewards)
    np.testing.assert_array_equal(joined.scores.total, whole.scores.total)
    np.testing.assert_array_equal(joined.scores.per_function["f"], whole.scores.per_function["f"])
    assert (joined.scores.failures, joined.scores.timeouts) == ({"f": 3}, {"f": 1})
    assert joined.metrics == whole.metrics and joined.sample_seconds == 1.5
    with pytest.raises(ValueError, match="3 prompts do not split into 2"):
        split_rollout(_rollout(prompts=3, group=2), 2)
