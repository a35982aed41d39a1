"""Metrics of the GRPO loss, including the Theorem 1 diagnostics of docs/algorithm.md §7.

`grpo_loss` returns metrics as *accumulators*: sums and counts (added across micro-batches), and
keys ending in `_min` / `_max` (combined with min / max). Under `jax.jit` over a sharded batch they
are already global. `combine_metrics` merges two micro-batches; `finalize_metrics` turns the merged
accumulators into the logged means. A mean over an empty set (e.g. the KL when every group is masked) is
finalised as 0 next to its count, and `MEAN_COUNTS` names that count, so whoever reports a mean can drop it
when its count is 0: a NaN in the metrics only ever means a real numerical problem.

Theorem 1 (rewards in [0, 1]), per prompt x with s = sqrt(var_alpha(r) + eps):
    J(pi) - J(pi_k) >= L_alpha(pi) - 2 (1 - s)/s TV(pi, alpha) - 2 TV(pi_k, alpha),
    L_alpha(pi) = E_{y~alpha}[pi/alpha * A].
Averaged over prompts the weight becomes M = sqrt(mean_x ((1 - s)/s)^2). TV(p, alpha) is estimated
from the samples as 0.5 * mean |p(y)/alpha(y) - 1| with whole-sequence ratios. All of it is taken over
the rows that enter the loss (with zero-variance masking the masked prompts, whose s ~ sqrt(eps) makes
the bound vacuous, are exactly the ones the objective drops).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jgrpo.rl.loss_records import LossExtras, LossInputs, LossTerms

# Sequence log-ratios are clamped here before exp: a sum over hundreds of tokens overflows float32 easily,
# and a ratio of e^20 already makes the bound vacuous.
SEQUENCE_LOG_RATIO_LIMIT = 20.0


def _sum(x, where) -> jax.Array:
    return jnp.sum(jnp.where(where, x, 0.0)).astype(jnp.float32)


def _min(x, where) -> jax.Array:
    return jnp.min(jnp.where(where, x, jnp.inf)).astype(jnp.float32)


def _max(x, where) -> jax.Array:
    return jnp.max(jnp.where(where, x, -jnp.inf)).astype(jnp.float32)


def loss_metrics(inputs: LossInputs, terms: LossTerms, extras: LossExtras) -> dict[str, jax.Array]:
    """Accumulators for one micro-batch (see module doc), from `objectives.grpo_loss`'s `inputs` as it masked them
    (log-probs zeroed outside the completion mask, the advantages' rows restricted to `extras.rows`), the `terms`
    it computed and its `extras`."""
    sg = jax.lax.stop_gradient
    lp, lp_alpha, lp_k, adv, valid = inputs
    mask, ratio = terms.mask, sg(terms.ratio)
    lp = sg(lp)
    rows = jnp.ones(valid.shape[:1], bool) if extras.rows is None else extras.rows
    m = {
        "pg_loss": sg(terms.pg_loss).astype(jnp.float32),
        "kl_loss": sg(terms.kl_loss).astype(jnp.float32),
        "token_count": _sum(1.0, mask),
        "completion_token_count": _sum(1.0, valid),
        "row_count": _sum(1.0, rows),
        "clip_low_count": _sum(1.0, terms.clipped_low & mask),
        "clip_high_count": _sum(1.0, terms.clipped_high & mask),
        "dual_clip_count": _sum(1.0, terms.dual_clipped & mask),
        "ratio_sum": _sum(ratio, mask),
        "ratio_min": _min(ratio, mask),
        "ratio_max": _max(ratio, mask),
        # Advantage statistics and zero-variance groups, over every row (each group has G rows, so the row
        # fraction of zero-variance rows is the group fraction once summed over the step).
        "advantage_sum": _sum(adv.advantages, rows),
        "advantage_sq_sum": _sum(jnp.square(adv.advantages), rows),
        "advantage_min": _min(adv.advantages, rows),
        "advantage_max": _max(adv.advantages, rows),
        "zero_variance_row_count": _sum(1.0, adv.zero_variance),
    }
    if terms.kl is not None:
        m["kl_sum"] = _sum(sg(terms.kl), mask)
    if terms.is_weight is not None:
        m["is_weight_sum"] = _sum(terms.is_weight, mask)
    if terms.sequence_masked is not None:  # rows in the loss that the off-policy sequence masking dropped
        m["sequence_masked_row_count"] = _sum(1.0, terms.sequence_masked & adv.in_loss.astype(bool))
    if terms.mis_dropped is not None:  # loss tokens masked importance sampling dropped
        m["mis_drop_count"] = _sum(1.0, terms.mis_dropped & mask)
    if extras.m2po_drop is not None:
        m["m2po_drop_count"] = _sum(1.0, extras.m2po_drop & mask)
    if extras.entropy is not None:
        m["entropy_sum"] = _sum(sg(extras.entropy), valid)
    if extras.lp_behaviour_trainer is not None:
        # A sampled token outside the trainer's truncated support (lp = -inf, e.g. at a top-p edge that rounding
        # moved) is a mismatch of support, not of value: counted, and kept out of the gap statistics.
        trainer_lp = jnp.where(valid, sg(extras.lp_behaviour_trainer), 0.0)
        inside = valid & jnp.isfinite(trainer_lp)
        gap = jnp.abs(lp_alpha - jnp.where(inside, trainer_lp, 0.0))
        m["logprob_mismatch_sum"] = _sum(gap, inside)
        m["logprob_mismatch_max"] = _max(gap, inside)
        m["mismatch_token_count"] = _sum(1.0, inside)
        m["outside_support_count"] = _sum(1.0, valid & ~inside)
    if extras.staleness is not None:
        m["staleness_max"] = jnp.asarray(extras.staleness, jnp.float32)
    m.update(theorem1_accumulators(inputs._replace(lp=lp)))
    return m


def theorem1_accumulators(inputs: LossInputs) -> dict[str, jax.Array]:
    """Sums over the rows in the loss of the quantities whose means make Theorem 1's bound."""
    lp, lp_alpha, lp_k, adv, valid = inputs

    def sequence_ratio(log_num):  # [N, T] -> [N]: p(y)/alpha(y) over the whole completion
        log_ratio = jnp.sum(jnp.where(valid, log_num - lp_alpha, 0.0), axis=1)
        return jnp.exp(jnp.minimum(log_ratio, SEQUENCE_LOG_RATIO_LIMIT))

    ratio_theta = sequence_ratio(jax.lax.stop_gradient(lp))  # pi_theta / alpha
    ratio_k = sequence_ratio(lp_k)  # pi_k / alpha
    rows = adv.in_loss.astype(bool)
    weight = adv.tv_weight
    return {
        "bound_row_count": _sum(1.0, rows),
        "tv_theta_alpha_sum": _sum(0.5 * jnp.abs(ratio_theta - 1.0), rows),
        "tv_k_alpha_sum": _sum(0.5 * jnp.abs(ratio_k - 1.0), rows),
        "surrogate_alpha_sum": _sum(ratio_theta * adv.advantages, rows),
        "tv_weight_sum": _sum(weight, rows),
        "tv_weight_sq_sum": _sum(jnp.square(weight), rows),
    }


@functools.lru_cache(maxsize=1024)  # a pure function of the metric's name, asked every iteration
def extreme_kind(key: str) -> str | None:
    """"min" or "max" for a metric that is an extreme (its name ends in `_min` / `_max`), else None.

    The one rule for reducing metrics: extremes combine by min / max (over micro-batches here, over an
    iteration's updates in `trainer_metrics`), everything else by sum or mean.
    """
    for kind in ("min", "max"):
        if key.endswith("_" + kind):
            return kind
    return None


def combine_metrics(a: dict[str, jax.Array], b: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """Merge the accumulators of two micro-batches (same keys): min / max for extremes, else add."""
    if a.keys() != b.keys():
        raise ValueError(f"metric keys differ: {sorted(a.keys() ^ b.keys())}")
    merge = {"min": jnp.minimum, "max": jnp.maximum, None: jnp.add}
    return {key: merge[extreme_kind(key)](a[key], b[key]) for key in a}


# Each finalised mean (or min / max) and the count of the set it is taken over. With a count of 0 the value
# is a placeholder 0: drop it (see `trainer_metrics`).
MEAN_COUNTS = {
    **dict.fromkeys(("clip_frac_low", "clip_frac_high", "clip_frac_dual", "ratio_mean", "ratio_min", "ratio_max",
                     "kl_mean", "is_weight_mean", "mis_drop_frac", "m2po_drop_frac"), "token_count"),
    "sequence_mask_frac": "bound_row_count",  # the rows in the loss
    "entropy_mean": "completion_token_count",
    "logprob_mismatch_mean": "mismatch_token_count",
    "routing_mismatch": "routing_count",
    "logprob_mismatch_max": "mismatch_token_count",
    "outside_support_frac": "completion_token_count",
    **dict.fromkeys(("tv_theta_alpha", "tv_k_alpha", "tv_weight_mean", "tv_weight_M", "surrogate_alpha",
                     "lower_bound"), "bound_row_count"),
}


def finalize_metrics(acc: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """Accumulators of a whole optimiser step -> the logged values (scalars); see `MEAN_COUNTS`."""

    def mean(total, count):
        return jnp.where(count > 0, total / jnp.maximum(count, 1.0), 0.0)

    def extreme(value, count):
        return jnp.where(count > 0, value, 0.0)

    tokens, completion_tokens, rows = acc["token_count"], acc["completion_token_count"], acc["row_count"]
    out = {
        "loss": acc["pg_loss"] + acc["kl_loss"],
        "pg_loss": acc["pg_loss"],
        "kl_loss": acc["kl_loss"],
        "token_count": tokens,
        "completion_token_count": completion_tokens,
        "row_count": rows,
        "clip_frac_low": mean(acc["clip_low_count"], tokens),
        "clip_frac_high": mean(acc["clip_high_count"], tokens),
        "clip_frac_dual": mean(acc["dual_clip_count"], tokens),
        "ratio_mean": mean(acc["ratio_sum"], tokens),
        "ratio_min": extreme(acc["ratio_min"], tokens),
        "ratio_max": extreme(acc["ratio_max"], tokens),
        "advantage_mean": mean(acc["advantage_sum"], rows),
        "advantage_min": extreme(acc["advantage_min"], rows),
        "advantage_max": extreme(acc["advantage_max"], rows),
        "zero_variance_frac": mean(acc["zero_variance_row_count"], rows),
    }
    second_moment = mean(acc["advantage_sq_sum"], rows)
    out["advantage_std"] = jnp.sqrt(jnp.maximum(second_moment - jnp.square(out["advantage_mean"]), 0.0))
    if "kl_sum" in acc:
        out["kl_mean"] = mean(acc["kl_sum"], tokens)
    if "is_weight_sum" in acc:
        out["is_weight_mean"] = mean(acc["is_weight_sum"], tokens)
    if "sequence_masked_row_count" in acc:
        out["sequence_mask_frac"] = mean(acc["sequence_masked_row_count"], acc["bound_row_count"])
    for name in ("mis", "m2po"):
        if f"{name}_drop_count" in acc:
            out[f"{name}_drop_frac"] = mean(acc[f"{name}_drop_count"], tokens)
    if "entropy_sum" in acc:
        out["entropy_mean"] = mean(acc["entropy_sum"], completion_tokens)
    if "logprob_mismatch_sum" in acc:
        matched = acc["mismatch_token_count"]
        out["mismatch_token_count"] = matched
        out["logprob_mismatch_mean"] = mean(acc["logprob_mismatch_sum"], matched)
        out["logprob_mismatch_max"] = extreme(acc["logprob_mismatch_max"], matched)
        out["outside_support_frac"] = mean(acc["outside_support_count"], completion_tokens)
    if "staleness_max" in acc:
        out["staleness"] = acc["staleness_max"]
    for name in ("router_aux_loss", "router_z_loss"):  # a mixture of experts: the step's micro-batches' mean
        if name in acc:
            out[name] = acc[name]
    if "routing_count" in acc:  # a mixture of experts (`rl.routing_replay`)
        out["routing_count"] = acc["routing_count"]
        out["routing_mismatch"] = mean(acc["routing_mismatch_count"], acc["routing_count"])
    if "expert_tokens" in acc:
        counts = acc["expert_tokens"]  # [L, E]
        layer_mean = jnp.mean(counts, axis=-1)
        out["expert_load_max"] = jnp.max(jnp.where(layer_mean > 0, jnp.max(counts, axis=-1)
                                                   / jnp.maximum(layer_mean, 1e-9), 0.0))

    bound_rows = acc["bound_row_count"]
    tv_theta = mean(acc["tv_theta_alpha_sum"], bound_rows)
    tv_k = mean(acc["tv_k_alpha_sum"], bound_rows)
    surrogate = mean(acc["surrogate_alpha_sum"], bound_rows)
    weight_m = jnp.sqrt(mean(acc["tv_weight_sq_sum"], bound_rows))
    out.update({
        "bound_row_count": bound_rows,
        "tv_theta_alpha": tv_theta,
        "tv_k_alpha": tv_k,
        "tv_weight_mean": mean(acc["tv_weight_sum"], bound_rows),
        "tv_weight_M": weight_m,
        "surrogate_alpha": surrogate,
        "lower_bound": surrogate - 2.0 * weight_m * tv_theta - 2.0 * tv_k,
    })
    return out
