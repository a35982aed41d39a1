"""One-token decode step with per-layer weights and per-layer KV caches: the sampler's inner loop.

`LLM.__call__` runs the layers under one `lax.scan` over stacked [L, ...] weights and a stacked
[L, B, S, KVH, Dh] cache, which keeps compile time flat in depth and is right for prefill and training.
In a decode loop it is slow on CPU: each step, for each layer, XLA copies that layer's weights and its whole
cache slice out of the stacked arrays (a dynamic slice is a copy), then transposes the cache slice to put
the kv heads before the slots for the attention dots; at 64 rows x 320 slots on SmolLM2 that is ~1.4 GB
moved per generated token. Here the weights are split into L separate arrays once per sampler call, the
layer loop is unrolled in Python, and each layer's cache is separate buffers with the kv heads before the
slots ([B, KVH, S, Dh]), updated in place in the `while_loop` carry: every matmul reads its operands where
they lie. The cache is split into segments (the prompt, then chunks of generated slots) so that a step
reads only the segments filled so far.

`sampler.decode_layers` chooses between this and `decode_step_scanned` (one `lax.scan` over the stacked
weights and a stacked cache), which a TPU compiles faster and reads in place (docs/configuration.md).

The arithmetic is the same as `LLM.__call__` (`layer_qkv`, `layer_output` are shared; the attention is
the same softmax over the same allowed slots), so the two paths agree to float rounding (tested).
"""

from __future__ import annotations

import functools
import itertools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jgrpo.models import kv_quant
from jgrpo.models.layer_stack import scan_layers
from jgrpo.models.llm import KVCache, LLMConfig, layer_output, layer_qkv, rms_norm
from jgrpo.models.quantize import compute_weights, lookup
from jgrpo.models.rope import rope_cos_sin
from jgrpo.parallel.platform_defaults import resolve

DECODE_LAYERS = ("unrolled", "scanned")
# What `sampler.decode_layers: auto` picks by platform (reasons: docs/configuration.md).
# GPU: unrolled measured 1.59x scanned on an H100 (Qwen2.5-0.5B shapes, 256 rows x 200 tokens, bf16;
# benchmarks/accelerator.py, docs/configuration.md).
DECODE_LAYERS_AUTO = {"cpu": "unrolled", "tpu": "scanned", "gpu": "unrolled", "other": "scanned"}
# Int8 weights or an int8 cache change nothing here: on a TPU the scanned decode reads each layer's s8 slice once (XLA
# re-tiles it inside the matmul's fusion, which computes only the slice), and keeps a small cache on chip. Qwen2.5-0.5B,
# v5e:2x4, int8 weights: 0.679 GB a step scanned against 0.726 unrolled; DeepScaleR 1.5B, int8 weights + cache: 3.96
# GB against 3.99 GB, 3.7 GiB of temporaries against 5.6 (docs/configuration.md).

DECODE_SOFTMAX = ("whole", "segments")
# What `sampler.decode_softmax: auto` picks by platform. TPU: an unrolled decode with one softmax over all slots
# writes each layer's [rows, heads, slots] f32 scores to HBM and reads them back; per segment they stay on chip.
# DeepScaleR 1.5B, v5e:2x4, last step: int8 weights + int8 cache 4.43 -> 3.99 GB, bf16 unrolled 7.88 -> 7.35 GB,
# bf16 scanned 7.32 GB either way (docs/configuration.md). CPU, GPU: not measured to gain, the old form kept (the
# samples move by float rounding between the two).
DECODE_SOFTMAX_AUTO = {"cpu": "whole", "tpu": "segments", "gpu": "whole", "other": "whole"}


def resolve_decode_softmax(choice: str, platform: str) -> str:
    """`sampler.decode_softmax` ("auto", "whole" or "segments") on devices of `platform`."""
    return resolve("sampler.decode_softmax", choice, DECODE_SOFTMAX, DECODE_SOFTMAX_AUTO, platform)


def resolve_decode_layers(choice: str, platform: str) -> str:
    """`sampler.decode_layers` ("auto", "unrolled" or "scanned") on devices of `platform`."""
    return resolve("sampler.decode_layers", choice, DECODE_LAYERS, DECODE_LAYERS_AUTO, platform)


