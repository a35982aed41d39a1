"""rollout/versions_per_row and rollout/slot_utilization (jgrpo/rollout/slot_metrics.py), by hand."""

import numpy as np
import pytest

from jgrpo.rollout.slot_metrics import generate_utilization, versions_per_row


@pytest.mark.parametrize("lengths, slots, queues, expected", [
    # 2 slots: rows 5 and 3 start at step 0; row 3's slot takes row 2 at step 2 and the last row at step 3; the
    # last token is drawn at step 4. Busy 4 + 2 + 1 + 1 = 8 of 2 x 4.
    ([5, 3, 2, 2], 2, 1, 1.0),
    ([5, 3], 2, 1, 6 / 8),  # the row of 3 is done after 2 steps, its slot idles 2 more
    # Two queues of one slot: queue 0 runs 5 then 3 (steps 4 + 2 = 6), queue 1 runs 2 and 2 (steps 1 + 1).
    ([5, 3, 2, 2], 2, 2, 8 / 12),
    ([1, 3], 1, 1, 2 / 3),  # a row that stops at its first token holds its slot for one step
])
def test_generate_utilization_by_hand(lengths, slots, queues, expected):
    assert generate_utilization(np.asarray(lengths), slots, queues) == pytest.approx(expected)


def test_versions_per_row_counts_the_versions_of_drawn_tokens():
    version = np.asarray([[3, 3, 4, -1], [5, 5, 5, 5], [-1, 6, 7, 8]])
    drawn = version >= 0
    assert versions_per_row(version, drawn) == {"rollout/versions_per_row": 2.0, "rollout/versions_per_row_max": 3.0}
