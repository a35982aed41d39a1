"""Attention of one new token per row over that row's live pages (`models/paged_kv.py`), per backend.

One entry point, `paged_attention`, with implementations chosen by `sampler.paged_attention` (`auto`: by platform,
PAGED_ATTENTION_AUTO):

- `xla`: plain XLA ops. The rows' page tables are read a block of entries at a time (`block` pages: gathered,
  scored, folded into a running softmax by log-sum-exp as flash-decoding does), in a `while_loop` whose trip count
  is the longest live table of the step: a step reads every row's pages up to the longest row's, never the
  unused rest of the table, and nothing the size of the whole cache is built.
- `pallas`: a Pallas TPU kernel (`models/paged_attention_tpu.py`) that reads each row's live pages only.

Every implementation computes softmax(q k^T / sqrt(Dh)) v over the tokens `PageView` marks, with grouped-query
heads; int8 pages are read as int8, their per-token scales folded into the scores and the probabilities
(`models/kv_quant.py`), so nothing dequantized is built.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jgrpo.models import kv_quant
from jgrpo.models.paged_kv import PageView, read_pages
from jgrpo.parallel.platform_defaults import resolve

PAGED_ATTENTION = ("xla", "pallas")
# What `sampler.paged_attention: auto` picks by platform (reasons: docs/configuration.md). CPU and GPU: the XLA
# blocks (measured on CPU; on GPU the only implementation until a Pallas GPU kernel measures faster). TPU: the
# kernel, which reads each row's own live pages where the XLA blocks read every row up to the longest.
PAGED_ATTENTION_AUTO = {"cpu": "xla", "tpu": "pallas", "gpu": "xla", "other": "xla"}
_LOWEST = jnp.finfo(jnp.float32).min


def resolve_paged_attention(choice: str, platform: str) -> str:
    """`sampler.paged_attention` ("auto", "xla" or "pallas") on devices of `platform`."""
    return resolve("sampler.paged_attention", choice, PAGED_ATTENTION, PAGED_ATTENTION_AUTO, platform)


def paged_attention(implementation: str, q, k_pool, v_pool, view: PageView, block: int, layer=None):
    """q [Q, n, H, Dh] (one token per row) over the rows' pages in the pools k_pool, v_pool [Q, P, KVH,
    page_size, Dh] (with `layer`, a traced index: layer `layer` of stacked pools [L, Q, P, ...], read in place)
    -> [Q, n, H, Dh] in q's dtype. `block`: table entries read at a time (xla)."""
    if implementation == "pallas":
        from jgrpo.models.paged_attention_tpu import paged_attention_tpu

        return paged_attention_tpu(q, k_pool, v_pool, view, layer)
    if implementation != "xla":
        raise ValueError(f"unknown paged attention {implementation!r}; one of {PAGED_ATTENTION}")
    return paged_attention_xla(q, k_pool, v_pool, view, block, layer)


def _operand(pages, dtype):
    """(the dot's operand in `dtype`, its per-token scales [Q, n, e, KVH, ps] or None)."""
    if kv_quant.is_int8(pages):
        return pages.values.astype(dtype), pages.scales[..., 0]
    return pages.astype(dtype), None


def paged_attention_xla(q, k_pool, v_pool, view: PageView, block: int, layer=None):
    """The `xla` implementation: blocks of `block` table entries in a while loop up to the longest live table."""
    Q, n, H, Dh = q.shape
    shape = k_pool.values.shape if kv_quant.is_int8(k_pool) else k_pool.shape
    P, KVH, ps = shape[-4], shape[-3], shape[-2]
    G = H // KVH
    entries = view.table.shape[-1]
    table = jnp.pad(view.table, ((0, 0), (0, 0), (0, -entries % block)), constant_values=P)
    trips = -(-jnp.max(view.live_entries(ps)) // block)
    qg = q.reshape(Q, n, KVH, G, Dh)
    cdt = q.dtype

    def body(carry):
        b, m, total, out = carry
        at = b * block + jnp.arange(block)
        ids = jax.lax.dynamic_slice_in_dim(table, b * block, block, axis=2)  # [Q, n, block]
        k, k_scale = _operand(read_pages(k_pool, ids, layer), cdt)  # [Q, n, block, KVH, ps, Dh]
        v, v_scale = _operand(read_pages(v_pool, ids, layer), cdt)
        valid = jnp.arange(ps) < view.tokens_in(jnp.broadcast_to(at, ids.shape), ps)[..., None]  # [Q, n, block, ps]
        valid = valid[:, :, None, None]  # [Q, n, 1, 1, block, ps]
        scores = jnp.einsum("qnkgd,qnbkpd->qnkgbp", qg, k, preferred_element_type=jnp.float32)
        if k_scale is not None:
            scores = scores * jnp.moveaxis(k_scale, 3, 2)[:, :, :, None]
        scores = jnp.where(valid, scores * Dh**-0.5, _LOWEST)
        peak = jnp.maximum(m, scores.max(axis=(-2, -1)))
        probs = jnp.where(valid, jnp.exp(scores - peak[..., None, None]), 0.0)
        rescale = jnp.exp(m - peak)
        total = total * rescale + probs.sum(axis=(-2, -1))
        if v_scale is not None:
            probs = probs * jnp.moveaxis(v_scale, 3, 2)[:, :, :, None]
        out = out * rescale[..., None] + jnp.einsum("qnkgbp,qnbkpd->qnkgd", probs.astype(cdt), v,
                                                    preferred_element_type=jnp.float32)
        return b + 1, peak, total, out

    carry = (jnp.int32(0), jnp.full((Q, n, KVH, G), _LOWEST, jnp.float32), jnp.zeros((Q, n, KVH, G), jnp.float32),
             jnp.zeros((Q, n, KVH, G, Dh), jnp.float32))
    # Bounded by the whole table too: a `counter < constant` the planner reads as this loop's worst case.
    blocks = table.shape[-1] // block
    _, _, total, out = jax.lax.while_loop(lambda c: (c[0] < blocks) & (c[0] < trips), body, carry)
    out = out / jnp.maximum(total, jnp.finfo(jnp.float32).tiny)[..., None]  # a row with no token (an empty slot): 0
    return out.astype(cdt).reshape(Q, n, H, Dh)
