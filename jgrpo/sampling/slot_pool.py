"""The sampler's jitted program: one prefill, then decode over a pool of slots that are refilled as rows stop.

`jgrpo.sampling.sampler.generate` validates and lays out the inputs; this module is what runs on the device:

1. prefill: the B prompts (left-padded) run once through the model; their keys/values are the prompt store
   [L, B, KVH, P, Dh] and their last logits give every row's first token, so a prompt is never prefilled G times;
2. a pool of S slots decodes inside `lax.while_loop`s, one token per slot per step
   (`models.decode.decode_step`, in place in the loop carry). Each slot's cache is [its prompt | generated
   ring of T = chunks x C columns]; every slot writes column `clock mod T` at step `clock`, so the write
   is one slice shared by all rows and the decode step stays copy-free;
3. when a slot's row stops (a stop id or N tokens), the slot takes the next pending row (continuous
   batching): its prompt's keys/values are copied from the store into the slot's prompt segment (only on
   steps where some slot is free and rows are pending, under `lax.cond`), its first token is drawn from the
   prompt's last logits and it starts writing at the next column. A row attends only to its own prompt and
   the columns written since it started, so what a slot held before cannot leak into it.

With S = rows (the default, "static batching") no slot is ever refilled and the program is one pass over
the ring: the first pass attends only to the chunks filled so far (at 64 rows x 256 tokens attention over
every column was ~40% of a step on CPU). With S < rows, once the ring wraps every step reads all of it.

Rows are served by Q queues, one per shard of the row axis (queue q owns rows q*R/Q .. and slots q*S/Q ..),
so every refill, gather and output write stays on the device that holds the row. What crosses devices is one
scalar per step (whether and how wide to refill: every device must take the same branch, and the same loop
exit). The loops are bounded by counters at the worst case, every row running to N (see the laps below).

Randomness: row r draws its token t with `fold_in(fold_in(key, r), t)`, whatever slot it runs in and
whatever else is in flight: the same key gives the same tokens with any slot count, up to float rounding.
The rounding is not the same (a step's matmuls see S rows instead of R; a refilled row's columns lie rotated
in the ring, so its attention sums in another order): on SmolLM2 log-probs differ by ~1e-5, and over many
tokens at temperature 1 a draw within rounding of a boundary can flip and the row go its own way, as static
batching does at another batch size. Tested: identical on the tiny model, and on SmolLM2 the trainer's
log-probs of the tokens, with most rows identical to static (tests/sampling/test_sampler_smollm2.py).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jgrpo.models.decode import (
    DecodeCache,
    decode_cache,
    decode_step,
    decode_step_scanned,
    prompt_store,
    unstack_layers,
)
from jgrpo.models.llm import init_cache, merge_model, position_ids_from_mask


class SampleOutput(NamedTuple):
    tokens: jax.Array  # [B*G, N] int32; pad_id after a row's stop token
    logprobs: jax.Array  # [B*G, N] float32 log-prob under the sampled distribution; 0 where masked
    completion_mask: jax.Array  # [B*G, N] bool; True for generated tokens, the stop token included
    lengths: jax.Array  # [B*G] int32 number of generated tokens
    truncated: jax.Array  # [B*G] bool; True when the row hit max_new_tokens without a stop id


def decode_chunking(max_new_tokens: int, chunk_len: int | None = None) -> tuple[int, int]:
    """(chunk length C, number of chunks) for the generated columns; each chunk is one decode phase.

    A step attends only to the chunks filled so far, so smaller chunks read less of the cache; each chunk
    is one more compiled copy of the decode loop, so by default there are at most 8 and none shorter than 64.
    """
    columns = max(max_new_tokens - 1, 1)  # the last token is drawn but never fed back
    if chunk_len is None:
        chunk_len = min(columns, max(64, -(-columns // 8)))
    if chunk_len < 1:
        raise ValueError(f"decode chunk length must be positive, got {chunk_len}")
    return chunk_len, -(-columns // chunk_len)


class Plan(NamedTuple):
    """The static shape of one sampling program (hashable: part of the jit cache key)."""

    num_samples: int  # G
    max_new_tokens: int  # N
    slots: int  # S
    queues: int  # Q
    chunk_len: int  # C
    chunks: int
    scanned: bool  # decode_step_scanned instead of the unrolled decode_step
    stop_ids: tuple[int, ...]
    pad_id: int


def queue_prompts(batch: int, rows: int, queues: int, group: int) -> np.ndarray:
    """[Q, W] the prompts each queue's rows come from (queue q's rows q*R/Q .. are prompts row // G), padded
    with the queue's last prompt; a queue's local prompt index of local row r is (q*R/Q + r) // G - first[q]."""
    per_queue = rows // queues
    first = np.arange(queues) * per_queue // group
    last = (np.arange(queues) * per_queue + per_queue - 1) // group
    width = int((last - first).max()) + 1
    return np.minimum(first[:, None] + np.arange(width)[None, :], last[:, None])


