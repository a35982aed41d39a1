"""Every parameter of the decoder, declared once: its shape, dtype, logical axes and initializer (a
`param_spec.ParamSpec`). The model creates its parameters from these declarations (`llm.py`), the checkpoint formats
read their shapes (`hf_format.py`, `hf.py`; a GGUF file converts to the HF layout), the sharding rules their
logical axes (`param_logical_axes`, jgrpo.parallel.mesh's rule tables) and the planner its shapes (the model built
without weights, `llm.abstract_model`), so all of them agree by construction.

`WEIGHTS` holds a checkpoint's weights, each with its shape in the config's dimensions (`dimensions`) and the
configs that have it; a config's LoRA adapters (`lora.adapter_specs`) and an int8 copy's scales
(`quantize.scale_spec`) are declared from the weight they belong to. `param_specs(cfg)` is every parameter of a
model of `cfg`, in the order the model creates them (random keys are drawn in that order).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
from jax.sharding import PartitionSpec

from jgrpo.models.architecture import LLMConfig
from jgrpo.models.layer_stack import moe_layer_count, stack_length
from jgrpo.models.lora import LORA_TARGETS, adapter_axes, adapter_specs
from jgrpo.models.param_spec import Initializer, ParamSpec, normal, ones, zeros
from jgrpo.models.quantize import EMBEDDING_SCALES, PROJECTIONS, scale_axes, scale_path, scale_spec, scaled_weights


class Weight(NamedTuple):
    """A checkpoint weight's declaration: `dims` name its sizes (`dimensions`), one per logical axis in `axes`."""

    dims: tuple[str, ...]
    axes: tuple[str, ...]
    init: Initializer
    present: Callable[[LLMConfig], bool] = lambda cfg: True  # the configs that have the weight: all by default


def _untied(cfg):
    return not cfg.tie_word_embeddings


def _qkv_bias(cfg):
    return cfg.qkv_bias


def _o_bias(cfg):
    return cfg.o_bias


def _qk_norm(cfg):
    return cfg.qk_norm


def _experts(cfg):
    return bool(cfg.num_experts)


def _dense_mlp(cfg):  # every layer of a dense model, the dense layers of a periodic mixture-of-experts stack
    return stack_length(cfg, "gate") > 0


# Path in the params pytree -> its declaration. Layers are stacked along a leading "layers" axis: L for every layer,
# Ld for the dense MLPs, Lm for the mixture-of-experts layers (models/layer_stack.py).
WEIGHTS: dict[tuple[str, ...], Weight] = {
    ("embed",): Weight(("V", "D"), ("vocab", "embed"), normal),
    ("final_norm",): Weight(("D",), ("norm",), ones),
    ("layers", "attn_norm"): Weight(("L", "D"), ("layers", "norm"), ones),
    ("layers", "q"): Weight(("L", "D", "H", "Dh"), ("layers", "embed", "heads", "head_dim"), normal),
    ("layers", "k"): Weight(("L", "D", "KVH", "Dh"), ("layers", "embed", "kv_heads", "head_dim"), normal),
    ("layers", "v"): Weight(("L", "D", "KVH", "Dh"), ("layers", "embed", "kv_heads", "head_dim"), normal),
    ("layers", "o"): Weight(("L", "H", "Dh", "D"), ("layers", "heads", "head_dim", "embed"), normal),
    ("layers", "mlp_norm"): Weight(("L", "D"), ("layers", "norm"), ones),
    ("layers", "router"): Weight(("Lm", "D", "E"), ("layers", "embed", "router_logits"), normal, _experts),
    ("layers", "experts_gate"): Weight(("Lm", "E", "D", "Fe"), ("layers", "experts", "embed", "expert_mlp"), normal,
                                       _experts),
    ("layers", "experts_up"): Weight(("Lm", "E", "D", "Fe"), ("layers", "experts", "embed", "expert_mlp"), normal,
                                     _experts),
    ("layers", "experts_down"): Weight(("Lm", "E", "Fe", "D"), ("layers", "experts", "expert_mlp", "embed"), normal,
                                       _experts),
    ("layers", "gate"): Weight(("Ld", "D", "F"), ("layers", "embed", "mlp"), normal, _dense_mlp),
    ("layers", "up"): Weight(("Ld", "D", "F"), ("layers", "embed", "mlp"), normal, _dense_mlp),
    ("layers", "down"): Weight(("Ld", "F", "D"), ("layers", "mlp", "embed"), normal, _dense_mlp),
    ("lm_head",): Weight(("D", "V"), ("embed", "vocab"), normal, _untied),
    ("layers", "q_bias"): Weight(("L", "H", "Dh"), ("layers", "heads", "head_dim"), zeros, _qkv_bias),
    ("layers", "k_bias"): Weight(("L", "KVH", "Dh"), ("layers", "kv_heads", "head_dim"), zeros, _qkv_bias),
    ("layers", "v_bias"): Weight(("L", "KVH", "Dh"), ("layers", "kv_heads", "head_dim"), zeros, _qkv_bias),
    ("layers", "o_bias"): Weight(("L", "D"), ("layers", "norm"), zeros, _o_bias),
    ("layers", "q_norm"): Weight(("L", "Dh"), ("layers", "norm"), ones, _qk_norm),
    ("layers", "k_norm"): Weight(("L", "Dh"), ("layers", "norm"), ones, _qk_norm),
}


