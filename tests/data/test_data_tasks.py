"""Built-in tasks: deterministic by seed, disjoint train/test, and every reference verified by its reward."""

import re

import pytest

from jgrpo.config import DataConfig
from jgrpo.data import load_examples
from jgrpo.data.tasks import arithmetic_examples, countdown_examples
from jgrpo.rewards import get_reward


def _questions(examples):
    return [e.question for e in examples]


@pytest.mark.parametrize("make", [
    lambda split, seed, count: arithmetic_examples(digits=2, operators="+-*", split=split, count=count, seed=seed),
    lambda split, seed, count: arithmetic_examples(digits=6, operators="*", split=split, count=count, seed=seed),
    lambda split, seed, count: countdown_examples(num_numbers=3, split=split, count=count, seed=seed),
], ids=["arithmetic-enumerated", "arithmetic-sampled", "countdown"])
def test_deterministic_by_seed_and_disjoint_splits(make):
    train = make("train", 0, 600)
    assert train == make("train", 0, 600)
    assert _questions(make("train", 1, 600)) != _questions(train)
    assert len(set(_questions(train))) == 600
    # The split is a property of the problem, not of the seed: no seed can leak test problems into training.
    tests = set(_questions(make("test", 0, 100))) | set(_questions(make("test", 7, 100)))
    trains = set(_questions(train)) | set(_questions(make("train", 7, 600)))
    assert len(tests) > 100 and tests.isdisjoint(trains)


def test_arithmetic_answers_are_exact_and_verified_by_the_reward():
    reward = get_reward("exact_numeric")
    examples = arithmetic_examples(digits=3, operators="+-*", split="train", count=500, seed=3)
    ops = set()
    for ex in examples:
        a, op, b = re.fullmatch(r"What is (\d+) ([-+*]) (\d+)\?", ex.question).groups()
        ops.add(op)
        a, b = int(a), int(b)
        assert 100 <= a <= 999 and 100 <= b <= 999
        expected = {"+": a + b, "-": a - b, "*": a * b}[op]
        assert ex.reference["answer"] == str(expected)
        assert reward(ex.question, f"The result is {expected:,}.", ex.reference) == 1.0
        assert reward(ex.question, f"The result is {expected + 1}.", ex.reference) == 0.0
    assert ops == {"+", "-", "*"}


def test_countdown_items_are_solvable_and_verified_by_the_reward():
    reward = get_reward("countdown")
    for n in (2, 3, 4):
        for ex in countdown_examples(num_numbers=n, split="test", count=100, seed=0):
            ref = ex.reference
            assert len(ref["numbers"]) == n and str(ref["numbers"]) in ex.question
            assert f"equals {ref['target']}." in ex.question and 1 <= ref["target"] <= 999
            assert reward(ex.question, f"<answer>{ref['solution']}</answer>", ref) == 1.0
            assert reward(ex.question, f"<answer>{ref['target']}</answer>", ref) == 0.0  # numbers unused


def test_builtin_tasks_through_the_data_config(caplog):
    config = DataConfig(source="arithmetic", arithmetic_digits=1, arithmetic_operators="+", num_examples=1000,
                        num_test_examples=5)
    train, skipped = load_examples(config)
    assert skipped == 0 and len(train) == 90  # 100 one-digit sums, 1 in 10 reserved for test: ~90 remain
    assert "only 90 distinct train problems" in caplog.text
    test, _ = load_examples(config, "test")
    assert len(test) == 5 and set(_questions(test)).isdisjoint(_questions(train))
    countdown = DataConfig(source="countdown", countdown_numbers=4, num_examples=20, task_seed=5)
    assert load_examples(countdown)[0] == countdown_examples(num_numbers=4, split="train", count=20, seed=5)
    with pytest.raises(ValueError, match="splits 'train' and 'test'"):
        load_examples(config, "validation")
