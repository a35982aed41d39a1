"""The sampler engine's slot-level interface: a pool of rows decoded a chunk at a time, paused between turns.

What multi-turn environments and cross-process rollouts drive (`Sampler.start / advance / append / finish /
drain`, which call these):

    state = sampler.start(params, prompts, key)        the prompts prefilled, every slot's first token drawn
    state = sampler.advance(params, state, chunks=1)   decode to the next chunk boundary (or until nothing can run);
                                                       `state.status()`: each slot's row, and whether it is
                                                       decoding, paused (its turn ended) or done
    state = sampler.append(params, state, slot, ids)   tokens after a paused row's last one (an environment's
                                                       reply); the row's next turn starts at once
    state = sampler.finish(state, slot)                a paused row is complete: its slot takes the next row
    rows, out = sampler.drain(state)                   the complete rows not drained before, and their tokens
    state, row = sampler.park(state, slot)             a paused row leaves its slot to a pending row while it
                                                       waits; later `sampler.resume(params, state, slot, row, ids)`
                                                       in a free slot of its queue, or `sampler.finish_row`

A turn ends at a stop id or after `turn_tokens` drawn tokens; a row is complete when the host finishes it or its
`max_new_tokens` are used (drawn and appended together). `params` may change between calls (a weight update): each
drawn token records the `version` of the params that drew it (`SampleOutput.version`; appended tokens -1, and
out of the loss mask).

The programs are the decode loop's (`jgrpo.sampling.decode_loop`) in its interactive form: the same prefill,
admission and feed, the same keys (row r's token t is drawn with fold_in(fold_in(key, r), t) whatever the turn),
so a pool driven here draws what `generate` draws (tested token for token). The differences: a slot whose turn
ends keeps its row (held) instead of taking the next one, and a row takes the pages for its N tokens when it
starts (an episode cannot be drawn again: its environment has moved on), so it never runs short. A row's keys and
values stay in its pages between turns, whether it keeps its slot or not: `append` prefills the turn's last drawn
token (drawn, not fed yet) and the appended ids into the row's pages, attending to what they hold (not recomputing
it), and draws the next turn's first token from the last logits: prefilling the concatenated prompt up to rounding,
at the cost of a forward over W = 1 + append_tokens tokens (the Sampler's `append_tokens`). `park` gives the slot
away and keeps the pages; `resume` does the same prefill in another slot of the row's queue. Appended ids are padded
to W, so appends of any length run one compiled program.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jgrpo.models import kv_quant, paged_kv
from jgrpo.models.layer_stack import unstack_layers
from jgrpo.models.llm import KVCache, merge_model
from jgrpo.parallel.host_arrays import fetch
from jgrpo.sampling.decode_loop import (
    draw,
    free_slots,
    outputs,
    release,
    start,
    step,
    view_of,
    weights,
)
from jgrpo.sampling.state import Pool, PoolSpec, PromptStore, SampleOutput, record, turn_ends

DECODING, PAUSED, DONE, EMPTY = "decoding", "paused", "done", "empty"


class SlotStatus(NamedTuple):
    """Per slot [S] (numpy, read after a call): its row (global index, -1 if none), the row's tokens so far and
    those of its current turn, its state (DECODING; PAUSED: the turn ended and the host decides; DONE: the row is
    complete and the slot waits for a pending row; EMPTY) and whether a paused turn ended at a stop id."""

    row: np.ndarray
    length: np.ndarray
    turn_length: np.ndarray
    state: np.ndarray  # str
    stopped: np.ndarray  # bool


@dataclasses.dataclass
class SlotState:
    """A pool in flight: its static spec, the prompt store and the pool (device arrays), the rows drained."""

    spec: PoolSpec
    store: PromptStore
    pool: Pool
    drained: np.ndarray  # [R] bool
    parked: set[int] = dataclasses.field(default_factory=set)  # rows that left their slot between turns (`park`)
    unstacked: tuple | None = None  # (params["layers"], its layers split) for the unrolled decode, reused per params

    def status(self) -> SlotStatus:
        plan = self.spec.plan
        sl, lengths, turn_start, stopped = fetch((self.pool.slots, self.pool.rows.lengths, self.pool.rows.turn_start,
                                                  self.pool.rows.stopped))
        Rq = plan.rows_per_queue
        queue = np.repeat(np.arange(plan.queues), plan.slots_per_queue)
        local, done, held = (np.asarray(x).reshape(-1) for x in (sl.row, sl.done, sl.held))
        real = local < Rq
        row = np.where(real, queue * Rq + np.minimum(local, Rq - 1), -1)
        at = np.maximum(row, 0)
        length, start_of_turn = np.asarray(lengths).reshape(-1)[at], np.asarray(turn_start).reshape(-1)[at]
        state = np.where(~real, EMPTY, np.where(~done, DECODING, np.where(held, PAUSED, DONE)))
        return SlotStatus(row, np.where(real, length, 0), np.where(real, length - start_of_turn, 0), state,
                          (state == PAUSED) & np.asarray(stopped).reshape(-1)[at])

    def turns(self) -> np.ndarray:
        """Each slot's current turn, [S, turn_limit] int32 on every host (its first `status().turn_length` ids
        are the turn's). Cut out and replicated on the devices: a host reads no other part of the pool's rows
        (with several processes, reading the rows themselves would gather all of them through every host)."""
        return np.asarray(fetch(_turns(self.pool, spec=self.spec)))

    def idle(self) -> bool:
        """Nothing can decode until the host appends to or finishes a paused row (or every row is complete)."""
        sl, queued = fetch((self.pool.slots, self.pool.rows.queued))
        free = sl.done & ~sl.held
        return bool(sl.done.all() and (~free.any(axis=1) | ~queued.any(axis=1)).all())


@functools.partial(jax.jit, static_argnames=("spec",))
def _turns(pool: Pool, *, spec: PoolSpec) -> jax.Array:
    """Each slot's row's tokens from its turn's first drawn one, [S, turn_limit] (0 past the row's end)."""
    plan = spec.plan
    rows = jnp.minimum(pool.slots.row, plan.rows_per_queue - 1)  # [Q, Sq] (an empty slot: any row)
    start_of_turn = jax.vmap(lambda t, r: t[r])(pool.rows.turn_start, rows)
    columns = start_of_turn[..., None] + jnp.arange(plan.turn_limit)  # [Q, Sq, T]
    queues = jnp.arange(plan.queues)[:, None, None]
    turns = pool.rows.tokens.at[queues, rows[..., None], columns].get(mode="fill", fill_value=0)
    return spec.pin("replicated", turns.reshape(plan.slots, plan.turn_limit))


@functools.partial(jax.jit, static_argnames=("graphdef", "spec"))
def _start(graphdef, params, prompts, key, version, *, spec: PoolSpec):
    return start(spec, weights(graphdef, params, spec.plan), prompts, key, version)


@functools.partial(jax.jit, static_argnames=("graphdef", "spec"), donate_argnames=("pool",))
def _decode_chunk(graphdef, params, layers, store, pool, version, *, spec: PoolSpec):
    """Decode until the clock reaches the next multiple of the plan's chunk, or nothing can run."""
    plan = spec.plan
    w = weights(graphdef, params, plan, layers)
    pool = pool._replace(version=version)

    def go_on(carry):
        at, p = carry
        free = free_slots(plan, p.slots)
        can_run = ~jnp.all(p.slots.done) | jnp.any(jnp.any(free, axis=1) & jnp.any(p.rows.queued, axis=1))
        return (at < plan.chunk) & can_run

    _, pool = jax.lax.while_loop(go_on, lambda c: (c[0] + 1, step(spec, w, store, c[1])),
                                 (pool.clock % plan.chunk, pool))
    return pool


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _unstack(graphdef, params):
    return unstack_layers(merge_model(graphdef, params).cfg, params["layers"])


