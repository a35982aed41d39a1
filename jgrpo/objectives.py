"""The GRPO loss kernel (docs/algorithm.md §3, §4): clipped surrogate in every off-policy mode, KL, aggregation.

Pure functions of arrays; no model inside. Shapes: N completion rows (B prompts x G samples), T
completion tokens. Per-token log-probs are `lp` (current params, the only input with a gradient),
`lp_alpha` (behaviour policy, recorded by the sampler), `lp_k` (params at the start of the outer
iteration) and `lp_ref` (reference policy).

Micro-batching and sharding invariance: every token's weight in the loss is fixed by counts over the
*whole optimiser step* (`step_normaliser`, computed before the micro-batch loop), so the loss is a
plain sum over rows. Hence sum over micro-batches of `grpo_loss(micro)` == `grpo_loss(step)`, for the
value and the gradient, and sharding the rows over devices changes nothing either.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jgrpo.advantages import GroupAdvantages
from jgrpo.config import GRPOConfig
from jgrpo.diagnostics import loss_metrics

# exp() of a log-ratio beyond this is clamped (as verl does): float32 exp overflows at ~88 and one runaway
# token must not turn the step into inf/NaN. e^20 ~ 5e8 is far outside any clip range, so within it nothing
# changes.
LOG_RATIO_LIMIT = 20.0


class StepNorm(NamedTuple):
    """Counts over the whole optimiser step that fix every token's weight (float32 scalars)."""

    num_tokens: jax.Array  # loss tokens (completion tokens of rows in the loss)
    num_sequences: jax.Array  # rows in the loss with at least one completion token
    sum_norm_length: jax.Array  # Dr.GRPO's constant L


def loss_token_mask(completion_mask: jax.Array, in_loss: jax.Array) -> jax.Array:
    """[N, T] bool: generated tokens of the rows that enter the loss (prompt and padding never do)."""
    return completion_mask.astype(bool) & in_loss.astype(bool)[:, None]


def step_normaliser(
    completion_mask: jax.Array, in_loss: jax.Array, config: GRPOConfig, *, max_new_tokens: int | None = None
) -> StepNorm:
    """The step's normalisers, from the masks of the WHOLE optimiser step (all micro-batches, all devices).

    `completion_mask` [N, T], `in_loss` [N] (from `group_advantages`). Dr.GRPO's L is
    `config.sum_norm_length`, or else `max_new_tokens` (the sampler's); only that aggregation needs it.
    """
    if completion_mask.ndim != 2 or in_loss.shape != completion_mask.shape[:1]:
        raise ValueError(f"completion_mask must be [N, T] and in_loss [N]; got {completion_mask.shape}, "
                         f"{in_loss.shape}")
    length = config.sum_norm_length if config.sum_norm_length is not None else max_new_tokens
    if length is None:
        if config.aggregation == "seq_mean_token_sum_norm":
            raise ValueError("aggregation='seq_mean_token_sum_norm' needs a constant L: set grpo.sum_norm_length "
                             "or pass max_new_tokens=sampler.max_new_tokens")
        length = 1
    mask = loss_token_mask(completion_mask, in_loss)
    return StepNorm(
        num_tokens=mask.sum().astype(jnp.float32),
        num_sequences=mask.any(axis=1).sum().astype(jnp.float32),
        sum_norm_length=jnp.float32(length),
    )


def token_weights(mask: jax.Array, norm: StepNorm, aggregation: str) -> jax.Array:
    """[N, T] weight of each token in the step's mean (constants; rows only need their own length)."""
    mask = mask.astype(jnp.float32)
    if aggregation == "token_mean":  # sum / tokens in the step
        return mask / jnp.maximum(norm.num_tokens, 1.0)
    if aggregation == "seq_mean_token_mean":  # mean over sequences of the per-sequence token mean
        length = jnp.maximum(mask.sum(axis=1, keepdims=True), 1.0)  # [N, 1]
        return mask / (length * jnp.maximum(norm.num_sequences, 1.0))
    if aggregation == "seq_mean_token_sum_norm":  # Dr.GRPO: sum / (sequences * L)
        return mask / (jnp.maximum(norm.num_sequences, 1.0) * norm.sum_norm_length)
    raise ValueError(f"unknown aggregation {aggregation!r}")


