"""What an environment is: `reset(row, seed) -> messages`, then `step(turn) -> StepResult` per assistant turn.

An episode starts from a data row (its question and reference fields) and a seed (from the run's key: the same
row of the same iteration gets the same seed, and so do the G episodes of a GRPO group). `reset` returns the
opening messages (system, user, ...); the sampler draws the assistant's turn; `step` reads it as a `Turn` and
answers with more messages (rendered with the chat template and appended after the sampled tokens) or raw
token ids (appended as they are), a reward (None: none for this turn) and whether the episode is over.

Rewards of the turns add up. When the last step gives None, the run's `reward.functions` score the last turn's
text outside its tool calls (a final answer graded like any single-turn completion; a number written as a call's
argument, or in a call the budget cut off, is not an answer). `info` counts what the metrics show
(`tool_calls`, `tool_call_errors/<kind>`, ...).

`ToolEnvironment` is the base of environments whose turns call tools (`env.tools`): a turn with calls gets the
tools' results, a turn without any is the final answer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple

from jgrpo.envs.tool_format import ToolCall
from jgrpo.envs.toolbox import build_tools
from jgrpo.envs.tools import Tool, ToolError


@dataclasses.dataclass(frozen=True)
class Turn:
    """One assistant turn as the environment sees it."""

    index: int  # 0 for the first turn of the episode
    ids: tuple[int, ...]  # the sampled token ids (the stop token included when there is one)
    text: str  # `env.turn_prefix` + the decoded sampled tokens (special tokens and the stop token left out)
    tool_calls: tuple[ToolCall, ...]  # parsed from `text` (empty when there are none or they cannot be read)
    parse_error: str | None  # why the tool calls in `text` cannot be read; None when they can (or there are none)
    truncated: bool  # `sampler.max_new_tokens` cut the turn before a stop token


class StepResult(NamedTuple):
    reply: Sequence[dict] | Sequence[int]  # messages to render, or token ids to append as they are
    reward: float | None = None  # this turn's reward; None: none (see the module doc)
    done: bool = False
    info: dict | None = None  # counters for the metrics, e.g. {"tool_calls": 1}


class Environment:
    """Subclass and implement `reset` and `step`; `tools` lists the tools the model is told about.

    Built with the run's `Config` (its `env` section holds the limits); one instance per episode, in a worker
    process (`env.num_workers`), so an instance may keep the episode's state in attributes.
    """

    tools: Sequence[Tool] = ()

    def __init__(self, config):
        self.config = config

    def reset(self, row: dict, seed: int) -> list[dict]:
        raise NotImplementedError

    def step(self, turn: Turn) -> StepResult:
        raise NotImplementedError


class ToolEnvironment(Environment):
    """A question answered with the help of `env.tools`: each turn's calls get the tools' results as `tool`
    messages; a turn without calls is the final answer (scored by `reward.functions`). A call the model gets
    wrong (unreadable JSON, an unknown tool, wrong arguments, a tool's limit) gets an error message back."""

    default_tools: tuple[str, ...] = ()

    def __init__(self, config):
        super().__init__(config)
        names = config.env.tools if config.env.tools is not None else self.default_tools
        self.tools = build_tools(names, config.env)
        self.by_name = {t.name: t for t in self.tools}

    def system_prompt(self, row: dict) -> str | None:
        return self.config.data.system_prompt

    def reset(self, row: dict, seed: int) -> list[dict]:
        system = self.system_prompt(row)
        question = row["question"] + self.config.data.instruction_suffix
        return ([{"role": "system", "content": system}] if system is not None else []) + [
            {"role": "user", "content": question}]

    def step(self, turn: Turn) -> StepResult:
        if turn.parse_error is not None:
            return StepResult([self.error_message(turn.parse_error)], None, False,
                              {"tool_call_errors/bad_json": 1})
        if not turn.tool_calls:
            return StepResult([], None, True)
        replies, info = [], {"tool_calls": len(turn.tool_calls)}
        for call in turn.tool_calls:
            tool = self.by_name.get(call.name)
            try:
                if tool is None:
                    raise ToolError(f"there is no tool {call.name!r}; the tools are {sorted(self.by_name)}",
                                    kind="unknown_tool")
                replies.append(self.tool_message(call.name, tool.call(call.arguments)))
            except ToolError as e:
                info[f"tool_call_errors/{e.kind}"] = info.get(f"tool_call_errors/{e.kind}", 0) + 1
                replies.append(self.error_message(str(e)))
        return StepResult(replies, None, False, info)

    @staticmethod
    def tool_message(name: str, content: str) -> dict:
        return {"role": "tool", "name": name, "content": content}

    @staticmethod
    def error_message(message: str) -> dict:
        return {"role": "tool", "name": "error", "content": f"error: {message}"}


def row_of(question: str, reference: dict[str, Any]) -> dict:
    """A data row as environments get it: the question and the reference fields."""
    return {"question": question, **reference}
