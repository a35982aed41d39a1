"""Score a batch of completions with the weighted reward functions of a RewardConfig.

A call that raises, returns something that is not a finite number, crashes its worker, or runs past
`reward.timeout_s` scores 0 for that sample; it is counted per function (`reward/<name>/failures`), each kind of
failure is logged once with the completion that caused it, and training goes on.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Sequence

import numpy as np

from jgrpo.config import ConfigError, RewardConfig
from jgrpo.rewards.pool import RewardWorkerPool
from jgrpo.rewards.registry import get_reward, reward_path

log = logging.getLogger("jgrpo.rewards")


@dataclasses.dataclass(frozen=True)
class RewardResult:
    total: np.ndarray  # [N] float32: sum over functions of weight * value
    per_function: dict[str, np.ndarray]  # name -> [N] float32 unweighted values (0 where the call failed)
    failures: dict[str, int]  # name -> calls that raised, crashed or timed out
    timeouts: dict[str, int]  # name -> the subset of failures that timed out

    def metrics(self) -> dict[str, float]:
        """Flat scalars for the metrics log: mean reward per function and failure counts."""
        out = {"reward/total": float(self.total.mean()) if self.total.size else 0.0}
        for name, values in self.per_function.items():
            out[f"reward/{name}"] = float(values.mean()) if values.size else 0.0
            out[f"reward/{name}/failures"] = float(self.failures[name])
            out[f"reward/{name}/timeouts"] = float(self.timeouts[name])
        return out


class RewardScorer:
    """`RewardScorer(config.reward).score(prompts, completions, references) -> RewardResult`.

    Functions are resolved (and bad names rejected) when the scorer is built; their calls run on a persistent
    pool of worker processes. Close it (or use it as a context manager) to stop the workers early; they are
    also stopped at interpreter exit.
    """

    def __init__(self, config: RewardConfig):
        if len(set(config.functions)) != len(config.functions):
            raise ConfigError(f"reward.functions={config.functions!r} lists a function twice")
        self.names = list(config.functions)
        self.weights = np.asarray(config.weights, np.float32)
        self._paths = [reward_path(get_reward(name)) for name in self.names]
        self._pool = RewardWorkerPool(sorted(set(self._paths)), num_workers=config.num_workers,
                                      timeout_s=config.timeout_s)
        # One call at a time: async rollouts score in their producer thread while the evaluator scores in the
        # trainer's, and the pool's workers answer one request at a time.
        self._lock = threading.Lock()
        self._reported: set[tuple[str, str]] = set()  # (function, kind of failure) already logged with an example

    def close(self) -> None:
        self._pool.close()

    def __enter__(self) -> RewardScorer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def score(self, prompts: Sequence[str], completions: Sequence[str], references: Sequence[dict]) -> RewardResult:
        """Rewards of N completions.

        `prompts` and `references` have one entry per completion, or one per prompt when each prompt has G
        completions in consecutive rows (N = B * G, rows b*G .. b*G+G-1 belong to prompt b).
        """
        n = len(completions)
        if len(prompts) != len(references):
            raise ValueError(f"{len(prompts)} prompts but {len(references)} references")
        if len(prompts) == 0 or n % len(prompts):
            raise ValueError(f"{n} completions cannot be grouped over {len(prompts)} prompts")
        group = n // len(prompts)
        calls = [(path, prompts[i // group], completions[i], references[i // group])
                 for path in self._paths for i in range(n)]
        with self._lock:
            outcomes = self._pool.run(calls)
        per_function, failures, timeouts = {}, {}, {}
        for f, name in enumerate(self.names):
            chunk = outcomes[f * n : (f + 1) * n]
            per_function[name] = np.asarray([o.value for o in chunk], np.float32)  # [N]
            failed = [o for o in chunk if o.status != "ok"]
            failures[name] = len(failed)
            timeouts[name] = sum(o.status == "timeout" for o in failed)
            for i, o in enumerate(chunk):
                self._report_first_of_kind(name, o, completions[i])
            if failed:
                log.info("reward %r gave 0 to %d of %d samples (%d timed out after %g s); first: %s: %s",
                            name, len(failed), n, timeouts[name], self._pool.timeout_s,
                            failed[0].status, failed[0].message)
        total = sum((w * per_function[name] for w, name in zip(self.weights, self.names, strict=True)),
                    np.zeros(n, np.float32))
        return RewardResult(total.astype(np.float32), per_function, failures, timeouts)

    def _report_first_of_kind(self, name: str, outcome, completion: str) -> None:
        """Log each kind of failure of each function once, with the completion that caused it."""
        if outcome.status == "ok":
            return
        kind = outcome.message.split(":", 1)[0] if outcome.status == "error" else outcome.status
        if (name, kind) in self._reported:
            return
        self._reported.add((name, kind))
        log.warning("reward %r: %s; such calls score 0 and are counted in reward/%s/failures (each kind is logged "
                    "once). The completion: %r", name, outcome.message, name, completion[:300])