def kl_estimate(lp: jax.Array, lp_ref: jax.Array, estimator: str) -> jax.Array:
    """Per-token estimate of KL(pi_theta || pi_ref) from d = lp_ref - lp (Schulman's k1, k2, k3)."""
    d = jnp.minimum(jax.lax.stop_gradient(lp_ref) - lp, LOG_RATIO_LIMIT)
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return 0.5 * d * d
    if estimator == "k3":
        return jnp.exp(d) - d - 1.0
    raise ValueError(f"unknown kl_estimator {estimator!r}")


def _masked_row_sum(x: jax.Array, valid: jax.Array) -> jax.Array:
    return jnp.sum(jnp.where(valid, x, 0.0), axis=1)  # [N]


def _log_ratio(lp_num: jax.Array, lp_den: jax.Array) -> jax.Array:
    """log(num / den) of truncated policies, at most LOG_RATIO_LIMIT, never NaN.

    A sampled token can lie outside a truncated (top-k/top-p/min-p) support of the numerator's policy
    (lp_num = -inf): its ratio is 0 and, through the `where`, its gradient exactly 0 (even when lp_den is
    -inf too, e.g. lp_k = sg(lp) at the first update, where num - den would be NaN). Outside the
    denominator's support only (lp_den = -inf < lp_num), the ratio is the clamp, like any runaway ratio.
    """
    return jnp.where(jnp.isneginf(lp_num), -jnp.inf, jnp.minimum(lp_num - lp_den, LOG_RATIO_LIMIT))


def policy_ratio(lp, lp_alpha, lp_k, valid, config: GRPOConfig):
    """The ratio in the clip and its clip range for `config.off_policy_ratio` (docs/algorithm.md §3 table).

    Returns (ratio [N, T] with gradient, low [N, T], high [N, T]); with `sequence_ratio` (GSPO) every
    token of a row carries the row's length-normalised ratio exp(mean_t log-ratio).
    """
    if config.off_policy_ratio == "current":  # pi_theta / pi_k (= pi_theta / sg(pi_theta) at i = 1)
        log_ratio = _log_ratio(lp, lp_k)
    else:  # "behaviour" and "recentred": pi_theta / alpha
        log_ratio = _log_ratio(lp, lp_alpha)
    recentred = config.off_policy_ratio == "recentred"
    log_centre = _log_ratio(lp_k, lp_alpha) if recentred else None  # log(pi_k / alpha), no gradient
    if config.sequence_ratio:
        length = jnp.maximum(valid.sum(axis=1, keepdims=True), 1)  # [N, 1]
        log_ratio = jnp.broadcast_to(_masked_row_sum(log_ratio, valid)[:, None] / length, lp.shape)
        if recentred:
            log_centre = jnp.broadcast_to(_masked_row_sum(log_centre, valid)[:, None] / length, lp.shape)
    ratio = jnp.exp(log_ratio)
    if recentred:
        centre = jnp.exp(log_centre)
        low = jnp.maximum(centre - config.clip_eps_low, 0.0)
        high = centre + config.clip_eps_high
    else:
        low = jnp.full_like(ratio, 1.0 - config.clip_eps_low)
        high = jnp.full_like(ratio, 1.0 + config.clip_eps_high)
    return ratio, jax.lax.stop_gradient(low), jax.lax.stop_gradient(high)


def clipped_surrogate(ratio, advantages, low, high, dual_clip: float | None):
    """min(ratio * A, clip(ratio, low, high) * A), optionally floored at c * A for A < 0 (dual clip).

    Written with explicit clipped-side masks rather than min/clip so the gradient is exactly A * d ratio
    inside the range (including its edges) and exactly 0 on the clipped side: jnp.minimum/clip split the
    gradient in half at ties, which would be wrong e.g. at ratio == 1 with clip_eps_low = 0.
    Returns (objective, clipped_low, clipped_high, dual_clipped), the last three [N, T] bool.
    """
    clipped_low = (ratio < low) & (advantages < 0)  # the min picks low * A: no gradient
    clipped_high = (ratio > high) & (advantages > 0)  # the min picks high * A: no gradient
    objective = jnp.where(clipped_low, low * advantages, jnp.where(clipped_high, high * advantages, ratio * advantages))
    if dual_clip is None:
        dual_clipped = jnp.zeros_like(clipped_low)
    else:
        dual_clipped = (advantages < 0) & (ratio > dual_clip)  # -ratio * |A| would fall below c * A
        objective = jnp.where(dual_clipped, dual_clip * advantages, objective)
    return objective, clipped_low, clipped_high, dual_clipped


