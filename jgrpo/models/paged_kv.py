"""The sampler's KV cache in pages: one pool of fixed-size pages per layer, rows pointing at their pages.

A page holds `page_size` tokens' keys (or values) for every KV head, [KVH, page_size, Dh]; a layer's pool is
[Q, pages, KVH, page_size, Dh] (Q: one pool per shard of the row axis, so a row's pages live on the device that
decodes it). A row's tokens are its prompt's (pages written once by the prefill and shared by the G rows of the
group) followed by its own (the tokens fed after the prompt, in pages taken as the row grows). Its page table
lists them in that order; `PageView` says, per row, which entries hold how many tokens:

    entry i < prompt_pages:   the prompt's page i, min(page_size, prompt_len - i * page_size) tokens
    entry prompt_pages + j:   the row's own page j, min(page_size, own_len - j * page_size) tokens

so the last prompt page may end part full (the prompt's page is never written by a row: its own tokens start on a
page of their own). Page id `pages` (one past the last) stands for "none": writes to it are dropped, reads of it are
masked. An int8 pool is `kv_quant.Int8KV` values and per-token scales ([.., page_size, 1]); every function here
moves both parts alike (`kv_quant.per_part`).

The allocation (which pages are free, who holds what) is the sampler's (`jgrpo.sampling.pages`); this module is the
format: empty pools, writing tokens, reading pages.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jgrpo.models import kv_quant


class PagedKV(NamedTuple):
    """Per layer, the key and value pools [Q, pages, KVH, page_size, Dh] (`stacked`: one entry [L, Q, ...])."""

    k: tuple
    v: tuple


class PageView(NamedTuple):
    """What each row of a decode step (or an append) attends to, [Q, n] per field (table [Q, n, entries])."""

    table: jax.Array  # int32: the prompt's pages, then the row's own (`pages` past its live entries)
    prompt_pages: jax.Array  # int32: how many entries are the prompt's
    prompt_len: jax.Array  # int32: the prompt's tokens
    own_len: jax.Array  # int32: the row's own tokens in its pages (after this step's write)

    def live_entries(self, page_size: int) -> jax.Array:
        """[Q, n] the entries that hold at least one token: the prompt's pages and the own pages in use."""
        return self.prompt_pages + -(-self.own_len // page_size)

    def tokens_in(self, entries: jax.Array, page_size: int) -> jax.Array:
        """How many tokens entry `entries` [Q, n, e] of each row holds (0 past its live entries)."""
        own = entries - self.prompt_pages[..., None]
        prompt = self.prompt_len[..., None] - entries * page_size
        mine = self.own_len[..., None] - own * page_size
        return jnp.clip(jnp.where(own < 0, prompt, mine), 0, page_size)


def empty(cfg, queues: int, pages: int, page_size: int, dtype: str, stacked: bool) -> PagedKV:
    """Pools of `pages` empty pages per queue for every layer, in `dtype` ("int8": values and unit scales)."""
    shape = (queues, pages, cfg.num_kv_heads, page_size, cfg.head_dim)
    if stacked:
        return PagedKV((kv_quant.zeros((cfg.num_layers, *shape), dtype),),
                       (kv_quant.zeros((cfg.num_layers, *shape), dtype),))
    return PagedKV(tuple(kv_quant.zeros(shape, dtype) for _ in range(cfg.num_layers)),
                   tuple(kv_quant.zeros(shape, dtype) for _ in range(cfg.num_layers)))


def write_tokens(pool, new, page, offset, layer=None):
    """`new` [Q, n, KVH, Dh] (keys or values, in the pool's form: `kv_quant.store`) written at token `offset` of
    page `page` ([Q, n] int32; `pages` = none: dropped) of each queue's pool; with `layer` (a traced index) into the
    stacked pool [L, Q, ...]. In place in a loop carry."""

    def one_queue(pool, new, page, offset):  # pool [P, KVH, ps, Dh] (or [L, P, ...] with a layer)
        if layer is None:
            return pool.at[page, :, offset].set(new, mode="drop")
        return pool.at[layer, page, :, offset].set(new, mode="drop")

    axis = 0 if layer is None else 1
    return kv_quant.per_part(lambda p, x: jax.vmap(one_queue, (axis, 0, 0, 0), axis)(p, x, page, offset), pool, new)


def write_pages(pool, new, table, layer=None):
    """Whole pages: `new` [Q, n, e, KVH, page_size, Dh] written at pages `table` [Q, n, e] (`pages` = none)."""

    def one_queue(pool, new, table):
        flat, pages = table.reshape(-1), new.reshape(-1, *new.shape[2:])
        return pool.at[flat].set(pages, mode="drop") if layer is None else pool.at[layer, flat].set(pages, mode="drop")

    axis = 0 if layer is None else 1
    return kv_quant.per_part(lambda p, x: jax.vmap(one_queue, (axis, 0, 0), axis)(p, x, table), pool, new)


def read_pages(pool, table, layer=None):
    """The pages `table` [Q, n, e] of each queue's pool [Q, P, KVH, ps, Dh] (with `layer`, a traced index: of
    layer `layer` of the stacked pool [L, Q, P, ...], read in place, no copy of the layer): [Q, n, e, KVH, ps, Dh];
    an entry `pages` (none) reads page 0, for the caller to mask."""
    shape = pool.values.shape if kv_quant.is_int8(pool) else pool.shape
    table = jnp.where(table < shape[-4], table, 0)
    if layer is None:
        return kv_quant.per_part(lambda p: jax.vmap(lambda p, t: p[t])(p, table), pool)
    return kv_quant.per_part(lambda p: jax.vmap(lambda p, t: p[layer, t], (1, 0))(p, table), pool)
