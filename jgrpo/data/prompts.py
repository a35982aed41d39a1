"""Prompt text and token ids from questions, with the tokenizer's chat template; padding to bucketed shapes.

The one owner of three things every entrypoint needs: the chat template (`chat_prompt_text`: a tokenizer
without one is an error, never a silent raw-text prompt), the pad id (`pad_id_for`) and left padding to
bucketed widths (`left_pad`, `bucketed_length`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from jgrpo.config.errors import DataError
from jgrpo.data.formats import Example


class PromptEncoder:
    """question -> chat-formatted prompt text and token ids, ending with the assistant turn's opening.

    `instruction_suffix` is appended to the question verbatim (start it with a space or newline). Prompts
    longer than `max_length` tokens are dropped, or with `truncate` keep their last `max_length` tokens
    (the end holds the question's tail and the assistant header, which the model needs most).
    """

    def __init__(self, tokenizer, *, max_length: int, system_prompt: str | None = None,
                 instruction_suffix: str = "", truncate: bool = False):
        _require_chat_template(tokenizer)
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.system_prompt = system_prompt
        self.instruction_suffix = instruction_suffix
        self.truncate = truncate

    def render(self, question: str) -> str:
        return chat_prompt_text(self.tokenizer, question + self.instruction_suffix, self.system_prompt)

    def encode(self, examples: Sequence[Example]) -> tuple[list[dict], list[str], int]:
        """(records, dropped, truncated): one record {question, text, token_ids, reference} per kept example,
        where each dropped prompt came from ("path: line 7, 300 tokens") and how many were truncated."""
        texts = [self.render(ex.question) for ex in examples]
        # The template already wrote the special tokens (BOS, turn markers); do not add them a second time.
        all_ids = self.tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
        records, dropped, truncated = [], [], 0
        for ex, text, ids in zip(examples, texts, all_ids, strict=True):
            if len(ids) > self.max_length:
                if not self.truncate:
                    dropped.append(f"{ex.where or repr(ex.question[:40])}, {len(ids)} tokens")
                    continue
                ids = ids[-self.max_length :]
                text = self.tokenizer.decode(ids)
                truncated += 1
            records.append({"question": ex.question, "text": text, "token_ids": list(ids),
                            "reference": ex.reference})
        return records, dropped, truncated


def _require_chat_template(tokenizer) -> None:
    if not getattr(tokenizer, "chat_template", None):
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise DataError(f"the tokenizer of {name} has no chat template; jgrpo builds every prompt with the "
                         "model's chat template (use an instruct/chat model, or set tokenizer.chat_template)")


def chat_prompt_text(tokenizer, message: str, system: str | None = None) -> str:
    """One user turn (and an optional system turn) in the tokenizer's chat template, with the assistant header."""
    _require_chat_template(tokenizer)
    turns = ([{"role": "system", "content": system}] if system is not None else []) + [
        {"role": "user", "content": message}]
    return tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)


def render_chat(tokenizer, messages, *, tools=None, generation_prompt: bool = True) -> str:
    """Any conversation in the tokenizer's chat template (`tools`: the function schemas, for templates that render
    them); with the assistant header when `generation_prompt`. Multi-turn episodes render through this."""
    _require_chat_template(tokenizer)
    return tokenizer.apply_chat_template(list(messages), tools=tools, tokenize=False,
                                         add_generation_prompt=generation_prompt)


def chat_prompt_ids(tokenizer, message: str, system: str | None = None) -> list[int]:
    """Token ids of `chat_prompt_text` (the template wrote the special tokens: none are added again)."""
    return tokenizer(chat_prompt_text(tokenizer, message, system), add_special_tokens=False)["input_ids"]


def pad_id_for(tokenizer) -> int:
    """The id that fills padding and the slots after a completion's stop token: the tokenizer's pad id, else
    its EOS id (a token the model reads as an end), else 0. Padding is always masked, so the value never
    reaches a loss or an attention score; one choice keeps every program's inputs identical."""
    for candidate in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if isinstance(candidate, (list, tuple)):
            candidate = candidate[0] if candidate else None
        if candidate is not None:
            return int(candidate)
    return 0


def bucketed_length(length: int, bucket: int) -> int:
    """`length` rounded up to a multiple of `bucket` (at least one bucket), so jit sees few distinct shapes."""
    if bucket < 1:
        raise ValueError(f"bucket must be a positive integer, got {bucket}")
    return max(1, math.ceil(length / bucket)) * bucket


def left_pad(token_ids: Sequence[Sequence[int]], *, pad_id: int, bucket: int = 1, length: int | None = None,
             max_length: int | None = None, truncate: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Left-pad prompts to P = `length`, else the longest rounded up to `bucket` (never past `max_length`):
    (tokens [B, P] int32, mask [B, P] bool).

    Left padding puts every prompt's last token in the same column, where generation starts; mask is True on
    real tokens. A prompt longer than `max_length` is an error naming it, or with `truncate` keeps its last
    `max_length` tokens (the end of a chat prompt holds the question and the assistant header).
    """
    if not token_ids:
        raise ValueError("no prompts to pad")
    rows = [list(ids) for ids in token_ids]
    for i, row in enumerate(rows):
        if not row:
            raise DataError(f"prompt {i} is empty")
        if max_length is not None and len(row) > max_length:
            if not truncate:
                raise DataError(f"prompt {i} has {len(row)} tokens, more than max_prompt_length={max_length} "
                                "(shorten it, raise the limit, or enable left truncation)")
            rows[i] = row[-max_length:]
    longest = max(len(row) for row in rows)
    width = bucketed_length(longest, bucket) if length is None else length
    if length is None and max_length is not None:  # the bucket never pushes past the limit things were sized for
        width = min(width, max(max_length, longest))
    if longest > width:
        raise ValueError(f"a prompt has {longest} tokens, more than the padded length {width}")
    tokens = np.full((len(rows), width), pad_id, np.int32)  # [B, P]
    mask = np.zeros((len(rows), width), bool)  # [B, P]
    for i, row in enumerate(rows):
        tokens[i, width - len(row):] = row
        mask[i, width - len(row):] = True
    return tokens, mask
