"""pass@k and maj@k (jgrpo.rollout.estimators) against hand-derived numbers, ties and missing answers included."""

import itertools
from fractions import Fraction

import numpy as np
import pytest

from jgrpo.rollout.estimators import maj_at_k, majority_index, pass_at_k, summed_by_label, summed_over_prompts


def test_pass_at_k_by_hand():
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # 1 - C(3,2)/C(5,2)
    assert pass_at_k(8, 2, 4) == pytest.approx(1 - 15 / 70)  # 1 - C(6,4)/C(8,4)
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)  # pass@1 is c / n
    assert pass_at_k(4, 0, 2) == 0.0
    assert pass_at_k(4, 3, 2) == 1.0  # one wrong sample: every pair holds a correct one
    assert pass_at_k(4, 4, 4) == 1.0


def test_pass_at_k_is_the_share_of_k_subsets_with_a_correct_sample():
    for n, c, k in [(6, 2, 3), (7, 1, 2), (5, 3, 1), (8, 4, 5)]:
        outcomes = [True] * c + [False] * (n - c)
        subsets = list(itertools.combinations(outcomes, k))
        exact = Fraction(sum(any(s) for s in subsets), len(subsets))
        assert pass_at_k(n, c, k) == pytest.approx(float(exact), abs=1e-12)


@pytest.mark.parametrize("n, c, k", [(3, 1, 4), (3, 1, 0), (3, 4, 1)])
def test_pass_at_k_refuses_impossible_counts(n, c, k):
    with pytest.raises(ValueError, match="pass@k needs"):
        pass_at_k(n, c, k)


def test_majority_vote_with_ties_and_missing_answers():
    assert maj_at_k(["12", "7", "12", None], [True, False, True, False], 4) == 1.0
    # A 2-2 tie goes to the answer that came first.
    assert maj_at_k(["7", "12", "12", "7"], [False, True, True, False], 4) == 0.0
    assert maj_at_k(["12", "7", "7", "12"], [True, False, False, True], 4) == 1.0
    # Only the first k samples vote: 1-1 (the first wins), then 2-1.
    assert maj_at_k(["7", "12", "12"], [False, True, True], 2) == 0.0
    assert maj_at_k(["7", "12", "12"], [False, True, True], 3) == 1.0
    # Samples without an answer do not vote; a prompt where none has one is wrong.
    assert maj_at_k([None, None, "5"], [False, False, True], 3) == 1.0
    assert maj_at_k([None, None], [False, False], 2) == 0.0
    assert majority_index([None, "a", "b", "b"]) == 2
    with pytest.raises(ValueError, match="maj@3 needs k <= the 2 samples"):
        maj_at_k(["1", "2"], [True, False], 3)


def test_sums_over_prompts_by_hand():
    # Two prompts, 4 samples each: 1 and 3 correct. Prompt 0's answers tie 2-2 ("9" first, wrong); prompt 1's
    # majority "4" is right.
    correct = np.asarray([[False, True, False, False], [True, True, False, True]])
    answers = ["9", "7", "9", "7", "4", "4", "5", "4"]
    sums = summed_over_prompts(correct, answers, (1, 2, 4))
    assert sums["pass_at_1"] == pytest.approx(1 / 4 + 3 / 4)
    assert sums["pass_at_2"] == pytest.approx((1 - 3 / 6) + 1.0)  # 1 - C(3,2)/C(4,2); 1 wrong of 4: always
    assert sums["pass_at_4"] == 2.0
    # Prompt 0 votes "9" (wrong) at every k: alone, then in a 1-1 and a 2-2 tie it came first to; prompt 1 "4".
    assert (sums["maj_at_1"], sums["maj_at_2"], sums["maj_at_4"]) == (1.0, 1.0, 1.0)
    assert summed_over_prompts(correct, None, (1,)) == {"pass_at_1": pytest.approx(1.0)}


def test_sums_by_label_by_hand():
    # The same two prompts plus a third (2 of 4 correct, no answers extracted), labelled seen / held-out / seen.
    correct = np.asarray([[False, True, False, False], [True, True, False, True], [True, False, True, False]])
    answers = ["9", "7", "9", "7", "4", "4", "5", "4", None, None, None, None]
    labels = ["held_out/False", "held_out/True", "held_out/False"]
    sums = summed_by_label(correct, answers, (1, 4), labels)
    assert sums["held_out/False/prompts"] == 2 and sums["held_out/True/prompts"] == 1
    assert (sums["held_out/False/correct"], sums["held_out/True/correct"]) == (3, 3)
    assert sums["held_out/False/pass_at_1"] == pytest.approx(1 / 4 + 2 / 4)
    assert sums["held_out/True/pass_at_1"] == pytest.approx(3 / 4)
    assert (sums["held_out/False/pass_at_4"], sums["held_out/True/pass_at_4"]) == (2.0, 1.0)
    # Prompt 0 votes "9" (wrong), prompt 2 has no answer (wrong); prompt 1 votes "4" (right).
    assert (sums["held_out/False/maj_at_4"], sums["held_out/True/maj_at_4"]) == (0.0, 1.0)
    assert summed_by_label(correct, None, (), labels) == {
        "held_out/False/prompts": 2, "held_out/False/correct": 3, "held_out/True/prompts": 1,
        "held_out/True/correct": 3}
