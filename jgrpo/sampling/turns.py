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

The programs are the slot pool's (`jgrpo.sampling.slot_pool`) in its interactive form: the same prefill, first
tokens, feed and refill, the same keys (row r's token t is drawn with fold_in(fold_in(key, r), t) whatever the
turn), so a pool driven here draws what `generate` draws (tested token for token). The differences: a slot whose
turn ends keeps its row (held) instead of taking the next one, and its prompt segment has room for the row's
whole context (P + N columns). `append` moves the turn's keys/values from the decode ring into the slot's prompt
segment (a paused slot's ring columns are not overwritten while it waits), prefills the turn's last drawn token
(drawn, not fed yet) and the appended ids after them (attending to the context, not recomputing it), and draws the
next turn's first token from the last logits: prefilling the concatenated prompt up to rounding, at the cost of a
forward over W = 1 + append_tokens tokens (the Sampler's `append_tokens`). `park` keeps the same context aside on
the device, and `resume` does the same prefill from it in another slot. Appended ids are padded to W, so appends of
any length run one compiled program.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jgrpo.models import kv_quant
from jgrpo.models.decode import DecodeCache
from jgrpo.models.layer_stack import unstack_layers
from jgrpo.models.llm import KVCache, merge_model
from jgrpo.parallel.host_arrays import fetch
from jgrpo.sampling.pool import Pool, PoolSpec, PromptStore, SampleOutput, record, turn_ends
from jgrpo.sampling.slot_pool import decode_chunk, draw, local_prompt, outputs, start, weights

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
    # Rows that left their slot between turns (`park`), to `resume` or `finish_row`: their context's keys/values
    # (device arrays, [L, 1, P + N, KVH, Dh]).
    parked: dict[int, KVCache] = dataclasses.field(default_factory=dict)
    unstacked: tuple | None = None  # (params["layers"], its layers split) for the unrolled decode, reused per params

    def status(self) -> SlotStatus:
        plan = self.spec.plan
        sl, stopped = fetch((self.pool.slots, self.pool.rows.stopped))
        Rq = plan.rows_per_queue
        queue = np.repeat(np.arange(plan.queues), plan.slots_per_queue)
        local, done, held = (np.asarray(x).reshape(-1) for x in (sl.row, sl.done, sl.held))
        real = local < Rq
        row = np.where(real, queue * Rq + np.minimum(local, Rq - 1), -1)
        state = np.where(~real, EMPTY, np.where(~done, DECODING, np.where(held, PAUSED, DONE)))
        return SlotStatus(row, np.where(real, sl.count.reshape(-1), 0),
                          np.where(real, (sl.count - sl.turn_start).reshape(-1), 0), state,
                          (state == PAUSED) & np.asarray(stopped).reshape(-1)[np.maximum(row, 0)])

    def turns(self) -> np.ndarray:
        """Each slot's current turn, [S, turn_limit] int32 on every host (its first `status().turn_length` ids
        are the turn's). Cut out and replicated on the devices: a host reads no other part of the pool's rows
        (with several processes, reading the rows themselves would gather all of them through every host)."""
        return np.asarray(fetch(_turns(self.pool, spec=self.spec)))

    def idle(self) -> bool:
        """Nothing can decode until the host appends to or finishes a paused row (or every row is complete)."""
        plan = self.spec.plan
        sl, pending = fetch((self.pool.slots, self.pool.pending))
        free = sl.done & ~sl.held
        return bool(sl.done.all() and (~free.any(axis=1) | (pending >= plan.rows_per_queue)).all())


@functools.partial(jax.jit, static_argnames=("spec",))
def _turns(pool: Pool, *, spec: PoolSpec) -> jax.Array:
    """Each slot's row's tokens from its turn's first drawn one, [S, turn_limit] (0 past the row's end)."""
    plan = spec.plan
    sl = pool.slots
    rows = jnp.minimum(sl.row, plan.rows_per_queue - 1)[..., None]  # [Q, Sq, 1] (an empty slot: any row)
    columns = sl.turn_start[..., None] + jnp.arange(plan.turn_limit)  # [Q, Sq, T]
    queues = jnp.arange(plan.queues)[:, None, None]
    turns = pool.rows.tokens.at[queues, rows, columns].get(mode="fill", fill_value=0)
    return spec.pin("replicated", turns.reshape(plan.slots, plan.turn_limit))


@functools.partial(jax.jit, static_argnames=("graphdef", "spec"))
def _start(graphdef, params, prompts, key, version, *, spec: PoolSpec):
    return start(spec, weights(graphdef, params, spec.plan), prompts, key, version)


@functools.partial(jax.jit, static_argnames=("graphdef", "spec", "chunk", "lap"), donate_argnames=("pool",))
def _decode_chunk(graphdef, params, layers, store, pool, version, *, spec: PoolSpec, chunk: int, lap: bool):
    """Decode until the clock leaves ring chunk `chunk` (from wherever it is in it) or nothing can run."""
    steps = spec.plan.chunk_len - pool.clock % spec.plan.chunk_len if lap else None
    return decode_chunk(spec, weights(graphdef, params, spec.plan, layers), store, pool._replace(version=version),
                        chunk, lap, steps)


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _unstack(graphdef, params):
    return unstack_layers(merge_model(graphdef, params).cfg, params["layers"])


def advance(graphdef, params, state: SlotState, chunks: int, version: int) -> SlotState:
    """Decode up to `chunks` chunk boundaries of the ring, stopping early when nothing can run."""
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
        clock = int(fetch(state.pool.clock))
        chunk, lap = (clock // plan.chunk_len) % plan.chunks, clock >= plan.ring
        pool = _decode_chunk(graphdef, params, layers, state.store, state.pool, np.int32(version), spec=state.spec,
                             chunk=chunk, lap=lap)
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


def _next_turn(spec, store, pool: Pool, rows, slot, row, length, logits, mask, segment, version) -> Pool:
    """Slot `slot` decodes row `row`'s next turn: its first token drawn from `logits`, the slot's context
    (`mask` [P + N], keys/values `segment`) set, writing from the next column on."""
    plan = spec.plan
    q, j = slot // plan.slots_per_queue, slot % plan.slots_per_queue
    token, logprob = draw(spec, store, jnp.broadcast_to(logits, (plan.queues, 1, logits.shape[-1])),
                          jnp.arange(plan.queues)[:, None], jnp.full((plan.queues, 1), row),
                          jnp.full((plan.queues, 1), length))
    token, logprob = token[q, 0], logprob[q, 0]
    stopped = jnp.isin(token, plan.stops())
    one = lambda x: jnp.asarray(x)[None, None]  # noqa: E731 - a scalar as [Q = 1, n = 1] for the per-queue scatter
    queue_rows = jax.tree.map(lambda x: x[q][None], rows)
    queue_rows = record(queue_rows, one(row), one(length), one(token), one(logprob), one(stopped), one(True), version)
    rows = jax.tree.map(lambda whole, part: whole.at[q].set(part[0]), rows, queue_rows)
    length = length + 1
    done, held, full = turn_ends(plan, stopped, length, length - 1)
    rows = rows._replace(finished=rows.finished.at[q, row].set(full))
    sl = pool.slots
    slots = sl._replace(row=sl.row.at[q, j].set(row), start=sl.start.at[q, j].set(pool.clock),
                        count=sl.count.at[q, j].set(length), last=sl.last.at[q, j].set(token),
                        done=sl.done.at[q, j].set(done), held=sl.held.at[q, j].set(held),
                        turn_start=sl.turn_start.at[q, j].set(length - 1),
                        prompt_len=sl.prompt_len.at[q, j].set(jnp.sum(mask, dtype=jnp.int32)),
                        prompt_mask=sl.prompt_mask.at[q, j].set(mask))
    cache = _write_segment(plan, pool.cache, segment, slot)
    return pool._replace(slots=slots, rows=rows, cache=spec.pin("cache", cache))


def _prefill_turn(spec, store: PromptStore, pool: Pool, w, slot, row, context: KVCache, length, ids, count,
                  version) -> Pool:
    """Queue-local `row` (`length` tokens; the keys/values of all but its last, a drawn token not fed yet, in
    `context` [L, 1, P + N, KVH, Dh]) goes on in `slot`: `count` ids (of `ids` [N]) after its tokens, its last token
    and the ids prefilled after the context (attending to it, not recomputing it), the next turn's first token
    drawn."""
    plan = spec.plan
    q = slot // plan.slots_per_queue
    N = plan.max_new_tokens
    rows = _with_ids(plan, pool.rows, q, row, length, ids, count)
    prompt_mask = store.mask[q, local_prompt(plan, store, q, row)]
    P, W = prompt_mask.shape[0], plan.append_width
    fed = length - 1  # the row's tokens whose keys/values are in `context`
    feed = jax.lax.dynamic_slice(jnp.concatenate([rows.tokens[q, row], jnp.zeros(W, jnp.int32)]), (fed,), (W,))
    length = length + count
    mask = jnp.concatenate([prompt_mask, jnp.arange(N) < length])  # the row's context after the append, [P + N]
    positions = jnp.sum(prompt_mask, dtype=jnp.int32) + fed + jnp.arange(W)
    cache = jax.tree.map(lambda x: jnp.pad(x, ((0, 0), (0, 0), (0, W), (0, 0), (0, 0))), context)  # room past the end
    hidden, cache, experts = w.model.routed(feed[None], positions[None],
                                            jnp.concatenate([mask, jnp.zeros(W, bool)])[None], cache, P + fed)
    if plan.routing:  # the experts of the fed tokens: the turn's last drawn token and the appended ids
        fed_ids = jnp.where(jnp.arange(W) <= count, fed + jnp.arange(W), N)  # past them: dropped
        rows = rows._replace(routing=rows.routing.at[q, row, fed_ids].set(experts[0].astype(rows.routing.dtype),
                                                                          mode="drop"))
    context = jax.tree.map(lambda x: x[:, :, :P + N], cache)
    return _next_turn(spec, store, pool, rows, slot, row, length, w.model.logits(hidden[0, count]), mask, context,
                      version)


@functools.partial(jax.jit, static_argnames=("graphdef", "spec"), donate_argnames=("pool",))
def _append(graphdef, params, store: PromptStore, pool: Pool, slot, ids, count, version, *, spec: PoolSpec) -> Pool:
    """`slot`: `count` ids (of `ids` [N]) after its row's tokens, its next turn in the same slot."""
    plan = spec.plan
    q, j = slot // plan.slots_per_queue, slot % plan.slots_per_queue
    sl = pool.slots
    return _prefill_turn(spec, store, pool, weights(graphdef, params, plan), slot, sl.row[q, j],
                         _read_context(plan, pool, slot), sl.count[q, j], ids, count, version)


@functools.partial(jax.jit, static_argnames=("graphdef", "spec"), donate_argnames=("pool",))
def _resume(graphdef, params, store: PromptStore, pool: Pool, slot, row, context, ids, count, version, *,
            spec: PoolSpec) -> Pool:
    """Parked queue-local `row` (its context's keys/values kept when it parked): `count` ids after its tokens, its
    next turn in free slot `slot`."""
    plan = spec.plan
    length = pool.rows.lengths[slot // plan.slots_per_queue, row]
    return _prefill_turn(spec, store, pool, weights(graphdef, params, plan), slot, row, context, length, ids, count,
                         version)


def _read_context(plan, pool: Pool, slot) -> KVCache:
    """Paused `slot`'s row's context as a one-row KVCache [L, 1, P + N, KVH, Dh]: its prompt segment (the context
    before this turn) with the turn's fed tokens' keys/values moved in from the decode ring (the slot's token i of
    the turn was written at ring column (start + i) mod T; a paused slot's columns are not overwritten)."""
    q, j = slot // plan.slots_per_queue, slot % plan.slots_per_queue
    sl = pool.slots
    columns = jnp.mod(sl.start[q, j] + jnp.arange(plan.turn_limit), plan.ring)
    N = plan.max_new_tokens

    def read(per_layer):
        if plan.scanned:
            (segment, *chunks), = per_layer
            context, ring = segment[:, slot], jnp.concatenate([c[:, slot] for c in chunks], axis=2)
        else:
            context = jnp.stack([segment[slot] for segment, *_ in per_layer])  # [L, KVH, P + N, Dh]
            ring = jnp.stack([jnp.concatenate([c[slot] for c in chunks], axis=1) for _, *chunks in per_layer])
        P = context.shape[2] - N
        turn = jnp.take(ring, columns, axis=2)  # [L, KVH, turn_limit, Dh]; past the fed tokens: overwritten later
        context = jnp.pad(context, ((0, 0), (0, 0), (0, plan.turn_limit), (0, 0)))
        context = jax.lax.dynamic_update_slice_in_dim(context, turn.astype(context.dtype), P + sl.turn_start[q, j],
                                                      axis=2)[:, :, :P + N]
        return jnp.swapaxes(context, 1, 2)[:, None]  # [L, 1, P + N, KVH, Dh]

    return kv_quant.per_part(lambda c: KVCache(read(c.k), read(c.v)), pool.cache)


@functools.partial(jax.jit, static_argnames=("spec",))
def _keep(pool: Pool, slot, *, spec: PoolSpec) -> KVCache:
    return _read_context(spec.plan, pool, slot)


def _write_segment(plan, cache: DecodeCache, context, slot) -> DecodeCache:
    """The prefilled context's keys/values [L, 1, P + N, KVH, Dh] as slot `slot`'s prompt segment, every layer."""
    def write(per_layer, new):
        if plan.scanned:
            (segment, *chunks), = per_layer
            return ((segment.at[:, slot].set(new.astype(segment.dtype)), *chunks),)
        return tuple((segment.at[slot].set(new[i].astype(segment.dtype)), *chunks)
                     for i, (segment, *chunks) in enumerate(per_layer))

    def write_both(cache, context):
        k, v = (jnp.swapaxes(x[:, 0], 1, 2) for x in (context.k, context.v))  # [L, KVH, P + N, Dh]
        return DecodeCache(write(cache.k, k), write(cache.v, v))

    return kv_quant.per_part(write_both, cache, context)


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
def _finish(pool: Pool, q, j, *, spec: PoolSpec) -> Pool:
    sl, rows = pool.slots, pool.rows
    return pool._replace(slots=sl._replace(held=sl.held.at[q, j].set(False), done=sl.done.at[q, j].set(True)),
                         rows=rows._replace(finished=rows.finished.at[q, sl.row[q, j]].set(True, mode="drop")))


def finish(state: SlotState, slot: int) -> SlotState:
    status = state.status()
    if status.state[slot] != PAUSED:
        raise ValueError(f"slot {slot} is {status.state[slot]}: only a paused row can be finished")
    q, j = divmod(slot, state.spec.plan.slots_per_queue)
    return dataclasses.replace(state, pool=_finish(state.pool, jnp.int32(q), jnp.int32(j), spec=state.spec))


@functools.partial(jax.jit, static_argnames=("spec",), donate_argnames=("pool",))
def _park(pool: Pool, q, j, *, spec: PoolSpec) -> Pool:
    sl = pool.slots
    return pool._replace(slots=sl._replace(held=sl.held.at[q, j].set(False), done=sl.done.at[q, j].set(True),
                                           row=sl.row.at[q, j].set(spec.plan.rows_per_queue)))


def park(state: SlotState, slot: int) -> tuple[SlotState, int]:
    """Paused `slot`'s row leaves it, its context's keys/values kept aside (on the device: as much memory as a
    slot's prompt segment while it waits): the slot takes a pending row at the next `advance`, and the row goes on
    later with `resume` into a free slot of its queue. Returns (state, the row)."""
    status = state.status()
    if status.state[slot] != PAUSED:
        raise ValueError(f"slot {slot} is {status.state[slot]}: only a paused row can be parked")
    q, j = divmod(slot, state.spec.plan.slots_per_queue)
    row = int(status.row[slot])
    parked = {**state.parked, row: _keep(state.pool, np.int32(slot), spec=state.spec)}
    return dataclasses.replace(state, pool=_park(state.pool, jnp.int32(q), jnp.int32(j), spec=state.spec),
                               parked=parked), row


def resume(graphdef, params, state: SlotState, slot: int, row: int, token_ids, version: int) -> SlotState:
    """Parked `row`: `token_ids` after its tokens, its next turn in free `slot` (of the row's queue): the kept
    context moves there and the turn and the ids are prefilled after it, as `append` does in place."""
    plan = state.spec.plan
    status = state.status()
    if row not in state.parked:
        raise ValueError(f"row {row} is not parked")
    if status.state[slot] not in (DONE, EMPTY) or slot // plan.slots_per_queue != row // plan.rows_per_queue:
        raise ValueError(f"slot {slot} is {status.state[slot]} or of another queue than row {row}: a parked row "
                         "resumes in a free slot of its queue")
    ids = _padded_ids(plan, token_ids, int(fetch(state.pool.rows.lengths).reshape(-1)[row]), row)
    parked = dict(state.parked)
    pool = _resume(graphdef, params, state.store, state.pool, np.int32(slot), np.int32(row % plan.rows_per_queue),
                   parked.pop(row), *ids, np.int32(version), spec=state.spec)
    return dataclasses.replace(state, pool=pool, parked=parked)


@functools.partial(jax.jit, static_argnames=("spec",), donate_argnames=("pool",))
def _finish_row(pool: Pool, q, row, *, spec: PoolSpec) -> Pool:
    return pool._replace(rows=pool.rows._replace(finished=pool.rows.finished.at[q, row].set(True)))


def finish_row(state: SlotState, row: int) -> SlotState:
    """Parked `row` is complete."""
    if row not in state.parked:
        raise ValueError(f"row {row} is not parked")
    Rq = state.spec.plan.rows_per_queue
    pool = _finish_row(state.pool, jnp.int32(row // Rq), jnp.int32(row % Rq), spec=state.spec)
    return dataclasses.replace(state, pool=pool, parked={r: p for r, p in state.parked.items() if r != row})


def drain(state: SlotState) -> tuple[np.ndarray, SampleOutput, SlotState]:
    """(row indices, their outputs as numpy [n, ...], the state with them marked drained): the complete rows not
    drained before, in row order."""
    out = fetch(outputs(state.spec.plan, state.pool, prompts=state.store))
    complete = np.asarray(fetch(state.pool.rows.finished)).reshape(-1) & ~state.drained
    rows = np.flatnonzero(complete)
    drained = state.drained | complete
    return rows, out.map(lambda x: np.asarray(x)[rows]), dataclasses.replace(state, drained=drained)


def begin(graphdef, params, spec: PoolSpec, prompts, key, version: int) -> SlotState:
    store, pool = _start(graphdef, params, prompts, key, np.int32(version), spec=spec)
    return SlotState(spec, store, pool, np.zeros(spec.plan.rows, bool))

