"""Countdown: does the completion's equation reach the target using the given numbers?

The expression is parsed with `ast` and evaluated exactly (fractions) by walking a whitelist of nodes:
non-negative integer literals, + - * /, and parentheses. Nothing is ever passed to `eval`.
"""

from __future__ import annotations

import ast
import re
from collections import Counter
from fractions import Fraction

from jgrpo.rewards.extract import answer_tag, boxed_contents
from jgrpo.rewards.registry import register_reward

MAX_EXPRESSION_CHARS = 200  # longer "equations" are not answers; also bounds the parser's work
_OPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b}
_REPLACEMENTS = (("\\times", "*"), ("\\cdot", "*"), ("\\div", "/"), ("×", "*"), ("·", "*"), ("÷", "/"),
                 ("−", "-"), ("\\left", ""), ("\\right", ""), ("{", "("), ("}", ")"), ("[", "("), ("]", ")"))


class ExpressionError(ValueError):
    """The text is not an arithmetic expression over integers with + - * / and parentheses."""


def evaluate_expression(expression: str) -> tuple[Fraction, list[int]]:
    """Exact value of `expression` and the integer literals it uses, in order; ExpressionError otherwise."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ExpressionError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError) as e:
        raise ExpressionError(f"not an expression: {e}") from None
    numbers: list[int] = []

    def walk(node: ast.AST) -> Fraction:
        if isinstance(node, ast.BinOp):
            left, right = walk(node.left), walk(node.right)
            if isinstance(node.op, ast.Div):
                if right == 0:
                    raise ExpressionError("division by zero")
                return left / right
            op = _OPS.get(type(node.op))
            if op is None:
                raise ExpressionError(f"operator {type(node.op).__name__} is not allowed")
            return op(left, right)
        if isinstance(node, ast.Constant) and type(node.value) is int and node.value >= 0:
            numbers.append(node.value)
            return Fraction(node.value)
        raise ExpressionError(f"{type(node).__name__} is not allowed (only integers, + - * / and parentheses)")

    return walk(tree.body), numbers


def equation_candidate(completion: str) -> str | None:
    """The equation the completion proposes: its `<answer>` tag, else last `\\boxed{}`, else its last line."""
    text = answer_tag(completion)
    if text is None:
        boxes = boxed_contents(completion)
        text = boxes[-1] if boxes else None
    if text is None:
        lines = [line for line in completion.splitlines() if re.search(r"\d", line)]
        text = lines[-1] if lines else None
    if text is None:
        return None
    for old, new in _REPLACEMENTS:
        text = text.replace(old, new)
    text = text.strip().strip("$").strip().rstrip(".")
    if "=" in text:  # "3 * 8 = 24" or "24 = 3 * 8": keep the side that does the arithmetic
        sides = [s.strip() for s in text.split("=") if s.strip()]
        with_ops = [s for s in sides if re.search(r"[-+*/]", s)]
        text = with_ops[0] if with_ops else (sides[0] if sides else "")
    return text or None


def check_countdown(expression: str, numbers: list[int], target: int, *, use_all: bool = True) -> bool:
    """True when `expression` evaluates to `target` using each of `numbers` at most once (exactly once if use_all)."""
    try:
        value, used = evaluate_expression(expression)
    except ExpressionError:
        return False
    used_counts, available = Counter(used), Counter(numbers)
    if any(used_counts[n] > available[n] for n in used_counts):
        return False
    if use_all and used_counts != available:
        return False
    return value == target


@register_reward("countdown")
def countdown_reward(prompt: str, completion: str, reference: dict) -> float:
    """1 when the proposed equation is valid, uses the given numbers as the task says, and equals the target.

    reference: `numbers` (list of int), `target` (int), optional `use_all` (default True: each number exactly
    once; False: each at most once).
    """
    for key in ("numbers", "target"):
        if key not in reference:
            raise KeyError(f"countdown reference has no {key!r} field (fields: {sorted(reference)})")
    expression = equation_candidate(completion)
    if expression is None:
        return 0.0
    numbers = [int(n) for n in reference["numbers"]]
    return float(check_countdown(expression, numbers, int(reference["target"]),
                                 use_all=bool(reference.get("use_all", True))))
