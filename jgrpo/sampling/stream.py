"""A pool that never drains: batches of prompts fed into lanes of a decoding pool, rows of the next batch starting
in the slots the last one's rows leave (`Sampler.open_stream`, `Sampler.refill`; the rest is the slot interface).

    state = sampler.open_stream(params, lanes=L, batch=B, prompt_len=P)   an empty pool with L lanes of B prompts
    state = sampler.refill(params, state, lane, prompts, key, order, v)    batch `order` prefilled into a free lane
    state = sampler.advance(params, state, chunks=1, version=v)            decode a chunk with the params of v
    rows, out, state = sampler.drain(state)                                the rows complete since the last drain

A lane is B prompts and their B x G rows; it is free once all its rows are complete and drained. Its next batch is
prefilled with the params the pool decodes with at that moment, into pages taken from the pool's free ones (the
last batch's prompt pages came back with its last row), and its rows wait for slots: a slot whose row stops takes
the oldest batch's next waiting row (`PromptStore.order`), whatever its lane. The params may change between any
two calls (weights updated in flight): every drawn token records the version that drew it, and the keys/values
the rows computed so far stay as they are (PipelineRL's choice).

With Q queues (one per shard of the row axis), a lane holds B / Q prompts of each queue: lane m's prompts are the
queue's store entries m*B/Q .. and its rows m*B/Q*G .., so batch prompt q*B/Q + i is queue q's entry m*B/Q + i. A
stream's pool row r (global) is queue r // Rq's local row r % Rq; `batch_rows` maps a lane's rows to batch order.

Keys: batch prompt b's row g draws token t with fold_in(fold_in(key, b * G + g), t), the key `generate` gives it:
a batch streamed alone with one version draws what `generate` draws (tested token for token).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jgrpo.models import kv_quant, paged_kv
from jgrpo.models.llm import init_cache, merge_model, position_ids_from_mask
from jgrpo.sampling import pages
from jgrpo.sampling.decode_loop import local_prompt
from jgrpo.sampling.prefill import empty_pool, write_prompts
from jgrpo.sampling.state import PoolSpec, PromptStore
from jgrpo.sampling.turns import SlotState


def batch_rows(spec: PoolSpec, lane: int) -> np.ndarray:
    """[B * G] the pool's global rows of a lane, in the batch's row order (prompt b's G rows at b*G ..)."""
    plan = spec.plan
    Q, Rq = plan.queues, plan.rows_per_queue
    per_queue = Rq // plan.lanes  # a lane's rows in each queue
    return (np.arange(Q)[:, None] * Rq + lane * per_queue + np.arange(per_queue)[None, :]).reshape(-1)


@functools.partial(jax.jit, static_argnames=("spec", "cfg", "width"))
def _open(*, spec: PoolSpec, cfg, width: int):
    """An empty stream: no prompts, every row complete (no lane holds a batch), every page free."""
    plan = spec.plan
    Q, W = plan.queues, plan.rows_per_queue // plan.num_samples
    key = jax.random.key(0)
    store = PromptStore(logits=jnp.zeros((Q, W, cfg.vocab_size), jnp.float32), length=jnp.zeros((Q, W), jnp.int32),
                        table=jnp.full((Q, W, plan.prompt_pages), plan.pages, jnp.int32),
                        keys=jnp.broadcast_to(key, (Q, W)), index=jnp.zeros((Q, W), jnp.int32),
                        first=jnp.arange(Q, dtype=jnp.int32) * W,
                        routing=(jnp.zeros((Q, W, width, *plan.routing[:2]), plan.routing[2]) if plan.routing
                                 else None),
                        order=jnp.zeros((Q, W), jnp.int32))
    store = jax.tree.map(lambda x: spec.pin("queues", x), store)
    cache = paged_kv.empty(cfg, Q, plan.pages, plan.page_size, plan.kv_dtype, plan.scanned)
    pool = empty_pool(spec, pages.initial(plan.pages, jnp.zeros(Q, jnp.int32)), spec.pin("cache", cache))
    rows = pool.rows._replace(queued=jnp.zeros_like(pool.rows.queued), finished=jnp.ones_like(pool.rows.finished))
    return store, pool._replace(rows=rows, refs=jnp.zeros_like(pool.refs), version=jnp.int32(0), busy=jnp.int32(0))


@functools.partial(jax.jit, static_argnames=("graphdef", "spec"), donate_argnames=("store", "pool"))
def _refill(graphdef, params, store: PromptStore, pool, lane, tokens, mask, keys, index, order, *, spec: PoolSpec):
    """Lane `lane` (free) takes the B prompts `tokens`/`mask` [B, P] of batch `order`: prefilled, their keys/values
    into free pages, their rows waiting. `keys`, `index` [B]: each prompt's key and index in its batch."""
    plan = spec.plan
    model = merge_model(graphdef, params)
    B = tokens.shape[0]
    Q, G, ps, pp = plan.queues, plan.num_samples, plan.page_size, plan.prompt_pages
    n = B // Q  # the lane's prompts in each queue
    with jax.named_scope("prefill"):
        dense = spec.pin("prefill", init_cache(model.cfg, B, tokens.shape[1], plan.kv_dtype))
        hidden, dense, routing = model.routed(tokens, position_ids_from_mask(mask), mask, dense, 0)
        logits = model.logits(hidden[:, -1])  # [B, V]
    by_queue = lambda x: spec.pin("queues", x.reshape(Q, n, *x.shape[1:]))  # noqa: E731 - [B, ...] -> [Q, n, ...]
    length = by_queue(jnp.sum(mask, axis=1, dtype=jnp.int32))
    wanted = jnp.arange(pp) < -(-length[..., None] // ps)  # [Q, n, pp]
    free, table = pages.take(pool.free, wanted.reshape(Q, n * pp))
    table = table.reshape(Q, n, pp)
    cache = write_prompts(plan, pool.cache, dense, jnp.arange(B, dtype=jnp.int32).reshape(Q, n), length, table)
    entries = lane * n + jnp.arange(n)
    put = lambda field, value: field.at[:, entries].set(value)  # noqa: E731 - the lane's store entries
    if plan.routing:
        routing = put(store.routing, by_queue(jnp.where(mask[..., None, None], routing, 0).astype(plan.routing[2])))
    store = store._replace(logits=put(store.logits, by_queue(logits)), length=put(store.length, length),
                           table=put(store.table, table), keys=put(store.keys, by_queue(keys)),
                           index=put(store.index, by_queue(index)),
                           order=put(store.order, jnp.full((Q, n), order, jnp.int32)),
                           routing=routing if plan.routing else None)
    rows = lane * n * G + jnp.arange(n * G)  # the lane's queue-local rows
    r = pool.rows
    reset = lambda field, value: field.at[:, rows].set(value)  # noqa: E731
    r = r._replace(tokens=reset(r.tokens, plan.pad_id), logprobs=reset(r.logprobs, 0.0), lengths=reset(r.lengths, 0),
                   stopped=reset(r.stopped, False), pages=reset(r.pages, plan.pages), queued=reset(r.queued, True),
                   preempted=reset(r.preempted, 0), drawn=reset(r.drawn, False), version=reset(r.version, -1),
                   finished=reset(r.finished, False), turn_start=reset(r.turn_start, 0),
                   routing=None if r.routing is None else reset(r.routing, 0))
    pool = pool._replace(free=free, refs=pool.refs.at[:, entries].set(G), rows=r, cache=spec.pin("cache", cache))
    return store, pool


def open_stream(spec: PoolSpec, cfg, width: int) -> SlotState:
    """An empty stream for `spec` (a "stream" spec of lanes x B prompts of width `width`)."""
    plan = spec.plan
    need = plan.rows_per_queue // plan.num_samples * plan.prompt_pages + plan.slots_per_queue * plan.own_pages
    if plan.pages < need:
        raise ValueError(f"sampler.kv_pages={plan.pages} per queue is too few for a stream: its lanes' prompts and "
                         f"every slot's row at its longest take {need} (a stream never preempts; 0 sizes it so)")
    store, pool = _open(spec=spec, cfg=cfg, width=width)
    return SlotState(spec, store, pool, np.ones(plan.rows, bool))


def refill(graphdef, params, state: SlotState, lane: int, prompts, keys, order: int) -> SlotState:
    """Free `lane` takes batch `order`'s prompts (`prompts`: tokens, mask, index [B]; `keys` [B])."""
    plan = state.spec.plan
    B = prompts.tokens.shape[0]
    if B * plan.num_samples * plan.lanes != plan.rows:
        raise ValueError(f"a batch of {B} prompts does not fit the stream's lanes of "
                         f"{plan.rows // plan.lanes // plan.num_samples}")
    if not 0 <= lane < plan.lanes:
        raise ValueError(f"lane {lane} is not one of the stream's {plan.lanes}")
    rows = batch_rows(state.spec, lane)
    if not state.drained[rows].all():
        raise ValueError(f"lane {lane} still has rows that are not complete and drained: it is not free")
    store, pool = _refill(graphdef, params, state.store, state.pool, np.int32(lane), prompts.tokens, prompts.mask,
                          keys, prompts.index, np.int32(order), spec=state.spec)
    drained = state.drained.copy()
    drained[rows] = False
    return SlotState(state.spec, store, pool, drained, state.parked, state.unstacked)


@functools.partial(jax.jit, static_argnames=("graphdef", "spec"), donate_argnames=("store", "pool"))
def _recompute(graphdef, params, store: PromptStore, pool, tokens, mask, *, spec: PoolSpec):
    """Every live prompt's and every running row's keys/values computed again with `params`, and the prompts'
    last logits (what waiting rows start from). `tokens`/`mask` [Q * W, P]: the store's prompts, queue-major."""
    plan = spec.plan
    model = merge_model(graphdef, params)
    Q, W, Rq, N, ps = plan.queues, plan.rows_per_queue // plan.num_samples, plan.rows_per_queue, \
        plan.max_new_tokens, plan.page_size
    P = tokens.shape[1]
    queues = jnp.arange(Q)[:, None]
    with jax.named_scope("recompute_prompts"):
        dense = spec.pin("prefill", init_cache(model.cfg, Q * W, P, plan.kv_dtype))
        hidden, dense, _ = model.routed(tokens, position_ids_from_mask(mask), mask, dense, 0)
        live = pool.refs > 0  # [Q, W]: prompts some row still needs (the others' pages went back to the pool)
        table = jnp.where(live[..., None], store.table, plan.pages)
        cache = write_prompts(plan, pool.cache, dense, jnp.arange(Q * W).reshape(Q, W), store.length, table)
        logits = model.logits(hidden[:, -1]).reshape(Q, W, -1)
        store = store._replace(logits=jnp.where(live[..., None], logits, store.logits))
    with jax.named_scope("recompute_rows"):
        sl, rows = pool.slots, pool.rows
        running = ~sl.done  # [Q, Sq]
        row = jnp.minimum(sl.row, Rq - 1)
        pick = jax.vmap(lambda x, i: x[i])
        prompt = local_prompt(plan, store, queues, row)  # [Q, Sq]
        fed = pick(rows.lengths, row) - 1  # the row's tokens in its pages (its last is drawn, not fed yet)
        by_queue = lambda x: x.reshape(Q, W, *x.shape[1:])  # noqa: E731
        seq = jnp.concatenate([pick(by_queue(tokens), prompt), pick(rows.tokens, row)], axis=-1)  # [Q, Sq, P + N]
        seq_mask = jnp.concatenate([pick(by_queue(mask), prompt), jnp.arange(N) < fed[..., None]], axis=-1)
        S = seq.shape[0] * seq.shape[1]
        seq, seq_mask = seq.reshape(S, P + N), seq_mask.reshape(S, P + N)
        own = init_cache(model.cfg, S, P + N, plan.kv_dtype)
        _, own, _ = model.routed(seq, position_ids_from_mask(seq_mask), seq_mask, own, 0)
        OP = plan.own_pages
        pages = jnp.where(running[..., None] & (jnp.arange(OP) * ps < fed[..., None]), pick(rows.pages, row),
                          plan.pages)  # [Q, Sq, OP]: the pages that hold fed tokens

        def paged(x):  # [L, S, P + N, KVH, Dh] -> [L, Q, Sq, OP, KVH, ps, Dh]: the own tokens in page layout
            x = x[:, :, P:]
            x = jnp.pad(x, ((0, 0), (0, 0), (0, OP * ps - N), (0, 0), (0, 0)))
            x = x.reshape(x.shape[0], Q, S // Q, OP, ps, *x.shape[3:])
            return jnp.swapaxes(x, 4, 5)

        new = kv_quant.per_part(lambda c: jax.tree.map(paged, c), own)
        if plan.scanned:
            write = jax.vmap(lambda p, x: paged_kv.write_pages(p, x, pages))
            cache = paged_kv.PagedKV((write(cache.k[0], new.k),), (write(cache.v[0], new.v),))
        else:
            layer = lambda c, i: kv_quant.per_part(lambda x: x[i], c)  # noqa: E731
            cache = paged_kv.PagedKV(*(tuple(paged_kv.write_pages(p, layer(parts, i), pages)
                                             for i, p in enumerate(pools))
                                       for pools, parts in ((cache.k, new.k), (cache.v, new.v))))
    return store, pool._replace(cache=spec.pin("cache", cache))


def recompute(graphdef, params, state: SlotState, prompts) -> SlotState:
    """AReaL's choice at a weight update: the pool's keys/values of every live prompt and running row computed
    again with `params`, so every token drawn from now on is drawn in a context of one version. `prompts`: the
    store's prompts (tokens, mask [Q * W, P], queue-major; a free lane's entries any left-padded prompt)."""
    if state.spec.plan.routing:
        raise ValueError("recomputing the keys/values of rows in flight is not built for a mixture of experts (its "
                         "routing record would need recomputing too): keep them (rollout.in_flight_kv: keep)")
    store, pool = _recompute(graphdef, params, state.store, state.pool, prompts.tokens, prompts.mask,
                             spec=state.spec)
    return SlotState(state.spec, store, pool, state.drained, state.parked, state.unstacked)
