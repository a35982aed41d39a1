"""Group-relative advantages (docs/algorithm.md §2) and the per-row facts the loss kernel needs about each group.

Rewards arrive flat, `[B * G]`, with the G completions of prompt b in rows b*G .. b*G+G-1 (the
sampler's layout). Everything here is computed once per iteration on the *whole* batch, before any
micro-batching, and returned row-aligned, so a micro-batch is just a slice of rows of every field.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jgrpo.config import GRPOConfig


class GroupAdvantages(NamedTuple):
    """Row-aligned (one entry per completion) results of `group_advantages`; slice rows to micro-batch."""

    advantages: jax.Array  # [N] float32, 0 for zero-variance groups
    in_loss: jax.Array  # [N] bool: the row enters surrogate, KL and normalisers (False = masked zero-variance)
    zero_variance: jax.Array  # [N] bool: all rewards of the row's group are equal
    tv_weight: jax.Array  # [N] float32: (1 - s) / s of the row's prompt, s = sqrt(var(r) + eps) (docs/algorithm.md §7)


def group_advantages(rewards: jax.Array, config: GRPOConfig, components: jax.Array | None = None,
                     weights: tuple[float, ...] | None = None, valid: jax.Array | None = None) -> GroupAdvantages:
    """A_i = (r_i - mean_group(r)) / scale, with the scale chosen by the config (docs/algorithm.md §2).

    - `advantage_scale`: "group" divides by the group's std (paper eq. 2), "batch" by the std of all
      rewards of the batch (centring stays per group), "none" does not divide (Dr.GRPO).
    - `advantage_std`: "population" (paper) or "bessel" (unbiased, what TRL uses).
    - `advantage_eps_placement`: "inside_sqrt" gives sqrt(var + eps) (paper), "add_to_std" gives std + eps.
    - Zero-variance groups get A = 0 exactly; with `mask_zero_variance` they also leave the loss
      (`in_loss` False), so they are removed from surrogate, KL and normalisers (paper eq. 8).
    - `advantage_reward_normalisation: per_reward` (GDPO) needs `components` [B*G, F] (each reward function's
      reward, `rewards` being their weighted sum) and their `weights`: each column is centred and scaled within
      its group as above, the weighted sum is standardised over the batch's rows with signal; a group is
      zero-variance when every column is constant in it.
    - `valid` [B*G] bool (None: every row): rows left out of the loss and of their group's statistics (an
      episode whose environment failed, `env.on_failure: mask`): a group's mean and std are over its valid rows,
      an invalid row gets A = 0 and `in_loss` False, and a group with fewer than two valid rows is zero-variance.
    """
    rewards = jnp.asarray(rewards, jnp.float32)
    g = config.num_generations
    if rewards.ndim != 1:
        raise ValueError(f"rewards must be flat [B*G] with the G samples of a prompt contiguous, got {rewards.shape}")
    if rewards.shape[0] == 0 or rewards.shape[0] % g:
        raise ValueError(
            f"rewards has {rewards.shape[0]} rows, which is not a positive multiple of grpo.num_generations={g}"
        )
    if config.advantage_std == "bessel" and g < 2:
        raise ValueError("advantage_std='bessel' needs num_generations >= 2")
    ddof = 0 if config.advantage_std == "population" else 1
    eps = jnp.float32(config.advantage_eps)

    grouped = rewards.reshape(-1, g)  # [B, G]
    if valid is not None:
        if config.advantage_reward_normalisation == "per_reward":
            raise ValueError("advantage_reward_normalisation='per_reward' does not take valid rows")
        return _with_valid_rows(grouped, jnp.asarray(valid, bool).reshape(grouped.shape), config, ddof, eps)
    if config.advantage_reward_normalisation == "per_reward":
        if components is None or weights is None or components.shape != (rewards.shape[0], len(weights)):
            raise ValueError("advantage_reward_normalisation='per_reward' needs components [B*G, F] and F weights, "
                             f"got {None if components is None else components.shape} and {weights}")
        columns = jnp.asarray(components, jnp.float32).reshape(-1, g, len(weights)).transpose(2, 0, 1)  # [F, B, G]
        per_column = jax.vmap(lambda r: _normalised(r, config, ddof, eps))(columns)  # [F, B, G], [F, B, 1]
        summed = jnp.tensordot(jnp.asarray(weights, jnp.float32), per_column[0], axes=1)  # [B, G]
        zero_variance = jnp.all(per_column[1], axis=0)  # [B, 1]
        # GDPO's batch-wise normalisation, over the rows of groups with any variance: a group whose rewards are
        # all equal has no signal, and its zeros would shrink the std by however many such groups a batch has.
        live = jnp.broadcast_to(~zero_variance, summed.shape).astype(jnp.float32)
        count = jnp.maximum(live.sum(), 1.0)
        mean = (summed * live).sum() / count
        var = (jnp.square(summed - mean) * live).sum() / count
        advantages = jnp.where(zero_variance, 0.0, (summed - mean) / jnp.sqrt(var + eps))
    else:
        advantages, zero_variance = _normalised(grouped, config, ddof, eps)

    # Theorem 1's s is the group's reward std as the paper defines it: var_alpha is the population variance
    # (whatever `advantage_std` scales the advantages with), eps inside the sqrt.
    s = jnp.sqrt(grouped.var(axis=1, keepdims=True) + eps)  # [B, 1] (of the total reward in either mode)
    tv_weight = (1.0 - s) / s

    in_loss = ~zero_variance if config.mask_zero_variance else jnp.ones_like(zero_variance)

    def rows(x):  # [B, 1] or [B, G] -> [B*G]
        return jnp.broadcast_to(x, grouped.shape).reshape(-1)

    return GroupAdvantages(
        advantages=rows(advantages),
        in_loss=rows(in_loss),
        zero_variance=rows(zero_variance),
        tv_weight=rows(tv_weight),
    )


def _normalised(grouped: jax.Array, config: GRPOConfig, ddof: int, eps: jax.Array) -> tuple[jax.Array, jax.Array]:
    """[B, G] rewards -> (advantages [B, G], zero_variance [B, 1]) by `advantage_scale` and the eps rule."""
    centred = grouped - grouped.mean(axis=1, keepdims=True)  # [B, G]
    # Equality, not var == 0: the float mean of equal rewards (e.g. three 0.1s) need not equal them exactly.
    zero_variance = jnp.all(grouped == grouped[:, :1], axis=1, keepdims=True)  # [B, 1]
    if config.advantage_scale == "none":
        advantages = centred
    else:
        if config.advantage_scale == "group":
            var = grouped.var(axis=1, ddof=ddof, keepdims=True)
        else:
            var = grouped.var(ddof=ddof)
        if config.advantage_eps_placement == "inside_sqrt":
            denominator = jnp.sqrt(var + eps)
        else:
            denominator = jnp.sqrt(var) + eps
        # With eps = 0 a zero-variance group divides 0 by 0; the where below puts the 0 of docs/algorithm.md §2.
        advantages = centred / denominator
    return jnp.where(zero_variance, 0.0, advantages), zero_variance


def _with_valid_rows(grouped: jax.Array, valid: jax.Array, config: GRPOConfig, ddof: int,
                     eps: jax.Array) -> GroupAdvantages:
    """`group_advantages` over the valid rows of each group only (see its `valid`)."""
    w = valid.astype(jnp.float32)  # [B, G]
    count = w.sum(axis=1, keepdims=True)  # [B, 1]
    mean = (grouped * w).sum(axis=1, keepdims=True) / jnp.maximum(count, 1.0)
    centred = (grouped - mean) * w
    first = jnp.take_along_axis(grouped, jnp.argmax(valid, axis=1)[:, None], axis=1)  # a valid row's reward
    zero_variance = jnp.all(~valid | (grouped == first), axis=1, keepdims=True) | (count < 2)
    population = (jnp.square(centred)).sum(axis=1, keepdims=True) / jnp.maximum(count, 1.0)
    if config.advantage_scale == "none":
        advantages = centred
    else:
        if config.advantage_scale == "group":
            var = jnp.square(centred).sum(axis=1, keepdims=True) / jnp.maximum(count - ddof, 1.0)
        else:
            total = jnp.maximum(w.sum(), 1.0)
            batch_mean = (grouped * w).sum() / total
            var = (jnp.square(grouped - batch_mean) * w).sum() / jnp.maximum(total - ddof, 1.0)
        denominator = jnp.sqrt(var + eps) if config.advantage_eps_placement == "inside_sqrt" else jnp.sqrt(var) + eps
        advantages = centred / denominator
    advantages = jnp.where(zero_variance | ~valid, 0.0, advantages)
    s = jnp.sqrt(population + eps)  # Theorem 1's s over the valid rows (population variance, eps inside)
    in_loss = (~zero_variance if config.mask_zero_variance else jnp.ones_like(zero_variance)) & valid

    def rows(x):
        return jnp.broadcast_to(x, grouped.shape).reshape(-1)

    return GroupAdvantages(advantages=rows(advantages), in_loss=rows(in_loss), zero_variance=rows(zero_variance),
                           tv_weight=rows((1.0 - s) / s))
