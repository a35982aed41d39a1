"""Tool calls: parsing, the model's mistakes answered (not failures), and the python sandbox's limits."""

import json

import pytest

from jgrpo.config import Config, EnvConfig
from jgrpo.envs.base import ToolEnvironment, Turn
from jgrpo.envs.sandbox import PythonTool
from jgrpo.envs.tool_format import outside_tool_calls, parse_tool_calls
from jgrpo.envs.tools import ToolError


def test_parse_tool_calls():
    calls, error = parse_tool_calls('Let me compute.<tool_call>\n{"name": "calculator", "arguments": '
                                    '{"expression": "2+2"}}\n</tool_call>')
    assert error is None and calls == [{"name": "calculator", "arguments": {"expression": "2+2"}}]
    calls, error = parse_tool_calls('<tool_call>{"name": "a", "arguments": "{\\"x\\": 1}"}</tool_call>'
                                    '<tool_call>{"name": "b"}</tool_call>')
    assert error is None and calls == [{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]
    assert parse_tool_calls("The answer is 4.") == ([], None)
    calls, error = parse_tool_calls('<tool_call>{"name": "calculator", "arguments": {"expression": "2+')
    assert calls == [] and error.startswith("the tool call is not valid JSON")
    assert parse_tool_calls('<tool_call>[1, 2]</tool_call>')[1].startswith("a tool call must be a JSON object")


def test_outside_tool_calls():
    assert outside_tool_calls("The answer is 4.") == "The answer is 4."
    assert outside_tool_calls('So <tool_call>{"name": "c", "arguments": {"expression": "2*2"}}</tool_call> is 4') \
        == "So  is 4"
    assert outside_tool_calls('4 <tool_call>{"name": "calculator", "arguments": {"expression": "2288*') == "4 "


def turn_with(text):
    calls, error = parse_tool_calls(text)
    return Turn(0, (), text, tuple(calls), error, False)


def call(name, **arguments):
    return f'<tool_call>{json.dumps({"name": name, "arguments": arguments})}</tool_call>'


@pytest.fixture
def env():
    return ToolEnvironment(Config(env=EnvConfig(name="calculator", tools=("calculator", "python"),
                                                sandbox_cpu_s=1, sandbox_timeout_s=5)))


def test_a_turn_with_calls_gets_the_results(env):
    result = env.step(turn_with(call("calculator", expression="345 * 67") + call("python", code="print(6 * 7)")))
    assert not result.done and result.reward is None
    assert [m["content"] for m in result.reply] == ["23115", "42\n"]
    assert result.info == {"tool_calls": 2}


def test_a_turn_without_calls_is_the_final_answer(env):
    result = env.step(turn_with("The answer is 23115."))
    assert result.done and result.reward is None and result.reply == []


@pytest.mark.parametrize("text, kind, message", [
    ('<tool_call>{"name": "calculator", "arguments": {"expression": "2+', "bad_json", "not valid JSON"),
    (call("search", query="x"), "unknown_tool", "there is no tool 'search'"),
    (call("calculator", expr="1+1"), "arguments", "missing ['expression']"),
    (call("calculator", expression="9^9^9"), "tool_limits", "exponents are limited"),
])
def test_model_errors_are_answered_and_counted(env, text, kind, message):
    result = env.step(turn_with(text))
    assert not result.done
    assert result.reply[0]["content"].startswith("error: ") and message in result.reply[0]["content"]
    assert result.info[f"tool_call_errors/{kind}"] == 1


@pytest.mark.parametrize("code, expected", [
    ("while True: pass", "used more than 1 s of CPU"),
    ("x = bytearray(4 << 30)", "MemoryError"),
    ("open('big', 'wb').write(b'0' * (64 << 20))", "File too large"),
    ("import socket\nsocket.create_connection(('10.0.0.1', 80), timeout=2)", "Error"),
    ("print('y' * (1 << 20))", "[truncated]"),
    ("import os\nprint(sorted(os.environ))", "['LC_CTYPE']"),
])
def test_python_sandbox_limits(code, expected):
    tool = PythonTool(EnvConfig(sandbox_cpu_s=1, sandbox_timeout_s=10, sandbox_output_chars=4000))
    out = tool.call({"code": code})
    assert expected in out
    assert len(out) <= 4000 + 40


def test_python_sandbox_fork_bomb_is_contained():
    # Where RLIMIT_NPROC binds (not root) the forks fail; as root (inside a user namespace) the wall-clock limit
    # kills the whole process group. Either way the call returns and nothing outlives it.
    tool = PythonTool(EnvConfig(sandbox_cpu_s=1, sandbox_timeout_s=3))
    code = "import os\nfor _ in range(64):\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    try:
        tool.call({"code": code + "import time\ntime.sleep(60)"})
    except ToolError as e:
        assert "no result after 3 s" in str(e)