class DecodeCache(NamedTuple):
    """Per layer, the cache as segments: the prompt's slots [B, KVH, P, Dh], then generated chunks [B, KVH, C, Dh].

    Separate buffers let a decode step attend to the segments filled so far only (see `decode_step`),
    instead of reading every slot of a full-length cache at every step.
    """

    k: tuple[tuple[jax.Array, ...], ...]  # L x (prompt, chunk 0, chunk 1, ...)
    v: tuple[tuple[jax.Array, ...], ...]


def prompt_store(cache: KVCache) -> KVCache:
    """A prefill cache [L, B, P, KVH, Dh] with the kv heads before the slots, [L, B, KVH, P, Dh]: the layout the
    decode cache's prompt segments are copied from (once per slot that takes the prompt)."""
    return kv_quant.per_part(lambda c: KVCache(jnp.swapaxes(c.k, 2, 3), jnp.swapaxes(c.v, 2, 3)), cache)


def decode_cache(prompts: KVCache, chunks: int, chunk_len: int, stacked: bool = False) -> DecodeCache:
    """A DecodeCache whose prompt segments are `prompts` ([L, S, KVH, P, Dh], one prompt per slot, e.g. from
    `prompt_store` gathered per slot) followed by `chunks` empty chunks of `chunk_len` slots, in the prompts'
    dtype (an int8 cache: `kv_quant.Int8KV` values and scales alike).

    `stacked` (for `decode_step_scanned`): one entry whose segments keep the layer axis, [L, S, KVH, S_i, Dh].
    """

    def segments(prompt):
        shape = prompt.shape[:-2] + (chunk_len, prompt.shape[-1])
        if stacked:
            return ((prompt,) + (jnp.zeros(shape, prompt.dtype),) * chunks,)
        empty = jnp.zeros(shape[1:], prompt.dtype)
        return tuple((prompt[i],) + (empty,) * chunks for i in range(prompt.shape[0]))

    return kv_quant.per_part(lambda p: DecodeCache(segments(p.k), segments(p.v)), prompts)


