"""What a training run checks before it loads a model, cheapest first, so a bad invocation fails in seconds.

Each check raises a `UserError` whose message names the key, path or file and what to do. None of them reads
weights or data rows: that the data source exists (not its rows: `jgrpo.data` reports bad rows by file and
line when it reads them), that the reward functions import, that the python tool's sandbox runs, that the mesh
fits the devices, that the run directory can be written. Calling `check_before_loading` twice is harmless (the
trainer calls it, and `python -m jgrpo.train` calls it before it writes the run's config.yaml).
"""

from __future__ import annotations

import uuid
from pathlib import Path

from jgrpo.config import Config, ConfigError
from jgrpo.config.errors import PathError
from jgrpo.data.sources import BUILTIN_TASKS, locate
from jgrpo.data.tasks import check_split
from jgrpo.envs.builtin import check_tools
from jgrpo.parallel.mesh import make_meshes
from jgrpo.rewards.registry import get_reward, reward_path
from jgrpo.training.wandb_sink import require_wandb


def check_output_dir(output_dir: str) -> None:
    """`run.output_dir` is a directory this process can write (made if missing). Buckets are checked when
    written: probing one costs a round trip and its permissions are not the local user's."""
    if "://" in output_dir:
        return
    path = Path(output_dir).expanduser()
    if path.exists() and not path.is_dir():
        raise PathError(f"run.output_dir={output_dir!r} is a file, not a directory: choose another run.output_dir "
                        "or move the file away")
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".jgrpo-write-check-{uuid.uuid4().hex}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise PathError(f"run.output_dir={output_dir!r} cannot be written ({e.strerror or e}): choose a directory "
                        "you can write, e.g. run.output_dir=runs/NAME") from None


def check_trains(config: Config) -> None:
    """Settings that are valid for sampling or evaluation but cannot train."""
    if config.sampler.temperature == 0:
        raise ConfigError("sampler.temperature=0 (greedy) cannot train: GRPO needs G different samples per prompt "
                          "and finite log-probs; use a temperature > 0 (greedy is for python -m jgrpo.eval)")
    if config.reward.overlong_buffer > config.sampler.max_new_tokens:
        raise ConfigError(f"reward.overlong_buffer={config.reward.overlong_buffer} is longer than "
                          f"sampler.max_new_tokens={config.sampler.max_new_tokens}")


def check_data_source(config: Config) -> None:
    """The train split exists, and the test split too when the run evaluates."""
    data = config.data
    if data.source in BUILTIN_TASKS:
        check_split(data.split, data.source)  # before any model loads
        return
    locate(data.source, data.split)
    if config.run.eval_every or config.run.eval_before:
        locate(data.source, "test")


def check_rewards(config: Config) -> None:
    for name in config.reward.functions:
        reward_path(get_reward(name))  # imports the function's module, as each reward worker will


def check_before_loading(config: Config) -> None:
    """Every check a training run can make before loading a model, in the order a user meets them."""
    check_trains(config)
    check_output_dir(config.run.output_dir)
    make_meshes(config.mesh)  # the axis sizes against the devices jax sees
    check_data_source(config)
    check_rewards(config)
    check_tools(config)
    require_wandb(config.logging)