def advance(graphdef, params, state: SlotState, chunks: int, version: int) -> SlotState:
    """Decode up to `chunks` chunk boundaries, stopping early when nothing can run."""
    plan = state.spec.plan
    layers = None
    # The unrolled decode reads the layers as separate arrays: split once per params object, not in every chunk
    # program (a copy of every layer weight, ~0.3 s a call for SmolLM2 on CPU).
    if not plan.scanned:
        source, layers = state.unstacked or (None, None)
        if source is not params["layers"]:
            layers = _unstack(graphdef, params)
            state = dataclasses.replace(state, unstacked=(params["layers"], layers))
    for _ in range(chunks):
        if state.idle():
            break
        pool = _decode_chunk(graphdef, params, layers, state.store, state.pool, np.int32(version), spec=state.spec)
        state = dataclasses.replace(state, pool=pool)
    return state


def _with_ids(plan, rows, q, row, length, ids, count):
    """The row's tokens with `count` appended ids (of `ids` [N]) after its `length`: not drawn, no log-prob, no
    version."""
    N = plan.max_new_tokens
    at = jnp.where(jnp.arange(N) < count, length + jnp.arange(N), N)  # past the ids: dropped
    return rows._replace(tokens=rows.tokens.at[q, row, at].set(ids, mode="drop"),
                         logprobs=rows.logprobs.at[q, row, at].set(0.0, mode="drop"),
                         drawn=rows.drawn.at[q, row, at].set(False, mode="drop"),
                         version=rows.version.at[q, row, at].set(-1, mode="drop"),
                         stopped=rows.stopped.at[q, row].set(False))


