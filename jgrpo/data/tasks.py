"""Built-in verifiable tasks, generated offline: arithmetic and Countdown.

Deterministic: the same settings and `data.task_seed` give the same problems in the same order.
Disjoint splits: whether a problem is in train or test is a fixed hash of the problem itself (one in
TEST_EVERY), independent of the seed and the requested counts, so no seed or size can leak test
problems into training.
"""

from __future__ import annotations

import hashlib
import logging

import numpy as np

from jgrpo.config.errors import ConfigError
from jgrpo.data.formats import Example
from jgrpo.rewards.countdown import check_countdown

log = logging.getLogger("jgrpo.data")

TEST_EVERY = 10  # one problem in ten belongs to the test split
ENUMERATE_LIMIT = 4_000_000  # problem spaces up to this size are enumerated, larger ones sampled
COUNTDOWN_NUMBER_RANGE = (1, 99)  # inclusive range of the given numbers
COUNTDOWN_TARGET_RANGE = (1, 999)  # inclusive range of targets


def _is_test_index(index: np.ndarray) -> np.ndarray:
    """splitmix64 of the problem index: a fixed, well-mixed train/test assignment."""
    with np.errstate(over="ignore"):
        z = index.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return z % np.uint64(TEST_EVERY) == 0


def is_test_key(key: str) -> bool:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little") % TEST_EVERY == 0


def check_split(split: str, task: str) -> bool:
    """Whether a built-in task's `split` is its test split; another name than train / test is a config error."""
    if split not in ("train", "test"):
        raise ConfigError(f"data.split={split!r}: the built-in task {task!r} has the splits 'train' and 'test'")
    return split == "test"


def warn_short(task: str, split: str, got: int, wanted: int) -> None:
    if got == 0:
        raise ConfigError(f"data.source={task}: these data.* settings allow no {split} problems at all; use more "
                          "digits or operators")
    if got < wanted:
        log.warning("%s: only %d distinct %s problems exist with these settings (asked for %d)",
                    task, got, split, wanted)


def arithmetic_examples(*, digits: int, operators: str, split: str, count: int, seed: int) -> list[Example]:
    """`count` problems "What is a <op> b?" with `digits`-digit operands; reference answer is the exact result."""
    want_test = check_split(split, "arithmetic")
    low, high = (0 if digits == 1 else 10 ** (digits - 1)), 10**digits - 1
    span = high - low + 1
    size = len(operators) * span * span  # index = (op * span + a) * span + b
    rng = np.random.default_rng([seed, 1])
    if size <= ENUMERATE_LIMIT:
        order = rng.permutation(size)
        chosen = order[_is_test_index(order) == want_test][:count]
    else:  # sample with rejection; the space is so large that duplicates are rare
        chosen_list, seen = [], set()
        while len(chosen_list) < count:
            draw = rng.integers(0, size, size=4 * count + 16)
            for idx in draw[_is_test_index(draw) == want_test].tolist():
                if idx not in seen and len(chosen_list) < count:
                    seen.add(idx)
                    chosen_list.append(idx)
        chosen = np.asarray(chosen_list, np.int64)
    warn_short("arithmetic", split, len(chosen), count)
    examples = []
    for idx in chosen.tolist():
        op_index, rest = divmod(idx, span * span)
        a, b = low + rest // span, low + rest % span
        op = operators[op_index]
        result = a + b if op == "+" else a - b if op == "-" else a * b
        examples.append(Example(f"What is {a} {op} {b}?", {"answer": str(result)}))
    return examples


def _random_solution(rng: np.random.Generator, numbers: list[int]) -> tuple[int, str] | None:
    """Combine all `numbers` with random operations into (value, expression); None if a step is not allowed.

    Countdown rules: every intermediate value is a positive integer (no negatives, no fractions).
    """
    items = [(n, str(n)) for n in numbers]
    while len(items) > 1:
        i, j = rng.choice(len(items), size=2, replace=False).tolist()
        (a, ea), (b, eb) = items[i], items[j]
        op = "+-*/"[int(rng.integers(4))]
        if op == "-" and a < b or op == "/" and b > a:
            (a, ea), (b, eb) = (b, eb), (a, ea)
        if op == "-" and a == b or op == "/" and a % b:
            return None
        value = a + b if op == "+" else a - b if op == "-" else a * b if op == "*" else a // b
        items = [item for k, item in enumerate(items) if k not in (i, j)] + [(value, f"({ea} {op} {eb})")]
    value, expression = items[0]
    return value, expression[1:-1]


def countdown_examples(*, num_numbers: int, split: str, count: int, seed: int) -> list[Example]:
    """`count` Countdown problems: reach a target with `num_numbers` given numbers, each used exactly once.

    Every problem is generated together with one solution (reference `solution`), so each is solvable.
    """
    want_test = check_split(split, "countdown")
    rng = np.random.default_rng([seed, 2])
    examples, seen = [], set()
    attempts, max_attempts = 0, 200 * count * TEST_EVERY + 1000
    while len(examples) < count and attempts < max_attempts:
        attempts += 1
        numbers = rng.integers(COUNTDOWN_NUMBER_RANGE[0], COUNTDOWN_NUMBER_RANGE[1] + 1, size=num_numbers).tolist()
        solved = _random_solution(rng, numbers)
        if solved is None:
            continue
        target, solution = solved
        if not COUNTDOWN_TARGET_RANGE[0] <= target <= COUNTDOWN_TARGET_RANGE[1] or target in numbers:
            continue
        key = f"{sorted(numbers)}->{target}"
        if key in seen or is_test_key(key) != want_test:
            continue
        seen.add(key)
        assert check_countdown(solution, numbers, target), (solution, numbers, target)  # generator invariant
        question = (f"Using the numbers {numbers}, write an equation that equals {target}. Use +, -, * and /, "
                    "each number exactly once, and parentheses as needed. Put the equation in <answer></answer> "
                    "tags, for example <answer>(1 + 2) * 3</answer>.")
        reference = {"answer": solution, "numbers": numbers, "target": target, "use_all": True,
                     "solution": solution}
        examples.append(Example(question, reference))
    warn_short("countdown", split, len(examples), count)
    return examples
