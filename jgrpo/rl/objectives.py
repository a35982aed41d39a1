"""The GRPO loss kernel (docs/algorithm.md §3, §4): clipped surrogate in every off-policy mode, KL, aggregation.

Pure functions of arrays; no model inside. Shapes: N completion rows (B prompts x G samples), T
completion tokens. Per-token log-probs are `lp` (current params, the only input with a gradient),
`lp_alpha` (behaviour policy, recorded by the sampler), `lp_k` (params at the start of the outer
iteration) and `lp_ref` (reference policy); `grpo_loss` takes them as records (`loss_records`: the inputs every
objective needs, and the optional extras) and hands them, with the terms it computed, whole to its metrics.

Micro-batching and sharding invariance: every token's weight in the loss is fixed by counts over the
*whole optimiser step* (`step_normaliser`, computed before the micro-batch loop), so the loss is a
plain sum over rows. Hence sum over micro-batches of `grpo_loss(micro)` == `grpo_loss(step)`, for the
value and the gradient, and sharding the rows over devices changes nothing either.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jgrpo.config import GRPOConfig
from jgrpo.rl.advantages import GroupAdvantages
from jgrpo.rl.corrections import (
    LOG_RATIO_LIMIT,
    log_ratio,
    masked_is_drop,
    masked_row_sum,
    off_policy_sequence_mask,
    truncated_is_weight,
)
from jgrpo.rl.diagnostics import loss_metrics
from jgrpo.rl.loss_records import LossExtras, LossInputs, LossTerms


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


def policy_ratio(lp, lp_alpha, lp_k, valid, config: GRPOConfig, eps: tuple[float | None, float] | None = None):
    """The ratio in the clip and its clip range for `config.off_policy_ratio` (docs/algorithm.md §3 table).

    Returns (ratio [N, T] with gradient, low [N, T], high [N, T]); with `sequence_ratio` (GSPO) every
    token of a row carries the row's length-normalised ratio exp(mean_t log-ratio). The range is
    [centre - eps_low, centre + eps_high] (centre 1, or pi_k / alpha when recentred) with `eps` = (eps_low,
    eps_high), by default the clip's; CISPO passes its own, where eps_low None means no lower bound (low = 0).
    """
    eps_low, eps_high = (config.clip_eps_low, config.clip_eps_high) if eps is None else eps
    if config.off_policy_ratio == "current":  # pi_theta / pi_k (= pi_theta / sg(pi_theta) at i = 1)
        log_r = log_ratio(lp, lp_k)
    else:  # "behaviour" and "recentred": pi_theta / alpha
        log_r = log_ratio(lp, lp_alpha)
    recentred = config.off_policy_ratio == "recentred"
    log_centre = log_ratio(lp_k, lp_alpha) if recentred else None  # log(pi_k / alpha), no gradient
    if config.sequence_ratio:
        length = jnp.maximum(valid.sum(axis=1, keepdims=True), 1)  # [N, 1]
        log_r = jnp.broadcast_to(masked_row_sum(log_r, valid)[:, None] / length, lp.shape)
        if recentred:
            log_centre = jnp.broadcast_to(masked_row_sum(log_centre, valid)[:, None] / length, lp.shape)
    ratio = jnp.exp(log_r)
    centre = jnp.exp(log_centre) if recentred else jnp.ones_like(ratio)
    low = jnp.zeros_like(ratio) if eps_low is None else jnp.maximum(centre - eps_low, 0.0)
    high = centre + eps_high
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


def cispo_surrogate(lp, ratio, advantages, low, high):
    """CISPO's objective (MiniMax-M1, arXiv 2506.13585 eq. 4): sg(clip(ratio, low, high)) * A * log pi_theta.

    Written as w * A * exp(lp - sg(lp)) with w = sg(clip(ratio)): its gradient is CISPO's, w * A * d lp, for
    every token (none loses its gradient to the clip, the point of CISPO), and its value is w * A, the
    truncated-IS surrogate, comparable with the clipped objective's (a plain w * A * lp would make the logged
    loss a log-likelihood). A token outside pi_theta's truncated support (lp = -inf) has ratio 0 and no gradient.
    Returns (objective, weight_clipped_low, weight_clipped_high).
    """
    weight = jax.lax.stop_gradient(jnp.clip(ratio, low, high))
    inside = jnp.isfinite(lp)
    own = jnp.where(inside, lp, 0.0)
    objective = weight * advantages * jnp.where(inside, jnp.exp(own - jax.lax.stop_gradient(own)), 0.0)
    return objective, ratio < low, ratio > high


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


def grpo_loss(inputs: LossInputs, norm: StepNorm, config: GRPOConfig,
              extras: LossExtras = LossExtras()) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The loss to minimise, -(sum over tokens of weight * (surrogate - beta * kl)), and additive metrics.

    `inputs`: what every objective needs (`loss_records.LossInputs`: per-token [N, T] float32 log-probs of pi_theta,
    alpha and pi_k, the rows' advantages, the completion mask); `extras`: the optional ones (`LossExtras`: the KL's,
    M2PO's mask, the metrics', the rows covered). `norm` comes from `step_normaliser` over the whole optimiser step.
    Only `inputs.lp` carries a gradient; it may be -inf on a sampled token outside pi_theta's current truncated
    support: that token's ratio is 0 and its gradient 0. `extras.lp_ref` is needed when config.beta > 0 (and
    ignored otherwise).
    Metrics are sums/counts/min/max over this micro-batch: combine micro-batches with
    `diagnostics.combine_metrics` and turn them into means with `diagnostics.finalize_metrics`.
    """
    _check_inputs(inputs, extras, config)
    lp, lp_alpha, lp_k, adv, completion_mask = inputs
    rows = extras.rows
    if rows is not None:
        completion_mask = completion_mask.astype(bool) & rows[:, None]
        adv = adv._replace(in_loss=adv.in_loss.astype(bool) & rows, zero_variance=adv.zero_variance & rows)
    valid = completion_mask.astype(bool)  # [N, T]
    mask = loss_token_mask(valid, adv.in_loss)  # [N, T]
    # Masked positions may hold -inf or garbage (e.g. padding outside a top-k support): zero them before any
    # exp so no inf/NaN reaches the sums, and the where keeps their gradient exactly 0.
    lp = jnp.where(valid, lp, 0.0)
    lp_kl = lp if extras.lp_kl is None else jnp.where(valid, extras.lp_kl, 0.0)
    lp_alpha = jnp.where(valid, jax.lax.stop_gradient(lp_alpha), 0.0)
    lp_k = jnp.where(valid, jax.lax.stop_gradient(lp if lp_k is None else lp_k), 0.0)
    advantages = adv.advantages.astype(jnp.float32)[:, None]  # [N, 1]

    if config.policy_loss == "cispo":
        ratio, low, high = policy_ratio(lp, lp_alpha, lp_k, valid, config,
                                        eps=(config.cispo_eps_low, config.cispo_eps_high))
        surrogate, clipped_low, clipped_high = cispo_surrogate(lp, ratio, advantages, low, high)
        dual_clipped = jnp.zeros_like(clipped_low)
    else:
        ratio, low, high = policy_ratio(lp, lp_alpha, lp_k, valid, config)
        if config.m2po_tau is not None and config.m2po_form == "paper":  # M2PO: its mask replaces the clip
            low, high = jnp.zeros_like(ratio), jnp.full_like(ratio, jnp.inf)
        surrogate, clipped_low, clipped_high, dual_clipped = clipped_surrogate(
            ratio, advantages, low, high, config.dual_clip
        )
    is_weight = truncated_is_weight(lp_k, lp_alpha, valid, config)
    if is_weight is not None:
        surrogate = surrogate * is_weight
    # Corrections that drop tokens: out of the surrogate only (the normaliser and the KL term keep them).
    sequence_masked = off_policy_sequence_mask(lp, lp_alpha, valid, advantages, config.sequence_mask_delta)
    if sequence_masked is not None:
        surrogate = jnp.where(sequence_masked[:, None], 0.0, surrogate)
    mis_dropped = masked_is_drop(lp_k, lp_alpha, valid, config)
    for dropped in (mis_dropped, extras.m2po_drop):
        if dropped is not None:
            surrogate = jnp.where(dropped, 0.0, surrogate)

    weights = token_weights(mask, norm, config.aggregation)  # [N, T]
    pg_loss = -jnp.sum(weights * surrogate)
    kl = None
    kl_loss = jnp.float32(0.0)
    if config.beta > 0:
        kl = kl_estimate(lp_kl, jnp.where(valid, extras.lp_ref, 0.0), config.kl_estimator)
        kl_loss = config.beta * jnp.sum(weights * kl)
    loss = pg_loss + kl_loss

    terms = LossTerms(mask=mask, ratio=ratio, clipped_low=clipped_low, clipped_high=clipped_high,
                      dual_clipped=dual_clipped, is_weight=is_weight, sequence_masked=sequence_masked,
                      mis_dropped=mis_dropped, kl=kl, pg_loss=pg_loss, kl_loss=kl_loss)
    return loss, loss_metrics(LossInputs(lp, lp_alpha, lp_k, adv, valid), terms, extras)


def _check_inputs(inputs: LossInputs, extras: LossExtras, config: GRPOConfig) -> None:
    lp, lp_alpha, lp_k, adv, completion_mask = inputs
    lp_ref = extras.lp_ref
    shape = lp.shape
    if lp.ndim != 2:
        raise ValueError(f"lp must be [N, T] per-token log-probs, got shape {shape}")
    named = {"lp_alpha": lp_alpha, "lp_k": lp_k, "completion_mask": completion_mask, "entropy": extras.entropy,
             "lp_behaviour_trainer": extras.lp_behaviour_trainer, "lp_kl": extras.lp_kl}
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
