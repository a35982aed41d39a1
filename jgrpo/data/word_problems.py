"""Built-in GSM8K-style word problems (`data.source: word_problems`), generated offline with exact answers.

Each of the 14 templates is a short story with one to three arithmetic steps; names, objects, units and numbers
vary, and every answer is a whole number computed from the numbers drawn (reference: `answer`, `template`,
`held_out`, `numbers`, `steps`). The splits measure transfer to new phrasing, not memorisation:

- the templates in HELD_OUT appear only in the test split (their phrasings never reach training);
- the other templates appear in both, with disjoint problems: a fixed hash of the problem itself (template and
  numbers) puts one in TEST_EVERY in the test split, whatever the seed or the counts.

The test split alternates a held-out-template problem with a seen-template one: half of it measures new
phrasing, half new numbers in known phrasing (the reference's `held_out` tells them apart). Deterministic: the
same `data.task_seed` and counts give the same problems in the same order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from jgrpo.data.formats import Example
from jgrpo.data.tasks import check_split, is_test_key, warn_short

NAMES = ("Ava", "Ben", "Chloe", "Diego", "Emma", "Farah", "Gus", "Hana", "Ivan", "Jia", "Kofi", "Lena", "Mateo",
         "Nora", "Omar", "Priya", "Quinn", "Rosa", "Sam", "Tariq", "Uma", "Victor", "Wen", "Yara", "Zane")
ITEMS = ("apple", "marble", "sticker", "pencil", "cookie", "seashell", "stamp", "card", "balloon", "book",
         "orange", "cupcake", "crayon", "coin", "shirt")
VEHICLES = (("train", "kilometers"), ("car", "miles"), ("bus", "kilometers"), ("boat", "miles"),
            ("cyclist", "kilometers"))
INGREDIENTS = ("flour", "sugar", "rice", "milk", "oats")


@dataclasses.dataclass(frozen=True)
class Template:
    name: str
    steps: int
    draw: Callable[[np.random.Generator], tuple[str, int, tuple[int, ...]]]  # -> (question, answer, numbers)


def _pick(rng, options):
    return options[int(rng.integers(len(options)))]


def _int(rng, low, high):
    return int(rng.integers(low, high + 1))


def _buy(rng):
    name, item, n, price = _pick(rng, NAMES), _pick(rng, ITEMS), _int(rng, 2, 12), _int(rng, 2, 25)
    return f"{name} buys {n} {item}s at ${price} each. How many dollars does {name} spend?", n * price, (n, price)


def _share(rng):
    name, item, each, friends = _pick(rng, NAMES), _pick(rng, ITEMS), _int(rng, 2, 15), _int(rng, 2, 9)
    return (f"{name} has {each * friends} {item}s and shares them equally among {friends} friends. How many "
            f"{item}s does each friend get?", each, (each * friends, friends))


def _found_gave(rng):
    name, item, had, found = _pick(rng, NAMES), _pick(rng, ITEMS), _int(rng, 5, 60), _int(rng, 2, 40)
    gave = _int(rng, 1, had + found - 1)
    return (f"{name} had {had} {item}s, found {found} more, and then gave {gave} to a friend. How many {item}s "
            f"does {name} have now?", had + found - gave, (had, found, gave))


def _travel(rng):
    (vehicle, unit), speed, hours = _pick(rng, VEHICLES), _int(rng, 10, 90), _int(rng, 2, 9)
    return (f"A {vehicle} travels at {speed} {unit} per hour for {hours} hours. How many {unit} does it travel?",
            speed * hours, (speed, hours))


def _boxes(rng):
    name, item, boxes, per = _pick(rng, NAMES), _pick(rng, ITEMS), _int(rng, 2, 12), _int(rng, 3, 20)
    taken = _int(rng, 1, boxes * per - 1)
    return (f"There are {boxes} boxes with {per} {item}s in each box. {name} takes out {taken} {item}s. How many "
            f"{item}s are left in the boxes?", boxes * per - taken, (boxes, per, taken))


def _savings(rng):
    name, weekly, weeks = _pick(rng, NAMES), _int(rng, 3, 40), _int(rng, 2, 12)
    spent = _int(rng, 1, weekly * weeks - 1)
    return (f"{name} saves ${weekly} every week for {weeks} weeks and then spends ${spent} on a gift. How many "
            f"dollars does {name} have left?", weekly * weeks - spent, (weekly, weeks, spent))


def _price_rise(rng):
    name, item, price = _pick(rng, NAMES), _pick(rng, ITEMS), _int(rng, 2, 30)
    rise, n = _int(rng, 1, 9), _int(rng, 2, 9)
    return (f"A {item} costs ${price}. The price goes up by ${rise}, and then {name} buys {n} {item}s. How many "
            f"dollars does {name} pay?", (price + rise) * n, (price, rise, n))


def _teams(rng):
    item, size, teams, each = _pick(rng, ITEMS), _int(rng, 2, 6), _int(rng, 2, 10), _int(rng, 2, 8)
    return (f"{size * teams} students are split into teams of {size}. Each team gets {each} {item}s. How many "
            f"{item}s are needed in all?", teams * each, (size * teams, size, each))


def _ages(rng):
    first, second = _pick(rng, NAMES[:12]), _pick(rng, NAMES[12:])
    age, older, later = _int(rng, 3, 40), _int(rng, 1, 25), _int(rng, 1, 15)
    return (f"{first} is {age} years old. {second} is {older} years older than {first}. How old will {second} be "
            f"in {later} years?", age + older + later, (age, older, later))


def _recipe(rng):
    ingredient, cups, servings, times = _pick(rng, INGREDIENTS), _int(rng, 2, 6), _int(rng, 2, 8), _int(rng, 2, 6)
    return (f"A recipe uses {cups} cups of {ingredient} to make {servings} servings. How many cups of {ingredient} "
            f"are needed to make {servings * times} servings?", cups * times, (cups, servings, servings * times))


def _pages(rng):
    name, per_day, days, rest = _pick(rng, NAMES), _int(rng, 5, 40), _int(rng, 2, 10), _int(rng, 1, 80)
    return (f"A book has {per_day * days + rest} pages. {name} reads {per_day} pages every day. How many pages are "
            f"left after {days} days?", rest, (per_day * days + rest, per_day, days))


def _change(rng):
    name, item, n, price = _pick(rng, NAMES), _pick(rng, ITEMS), _int(rng, 2, 8), _int(rng, 1, 12)
    bill = next(b for b in (10, 20, 50, 100) if b > n * price)
    return (f"{name} pays for {n} {item}s that cost ${price} each with a ${bill} bill. How many dollars of change "
            f"does {name} get?", bill - n * price, (n, price, bill))


def _two_legs(rng):
    (vehicle, unit), first, hours, second, more = (_pick(rng, VEHICLES), _int(rng, 10, 80), _int(rng, 2, 6),
                                                   _int(rng, 10, 80), _int(rng, 2, 6))
    return (f"A {vehicle} travels at {first} {unit} per hour for {hours} hours, then at {second} {unit} per hour "
            f"for {more} hours. How many {unit} does it travel in all?", first * hours + second * more,
            (first, hours, second, more))


def _shopping(rng):
    name, item, other = _pick(rng, NAMES), _pick(rng, ITEMS[:7]), _pick(rng, ITEMS[7:])
    n, price, m, cost = _int(rng, 2, 6), _int(rng, 1, 9), _int(rng, 2, 6), _int(rng, 1, 9)
    bill = next(b for b in (20, 50, 100) if b > n * price + m * cost)
    return (f"{name} buys {n} {item}s at ${price} each and {m} {other}s at ${cost} each, and pays with a ${bill} "
            f"bill. How many dollars of change does {name} get?", bill - n * price - m * cost,
            (n, price, m, cost, bill))


TEMPLATES = (
    Template("buy", 1, _buy), Template("share", 1, _share), Template("found_gave", 2, _found_gave),
    Template("travel", 1, _travel), Template("boxes", 2, _boxes), Template("savings", 2, _savings),
    Template("price_rise", 2, _price_rise), Template("teams", 2, _teams), Template("two_legs", 3, _two_legs),
    # Held out: only in the test split. Each uses operations the seen templates train (sums of several terms,
    # a multiplication after a division, products then a difference) in a story the model has not seen.
    Template("ages", 2, _ages), Template("recipe", 2, _recipe), Template("pages", 2, _pages),
    Template("change", 2, _change), Template("shopping", 3, _shopping),
)
HELD_OUT = frozenset({"ages", "recipe", "pages", "change", "shopping"})


def word_problem_examples(*, split: str, count: int, seed: int) -> list[Example]:
    """`count` problems of `split`: training draws the seen templates in turn; the test split alternates a
    held-out template's problem with a seen template's (new numbers)."""
    want_test = check_split(split, "word_problems")
    seen_templates = [t for t in TEMPLATES if t.name not in HELD_OUT]
    held_out = [t for t in TEMPLATES if t.name in HELD_OUT]
    rng = np.random.default_rng([seed, 3])
    examples, questions = [], set()
    attempts, max_attempts = 0, 200 * count * 10 + 1000
    while len(examples) < count and attempts < max_attempts:
        attempts += 1
        unseen = want_test and len(examples) % 2 == 0
        pool = held_out if unseen else seen_templates
        template = pool[(len(examples) // (2 if want_test else 1)) % len(pool)]
        question, answer, numbers = template.draw(rng)
        if question in questions:
            continue
        if not unseen and is_test_key(f"{template.name}:{numbers}") != want_test:
            continue  # a seen template's problem belongs to the other split
        questions.add(question)
        examples.append(Example(question, {"answer": answer, "template": template.name, "held_out": unseen,
                                           "numbers": list(numbers), "steps": template.steps}))
    warn_short("word_problems", split, len(examples), count)
    return examples
