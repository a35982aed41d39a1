"""The optimiser: schedule values and AdamW + clipping updates checked against hand-derived numbers."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from jgrpo.config import OptimConfig
from jgrpo.training.optimizer import learning_rate_schedule, make_optimizer


def test_warmup_then_constant():
    sched = learning_rate_schedule(OptimConfig(learning_rate=1e-3, warmup_steps=3), total_steps=100)
    # lr * (count + 1) / (warmup + 1): 1/4, 2/4, 3/4 of the peak, then the peak.
    np.testing.assert_allclose([float(sched(c)) for c in range(6)], [2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3],
                               rtol=1e-6)


def test_no_warmup_is_constant_from_the_first_step():
    sched = learning_rate_schedule(OptimConfig(learning_rate=2e-6), total_steps=10)
    assert float(sched(0)) == pytest.approx(2e-6) and float(sched(9)) == pytest.approx(2e-6)


def test_cosine_after_warmup_reaches_zero_at_the_horizon():
    config = OptimConfig(learning_rate=1.0, schedule="cosine", warmup_steps=2, decay_steps=12)
    sched = learning_rate_schedule(config, total_steps=1000)  # decay_steps wins over the run length
    assert float(sched(1)) == pytest.approx(2 / 3)
    assert float(sched(2)) == pytest.approx(1.0)
    # Halfway through the 10 decay steps: 0.5 * (1 + cos(pi / 2)) = 0.5; a quarter: 0.5 * (1 + cos(pi/4)).
    assert float(sched(7)) == pytest.approx(0.5, abs=1e-6)
    assert float(sched(4.5)) == pytest.approx(0.5 * (1 + math.cos(math.pi / 4)), abs=1e-6)
    assert float(sched(12)) == pytest.approx(0.0, abs=1e-7) and float(sched(50)) == pytest.approx(0.0, abs=1e-7)
    # Without decay_steps the horizon is the whole run.
    whole = learning_rate_schedule(OptimConfig(learning_rate=1.0, schedule="cosine"), total_steps=8)
    assert float(whole(4)) == pytest.approx(0.5, abs=1e-6)


def test_bad_schedule_is_a_clear_error():
    with pytest.raises(ValueError, match="decay_steps=2 must exceed optim.warmup_steps=5"):
        learning_rate_schedule(OptimConfig(schedule="cosine", warmup_steps=5, decay_steps=2), 100)
    with pytest.raises(ValueError, match="total_steps=0"):
        make_optimizer(OptimConfig(), 0)


def test_adamw_with_clipping_matches_hand_computation():
    lr, b1, b2, eps, wd, clip = 0.1, 0.9, 0.99, 1e-8, 0.01, 1.0
    opt = make_optimizer(
        OptimConfig(learning_rate=lr, b1=b1, b2=b2, eps=eps, weight_decay=wd, max_grad_norm=clip), total_steps=10
    )
    p = jnp.array([1.0, -2.0])
    state = opt.init(p)
    g1 = jnp.array([3.0, 4.0])  # norm 5 -> clipped to [0.6, 0.8]
    g2 = jnp.array([0.3, -0.4])  # norm 0.5 -> unchanged
    u1, state = opt.update(g1, state, p)
    p1 = p + u1
    u2, state = opt.update(g2, state, p1)
    p2 = p1 + u2

    c1 = np.array([0.6, 0.8])
    m1, v1 = (1 - b1) * c1, (1 - b2) * c1**2
    want1 = np.array([1.0, -2.0]) - lr * (m1 / (1 - b1) / (np.sqrt(v1 / (1 - b2)) + eps) + wd * np.array([1.0, -2.0]))
    np.testing.assert_allclose(np.asarray(p1), want1, rtol=1e-6)
    g2n = np.array([0.3, -0.4])
    m2, v2 = b1 * m1 + (1 - b1) * g2n, b2 * v1 + (1 - b2) * g2n**2
    want2 = want1 - lr * (m2 / (1 - b1**2) / (np.sqrt(v2 / (1 - b2**2)) + eps) + wd * want1)
    np.testing.assert_allclose(np.asarray(p2), want2, rtol=1e-6)


def test_clipping_off_keeps_raw_gradients_in_the_moments():
    opt = make_optimizer(OptimConfig(learning_rate=0.1, max_grad_norm=None), total_steps=10)
    state = opt.init(jnp.zeros(2))
    _, state = opt.update(jnp.array([3.0, 4.0]), state, jnp.zeros(2))
    np.testing.assert_allclose(np.asarray(state[0].mu), [0.3, 0.4], rtol=1e-6)
