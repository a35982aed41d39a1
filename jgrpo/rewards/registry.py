"""Reward functions by name: the built-ins, anything registered with `@register_reward`, or "module:function".

A reward function is `fn(prompt: str, completion: str, reference: dict) -> float`. Rewards run in worker
processes (see pool.py), so every function must be importable by module path: one defined in `__main__`
is refused with a message saying so.
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable

from jgrpo.config.errors import RewardSetupError

RewardFn = Callable[[str, str, dict], float]

_REGISTRY: dict[str, RewardFn] = {}
_BUILTIN_MODULES = ("jgrpo.rewards.answers", "jgrpo.rewards.countdown", "jgrpo.rewards.format")


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator: make `fn` available to RewardConfig.functions as `name`."""

    def decorate(fn: RewardFn) -> RewardFn:
        existing = _REGISTRY.get(name)
        if existing is not None and reward_path(existing) != reward_path(fn):
            raise RewardSetupError(f"reward name {name!r} is already registered to {reward_path(existing)}")
        _REGISTRY[name] = fn
        return fn

    return decorate


def _load_builtins() -> None:
    for module in _BUILTIN_MODULES:
        importlib.import_module(module)


def available_rewards() -> list[str]:
    _load_builtins()
    return sorted(_REGISTRY)


def get_reward(name: str) -> RewardFn:
    """The function for a registered name or a "package.module:function" path; unknown names list the valid ones."""
    if ":" in name:
        module_name, _, attr = name.partition(":")
        try:
            obj = importlib.import_module(module_name)
        except ImportError as e:
            raise RewardSetupError(f"reward.functions: cannot import module {module_name!r} of reward {name!r} ({e}); "
                                   "it must be importable from the directory you run in (or on PYTHONPATH)") from None
        except Exception as e:  # noqa: BLE001 - the module itself fails while importing: the user's code
            raise RewardSetupError(f"reward.functions: importing module {module_name!r} for reward {name!r} "
                                   f"raised {type(e).__name__}: {e}") from None
        for part in attr.split("."):
            if not hasattr(obj, part):
                raise RewardSetupError(f"reward.functions: module {module_name!r} has no attribute {attr!r} "
                                       f"(reward {name!r})")
            obj = getattr(obj, part)
        if not callable(obj):
            raise RewardSetupError(f"reward.functions: {name!r} is not callable")
        return obj
    _load_builtins()
    if name not in _REGISTRY:
        close = difflib.get_close_matches(name, _REGISTRY, n=3, cutoff=0.5)
        hint = f"did you mean {', '.join(close)}? " if close else ""
        raise RewardSetupError(f"reward.functions: unknown reward function {name!r}; {hint}available: "
                               f"{', '.join(sorted(_REGISTRY))}, or a 'package.module:function' path")
    return _REGISTRY[name]


def reward_path(fn: RewardFn) -> str:
    """The "module:qualname" a worker process imports to get `fn`."""
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    if not module or not qualname or "<" in qualname:
        raise RewardSetupError(f"reward function {fn!r} must be a module-level function (workers import it by name)")
    if module == "__main__":
        raise RewardSetupError(f"reward function {qualname!r} is defined in __main__; reward workers cannot import it, "
                         "move it to an importable module")
    return f"{module}:{qualname}"
