"""The built-in tools by name (`env.tools`)."""

from __future__ import annotations

from jgrpo.envs.sandbox import PythonTool
from jgrpo.envs.tools import Calculator, Tool

BUILTIN_TOOLS = {"calculator": lambda config: Calculator(), "python": PythonTool}


def build_tools(names, config) -> list[Tool]:
    """The tools `names` lists, built with the env config (the sandbox's limits)."""
    unknown = [n for n in names if n not in BUILTIN_TOOLS]
    if unknown:
        raise ValueError(f"unknown tool(s) {unknown}; built-in tools: {sorted(BUILTIN_TOOLS)}")
    return [BUILTIN_TOOLS[n](config) for n in names]
