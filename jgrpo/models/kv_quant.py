"""The sampler's KV cache in int8 (`sampler.kv_cache_dtype: int8`): keys and values with one scale per token and
KV head.

A cache array [..., Dh] becomes an `Int8KV`: int8 values [..., Dh] and float32 scales [..., 1] (absmax over
head_dim / 127, symmetric, as the int8 weights in models/quantize.py). The scales keep head_dim as a size-1 axis,
so every slice, pad, transpose, gather and in-place update the sampler applies to a cache array over its other
axes applies unchanged to both parts (`per_part`); on a TPU the size-1 axis costs no padding (its compiled
layout puts it outermost: a [32, 2, 4608, 1] float32 scale array takes its 1.2 MB, checked deviceless on v5e).

Keys/values are quantized where they are written (prefill, the prompt store, each decode step, an append) and
read as int8 by the decode step's attention, which folds the scales into the scores and the probabilities
(`decode._attend_one`), so a step reads one byte per cached element plus 4 per token and head. A prefill or an
append attends over the dequantized cache (`load`). The trainer never sees the cache: the sampler is then another
policy than the trained weights, as with int8 weights (docs/algorithm.md §17).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jgrpo.models.quantize import quantize_over

KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "int8")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Int8KV:
    """An int8 cache array: `values` int8 [..., Dh] and `scales` float32 [..., 1]; stands for values * scales.
    Not a tuple on purpose: indexing one raises instead of silently picking a part."""

    values: jax.Array
    scales: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        return self.values.shape


def is_int8(x) -> bool:
    return isinstance(x, Int8KV)


def resolve_kv_dtype(choice: str, compute_dtype) -> str:
    """`sampler.kv_cache_dtype` as a dtype name: "auto" is the model's compute dtype (the cache as before)."""
    if choice not in KV_CACHE_DTYPES:
        raise ValueError(f"kv cache dtype {choice!r} is not one of {KV_CACHE_DTYPES}")
    return jnp.dtype(compute_dtype).name if choice == "auto" else choice


def quantize_kv(x: jax.Array) -> Int8KV:
    """[..., Dh] keys or values -> int8 with one scale per [...] index (an all-zero vector gets scale 1)."""
    values, scales = quantize_over(x, (x.ndim - 1,))
    return Int8KV(values, scales)


def dequantize_kv(c: Int8KV, dtype=jnp.float32) -> jax.Array:
    return (c.values.astype(jnp.float32) * c.scales).astype(dtype)


def zeros(shape: tuple[int, ...], dtype: str) -> jax.Array | Int8KV:
    """An empty cache array of `shape` [..., Dh] in `dtype` ("int8": zero values, unit scales)."""
    if dtype == "int8":
        return Int8KV(jnp.zeros(shape, jnp.int8), jnp.ones(shape[:-1] + (1,), jnp.float32))
    return jnp.zeros(shape, dtype)


def store(new: jax.Array, like) -> jax.Array | Int8KV:
    """New keys/values [..., Dh] in the form of the cache array `like` is: quantized, or cast to its dtype."""
    return quantize_kv(new) if is_int8(like) else new.astype(like.dtype)


def load(c, dtype) -> jax.Array:
    """A cache array as `dtype` keys/values (an int8 one dequantized)."""
    return dequantize_kv(c, dtype) if is_int8(c) else c.astype(dtype)


def per_part(fn, *trees):
    """`fn(*trees)` for a function that moves cache arrays around along any axis but the last (slices, pads,
    transposes, gathers, updates): with int8 caches, applied to the values and to the scales and zipped back into
    `Int8KV`s; with float caches, called as it is."""
    if not any(is_int8(x) for t in trees for x in jax.tree.leaves(t, is_leaf=is_int8)):
        return fn(*trees)

    def part(name):
        return fn(*(jax.tree.map(lambda x: getattr(x, name) if is_int8(x) else x, t, is_leaf=is_int8)
                    for t in trees))

    return jax.tree.map(Int8KV, part("values"), part("scales"))
