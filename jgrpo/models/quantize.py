"""The sampler's copy of the weights: cast to a float dtype, or int8 (weight-only, per output channel).

`sampler.weights_dtype: int8` quantizes every layer projection W [L, *in, *out] (q, k, v, o, gate, up, down)
symmetrically: one float32 scale per output channel, absmax over the input dims / 127, kept as a leaf
`<name>_scale` [L, 1.., *out] beside the int8 values (the input dims kept as 1s, so it shards like W's output
axes). Norms, biases and LoRA adapters stay float, in the compute dtype, and so do the embedding and lm_head
unless `sampler.quantize_embeddings` (then int8 with one scale per vocabulary row, serving the lookup and the
logits, tied or not). A projection then computes (x @ q) * scale (`matmul.dense`), q converted to the compute
dtype inside the matmul: a decode step reads one byte per weight. A LLMConfig with `int8_weights` (and
`int8_embeddings`) declares the scale leaves, so the same model code runs either copy, and the sampler picks that
config from the params it is given; the trainer never sees one (only the sampler's copies are quantized). On a
TPU the scanned decode (the default) reads each layer's int8 slice once, as int8 (docs/configuration.md).

Why not qwix (Google's quantization library): its weight-only rule is the same arithmetic (a bf16 x s8
dot_general, the per-channel scale on the output), but its providers intercept Flax module calls, and our
layers are plain arrays stacked [L, ...] under one `lax.scan`, sliced per layer and sharded by logical-axis
rules; two arrays per projection fit all three with no new pytree type.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jgrpo.models.lora import LORA_TARGETS, inputs_of
from jgrpo.models.param_spec import ParamSpec, ones

PROJECTIONS = LORA_TARGETS  # every layer projection (the experts of a mixture stay out: see `check_int8`)
SCALE = "_scale"
INT8_MAX = 127


def scale_name(projection: str) -> str:
    return projection + SCALE


def is_scale(name: str) -> bool:
    return name.endswith(SCALE)


def quantize_weight(w: jax.Array, contract: int) -> tuple[jax.Array, jax.Array]:
    """W [L, *in, *out] (`contract` input dims after the layer axis) -> (int8 values, float32 scales
    [L, 1.., *out]) with W ~= values * scales. An all-zero channel gets scale 1 (values 0): finite, exact."""
    return quantize_over(w, tuple(range(1, 1 + contract)))


def quantize_over(w: jax.Array, axes: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
    """Symmetric int8 with one scale per index of the axes not in `axes` (absmax over `axes` / 127)."""
    w32 = w.astype(jnp.float32)
    absmax = jnp.max(jnp.abs(w32), axis=axes, keepdims=True)
    scale = jnp.where(absmax > 0, absmax / INT8_MAX, 1.0)
    values = jnp.clip(jnp.round(w32 / scale), -INT8_MAX, INT8_MAX).astype(jnp.int8)
    return values, scale


def dequantize(values: jax.Array, scale: jax.Array) -> jax.Array:
    """The float32 weight an int8 projection stands for (tests, diagnostics)."""
    return values.astype(jnp.float32) * scale


# Per-vocabulary-row scales of int8 embeddings (`sampler.quantize_embeddings`): they serve the lookup and the
# lm_head alike (tied or not). Path -> (the reduced axis, the scale's logical axes).
EMBEDDING_SCALES = {("embed",): (1, ("vocab", None)), ("lm_head",): (0, (None, "vocab"))}


def scale_axes(path: tuple[str, ...], weight_axes: tuple) -> tuple:
    """The logical axes of the scale of the weight at `path` with `weight_axes`: a projection's output axes (its kept
    input dims replicated), an embedding's vocabulary axis."""
    if path in EMBEDDING_SCALES:
        return EMBEDDING_SCALES[path][1]
    n = inputs_of(path[-1])
    return ("layers", *(None,) * n, *weight_axes[1 + n:])


def scale_spec(path: tuple[str, ...], weight: ParamSpec) -> ParamSpec:
    """The declaration of an int8 copy's scale leaf for the weight at `path` declared `weight`: a projection's
    [L, 1.., *out] (one per output channel), an embedding's one per vocabulary row; float32, filled by quantizing."""
    if path in EMBEDDING_SCALES:
        axis = EMBEDDING_SCALES[path][0]
        shape = tuple(1 if i == axis else n for i, n in enumerate(weight.shape))
    else:
        layers, *dims = weight.shape
        n = inputs_of(path[-1])
        shape = (layers, *(1,) * n, *dims[n:])
    return ParamSpec(shape, "float32", scale_axes(path, weight.axes), ones)


