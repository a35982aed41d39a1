"""Messages -> token ids for a multi-turn episode, appending only the new tokens: nothing sampled is re-tokenized.

An episode's token sequence is the prompt's ids, then for each turn the ids the sampler drew and the ids
appended after them. The appended ids are the *delta*: what the chat template writes after the assistant's
content when the environment's messages follow (the turn close, e.g. `<|im_end|>\\n`, the messages, the next
assistant header), minus the stop token the model already drew, plus `env.turn_prefix` (the prompt ends with
`env.first_turn_prefix` when one is set). Re-tokenizing the whole
transcript instead would change the sampled ids (verl #3720: the newline after `<|im_end|>`), so the trainer would
score tokens nobody sampled.

The delta is rendered against a fixed stub history ending in an assistant message with a sentinel content: the
text after the sentinel is what the template writes after any assistant turn. That is exact for append-only
templates (SmolLM2, Qwen2.5) and still well-defined for templates that rewrite the past (Qwen3 drops earlier
`<think>` blocks after a new user turn): there the trajectory stays the sampled + appended ids, which is what the
model saw, and a warning says once that re-rendering the transcript would give other ids.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from jgrpo.data.prompts import render_chat
from jgrpo.envs.tool_format import hermes_system_prompt, resolve_format

log = logging.getLogger("jgrpo.envs")

_SENTINEL = "\u2063jgrpo-sentinel\u2063"


class Renderer:
    """Prompt and delta ids of one run's episodes (`tools`: the environment's, shown per `tool_format`)."""

    def __init__(self, tokenizer, *, tools: Sequence = (), tool_format: str = "auto", turn_prefix: str = "",
                 first_turn_prefix: str | None = None):
        self.tokenizer, self.tools, self.turn_prefix = tokenizer, list(tools), turn_prefix
        self.first_turn_prefix = turn_prefix if first_turn_prefix is None else first_turn_prefix
        self.format = resolve_format(tool_format, tokenizer) if self.tools else "hermes"
        self._schemas = [t.schema() for t in self.tools] if self.format == "template" and self.tools else None
        self._prefix_ids = self.encode(turn_prefix) if turn_prefix else []
        self._first_prefix_ids = self.encode(self.first_turn_prefix) if self.first_turn_prefix else []
        self._warned = False

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _render(self, messages, generation_prompt: bool) -> str:
        return render_chat(self.tokenizer, messages, tools=self._schemas, generation_prompt=generation_prompt)

    def with_tools(self, messages: Sequence[dict]) -> list[dict]:
        """`messages` with the hermes tool instructions in the system message (template format: as they are)."""
        messages = [dict(m) for m in messages]
        if self.format != "hermes" or not self.tools:
            return messages
        if messages and messages[0]["role"] == "system":
            messages[0]["content"] = hermes_system_prompt(self.tools, messages[0]["content"])
        else:
            messages.insert(0, {"role": "system", "content": hermes_system_prompt(self.tools, None)})
        return messages

    def prompt(self, messages: Sequence[dict]) -> tuple[list[dict], list[int]]:
        """(the transcript so far, the prompt ids): `reset`'s messages rendered with the assistant header, then
        the first turn's prefix."""
        transcript = self.with_tools(messages)
        return transcript, self.encode(self._render(transcript, True)) + self._first_prefix_ids

    def turn_text(self, ids: Sequence[int], stopped: bool, first: bool = False) -> str:
        """The turn as the environment reads it: its prefix (the `first` turn's own) and the drawn text (no stop
        token)."""
        drawn = list(ids[:-1] if stopped else ids)
        return (self.first_turn_prefix if first else self.turn_prefix) + self.tokenizer.decode(
            drawn, skip_special_tokens=True)

    def delta(self, reply, stop_id: int | None) -> list[int]:
        """The ids to append after a turn: `reply` (messages, or ids taken as they are) rendered after an
        assistant turn, without the `stop_id` the model drew, then the next assistant header and turn prefix."""
        if reply and all(isinstance(x, int) for x in reply):
            return list(reply)
        stub = [{"role": "user", "content": "x"}, {"role": "assistant", "content": _SENTINEL}]
        text = self._render(stub + list(reply), True)
        after = text[text.index(_SENTINEL) + len(_SENTINEL):]
        if stop_id is not None:
            stop_text = self.tokenizer.convert_ids_to_tokens(int(stop_id))
            if stop_text and after.startswith(stop_text):
                after = after[len(stop_text):]
        return self.encode(after) + self._prefix_ids

    def delta_within(self, reply, stop_id: int | None, limit: int) -> tuple[list[int], bool]:
        """(`delta`'s ids, whether the reply was cut): a reply of messages longer than `limit` tokens has its last
        message's content cut to fit, marked " [truncated]"; raw ids past `limit` are cut as they are."""
        ids = self.delta(reply, stop_id)
        if len(ids) <= limit:
            return ids, False
        if all(isinstance(x, int) for x in reply):
            return ids[:limit], True
        reply = [dict(m) for m in reply]
        for _ in range(4):  # the cut content may tokenize a little longer at its new end: try again, shorter
            content = self.encode(reply[-1]["content"])
            keep = max(0, len(content) - (len(ids) - limit) - len(self.encode(" [truncated]")) - 2)
            reply[-1]["content"] = self.tokenizer.decode(content[:keep]) + " [truncated]"
            ids = self.delta(reply, stop_id)
            if len(ids) <= limit:
                return ids, True
        return ids[:limit], True  # the template's own text alone is over the limit

    def check_append_only(self, transcript: Sequence[dict], reply: Sequence[dict]) -> None:
        """Warn once when re-rendering the transcript with `reply` would change what came before (Qwen3)."""
        if self._warned or not reply or all(isinstance(x, int) for x in reply):
            return
        before = self._render(transcript, False)
        after = self._render(list(transcript) + list(reply), True)
        if not after.startswith(before):
            self._warned = True
            log.warning("the chat template is not append-only: rendering the transcript again after a new turn "
                        "changes earlier turns (e.g. Qwen3 drops earlier <think> blocks). Episodes keep the exact "
                        "sampled and appended ids (what the model saw); re-rendered transcripts would differ.")
