"""Group advantages (docs/algorithm.md §2) against hand-derived numbers."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from jgrpo.advantages import group_advantages
from jgrpo.config import GRPOConfig


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