def _attend_one(q: jax.Array, ks: tuple, vs: tuple, allowed: jax.Array, merged: bool = False) -> jax.Array:
    """Grouped-query attention of one new token over cache segments.

    q: [B, 1, H, Dh]; ks, vs: segments [B, KVH, S_i, Dh] in the compute dtype, or `kv_quant.Int8KV`s; allowed:
    [B, sum S_i] bool. Equals attention over the segments' concatenation (without building it). Int8 segments
    are read as int8: a key's scale multiplies its scores, a value's its probabilities, so the dots take the int8
    values (converted inside the dot) and nothing dequantized is built.

    `merged` (`sampler.decode_softmax: segments`): each segment's softmax alone, merged by log-sum-exp
    (flash-decoding's rule), so no array spans all the slots; else one softmax over the concatenated scores.
    """
    B, _, H, Dh = q.shape
    KVH = ks[0].shape[1]
    cdt = q.dtype
    q = q.reshape(B, KVH, H // KVH, Dh)

    def operand(c):  # (the dot's operand, its per-slot scales [B, KVH, 1, S_i] or None)
        if kv_quant.is_int8(c):
            return c.values.astype(cdt), jnp.swapaxes(c.scales, 2, 3)
        return c, None

    def scores_of(k):
        k, scale = operand(k)
        s = jnp.einsum("bkgd,bksd->bkgs", q, k, preferred_element_type=jnp.float32)
        return (s if scale is None else s * scale) * Dh**-0.5

    def values_of(p, v, out_type=None):
        v, scale = operand(v)
        return jnp.einsum("bkgs,bksd->bkgd", (p if scale is None else p * scale).astype(cdt), v,
                          preferred_element_type=out_type)

    lowest = jnp.finfo(jnp.float32).min
    starts = list(itertools.accumulate((k.shape[2] for k in ks), initial=0))
    if merged:
        # Per segment i: m_i its largest score, l_i = sum exp(s - m_i), o_i = exp(s - m_i) @ v. The softmax over
        # all slots is sum_i e^(m_i - m) o_i / sum_i e^(m_i - m) l_i with m = max_i m_i: a segment with no
        # allowed slot has m_i = lowest and weighs e^(lowest - m) = 0 (a row with none at all: uniform, as below).
        maxima, sums, outs = [], [], []
        for start, k, v in zip(starts[:-1], ks, vs, strict=True):
            scores = scores_of(k)
            scores = jnp.where(allowed[:, None, None, start:start + scores.shape[-1]], scores, lowest)
            m = scores.max(-1, keepdims=True)
            p = jnp.exp(scores - m)
            maxima.append(m)
            sums.append(p.sum(-1, keepdims=True))
            outs.append(values_of(p, v, jnp.float32))
        m = functools.reduce(jnp.maximum, maxima)
        weights = [jnp.exp(m_i - m) for m_i in maxima]
        out = sum(w * o for w, o in zip(weights, outs, strict=True)) / sum(
            w * l_i for w, l_i in zip(weights, sums, strict=True))
        return out.astype(cdt).reshape(B, 1, H, Dh)
    scores = jnp.concatenate([scores_of(k) for k in ks], axis=-1)
    scores = jnp.where(allowed[:, None, None], scores, lowest)
    probs = jax.nn.softmax(scores, axis=-1)
    out = 0
    for p, v in zip(jnp.split(probs, starts[1:-1], axis=-1), vs, strict=True):
        out = out + values_of(p, v)
    return out.reshape(B, 1, H, Dh)


def _layer_step(cfg, p, x, cos, sin, allowed, k_segments, v_segments, chunk, offset, visible, layer=None, keep=None,
                merged=False):
    """One layer for one new token: write its keys/values into generated chunk `chunk` at slot `offset` and
    attend to the prompt and the first `visible` chunks. Segments are one layer's [B, KVH, S_i, Dh], or with
    `layer` (a traced index) the stacked [L, B, KVH, S_i, Dh], written and read at that layer. Rows where `keep`
    ([B] bool) is set keep the slot's old keys/values (a paused turn's, still to be read); `merged`: the softmax
    per segment (`_attend_one`). Returns the new
    residual stream, the segments and the token's experts [B, k] (None for a dense layer)."""
    q, k, v = layer_qkv(cfg, p, x, cos, sin)  # q [B, 1, H, Dh]; k, v [B, 1, KVH, Dh]
    k_segments, v_segments = list(k_segments), list(v_segments)
    start = (0, 0, offset, 0) if layer is None else (layer, 0, 0, offset, 0)

    def write(target, new):  # one part (values or scales) of the chunk, `new` [B, KVH, 1, Dh | 1]
        new = new if layer is None else new[None]
        if keep is not None:
            old = jax.lax.dynamic_slice(target, start, new.shape)
            new = jnp.where(keep.reshape((1,) * (new.ndim - 4) + (-1, 1, 1, 1)), old, new)
        return jax.lax.dynamic_update_slice(target, new, start)

    for segments, new in ((k_segments, k), (v_segments, v)):
        target = segments[1 + chunk]
        new = kv_quant.store(jnp.swapaxes(new, 1, 2), target)
        segments[1 + chunk] = kv_quant.per_part(write, target, new)
    cdt = jnp.dtype(cfg.compute_dtype)

    def read(c):  # one layer's segment; int8 stays int8 (`_attend_one` reads it as such)
        c = c if layer is None else kv_quant.per_part(lambda c: c[layer], c)
        return c if kv_quant.is_int8(c) else c.astype(cdt)

    read_k, read_v = (tuple(map(read, segments[:visible + 1])) for segments in (k_segments, v_segments))
    attended = _attend_one(q, read_k, read_v, allowed, merged)
    x, ids, _ = layer_output(cfg, p, x, attended)
    return x, tuple(k_segments), tuple(v_segments), None if ids is None else ids[:, 0]


def decode_step(
    cfg: LLMConfig,
    params: dict,  # the full params pytree (embed, final_norm, ...); its "layers" entry is not read
    layers: tuple[dict[str, jax.Array], ...],  # from `layer_stack.unstack_layers(cfg, params["layers"])`
    tokens: jax.Array,  # [B] int32, the token fed this step
    positions: jax.Array,  # [B] int32, its rotary position
    allowed: jax.Array,  # [B, P + visible * C] bool: the prompt and visible chunk slots each row attends to
    cache: DecodeCache,
    chunk: int,  # static: the generated chunk written this step
    offset: jax.Array,  # [] int32: the slot written inside that chunk (the same for every row)
    visible: int,  # static: the step reads the prompt and chunks 0 .. visible - 1 only
    keep: jax.Array | None = None,  # [B] bool: rows whose slot keeps its old keys/values (not written this step)
    merged: bool = False,  # static: each segment's softmax merged by log-sum-exp (`sampler.decode_softmax`)
) -> tuple[jax.Array, DecodeCache, jax.Array | None]:
    """Feed one token per row: (final hidden state [B, D] after the final norm, the updated cache, the experts
    the token went to in each MoE layer [B, L, k], None for a dense model).

    The token's keys/values go to slot `offset` of generated chunk `chunk`; it attends to the slots `allowed`
    marks among the prompt segment and the first `visible` chunks. Chunks after those are not read, so while the
    cache fills up a step's attention reads only its filled part.
    """
    cdt = jnp.dtype(cfg.compute_dtype)
    cos, sin = rope_cos_sin(cfg, positions[:, None])  # [B, 1, Dh/2]
    x = lookup(params["embed"], tokens, cdt, params.get("embed_scale"))[:, None, :]  # [B, 1, D]
    new_k, new_v, routing = [], [], []
    for p, k_segments, v_segments in zip(layers, cache.k, cache.v, strict=True):  # unrolled over layers
        p = compute_weights(p, cdt)
        x, k_segments, v_segments, ids = _layer_step(cfg, p, x, cos, sin, allowed, k_segments, v_segments, chunk,
                                                     offset, visible, keep=keep, merged=merged)
        new_k.append(k_segments)
        new_v.append(v_segments)
        if ids is not None:  # a MoE layer
            routing.append(ids)
    hidden = rms_norm(x[:, 0], params["final_norm"], cfg.rms_norm_eps)
    routing = jnp.stack(routing, axis=1) if routing else None
    return hidden, DecodeCache(tuple(new_k), tuple(new_v)), routing


def decode_step_scanned(cfg: LLMConfig, params: dict, tokens, positions, allowed, cache: DecodeCache,
                        chunk: int, offset, visible: int, keep=None, merged: bool = False):
    """`decode_step` with the layers under one `lax.scan` over the stacked weights `params["layers"]` and a
    stacked cache (`decode_cache(..., stacked=True)`), written in place in the scan's carry.

    The program holds one layer instead of L (compile time flat in depth); whether reading a layer's weights and
    cache out of the stacked arrays costs a copy per layer and token depends on the backend (it does on CPU,
    see the module docstring; `sampler.decode_layers` picks per backend).
    """
    cdt = jnp.dtype(cfg.compute_dtype)
    (k_segments,), (v_segments,) = cache.k, cache.v
    cos, sin = rope_cos_sin(cfg, positions[:, None])
    x = lookup(params["embed"], tokens, cdt, params.get("embed_scale"))[:, None, :]

    def layer(carry, p, index, _):
        x, k_segments, v_segments = carry
        p = compute_weights(p, cdt)
        *carry, ids = _layer_step(cfg, p, x, cos, sin, allowed, k_segments, v_segments, chunk, offset, visible,
                                  layer=index, keep=keep, merged=merged)
        return tuple(carry), ids

    (x, k_segments, v_segments), routing = scan_layers(cfg, layer, (x, k_segments, v_segments), params["layers"])
    hidden = rms_norm(x[:, 0], params["final_norm"], cfg.rms_norm_eps)
    routing = None if routing is None else jnp.swapaxes(routing, 0, 1)  # [B, L, k]
    return hidden, DecodeCache((k_segments,), (v_segments,)), routing
