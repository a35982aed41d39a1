"""One-token decode step with per-layer weights and per-layer KV caches: the sampler's inner loop.

`LLM.__call__` runs the layers under one `lax.scan` over stacked [L, ...] weights and a stacked
[L, B, S, KVH, Dh] cache, which keeps compile time flat in depth and is right for prefill and training.
In a decode loop it is slow on CPU: each step, for each layer, XLA copies that layer's weights and its whole
cache slice out of the stacked arrays (a dynamic slice is a copy), then transposes the cache slice to put
the kv heads before the slots for the attention dots; at 64 rows x 320 slots on SmolLM2 that is ~1.4 GB
moved per generated token. Here the weights are split into L separate arrays once per sampler call, the
layer loop is unrolled in Python, and each layer's cache is its own [B, KVH, S, Dh] buffer (heads before
slots), updated in place in the `while_loop` carry: every matmul reads its operands where they lie.

The arithmetic is the same as `LLM.__call__` (`layer_qkv`, `layer_output` are shared; the attention is
the same softmax over the same allowed slots), so the two paths agree to float rounding (tested).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jgrpo.models.llm import KVCache, LLMConfig, layer_output, layer_qkv, rms_norm, rope_cos_sin


class DecodeCache(NamedTuple):
    k: tuple[jax.Array, ...]  # L x [B, KVH, S, Dh]
    v: tuple[jax.Array, ...]  # L x [B, KVH, S, Dh]


def unstack_layers(layers: dict[str, jax.Array]) -> tuple[dict[str, jax.Array], ...]:
    """The stacked {name: [L, ...]} layer weights as L dicts of separate arrays (one copy, outside any loop)."""
    num_layers = next(iter(layers.values())).shape[0]
    return tuple({name: w[i] for name, w in layers.items()} for i in range(num_layers))


def decode_cache_from_prefill(cache: KVCache, repeats: int, extra_slots: int) -> DecodeCache:
    """A prefill cache [L, B, P, KVH, Dh] -> per-layer [B * repeats, KVH, P + extra_slots, Dh] caches.

    Row b's cache is shared by rows b*repeats .. b*repeats + repeats - 1 (the G samples of one prompt);
    the extra slots (zeros) receive the generated tokens.
    """

    def per_layer(stacked):
        heads_major = jnp.swapaxes(stacked, 2, 3)  # [L, B, KVH, P, Dh]
        grown = jnp.pad(jnp.repeat(heads_major, repeats, axis=1), ((0, 0),) * 3 + ((0, extra_slots), (0, 0)))
        return tuple(grown[i] for i in range(grown.shape[0]))

    return DecodeCache(per_layer(cache.k), per_layer(cache.v))


def _attend_one(q: jax.Array, k: jax.Array, v: jax.Array, allowed: jax.Array) -> jax.Array:
    """Grouped-query attention of one new token. q: [B, 1, H, Dh]; k, v: [B, KVH, S, Dh]; allowed: [B, S]."""
    B, _, H, Dh = q.shape
    KVH = k.shape[1]
    q = q.reshape(B, KVH, H // KVH, Dh)
    scores = jnp.einsum("bkgd,bksd->bkgs", q, k, preferred_element_type=jnp.float32) * Dh**-0.5
    scores = jnp.where(allowed[:, None, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("bkgs,bksd->bkgd", probs, v).reshape(B, 1, H, Dh)


def decode_step(
    cfg: LLMConfig,
    params: dict,  # the full params pytree (embed, final_norm, ...); its "layers" entry is not read
    layers: tuple[dict[str, jax.Array], ...],  # from `unstack_layers(params["layers"])`
    tokens: jax.Array,  # [B] int32, the token fed at slot `index`
    positions: jax.Array,  # [B] int32, its rotary position
    kv_mask: jax.Array,  # [B, S] bool, True = a real slot (causality below hides the ones not yet written)
    cache: DecodeCache,
    index: jax.Array,  # [] int32 slot written this step
) -> tuple[jax.Array, DecodeCache]:
    """Feed one token per row: (final hidden state [B, D] after the final norm, the updated cache)."""
    cdt = jnp.dtype(cfg.compute_dtype)
    S = kv_mask.shape[1]
    allowed = kv_mask.astype(bool) & (jnp.arange(S) <= index)[None, :]  # [B, S]
    cos, sin = rope_cos_sin(cfg, positions[:, None])  # [B, 1, Dh/2]
    x = jnp.take(params["embed"], tokens, axis=0).astype(cdt)[:, None, :]  # [B, 1, D]
    ks, vs = list(cache.k), list(cache.v)
    for i, p in enumerate(layers):  # unrolled: each layer reads its own buffers in place
        p = {name: w.astype(cdt) for name, w in p.items()}
        q, k, v = layer_qkv(cfg, p, x, cos, sin)  # q [B, 1, H, Dh]; k, v [B, 1, KVH, Dh]
        start = (0, 0, index, 0)
        ks[i] = jax.lax.dynamic_update_slice(ks[i], jnp.swapaxes(k, 1, 2).astype(ks[i].dtype), start)
        vs[i] = jax.lax.dynamic_update_slice(vs[i], jnp.swapaxes(v, 1, 2).astype(vs[i].dtype), start)
        x = layer_output(cfg, p, x, _attend_one(q, ks[i].astype(cdt), vs[i].astype(cdt), allowed))
    hidden = rms_norm(x[:, 0], params["final_norm"], cfg.rms_norm_eps)
    return hidden, DecodeCache(tuple(ks), tuple(vs))