def _one(plan, x):
    """[Q, 1]: `x` for every queue (a single row's index or count, as the per-queue gathers and writes take it)."""
    return jnp.full((plan.queues, 1), x, jnp.int32)


def _context(plan, store, pool: Pool, q, row, fed):
    """Row `row` of queue q with `fed` tokens in its own pages: what it attends to (the view, [Q, 1, ...]), its
    keys/values as a dense one-row cache [L, 1, E * ps, KVH, Dh], and which of those slots hold a token [E * ps]."""
    ps = plan.page_size
    view = view_of(plan, store, pool.rows, _one(plan, row), _one(plan, fed))
    entries = jnp.arange(view.table.shape[-1])
    valid = (jnp.arange(ps) < view.tokens_in(entries[None, None], ps)[..., None])[q, 0].reshape(-1)

    def one(pool):  # one layer's pool [Q, NP, KVH, ps, Dh] -> queue q's row [1, E * ps, KVH, Dh]
        pages = paged_kv.read_pages(pool, view.table)  # [Q, 1, E, KVH, ps, Dh]
        return kv_quant.per_part(lambda x: jnp.swapaxes(x[q, 0], 1, 2).reshape(1, -1, x.shape[-3], x.shape[-1]),
                                 pages)

    def dense(pools):
        if plan.scanned:
            return jax.vmap(one)(pools[0])
        return kv_quant.per_part(lambda *xs: jnp.stack(xs), *[one(p) for p in pools])

    return view, KVCache(dense(pool.cache.k), dense(pool.cache.v)), valid


