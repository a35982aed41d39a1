"""The calculator tool: exact rational arithmetic with hand-checked values, and every limit refused early."""

import time
from fractions import Fraction

import pytest

from jgrpo.envs.calculator import CalculationError, evaluate, format_value
from jgrpo.envs.tools import Calculator, ToolError


@pytest.mark.parametrize("expression, value", [
    ("345 * 67", 23115), ("1234*5678", 7006652), ("2 + 3 * 4", 14), ("(2 + 3) * 4", 20), ("2^3^2", 512),
    ("2**10", 1024), ("-3^2", -9), ("(-3)^2", 9), ("7 / 2", Fraction(7, 2)), ("0.1 + 0.2", Fraction(3, 10)),
    ("10 - 4 - 3", 3), ("100 / 10 / 5", 2), ("1,234 + 1", 1235), ("2^-2", Fraction(1, 4)), ("--5", 5),
    ("6 × 7 ÷ 3", 14), (" 12 ", 12), ("(((1)))", 1), (".5 * 4", 2),
])
def test_values(expression, value):
    assert evaluate(expression) == value


@pytest.mark.parametrize("value, text", [
    (Fraction(23115), "23115"), (Fraction(7, 2), "3.5"), (Fraction(-1, 8), "-0.125"), (Fraction(1, 3), "1/3"),
    (Fraction(3, 10), "0.3"), (Fraction(-7), "-7"),
])
def test_format(value, text):
    assert format_value(value) == text


@pytest.mark.parametrize("expression, message", [
    ("9^9^9", "exponents are limited to 64"), ("10^64^1 * 10^64 * 10^64 * 10^64", "more than 200 digits"),
    ("1/0", "division by zero"), ("0^-1", "division by zero"), ("2^(1/2)", "whole numbers"),
    ("1" * 51, "more than 50 digits"), ("(1 + 2", "not closed"), ("1 +", "ends too early"), ("", "empty"),
    ("1 2", "after a complete expression"), ("__import__('os')", "unexpected"), ("1,23", "not a number"),
    ("9" * 50 + "^64", "more than 200 digits"), ("1" * 1001, "longer than 1000"),
])
def test_refusals(expression, message):
    started = time.perf_counter()
    with pytest.raises(CalculationError, match=message):
        evaluate(expression)
    assert time.perf_counter() - started < 1.0  # refused before any big number is built


def test_tool_reports_model_errors_as_tool_errors():
    tool = Calculator()
    assert tool.call({"expression": "12 * 12"}) == "144"
    with pytest.raises(ToolError, match="missing") as missing:
        tool.call({})
    assert missing.value.kind == "arguments"
    with pytest.raises(ToolError, match="unknown") as unknown:
        tool.call({"expression": "1", "precision": 3})
    assert unknown.value.kind == "arguments"
    with pytest.raises(ToolError, match="must be a string"):
        tool.call({"expression": 5})
    with pytest.raises(ToolError, match="exponents") as limit:
        tool.call({"expression": "9^9^9"})
    assert limit.value.kind == "tool_limits"
