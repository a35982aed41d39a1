"""Which decoder layers hold which weights, and the one scan that runs them.

Every weight of the decoder is stacked along a leading axis over the layers that have it. In a dense model, and
in a mixture of experts whose every layer is sparse, that is all L layers. Qwen3-MoE's `decoder_sparse_step`
s > 1 makes a periodic stack instead: s - 1 dense layers, then a mixture of experts, repeated (transformers: layer
i is sparse when (i + 1) % s == 0). Then the attention weights stack L layers, the dense MLP's (gate, up, down)
L (s - 1) / s, the router's and the experts' L / s.

`scan_layers` runs a one-layer body under one `lax.scan` over super-layers of s layers, unrolled inside: the
program holds s layers whatever the depth (compile time flat in depth, as with s = 1), and each scan step
returns what its one MoE layer returned, so routing records stack [L / s, ...] in layer order. With s = 1 it is
exactly the scan over layers that the dense models have always run (the same program).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

MOE_WEIGHTS = ("router", "experts_gate", "experts_up", "experts_down")
DENSE_MLP_WEIGHTS = ("gate", "up", "down")
_SUFFIXES = ("_lora_a", "_lora_b", "_scale")  # an adapter or an int8 scale stacks like its weight


def sparse_step(cfg) -> int:
    """s: one layer in s is a mixture of experts, the last of each run of s (1 for a dense model)."""
    return cfg.decoder_sparse_step if cfg.num_experts else 1


def is_moe_layer(cfg, layer: int) -> bool:
    return bool(cfg.num_experts) and (layer + 1) % cfg.decoder_sparse_step == 0


def moe_layer_count(cfg) -> int:
    """How many layers are a mixture of experts (the routing record's layer axis); 0 for a dense model."""
    return cfg.num_layers // cfg.decoder_sparse_step if cfg.num_experts else 0


def _family(name: str) -> str:
    """"moe", "dense_mlp" or "every": which layers a weight (or its adapter, its int8 scale) is stacked over."""
    for suffix in _SUFFIXES:
        name = name.removesuffix(suffix)
    if name in MOE_WEIGHTS:
        return "moe"
    return "dense_mlp" if name in DENSE_MLP_WEIGHTS else "every"


def stacked_layers(cfg, name: str) -> list[int]:
    """The layers whose weights the stack `name` holds, in stack order (what HF's `model.layers.{i}` names)."""
    family = _family(name)
    if family == "every":
        return list(range(cfg.num_layers))
    return [i for i in range(cfg.num_layers) if is_moe_layer(cfg, i) == (family == "moe")]


def stack_length(cfg, name: str) -> int:
    """The leading axis of the stack `name`: L, L - L / s (dense MLP) or L / s (mixture of experts)."""
    family, moe = _family(name), moe_layer_count(cfg)
    return {"every": cfg.num_layers, "moe": moe, "dense_mlp": cfg.num_layers - moe}[family]


def _stack_index(cfg, name: str, layer: int) -> int | None:
    """Where layer `layer` sits in the stack `name`, or None when the layer has no such weight."""
    family = _family(name)
    if family == "every":
        return layer
    if is_moe_layer(cfg, layer) != (family == "moe"):
        return None
    before = (layer + 1) // cfg.decoder_sparse_step if cfg.num_experts else 0  # MoE layers up to this one
    return before - 1 if family == "moe" else layer - before


def layer_weights(cfg, layers: dict[str, jax.Array], layer: int) -> dict[str, jax.Array]:
    """One layer's weights {name: array} out of the stacks (a static index: one slice each)."""
    picked = {name: _stack_index(cfg, name, layer) for name in layers}
    return {name: layers[name][i] for name, i in picked.items() if i is not None}


def unstack_layers(cfg, layers: dict[str, jax.Array]) -> tuple[dict[str, jax.Array], ...]:
    """The stacks as L per-layer dicts of separate arrays (one copy, outside any loop)."""
    return tuple(layer_weights(cfg, layers, i) for i in range(cfg.num_layers))


def with_remat(fn, policy: str):
    """`fn` (a layer body) under the model's remat policy: what its backward pass recomputes."""
    if policy == "full":
        return jax.checkpoint(fn)
    if policy == "dots":  # keep weight matmul outputs, recompute the cheap elementwise work
        return jax.checkpoint(fn, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
    return fn


def scan_layers(cfg, body, carry, layers: dict[str, jax.Array], moe_xs=None, remat: str = "none"):
    """Run every layer in order: `body(carry, weights, layer, moe_x) -> (carry, out)` with one layer's weights,
    its index (traced) and, for a MoE layer, its slice of `moe_xs` (a pytree stacked over the MoE layers, e.g.
    replayed experts; None elsewhere). Returns (the final carry, the MoE layers' outs stacked [L / s, ...]; for a
    dense model each layer's out stacked [L, ...])."""
    s = sparse_step(cfg)
    groups = cfg.num_layers // s
    if s == 1:
        return jax.lax.scan(with_remat(lambda c, xs: body(c, *xs), remat), carry,
                            (layers, jnp.arange(groups), moe_xs))
    # [n, ...] -> [groups, n / groups, ...]: the stack's slots within each super-layer.
    grouped = {name: w.reshape(groups, w.shape[0] // groups, *w.shape[1:]) for name, w in layers.items()}

    def super_layer(carry, xs):
        stacks, group, moe_x = xs
        out = None
        for i in range(s):  # unrolled: s - 1 dense layers, then the MoE one
            weights = layer_weights(cfg, stacks, i)  # layer i of the first super-layer's slots = slot in this one
            carry, out = body(carry, weights, group * s + i, moe_x if i == s - 1 else None)
        return carry, out

    return jax.lax.scan(with_remat(super_layer, remat), carry, (grouped, jnp.arange(groups), moe_xs))
