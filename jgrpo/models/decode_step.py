"""One decode step: every row feeds one token, writes its keys/values into its page and attends to its live pages.

The sampler's loop (`jgrpo.sampling.decode_loop`) calls this once per generated token. The arithmetic is
`LLM.__call__`'s (`layer_qkv` and `layer_output` are shared; the attention is the same softmax over the same
tokens: `models/paged_attention.py`), so a decode step and the full forward agree to float rounding (tested).

The layers run one of two ways (`sampler.decode_layers`, DECODE_LAYERS_AUTO by platform):
- `unrolled`: the layer loop unrolled in Python over per-layer weights (split once per sampler call:
  `layer_stack.unstack_layers`) and per-layer page pools, each updated in place in the loop carry. On CPU a
  `lax.scan` over the stacked weights copies each layer's weights out of the stack every step (a dynamic slice is
  a copy there); unrolled, every matmul reads its operands where they lie.
- `scanned`: one `lax.scan` over the stacked weights and a stacked pool [L, Q, ...]: one layer to compile, which
  a TPU reads in place.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jgrpo.models import kv_quant, paged_kv
from jgrpo.models.layer_stack import scan_layers
from jgrpo.models.llm import LLMConfig, layer_output, layer_qkv, rms_norm
from jgrpo.models.paged_attention import paged_attention
from jgrpo.models.paged_kv import PagedKV, PageView
from jgrpo.models.quantize import compute_weights, lookup
from jgrpo.models.rope import rope_cos_sin
from jgrpo.parallel.platform_defaults import resolve

DECODE_LAYERS = ("unrolled", "scanned")
# What `sampler.decode_layers: auto` picks by platform (reasons: docs/configuration.md).
# GPU: unrolled measured 1.59x scanned on an H100 (Qwen2.5-0.5B shapes, 256 rows x 200 tokens, bf16;
# benchmarks/accelerator.py, docs/configuration.md).
DECODE_LAYERS_AUTO = {"cpu": "unrolled", "tpu": "scanned", "gpu": "unrolled", "other": "scanned"}


def resolve_decode_layers(choice: str, platform: str) -> str:
    """`sampler.decode_layers` ("auto", "unrolled" or "scanned") on devices of `platform`."""
    return resolve("sampler.decode_layers", choice, DECODE_LAYERS, DECODE_LAYERS_AUTO, platform)


class StepInputs(NamedTuple):
    """What the rows feed and where they write: [Q * n] tokens and positions, the rest per queue [Q, n]."""

    tokens: jax.Array  # int32, the token each row feeds
    positions: jax.Array  # int32, its rotary position
    view: PageView  # the pages each row attends to (this step's token included)
    page: jax.Array  # int32, the page the token's keys/values go to (`pages`: a row that writes nothing)
    offset: jax.Array  # int32, the token's slot in that page


class StepOptions(NamedTuple):
    """Static choices of the step (hashable): the layer loop, the attention implementation and its block."""

    scanned: bool = False
    attention: str = "xla"
    block: int = 8  # table entries the xla attention reads at a time


def _layer(cfg, p, x, cos, sin, k_pool, v_pool, inputs: StepInputs, options: StepOptions, layer=None):
    """One layer for one new token per row: (x, k_pool, v_pool, experts [S, k] or None). `layer`: the index into
    stacked pools (scanned)."""
    q, k, v = layer_qkv(cfg, p, x, cos, sin)  # q [S, 1, H, Dh]; k, v [S, 1, KVH, Dh]
    Q, n = inputs.page.shape
    pools = []
    for pool, new in ((k_pool, k), (v_pool, v)):
        new = new.reshape(Q, n, *new.shape[2:])
        pools.append(paged_kv.write_tokens(pool, kv_quant.store(new, pool), inputs.page, inputs.offset, layer))
    k_pool, v_pool = pools
    attended = paged_attention(options.attention, q.reshape(Q, n, *q.shape[2:]), k_pool, v_pool, inputs.view,
                               options.block, layer)
    x, ids, _ = layer_output(cfg, p, x, attended.reshape(q.shape))
    return x, k_pool, v_pool, None if ids is None else ids[:, 0]


def decode_step(cfg: LLMConfig, params: dict, layers, cache: PagedKV, inputs: StepInputs, options: StepOptions):
    """Feed one token per row: (final hidden states [S, D] after the final norm, the updated cache, the experts
    each token went to in each MoE layer [S, L, k], None for a dense model).

    `layers`: the per-layer weights (`layer_stack.unstack_layers`) for the unrolled loop; None with
    `options.scanned` (the stacked `params["layers"]` are read)."""
    cdt = jnp.dtype(cfg.compute_dtype)
    cos, sin = rope_cos_sin(cfg, inputs.positions[:, None])  # [S, 1, Dh/2]
    x = lookup(params["embed"], inputs.tokens, cdt, params.get("embed_scale"))[:, None, :]  # [S, 1, D]
    if options.scanned:
        (k_pool,), (v_pool,) = cache.k, cache.v

        def layer(carry, p, index, _):
            x, k_pool, v_pool = carry
            *carry, ids = _layer(cfg, compute_weights(p, cdt), x, cos, sin, k_pool, v_pool, inputs, options, index)
            return tuple(carry), ids

        (x, k_pool, v_pool), routing = scan_layers(cfg, layer, (x, k_pool, v_pool), params["layers"])
        routing = None if routing is None else jnp.swapaxes(routing, 0, 1)  # [S, L, k]
        cache = PagedKV((k_pool,), (v_pool,))
    else:
        new_k, new_v, experts = [], [], []
        for p, k_pool, v_pool in zip(layers, cache.k, cache.v, strict=True):  # unrolled over layers
            x, k_pool, v_pool, ids = _layer(cfg, compute_weights(p, cdt), x, cos, sin, k_pool, v_pool, inputs, options)
            new_k.append(k_pool)
            new_v.append(v_pool)
            if ids is not None:  # a MoE layer
                experts.append(ids)
        routing = jnp.stack(experts, axis=1) if experts else None
        cache = PagedKV(tuple(new_k), tuple(new_v))
    return rms_norm(x[:, 0], params["final_norm"], cfg.rms_norm_eps), cache, routing
