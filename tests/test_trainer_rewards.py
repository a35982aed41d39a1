"""A dense reward a tiny random model can learn within a few iterations, used by the trainer tests.

Reward workers import it by path ("test_trainer_rewards:space_fraction"): tests/ is on sys.path under
pytest, and the entrypoint tests put it on PYTHONPATH of their subprocesses.
"""

import pytest


def space_fraction(prompt: str, completion: str, reference: dict) -> float:
    """Fraction of the completion's characters that are spaces; 0 for an empty completion.

    Random text from a random model scores ~0.1-0.2 with real spread inside a group (GRPO needs variance),
    and a policy can push it up just by preferring space-led tokens: trivially learnable.
    """
    return completion.count(" ") / len(completion) if completion else 0.0


@pytest.mark.parametrize(("completion", "want"), [("", 0.0), ("ab", 0.0), (" a b", 0.5), ("    ", 1.0)])
def test_space_fraction(completion, want):
    assert space_fraction("q", completion, {}) == want


def length_parity(prompt: str, completion: str, reference: dict) -> float:
    """1 when the completion has an odd number of characters: random text gives real variance in every group."""
    return float(len(completion) % 2)


@pytest.mark.parametrize(("completion", "want"), [("", 0.0), ("a", 1.0), ("ab", 0.0)])
def test_length_parity(completion, want):
    assert length_parity("q", completion, {}) == want


def parity_on_even_answers(prompt: str, completion: str, reference: dict) -> float:
    """`length_parity` where the reference answer is even, 0 elsewhere: about half the groups have no variance."""
    return float(len(completion) % 2) if int(reference["answer"]) % 2 == 0 else 0.0


@pytest.mark.parametrize(("answer", "completion", "want"), [("4", "a", 1.0), ("4", "ab", 0.0), ("3", "a", 0.0)])
def test_parity_on_even_answers(answer, completion, want):
    assert parity_on_even_answers("q", completion, {"answer": answer}) == want
