"""How tools reach the model and its calls come back (`env.tool_format`).

- `hermes`: the tools' JSON schemas in the system prompt inside `<tools></tools>`, with one example call; the
  model calls as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; results come back as `tool`-role
  messages. For templates that ignore `tools=` (SmolLM2-135M-Instruct's).
- `template`: the chat template's own rendering of `tools=` (Qwen2.5, Qwen3). Their calls use the same
  `<tool_call>` JSON, so one parser serves both.
- `auto`: `template` when the template renders `tools` (its output changes when tools are passed), else `hermes`.

`parse_tool_calls(text)` returns the calls of one assistant turn, or the reason they cannot be read (the
environment tells the model, `env/tool_call_errors/bad_json`); `outside_tool_calls(text)` the rest of it (what
the reward functions score on an episode's last turn).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

HERMES_INSTRUCTIONS = (
    "You may call functions to help with the task. The functions are given inside <tools></tools> as JSON "
    "schemas:\n<tools>\n{schemas}\n</tools>\n"
    "To call a function, write a JSON object with its name and arguments inside <tool_call></tool_call>, "
    "for example:\n<tool_call>\n{example}\n</tool_call>\n"
    "The result comes back in a tool message. When you know the final answer, write it without a tool call."
)


def template_renders_tools(tokenizer) -> bool:
    """Whether the chat template shows `tools=` (Qwen2.5, Qwen3) or ignores it (SmolLM2)."""
    from jgrpo.data.prompts import render_chat  # here: environment workers import this module without jax

    probe = [{"role": "user", "content": "hi"}]
    tool = {"type": "function", "function": {"name": "probe_tool_zq", "description": "d",
                                             "parameters": {"type": "object", "properties": {}}}}
    try:
        with_tools = render_chat(tokenizer, probe, tools=[tool])
    except Exception:  # a template that fails on tools cannot render them  # noqa: BLE001
        return False
    return "probe_tool_zq" in with_tools


def resolve_format(tool_format: str, tokenizer) -> str:
    if tool_format != "auto":
        return tool_format
    return "template" if template_renders_tools(tokenizer) else "hermes"


def hermes_system_prompt(tools: Sequence, system: str | None) -> str | None:
    """`system` followed by the hermes tool instructions (None and no tools: no system prompt)."""
    if not tools:
        return system
    schemas = "\n".join(json.dumps(t.schema(), ensure_ascii=False) for t in tools)
    first = tools[0]
    example = json.dumps({"name": first.name, "arguments": dict(first.example)}, ensure_ascii=False)
    instructions = HERMES_INSTRUCTIONS.format(schemas=schemas, example=example)
    return f"{system}\n\n{instructions}" if system else instructions


class ToolCall(dict):
    """{"name": str, "arguments": dict}: one call as the model wrote it."""

    @property
    def name(self) -> str:
        return self["name"]

    @property
    def arguments(self):
        return self["arguments"]


def outside_tool_calls(text: str) -> str:
    """`text` without its tool calls (a call the turn's end cut off included): the part of a turn that can be an
    answer. A number in a call's arguments is the model's question to the tool, not its reply."""
    return _CALL.sub("", text)


def parse_tool_calls(text: str) -> tuple[list[ToolCall], str | None]:
    """(the calls in `text`, None) or ([], why they cannot be read). No `<tool_call>`: no calls, no error."""
    calls = []
    for body in _CALL.findall(text):
        try:
            call = json.loads(body.strip())
        except json.JSONDecodeError as e:
            return [], f"the tool call is not valid JSON ({e.msg} at character {e.pos + 1})"
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return [], 'a tool call must be a JSON object {"name": ..., "arguments": {...}}'
        arguments = call.get("arguments", {})
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                return [], "the tool call's arguments are not a JSON object"
        calls.append(ToolCall(name=call["name"], arguments=arguments))
    return calls, None
