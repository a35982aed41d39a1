"""`rollout.weight_delta: auto`: whole copies or changes, whichever this run measures faster.

Which one wins depends on the hardware, not on a rule of thumb: changes save bytes on the link, and cost a
comparison of the new copy with the last one on the trainer and a write of each change on the rollout job. On a
CPU host over loopback the link is a memory copy, as fast as the comparison, and whole copies win
(docs/benchmarks.md "Two jobs"); on an accelerator the comparison runs at HBM bandwidth and the link is the
slower part. So the sender times both, as the run goes: a whole copy first (the rollout job holds nothing), then
changes (the first after a whole copy computes the fingerprints in full and makes the rollout job's spares: not
counted), and from then on the faster by the last steady figure of each, trying the other again every
PROBE_EVERY publishes (the changed fraction drifts as the learning rate decays). The seconds are summed over the
trainer's processes (a small collective) before each choice, so every process makes the same one.
"""

from __future__ import annotations

import numpy as np

from jgrpo.parallel.host_arrays import global_sum

PROBE_EVERY = 20  # publishes between two tries of the kind not chosen


class MeasuredChoice:
    def __init__(self):
        self.seconds: dict[str, float | None] = {"whole": None, "changes": None}  # the last steady publish of each
        self._since_probe = 0
        self._queued: list[str] = []  # the second publish of a try of changes
        self._last: str | None = None

    def next(self) -> str:
        """The kind of the next publish (when the rollout job holds a base: else it is whole anyway)."""
        if self._queued:
            return self._queued.pop()
        whole, changes = self.seconds["whole"], self.seconds["changes"]
        best = "changes" if changes is not None and (whole is None or changes <= whole) else "whole"
        if changes is not None and self._since_probe < PROBE_EVERY:
            return best
        self._since_probe = 0
        other = "changes" if changes is None or best == "whole" else "whole"
        if other == "changes":
            self._queued = ["changes"]  # twice: the first after a whole copy is warm
        return other

    def record(self, kind: str, seconds: float) -> None:
        """A publish of `kind` took `seconds` on this process; summed over the trainer's processes (a collective:
        every process calls it, in the same order), so that every one chooses alike."""
        total = float(global_sum(np.asarray([seconds], np.float64))[0])
        if kind == "whole" or self._last == "changes":  # (changes right after a whole copy: warm, not counted)
            self.seconds[kind] = total
        self._since_probe += 1
        self._last = kind
