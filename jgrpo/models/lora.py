"""LoRA adapters on the decoder's projections: shapes, logical axes, initialisation, the low-rank term, merging.

An adapter on a projection W [L, *in, *out] (stacked over layers) is A [L, *in, r] and B [L, r, *out]; the
layer computes x W + (alpha / r) (x A) B. B starts at zero, so a fresh adapter leaves the model's outputs
exactly unchanged; A starts as PEFT's does (kaiming-uniform: bound 1 / sqrt(fan_in)). A shards like W's input
axes and B like its output axes, so each adapter lives on its base weight's devices; the rank axis is
replicated. No dropout: it would make log-probs stochastic and the importance ratio meaningless.

The adapters are leaves `<target>_lora_a` / `<target>_lora_b` beside their base weight in `params["layers"]`;
`split_adapters` separates them (what trains, what a behaviour copy holds) from the frozen base.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from jgrpo.config.errors import ConfigError
from jgrpo.models.matmul import dense

LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
# Projection -> (input, output) logical axes of its weight after the leading "layers" axis.
_IO_AXES = {
    "q": (("embed",), ("heads", "head_dim")),
    "k": (("embed",), ("kv_heads", "head_dim")),
    "v": (("embed",), ("kv_heads", "head_dim")),
    "o": (("heads", "head_dim"), ("embed",)),
    "gate": (("embed",), ("mlp",)),
    "up": (("embed",), ("mlp",)),
    "down": (("mlp",), ("embed",)),
}
SUFFIXES = ("_lora_a", "_lora_b")

LORA_LOGICAL_AXES: dict[tuple[str, ...], tuple[str, ...]] = {
    **{("layers", f"{t}_lora_a"): ("layers", *ins, "lora_rank") for t, (ins, _) in _IO_AXES.items()},
    **{("layers", f"{t}_lora_b"): ("layers", "lora_rank", *outs) for t, (_, outs) in _IO_AXES.items()},
}


def check_lora(rank: int, alpha: float, targets: tuple[str, ...]) -> None:
    """Fail naming the problem when an adapter spec is invalid (rank 0 = no adapters)."""
    if rank < 0 or (rank == 0) != (not targets):
        raise ValueError(f"LoRA rank {rank} with targets {targets}: a positive rank needs targets, rank 0 none")
    unknown = sorted(set(targets) - set(LORA_TARGETS))
    if unknown or len(set(targets)) != len(targets):
        raise ValueError(f"LoRA targets {targets}: each one of {LORA_TARGETS}, at most once")
    if rank and alpha <= 0:
        raise ValueError(f"LoRA alpha must be > 0, got {alpha}")


def inputs_of(target: str) -> int:
    """How many leading (after "layers") dims of the target's weight are its input: 2 for o ([H, Dh]), else 1."""
    return len(_IO_AXES[target][0])


def lora_shapes_by_path(base_shapes: dict[tuple[str, ...], tuple[int, ...]], rank: int,
                        targets: tuple[str, ...]) -> dict[tuple[str, ...], tuple[int, ...]]:
    """The adapters' shapes, from the base weights' (`llm.param_shapes_by_path`)."""
    shapes = {}
    for target in targets:
        layers, *dims = base_shapes[("layers", target)]
        n = inputs_of(target)
        shapes[("layers", f"{target}_lora_a")] = (layers, *dims[:n], rank)
        shapes[("layers", f"{target}_lora_b")] = (layers, rank, *dims[n:])
    return shapes


def is_adapter(name: str) -> bool:
    return name.endswith(SUFFIXES)


def init_adapter(name: str, shape: tuple[int, ...], key: jax.Array, dtype) -> jax.Array:
    if name.endswith("_lora_b"):
        return jnp.zeros(shape, dtype)
    bound = 1.0 / math.sqrt(math.prod(shape[1:-1]))  # fan_in: the input dims between "layers" and the rank
    return jax.random.uniform(key, shape, jnp.float32, -bound, bound).astype(dtype)


def low_rank(x: jax.Array, a: jax.Array, b: jax.Array, contract: int, scale: float) -> jax.Array:
    """(alpha / r) (x A) B for one layer's A [*in, r], B [r, *out]: two thin matmuls, never the [in, out] product."""
    return dense(dense(x, a, contract), b) * jnp.asarray(scale, x.dtype)


def split_adapters(params: dict) -> tuple[dict, dict]:
    """params -> (adapters, base): two dicts of the same nesting; together they hold every leaf once."""
    layers = params["layers"]
    adapters = {"layers": {k: v for k, v in layers.items() if is_adapter(k)}}
    base = {**params, "layers": {k: v for k, v in layers.items() if not is_adapter(k)}}
    return adapters, base


def join_adapters(adapters: dict, base: dict | None) -> dict:
    """The inverse of `split_adapters`: no copy, only new dicts around the same arrays. Without a base (full
    fine-tuning: nothing is frozen) the trainable params are the whole model and come back as they are."""
    if base is None:
        return adapters
    return {**base, "layers": {**base["layers"], **adapters["layers"]}}


ATTENTION_TARGETS = ("q", "k", "v", "o")


def with_lora(cfg, rank: int, alpha: float, targets: tuple[str, ...]):
    """The model config `cfg` (an `llm.LLMConfig`) with adapters of this spec (rank 0: none). A mixture of
    experts adapts its attention, and the MLPs of a periodic stack's dense layers (`decoder_sparse_step` > 1):
    the experts and the router stay frozen (the MLP targets, in the default list, are dropped when no layer is
    dense; a list of MLP targets alone is then an error)."""
    if rank and cfg.num_experts and cfg.decoder_sparse_step == 1:
        kept = tuple(t for t in targets if t in ATTENTION_TARGETS)
        if not kept:
            raise ConfigError(f"model.lora.targets={list(targets)}: LoRA on a mixture-of-experts model adapts "
                              f"attention only ({', '.join(ATTENTION_TARGETS)}) when every layer is sparse; its "
                              "experts and router stay frozen")
        targets = kept
    return dataclasses.replace(cfg, lora_rank=rank, lora_alpha=alpha, lora_targets=tuple(targets) if rank else ())


def without_lora(cfg):
    """The same model without adapters (a LoRA run's base, its reference policy, its merged export)."""
    return with_lora(cfg, 0, cfg.lora_alpha, ())


def merge_adapters(params: dict, scale: float) -> dict:
    """The base params with every adapter folded in (W + scale * A B, in W's dtype) and no adapter leaves."""
    adapters, base = split_adapters(params)
    layers = dict(base["layers"])
    for name in adapters["layers"]:
        if not name.endswith("_lora_a"):
            continue
        target = name[: -len("_lora_a")]
        a, b, w = adapters["layers"][name], adapters["layers"][f"{target}_lora_b"], layers[target]
        delta = jnp.matmul(a.astype(jnp.float32).reshape(a.shape[0], -1, a.shape[-1]),
                           b.astype(jnp.float32).reshape(b.shape[0], b.shape[1], -1)).reshape(w.shape)
        layers[target] = (w.astype(jnp.float32) + scale * delta).astype(w.dtype)
    return {**base, "layers": layers}
