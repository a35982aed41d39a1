"""Decoder-only transformer in Flax NNX: Llama (incl. Llama 3 rope scaling, SmolLM2), Qwen2/2.5, Qwen3.

The three families differ only by config flags: q/k/v (and o) biases, per-head q/k RMSNorm, and a
head_dim that need not equal hidden / heads. Every parameter is declared once, with its shape, dtype, logical axes
and initializer (`parameters.py`; the config, `LLMConfig`, in `architecture.py`): the model creates its parameters
from those declarations, so creation, sharding and checkpoint layout agree by construction. Layers are stacked
along a leading "layers" axis and run under one `lax.scan`, so compile time does not grow with depth.

Padding is never inferred from token ids: callers pass `kv_mask` (True = real token) and explicit
positions (`position_ids_from_mask`), because e.g. SmolLM2's pad id is its end-of-turn id and
occurs inside every chat prompt.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jgrpo.models import kv_quant
from jgrpo.models.architecture import (  # noqa: F401 - re-exported: callers import the model's config from here
    DTYPES,
    REMAT_POLICIES,
    SUPPORTED_ARCHITECTURES,
    SUPPORTED_ROPE_TYPES,
    LLMConfig,
    ModelOptions,
)
from jgrpo.models.attention_backends import causal_attention, dense_attention, slot_mask
from jgrpo.models.kv_quant import Int8KV
from jgrpo.models.layer_stack import scan_layers
from jgrpo.models.lora import inputs_of, low_rank
from jgrpo.models.matmul import dense
from jgrpo.models.moe import moe_mlp
from jgrpo.models.param_spec import ParamSpec
from jgrpo.models.parameters import param_logical_axes, param_specs  # noqa: F401 - param_logical_axes re-exported
from jgrpo.models.quantize import compute_weights, lookup, scale_name
from jgrpo.models.rope import apply_rope, rope_cos_sin


class KVCache(NamedTuple):
    k: jax.Array | Int8KV  # [L, B, S, KVH, Dh] (int8: values and per-token scales, models/kv_quant.py)
    v: jax.Array | Int8KV  # [L, B, S, KVH, Dh]


def init_cache(cfg: LLMConfig, batch: int, max_len: int, dtype=None) -> KVCache:
    """An empty cache in `dtype` (default the compute dtype; "int8": `kv_quant.Int8KV`)."""
    shape = (cfg.num_layers, batch, max_len, cfg.num_kv_heads, cfg.head_dim)
    dtype = jnp.dtype(dtype or cfg.compute_dtype).name
    return KVCache(kv_quant.zeros(shape, dtype), kv_quant.zeros(shape, dtype))


def position_ids_from_mask(kv_mask: jax.Array) -> jax.Array:
    """Positions of a left-padded batch: real tokens count 0, 1, 2, ...; padding gets 0. [B, T] int32."""
    return jnp.maximum(jnp.cumsum(kv_mask.astype(jnp.int32), axis=-1) - 1, 0)




def _new_param(spec: ParamSpec, rngs: nnx.Rngs) -> nnx.Param:
    """A parameter as declared (`parameters.py`), its random keys drawn from the model's `params` stream."""
    # eager_sharding=False: placement happens later with a rules table (training and sampling differ).
    return nnx.Param(spec.initial_value(rngs.params), out_sharding=spec.axes, eager_sharding=False)


class DecoderLayers(nnx.Module):
    """All decoder layers' weights, stacked along a leading [L] axis."""

    def __init__(self, specs: dict[tuple[str, ...], ParamSpec], *, rngs: nnx.Rngs):
        for path, spec in specs.items():
            if path[0] == "layers":
                setattr(self, path[1], _new_param(spec, rngs))

    def arrays(self) -> dict[str, jax.Array]:
        return {name: value[...] for name, value in vars(self).items() if isinstance(value, nnx.Param)}


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    # Statistics in float32 whatever the compute dtype, as the HF reference does.
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight.astype(x.dtype) * normed.astype(x.dtype)


def project(cfg: LLMConfig, p: dict, name: str, x: jax.Array) -> jax.Array:
    """x times the layer's weight `name` (int8 ones with their scales), plus its LoRA term when the layer has an
    adapter there."""
    contract = inputs_of(name)
    y = dense(x, p[name], contract, p.get(scale_name(name)))
    if f"{name}_lora_a" in p:
        y = y + low_rank(x, p[f"{name}_lora_a"], p[f"{name}_lora_b"], contract, cfg.lora_scale)
    return y


