"""The packing plan (training/packing.py): hand-placed examples, overflow, shards, and pack/unpack of any field."""

import numpy as np
import pytest

from jgrpo.training.packing import PackedSizes, pack, plan_packing, unpack

_ = -1  # a padding slot


def test_first_fit_within_a_micro_batch_and_whole_groups_overflow_to_the_next():
    # Groups of 2 into 2 rows of 5, a row one group's: group 0 (3, 1) shares row 0; group 1 (4, 4) fits row 1 with
    # its first completion only, so the whole group opens micro-batch 1; group 2 (2, 2) finds no room left there.
    plan = plan_packing([3, 1, 4, 4, 2, 2], PackedSizes(rows=2, width=5, micro_batches=3), group_size=2)
    np.testing.assert_array_equal(plan.row, [
        [[0, 0, 0, 1, _], [_, _, _, _, _]],
        [[2, 2, 2, 2, _], [3, 3, 3, 3, _]],
        [[4, 4, 5, 5, _], [_, _, _, _, _]],
    ])
    np.testing.assert_array_equal(plan.position[0, 0], [0, 1, 2, 0, 0])
    np.testing.assert_array_equal(plan.segment[0, 0], [1, 1, 1, 2, 0])
    np.testing.assert_array_equal(plan.segment[2, 0], [1, 1, 2, 2, 0])
    assert plan.micro_batches == 3 and plan.fill == pytest.approx(16 / 30)


def test_groups_are_dealt_to_the_least_loaded_shard_and_stay_on_it():
    # 4 rows over 2 shards (rows 0-1 and 2-3). Loads: group 0 (10 tokens) -> shard 0; group 1 (2) -> shard 1;
    # group 2 (10) -> shard 1 (2 < 10), where it overflows to micro-batch 1; group 3 (2) -> shard 0 (10 < 12),
    # whose micro-batch 0 is full: micro-batch 1.
    plan = plan_packing([5, 5, 1, 1, 5, 5, 1, 1], PackedSizes(rows=4, width=5, micro_batches=2, shards=2), group_size=2)
    np.testing.assert_array_equal(plan.row, [
        [[0] * 5, [1] * 5, [2, 3, _, _, _], [_] * 5],
        [[6, 7, _, _, _], [_] * 5, [4] * 5, [5] * 5],
    ])
    assert plan.micro_batches == 2


def test_an_empty_completion_takes_no_slot_and_a_row_holds_one_group():
    # One row of 8: group 1's completion (3 tokens) would fit beside group 0's (2), but a row holds one group (its
    # completions attend to one prompt): it opens micro-batch 1. Unused micro-batches are padding.
    plan = plan_packing([2, 0, 0, 3], PackedSizes(rows=1, width=8, micro_batches=4), group_size=2)
    np.testing.assert_array_equal(plan.row[:2, 0], [[0, 0, _, _, _, _, _, _], [3, 3, 3, _, _, _, _, _]])
    assert plan.micro_batches == 2 and (plan.row[2:] == -1).all()
    np.testing.assert_array_equal(plan.owner, [0, 0, 1, 1])  # the empty completions' micro-batches too


def test_a_group_fits_only_where_its_prompt_fits_too():
    # Groups of 2 into 2 rows of 8, prompts (4, 3, 2 tokens) into 1 prompt row of 6. Group 1's completions would fit
    # micro-batch 0's free row, its prompt would not (4 + 3 > 6): the group opens micro-batch 1, where group 2
    # joins it (its own row, its prompt beside group 1's). Every row's prompt row is 0, the only one.
    plan = plan_packing([2, 2, 1, 1, 2, 2], PackedSizes(rows=2, width=8, prompt_rows=1, prompt_width=6,
                                                        micro_batches=3), group_size=2, prompt_lengths=[4, 3, 2])
    np.testing.assert_array_equal(plan.row[:2], [[[0, 0, 1, 1, _, _, _, _], [_] * 8],
                                                 [[2, 3, _, _, _, _, _, _], [4, 4, 5, 5, _, _, _, _]]])
    np.testing.assert_array_equal(plan.prompt_group[:, 0], [[0, 0, 0, 0, _, _], [1, 1, 1, 2, 2, _], [_] * 6])
    np.testing.assert_array_equal(plan.prompt_position[:2, 0], [[0, 1, 2, 3, 0, 0], [0, 1, 2, 0, 1, 0]])
    assert plan.micro_batches == 2 and (plan.prompt_row == 0).all()


