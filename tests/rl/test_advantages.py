"""Group advantages (docs/algorithm.md §2) against hand-derived numbers."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from jgrpo.config import GRPOConfig
from jgrpo.rl.advantages import group_advantages


def _cfg(**kw):
    return GRPOConfig(num_generations=4, **kw)


def test_paper_default_population_std_eps_inside_sqrt():
    # Group 0: r = [1, 0, 0, 1]: mean 0.5, population var 0.25, A = +-0.5 / sqrt(0.25 + 1e-4).
    # Group 1: all rewards 1 -> zero variance -> A = 0 and (masking on) out of the loss.
    adv = group_advantages(jnp.array([1.0, 0, 0, 1, 1, 1, 1, 1]), _cfg(advantage_eps=1e-4))
    a = 0.5 / math.sqrt(0.25 + 1e-4)
    np.testing.assert_allclose(adv.advantages, [a, -a, -a, a, 0, 0, 0, 0], rtol=1e-6)
    np.testing.assert_array_equal(adv.in_loss, [True] * 4 + [False] * 4)
    np.testing.assert_array_equal(adv.zero_variance, [False] * 4 + [True] * 4)
    # Theorem 1 weight (1 - s) / s with s = sqrt(var + eps): group 0 s = 0.50009999, group 1 s = sqrt(1e-4) = 0.01.
    s0 = math.sqrt(0.25 + 1e-4)
    np.testing.assert_allclose(adv.tv_weight, [(1 - s0) / s0] * 4 + [99.0] * 4, rtol=1e-5)


def test_bessel_std_with_eps_added_to_std():
    # r = [1, 0, 0, 0]: mean 0.25, Bessel var = (0.75^2 + 3 * 0.25^2) / 3 = 0.25, std 0.5, A = (r - 0.25) / (0.5 + 0.1).
    adv = group_advantages(jnp.array([1.0, 0, 0, 0]),
                           _cfg(advantage_std="bessel", advantage_eps_placement="add_to_std", advantage_eps=0.1))
    np.testing.assert_allclose(adv.advantages, np.array([0.75, -0.25, -0.25, -0.25]) / 0.6, rtol=1e-6)
    # Theorem 1's s is the paper's var_alpha, the population variance, whatever scales the advantages:
    # population var = 0.1875, s = sqrt(0.1875 + 0.1) (not the Bessel 0.25).
    s = math.sqrt(0.1875 + 0.1)
    np.testing.assert_allclose(adv.tv_weight, [(1 - s) / s] * 4, rtol=1e-6)


def test_batch_scale_centres_per_group_and_divides_by_batch_std():
    # Groups [1,0,0,0] (mean .25) and [1,1,0,1] (mean .75). All 8 rewards: mean .5, population var .25.
    r = jnp.array([1.0, 0, 0, 0, 1, 1, 0, 1])
    adv = group_advantages(r, _cfg(advantage_scale="batch", advantage_eps=0.0))
    expected = (np.array([1, 0, 0, 0, 1, 1, 0, 1]) - np.array([0.25] * 4 + [0.75] * 4)) / 0.5
    np.testing.assert_allclose(adv.advantages, expected, rtol=1e-6)


def test_no_scaling_is_dr_grpo():
    # Dr.GRPO: A = r - mean(r) only. Group [2, 0, 1, 1]: mean 1 -> [1, -1, 0, 0].
    adv = group_advantages(jnp.array([2.0, 0, 1, 1]), _cfg(advantage_scale="none"))
    np.testing.assert_allclose(adv.advantages, [1, -1, 0, 0], atol=0)


def test_zero_variance_is_detected_exactly_and_masking_can_be_off():
    # Three 0.1s have a float mean that may differ from 0.1 in the last bit; A must still be exactly 0.
    r = jnp.array([0.1, 0.1, 0.1, 0.1, 0.3, 0.7, 0.7, 0.7])
    adv = group_advantages(r, _cfg(mask_zero_variance=False, advantage_eps=0.0))
    np.testing.assert_array_equal(adv.advantages[:4], 0.0)
    np.testing.assert_array_equal(adv.zero_variance, [True] * 4 + [False] * 4)
    np.testing.assert_array_equal(adv.in_loss, [True] * 8)  # masking off: everything stays in the loss
    assert np.all(np.isfinite(adv.advantages))  # 0 / 0 of the eps = 0 zero-variance group replaced by 0


def test_bad_shapes_fail_with_a_clear_message():
    with pytest.raises(ValueError, match="not a positive multiple of grpo.num_generations=4"):
        group_advantages(jnp.zeros(6), _cfg())
    with pytest.raises(ValueError, match=r"flat \[B\*G\]"):
        group_advantages(jnp.zeros((2, 4)), _cfg())


def test_per_reward_normalisation_is_gdpo():
    # GDPO (arXiv 2601.05242), eps 0 so the numbers are exact. Two functions c, f; G = 4.
    #   group 0: c = [1, 1, 0, 0] -> [1, 1, -1, -1]; f = [1, 0, 1, 0] -> [1, -1, 1, -1]; sum [2, 0, 0, -2]
    #   group 1: c constant -> 0;  f = [1, 0, 0, 0]: mean 0.25, std sqrt(0.1875) -> [sqrt 3, -1/sqrt 3 (x3)]
    #   group 2: both constant -> zero variance: A = 0, out of the loss, out of the batch statistics.
    # Batch-wise over the 8 live rows: mean 0, var (4 + 4 + 3 + 3 * 1/3) / 8 = 1.5 -> A = sum / sqrt(1.5).
    c = [1.0, 1, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0]
    f = [1.0, 0, 1, 0, 1, 0, 0, 0, 1, 1, 1, 1]
    components = jnp.stack([jnp.array(c), jnp.array(f)], axis=1)
    cfg = _cfg(advantage_reward_normalisation="per_reward", advantage_eps=0.0)
    adv = group_advantages(components.sum(axis=1), cfg, components=components, weights=(1.0, 1.0))
    r3 = math.sqrt(3)
    expected = np.array([2, 0, 0, -2, r3, -1 / r3, -1 / r3, -1 / r3, 0, 0, 0, 0]) / math.sqrt(1.5)
    np.testing.assert_allclose(adv.advantages, expected, rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(adv.in_loss, [True] * 8 + [False] * 4)
    # Weights (1, 0.5): group 0 [1.5, 0.5, -0.5, -1.5], group 1 half of above; var (5 + 0.75 + 0.25) / 8 = 0.75.
    adv = group_advantages(components @ jnp.array([1.0, 0.5]), cfg, components=components, weights=(1.0, 0.5))
    expected = np.array([1.5, 0.5, -0.5, -1.5, r3 / 2, -0.5 / r3, -0.5 / r3, -0.5 / r3, 0, 0, 0, 0]) / math.sqrt(0.75)
    np.testing.assert_allclose(adv.advantages, expected, rtol=1e-6, atol=1e-7)
    # The plain GRPO sum of group 0, [2, 1, 1, 0], normalises to [1, 0, 0, -1] / sqrt(0.5): different numbers.
    plain = group_advantages(components.sum(axis=1), _cfg(advantage_eps=0.0))
    np.testing.assert_allclose(plain.advantages[:4], np.array([1, 0, 0, -1]) / math.sqrt(0.5), rtol=1e-6)
    with pytest.raises(ValueError, match="per_reward"):
        group_advantages(components.sum(axis=1), cfg)


def test_soft_overlong_punishment_in_tokens():
    from jgrpo.rewards.overlong import overlong_punishment

    # L = 16, buffer 4: free up to 12 tokens, then -1/4 per token, -penalty at 16.
    np.testing.assert_allclose(overlong_punishment([10, 12, 14, 16], max_new_tokens=16, buffer=4, penalty=1.0),
                               [0, 0, -0.5, -1.0])
    np.testing.assert_allclose(overlong_punishment([13], max_new_tokens=16, buffer=4, penalty=0.5), [-0.125])
    with pytest.raises(ValueError, match="overlong_buffer"):
        overlong_punishment([1], max_new_tokens=16, buffer=20, penalty=1.0)


def test_invalid_rows_leave_their_groups_statistics():
    # Group 0: r = [1, 0, 7, 1] with row 2 invalid (its environment failed): the group is [1, 0, 1], mean 2/3,
    # population var ((1/3)^2 * 2 + (2/3)^2) / 3 = 2/9, A = (r - 2/3) / sqrt(2/9 + 1e-4); row 2 gets 0, out of
    # the loss. Group 1: r = [3, 5, 5, 5] with rows 1-3 invalid: one valid row, no signal (zero-variance).
    valid = jnp.array([True, True, False, True, True, False, False, False])
    adv = group_advantages(jnp.array([1.0, 0, 7, 1, 3, 5, 5, 5]), _cfg(advantage_eps=1e-4), valid=valid)
    d = math.sqrt(2 / 9 + 1e-4)
    np.testing.assert_allclose(adv.advantages, [(1 / 3) / d, (-2 / 3) / d, 0, (1 / 3) / d, 0, 0, 0, 0], rtol=1e-6)
    np.testing.assert_array_equal(adv.in_loss, [True, True, False, True, False, False, False, False])
    np.testing.assert_array_equal(adv.zero_variance, [False] * 4 + [True] * 4)
    np.testing.assert_allclose(adv.tv_weight[:4], (1 - d) / d, rtol=1e-5)
    # Every row valid: the same numbers as without `valid`.
    rewards = jnp.array([1.0, 0, 0, 1, 2, 3, 5, 7])
    for kw in ({}, {"advantage_std": "bessel"}, {"advantage_scale": "batch"}, {"advantage_scale": "none"}):
        ref = group_advantages(rewards, _cfg(**kw))
        got = group_advantages(rewards, _cfg(**kw), valid=jnp.ones(8, bool))
        for a, b in zip(ref, got, strict=True):
            np.testing.assert_allclose(np.asarray(b, np.float32), np.asarray(a, np.float32), rtol=1e-6, atol=1e-7)
