"""The import paths of jgrpo before its modules were grouped into rooms (docs/architecture.md), for one release.

`import jgrpo.trainer` (or `from jgrpo.sampler import generate`) still works: a finder on `sys.meta_path`
answers each old name with the module that now holds its code, the same module object, so a monkeypatch
through either name changes both. Each old name warns once (FutureWarning), naming the new path. The finder
is installed when `jgrpo` is imported; it only answers the names below, and resolves nothing else.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

# old module (jgrpo.<old>) -> the module that holds its code now (jgrpo.<new>). `jgrpo.config`, `jgrpo.rollout` and
# `jgrpo.planning` are packages now; their old names resolve through their own `__init__`.
MOVED = {
    "config_errors": "config.errors", "config_grpo": "config.grpo", "config_loading": "config.loading",
    "config_docs": "config.docs",
    "mesh": "parallel.mesh", "host_arrays": "parallel.host_arrays", "distributed": "parallel.distributed",
    "platform_defaults": "parallel.platform_defaults", "process_setup": "parallel.startup",
    "frozen_base": "models.frozen_base",
    "sampler": "sampling.sampler", "slot_decoding": "sampling.decode_loop", "sampling_methods": "sampling.methods",
    "advantages": "rl.advantages", "objectives": "rl.objectives", "corrections": "rl.corrections",
    "diagnostics": "rl.diagnostics", "logprobs": "rl.logprobs", "behaviour_refresh": "rl.behaviour_refresh",
    "rollout_source": "rollout.sources", "dynamic_sampling": "rollout.dynamic_sampling",
    "async_rollouts": "rollout.async_producer", "sampling_policy": "rollout.sampling_weights",
    "evaluator": "rollout.evaluator",
    "trainer": "training.trainer", "train_step": "training.steps", "checkpoint": "training.checkpoint",
    "optim": "training.optimizer", "trainer_metrics": "training.iteration_record", "metrics": "training.metrics_log",
    "preflight": "training.preflight", "fingerprint": "parallel.fingerprint",
    "abstract_run": "planning.abstract_run", "hlo_cost": "planning.hlo_cost", "hlo_inspect": "planning.hlo_inspect",
    "roofline": "planning.roofline",
    # The paged cache (docs/architecture.md): the sampler's modules named after what they hold.
    "sampling.pool": "sampling.state", "sampling.slot_pool": "sampling.decode_loop",
    "models.decode": "models.decode_step",
    # The weight transport gathered in one folder (parallel/weights/); the content fingerprint went below it.
    "training.fingerprint": "parallel.fingerprint", "parallel.device_transfer": "parallel.weights.device_transfer",
    "parallel.process_crossing": "parallel.weights.process_crossing",
    # Rollouts that never drain: one name per concept (`collect` and `collector` differed by two letters).
    "rollout.collect": "rollout.scoring",
}
_warned: set[str] = set()


def _warn_once(old: str, new: str, stacklevel: int) -> None:
    """`stacklevel` counts the frames up to the user's import (the warnings module skips importlib's own)."""
    if old not in _warned:
        _warned.add(old)
        warnings.warn(f"{old} moved to {new}; the old path goes in the next release (docs/architecture.md)",
                      FutureWarning, stacklevel=stacklevel + 1)


class _Alias(importlib.abc.Loader):
    def __init__(self, target: str):
        self.target = target

    def create_module(self, spec):
        _warn_once(spec.name, self.target, stacklevel=2)
        module = importlib.import_module(self.target)
        self.spec = module.__spec__
        return module

    def exec_module(self, module) -> None:
        # The target ran its own code when it was imported; the import system has just set the old name's spec
        # on it: give it back its own, so the module keeps one identity.
        module.__spec__ = self.spec


class _MovedFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        old = fullname.removeprefix("jgrpo.")
        if fullname.startswith("jgrpo.") and old in MOVED:
            return importlib.util.spec_from_loader(fullname, _Alias(f"jgrpo.{MOVED[old]}"))
        return None


def install() -> None:
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.append(_MovedFinder())


def moved_attribute(package: str, name: str, moved: dict[str, str]):
    """For a package's `__getattr__`: an attribute of the old module of the same name, from its new home."""
    if name not in moved:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    _warn_once(f"{package}.{name}", f"{moved[name]}.{name}", stacklevel=3)
    return getattr(importlib.import_module(moved[name]), name)