def scaled_weights(cfg) -> tuple[tuple[str, ...], ...]:
    """The paths of the weights an int8 copy of `cfg` quantizes (whose scales it declares), if any of the model's."""
    if not cfg.int8_weights:
        return ()
    embeddings = tuple(EMBEDDING_SCALES) if cfg.int8_embeddings else ()
    return (*embeddings, *(("layers", name) for name in PROJECTIONS))


def scale_path(path: tuple[str, ...]) -> tuple[str, ...]:
    """Where the scale of the weight at `path` lives: beside it, `<name>_scale`."""
    return (*path[:-1], scale_name(path[-1]))


def check_int8(cfg) -> None:
    """An int8 copy of a mixture of experts is refused: its grouped expert matmuls take float weights only."""
    if cfg.int8_embeddings and not cfg.int8_weights:
        raise ValueError("int8 embeddings come with int8 weights (the projections quantized too)")
    if cfg.int8_weights and cfg.num_experts:
        raise ValueError("int8 weights on a mixture of experts are not supported: the grouped expert matmuls "
                         "(model.moe_impl) take float weights only")


def with_int8(cfg, embeddings: bool = False):
    """The model config (an `llm.LLMConfig`) whose layers hold int8 projections and their scales (and with
    `embeddings` an int8 embedding and lm_head)."""
    return dataclasses.replace(cfg, int8_weights=True, int8_embeddings=embeddings)


def quantized(params: dict) -> tuple[bool, bool]:
    """(the projections are int8, the embeddings are int8): what kind of copy `params` are."""
    return any(is_scale(name) for name in params.get("layers", {})), scale_name("embed") in params


def is_quantized(params: dict) -> bool:
    return any(quantized(params))


def without_scales(params: dict) -> dict:
    """The params' structure without the scale leaves: what a float model of the same shapes holds."""
    if not is_quantized(params):
        return params
    kept = {k: v for k, v in params.items() if not is_scale(k)}
    return {**kept, "layers": {k: v for k, v in params["layers"].items() if not is_scale(k)}}


def lookup(embed: jax.Array, tokens: jax.Array, compute_dtype, scale: jax.Array | None = None) -> jax.Array:
    """The embedding rows of `tokens` in the compute dtype (int8 rows times their row scale)."""
    rows = jnp.take(embed, tokens, axis=0)
    if scale is not None:
        rows = rows.astype(jnp.float32) * jnp.take(scale, tokens, axis=0)
    return rows.astype(compute_dtype)


def compute_weights(layer: dict[str, jax.Array], compute_dtype) -> dict[str, jax.Array]:
    """One layer's weights as its matmuls take them: floats cast to the compute dtype; int8 values and their
    float32 scales as they are (a cast here would materialise the dequantized weight in every decode step)."""
    cdt = jnp.dtype(compute_dtype)
    return {name: w if w.dtype == jnp.int8 or is_scale(name) else w.astype(cdt) for name, w in layer.items()}


def cast_floating(dtype) -> Callable[[dict], dict]:
    """params -> params with every floating leaf cast to `dtype` (integer leaves kept)."""
    target = jnp.dtype(dtype)
    return lambda params: jax.tree.map(
        lambda x: x.astype(target) if jnp.issubdtype(x.dtype, jnp.floating) else x, params)


def quantize_params(params: dict, compute_dtype, embeddings: bool = False) -> dict:
    """The int8 copy: each projection present (a LoRA base has them, its adapters do not) as values and scales,
    with `embeddings` the embedding and lm_head too (per vocabulary row), every other floating leaf in the
    compute dtype."""
    layers = params.get("layers", {})
    out = cast_floating(compute_dtype)(params)
    for (name,), (axis, _) in EMBEDDING_SCALES.items():
        if embeddings and name in params:
            out[name], out[scale_name(name)] = quantize_over(params[name], (axis,))
    quantized = dict(out.get("layers", {}))
    for name in PROJECTIONS:
        if name in layers:
            quantized[name], quantized[scale_name(name)] = quantize_weight(layers[name], inputs_of(name))
    return {**out, "layers": quantized} if "layers" in params else out


def sampler_copy(weights_dtype: str, compute_dtype, embeddings: bool = False) -> Callable[[dict], dict]:
    """params -> the sampler's copy in `sampler.weights_dtype`: a cast, or `quantize_params` (`embeddings`:
    `sampler.quantize_embeddings`)."""
    if weights_dtype == "int8":
        return lambda params: quantize_params(params, compute_dtype, embeddings)
    return cast_floating(weights_dtype)
