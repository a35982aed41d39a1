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

A turn ends at a stop id or after `turn_tokens` drawn tokens; a row is complete when the host finishes it or its
`max_new_tokens` are used (drawn and appended together). `params` may change between calls (a weight update): each
drawn token records the `version` of the params that drew it (`SampleOutput.version`; appended tokens -1, and
out of the loss mask).

The programs are the slot pool's (`jgrpo.sampling.slot_pool`) in its interactive form: the same prefill, first
tokens, feed and refill, the same keys (row r's token t is drawn with fold_in(fold_in(key, r), t) whatever the
turn), so a pool driven here draws what `generate` draws (tested token for token). The differences: a slot whose
turn ends keeps its row (held) instead of taking the next one, and its prompt segment has room for the row's
whole context (P + N columns). `append` prefills that context again, the prompt followed by the row's tokens so
far and the appended ones, into the slot's prompt segment, and draws the next turn's first token from its last
logits: exactly prefilling the concatenated prompt, at the cost of one context-long forward per turn (keeping the
decode's own keys/values instead is a later optimisation). Appended ids are padded to the row's N tokens, so
appends of any length run one compiled program.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jgrpo.models.decode import DecodeCache
from jgrpo.models.llm import init_cache, position_ids_from_mask
from jgrpo.sampling.pool import Pool, PoolSpec, PromptStore, SampleOutput
from jgrpo.sampling.slot_pool import decode_chunk, draw, local_prompt, outputs, record, start, turn_ends, weights

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

    def status(self) -> SlotStatus:
        plan = self.spec.plan
        sl, stopped = jax.device_get((self.pool.slots, self.pool.rows.stopped))
        Rq = plan.rows_per_queue
        queue = np.repeat(np.arange(plan.queues), plan.slots_per_queue)
        local, done, held = (np.asarray(x).reshape(-1) for x in (sl.row, sl.done, sl.held))
        real = local < Rq
        row = np.where(real, queue * Rq + np.minimum(local, Rq - 1), -1)
        state = np.where(~real, EMPTY, np.where(~done, DECODING, np.where(held, PAUSED, DONE)))
        return SlotStatus(row, np.where(real, sl.count.reshape(-1), 0),
                          np.where(real, (sl.count - sl.turn_start).reshape(-1), 0), state,
                          (state == PAUSED) & np.asarray(stopped).reshape(-1)[np.maximum(row, 0)])

    def idle(self) -> bool:
        """Nothing can decode until the host appends to or finishes a paused row (or every row is complete)."""
        plan = self.spec.plan
        sl, pending = jax.device_get((self.pool.slots, self.pool.pending))
        free = sl.done & ~sl.held
        return bool(sl.done.all() and (~free.any(axis=1) | (pending >= plan.rows_per_queue)).all())


@functools.partial(jax.jit, static_argnames=("graphdef", "spec"))
def _start(graphdef, params, prompts, key, version, *, spec: PoolSpec):
    return start(spec, weights(graphdef, params, spec.plan), prompts, key, version)


@functools.partial(jax.jit, static_argnames=("graphdef", "spec", "chunk", "lap"), donate_argnames=("pool",))
def _decode_chunk(graphdef, params, store, pool, version, *, spec: PoolSpec, chunk: int, lap: bool):
    """Decode until the clock leaves ring chunk `chunk` (from wherever it is in it) or nothing can run."""
    steps = spec.plan.chunk_len - pool.clock % spec.plan.chunk_len if lap else None
    return decode_chunk(spec, weights(graphdef, params, spec.plan), store, pool._replace(version=version), chunk,
                        lap, steps)


def advance(graphdef, params, state: SlotState, chunks: int, version: int) -> SlotState:
    """Decode up to `chunks` chunk boundaries of the ring, stopping early when nothing can run."""
    plan = state.spec.plan
    for _ in range(chunks):
        if state.idle():
            break
        clock = int(state.pool.clock)
        chunk, lap = (clock // plan.chunk_len) % plan.chunks, clock >= plan.ring
        pool = _decode_chunk(graphdef, params, state.store, state.pool, np.int32(version), spec=state.spec,
                             chunk=chunk, lap=lap)
        state = dataclasses.replace(state, pool=pool)
    return state


@functools.partial(jax.jit, static_argnames=("graphdef", "spec"), donate_argnames=("pool",))
def _append(graphdef, params, store: PromptStore, pool: Pool, slot, ids, count, version, *, spec: PoolSpec) -> Pool:
    """`slot`: `count` ids (of `ids` [N]) after its row's tokens, its context prefilled into its prompt segment,
    the next turn's first token drawn."""
    plan = spec.plan
    q, j = slot // plan.slots_per_queue, slot % plan.slots_per_queue
    w = weights(graphdef, params, plan)
    N = plan.max_new_tokens
    sl, rows = pool.slots, pool.rows
    row, length = sl.row[q, j], sl.count[q, j]
    # The appended ids join the row's tokens: not drawn, no log-prob, no version.
    at = jnp.where(jnp.arange(N) < count, length + jnp.arange(N), N)  # past the ids: dropped
    rows = rows._replace(tokens=rows.tokens.at[q, row, at].set(ids, mode="drop"),
                         logprobs=rows.logprobs.at[q, row, at].set(0.0, mode="drop"),
                         drawn=rows.drawn.at[q, row, at].set(False, mode="drop"),
                         version=rows.version.at[q, row, at].set(-1, mode="drop"),
                         stopped=rows.stopped.at[q, row].set(False))
    length = length + count
    # The row's context, [prompt (left-padded) | its N tokens, the first `length` real]: prefilled at once.
    prompt = local_prompt(plan, store, q, row)
    context = jnp.concatenate([store.tokens[q, prompt], rows.tokens[q, row]])
    mask = jnp.concatenate([store.mask[q, prompt], jnp.arange(N) < length])
    cache = init_cache(w.model.cfg, 1, context.shape[0])
    hidden, cache = w.model(context[None], position_ids_from_mask(mask[None]), mask[None], cache, 0)
    logits = w.model.logits(hidden[0, context.shape[0] - N + length - 1])  # the last real token's
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
    slots = sl._replace(start=sl.start.at[q, j].set(pool.clock), count=sl.count.at[q, j].set(length),
                        last=sl.last.at[q, j].set(token), done=sl.done.at[q, j].set(done),
                        held=sl.held.at[q, j].set(held), turn_start=sl.turn_start.at[q, j].set(length - 1),
                        prompt_len=sl.prompt_len.at[q, j].set(jnp.sum(mask, dtype=jnp.int32)),
                        prompt_mask=sl.prompt_mask.at[q, j].set(mask))
    cache = _write_segment(plan, pool.cache, cache, slot)
    return pool._replace(slots=slots, rows=rows, cache=spec.pin("cache", cache))


def _write_segment(plan, cache: DecodeCache, context, slot) -> DecodeCache:
    """The prefilled context's keys/values [L, 1, P + N, KVH, Dh] as slot `slot`'s prompt segment, every layer."""
    k, v = (jnp.swapaxes(x[:, 0], 1, 2) for x in (context.k, context.v))  # [L, KVH, P + N, Dh]

    def write(per_layer, new):
        if plan.scanned:
            (segment, *chunks), = per_layer
            return ((segment.at[:, slot].set(new.astype(segment.dtype)), *chunks),)
        return tuple((segment.at[slot].set(new[i].astype(segment.dtype)), *chunks)
                     for i, (segment, *chunks) in enumerate(per_layer))

    return DecodeCache(write(cache.k, k), write(cache.v, v))


def append(graphdef, params, state: SlotState, slot: int, token_ids, version: int) -> SlotState:
    plan = state.spec.plan
    status = state.status()
    if status.state[slot] != PAUSED:
        raise ValueError(f"slot {slot} is {status.state[slot]}: tokens are appended to a paused row only")
    ids = np.asarray(token_ids, np.int32).reshape(-1)
    room = plan.max_new_tokens - int(status.length[slot]) - 1  # the next turn draws at least one token
    if len(ids) > room:
        raise ValueError(f"row {status.row[slot]} has {status.length[slot]} of its max_new_tokens="
                         f"{plan.max_new_tokens} tokens: {len(ids)} more and a turn do not fit (at most {room}); "
                         "finish the row instead")
    padded = np.zeros(plan.max_new_tokens, np.int32)
    padded[:len(ids)] = ids
    pool = _append(graphdef, params, state.store, state.pool, np.int32(slot), padded, np.int32(len(ids)),
                   np.int32(version), spec=state.spec)
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


def drain(state: SlotState) -> tuple[np.ndarray, SampleOutput, SlotState]:
    """(row indices, their outputs as numpy [n, ...], the state with them marked drained): the complete rows not
    drained before, in row order."""
    out = jax.device_get(outputs(state.spec.plan, state.pool))
    complete = np.asarray(jax.device_get(state.pool.rows.finished)).reshape(-1) & ~state.drained
    rows = np.flatnonzero(complete)
    drained = state.drained | complete
    return rows, out.map(lambda x: np.asarray(x)[rows]), dataclasses.replace(state, drained=drained)


def begin(graphdef, params, spec: PoolSpec, prompts, key, version: int) -> SlotState:
    store, pool = _start(graphdef, params, prompts, key, np.int32(version), spec=spec)
    return SlotState(spec, store, pool, np.zeros(spec.plan.rows, bool))

