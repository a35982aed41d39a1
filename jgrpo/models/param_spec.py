"""What one parameter of the model is: a `ParamSpec` (its shape, dtype, logical axes and initializer), and the
initializers. `models/parameters.py` declares every parameter with one; LoRA adapters (`lora.adapter_specs`) and an
int8 copy's scales (`quantize.scale_spec`) are declared from the weight they belong to.

An initializer is `init(draw, shape, dtype) -> array`, where `draw()` gives the next random key of the model's
stream: the ones that need randomness draw, so which key a parameter gets depends only on the ones drawn before it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

Initializer = Callable[[Callable[[], jax.Array], tuple[int, ...], jnp.dtype], jax.Array]


class ParamSpec(NamedTuple):
    """One parameter: what creates it (`init`), what it is (`shape`, `dtype`) and how it shards (`axes`: one logical
    axis name per dimension, or None for one never split; jgrpo.parallel.mesh's rule tables map them to the mesh)."""

    shape: tuple[int, ...]
    dtype: str
    axes: tuple[str | None, ...]
    init: Initializer

    def initial_value(self, draw: Callable[[], jax.Array]) -> jax.Array:
        return self.init(draw, self.shape, jnp.dtype(self.dtype))


def normal(draw, shape, dtype) -> jax.Array:
    """N(0, 0.02^2): HF's initializer_range for these families (drawn in float32, then cast)."""
    return (0.02 * jax.random.normal(draw(), shape, jnp.float32)).astype(dtype)


def ones(draw, shape, dtype) -> jax.Array:
    """RMSNorm gains start at identity (an int8 copy's scales are filled by quantizing)."""
    return jnp.ones(shape, dtype)


def zeros(draw, shape, dtype) -> jax.Array:
    """Biases."""
    return jnp.zeros(shape, dtype)
