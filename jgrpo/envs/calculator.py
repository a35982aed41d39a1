"""The calculator tool's arithmetic: an exact rational parser, never `eval`.

Grammar (whitespace anywhere between tokens):

    expression := term (("+" | "-") term)*
    term       := unary (("*" | "/" | "×" | "÷") unary)*
    unary      := ("-" | "+") unary | power            -3^2 = -(3^2) = -9
    power      := atom (("^" | "**") unary)?           right-associative: 2^3^2 = 2^9; 2^-2 = 1/4
    atom       := number | "(" expression ")"
    number     := digits ["." digits] | "." digits      at most MAX_DIGITS digits; "," between thousands allowed

Every value is a `fractions.Fraction`, so 0.1 + 0.2 is 3/10 exactly. Limits keep a model's call from costing
the host anything: numbers of at most 50 digits, integer exponents of at most 64 in size, and no value (the
result or any intermediate one) past 200 digits in its numerator or denominator, checked before a power is
computed (9^9^9 is refused at once, not evaluated). Breaking a limit, dividing by zero or a syntax error raises
`CalculationError` with a message the model reads as the tool's answer.
"""

from __future__ import annotations

import re
from fractions import Fraction

MAX_DIGITS = 50  # digits of one number in the expression
MAX_EXPONENT = 64  # |exponent| of a power
MAX_RESULT_DIGITS = 200  # digits of any value's numerator or denominator
MAX_EXPRESSION_CHARS = 1000

_TOKEN = re.compile(r"\s*(?:(?P<number>\d[\d,]*(?:\.\d*)?|\.\d+)|(?P<op>\*\*|[-+*/^()×÷]))")


class CalculationError(ValueError):
    """The expression cannot be evaluated: the message says why, for the model to read."""


def _digits(value: Fraction) -> int:
    return max(len(str(abs(value.numerator))), len(str(value.denominator)))


def _checked(value: Fraction) -> Fraction:
    if _digits(value) > MAX_RESULT_DIGITS:
        raise CalculationError(f"a value has more than {MAX_RESULT_DIGITS} digits")
    return value


def _tokens(expression: str) -> list[tuple[str, str]]:
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculationError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    tokens, at, text = [], 0, expression.rstrip()
    while at < len(text):
        match = _TOKEN.match(text, at)
        if match is None:
            raise CalculationError(f"unexpected {text[at:].lstrip()[:10]!r} at character {at + 1}")
        kind = "number" if match.group("number") is not None else "op"
        tokens.append((kind, match.group(kind)))
        at = match.end()
    return tokens


def _number(text: str) -> Fraction:
    if "," in text and not re.fullmatch(r"\d{1,3}(,\d{3})+(\.\d*)?", text):
        raise CalculationError(f"{text!r} is not a number (commas only between groups of three digits)")
    plain = text.replace(",", "")
    if sum(c.isdigit() for c in plain) > MAX_DIGITS:
        raise CalculationError(f"a number has more than {MAX_DIGITS} digits")
    return Fraction(plain.rstrip(".") or "0")


class _Parser:
    def __init__(self, tokens: list[tuple[str, str]]):
        self.tokens, self.at = tokens, 0

    def peek(self) -> str | None:
        return self.tokens[self.at][1] if self.at < len(self.tokens) else None

    def take(self) -> tuple[str, str]:
        if self.at >= len(self.tokens):
            raise CalculationError("the expression ends too early")
        self.at += 1
        return self.tokens[self.at - 1]

    def expression(self) -> Fraction:
        value = self.term()
        while self.peek() in ("+", "-"):
            op = self.take()[1]
            right = self.term()
            value = _checked(value + right if op == "+" else value - right)
        return value

    def term(self) -> Fraction:
        value = self.unary()
        while self.peek() in ("*", "/", "×", "÷"):
            op = self.take()[1]
            right = self.unary()
            if op in ("/", "÷"):
                if right == 0:
                    raise CalculationError("division by zero")
                value = _checked(value / right)
            else:
                value = _checked(value * right)
        return value

    def power(self) -> Fraction:
        base = self.atom()
        if self.peek() not in ("^", "**"):
            return base
        self.take()
        exponent = self.unary()  # right-associative, and may carry a sign
        if exponent.denominator != 1:
            raise CalculationError("exponents must be whole numbers")
        if abs(exponent) > MAX_EXPONENT:
            raise CalculationError(f"exponents are limited to {MAX_EXPONENT} in size")
        if base == 0 and exponent < 0:
            raise CalculationError("division by zero")
        # Size before computing: digits(base^e) <= |e| * digits(base).
        if abs(int(exponent)) * max(_digits(base) - 1, 0) > MAX_RESULT_DIGITS:
            raise CalculationError(f"the power has more than {MAX_RESULT_DIGITS} digits")
        return _checked(base ** int(exponent))

    def unary(self) -> Fraction:
        if self.peek() in ("-", "+"):
            sign = self.take()[1]
            value = self.unary()
            return -value if sign == "-" else value
        return self.power()

    def atom(self) -> Fraction:
        kind, text = self.take()
        if kind == "number":
            return _number(text)
        if text == "(":
            value = self.expression()
            if self.peek() != ")":
                raise CalculationError("a '(' is not closed")
            self.take()
            return value
        raise CalculationError(f"unexpected {text!r}")


def evaluate(expression: str) -> Fraction:
    """The exact value of `expression` (see the module doc), or CalculationError."""
    if not isinstance(expression, str):
        raise CalculationError(f"the expression must be a string, not {type(expression).__name__}")
    parser = _Parser(_tokens(expression))
    if parser.peek() is None:
        raise CalculationError("the expression is empty")
    value = parser.expression()
    if parser.peek() is not None:
        raise CalculationError(f"unexpected {parser.peek()!r} after a complete expression")
    return value


def format_value(value: Fraction) -> str:
    """An integer as digits; a fraction as its exact decimal when it has at most 20 decimals, else p/q."""
    if value.denominator == 1:
        return str(value.numerator)
    denominator, twos, fives = value.denominator, 0, 0
    while denominator % 2 == 0:
        denominator, twos = denominator // 2, twos + 1
    while denominator % 5 == 0:
        denominator, fives = denominator // 5, fives + 1
    places = max(twos, fives)
    if denominator == 1 and places <= 20:
        scaled = abs(value.numerator) * 10**places // value.denominator
        sign = "-" if value < 0 else ""
        whole, frac = divmod(scaled, 10**places)
        return f"{sign}{whole}.{str(frac).rjust(places, '0')}"
    return f"{value.numerator}/{value.denominator}"
