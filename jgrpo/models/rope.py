"""Rotary position embeddings (HF layout), with the checkpoint's rope scaling: default, linear, Llama 3.1.

`cfg` is the model's `LLMConfig` (head_dim, rope_theta, rope_type, rope_params).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rope_inv_freq(cfg) -> jax.Array:
    """Inverse frequencies [Dh/2] (float32) with the checkpoint's rope scaling applied."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
    params = cfg.rope_params
    if cfg.rope_type == "linear":
        inv_freq = inv_freq / params["factor"]
    elif cfg.rope_type == "llama3":
        # Llama 3.1: long wavelengths slowed by `factor`, short ones kept, a smooth ramp in between.
        factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
        old_len = params["original_max_position_embeddings"]
        wavelen = 2 * jnp.pi / inv_freq
        scaled = jnp.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        inv_freq = jnp.where(is_medium, smoothed, scaled)
    return inv_freq


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate halves (HF layout). x: [B, T, N, Dh]; cos, sin: [B, T, Dh/2] float32."""
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def rope_cos_sin(cfg, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos, sin of the rotary angles for integer positions [B, T]: each [B, T, Dh/2] float32."""
    angles = positions.astype(jnp.float32)[..., None] * rope_inv_freq(cfg)
    return jnp.cos(angles), jnp.sin(angles)
