"""Prompt text and token ids from questions, with the tokenizer's chat template; padding to bucketed shapes."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from jgrpo.data.formats import Example


class PromptEncoder:
    """question -> chat-formatted prompt text and token ids, ending with the assistant turn's opening.

    `instruction_suffix` is appended to the question verbatim (start it with a space or newline). Prompts
    longer than `max_length` tokens are dropped, or with `truncate` keep their last `max_length` tokens
    (the end holds the question's tail and the assistant header, which the model needs most).
    """

    def __init__(self, tokenizer, *, max_length: int, system_prompt: str | None = None,
                 instruction_suffix: str = "", truncate: bool = False):
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("the tokenizer has no chat template; prompts are built with apply_chat_template")
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.system_prompt = system_prompt
        self.instruction_suffix = instruction_suffix
        self.truncate = truncate

    def render(self, question: str) -> str:
        messages = [{"role": "user", "content": question + self.instruction_suffix}]
        if self.system_prompt is not None:
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def encode(self, examples: Sequence[Example]) -> tuple[list[dict], int, int]:
        """(records, dropped, truncated): one record {question, text, token_ids, reference} per kept example."""
        texts = [self.render(ex.question) for ex in examples]
        # The template already wrote the special tokens (BOS, turn markers); do not add them a second time.
        all_ids = self.tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
        records, dropped, truncated = [], 0, 0
        for ex, text, ids in zip(examples, texts, all_ids, strict=True):
            if len(ids) > self.max_length:
                if not self.truncate:
                    dropped += 1
                    continue
                ids = ids[-self.max_length :]
                text = self.tokenizer.decode(ids)
                truncated += 1
            records.append({"question": ex.question, "text": text, "token_ids": list(ids),
                            "reference": ex.reference})
        return records, dropped, truncated


def bucketed_length(length: int, bucket: int) -> int:
    """`length` rounded up to a multiple of `bucket` (at least one bucket), so jit sees few distinct shapes."""
    return max(1, math.ceil(length / bucket)) * bucket


def left_pad(token_ids: Sequence[Sequence[int]], *, pad_id: int, bucket: int = 1,
             length: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Left-pad prompts to P = bucketed longest (or `length`): (tokens [B, P] int32, mask [B, P] bool).

    Left padding puts every prompt's last token in the same column, where generation starts; mask is True on
    real tokens.
    """
    longest = max((len(ids) for ids in token_ids), default=0)
    width = bucketed_length(longest, bucket) if length is None else length
    if longest > width:
        raise ValueError(f"a prompt has {longest} tokens, more than the padded length {width}")
    tokens = np.full((len(token_ids), width), pad_id, np.int32)  # [B, P]
    mask = np.zeros((len(token_ids), width), bool)  # [B, P]
    for row, ids in enumerate(token_ids):
        if ids:
            tokens[row, width - len(ids) :] = ids
            mask[row, width - len(ids) :] = True
    return tokens, mask
