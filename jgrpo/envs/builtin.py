"""The built-in environments (`env.name`) and how a name becomes an environment class.

- `calculator`: arithmetic questions (the built-in `arithmetic` task, e.g. 3-4 digit products) answered with
  the `calculator` tool; the final answer is scored by `reward.functions` (`exact_numeric`). With
  `env.tools: []` the same questions without the tool (the baseline the tool is measured against).
- `guess_number`: higher/lower, no tools: the environment thinks of a number from 1 to 100 (the row's `secret`
  field, else drawn from the episode's seed); a right guess ends the episode with reward 1, a wrong one gets
  "higher" or "lower" and reward 0.
- `module:Class`: an `Environment` subclass of your own, imported from an importable module.
"""

from __future__ import annotations

import importlib
import random
import re

from jgrpo.config.errors import ConfigError
from jgrpo.envs.base import Environment, StepResult, ToolEnvironment, Turn
from jgrpo.envs.sandbox import python_sandbox


class CalculatorEnvironment(ToolEnvironment):
    default_tools = ("calculator",)


class GuessNumberEnvironment(Environment):
    LOW, HIGH = 1, 100

    def reset(self, row: dict, seed: int) -> list[dict]:
        secret = row.get("secret")
        self.secret = int(secret) if secret is not None else random.Random(seed).randint(self.LOW, self.HIGH)
        system = self.config.data.system_prompt
        task = (f"I am thinking of a whole number from {self.LOW} to {self.HIGH}. Guess it: answer with one "
                "number. After a wrong guess I tell you whether my number is higher or lower.")
        return ([{"role": "system", "content": system}] if system is not None else []) + [
            {"role": "user", "content": task}]

    def step(self, turn: Turn) -> StepResult:
        numbers = re.findall(r"-?\d+", turn.text)
        if not numbers:
            return StepResult([{"role": "user", "content": f"Answer with one whole number from {self.LOW} to "
                                                           f"{self.HIGH}."}], 0.0, False, {"no_guess": 1})
        guess = int(numbers[-1])
        if guess == self.secret:
            return StepResult([], 1.0, True)
        return StepResult([{"role": "user", "content": "Higher." if self.secret > guess else "Lower."}], 0.0, False)


BUILTIN_ENVIRONMENTS = {"calculator": CalculatorEnvironment, "guess_number": GuessNumberEnvironment}


def environment_class(name: str) -> type[Environment]:
    """`env.name` -> the class (ValueError naming what is wrong: an unknown name, a module that does not import,
    a missing class or one that is not an Environment)."""
    if name in BUILTIN_ENVIRONMENTS:
        return BUILTIN_ENVIRONMENTS[name]
    if ":" not in name:
        raise ValueError(f"unknown environment {name!r}: the built-ins are {sorted(BUILTIN_ENVIRONMENTS)}, or "
                         "module:Class for your own")
    module_name, _, class_name = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # an import error is the user's, reported with its cause  # noqa: BLE001
        raise ValueError(f"the environment module {module_name!r} does not import: {type(e).__name__}: {e}") from e
    cls = getattr(module, class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise ValueError(f"{name!r}: {module_name} has no Environment subclass named {class_name!r}")
    return cls


def check_tools(config) -> None:
    """Before any model loads: the tools the run's environment uses can run here (the python tool needs its
    sandbox, `env.sandbox`: bubblewrap under `auto`), else ConfigError saying what to install or set."""
    e = config.env
    if not e.on:
        return
    names = e.tools
    if names is None:
        try:
            names = getattr(environment_class(e.name), "default_tools", ())
        except ValueError as error:
            raise ConfigError(f"env.name={e.name}: {error}") from error
    if "python" in names:
        python_sandbox(e)
