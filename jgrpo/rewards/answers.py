"""Correctness rewards for question/answer data: GSM8K, exact numeric match, and math equivalence (math-verify).

Each is `fn(prompt, completion, reference) -> float` in {0, 1}; `reference["answer"]` is the gold answer.
"""

from __future__ import annotations

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


@register_reward("gsm8k")
def gsm8k_reward(prompt: str, completion: str, reference: dict) -> float:
    """1 when the number after the completion's last `####` (else its last number) equals the gold answer."""
    gold = _gold_number(reference)
    marked = after_hashes(completion)
    numbers = find_numbers(marked) if marked is not None else []
    predicted = numbers[0] if numbers else last_number(completion)
    return float(predicted is not None and to_fraction(predicted) == gold)


@register_reward("exact_numeric")
def exact_numeric_reward(prompt: str, completion: str, reference: dict) -> float:
    """1 when the last number of the stated final answer equals the gold number exactly.

    The final answer is the `<answer>` tag, else the last `\\boxed{}`, else the text after `####`; when the
    completion has none of these, its last number. "1,234", "$1234" and "1234.00" all equal 1234.
    """
    gold = _gold_number(reference)
    region = final_answer_region(completion)
    predicted = last_number(region) if region is not None else None
    if predicted is None:
        predicted = last_number(completion)
    return float(predicted is not None and to_fraction(predicted) == gold)


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
    tagged = answer_tag(completion)
    boxes = boxed_contents(tagged if tagged is not None else completion)
    if boxes:
        predicted = parse(f"\\boxed{{{boxes[-1]}}}")
    else:
        predicted = parse(tagged) if tagged is not None else parse(completion)
    if not predicted:
        return 0.0
    return float(verify(gold_parsed, predicted))
