"""Format reward: the completion is one `<think>...</think>` block followed by one `<answer>...</answer>` block."""

from __future__ import annotations

import re

from jgrpo.rewards.registry import register_reward

_TAGS = ("<think>", "</think>", "<answer>", "</answer>")
_LAYOUT = re.compile(r"\s*<think>.*</think>\s*<answer>.*</answer>\s*", re.DOTALL)


def has_reasoning_format(text: str) -> bool:
    """True for `<think>reasoning</think> <answer>answer</answer>` with each tag exactly once, nothing around it."""
    if any(text.count(tag) != 1 for tag in _TAGS):
        return False
    return _LAYOUT.fullmatch(text) is not None


@register_reward("format")
def format_reward(prompt: str, completion: str, reference: dict) -> float:
    """1 when the completion follows the reasoning/answer tag layout, else 0.

    When the prompt already opens the reasoning block (it ends with `<think>`), the completion continues it.
    """
    if prompt.rstrip().endswith("<think>"):
        completion = "<think>" + completion
    return float(has_reasoning_format(completion))
