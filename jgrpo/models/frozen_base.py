"""LoRA's frozen base weights: held once per layout, joined with whichever adapters a policy has.

With LoRA (`model.lora.rank` > 0) the trainer's state holds adapters only: the current adapters, the behaviour's
copy (v > 1) and, after a reference swap, a frozen copy for the reference. Every policy is the base plus its
adapters, and the reference without a swap is the base alone, so beta > 0 costs no copy of the weights. The base
is held in the training layout and, only when the sampling layout differs from it (or `sampler.weights_dtype`
is narrower than the base's dtype, or int8: quantized), once more for the sampler (made once: the base never changes);
`sample_copy_bytes` reports that cost.

Without LoRA there is no frozen part: the trainable params are the whole model and `join` returns them as they are.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jgrpo.models.llm import param_logical_axes
from jgrpo.models.lora import join_adapters, split_adapters
from jgrpo.models.quantize import sampler_copy
from jgrpo.parallel.mesh import SAMPLE_RULES, logical_shardings
from jgrpo.parallel.weights.copies import param_copier


def sample_layout(base: dict, mesh, sampler, compute_dtype: str, rules=SAMPLE_RULES) -> tuple[dict, object] | None:
    """(shardings, convert) the sampler needs the base in (`convert`: params -> the sampler's copy, None: as they
    are), or None where the base as it is serves.

    `sampler`: the run's `sampler` config section. Int8 (`sampler.weights_dtype`) always copies: the base is
    quantized once. A float dtype casts only when
    narrower than the base's floating weights (a bfloat16 base is never widened to sample in float32). `base`
    may be arrays or ShapeDtypeStructs with shardings (the planner's), so both decide alike.
    """
    widest = max(x.dtype.itemsize for x in jax.tree.leaves(base) if jnp.issubdtype(x.dtype, jnp.floating))
    dtype = sampler.weights_dtype
    narrower = dtype == "int8" or jnp.dtype(dtype).itemsize < widest
    convert = sampler_copy(dtype, compute_dtype, sampler.quantize_embeddings) if narrower else None
    copied = base if convert is None else jax.eval_shape(convert, base)
    shardings = logical_shardings(param_logical_axes(copied), mesh, rules, shapes=copied)

    def same(x, sharding):
        return x.sharding.is_equivalent_to(sharding, len(x.shape))

    if convert is None and all(jax.tree.leaves(jax.tree.map(same, base, shardings))):
        return None
    return shardings, convert


class FrozenBase:
    """The base weights of a LoRA run (or nothing, for full fine-tuning)."""

    def __init__(self, base: dict | None, mesh, sampler, compute_dtype: str):
        self.train = base
        self.sample = base
        self.sample_copy_bytes = 0
        layout = None if base is None else sample_layout(base, mesh, sampler, compute_dtype)
        if layout is not None:
            self.sample = param_copier(*layout)(base)
            self.sample_copy_bytes = sum(x.nbytes for x in jax.tree.leaves(self.sample))

    @classmethod
    def split(cls, params: dict, lora: bool, mesh, sampler, compute_dtype: str) -> tuple[dict, FrozenBase]:
        """Loaded params -> (what trains, the frozen base): (adapters, base) with LoRA, else (params, nothing).
        `sampler`: the run's `sampler` config section (the sampling copy's dtype)."""
        if not lora:
            return params, cls(None, mesh, sampler, compute_dtype)
        adapters, base = split_adapters(params)
        return adapters, cls(base, mesh, sampler, compute_dtype)

    @property
    def lora(self) -> bool:
        return self.train is not None

    def join(self, trainable: dict) -> dict:
        """The whole model in the training layout: the base plus `trainable`'s adapters (no copies)."""
        return join_adapters(trainable, self.train)

    def join_sample(self, trainable: dict) -> dict:
        """The whole model in the sampling layout, from adapters already in that layout."""
        return join_adapters(trainable, self.sample)