class _Slots(NamedTuple):  # every field [Q, S/Q] (prompt_mask [Q, S/Q, P])
    row: jax.Array  # int32 the queue-local row the slot decodes; R/Q = none
    start: jax.Array  # int32 the clock at which the row feeds its first token (writes its first column)
    count: jax.Array  # int32 tokens drawn for the row so far = the index of the next one
    last: jax.Array  # int32 the row's latest token, fed at the next step
    done: jax.Array  # bool: the row has stopped (or the slot is empty): the slot is free
    prompt_len: jax.Array  # int32 real tokens in the row's prompt
    prompt_mask: jax.Array  # bool [Q, S/Q, P]


class _Rows(NamedTuple):  # the output, per queue-local row: [Q, R/Q, ...]
    tokens: jax.Array  # [Q, R/Q, N] int32
    logprobs: jax.Array  # [Q, R/Q, N] float32
    lengths: jax.Array  # [Q, R/Q] int32
    stopped: jax.Array  # [Q, R/Q] bool


class _State(NamedTuple):
    clock: jax.Array  # [] int32 decode steps taken = the ring column written next (mod T)
    pending: jax.Array  # [Q] int32 the next queue-local row waiting for a slot (R/Q = none left)
    slots: _Slots
    rows: _Rows
    cache: DecodeCache


def _per_queue(fn, *args):
    """vmap over the leading queue axis: each queue's gathers and scatters stay on its own rows."""
    return jax.vmap(fn)(*args)


