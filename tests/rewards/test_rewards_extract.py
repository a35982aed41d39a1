"""Answer extraction and the reward functions themselves (called directly, no worker processes)."""

from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jgrpo.rewards import available_rewards, get_reward
from jgrpo.rewards.countdown import ExpressionError, check_countdown, equation_candidate, evaluate_expression
from jgrpo.rewards.extract import (
    answer_tag,
    boxed_contents,
    final_answer_region,
    find_numbers,
    last_number,
    parse_number,
    reference_number,
)
from jgrpo.rewards.format import has_reasoning_format

LAST_NUMBER = [
    ("The answer is 42.", "42"),
    ("She pays $1,234.50 in total", "1234.50"),
    ("costs $5", "5"),
    ("a loss of -$30", "-30"),
    ("a balance of $-30", "-30"),
    ("it is -7 degrees", "-7"),
    ("x = -0.5", "-0.5"),
    ("5-3 = 2", "2"),  # binary minus is not a sign
    ("10-3", "3"),
    ("1,000,000 people", "1000000"),
    ("lists 1,2,3", "3"),
    ("1, 2, 3", "3"),
    ("pi is 3.14.", "3.14"),
    ("only .5 left", ".5"),
    ("unicode minus \u22124", "-4"),
    ("no digits here", None),
    ("", None),
]


@pytest.mark.parametrize("text,expected", LAST_NUMBER)
def test_last_number(text, expected):
    assert last_number(text) == expected


def test_find_numbers_order_and_normalisation():
    assert find_numbers("From $1,200 down to -$35.5, then 7") == ["1200", "-35.5", "7"]


@pytest.mark.parametrize("text,expected", [
    ("72", Fraction(72)), (" $1,234 ", Fraction(1234)), ("-7.50", Fraction(-15, 2)), ("42.", Fraction(42)),
    ("50%", Fraction(50)), ("72 apples", None), ("1 2", None), ("", None), ("abc", None),
])
def test_parse_number(text, expected):
    assert parse_number(text) == expected


@pytest.mark.parametrize("answer,expected", [
    ("72", Fraction(72)), ("$1,000", Fraction(1000)), ("Step 1 ... 3 + 4 = 7\n#### 7", Fraction(7)),
    ("#### -30", Fraction(-30)), ("#### 2,880", Fraction(2880)), (13, Fraction(13)), (2.5, Fraction(5, 2)),
    (True, None), ("\\frac{1}{2}", None), (float("nan"), None),
])
def test_reference_number(answer, expected):
    assert reference_number(answer) == expected


def test_boxed_contents_nested_several_and_unclosed():
    text = "first \\boxed{2} then \\boxed{\\frac{1}{2}} and \\fbox{x^{2}} and \\boxed{oops"
    assert boxed_contents(text) == ["2", "\\frac{1}{2}", "x^{2}"]
    assert boxed_contents("no box") == []


def test_answer_tag_and_final_region_priority():
    assert answer_tag("<answer>1</answer> text <answer> 2 </answer>") == " 2 "
    assert answer_tag("<answer>unclosed") is None
    assert final_answer_region("\\boxed{3} <answer>4</answer> #### 5") == "4"
    assert final_answer_region("\\boxed{3} then \\boxed{6} #### 5") == "6"
    assert final_answer_region("work\n#### 5\nmore") == " 5"
    assert final_answer_region("just text 9") is None


def _reward(name, completion, reference, prompt="q"):
    return get_reward(name)(prompt, completion, reference)


@pytest.mark.parametrize("completion,answer,expected", [
    ("So the total is $1,234.", "1234", 1.0),
    ("Answer: 1234.00", "1,234", 1.0),
    ("<answer>-30</answer> although 50 was mentioned", "-30", 1.0),
    ("I think \\boxed{12} no wait \\boxed{13}", "13", 1.0),
    ("I think \\boxed{12} no wait \\boxed{13}", "12", 0.0),
    ("it is 6.5", "6.50", 1.0),
    ("it is 6.5", "6", 0.0),
    ("there is no answer", "3", 0.0),
    ("", "3", 0.0),
])
def test_exact_numeric(completion, answer, expected):
    assert _reward("exact_numeric", completion, {"answer": answer}) == expected


@pytest.mark.parametrize("completion,answer,expected", [
    ("3 * 4 = 12\n#### 12", "12", 1.0),
    ("#### $1,260 dollars", "1260", 1.0),
    ("#### 7 and later 8", "7", 1.0),  # after #### the first number counts
    ("no marker, last number 8", "8", 1.0),
    ("3 + 4 = 7, then 9", "7", 0.0),
    ("nothing", "7", 0.0),
])
def test_gsm8k(completion, answer, expected):
    assert _reward("gsm8k", completion, {"answer": answer}) == expected


