"""Correctness rewards for question/answer data: GSM8K, exact numeric match, and math equivalence (math-verify).

Each is `fn(prompt, completion, reference) -> float` in {0, 1}; `reference["answer"]` is the gold answer.
Each also carries `fn.answer(completion) -> str | None`: the normalised answer it grades (None: it finds none),
which majority voting (maj@k, `jgrpo.rollout.estimators`) counts. A custom reward function can carry one too.
"""

from __future__ import annotations

from fractions import Fraction

from math_verify import parse, verify

from jgrpo.rewards.extract import (
    after_hashes,
    answer_tag,
    boxed_contents,
    final_answer_region,
    find_numbers,
    last_number,
    reference_number,
    to_fraction,
)
from jgrpo.rewards.registry import register_reward


def _gold(reference: dict):
    if "answer" not in reference:
        raise KeyError(f"reference has no 'answer' field (fields: {sorted(reference)})")
    return reference["answer"]


def _gold_number(reference: dict):
    gold = _gold(reference)
    value = reference_number(gold)
    if value is None:
        raise ValueError(f"reference answer {gold!r} is not a number")
    return value


def _number_answer(number: str | None) -> str | None:
    """A number as a normalised answer: "1,234", "$1234" and "1234.00" are all "1234", "0.5" is "1/2"."""
    value = to_fraction(number) if number is not None else None
    return None if value is None else str(value)


def gsm8k_answer(completion: str) -> str | None:
    """The number after the completion's last `####`, else its last number."""
    marked = after_hashes(completion)
    numbers = find_numbers(marked) if marked is not None else []
    return _number_answer(numbers[0] if numbers else last_number(completion))


@register_reward("gsm8k")
def gsm8k_reward(prompt: str, completion: str, reference: dict) -> float:
    """1 when the number after the completion's last `####` (else its last number) equals the gold answer."""
    gold = _gold_number(reference)
    predicted = gsm8k_answer(completion)
    return float(predicted is not None and Fraction(predicted) == gold)


gsm8k_reward.answer = gsm8k_answer


def numeric_answer(completion: str) -> str | None:
    """The last number of the stated final answer (`<answer>` tag, else the last `\\boxed{}`, else the text after
    `####`), else the completion's last number."""
    region = final_answer_region(completion)
    predicted = last_number(region) if region is not None else None
    return _number_answer(predicted if predicted is not None else last_number(completion))


@register_reward("exact_numeric")
def exact_numeric_reward(prompt: str, completion: str, reference: dict) -> float:
    """1 when the last number of the stated final answer equals the gold number exactly.

    The final answer is the `<answer>` tag, else the last `\\boxed{}`, else the text after `####`; when the
    completion has none of these, its last number. "1,234", "$1234" and "1234.00" all equal 1234.
    """
    gold = _gold_number(reference)
    predicted = numeric_answer(completion)
    return float(predicted is not None and Fraction(predicted) == gold)


exact_numeric_reward.answer = numeric_answer


def _parse_gold(gold: str):
    if "$" in gold or "\\boxed" in gold or "\\(" in gold or "\\[" in gold:
        return parse(gold)
    return parse(f"${gold}$") or parse(gold)


@register_reward("math_verify")
def math_verify_reward(prompt: str, completion: str, reference: dict) -> float:
    """1 when the completion's answer is mathematically equivalent to the gold answer (math-verify).

    The answer is the `<answer>` tag when there is one, else the last `\\boxed{}` (math-verify alone would read
    several boxes as a set), else whatever math-verify extracts from the whole completion.
    """
    gold = _gold(reference)
    gold = str(after_hashes(gold) or gold) if isinstance(gold, str) else str(gold)
    gold_parsed = _parse_gold(gold.strip())
    if not gold_parsed:
        raise ValueError(f"math-verify cannot parse the reference answer {gold!r}")
    predicted = _math_prediction(completion)
    if not predicted:
        return 0.0
    return float(verify(gold_parsed, predicted))


def _math_prediction(completion: str):
    """What math-verify parses as the completion's answer: the `<answer>` tag's last box or the tag itself,
    else the last `\\boxed{}`, else whatever it finds in the whole completion (an empty list: nothing)."""
    tagged = answer_tag(completion)
    boxes = boxed_contents(tagged if tagged is not None else completion)
    if boxes:
        return parse(f"\\boxed{{{boxes[-1]}}}")
    return parse(tagged) if tagged is not None else parse(completion)


def math_answer(completion: str) -> str | None:
    """math-verify's reading of the answer in its canonical form ("\\frac{1}{2}", "0.5" and "1/2" vote together)."""
    predicted = _math_prediction(completion)
    return str(predicted[0]) if predicted else None


math_verify_reward.answer = math_answer
