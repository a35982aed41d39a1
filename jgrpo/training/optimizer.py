"""The optimiser: AdamW with a warmup then a constant or cosine learning rate, and global-norm clipping.

Built from `OptimConfig` alone, so the trainer, the benchmarks and the tests all get the same update rule.
"""

from __future__ import annotations

import jax.numpy as jnp
import optax

from jgrpo.config import OptimConfig


def learning_rate_schedule(config: OptimConfig, total_steps: int) -> optax.Schedule:
    """Learning rate at optimiser step `count` (0-based: the value used by the first update).

    Warmup is linear and never starts at 0, so the first update already moves the params:
    lr * (count + 1) / (warmup_steps + 1) for count < warmup_steps. Afterwards either the peak lr
    (constant) or a cosine from the peak down to 0 reached at step `decay_steps` (default: the
    whole run, `total_steps`) and held there.
    """
    if total_steps < 1:
        raise ValueError(f"total_steps={total_steps} must be >= 1 (optimiser steps in the run)")
    peak, warmup = config.learning_rate, config.warmup_steps
    horizon = config.decay_steps if config.decay_steps is not None else total_steps
    if config.schedule == "cosine" and horizon <= warmup:
        raise ValueError(
            f"optim.decay_steps={horizon} must exceed optim.warmup_steps={warmup} for a cosine schedule"
        )

    def schedule(count):
        count = jnp.asarray(count, jnp.float32)
        warm = peak * jnp.minimum(1.0, (count + 1.0) / (warmup + 1.0))
        if config.schedule == "constant":
            return warm
        progress = jnp.clip((count - warmup) / max(horizon - warmup, 1), 0.0, 1.0)
        cosine = 0.5 * peak * (1.0 + jnp.cos(jnp.pi * progress))
        return jnp.where(count < warmup, warm, cosine)

    return schedule


def make_optimizer(config: OptimConfig, total_steps: int) -> optax.GradientTransformation:
    """Clip by global norm (when set), then AdamW with the schedule above.

    Weight decay follows AdamW (decoupled, scaled by the learning rate) and applies to every
    parameter; with the default weight_decay = 0 that choice is moot.
    """
    adamw = optax.adamw(
        learning_rate=learning_rate_schedule(config, total_steps),
        b1=config.b1,
        b2=config.b2,
        eps=config.eps,
        weight_decay=config.weight_decay,
    )
    if config.max_grad_norm is None:
        return adamw
    return optax.chain(optax.clip_by_global_norm(config.max_grad_norm), adamw)