@pytest.mark.parametrize("completion,answer,expected", [
    ("so \\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("so \\boxed{0.5}", "\\frac{1}{2}", 1.0),
    ("\\boxed{1+x^2}", "x^2+1", 1.0),
    ("first \\boxed{2} then \\boxed{3}", "3", 1.0),  # the last box counts, not the set {2, 3}
    ("first \\boxed{2} then \\boxed{3}", "2", 0.0),
    ("<think>hmm</think><answer>42</answer>", "42", 1.0),
    ("The final answer is 1,000", "1000", 1.0),
    ("no answer here", "72", 0.0),
])
def test_math_verify(completion, answer, expected):
    assert _reward("math_verify", completion, {"answer": answer}) == expected


def test_numeric_rewards_refuse_a_non_numeric_reference():
    with pytest.raises(ValueError, match="not a number"):
        _reward("exact_numeric", "42", {"answer": "\\frac{1}{2}"})
    with pytest.raises(KeyError, match="answer"):
        _reward("gsm8k", "42", {})


@pytest.mark.parametrize("expression,value,numbers", [
    ("(25 - 3) * 2", Fraction(44), [25, 3, 2]),
    ("7 / 2", Fraction(7, 2), [7, 2]),
    ("((1))", Fraction(1), [1]),
])
def test_evaluate_expression(expression, value, numbers):
    assert evaluate_expression(expression) == (value, numbers)


@pytest.mark.parametrize("expression", [
    "__import__('os').system('true')", "2 ** 100", "-3 + 5", "1.5 * 2", "3 // 2", "a + 1", "1 / 0", "",
    "(" * 150 + "1" + ")" * 150, "9" * 201, "[1, 2]", "1 if 1 else 2", "True + 1",
])
def test_evaluate_expression_rejects_anything_else(expression):
    with pytest.raises(ExpressionError):
        evaluate_expression(expression)


@pytest.mark.parametrize("completion,expected", [
    ("<answer>(25 - 3) * 2</answer>", 1.0),
    ("<answer>2 * (25 - 3) = 44</answer>", 1.0),
    ("<answer>44 = 2 \\times (25 - 3)</answer>", 1.0),
    ("thinking...\n(25 - 3) × 2", 1.0),  # no tags: the last line with a digit
    ("\\boxed{(25-3)*2}", 1.0),
    ("<answer>25 * 2 - 3 - 3</answer>", 0.0),  # 3 is given once but used twice
    ("<answer>25 + 19</answer>", 0.0),  # 19 is not given
    ("<answer>(25 - 3) * 2 + 0</answer>", 0.0),  # 0 is not given
    ("<answer>25 * 2 - 3</answer>", 0.0),  # wrong value (47)
    ("<answer>__import__('os')</answer>", 0.0),
    ("no equation", 0.0),
])
def test_countdown(completion, expected):
    assert _reward("countdown", completion, {"numbers": [25, 3, 2], "target": 44}) == expected


def test_countdown_use_all_switch():
    assert not check_countdown("25 + 19", [25, 19, 7], 44, use_all=True)
    assert check_countdown("25 + 19", [25, 19, 7], 44, use_all=False)
    assert equation_candidate("no digits") is None


@pytest.mark.parametrize("completion,expected", [
    ("<think>step by step</think>\n<answer>42</answer>", 1.0),
    ("  <think>\na\n</think><answer>\n42\n</answer>\n", 1.0),
    ("<think>a</think>", 0.0),
    ("<answer>42</answer><think>a</think>", 0.0),
    ("<think>a</think><answer>1</answer><answer>2</answer>", 0.0),
    ("preamble <think>a</think><answer>1</answer>", 0.0),
    ("", 0.0),
])
def test_format(completion, expected):
    assert _reward("format", completion, {}) == expected


def test_format_continues_a_prompt_that_opens_the_think_block():
    assert _reward("format", "a</think><answer>1</answer>", {}, prompt="assistant\n<think>") == 1.0
    assert has_reasoning_format("<think>a</think><answer>1</answer>")


def test_registry_names_and_errors():
    assert {"gsm8k", "exact_numeric", "math_verify", "countdown", "format"} <= set(available_rewards())
    assert get_reward("jgrpo.rewards.format:format_reward") is get_reward("format")
    with pytest.raises(ValueError, match="did you mean exact_numeric"):
        get_reward("exact_numerik")
    with pytest.raises(ValueError, match="cannot import module"):
        get_reward("no_such_module_xyz:fn")


_PIECES = list("0123456789-+*/.,$ {}()#<>=\\abxn\n\u2212") + [
    "\\boxed{", "<answer>", "</answer>", "####", "<think>", "</think>", "\\frac"]
# Strings made of the pieces extractors look for, and arbitrary unicode.
_text = st.lists(st.sampled_from(_PIECES), max_size=40).map("".join) | st.text(max_size=80)


@settings(max_examples=300, deadline=None)
@given(_text)
def test_extractors_never_raise(text):
    find_numbers(text)
    last_number(text)
    parse_number(text)
    boxed_contents(text)
    answer_tag(text)
    final_answer_region(text)
    reference_number(text)
    equation_candidate(text)
    has_reasoning_format(text)


@settings(max_examples=150, deadline=None)
@given(_text)
def test_rewards_never_raise_on_any_completion(text):
    for name, reference in [("exact_numeric", {"answer": "12"}), ("gsm8k", {"answer": "-3.5"}),
                            ("countdown", {"numbers": [1, 2, 3], "target": 6}), ("format", {})]:
        assert _reward(name, text, reference) in (0.0, 1.0)


@settings(max_examples=30, deadline=None)
@given(_text)
def test_math_verify_never_raises(text):
    assert _reward("math_verify", text, {"answer": "\\frac{1}{2}"}) in (0.0, 1.0)
