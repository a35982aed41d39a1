"""Pull final answers out of free-form model text: numbers, `\\boxed{}`, `####`, and `<answer>` tags.

Every function here is total: any string in, a value or None out, never an exception (fuzzed in the tests).
Regexes are written without nested quantifiers so no input can make them backtrack for long.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from fractions import Fraction

# A number as people write it: optional minus (not a binary minus: no word character or closing bracket
# right before it), optional dollar sign on either side of the minus, thousands separators, decimals.
_NUMBER = re.compile(
    r"(?P<sign>(?<![\w)\]}.])[-\u2212])?\s?\$?\s?(?P<sign2>(?<![\w)\]}.])[-\u2212])?"
    r"(?P<body>(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)"
)
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_BOXED_OPENERS = ("\\boxed{", "\\fbox{")


def find_numbers(text: str) -> list[str]:
    """Every number in `text`, normalised: no `$`, no thousands separators, ASCII minus ("-1234.5")."""
    out = []
    for m in _NUMBER.finditer(text):
        negative = bool(m.group("sign") or m.group("sign2"))
        out.append(("-" if negative else "") + m.group("body").replace(",", ""))
    return out


def last_number(text: str) -> str | None:
    numbers = find_numbers(text)
    return numbers[-1] if numbers else None


def to_fraction(number: str) -> Fraction | None:
    """Exact value of a normalised number string ("-1.50" -> -3/2); None when it is not one."""
    try:
        return Fraction(Decimal(number))
    except (InvalidOperation, ValueError, TypeError):
        return None


def parse_number(text: str) -> Fraction | None:
    """The value of `text` when it holds exactly one number ("$1,234", " -7.5 ", "42."), else None."""
    numbers = find_numbers(text)
    if len(numbers) != 1:
        return None
    rest = _NUMBER.sub("", text, count=1).strip().rstrip(".").strip()
    if rest not in ("", "$", "%"):
        return None
    return to_fraction(numbers[0])


def boxed_contents(text: str) -> list[str]:
    """Contents of every `\\boxed{...}` / `\\fbox{...}` in order, braces balanced; unclosed ones are ignored."""
    out = []
    i = 0
    while True:
        starts = [(text.find(o, i), o) for o in _BOXED_OPENERS]
        starts = [(s, o) for s, o in starts if s >= 0]
        if not starts:
            return out
        start, opener = min(starts)
        j = start + len(opener)
        depth = 1
        k = j
        while k < len(text) and depth:
            if text[k] == "{":
                depth += 1
            elif text[k] == "}":
                depth -= 1
            k += 1
        if depth:  # unclosed: nothing after it can be a complete box either
            return out
        out.append(text[j : k - 1])
        i = k


def answer_tag(text: str) -> str | None:
    """Content of the last complete `<answer>...</answer>`, or None."""
    found = _ANSWER_TAG.findall(text)
    return found[-1] if found else None


def after_hashes(text: str) -> str | None:
    """The line after the last `####` (GSM8K's final-answer marker), or None when there is no marker."""
    pos = text.rfind("####")
    if pos < 0:
        return None
    return text[pos + 4 :].split("\n", 1)[0]


def final_answer_region(text: str) -> str | None:
    """Where a model states its final answer: `<answer>` tag, else the last `\\boxed{}`, else after `####`."""
    tagged = answer_tag(text)
    if tagged is not None:
        return tagged
    boxes = boxed_contents(text)
    if boxes:
        return boxes[-1]
    return after_hashes(text)


def reference_number(answer: object) -> Fraction | None:
    """A numeric reference answer: a number, or a string like "72", "$1,000", or a GSM8K solution "... #### 72"."""
    if isinstance(answer, bool):
        return None
    if isinstance(answer, int):
        return Fraction(answer)
    if isinstance(answer, float):
        return Fraction(answer) if answer == answer and abs(answer) != float("inf") else None
    if not isinstance(answer, str):
        return None
    marked = after_hashes(answer)
    text = marked if marked is not None else answer
    value = parse_number(text)
    if value is None and marked is not None:
        first = find_numbers(marked)
        value = to_fraction(first[0]) if first else None
    return value
