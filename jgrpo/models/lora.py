"""LoRA adapters on the decoder's projections: their declarations, the low-rank term, merging.

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
from jgrpo.models.param_spec import ParamSpec

# Every projection an adapter can target, and how many of its weight's dims (after the leading "layers" axis) are
# its input: 2 for o ([H, Dh] -> D), 1 for the others; the rest are its output.
INPUT_DIMS = {"q": 1, "k": 1, "v": 1, "o": 2, "gate": 1, "up": 1, "down": 1}
LORA_TARGETS = tuple(INPUT_DIMS)
SUFFIXES = ("_lora_a", "_lora_b")


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
    return INPUT_DIMS[target]


def adapter_axes(target: str, weight_axes: tuple) -> tuple[tuple, tuple]:
    """The logical axes of the adapters A, B on a weight with `weight_axes` (["layers", *in, *out]): A shards like its
    input axes, B like its output axes, the rank axis replicated."""
    n = inputs_of(target)
    return ("layers", *weight_axes[1:1 + n], "lora_rank"), ("layers", "lora_rank", *weight_axes[1 + n:])


def adapter_specs(target: str, weight: ParamSpec, rank: int) -> dict[str, ParamSpec]:
    """The declarations of the rank-`rank` adapters `<target>_lora_a`, `<target>_lora_b` on the stacked weight
    declared `weight` [L, *in, *out]: A [L, *in, r], B [L, r, *out], float32 master weights whatever the base."""
    layers, *dims = weight.shape
    n = inputs_of(target)
    a_axes, b_axes = adapter_axes(target, weight.axes)
    return {f"{target}_lora_a": ParamSpec((layers, *dims[:n], rank), "float32", a_axes, _init_a),
            f"{target}_lora_b": ParamSpec((layers, rank, *dims[n:]), "float32", b_axes, _init_b)}


def _init_a(draw, shape, dtype) -> jax.Array:
    """PEFT's kaiming-uniform: bound 1 / sqrt(fan_in), fan_in the input dims between "layers" and the rank."""
    bound = 1.0 / math.sqrt(math.prod(shape[1:-1]))
    return jax.random.uniform(draw(), shape, jnp.float32, -bound, bound).astype(dtype)


def _init_b(draw, shape, dtype) -> jax.Array:
    """Zero, so a fresh adapter leaves the model unchanged. It still draws its key: each adapter has one (as
    `hf.new_adapters` splits them), so the parameters declared after it keep theirs."""
    draw()
    return jnp.zeros(shape, dtype)


def is_adapter(name: str) -> bool:
    return name.endswith(SUFFIXES)


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