def truncated_is_weight(lp_k, lp_alpha, valid, config: GRPOConfig) -> jax.Array | None:
    """min(pi_k / alpha, C) per token or per sequence (product over its tokens), no gradient; None if off."""
    if config.truncated_is == "none":
        return None
    log_w = _log_ratio(lp_k, lp_alpha)  # [N, T]
    if config.truncated_is == "sequence":
        log_w = jnp.broadcast_to(_masked_row_sum(log_w, valid)[:, None], lp_k.shape)
    return jax.lax.stop_gradient(jnp.exp(jnp.minimum(log_w, math.log(config.truncated_is_cap))))


def off_policy_sequence_mask(lp, lp_alpha, valid, advantages, delta: float | None) -> jax.Array | None:
    """[N] bool, True for the completions DeepSeek-V3.2's off-policy sequence masking drops (arXiv 2512.02556
    eq. 9): a negative advantage and a mean log(alpha / pi_theta) over the completion's tokens above `delta`
    (the sampler's policy made it much likelier than the current one does: learning from its failure is
    the riskiest update). No gradient; None when off. `advantages` is [N, 1]."""
    if delta is None:
        return None
    log_gap = jnp.where(valid, lp_alpha - jax.lax.stop_gradient(lp), 0.0)  # +inf outside pi_theta's support
    mean_gap = _masked_row_sum(log_gap, valid) / jnp.maximum(valid.sum(axis=1), 1)
    return (advantages[:, 0] < 0) & (mean_gap > delta)


def step_has_signal(adv: GroupAdvantages, norm: StepNorm, config: GRPOConfig) -> jax.Array:
    """[] bool: whether anything in the optimiser step can produce a gradient.

    False when no token is in the loss (every group of the step masked as zero-variance) or, without a KL
    term, when every advantage in the loss is 0 (zero-variance groups left unmasked): the gradient is then
    exactly 0 and only the optimiser's momentum would move the params (see `optim.skip_empty_steps`).
    `adv` fields may be any shape (e.g. [chunks, rows]).
    """
    has_tokens = norm.num_tokens > 0
    if config.beta > 0:
        return has_tokens
    return has_tokens & jnp.any(adv.in_loss.astype(bool) & (adv.advantages != 0))