def layer_qkv(cfg: LLMConfig, p: dict, x: jax.Array, cos, sin):
    """A layer's queries [B, T, H, Dh] and keys, values [B, T, KVH, Dh] (biases, qk-norm, RoPE applied)."""
    with jax.named_scope("attention"):
        h = rms_norm(x, p["attn_norm"], cfg.rms_norm_eps)
        q, k, v = project(cfg, p, "q", h), project(cfg, p, "k", h), project(cfg, p, "v", h)  # [B, T, H|KVH, Dh]
        if cfg.qkv_bias:
            q, k, v = q + p["q_bias"], k + p["k_bias"], v + p["v_bias"]
        if cfg.qk_norm:
            q = rms_norm(q, p["q_norm"], cfg.rms_norm_eps)
            k = rms_norm(k, p["k_norm"], cfg.rms_norm_eps)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def layer_output(cfg: LLMConfig, p: dict, x: jax.Array, attended: jax.Array, routing: jax.Array | None = None,
                 token_mask: jax.Array | None = None):
    """(the residual stream after a layer, its router's experts [B, T, k] and `moe.RouterStats` over the tokens of
    `token_mask` [B, T] (None and None for a dense MLP)), given the attention output [B, T, H, Dh]: o-projection,
    then the MLP. `routing` [B, T, k]: a mixture of experts replays these."""
    with jax.named_scope("attention"):
        x = x + project(cfg, p, "o", attended)
        if cfg.o_bias:
            x = x + p["o_bias"]
    with jax.named_scope("mlp"):
        h = rms_norm(x, p["mlp_norm"], cfg.rms_norm_eps)
        if "router" in p:  # this layer is a mixture of experts
            out, ids, stats = moe_mlp(h, p, k=cfg.experts_per_token, norm_topk_prob=cfg.norm_topk_prob,
                                      impl=cfg.moe_impl, ids=routing, token_mask=token_mask,
                                      dispatch=cfg.moe_dispatch)
            return x + out, ids, stats
        mlp = project(cfg, p, "down", jax.nn.silu(project(cfg, p, "gate", h)) * project(cfg, p, "up", h))
        return x + mlp, None, None


def vocab_logits(hidden: jax.Array, unembedding: jax.Array, compute_dtype, scale: jax.Array | None = None) -> jax.Array:
    """[..., D] hidden states x [D, V] unembedding -> [..., V] float32 logits: THE vocabulary projection.

    Both operands in the compute dtype, accumulated in float32. The sampler (`LLM.logits`) and the trainer
    (`logprobs.token_logprobs`) both call this one function, so with bfloat16 compute they round the same
    operands the same way: a sampler/trainer difference here would be multiplied by 1/temperature in every
    log-prob. One 2-D matmul: XLA:CPU runs it faster than the batched einsum. `scale` [1, V]: an int8 unembedding's
    (models/quantize.py), applied to the float32 logits.
    """
    cdt = jnp.dtype(compute_dtype)
    dim = hidden.shape[-1]
    logits = jnp.matmul(hidden.reshape(-1, dim).astype(cdt), unembedding.astype(cdt),
                        preferred_element_type=jnp.float32)
    if scale is not None:
        logits = logits * scale
    return logits.reshape(hidden.shape[:-1] + (unembedding.shape[-1],))


