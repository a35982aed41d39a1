"""Tool calls: parsing, the model's mistakes answered (not failures), results returned as tool messages."""

import json

import pytest

from jgrpo.config import Config, EnvConfig
from jgrpo.envs.base import ToolEnvironment, Turn
from jgrpo.envs.tool_format import outside_tool_calls, parse_tool_calls


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
    # The plumbing of tool calls; where the code runs and what it can reach: tests/envs/test_sandbox_escapes.py.
    return ToolEnvironment(Config(env=EnvConfig(name="calculator", tools=("calculator", "python"), sandbox="process",
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