def grpo_loss(
    lp: jax.Array,
    lp_alpha: jax.Array,
    lp_k: jax.Array | None,
    lp_ref: jax.Array | None,
    adv: GroupAdvantages,
    completion_mask: jax.Array,
    norm: StepNorm,
    config: GRPOConfig,
    *,
    entropy: jax.Array | None = None,
    lp_behaviour_trainer: jax.Array | None = None,
    staleness: jax.Array | int | None = None,
    lp_kl: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The loss to minimise, -(sum over tokens of weight * (surrogate - beta * kl)), and additive metrics.

    All per-token arrays are [N, T] float32; `adv` is the matching rows of `group_advantages`; `norm`
    comes from `step_normaliser` over the whole optimiser step. Only `lp` carries a gradient.
    - `lp_k`: log-probs at the start of the outer iteration. None means "this is inner step 1", where
      pi_k is the current policy, so stop_gradient(lp) is used (the `current` ratio is then pi/sg(pi)).
    - `lp_ref`: reference log-probs for the KL term: untruncated, temperature-scaled (the sampler's
      `tempered_logprobs`); may be None (and is ignored) when config.beta == 0.
    - `lp_kl`: pi_theta's log-probs for the KL term, untruncated like `lp_ref` (with gradient). None means
      `lp` (right when the sampler does not truncate). `lp` itself may be -inf on a sampled token outside
      pi_theta's current truncated support: that token's ratio is 0 and its gradient 0.
    - `entropy`: per-token policy entropy, for the metrics only.
    - `lp_behaviour_trainer`: the trainer's log-probs at the behaviour params (e.g. `lp` itself at
      (v=1, i=1), or `lp_k` when v=1), for the sampler-vs-trainer mismatch metric.
    - `staleness`: k - version(behaviour), reported as is.
    Metrics are sums/counts/min/max over this micro-batch: combine micro-batches with
    `diagnostics.combine_metrics` and turn them into means with `diagnostics.finalize_metrics`.
    """
    _check_inputs(lp, lp_alpha, lp_k, lp_ref, adv, completion_mask, config, entropy, lp_behaviour_trainer, lp_kl)
    valid = completion_mask.astype(bool)  # [N, T]
    mask = loss_token_mask(valid, adv.in_loss)  # [N, T]
    # Masked positions may hold -inf or garbage (e.g. padding outside a top-k support): zero them before any
    # exp so no inf/NaN reaches the sums, and the where keeps their gradient exactly 0.
    lp = jnp.where(valid, lp, 0.0)
    lp_kl = lp if lp_kl is None else jnp.where(valid, lp_kl, 0.0)
    lp_alpha = jnp.where(valid, jax.lax.stop_gradient(lp_alpha), 0.0)
    lp_k = jnp.where(valid, jax.lax.stop_gradient(lp if lp_k is None else lp_k), 0.0)
    advantages = adv.advantages.astype(jnp.float32)[:, None]  # [N, 1]

    ratio, low, high = policy_ratio(lp, lp_alpha, lp_k, valid, config)
    surrogate, clipped_low, clipped_high, dual_clipped = clipped_surrogate(
        ratio, advantages, low, high, config.dual_clip
    )
    is_weight = truncated_is_weight(lp_k, lp_alpha, valid, config)
    if is_weight is not None:
        surrogate = surrogate * is_weight
    sequence_masked = off_policy_sequence_mask(lp, lp_alpha, valid, advantages, config.sequence_mask_delta)
    if sequence_masked is not None:  # out of the surrogate only: the normaliser and the KL term keep them
        surrogate = jnp.where(sequence_masked[:, None], 0.0, surrogate)

    weights = token_weights(mask, norm, config.aggregation)  # [N, T]
    pg_loss = -jnp.sum(weights * surrogate)
    kl = None
    kl_loss = jnp.float32(0.0)
    if config.beta > 0:
        kl = kl_estimate(lp_kl, jnp.where(valid, lp_ref, 0.0), config.kl_estimator)
        kl_loss = config.beta * jnp.sum(weights * kl)
    loss = pg_loss + kl_loss

    metrics = loss_metrics(
        lp=lp, lp_alpha=lp_alpha, lp_k=lp_k, adv=adv, valid=valid, mask=mask, ratio=ratio,
        clipped_low=clipped_low, clipped_high=clipped_high, dual_clipped=dual_clipped, kl=kl, is_weight=is_weight,
        pg_loss=pg_loss, kl_loss=kl_loss, entropy=entropy, lp_behaviour_trainer=lp_behaviour_trainer,
        staleness=staleness, sequence_masked=sequence_masked,
    )
    return loss, metrics


def _check_inputs(lp, lp_alpha, lp_k, lp_ref, adv, completion_mask, config, entropy, lp_behaviour_trainer, lp_kl):
    shape = lp.shape
    if lp.ndim != 2:
        raise ValueError(f"lp must be [N, T] per-token log-probs, got shape {shape}")
    named = {"lp_alpha": lp_alpha, "lp_k": lp_k, "completion_mask": completion_mask, "entropy": entropy,
             "lp_behaviour_trainer": lp_behaviour_trainer, "lp_kl": lp_kl}
    if config.beta > 0:
        if lp_ref is None:
            raise ValueError(f"grpo.beta={config.beta} > 0 needs lp_ref (reference log-probs); pass beta=0 to "
                             "train without a reference")
        named["lp_ref"] = lp_ref
    for name, x in named.items():
        if x is not None and x.shape != shape:
            raise ValueError(f"{name} has shape {x.shape}, expected {shape} like lp")
    for name, x in adv._asdict().items():
        if x.shape != shape[:1]:
            raise ValueError(f"advantages field {name} has shape {x.shape}, expected ({shape[0]},) (one per row)")