class LLM(nnx.Module):
    def __init__(self, cfg: LLMConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        specs = param_specs(cfg)
        self.embed = _new_param(specs[("embed",)], rngs)
        self.layers = DecoderLayers(specs, rngs=rngs)
        # The rest of the model's own parameters: the final norm, an untied lm_head, an int8 copy's embedding scales.
        for path, spec in specs.items():
            if path[0] not in ("embed", "layers"):
                setattr(self, path[0], _new_param(spec, rngs))

    def unembedding(self) -> jax.Array:
        """[D, V] matrix mapping final hidden states to logits."""
        return self.embed[...].T if self.cfg.tie_word_embeddings else self.lm_head[...]

    def unembedding_scale(self) -> jax.Array | None:
        """[1, V] scales of an int8 unembedding, else None."""
        if not self.cfg.int8_embeddings:
            return None
        return self.embed_scale[...].T if self.cfg.tie_word_embeddings else self.lm_head_scale[...]

    def embedded(self, tokens: jax.Array) -> jax.Array:
        """The tokens' embeddings [..., D] in the compute dtype."""
        scale = self.embed_scale[...] if self.cfg.int8_embeddings else None
        return lookup(self.embed[...], tokens, jnp.dtype(self.cfg.compute_dtype), scale)

    def logits(self, hidden: jax.Array) -> jax.Array:
        """[..., D] final hidden states -> [..., V] float32 logits (the sampler's path; see `vocab_logits`)."""
        return vocab_logits(hidden, self.unembedding(), self.cfg.compute_dtype, self.unembedding_scale())

    def __call__(
        self,
        tokens: jax.Array,  # [B, T] int32
        positions: jax.Array,  # [B, T] int32
        kv_mask: jax.Array,  # [B, S] bool; S == T without a cache, the cache length with one
        cache: KVCache | None = None,
        cache_index: jax.Array | int | None = None,
        routing: jax.Array | None = None,  # [B, T, L, k] int: a mixture of experts replays these experts
    ) -> tuple[jax.Array, KVCache | None]:
        """(final hidden states [B, T, D] after the final norm, the updated cache or None)."""
        hidden, cache, _ = self.routed(tokens, positions, kv_mask, cache, cache_index, routing)
        return hidden, cache

    def routed(self, tokens, positions, kv_mask, cache=None, cache_index=None, routing=None, router_stats=False):
        """`__call__` that also returns the experts the router picks for each token, [B, T, L, k] int32 (its top k,
        also where `routing` replayed others: the difference is the replay's work), or None for a dense model.
        `router_stats`: a fourth value, each layer's `moe.RouterStats` ([L, ...]) over the real tokens (without a
        cache; with one, over every token), for the router losses."""
        cfg = self.cfg
        cdt = jnp.dtype(cfg.compute_dtype)
        B, T = tokens.shape
        if cache is None:
            if kv_mask.shape != (B, T):
                raise ValueError(f"without a cache kv_mask must be [B, T] = {(B, T)}, got {kv_mask.shape}")
            query_slots = jnp.arange(T)
        else:
            if cache_index is None:
                raise ValueError("cache_index is required with a cache")
            if kv_mask.shape != cache.k.shape[1:3]:
                raise ValueError(f"with a cache kv_mask must be [B, S] = {cache.k.shape[1:3]}, got {kv_mask.shape}")
            query_slots = cache_index + jnp.arange(T)
        S = kv_mask.shape[1]
        # Causal over slots and restricted to real tokens. Without a cache (and for a prefill from slot 0) the
        # queries are the last T of the S slots: the mask every attention implementation takes.
        causal = cache is None or (isinstance(cache_index, int) and cache_index == 0 and S == T)

        def attend(q, k, v):
            if causal:
                return causal_attention(cfg.attention, q, k, v, kv_mask.astype(bool))
            return dense_attention(cfg.attention, q, k, v, slot_mask(query_slots, kv_mask))

        cos, sin = rope_cos_sin(cfg, positions)
        x = self.embedded(tokens)  # [B, T, D]

        def layer(carry, p, index, replay):
            x, cache = carry
            p = compute_weights(p, cdt)
            q, k, v = layer_qkv(cfg, p, x, cos, sin)
            if cache is not None:
                # Written in place into the carried [L, B, S, KVH, Dh] buffers: no per-step cache copy. An int8
                # cache is written quantized and attended dequantized.
                start = (index, 0, cache_index, 0, 0)
                cache = KVCache(*(kv_quant.per_part(lambda c, n: jax.lax.dynamic_update_slice(c, n[None], start),
                                                    c, kv_quant.store(new, c))
                                  for c, new in ((cache.k, k), (cache.v, v))))
                k, v = (kv_quant.load(kv_quant.per_part(lambda c: c[index], c), cdt) for c in cache)  # [B, S, KVH, Dh]
            x, ids, stats = layer_output(cfg, p, x, attend(q, k, v), replay, kv_mask if cache is None else None)
            return (x, cache), (ids, stats)

        replay = None if routing is None else jnp.moveaxis(routing, 2, 0)  # per MoE layer, [L, B, T, k]
        (x, cache), (ids, stats) = scan_layers(cfg, layer, (x, cache), self.layers.arrays(), replay, cfg.remat)
        ids = None if ids is None else jnp.moveaxis(ids, 0, 2)  # [B, T, L, k]
        hidden = rms_norm(x, self.final_norm[...], cfg.rms_norm_eps)
        return (hidden, cache, ids, stats) if router_stats else (hidden, cache, ids)


def split_model(model: LLM) -> tuple[nnx.GraphDef, dict]:
    """(graphdef, params) with params a plain nested dict of arrays (optax/orbax/mesh friendly)."""
    graphdef, state = nnx.split(model)
    return graphdef, nnx.to_pure_dict(state)


def merge_model(graphdef: nnx.GraphDef, params: dict) -> LLM:
    return nnx.merge(graphdef, params)


def model_config(graphdef: nnx.GraphDef, params: dict) -> LLMConfig:
    """The model's config, from a model built of shapes only. Merging concrete params outside jit leaves
    reference cycles that hold every param array until Python's next full collection (flax 0.12's recursive
    flatten), so a caller's freed param copy would stay in memory."""
    return merge_model(graphdef, jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)).cfg


def forward(graphdef, params, tokens, positions, kv_mask, cache=None, cache_index=None, routing=None):
    """Pure form of `LLM.__call__` for use inside jit."""
    return merge_model(graphdef, params)(tokens, positions, kv_mask, cache, cache_index, routing)


def abstract_model(cfg: LLMConfig) -> tuple[nnx.GraphDef, dict]:
    """(graphdef, params of jax.ShapeDtypeStruct) without allocating any weights."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: LLM(cfg, rngs=nnx.Rngs(0))))
    return graphdef, nnx.to_pure_dict(state)