@functools.partial(jax.jit, static_argnames=("graphdef", "method", "plan", "constrain"))
def sample(graphdef, params, prompt_tokens, prompt_mask, key, prompt_index=None, *, method, plan: Plan,
           constrain=None) -> SampleOutput:
    """Sample G completions for each of the B left-padded prompts (rows b*G .. b*G+G-1 belong to prompt b).

    `key`: one key, or [B] keys (one per prompt); `prompt_index` [B] (default 0 .. B-1): each prompt's index in
    its own batch. Sample g of prompt b draws its token t with fold_in(fold_in(key_b, index_b * G + g), t), so
    prompts of several batches sampled together get exactly the tokens each batch would get on its own.
    `constrain` (hashable, from the sampler's layout) pins shardings of the cache and per-queue arrays.
    """
    model = merge_model(graphdef, params)
    pin = constrain or (lambda _, x: x)
    B, P = prompt_tokens.shape
    G, N, S, Q, C = plan.num_samples, plan.max_new_tokens, plan.slots, plan.queues, plan.chunk_len
    R = B * G
    Rq, Sq = R // Q, S // Q
    few = max(1, -(-Sq // 4))  # the usual refill width: a step's prompt copies are sized by it, not by all slots
    T = plan.chunks * C  # ring columns
    stops = jnp.asarray(plan.stop_ids or (-1,), jnp.int32)  # -1 never matches a token: "no stop ids"
    pick = jax.vmap(lambda x, i: x[i])  # per queue: x [Q, W, ...], i [Q, n] -> [Q, n, ...]

    def draw(logits, q, row, count):  # logits [Q, n, V]; row, count [Q, n] -> tokens, log-probs [Q, n]
        prompt = local_prompt(q, jnp.minimum(row, Rq - 1))
        row_id = pick(index_q, prompt) * G + (q * Rq + row) % G
        keys = jax.vmap(lambda k, r, t: jax.random.fold_in(jax.random.fold_in(k, r), t))(
            pick(keys_q, prompt).reshape(-1), row_id.reshape(-1), count.reshape(-1))
        tokens, logprobs = method.choose(method.process_logits(logits.reshape(-1, logits.shape[-1])), keys)
        return tokens.reshape(row.shape), logprobs.reshape(row.shape)

    with jax.named_scope("prefill"):
        prefill = pin("prefill", init_cache(model.cfg, B, P))
        hidden, prefill = model(prompt_tokens, position_ids_from_mask(prompt_mask), prompt_mask, prefill, 0)
        last_logits = model.logits(hidden[:, -1])  # [B, V]; left padding puts every prompt's end last
        # Per queue, the prompts its rows come from: store [L, Q, W, KVH, P, Dh], logits [Q, W, V], masks [Q, W, P].
        prompts = jnp.asarray(queue_prompts(B, R, Q, G))
        store = jax.tree.map(lambda x: pin("store", x[:, prompts]), prompt_store(prefill))
        logits_q, mask_q = pin("queues", last_logits[prompts]), pin("queues", prompt_mask[prompts])
        keys_q = jnp.broadcast_to(key, prompts.shape) if key.ndim == 0 else pin("queues", key[prompts])
        index_q = prompts if prompt_index is None else pin("queues", prompt_index[prompts])
        first_prompt = prompts[:, 0]  # [Q]

    def local_prompt(q, row):  # the queue-local prompt index of queue-local rows
        return jnp.minimum((q * Rq + row) // G - first_prompt[q], prompts.shape[1] - 1)

    queue_ids = jnp.arange(Q)[:, None]
    with jax.named_scope("first_tokens"):
        row = jnp.broadcast_to(jnp.arange(Sq), (Q, Sq))
        empty = row >= Rq  # more slots than rows
        row = jnp.where(empty, Rq, row)
        prompt = local_prompt(queue_ids, jnp.minimum(row, Rq - 1))  # [Q, Sq]
        first, first_lp = draw(pick(logits_q, prompt), queue_ids, row, jnp.zeros_like(row))
        slot_prompts = jax.tree.map(lambda x: jax.vmap(pick, (0, None))(x, prompt), store)  # [L, Q, Sq, ...]
        cache = decode_cache(jax.tree.map(lambda x: x.reshape(x.shape[0], S, *x.shape[3:]), slot_prompts),
                             plan.chunks, C, stacked=plan.scanned)
        prompt_masks = pick(mask_q, prompt)
        slots = _Slots(row=row, start=jnp.zeros((Q, Sq), jnp.int32), count=jnp.ones((Q, Sq), jnp.int32),
                       last=first, done=empty | jnp.isin(first, stops) | (N <= 1),
                       prompt_len=jnp.sum(prompt_masks, -1, dtype=jnp.int32), prompt_mask=prompt_masks)
        rows = _Rows(tokens=jnp.full((Q, Rq, N), plan.pad_id, jnp.int32), logprobs=jnp.zeros((Q, Rq, N), jnp.float32),
                     lengths=jnp.zeros((Q, Rq), jnp.int32), stopped=jnp.zeros((Q, Rq), bool))
        rows = _record(rows, slots.row, jnp.zeros_like(row), first, first_lp, jnp.isin(first, stops), ~empty)
        per_queue = functools.partial(jax.tree.map, lambda x: pin("queues", x))
        state = _State(clock=jnp.int32(0), pending=jnp.full((Q,), min(Sq, Rq), jnp.int32), slots=per_queue(slots),
                       rows=per_queue(rows), cache=pin("cache", cache))
    layers = None if plan.scanned else unstack_layers(params["layers"])  # once per call, outside the loop

    def step(s: _State, chunk: int, visible: int) -> _State:
        """One decode step writing ring column `clock` (in chunk `chunk`), attending to `visible` chunks."""
        sl = s.slots
        flat = lambda x: x.reshape(S, *x.shape[2:])  # noqa: E731
        column = jnp.arange(visible * C)
        written_at = s.clock - jnp.mod(s.clock - column, T)  # the clock that last wrote each column
        allowed = jnp.concatenate([flat(sl.prompt_mask), written_at[None, :] >= flat(sl.start)[:, None]], axis=1)
        positions = flat(sl.prompt_len + s.clock - sl.start)
        offset = jnp.mod(s.clock, T) - chunk * C
        args = (flat(sl.last), positions, allowed, s.cache, chunk, offset, visible)
        if plan.scanned:
            hidden, cache = decode_step_scanned(model.cfg, params, *args)
        else:
            hidden, cache = decode_step(model.cfg, params, layers, *args)
        tokens, logprobs = draw(model.logits(hidden).reshape(Q, Sq, -1), queue_ids, sl.row, sl.count)
        active = ~sl.done
        tokens = jnp.where(active, tokens, plan.pad_id)
        stopped = active & jnp.isin(tokens, stops)
        rows = _record(s.rows, sl.row, sl.count, tokens, logprobs, stopped, active)
        count = sl.count + active
        slots = sl._replace(last=tokens, count=count, done=sl.done | stopped | (count >= N))
        s = _State(s.clock + 1, s.pending, slots, rows, pin("cache", cache))
        if S == R:  # static batching: nothing is ever pending
            return s
        # No slot to refill (most steps), a few, or more (a wave of rows that started together and all ran to N).
        starting = jnp.max(jnp.minimum(jnp.sum(slots.done, axis=1), Rq - s.pending))
        branch = jnp.where(starting == 0, 0, jnp.where(starting <= few, 1, 2))
        return jax.lax.switch(branch, (lambda s: s, functools.partial(refill, width=few),
                                       functools.partial(refill, width=Sq)), s)

    def refill(s: _State, width: int) -> _State:
        """Free slots take the next pending rows of their queue, at most `width` per queue: the prompt's
        keys/values copied into the slot, the first token drawn, writing from the next column on."""
        M = width
        sl = s.slots
        rank = jnp.cumsum(sl.done, axis=1) - 1  # [Q, Sq] the free slots' order within their queue
        n = jnp.minimum(jnp.minimum(jnp.sum(sl.done, axis=1), Rq - s.pending), M)  # [Q] rows that start now
        starting = sl.done & (rank < n[:, None])
        # Per queue, M starters: starter m takes slot target[m] (Sq = none) and row pending + m.
        target = _per_queue(lambda r: jnp.full((M,), Sq, jnp.int32).at[r].set(jnp.arange(Sq), mode="drop"),
                            jnp.where(starting, rank, M))
        valid = jnp.arange(M)[None, :] < n[:, None]  # [Q, M]
        row = jnp.where(valid, s.pending[:, None] + jnp.arange(M), Rq)
        prompt = local_prompt(queue_ids, jnp.minimum(row, Rq - 1))  # [Q, M]

        def copy_prompt(segment, stored):  # segment [(L,) S, KVH, P, Dh] <- stored [(L,) Q, W, KVH, P, Dh]
            put = jax.vmap(lambda seg, st, t, src: seg.at[t].set(st[src], mode="drop"))
            if segment.ndim == 4:  # one layer
                return put(segment.reshape(Q, Sq, *segment.shape[1:]), stored, target, prompt).reshape(segment.shape)
            shaped = segment.reshape(segment.shape[0], Q, Sq, *segment.shape[2:])
            return jax.vmap(put, (0, 0, None, None))(shaped, stored, target, prompt).reshape(segment.shape)

        def copy_layers(per_layer, stored):
            if plan.scanned:
                (prompt_seg, *chunks), = per_layer
                return ((copy_prompt(prompt_seg, stored), *chunks),)
            return tuple((copy_prompt(seg, stored[i]), *chunks) for i, (seg, *chunks) in enumerate(per_layer))

        cache = DecodeCache(copy_layers(s.cache.k, store.k), copy_layers(s.cache.v, store.v))
        first, first_lp = draw(pick(logits_q, prompt), queue_ids, row, jnp.zeros_like(row))
        first_stop = jnp.isin(first, stops)
        rows = _record(s.rows, row, jnp.zeros_like(row), first, first_lp, first_stop, valid)
        masks = pick(mask_q, prompt)  # [Q, M, P]

        def put(field, values):  # slot field [Q, Sq, ...] <- values [Q, M, ...] at the starters' slots
            return _per_queue(lambda f, t, v: f.at[t].set(v, mode="drop"), field, target, values)

        slots = _Slots(row=put(sl.row, row), start=put(sl.start, jnp.broadcast_to(s.clock, row.shape)),
                       count=put(sl.count, jnp.ones_like(row)), last=put(sl.last, first),
                       done=put(sl.done, first_stop | (N <= 1)),
                       prompt_len=put(sl.prompt_len, jnp.sum(masks, -1, dtype=jnp.int32)),
                       prompt_mask=put(sl.prompt_mask, masks))
        return _State(s.clock, s.pending + n, slots, rows, pin("cache", cache))

    def finished(s: _State):
        return jnp.all(s.slots.done) & jnp.all(s.pending >= Rq)

    with jax.named_scope("decode"):
        for chunk in range(plan.chunks):  # the first pass over the ring reads only the chunks written so far
            state = jax.lax.while_loop(lambda s, c=chunk: (s.clock < (c + 1) * C) & ~finished(s),
                                       lambda s, c=chunk: step(s, c, c + 1), state)
        if S < R:  # later passes ("laps"): every column may belong to a row in flight
            # Every loop is bounded by a counter, so the compiled program states its worst case (every row runs
            # to N) and the planner can read its trip counts. A row needs at most N - 1 <= T steps after it
            # starts and a free slot takes the next row at once, so the i-th row of a queue starts by step
            # (i // S_q) T and every row is done after ceil(R_q / S_q) passes: the first, then the laps.
            laps = -(-Rq // Sq) - 1

            def lap(carry):
                done_laps, s = carry
                for chunk in range(plan.chunks):
                    s = jax.lax.while_loop(lambda c: (c[0] < C) & ~finished(c[1]),
                                           lambda c, k=chunk: (c[0] + 1, step(c[1], k, plan.chunks)),
                                           (jnp.int32(0), s))[1]
                return done_laps + 1, s

            state = jax.lax.while_loop(lambda c: (c[0] < laps) & ~finished(c[1]), lap, (jnp.int32(0), state))[1]

    out = state.rows
    lengths = out.lengths.reshape(R)
    return SampleOutput(tokens=out.tokens.reshape(R, N), logprobs=out.logprobs.reshape(R, N),
                        completion_mask=jnp.arange(N)[None, :] < lengths[:, None], lengths=lengths,
                        truncated=~out.stopped.reshape(R))


def _record(rows: _Rows, row, index, tokens, logprobs, stopped, active) -> _Rows:
    """Write each active slot's token `index` of its row (queue-local scatters; inactive slots write nothing)."""
    where = jnp.where(active, row, rows.lengths.shape[1])  # out of range = dropped
    at_row = jax.vmap(lambda buf, r, v: buf.at[r].set(v, mode="drop"))
    at_token = jax.vmap(lambda buf, r, i, v: buf.at[r, i].set(v, mode="drop"))
    return _Rows(tokens=at_token(rows.tokens, where, index, tokens),
                 logprobs=at_token(rows.logprobs, where, index, logprobs),
                 lengths=at_row(rows.lengths, where, index + 1), stopped=at_row(rows.stopped, where, stopped))
