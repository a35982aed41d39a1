"""Off-policy corrections beyond the clip (docs/algorithm.md §13): weights and masks from pi_k, alpha and pi_theta.

Each is a pure function of per-token log-probs [N, T] and the completion mask `valid`, without gradient, and
returns None when its switch is off, so `objectives.grpo_loss` applies only what is configured:

    truncated IS      weight min(pi_k / alpha, C), per token or per completion (product)         verl TIS
    masked IS         drop tokens / completions with pi_k / alpha outside [low, high]            verl MIS, IcePop
    sequence masking  drop completions with A < 0 and mean log(alpha / pi_theta) > delta        DeepSeek-V3.2
    M2PO              drop the batch's largest (log pi_k / alpha)^2 until their mean <= tau     arXiv 2510.01161

Dropped tokens leave the surrogate only: the step's normaliser (fixed before the micro-batches, see
`objectives`) and the KL term keep them, as in DeepSeek-V3.2's eq. 9, so every mask is micro-batch invariant.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jgrpo.config import GRPOConfig

# exp() of a log-ratio beyond this is clamped (as verl does): float32 exp overflows at ~88 and one runaway
# token must not turn the step into inf/NaN. e^20 ~ 5e8 is far outside any clip range, so within it nothing
# changes.
LOG_RATIO_LIMIT = 20.0


def log_ratio(lp_num: jax.Array, lp_den: jax.Array) -> jax.Array:
    """log(num / den) of truncated policies, at most LOG_RATIO_LIMIT, never NaN.

    A sampled token can lie outside a truncated (top-k/top-p/min-p) support of the numerator's policy
    (lp_num = -inf): its ratio is 0 and, through the `where`, its gradient exactly 0 (even when lp_den is
    -inf too, e.g. lp_k = sg(lp) at the first update, where num - den would be NaN). Outside the
    denominator's support only (lp_den = -inf < lp_num), the ratio is the clamp, like any runaway ratio.
    """
    return jnp.where(jnp.isneginf(lp_num), -jnp.inf, jnp.minimum(lp_num - lp_den, LOG_RATIO_LIMIT))


def masked_row_sum(x: jax.Array, valid: jax.Array) -> jax.Array:
    """[N, T] -> [N]: the sum over each row's valid tokens."""
    return jnp.sum(jnp.where(valid, x, 0.0), axis=1)


def masked_row_mean(x: jax.Array, valid: jax.Array) -> jax.Array:
    """[N, T] -> [N]: the mean over each row's valid tokens (0 for a row without any)."""
    return masked_row_sum(x, valid) / jnp.maximum(valid.sum(axis=1), 1)


def truncated_is_weight(lp_k, lp_alpha, valid, config: GRPOConfig) -> jax.Array | None:
    """min(pi_k / alpha, C) per token or per sequence (product over its tokens), no gradient; None if off."""
    if config.truncated_is == "none":
        return None
    log_w = log_ratio(lp_k, lp_alpha)  # [N, T]
    if config.truncated_is == "sequence":
        log_w = jnp.broadcast_to(masked_row_sum(log_w, valid)[:, None], lp_k.shape)
    return jax.lax.stop_gradient(jnp.exp(jnp.minimum(log_w, math.log(config.truncated_is_cap))))


def masked_is_drop(lp_k, lp_alpha, valid, config: GRPOConfig) -> jax.Array | None:
    """[N, T] bool, True for the tokens masked importance sampling drops; None if off.

    `token`: the token's pi_k / alpha is outside [masked_is_low, masked_is_high]. `sequence`: the completion's
    geometric-mean ratio exp(mean_t log(pi_k / alpha)) is (Geo-RS: length-neutral, unlike the product, which
    would reject every long completion). A token outside pi_k's truncated support has ratio 0: dropped.
    """
    if config.masked_is == "none":
        return None
    log_w = jax.lax.stop_gradient(log_ratio(lp_k, lp_alpha))
    if config.masked_is == "sequence":
        log_w = jnp.broadcast_to(masked_row_mean(log_w, valid)[:, None], lp_k.shape)
    low = math.log(config.masked_is_low) if config.masked_is_low > 0 else -jnp.inf
    return valid & ((log_w < low) | (log_w > math.log(config.masked_is_high)))


def off_policy_sequence_mask(lp, lp_alpha, valid, advantages, delta: float | None) -> jax.Array | None:
    """[N] bool, True for the completions DeepSeek-V3.2's off-policy sequence masking drops (arXiv 2512.02556
    eq. 9): a negative advantage and a mean log(alpha / pi_theta) over the completion's tokens above `delta`
    (the sampler's policy made it much likelier than the current one does: learning from its failure is
    the riskiest update). No gradient; None when off. `advantages` is [N, 1]."""
    if delta is None:
        return None
    log_gap = jnp.where(valid, lp_alpha - jax.lax.stop_gradient(lp), 0.0)  # +inf outside pi_theta's support
    return (advantages[:, 0] < 0) & (masked_row_mean(log_gap, valid) > delta)


def m2po_drop(lp_k: jax.Array, lp_alpha: jax.Array, in_loss_tokens: jax.Array, tau: float) -> jax.Array:
    """[..., T] bool, True for the tokens M2PO masks: over ALL the given tokens (pass the whole batch, once,
    before the updates: the mask must not depend on micro-batching or sharding), drop the ones with the largest
    m = (log pi_k / alpha)^2, fewest first, until the mean m of the tokens kept is <= tau.

    Sorting the m descending, dropping the top j leaves mean suffix_j / (n - j) (suffix sums, so a huge m at
    the top cannot swamp the small ones in float32); j* is the smallest j with that <= tau, and a token is
    dropped iff its rank is below j*. Ties are broken by position.
    """
    shape = lp_k.shape
    m = jnp.square(log_ratio(jax.lax.stop_gradient(lp_k), lp_alpha)).reshape(-1)
    m = jnp.where(jnp.isfinite(m), m, jnp.float32(1e30))  # outside pi_k's support: the first to go
    counted = in_loss_tokens.reshape(-1)
    m = jnp.where(counted, m, -1.0)  # tokens outside the loss sort last and are never dropped
    order = jnp.argsort(-m, stable=True)
    values = jnp.where(counted[order], m[order], 0.0)
    n = counted.sum()
    suffix = jnp.concatenate([jnp.cumsum(values[::-1])[::-1], jnp.zeros(1, values.dtype)])  # sum of values[j:]
    j = jnp.arange(suffix.shape[0])
    kept_mean = suffix / jnp.maximum(n - j, 1)
    satisfied = (kept_mean <= tau) | (j >= n)
    drop_count = jnp.argmax(satisfied)  # the first j that satisfies (j = n always does)
    rank = jnp.empty_like(order).at[order].set(jnp.arange(order.shape[0]))
    return ((rank < drop_count) & counted).reshape(shape)