def dimensions(cfg: LLMConfig) -> dict[str, int]:
    """The sizes `WEIGHTS` declares shapes in."""
    return {"V": cfg.vocab_size, "D": cfg.hidden_size, "F": cfg.intermediate_size, "H": cfg.num_heads,
            "KVH": cfg.num_kv_heads, "Dh": cfg.head_dim, "E": cfg.num_experts, "Fe": cfg.moe_intermediate_size,
            "L": cfg.num_layers, "Lm": moe_layer_count(cfg), "Ld": stack_length(cfg, "gate")}


def weight_specs(cfg: LLMConfig) -> dict[tuple[str, ...], ParamSpec]:
    """The weights of a model of `cfg` (what its HF checkpoint holds), in the config's param dtype."""
    sizes = dimensions(cfg)
    return {path: ParamSpec(tuple(sizes[d] for d in w.dims), cfg.param_dtype, w.axes, w.init)
            for path, w in WEIGHTS.items() if w.present(cfg)}


def param_specs(cfg: LLMConfig) -> dict[tuple[str, ...], ParamSpec]:
    """Every parameter of a model of `cfg`: its weights, any LoRA adapters and, for an int8 copy, the scales."""
    weights = weight_specs(cfg)
    adapters = {("layers", name): spec for target in cfg.lora_targets
                for name, spec in adapter_specs(target, weights[("layers", target)], cfg.lora_rank).items()}
    scales = {scale_path(path): scale_spec(path, weights[path]) for path in scaled_weights(cfg) if path in weights}
    return weights | adapters | scales


def _every_declared_axes() -> dict[tuple[str, ...], tuple]:
    """The logical axes of every parameter any config declares: the weights', every target's adapters', the scales'."""
    axes = {path: w.axes for path, w in WEIGHTS.items()}
    for target in LORA_TARGETS:
        a, b = adapter_axes(target, axes[("layers", target)])
        axes |= {("layers", f"{target}_lora_a"): a, ("layers", f"{target}_lora_b"): b}
    for path in (*EMBEDDING_SCALES, *(("layers", name) for name in PROJECTIONS)):
        axes[scale_path(path)] = scale_axes(path, axes[path])
    return axes


# Path -> logical axis names, one per dimension, of every parameter a model can have (see `param_logical_axes`).
LOGICAL_AXES: dict[tuple[str, ...], tuple] = _every_declared_axes()


def param_logical_axes(params) -> dict:
    """Same-structure pytree of PartitionSpecs of logical axis names (for jgrpo.parallel.mesh.place)."""

    def spec(path, leaf):
        keys = tuple(str(getattr(k, "key", getattr(k, "name", k))) for k in path)
        if keys not in LOGICAL_AXES:
            raise KeyError(f"parameter {'/'.join(keys)} is not a known LLM parameter")
        axes = LOGICAL_AXES[keys]
        if len(axes) != len(leaf.shape):
            raise ValueError(f"parameter {'/'.join(keys)} has shape {leaf.shape} but logical axes {axes}")
        return PartitionSpec(*axes)

    return jax.tree_util.tree_map_with_path(spec, params)
