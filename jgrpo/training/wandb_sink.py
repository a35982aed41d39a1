"""Weights & Biases as a third sink beside metrics.jsonl and TensorBoard: `logging.wandb_project` (off when empty).

`logging.wandb_mode`: `online` (needs a login and the network), `offline` (files under RUN_DIR/wandb, uploaded
later with `wandb sync`) or `disabled`. The run's resolved config is the W&B run's config; every iteration's
scalars are logged at step = iteration, and the sample dumps (`logging.samples_every`) as a table. The W&B run id
is kept in RUN_DIR/wandb_run_id, so a resumed run continues the same W&B run (W&B keeps the first value it saw
for a step: iterations redone after a resume keep their first logged values there; metrics.jsonl has the redo).
`wandb` is an optional extra (`pip install 'jgrpo[wandb]'`); without it, setting the key is a config error.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from etils import epath

from jgrpo.config import ConfigError, LoggingConfig

RUN_ID_FILE = "wandb_run_id"


def require_wandb(config: LoggingConfig) -> None:
    """A config error when W&B logging is asked for and the package is missing (checked before a model loads)."""
    if not config.wandb_project or config.wandb_mode == "disabled":
        return
    try:
        import wandb  # noqa: F401
    except ImportError:
        raise ConfigError(f"logging.wandb_project={config.wandb_project!r} needs the wandb package, which is not "
                          "installed: pip install 'jgrpo[wandb]' (or wandb), or leave logging.wandb_project "
                          "empty") from None


class WandbSink:
    def __init__(self, run_dir: epath.Path, config: LoggingConfig, run_config: Mapping[str, Any]):
        require_wandb(config)
        import wandb

        self._wandb = wandb
        id_file = run_dir / RUN_ID_FILE
        run_id = id_file.read_text().strip() if id_file.exists() else uuid.uuid4().hex[:12]
        id_file.write_text(run_id + "\n")
        self.run = wandb.init(project=config.wandb_project, mode=config.wandb_mode, dir=str(run_dir),
                              config=dict(run_config), id=run_id, name=run_dir.name, resume="allow")

    def log(self, iteration: int, record: Mapping[str, Any]) -> None:
        scalars = {k: v for k, v in record.items() if k != "iteration" and isinstance(v, (int, float))
                   and not isinstance(v, bool) and math.isfinite(v)}
        self.run.log(scalars, step=iteration, commit=True)  # the iteration's row is complete: written now

    def log_samples(self, iteration: int, samples: Sequence[Mapping[str, Any]]) -> None:
        if not samples:
            return
        columns = list(samples[0])
        table = self._wandb.Table(columns=columns, data=[[_cell(s.get(c)) for c in columns] for s in samples])
        self.run.log({"samples": table}, step=iteration, commit=False)  # the trainer logs samples, then scalars

    def close(self) -> None:
        self.run.finish()


def _cell(value: Any) -> Any:
    """A table cell: numbers and text as they are, anything else (lists, dicts) as its text."""
    return value if isinstance(value, (str, int, float, bool)) or value is None else str(value)
