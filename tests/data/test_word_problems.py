"""The built-in word problems (data.source: word_problems): every answer re-derived from the question's own text
by a hand-written formula per template, held-out templates only in the test split, no problem in both splits."""

import re

import pytest

from jgrpo.data.word_problems import HELD_OUT, TEMPLATES, word_problem_examples

# Each template's answer from the numbers as they appear in its question, in order.
BY_HAND = {
    "buy": lambda n, price: n * price,
    "share": lambda total, friends: total // friends,
    "found_gave": lambda had, found, gave: had + found - gave,
    "travel": lambda speed, hours: speed * hours,
    "boxes": lambda boxes, per, taken: boxes * per - taken,
    "savings": lambda weekly, weeks, spent: weekly * weeks - spent,
    "price_rise": lambda price, rise, n: (price + rise) * n,
    "teams": lambda students, size, each: students // size * each,
    "ages": lambda age, older, later: age + older + later,
    "recipe": lambda cups, servings, wanted: cups * wanted // servings,
    "pages": lambda total, per_day, days: total - per_day * days,
    "change": lambda n, price, bill: bill - n * price,
    "two_legs": lambda first, hours, second, more: first * hours + second * more,
    "shopping": lambda n, price, m, cost, bill: bill - (n * price + m * cost),
}


@pytest.mark.parametrize("split", ["train", "test"])
def test_every_answer_is_the_questions_arithmetic(split):
    examples = word_problem_examples(split=split, count=400, seed=3)
    assert len(examples) == 400
    for e in examples:
        numbers = [int(x) for x in re.findall(r"\d+", e.question)]
        answer = e.reference["answer"]
        assert answer == BY_HAND[e.reference["template"]](*numbers), e.question
        assert isinstance(answer, int) and answer >= 0
    assert {e.reference["template"] for e in examples} == (
        {t.name for t in TEMPLATES} if split == "test" else {t.name for t in TEMPLATES} - HELD_OUT)


def test_held_out_templates_never_reach_training_and_the_splits_are_disjoint():
    train = word_problem_examples(split="train", count=2000, seed=0)
    test = word_problem_examples(split="test", count=200, seed=0)
    assert not {e.reference["template"] for e in train} & HELD_OUT
    assert not any(e.reference["held_out"] for e in train)
    assert sum(e.reference["held_out"] for e in test) == 100  # half the test split: new phrasing
    assert all(e.reference["held_out"] == (e.reference["template"] in HELD_OUT) for e in test)
    assert not {e.question for e in train} & {e.question for e in test}
    # Another seed draws other problems, but never moves a seen template's problem across the split.
    other = word_problem_examples(split="train", count=2000, seed=1)
    assert not {e.question for e in other} & {e.question for e in test}
    assert [e.question for e in word_problem_examples(split="test", count=200, seed=0)] == [e.question for e in test]
    assert {e.reference["steps"] for e in train} == {e.reference["steps"] for e in test} == {1, 2, 3}
