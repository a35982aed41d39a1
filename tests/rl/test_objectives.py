"""The loss kernel (docs/algorithm.md §3, §4) against hand-derived numbers and closed-form gradients.

Common setup unless a test says otherwise: 2 rows x 2 tokens, all valid, advantages A = [+1, -1],
alpha = 0.5 everywhere, and the current policy chosen so that the token ratios pi/alpha are
    row 0 (A = +1): [1.1, 1.5]        row 1 (A = -1): [0.5, 1.3]
with clip eps 0.2 (range [0.8, 1.2]) and token_mean aggregation (each token weighs 1/4).
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jgrpo.config import GRPOConfig
from jgrpo.rl.advantages import GroupAdvantages, group_advantages
from jgrpo.rl.diagnostics import finalize_metrics
from jgrpo.rl.loss_records import LossExtras, LossInputs
from jgrpo.rl.objectives import grpo_loss, step_normaliser

LOG_HALF = math.log(0.5)
RATIOS = np.array([[1.1, 1.5], [0.5, 1.3]])
LP_ALPHA = jnp.full((2, 2), LOG_HALF)
LP = jnp.asarray(LOG_HALF + np.log(RATIOS), jnp.float32)
MASK = jnp.ones((2, 2), bool)


def _adv(values, in_loss=None, tv_weight=None):
    n = len(values)
    return GroupAdvantages(
        advantages=jnp.asarray(values, jnp.float32),
        in_loss=jnp.ones(n, bool) if in_loss is None else jnp.asarray(in_loss),
        zero_variance=jnp.zeros(n, bool),
        tv_weight=jnp.ones(n, jnp.float32) if tv_weight is None else jnp.asarray(tv_weight, jnp.float32),
    )


def _cfg(**kw):
    kw.setdefault("beta", 0.0)
    return GRPOConfig(num_generations=2, **kw)


def _loss_and_grad(cfg, lp=LP, lp_alpha=LP_ALPHA, lp_k=None, lp_ref=None, adv=None, mask=MASK, **kw):
    adv = _adv([1.0, -1.0]) if adv is None else adv
    norm = step_normaliser(mask, adv.in_loss, cfg, max_new_tokens=kw.pop("max_new_tokens", None))

    def f(lp):
        return grpo_loss(LossInputs(lp, lp_alpha, lp_k, adv, mask), norm, cfg, LossExtras(lp_ref=lp_ref, **kw))

    (loss, metrics), grad = jax.value_and_grad(f, has_aux=True)(lp)
    return loss, grad, finalize_metrics(metrics)


def test_behaviour_mode_values_clip_fractions_and_closed_form_gradient():
    # row0 t0: r = 1.1 inside -> 1.1 * 1 = 1.1        row0 t1: r = 1.5 > 1.2, A > 0 -> clipped: 1.2
    # row1 t0: r = 0.5 < 0.8, A < 0 -> clipped: -0.8  row1 t1: r = 1.3, A < 0: min(-1.3, -1.2) = -1.3 (unclipped)
    # objective = (1.1 + 1.2 - 0.8 - 1.3) / 4 = 0.05 -> loss -0.05.
    # Gradient (i = 1 closed form): d loss / d lp = -(1/4) * A * (pi/alpha) inside / on the unclipped side, else 0.
    loss, grad, m = _loss_and_grad(_cfg(off_policy_ratio="behaviour"))
    np.testing.assert_allclose(loss, -0.05, rtol=1e-5)
    np.testing.assert_allclose(grad, [[-1.1 / 4, 0.0], [0.0, 1.3 / 4]], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose([m["clip_frac_low"], m["clip_frac_high"], m["clip_frac_dual"]], [0.25, 0.25, 0.0])
    np.testing.assert_allclose([m["ratio_mean"], m["ratio_min"], m["ratio_max"]], [1.1, 0.5, 1.5], rtol=1e-5)


def test_clip_higher_uses_separate_low_and_high_eps():
    # eps_low = 0.2, eps_high = 0.6: range [0.8, 1.6]. Now r = 1.5 (A > 0) is inside -> 1.5.
    # objective = (1.1 + 1.5 - 0.8 - 1.3) / 4 = 0.125.
    loss, grad, m = _loss_and_grad(_cfg(clip_eps_high=0.6))
    np.testing.assert_allclose(loss, -0.125, rtol=1e-5)
    np.testing.assert_allclose(grad, [[-1.1 / 4, -1.5 / 4], [0.0, 1.3 / 4]], rtol=1e-5, atol=1e-7)
    assert m["clip_frac_high"] == 0.0


def test_dual_clip_caps_negative_advantage_tokens():
    # c = 1.25: row1 t1 has A < 0 and r = 1.3 > c, so its objective is c * A = -1.25 (constant, no gradient).
    # objective = (1.1 + 1.2 - 0.8 - 1.25) / 4 = 0.0625.
    loss, grad, m = _loss_and_grad(_cfg(dual_clip=1.25))
    np.testing.assert_allclose(loss, -0.0625, rtol=1e-5)
    np.testing.assert_allclose(grad, [[-1.1 / 4, 0.0], [0.0, 0.0]], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(m["clip_frac_dual"], 0.25)


def test_recentred_clip_is_paper_eq6():
    # pi_k / alpha = [[1, 1.4], [0.6, 1]]: clip ranges [[0.8,1.2],[1.2,1.6]] / [[0.4,0.8],[0.8,1.2]].
    # row0 t1: r = 1.5 in [1.2, 1.6] -> 1.5; row1 t0: r = 0.5 in [0.4, 0.8] -> -0.5; others as in behaviour mode.
    # objective = (1.1 + 1.5 - 0.5 - 1.3) / 4 = 0.2; every token is inside, gradient -(1/4) * A * r everywhere.
    lp_k = LP_ALPHA + jnp.log(jnp.array([[1.0, 1.4], [0.6, 1.0]]))
    loss, grad, m = _loss_and_grad(_cfg(off_policy_ratio="recentred"), lp_k=lp_k)
    np.testing.assert_allclose(loss, -0.2, rtol=1e-5)
    np.testing.assert_allclose(grad, -np.array([[1.0], [-1.0]]) * RATIOS / 4, rtol=1e-5)
    assert m["clip_frac_low"] == 0.0 and m["clip_frac_high"] == 0.0


def test_current_mode_at_first_inner_step_is_plain_policy_gradient():
    # lp_k = None means i = 1: ratio = pi / sg(pi) = 1, objective = sum A / 4 = 0, gradient = -(1/4) * A.
    loss, grad, m = _loss_and_grad(_cfg(off_policy_ratio="current"))
    np.testing.assert_allclose(loss, 0.0, atol=1e-7)
    np.testing.assert_allclose(grad, [[-0.25, -0.25], [0.25, 0.25]], rtol=1e-6)
    np.testing.assert_allclose([m["ratio_min"], m["ratio_max"]], [1.0, 1.0])


def test_current_mode_later_inner_step_uses_pi_over_pi_k():
    # i > 1: ratio = pi / pi_k. With pi_k = alpha the numbers are those of the behaviour mode.
    loss, _, _ = _loss_and_grad(_cfg(off_policy_ratio="current"), lp_k=LP_ALPHA)
    np.testing.assert_allclose(loss, -0.05, rtol=1e-5)


def test_truncated_is_weight_token_and_sequence_level():
    # current mode at i = 1 (ratio 1, objective A * w). pi_k = pi, so pi_k / alpha = [[2, 0.5], [1, 3]]; C = 1.5.
    # token level:    w = [[1.5, 0.5], [1, 1.5]] -> (1.5 + 0.5 - 1 - 1.5) / 4 = -0.125 -> loss 0.125.
    # sequence level: products [1, 3] -> w = [1, 1.5] per row -> (1 + 1 - 1.5 - 1.5) / 4 = -0.25 -> loss 0.25.
    # The weight carries no gradient: d loss / d lp = -(1/4) * A * w.
    lp = LP_ALPHA + jnp.log(jnp.array([[2.0, 0.5], [1.0, 3.0]]))
    loss, grad, m = _loss_and_grad(_cfg(off_policy_ratio="current", truncated_is="token", truncated_is_cap=1.5), lp=lp)
    np.testing.assert_allclose(loss, 0.125, rtol=1e-5)
    np.testing.assert_allclose(grad, [[-1.5 / 4, -0.5 / 4], [1 / 4, 1.5 / 4]], rtol=1e-5)
    np.testing.assert_allclose(m["is_weight_mean"], (1.5 + 0.5 + 1 + 1.5) / 4, rtol=1e-6)
    loss, grad, _ = _loss_and_grad(_cfg(off_policy_ratio="current", truncated_is="sequence", truncated_is_cap=1.5),
                                   lp=lp)
    np.testing.assert_allclose(loss, 0.25, rtol=1e-5)
    np.testing.assert_allclose(grad, [[-0.25, -0.25], [1.5 / 4, 1.5 / 4]], rtol=1e-5)


def test_gspo_sequence_ratio():
    # Row ratio = exp(mean log r): row0 sqrt(1.1 * 1.5) = 1.28452 > 1.2 with A > 0 -> clipped, 1.2 per token;
    # row1 sqrt(0.5 * 1.3) = 0.80623 in range -> -0.80623 per token.
    # objective = (2 * 1.2 - 2 * 0.80623) / 4 -> loss -0.196886.
    # Gradient: row1 tokens each get -(1/4) * 2 * A * s * (1/2) = 0.80623 / 4 (d s / d lp_t = s / 2), row0 zero.
    s1 = math.sqrt(0.65)
    loss, grad, m = _loss_and_grad(_cfg(sequence_ratio=True))
    np.testing.assert_allclose(loss, -(2.4 - 2 * s1) / 4, rtol=1e-5)
    np.testing.assert_allclose(grad, [[0, 0], [s1 / 4, s1 / 4]], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(m["clip_frac_high"], 0.5)  # both tokens of row 0


@pytest.mark.parametrize(
    ("estimator", "value", "dvalue"),
    [
        # d = lp_ref - lp = log(0.25 / 0.5) = -ln 2.   k1 = -d, dk1/dlp = 1
        ("k1", math.log(2), 1.0),
        # k2 = d^2 / 2, dk2/dlp = -d = ln 2
        ("k2", 0.5 * math.log(2) ** 2, math.log(2)),
        # k3 = e^d - d - 1 = 0.5 + ln 2 - 1, dk3/dlp = 1 - e^d = 0.5
        ("k3", 0.5 + math.log(2) - 1, 0.5),
    ],
)
def test_kl_estimators(estimator, value, dvalue):
    # A = 0 so only beta * mean_t kl remains: loss = 0.1 * value, gradient 0.1 * dvalue / 4 per token.
    lp_ref = jnp.full((2, 2), math.log(0.25))
    cfg = _cfg(beta=0.1, kl_estimator=estimator)
    loss, grad, m = _loss_and_grad(cfg, lp=LP_ALPHA, lp_ref=lp_ref, adv=_adv([0.0, 0.0]))
    np.testing.assert_allclose(loss, 0.1 * value, rtol=1e-5)
    np.testing.assert_allclose(grad, np.full((2, 2), 0.1 * dvalue / 4), rtol=1e-5)
    np.testing.assert_allclose(m["kl_mean"], value, rtol=1e-5)


def test_beta_zero_needs_no_reference_and_beta_positive_demands_one():
    _, _, m = _loss_and_grad(_cfg(beta=0.0), lp_ref=None)
    assert "kl_mean" not in m and m["kl_loss"] == 0.0
    with pytest.raises(ValueError, match="needs lp_ref"):
        _loss_and_grad(_cfg(beta=0.1), lp_ref=None)


@pytest.mark.parametrize(
    ("aggregation", "objective"),
    [
        # current mode, i = 1: every token's objective is its row's A. A = [2, 1]; row0 has 3 tokens, row1 has 1.
        ("token_mean", (3 * 2 + 1 * 1) / 4),  # sum / tokens in the step
        ("seq_mean_token_mean", (2 + 1) / 2),  # mean over rows of the row's token mean
        ("seq_mean_token_sum_norm", (3 * 2 + 1) / (2 * 4)),  # sum / (rows * L), L = 4
    ],
)
def test_aggregations(aggregation, objective):
    mask = jnp.array([[True, True, True], [True, False, False]])
    lp = jnp.full((2, 3), LOG_HALF)
    cfg = _cfg(off_policy_ratio="current", aggregation=aggregation)
    loss, _, _ = _loss_and_grad(cfg, lp=lp, lp_alpha=lp, adv=_adv([2.0, 1.0]), mask=mask, max_new_tokens=4)
    np.testing.assert_allclose(loss, -objective, rtol=1e-6)


def test_sum_norm_needs_a_constant_length():
    with pytest.raises(ValueError, match="sum_norm_length"):
        step_normaliser(MASK, jnp.ones(2, bool), _cfg(aggregation="seq_mean_token_sum_norm"))


def test_gradient_wrt_logits_of_a_tiny_softmax_policy():
    # Policy logits theta [N, T, V]; lp = log_softmax(theta)[y]; d lp / d theta = onehot(y) - softmax(theta).
    # behaviour mode at i = 1: d loss / d theta = -w * A * r * (onehot - p) on unclipped tokens, 0 on clipped ones.
    # current mode at i = 1: d loss / d theta = -w * A * (onehot - p).
    key = jax.random.PRNGKey(0)
    theta = jax.random.normal(key, (4, 3, 5))
    targets = jnp.array([[0, 1, 2], [3, 4, 0], [1, 1, 1], [2, 0, 4]])
    lp_alpha = jnp.log(jnp.full((4, 3), 0.2)) + 0.3 * jax.random.normal(jax.random.PRNGKey(1), (4, 3))
    adv = _adv([1.0, -0.5, 2.0, -1.5])
    mask = jnp.ones((4, 3), bool)
    p = jax.nn.softmax(theta)
    onehot = jax.nn.one_hot(targets, 5)
    w = 1 / 12
    lp_of = lambda th: jnp.take_along_axis(jax.nn.log_softmax(th), targets[..., None], -1)[..., 0]
    for mode in ("behaviour", "current"):
        cfg = _cfg(off_policy_ratio=mode)
        norm = step_normaliser(mask, adv.in_loss, cfg)
        grad = jax.grad(lambda th, cfg=cfg, norm=norm: grpo_loss(LossInputs(lp_of(th), lp_alpha, None, adv, mask),
                                                                 norm, cfg)[0])(theta)
        a = adv.advantages[:, None]
        if mode == "behaviour":
            r = jnp.exp(lp_of(theta) - lp_alpha)
            clipped = ((r > 1.2) & (a > 0)) | ((r < 0.8) & (a < 0))
            assert 0 < int(clipped.sum()) < 12  # both regimes are exercised
            coef = jnp.where(clipped, 0.0, -w * a * r)
        else:
            coef = -w * a * jnp.ones((4, 3))
        np.testing.assert_allclose(grad, coef[..., None] * (onehot - p), rtol=1e-5, atol=1e-7)


def test_zero_variance_groups_leave_surrogate_kl_and_normaliser():
    # Group 1 (rows 2, 3) has equal rewards. Masked: the loss equals the loss of group 0 alone (same normaliser
    # counts, its KL gone even though it is huge). Unmasked: group 1 adds its KL and its tokens to the count.
    rewards = jnp.array([1.0, 0.0, 1.0, 1.0])
    lp = jnp.full((4, 2), LOG_HALF)
    lp_ref = jnp.array([[LOG_HALF] * 2, [LOG_HALF] * 2, [-5.0] * 2, [-5.0] * 2])  # only group 1 has KL
    mask = jnp.ones((4, 2), bool)
    cfg = GRPOConfig(num_generations=2, beta=0.1, off_policy_ratio="current", mask_zero_variance=True)
    adv = group_advantages(rewards, cfg)
    norm = step_normaliser(mask, adv.in_loss, cfg)
    assert float(norm.num_tokens) == 4 and float(norm.num_sequences) == 2
    loss, metrics = grpo_loss(LossInputs(lp, lp, None, adv, mask), norm, cfg, LossExtras(lp_ref=lp_ref))
    np.testing.assert_allclose(loss, 0.0, atol=1e-7)  # A sums to 0 over group 0, its KL is 0
    assert finalize_metrics(metrics)["zero_variance_frac"] == 0.5

    cfg_off = GRPOConfig(num_generations=2, beta=0.1, off_policy_ratio="current", mask_zero_variance=False)
    adv_off = group_advantages(rewards, cfg_off)
    norm_off = step_normaliser(mask, adv_off.in_loss, cfg_off)
    loss_off, _ = grpo_loss(LossInputs(lp, lp, None, adv_off, mask), norm_off, cfg_off, LossExtras(lp_ref=lp_ref))
    d = -5.0 - LOG_HALF  # k3 of the 4 tokens of group 1, over 8 tokens
    np.testing.assert_allclose(loss_off, 0.1 * 4 * (math.exp(d) - d - 1) / 8, rtol=1e-5)


def test_masked_positions_with_minus_inf_logprobs_give_finite_loss_and_zero_gradient():
    # Padding outside a truncated support has lp = -inf; it must not leak NaN into the loss or the gradient.
    lp = LP.at[1, 1].set(-jnp.inf)
    mask = jnp.array([[True, True], [True, False]])
    loss, grad, _ = _loss_and_grad(_cfg(beta=0.1), lp=lp, lp_ref=LP_ALPHA, mask=mask)
    assert np.isfinite(loss) and np.all(np.isfinite(grad)) and grad[1, 1] == 0.0


def test_theorem1_diagnostics_mismatch_entropy_and_staleness():
    # One prompt, rewards [1, 0]: s = sqrt(0.25 + 1e-4), weight (1 - s)/s = M, A = +-0.5 / s.
    # Sequence ratios pi/alpha: row0 1.1 * 1.5 = 1.65, row1 0.5 * 1.3 = 0.65 -> TV = 0.5 * mean(0.65, 0.35) = 0.25.
    # pi_k/alpha: row0 1.2 * 1 = 1.2, row1 0.9 * 1 = 0.9 -> TV_k = 0.5 * mean(0.2, 0.1) = 0.075.
    # L_alpha = mean(1.65 * A0 + 0.65 * A1) = 0.5 * (1.65 - 0.65) * 0.5 / s.
    # bound = L - 2 M TV - 2 TV_k.
    cfg = GRPOConfig(num_generations=2, beta=0.0, advantage_eps=1e-4)
    adv = group_advantages(jnp.array([1.0, 0.0]), cfg)
    s = math.sqrt(0.25 + 1e-4)
    weight, surrogate = (1 - s) / s, 0.5 * 1.0 * 0.5 / s
    lp_k = LP_ALPHA + jnp.log(jnp.array([[1.2, 1.0], [0.9, 1.0]]))
    trainer = LP_ALPHA + jnp.array([[0.01, -0.02], [0.03, 0.0]])
    entropy = jnp.array([[1.0, 2.0], [3.0, 4.0]])
    _, _, m = _loss_and_grad(cfg, lp_k=lp_k, adv=adv, lp_behaviour_trainer=trainer, entropy=entropy, staleness=3)
    np.testing.assert_allclose(m["tv_theta_alpha"], 0.25, rtol=1e-5)
    np.testing.assert_allclose(m["tv_k_alpha"], 0.075, rtol=1e-5)
    np.testing.assert_allclose(m["tv_weight_M"], weight, rtol=1e-5)
    np.testing.assert_allclose(m["tv_weight_mean"], weight, rtol=1e-5)
    np.testing.assert_allclose(m["surrogate_alpha"], surrogate, rtol=1e-5)
    np.testing.assert_allclose(m["lower_bound"], surrogate - 2 * weight * 0.25 - 2 * 0.075, rtol=1e-5)
    np.testing.assert_allclose(m["logprob_mismatch_mean"], 0.06 / 4, rtol=1e-4)
    np.testing.assert_allclose(m["logprob_mismatch_max"], 0.03, rtol=1e-4)
    np.testing.assert_allclose(m["entropy_mean"], 2.5, rtol=1e-6)
    assert m["staleness"] == 3
    np.testing.assert_allclose([m["advantage_mean"], m["advantage_std"]], [0.0, 0.5 / s], atol=1e-6)


def test_shape_errors_name_the_argument():
    cfg = _cfg()
    norm = step_normaliser(MASK, jnp.ones(2, bool), cfg)
    with pytest.raises(ValueError, match="lp_alpha has shape"):
        grpo_loss(LossInputs(LP, jnp.zeros((2, 3)), None, _adv([1.0, -1.0]), MASK), norm, cfg)
    with pytest.raises(ValueError, match="advantages field advantages"):
        grpo_loss(LossInputs(LP, LP_ALPHA, None, _adv([1.0, -1.0, 0.0]), MASK), norm, cfg)


# ---------------------------------------------------------------- review defects (issue 15)

@pytest.mark.parametrize("mode", ["behaviour", "recentred", "current"])
@pytest.mark.parametrize("sequence_ratio", [False, True])
def test_sampled_token_outside_current_truncated_support_has_ratio_zero_and_no_gradient(mode, sequence_ratio):
    # A token sampled from alpha's truncated support can fall outside pi_theta's truncated support (lp = -inf),
    # e.g. at a top-p edge. Its ratio is 0 (no probability under the truncated pi_theta) and it gets no
    # gradient; the loss and every other gradient stay finite, also when lp_k (= sg(lp) at the first update,
    # or a stored pi_k) is -inf there. A masked token may hold -inf as well.
    lp = LP.at[0, 1].set(-jnp.inf).at[1, 0].set(-jnp.inf)
    mask = jnp.array([[True, True], [True, True]])
    for lp_k in (None, lp, LP_ALPHA.at[1, 0].set(-jnp.inf)):
        loss, grad, m = _loss_and_grad(_cfg(off_policy_ratio=mode, sequence_ratio=sequence_ratio, beta=0.1),
                                       lp=lp, lp_k=lp_k, lp_ref=LP_ALPHA, lp_kl=LP, mask=mask)
        assert np.isfinite(loss), (mode, lp_k)
        assert np.all(np.isfinite(grad)), (mode, lp_k, grad)
        assert grad[0, 1] == 0.0 and grad[1, 0] == 0.0
        assert m["ratio_min"] == 0.0
        assert all(np.isfinite(v) for v in m.values()), m
    masked = jnp.array([[True, True], [False, True]])  # -inf at a masked position too
    loss, grad, _ = _loss_and_grad(_cfg(off_policy_ratio=mode, sequence_ratio=sequence_ratio, beta=0.1), lp=lp,
                                   lp_ref=LP_ALPHA, lp_kl=LP, mask=masked)
    assert np.isfinite(loss) and np.all(np.isfinite(grad))


def test_kl_uses_untruncated_logprobs_and_is_zero_at_the_reference():
    # lp (truncated, -inf at [0, 1]) only enters the ratio; the KL term reads lp_kl and lp_ref, both untruncated.
    # With lp_kl == lp_ref the KL is exactly 0 and has zero gradient, whatever lp does.
    lp = LP.at[0, 1].set(-jnp.inf)
    cfg = _cfg(beta=0.1, off_policy_ratio="current")
    loss, grad, m = _loss_and_grad(cfg, lp=lp, lp_ref=LP, lp_kl=LP, adv=_adv([0.0, 0.0]))
    assert m["kl_mean"] == 0.0 and loss == 0.0 and np.all(grad == 0.0)
    # k3 of d = lp_ref - lp_kl = -ln 2 on every token (hand value as in test_kl_estimators).
    lp_kl = jnp.full((2, 2), math.log(0.5))
    _, _, m = _loss_and_grad(cfg, lp=lp, lp_ref=jnp.full((2, 2), math.log(0.25)), lp_kl=lp_kl, adv=_adv([0.0, 0.0]))
    np.testing.assert_allclose(m["kl_mean"], 0.5 + math.log(2) - 1, rtol=1e-5)


@pytest.mark.parametrize("mode", ["behaviour", "recentred"])
def test_truncated_is_with_a_behaviour_ratio_is_rejected(mode):
    # (pi/alpha) * min(pi_k/alpha, C) would weigh the behaviour ratio twice.
    from jgrpo.config import ConfigError

    with pytest.raises(ConfigError, match="off_policy_ratio=current"):
        _cfg(off_policy_ratio=mode, truncated_is="token")


def test_truncated_is_decoupled_form_at_a_later_update():
    # The allowed combination: ratio pi/pi_k clipped in [0.8, 1.2], weighted by min(pi_k/alpha, C), C = 1.5.
    # pi/pi_k = RATIOS (lp_k = alpha + 0 ... ) and pi_k/alpha = [[2, 0.5], [1, 3]]:
    #   row0 (A=+1): t0 r 1.1 inside -> 1.1 * w 1.5 = 1.65 ; t1 r 1.5 > 1.2 clipped -> 1.2 * w 0.5 = 0.6
    #   row1 (A=-1): t0 r 0.5 < 0.8 clipped -> -0.8 * w 1 = -0.8 ; t1 r 1.3 unclipped -> -1.3 * w 1.5 = -1.95
    # objective = (1.65 + 0.6 - 0.8 - 1.95) / 4 = -0.125 -> loss 0.125; gradient -(1/4) A w r on unclipped tokens.
    weights = jnp.array([[2.0, 0.5], [1.0, 3.0]])
    lp_k = LP_ALPHA + jnp.log(weights)
    lp = lp_k + jnp.log(jnp.asarray(RATIOS, jnp.float32))
    loss, grad, m = _loss_and_grad(_cfg(off_policy_ratio="current", truncated_is="token", truncated_is_cap=1.5),
                                   lp=lp, lp_k=lp_k)
    np.testing.assert_allclose(loss, 0.125, rtol=1e-5)
    np.testing.assert_allclose(grad, [[-1.1 * 1.5 / 4, 0.0], [0.0, 1.3 * 1.5 / 4]], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(m["is_weight_mean"], (1.5 + 0.5 + 1 + 1.5) / 4, rtol=1e-6)


def test_off_policy_sequence_masking_drops_stale_negative_rows_from_the_surrogate():
    # DeepSeek-V3.2 eq. 9 (arXiv 2512.02556). Mean log(alpha / pi) per row: row 0 (A = +1) -(log 1.1 + log 1.5) / 2
    # = -0.250; row 1 (A = -1) -(log 0.5 + log 1.3) / 2 = (0.6931 - 0.2624) / 2 = 0.2154.
    # delta = 0.2: row 1 (negative, 0.2154 > 0.2) leaves the surrogate, the normaliser keeps its 2 tokens:
    # objective = (1.1 + 1.2 [clipped]) / 4 = 0.575 -> loss -0.575; gradient only on row 0's unclipped token.
    loss, grad, m = _loss_and_grad(_cfg(off_policy_ratio="behaviour", sequence_mask_delta=0.2))
    np.testing.assert_allclose(loss, -0.575, rtol=1e-5)
    np.testing.assert_allclose(grad, [[-1.1 / 4, 0.0], [0.0, 0.0]], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(m["sequence_mask_frac"], 0.5)
    # delta = 0.25 is above row 1's gap: nothing is dropped and the loss is the unmasked one (-0.05, see above).
    loss, _, m = _loss_and_grad(_cfg(off_policy_ratio="behaviour", sequence_mask_delta=0.25))
    np.testing.assert_allclose(loss, -0.05, rtol=1e-5)
    assert m["sequence_mask_frac"] == 0.0
    # Only negative advantages are masked: with the signs swapped row 0 (gap -0.25) stays and row 1 (A > 0) too.
    loss, _, m = _loss_and_grad(_cfg(off_policy_ratio="behaviour", sequence_mask_delta=0.0), adv=_adv([-1.0, 1.0]))
    assert m["sequence_mask_frac"] == 0.0
    with pytest.raises(ValueError, match="grpo.sequence_mask_delta"):
        _cfg(sequence_mask_delta=-0.1)


def test_cispo_clips_the_weight_not_the_gradient():
    # CISPO (arXiv 2506.13585 eq. 4), ratio pi/alpha = RATIOS, eps_high 0.28, no lower bound:
    # w = min(r, 1.28) = [[1.1, 1.28], [0.5, 1.28]]; objective (1.1 + 1.28 - 0.5 - 1.28) / 4 = 0.15 -> loss -0.15.
    # Gradient w * A * d lp for EVERY token (the clipped ones too): d loss / d lp = -(1/4) * A * w.
    loss, grad, m = _loss_and_grad(_cfg(policy_loss="cispo", cispo_eps_high=0.28))
    np.testing.assert_allclose(loss, -0.15, rtol=1e-5)
    np.testing.assert_allclose(grad, [[-1.1 / 4, -1.28 / 4], [0.5 / 4, 1.28 / 4]], rtol=1e-5)
    np.testing.assert_allclose([m["clip_frac_low"], m["clip_frac_high"]], [0.0, 0.5])
    # With the optional lower bound 1 - 0.2: row 1's 0.5 becomes 0.8: (1.1 + 1.28 - 0.8 - 1.28) / 4 = 0.075.
    loss, grad, m = _loss_and_grad(_cfg(policy_loss="cispo", cispo_eps_high=0.28, cispo_eps_low=0.2))
    np.testing.assert_allclose(loss, -0.075, rtol=1e-5)
    np.testing.assert_allclose(grad, [[-1.1 / 4, -1.28 / 4], [0.8 / 4, 1.28 / 4]], rtol=1e-5)
    np.testing.assert_allclose(m["clip_frac_low"], 0.25)
    # A token outside pi_theta's truncated support: ratio 0, finite loss, no gradient.
    lp = LP.at[1, 0].set(-jnp.inf)
    loss, grad, _ = _loss_and_grad(_cfg(policy_loss="cispo", cispo_eps_high=0.28), lp=lp)
    np.testing.assert_allclose(loss, -(1.1 + 1.28 - 0.0 - 1.28) / 4, rtol=1e-5)
    assert grad[1, 0] == 0.0 and np.isfinite(np.asarray(grad)).all()
    from jgrpo.config import ConfigError

    with pytest.raises(ConfigError, match="grpo.dual_clip"):
        _cfg(policy_loss="cispo", dual_clip=3.0)
    with pytest.raises(ConfigError, match="grpo.sequence_ratio"):
        _cfg(policy_loss="cispo", sequence_ratio=True)


def test_masked_importance_sampling_drops_tokens_or_sequences_outside_the_range():
    # Behaviour ratio pi/alpha = RATIOS; pi_k/alpha = [[2, 0.5], [1, 3]]. Clipped per-token objective:
    #   row 0 (A=+1): 1.1, 1.2 (clipped)      row 1 (A=-1): -0.8 (clipped), -1.3
    # token, range [0.6, 2.5]: drops (0, 1) (0.5) and (1, 1) (3): (1.1 - 0.8) / 4 = 0.075 -> loss -0.075;
    # the only gradient left is (0, 0)'s -(1/4) * 1.1.
    pi_k_over_alpha = jnp.array([[2.0, 0.5], [1.0, 3.0]])
    lp_k = LP_ALPHA + jnp.log(pi_k_over_alpha)
    cfg = _cfg(off_policy_ratio="behaviour", masked_is="token", masked_is_low=0.6, masked_is_high=2.5)
    loss, grad, m = _loss_and_grad(cfg, lp_k=lp_k)
    np.testing.assert_allclose(loss, -0.075, rtol=1e-5)
    np.testing.assert_allclose(grad, [[-1.1 / 4, 0.0], [0.0, 0.0]], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(m["mis_drop_frac"], 0.5)
    # sequence (geometric mean): row 0 sqrt(2 * 0.5) = 1 stays, row 1 sqrt(3) = 1.73 > 1.5 goes:
    # (1.1 + 1.2) / 4 = 0.575 -> loss -0.575.
    cfg = _cfg(off_policy_ratio="behaviour", masked_is="sequence", masked_is_low=0.6, masked_is_high=1.5)
    loss, grad, m = _loss_and_grad(cfg, lp_k=lp_k)
    np.testing.assert_allclose(loss, -0.575, rtol=1e-5)
    np.testing.assert_allclose(grad, [[-1.1 / 4, 0.0], [0.0, 0.0]], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(m["mis_drop_frac"], 0.5)
    # Nothing outside a wide range: the plain objective (-0.05).
    loss, _, m = _loss_and_grad(_cfg(masked_is="token", masked_is_low=0.1, masked_is_high=10.0), lp_k=lp_k)
    np.testing.assert_allclose(loss, -0.05, rtol=1e-5)
    assert m["mis_drop_frac"] == 0.0
    from jgrpo.config import ConfigError

    with pytest.raises(ConfigError, match="grpo.masked_is_low"):
        _cfg(masked_is="token", masked_is_low=2.0, masked_is_high=1.5)


def test_masked_is_needs_the_trainers_own_pi_k_even_on_policy():
    from jgrpo.rl.lp_k import lp_k_source

    # v = 1 with two updates: without masked IS lp_k may be the sampler's lp_alpha; with it, never (its ratio
    # pi_k / alpha would be exactly 1 and nothing would ever be dropped).
    assert lp_k_source(_cfg(inner_steps=2)) == "behaviour"
    assert lp_k_source(_cfg(inner_steps=2, masked_is="token")) == "computed"
    assert lp_k_source(_cfg(m2po_tau=0.04)) == "computed"  # even with one update: the mask precedes it


def test_m2po_drops_the_largest_second_moments_until_the_mean_is_below_tau():
    from jgrpo.rl.corrections import m2po_drop

    # log(pi_k / alpha) of the loss tokens: [0.5, -0.3, 0.1, 0.0, 0.2] -> m = [0.25, 0.09, 0.01, 0, 0.04],
    # mean 0.078. tau 0.04: dropping 0.25 leaves 0.14 / 4 = 0.035 <= 0.04 -> one token dropped.
    # tau 0.03: 0.035 > 0.03, dropping 0.09 too leaves 0.05 / 3 = 0.0167 -> two dropped.
    # A token outside the loss (log ratio 3) is never dropped and never counted.
    log_r = jnp.array([[0.5, -0.3, 0.1], [0.0, 0.2, 3.0]])
    lp_alpha = jnp.full((2, 3), -1.0)
    in_loss = jnp.array([[True, True, True], [True, True, False]])
    drop = m2po_drop(lp_alpha + log_r, lp_alpha, in_loss, 0.04)
    np.testing.assert_array_equal(drop, [[True, False, False], [False, False, False]])
    drop = m2po_drop(lp_alpha + log_r, lp_alpha, in_loss, 0.03)
    np.testing.assert_array_equal(drop, [[True, True, False], [False, False, False]])
    drop = m2po_drop(lp_alpha + log_r, lp_alpha, in_loss, 1.0)  # already below: nothing
    assert not np.asarray(drop).any()
    # A token outside pi_k's truncated support (log ratio -inf) goes first, and its huge m does not swamp the
    # small ones in the sums: with it, the same two drops as at tau 0.04 plus that token.
    lp_k = (lp_alpha + log_r).at[1, 0].set(-jnp.inf)
    drop = m2po_drop(lp_k, lp_alpha, in_loss, 0.04)
    # kept after dropping -inf and 0.25: [0.09, 0.01, 0.04] -> 0.0467 > 0.04; dropping 0.09 too: 0.025.
    np.testing.assert_array_equal(drop, [[True, True, False], [True, False, False]])


def test_m2po_mask_leaves_the_surrogate_only():
    # The clipped form (mask and clip), dropping token (0, 1) (the clipped 1.2): objective (1.1 - 0.8 - 1.3) / 4
    # = -0.25 -> loss 0.25; the clipped 0.5 (A < 0) keeps no gradient.
    drop = jnp.array([[False, True], [False, False]])
    loss, grad, m = _loss_and_grad(_cfg(m2po_tau=0.04, m2po_form="clipped"), m2po_drop=drop)
    np.testing.assert_allclose(loss, 0.25, rtol=1e-5)
    np.testing.assert_allclose(grad, [[-1.1 / 4, 0.0], [0.0, 1.3 / 4]], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(m["m2po_drop_frac"], 0.25)
    # The paper's form (the default): the mask replaces the clip, every kept token is r x A with its gradient:
    # (1.1 - 0.5 - 1.3) / 4 = -0.175 -> loss 0.175.
    loss, grad, m = _loss_and_grad(_cfg(m2po_tau=0.04), m2po_drop=drop)
    np.testing.assert_allclose(loss, 0.175, rtol=1e-5)
    np.testing.assert_allclose(grad, [[-1.1 / 4, 0.0], [0.5 / 4, 1.3 / 4]], rtol=1e-5, atol=1e-7)
    assert m["clip_frac_low"] == 0 and m["clip_frac_high"] == 0