def _prefill_turn(spec, store: PromptStore, pool: Pool, w, slot, row, length, ids, count, version) -> Pool:
    """Queue-local `row` (`length` tokens; all but its last, a drawn token not fed yet, in its pages) goes on in
    `slot`: `count` ids (of `ids` [N]) after its tokens, its last token and the ids prefilled into its pages
    (attending to them, not recomputing them), the next turn's first token drawn."""
    plan = spec.plan
    q = slot // plan.slots_per_queue
    N, ps, W = plan.max_new_tokens, plan.page_size, plan.append_width
    rows = _with_ids(plan, pool.rows, q, row, length, ids, count)
    fed = length - 1  # the row's own tokens in its pages
    feed = jax.lax.dynamic_slice(jnp.concatenate([rows.tokens[q, row], jnp.zeros(W, jnp.int32)]), (fed,), (W,))
    view, context, valid = _context(plan, store, pool._replace(rows=rows), q, row, fed)
    width = valid.shape[0]
    positions = view.prompt_len[q, 0] + fed + jnp.arange(W)
    cache = jax.tree.map(lambda x: jnp.pad(x, ((0, 0), (0, 0), (0, W), (0, 0), (0, 0))), context)
    mask = jnp.concatenate([valid, jnp.arange(W) <= count])
    hidden, cache, experts = w.model.routed(feed[None], positions[None], mask[None], cache, width)
    if plan.routing:  # the experts of the fed tokens: the turn's last drawn token and the appended ids
        fed_ids = jnp.where(jnp.arange(W) <= count, fed + jnp.arange(W), N)  # past them: dropped
        rows = rows._replace(routing=rows.routing.at[q, row, fed_ids].set(experts[0].astype(rows.routing.dtype),
                                                                          mode="drop"))
    own = fed + jnp.arange(W)  # the new tokens' own indices; those past the ids are not written
    page = jnp.where(jnp.arange(W) <= count, rows.pages[q, row, jnp.minimum(own // ps, plan.own_pages - 1)],
                     plan.pages)
    page = jnp.where(jnp.arange(plan.queues)[:, None] == q, page[None], plan.pages)  # [Q, W]: queue q's only
    offset = jnp.broadcast_to(own % ps, page.shape)

    def write(pools, new):  # new [L, 1, width + W, KVH, Dh]: the new tokens' keys/values into the row's pages
        new = kv_quant.per_part(lambda x: jnp.broadcast_to(x[:, :, width:], (x.shape[0], plan.queues, W,
                                                                             *x.shape[3:])), new)
        layer = lambda i: kv_quant.per_part(lambda x: x[i], new)  # noqa: E731
        if plan.scanned:
            (stacked,) = pools
            for i in range(new.shape[0]):
                stacked = paged_kv.write_tokens(stacked, layer(i), page, offset, i)
            return (stacked,)
        return tuple(paged_kv.write_tokens(p, layer(i), page, offset) for i, p in enumerate(pools))

    cache = paged_kv.PagedKV(write(pool.cache.k, cache.k), write(pool.cache.v, cache.v))
    pool = pool._replace(rows=rows, cache=spec.pin("cache", cache))
    return _next_turn(spec, store, pool, slot, row, length + count, w.model.logits(hidden[0, count]), version)


def _next_turn(spec, store, pool: Pool, slot, row, length, logits, version) -> Pool:
    """Slot `slot` decodes row `row`'s next turn: its first token drawn from `logits`."""
    plan = spec.plan
    q, j = slot // plan.slots_per_queue, slot % plan.slots_per_queue
    token, logprob = draw(spec, store, jnp.broadcast_to(logits, (plan.queues, 1, logits.shape[-1])),
                          jnp.arange(plan.queues)[:, None], jnp.full((plan.queues, 1), row),
                          jnp.full((plan.queues, 1), length))
    token, logprob = token[q, 0], logprob[q, 0]
    stopped = jnp.isin(token, plan.stops())
    one = lambda x: jnp.asarray(x)[None, None]  # noqa: E731 - a scalar as [Q = 1, n = 1] for the per-queue scatter
    rows = pool.rows
    queue_rows = jax.tree.map(lambda x: x[q][None], rows)
    queue_rows = record(queue_rows, one(row), one(length), one(token), one(logprob), one(stopped), one(True), version)
    rows = jax.tree.map(lambda whole, part: whole.at[q].set(part[0]), rows, queue_rows)
    length = length + 1
    done, held, full = turn_ends(plan, stopped, length, length - 1)
    rows = rows._replace(finished=rows.finished.at[q, row].set(full), turn_start=rows.turn_start.at[q, row].set(
        length - 1))
    sl = pool.slots
    slots = sl._replace(row=sl.row.at[q, j].set(row), last=sl.last.at[q, j].set(token),
                        done=sl.done.at[q, j].set(done), held=sl.held.at[q, j].set(held))
    pool = pool._replace(slots=slots, rows=rows)
    return release(spec, store, pool, _one(plan, row), (jnp.arange(plan.queues)[:, None] == q) & full)


@functools.partial(jax.jit, static_argnames=("graphdef", "spec"), donate_argnames=("pool",))
def _append(graphdef, params, store: PromptStore, pool: Pool, slot, ids, count, version, *, spec: PoolSpec) -> Pool:
    """`slot`: `count` ids (of `ids` [N]) after its row's tokens, its next turn in the same slot."""
    plan = spec.plan
    q, j = slot // plan.slots_per_queue, slot % plan.slots_per_queue
    row = pool.slots.row[q, j]
    return _prefill_turn(spec, store, pool, weights(graphdef, params, plan), slot, row, pool.rows.lengths[q, row],
                         ids, count, version)


@functools.partial(jax.jit, static_argnames=("graphdef", "spec"), donate_argnames=("pool",))
def _resume(graphdef, params, store: PromptStore, pool: Pool, slot, row, ids, count, version, *,
            spec: PoolSpec) -> Pool:
    """Parked queue-local `row` (its keys/values still in its pages): `count` ids after its tokens, its next turn
    in free slot `slot`."""
    plan = spec.plan
    length = pool.rows.lengths[slot // plan.slots_per_queue, row]
    return _prefill_turn(spec, store, pool, weights(graphdef, params, plan), slot, row, length, ids, count, version)


def _padded_ids(plan, token_ids, length: int, row: int) -> tuple[np.ndarray, np.int32]:
    """(the ids padded to N, their count), checked against the row's room and the append width."""
    ids = np.asarray(token_ids, np.int32).reshape(-1)
    room = plan.max_new_tokens - length - 1  # the next turn draws at least one token
    if len(ids) > room:
        raise ValueError(f"row {row} has {length} of its max_new_tokens={plan.max_new_tokens} tokens: {len(ids)} "
                         f"more and a turn do not fit (at most {room}); finish the row instead")
    if len(ids) > plan.append_width - 1 and plan.append_width < plan.max_new_tokens:
        raise ValueError(f"{len(ids)} tokens: an append takes at most {plan.append_width - 1} "
                         "(the sampler's append_tokens)")
    padded = np.zeros(plan.max_new_tokens, np.int32)
    padded[:len(ids)] = ids
    return padded, np.int32(len(ids))


def append(graphdef, params, state: SlotState, slot: int, token_ids, version: int) -> SlotState:
    plan = state.spec.plan
    status = state.status()
    if status.state[slot] != PAUSED:
        raise ValueError(f"slot {slot} is {status.state[slot]}: tokens are appended to a paused row only")
    ids = _padded_ids(plan, token_ids, int(status.length[slot]), int(status.row[slot]))
    pool = _append(graphdef, params, state.store, state.pool, np.int32(slot), *ids, np.int32(version),
                   spec=state.spec)
    return dataclasses.replace(state, pool=pool)


@functools.partial(jax.jit, static_argnames=("spec",), donate_argnames=("pool",))
def _finish(store: PromptStore, pool: Pool, q, j, *, spec: PoolSpec) -> Pool:
    """Slot (q, j)'s paused row is complete: its pages back, the slot free."""
    sl, rows = pool.slots, pool.rows
    row = sl.row[q, j]
    pool = pool._replace(slots=sl._replace(held=sl.held.at[q, j].set(False), done=sl.done.at[q, j].set(True)),
                         rows=rows._replace(finished=rows.finished.at[q, row].set(True, mode="drop")))
    return _released(spec, store, pool, q, row)


def _released(spec, store, pool, q, row):
    plan = spec.plan
    return release(spec, store, pool, _one(plan, row), jnp.arange(plan.queues)[:, None] == q)


def finish(state: SlotState, slot: int) -> SlotState:
    status = state.status()
    if status.state[slot] != PAUSED:
        raise ValueError(f"slot {slot} is {status.state[slot]}: only a paused row can be finished")
    q, j = divmod(slot, state.spec.plan.slots_per_queue)
    pool = _finish(state.store, state.pool, jnp.int32(q), jnp.int32(j), spec=state.spec)
    return dataclasses.replace(state, pool=pool)


@functools.partial(jax.jit, static_argnames=("spec",), donate_argnames=("pool",))
def _park(pool: Pool, q, j, *, spec: PoolSpec) -> Pool:
    sl = pool.slots
    return pool._replace(slots=sl._replace(held=sl.held.at[q, j].set(False), done=sl.done.at[q, j].set(True),
                                           row=sl.row.at[q, j].set(spec.plan.rows_per_queue)))


def park(state: SlotState, slot: int) -> tuple[SlotState, int]:
    """Paused `slot`'s row leaves it, its keys/values kept in its pages: the slot takes a pending row at the next
    `advance`, and the row goes on later with `resume` into a free slot of its queue. Returns (state, the row)."""
    status = state.status()
    if status.state[slot] != PAUSED:
        raise ValueError(f"slot {slot} is {status.state[slot]}: only a paused row can be parked")
    q, j = divmod(slot, state.spec.plan.slots_per_queue)
    row = int(status.row[slot])
    return dataclasses.replace(state, pool=_park(state.pool, jnp.int32(q), jnp.int32(j), spec=state.spec),
                               parked=state.parked | {row}), row


def resume(graphdef, params, state: SlotState, slot: int, row: int, token_ids, version: int) -> SlotState:
    """Parked `row`: `token_ids` after its tokens, its next turn in free `slot` (of the row's queue): the turn and
    the ids prefilled into its pages, as `append` does in place."""
    plan = state.spec.plan
    status = state.status()
    if row not in state.parked:
        raise ValueError(f"row {row} is not parked")
    if status.state[slot] not in (DONE, EMPTY) or slot // plan.slots_per_queue != row // plan.rows_per_queue:
        raise ValueError(f"slot {slot} is {status.state[slot]} or of another queue than row {row}: a parked row "
                         "resumes in a free slot of its queue")
    ids = _padded_ids(plan, token_ids, int(fetch(state.pool.rows.lengths).reshape(-1)[row]), row)
    pool = _resume(graphdef, params, state.store, state.pool, np.int32(slot), np.int32(row % plan.rows_per_queue),
                   *ids, np.int32(version), spec=state.spec)
    return dataclasses.replace(state, pool=pool, parked=state.parked - {row})


@functools.partial(jax.jit, static_argnames=("spec",), donate_argnames=("pool",))
def _finish_row(store: PromptStore, pool: Pool, q, row, *, spec: PoolSpec) -> Pool:
    pool = pool._replace(rows=pool.rows._replace(finished=pool.rows.finished.at[q, row].set(True)))
    return _released(spec, store, pool, q, row)


def finish_row(state: SlotState, row: int) -> SlotState:
    """Parked `row` is complete: its pages back."""
    if row not in state.parked:
        raise ValueError(f"row {row} is not parked")
    Rq = state.spec.plan.rows_per_queue
    pool = _finish_row(state.store, state.pool, jnp.int32(row // Rq), jnp.int32(row % Rq), spec=state.spec)
    return dataclasses.replace(state, pool=pool, parked=state.parked - {row})


def drain(state: SlotState) -> tuple[np.ndarray, SampleOutput, SlotState]:
    """(row indices, their outputs as numpy [n, ...], the state with them marked drained): the complete rows not
    drained before, in row order."""
    out = fetch(outputs(state.spec.plan, state.pool, store=state.store))
    complete = np.asarray(fetch(state.pool.rows.finished)).reshape(-1) & ~state.drained
    rows = np.flatnonzero(complete)
    drained = state.drained | complete
    return rows, out.map(lambda x: np.asarray(x)[rows]), dataclasses.replace(state, drained=drained)


def begin(graphdef, params, spec: PoolSpec, prompts, key, version: int) -> SlotState:
    store, pool = _start(graphdef, params, prompts, key, np.int32(version), spec=spec)
    return SlotState(spec, store, pool, np.zeros(spec.plan.rows, bool))
