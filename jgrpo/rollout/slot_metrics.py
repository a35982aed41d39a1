"""What a batch's sampling tells of the sampler's use, logged every iteration of `rollout.mode: async`:

- `rollout/versions_per_row` (mean and `_max`): the weights versions that drew a row's tokens (1 between batches;
  in flight, a row that spans k weight updates has k + 1);
- `rollout/slot_utilization`: rows that drew a token over the rows the sampler can decode at once (its slots),
  summed over its decode steps. In flight the stream counts it (`Pool.busy` over slots x steps, between two batches
  handed over); between batches `generate_utilization` replays `generate`'s schedule from the rows' lengths.
"""

from __future__ import annotations

import heapq

import numpy as np


def versions_per_row(version: np.ndarray, drawn: np.ndarray) -> dict:
    """{versions_per_row, versions_per_row_max} over rows (`version` [R, N], `drawn` [R, N]: the loss mask)."""
    counts = np.asarray([len(np.unique(v[d])) for v, d in zip(version, drawn, strict=True)])
    return {"rollout/versions_per_row": float(counts.mean()), "rollout/versions_per_row_max": float(counts.max())}


def generate_utilization(lengths: np.ndarray, slots: int, queues: int = 1) -> float:
    """Slot utilization of one `generate` call whose rows (queue-major, `queues` queues of slots / queues slots)
    ended with `lengths` tokens, without a page budget: each queue admits its rows in order into its free slots
    (the first token drawn at admission), a running row draws one token a step, and a row's slot takes the next
    row in the step its last token is drawn (after one step if it stopped at its first). Busy slot-steps (the sum
    of length - 1) over slots x the steps until the last row's last token."""
    lengths = np.asarray(lengths).reshape(queues, -1)
    per_queue = slots // queues
    clock = 0
    for row_lengths in lengths:
        free_at = [0] * min(per_queue, len(row_lengths))  # the step at which each slot takes its next row
        heapq.heapify(free_at)
        for n in row_lengths:
            start = heapq.heappop(free_at)
            clock = max(clock, start + int(n) - 1)
            heapq.heappush(free_at, start + max(int(n) - 1, 1))
    busy = int(np.sum(np.maximum(lengths - 1, 0)))
    return busy / (slots * clock) if clock else 1.0
