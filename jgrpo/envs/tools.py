"""Tools an environment offers the model: a name, a JSON schema of the arguments, and a call.

A tool's `call(arguments)` returns the text the model reads. A mistake of the model's (wrong arguments, an
expression the calculator refuses, output over a limit) raises `ToolError`: the environment sends its message
back as the tool's answer and counts it (`env/tool_call_errors/*`); it is a part of learning, not a failure.
Anything else a tool raises is a bug of the environment and fails the episode (`env.on_failure`).

Built-ins (`env.tools`, `jgrpo.envs.toolbox`): `calculator` (exact arithmetic, `jgrpo.envs.calculator`) and `python`
(a resource-limited subprocess, `jgrpo.envs.sandbox`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jgrpo.envs.calculator import CalculationError, evaluate, format_value


class ToolError(ValueError):
    """The model called a tool wrongly: `kind` names the counter (`env/tool_call_errors/<kind>`)."""

    def __init__(self, message: str, kind: str = "arguments"):
        super().__init__(message)
        self.kind = kind


class Tool:
    """One tool: `name`, `description`, `parameters` (a JSON schema object) and `call`."""

    name: str = ""
    description: str = ""
    parameters: Mapping[str, Any] = {"type": "object", "properties": {}, "required": []}
    example: Mapping[str, Any] = {}  # arguments of one example call, shown in the system prompt (hermes format)

    def call(self, arguments: Mapping[str, Any]) -> str:
        raise NotImplementedError

    def schema(self) -> dict:
        """The OpenAI-style function schema chat templates and the hermes system prompt show."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": dict(self.parameters)}}

    def checked_arguments(self, arguments: Any) -> dict:
        """`arguments` with the schema's required keys present and no unknown ones, else ToolError."""
        if not isinstance(arguments, Mapping):
            raise ToolError(f"the arguments of {self.name} must be a JSON object, got {type(arguments).__name__}")
        known = set(self.parameters.get("properties", {}))
        missing = [k for k in self.parameters.get("required", []) if k not in arguments]
        unknown = sorted(set(arguments) - known)
        if missing or unknown:
            raise ToolError(f"{self.name} takes {sorted(known)}" + (f"; missing {missing}" if missing else "")
                            + (f"; unknown {unknown}" if unknown else ""))
        return dict(arguments)


class Calculator(Tool):
    name = "calculator"
    description = ("Evaluate an arithmetic expression exactly: + - * / ^ and parentheses on integers and "
                   "decimals.")
    parameters = {"type": "object", "properties": {"expression": {
        "type": "string", "description": "the expression, e.g. (12 + 3) * 4"}}, "required": ["expression"]}
    example = {"expression": "(12 + 3) * 4"}

    def call(self, arguments):
        expression = self.checked_arguments(arguments)["expression"]
        try:
            return format_value(evaluate(expression))
        except CalculationError as e:
            raise ToolError(f"calculator: {e}", kind="tool_limits") from None
