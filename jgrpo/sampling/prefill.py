"""Step 1 of the sampler's program (`jgrpo.sampling.decode_loop`): the prompts run once through the model, their
keys/values written into pages of their queue's pool, which their G rows share, and the pool every row starts
from (every slot free, every row waiting). `write_prompts` also serves a stream's batches (`jgrpo.sampling.stream`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jgrpo.models import kv_quant, paged_kv
from jgrpo.models.llm import init_cache, position_ids_from_mask
from jgrpo.sampling import pages
from jgrpo.sampling.state import Plan, Pool, PoolSpec, PromptStore, Rows, Slots, queue_groups, queue_prompts


def prefill(spec: PoolSpec, model, tokens, mask, key, prompt_index=None) -> Pool:
    """Run the B left-padded prompts [B, P] once, their keys/values into pages of their queue's pool; the pool with
    every slot free and every row waiting. `key`: one key, or [B] keys; `prompt_index` [B] (default 0 .. B-1): each
    prompt's index in its own batch (see `draw`). Returns (store, pool)."""
    plan = spec.plan
    B, P = tokens.shape
    ps, pp, none = plan.page_size, plan.prompt_pages, plan.pages
    with jax.named_scope("prefill"):
        dense = spec.pin("prefill", init_cache(model.cfg, B, P, plan.kv_dtype))
        hidden, dense, routing = model.routed(tokens, position_ids_from_mask(mask), mask, dense, 0)
        last_logits = model.logits(hidden[:, -1])  # [B, V]; left padding puts every prompt's end last
        prompts = jnp.asarray(queue_prompts(B, plan.rows, plan.queues, plan.num_samples))  # [Q, W]
        length = spec.pin("queues", jnp.sum(mask, axis=1, dtype=jnp.int32)[prompts])
        table, used = pages.prompt_tables(length, ps, pp, none)
        empty = paged_kv.empty(model.cfg, plan.queues, plan.pages, ps, plan.kv_dtype, plan.scanned)
        cache = write_prompts(plan, empty, dense, prompts, length, table)
        keys = jnp.broadcast_to(key, prompts.shape) if key.ndim == 0 else spec.pin("queues", key[prompts])
        index = prompts if prompt_index is None else spec.pin("queues", prompt_index[prompts])
        if plan.routing:  # [Q, W, P, L, k]
            routing = spec.pin("queues", jnp.where(mask[..., None, None], routing, 0).astype(plan.routing[2])[prompts])
        else:
            routing = None
        store = PromptStore(spec.pin("queues", last_logits[prompts]), length, table, keys, index, prompts[:, 0],
                            routing)
        return store, empty_pool(spec, pages.initial(plan.pages, used), spec.pin("cache", cache))


def write_prompts(plan: Plan, cache: paged_kv.PagedKV, dense, prompts, length, table) -> paged_kv.PagedKV:
    """The prompts' keys/values from the dense prefill cache `dense` [L, B, P, KVH, Dh] into pages: queue q's
    prompts `prompts[q]` (indices into B), `length` [Q, n] real tokens each, at pages `table` [Q, n, pp]."""
    ps, pp, P = plan.page_size, plan.prompt_pages, jax.tree.leaves(dense)[0].shape[2]
    # Token i of prompt b sits at column P - length_b + i of the left-padded cache: its page i // ps, slot i % ps.
    columns = jnp.clip(P - length[..., None] + jnp.arange(pp * ps), 0, P - 1)  # [Q, n, pp * ps]

    def paged(x):  # [L, B, P, KVH, Dh] -> [L, Q, n, pp, KVH, ps, Dh]
        x = jax.vmap(lambda c: jax.vmap(lambda xq, cq: jax.vmap(lambda xw, cw: xw[cw])(xq, cq))(
            c[prompts], columns))(x)
        x = x.reshape(*x.shape[:3], pp, ps, *x.shape[4:])
        return jnp.swapaxes(x, 4, 5)

    new = kv_quant.per_part(lambda c: jax.tree.map(paged, c), dense)
    if plan.scanned:
        write = jax.vmap(lambda pool, x: paged_kv.write_pages(pool, x, table))
        return paged_kv.PagedKV((write(cache.k[0], new.k),), (write(cache.v[0], new.v),))
    layer = lambda c, i: kv_quant.per_part(lambda x: x[i], c)  # noqa: E731
    return paged_kv.PagedKV(*(tuple(paged_kv.write_pages(pool, layer(parts, i), table) for i, pool in enumerate(pools))
                              for pools, parts in ((cache.k, new.k), (cache.v, new.v))))


def empty_pool(spec: PoolSpec, free, cache) -> Pool:
    plan = spec.plan
    Q, Rq, Sq, N = plan.queues, plan.rows_per_queue, plan.slots_per_queue, plan.max_new_tokens
    rows = Rows(tokens=jnp.full((Q, Rq, N), plan.pad_id, jnp.int32), logprobs=jnp.zeros((Q, Rq, N), jnp.float32),
                lengths=jnp.zeros((Q, Rq), jnp.int32), stopped=jnp.zeros((Q, Rq), bool),
                pages=jnp.full((Q, Rq, plan.own_pages), plan.pages, jnp.int32), queued=jnp.ones((Q, Rq), bool),
                preempted=jnp.zeros((Q, Rq), jnp.int32))
    if plan.interactive:
        rows = rows._replace(drawn=jnp.zeros((Q, Rq, N), bool), version=jnp.full((Q, Rq, N), -1, jnp.int32),
                             finished=jnp.zeros((Q, Rq), bool), turn_start=jnp.zeros((Q, Rq), jnp.int32))
    if plan.routing:
        L, k, dtype = plan.routing
        rows = rows._replace(routing=jnp.zeros((Q, Rq, N, L, k), dtype))
    slots = Slots(row=jnp.full((Q, Sq), Rq, jnp.int32), last=jnp.zeros((Q, Sq), jnp.int32),
                  done=jnp.ones((Q, Sq), bool), held=jnp.zeros((Q, Sq), bool) if plan.interactive else None)
    refs = jnp.asarray(queue_groups(plan.rows, plan.queues, plan.num_samples))
    per_queue = functools.partial(jax.tree.map, lambda x: spec.pin("queues", x))
    return Pool(clock=jnp.int32(0), free=per_queue(free), refs=per_queue(refs), slots=per_queue(slots),
                rows=per_queue(rows), cache=cache)