@pytest.mark.parametrize("lengths,sizes,kwargs,message", [
    ([4, 4, 4], dict(rows=2, width=4, micro_batches=2), dict(group_size=2), "not whole groups of 2"),
    ([6, 1], dict(rows=2, width=5, micro_batches=2), dict(group_size=2), "longer than the packed width 5"),
    ([5, 5, 5, 5], dict(rows=2, width=5, micro_batches=3), dict(group_size=4), "does not fit 2 empty rows of 5"),
    ([5, 5, 5, 5], dict(rows=2, width=5, micro_batches=1), dict(group_size=2), "do not fit 1 micro-batches of 2 x 5"),
    ([1, 1], dict(rows=3, width=5, micro_batches=1, shards=2), dict(group_size=2), "3 packed rows do not split over 2"),
    ([1, 1], dict(rows=2, width=5, micro_batches=1, prompt_rows=1, prompt_width=6),
     dict(group_size=2, prompt_lengths=[7]), "a prompt of 7 tokens is longer than the packed prompt width 6"),
    ([1, 1], dict(rows=2, width=5, micro_batches=1, prompt_rows=1, prompt_width=6),
     dict(group_size=2, prompt_lengths=[2, 2]), "2 prompt lengths for 1 groups"),
    ([1, 1], dict(rows=2, width=5, micro_batches=1, shards=2, prompt_rows=1, prompt_width=6),
     dict(group_size=2, prompt_lengths=[2]), "1 packed prompt rows do not split over 2"),
])
def test_what_cannot_be_packed_is_named(lengths, sizes, kwargs, message):
    with pytest.raises(ValueError, match=message):
        plan_packing(lengths, PackedSizes(**sizes), **kwargs)


def test_unpack_inverts_pack_for_every_field_and_every_token_lands_once():
    # Random lengths from 0 to N, packed rows of 2N (two full completions each). Any per-token field, with or
    # without trailing dims (a routing record [n, N, layers, k]), goes through the same two functions.
    rng = np.random.default_rng(0)
    G, n, N = 4, 32, 16
    lengths = rng.integers(0, N + 1, n)
    lengths[:G] = N  # a group at full length
    prompt_lengths = rng.integers(1, 13, n // G)
    plan = plan_packing(lengths, PackedSizes(rows=8, width=2 * N, prompt_rows=2, prompt_width=24, micro_batches=4,
                                             shards=2), group_size=G, prompt_lengths=prompt_lengths)
    real = np.arange(N)[None] < lengths[:, None]  # [n, N]
    fields = {"tokens": rng.integers(1, 100, (n, N)), "lp_alpha": rng.normal(size=(n, N)).astype(np.float32),
              "loss_mask": rng.random((n, N)) < 0.5, "routing": rng.integers(0, 8, (n, N, 3, 2)).astype(np.uint8),
              "a_field_added_later": rng.normal(size=(n, N, 5)).astype(np.float32)}
    for name, x in fields.items():
        x = np.where(real.reshape(real.shape + (1,) * (x.ndim - 2)), x, np.zeros((), x.dtype))
        packed = pack(x, plan)
        assert packed.shape == (4, 8, 2 * N) + x.shape[2:], name
        np.testing.assert_array_equal(unpack(packed, plan, n, N), x, err_msg=name)
    counts = np.zeros((n, N), int)
    np.add.at(counts, (plan.row[plan.row >= 0], plan.position[plan.row >= 0]), 1)
    np.testing.assert_array_equal(counts, real.astype(int))
    u, k, _w = np.nonzero(plan.row >= 0)
    group, shard = plan.row[u, k, _w] // G, k // 4  # rows 0-3 are shard 0's, 4-7 shard 1's
    for g in np.unique(group):  # a group lies in one micro-batch of one shard, and so does its prompt, once
        assert len(set(u[group == g])) == 1 and len(set(shard[group == g])) == 1, g
        pu, pk, pw = np.nonzero(plan.prompt_group == g)
        assert set(pu) == set(u[group == g]) and set(pk // 1) == set(shard[group == g])  # 1 prompt row a shard
        # Its rows hold it alone, and point at its prompt's row.
        rows = plan.row[u[group == g], k[group == g]]  # [its slots, W]: the whole rows its tokens are in
        assert ((rows < 0) | (rows // G == g)).all(), g
        assert set(plan.prompt_row[u[group == g], k[group == g]]) == set(pk), g
        np.testing.assert_array_equal(np.sort(plan.prompt_position[pu, pk, pw]), np.arange(prompt_lengths[g]))
    assert plan.fill == pytest.approx(lengths.sum() / (plan.micro_batches * 8 * 2 * N))
