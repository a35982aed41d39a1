"""The sampler's jitted programs: one prefill, then decode over a pool of slots that are refilled as rows stop.

`jgrpo.sampling.sampler.Sampler` validates and lays out the inputs; this module is what runs on the device, as
named functions of explicit state (the `Pool`, and the `PromptStore` it is filled from):

1. `prefill`: the B prompts (left-padded) run once through the model; their keys/values are the prompt store
   [L, Q, W, KVH, P, Dh] and their last logits give every row's first token, so a prompt is never prefilled G
   times;
2. `first_tokens`: each slot takes a row, draws its first token from its prompt's last logits and gets its
   prompt's keys/values as its cache's prompt segment;
3. `feed`: one token per slot (`models.decode.decode_step`, in place in the loop carry). Each slot's cache is
   [its prompt | generated ring of T = chunks x C columns]; every slot writes column `clock mod T` at step
   `clock`, so the write is one slice shared by all rows and the decode step stays copy-free;
4. `refill`: when a slot's row stops (a stop id or N tokens), the slot takes the next pending row (continuous
   batching): its prompt's keys/values are copied from the store into the slot's prompt segment (only on
   steps where some slot is free and rows are pending, under `lax.cond`), its first token is drawn from the
   prompt's last logits and it starts writing at the next column. A row attends only to its own prompt and
   the columns written since it started, so what a slot held before cannot leak into it;
5. `decode`: the loops of `step`s (a `feed`, then a `refill` if a slot is free): a first pass over the ring
   (`decode_chunk` per chunk, each step attending to the chunks written so far), then, with fewer slots than
   rows, laps over the whole ring until every row is done.

`sample` is these five in one jitted program. The engine's slot-level interface (`Sampler.start / advance`)
runs the same functions as separate programs, returning to the host at chunk boundaries.

With S = rows (the default, "static batching") no slot is ever refilled and the program is one pass over
the ring: the first pass attends only to the chunks filled so far (at 64 rows x 256 tokens attention over
every column was ~40% of a step on CPU). With S < rows, once the ring wraps every step reads all of it.

Rows are served by Q queues, one per shard of the row axis (queue q owns rows q*R/Q .. and slots q*S/Q ..),
so every refill, gather and output write stays on the device that holds the row. What crosses devices is one
scalar per step (whether and how wide to refill: every device must take the same branch, and the same loop
exit). The loops are bounded by counters at the worst case, every row running to N (see `decode`).

Randomness: row r draws its token t with `fold_in(fold_in(key, r), t)`, whatever slot it runs in and
whatever else is in flight: the same key gives the same tokens with any slot count, up to float rounding.
The rounding is not the same (a step's matmuls see S rows instead of R; a refilled row's columns lie rotated
in the ring, so its attention sums in another order): on SmolLM2 log-probs differ by ~1e-5, and over many
tokens at temperature 1 a draw within rounding of a boundary can flip and the row go its own way, as static
batching does at another batch size. Tested: identical on the tiny model, and on SmolLM2 the trainer's
log-probs of the tokens, with most rows identical to static (tests/sampling/test_sampler_smollm2.py).

Dimension names (B, G, R, Q, S, W, P, N, C, T, ...): `jgrpo.sampling.pool`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jgrpo.models import kv_quant
from jgrpo.models.decode import DecodeCache, decode_cache, decode_step_scanned, prompt_store
from jgrpo.models.decode import decode_step as model_decode_step
from jgrpo.models.layer_stack import unstack_layers
from jgrpo.models.llm import KVCache, init_cache, merge_model, position_ids_from_mask
from jgrpo.sampling.pool import (
    Plan,
    Pool,
    PoolSpec,
    PromptStore,
    Rows,
    SampleOutput,
    Slots,
    Weights,
    mark,
    queue_prompts,
    record,
    record_routing,
    turn_ends,
)


def weights(graphdef, params, plan: Plan, layers=None) -> Weights:
    """Inside a program: the model merged, and the stacked layers split once per call, outside every loop (or
    `layers`, split already by a caller that runs many programs with the same params)."""
    model = merge_model(graphdef, params)
    if not plan.scanned and layers is None:
        layers = unstack_layers(model.cfg, params["layers"])
    return Weights(model, params, None if plan.scanned else layers)


_pick = jax.vmap(lambda x, i: x[i])  # per queue: x [Q, W, ...], i [Q, n] -> [Q, n, ...]


def _per_queue(fn, *args):
    """vmap over the leading queue axis: each queue's gathers and scatters stay on its own rows."""
    return jax.vmap(fn)(*args)


def local_prompt(plan: Plan, prompts: PromptStore, q, row):
    """The queue-local prompt index of queue-local rows `row` [Q, n] of queues `q` [Q, 1]."""
    Rq = plan.rows_per_queue
    return jnp.minimum((q * Rq + row) // plan.num_samples - prompts.first[q], prompts.logits.shape[1] - 1)


def draw(spec: PoolSpec, prompts: PromptStore, logits, q, row, count):
    """Token `count` of rows `row` (queue-local, [Q, n]) from `logits` [Q, n, V]: tokens, log-probs [Q, n].
    Row r of prompt b (index i_b in its batch) draws with fold_in(fold_in(key_b, i_b * G + r mod G), count)."""
    plan, method = spec.plan, spec.method
    Rq, G = plan.rows_per_queue, plan.num_samples
    prompt = local_prompt(plan, prompts, q, jnp.minimum(row, Rq - 1))
    row_id = _pick(prompts.index, prompt) * G + (q * Rq + row) % G
    keys = jax.vmap(lambda k, r, t: jax.random.fold_in(jax.random.fold_in(k, r), t))(
        _pick(prompts.keys, prompt).reshape(-1), row_id.reshape(-1), count.reshape(-1))
    tokens, logprobs = method.choose(method.process_logits(logits.reshape(-1, logits.shape[-1])), keys)
    return tokens.reshape(row.shape), logprobs.reshape(row.shape)


def prefill(spec: PoolSpec, model, tokens, mask, key, prompt_index=None) -> PromptStore:
    """Run the B left-padded prompts [B, P] once; lay them out per queue. `key`: one key, or [B] keys;
    `prompt_index` [B] (default 0 .. B-1): each prompt's index in its own batch (see `draw`)."""
    plan = spec.plan
    B, P = tokens.shape
    with jax.named_scope("prefill"):
        cache = spec.pin("prefill", init_cache(model.cfg, B, P, plan.kv_dtype))
        hidden, cache, routing = model.routed(tokens, position_ids_from_mask(mask), mask, cache, 0)
        last_logits = model.logits(hidden[:, -1])  # [B, V]; left padding puts every prompt's end last
        prompts = jnp.asarray(queue_prompts(B, plan.rows, plan.queues, plan.num_samples))  # [Q, W]
        store = jax.tree.map(lambda x: spec.pin("store", x[:, prompts]), prompt_store(cache))
        logits_q, mask_q = spec.pin("queues", last_logits[prompts]), spec.pin("queues", mask[prompts])
        keys_q = jnp.broadcast_to(key, prompts.shape) if key.ndim == 0 else spec.pin("queues", key[prompts])
        index_q = prompts if prompt_index is None else spec.pin("queues", prompt_index[prompts])
        ids = spec.pin("queues", tokens[prompts]) if plan.interactive else None  # a turn's context starts with them
        if plan.routing:  # [Q, W, P, L, k]
            routing = spec.pin("queues", jnp.where(mask[..., None, None], routing, 0).astype(plan.routing[2])[prompts])
        return PromptStore(store, logits_q, mask_q, keys_q, index_q, prompts[:, 0], ids, routing)


def first_tokens(spec: PoolSpec, prompts: PromptStore, version=None) -> Pool:
    """Slot s of queue q takes the queue's row s (if any): its first token drawn, its prompt's keys/values as
    its cache's prompt segment, an empty ring. Interactive: the prompt segment has room for the row's context
    (P + N columns), and `version` is recorded with the tokens."""
    plan = spec.plan
    Q, Rq, Sq, N = plan.queues, plan.rows_per_queue, plan.slots_per_queue, plan.max_new_tokens
    stops = plan.stops()
    with jax.named_scope("first_tokens"):
        queue_ids = jnp.arange(Q)[:, None]
        row = jnp.broadcast_to(jnp.arange(Sq), (Q, Sq))
        empty = row >= Rq  # more slots than rows
        row = jnp.where(empty, Rq, row)
        prompt = local_prompt(plan, prompts, queue_ids, jnp.minimum(row, Rq - 1))  # [Q, Sq]
        first, first_lp = draw(spec, prompts, _pick(prompts.logits, prompt), queue_ids, row, jnp.zeros_like(row))
        slot_prompts = jax.tree.map(lambda x: jax.vmap(_pick, (0, None))(x, prompt), prompts.store)  # [L, Q, Sq, ..]
        prompt_masks = _pick(prompts.mask, prompt)
        if plan.interactive:  # the prompt segment grows by the row's N tokens: the context of its later turns
            slot_prompts = jax.tree.map(lambda x: _widen(x, -2, N), slot_prompts)
            prompt_masks = _widen(prompt_masks, -1, N)
        cache = decode_cache(jax.tree.map(lambda x: x.reshape(x.shape[0], plan.slots, *x.shape[3:]), slot_prompts),
                             plan.chunks, plan.chunk_len, stacked=plan.scanned)
        slots = Slots(row=row, start=jnp.zeros((Q, Sq), jnp.int32), count=jnp.ones((Q, Sq), jnp.int32),
                      last=first, done=empty | jnp.isin(first, stops) | (N <= 1),
                      prompt_len=jnp.sum(prompt_masks, -1, dtype=jnp.int32), prompt_mask=prompt_masks)
        rows = Rows(tokens=jnp.full((Q, Rq, N), plan.pad_id, jnp.int32), logprobs=jnp.zeros((Q, Rq, N), jnp.float32),
                    lengths=jnp.zeros((Q, Rq), jnp.int32), stopped=jnp.zeros((Q, Rq), bool))
        if plan.interactive:
            done, held, full = turn_ends(plan, jnp.isin(first, stops), slots.count, 0)
            slots = slots._replace(done=empty | done, held=~empty & held, turn_start=jnp.zeros((Q, Sq), jnp.int32))
            rows = rows._replace(drawn=jnp.zeros((Q, Rq, N), bool), version=jnp.full((Q, Rq, N), -1, jnp.int32),
                                 finished=mark(jnp.zeros((Q, Rq), bool), row, ~empty & full))
        if plan.routing:
            L, k, dtype = plan.routing
            rows = rows._replace(routing=jnp.zeros((Q, Rq, N, L, k), dtype))
        rows = record(rows, slots.row, jnp.zeros_like(row), first, first_lp, jnp.isin(first, stops), ~empty, version)
        per_queue = functools.partial(jax.tree.map, lambda x: spec.pin("queues", x))
        return Pool(clock=jnp.int32(0), pending=jnp.full((Q,), min(Sq, Rq), jnp.int32), slots=per_queue(slots),
                    rows=per_queue(rows), cache=spec.pin("cache", cache), version=version)


def _widen(x, axis: int, extra: int):
    """`x` zero-padded (False for masks) by `extra` entries at the end of `axis`."""
    pad = [(0, 0)] * x.ndim
    pad[axis % x.ndim] = (0, extra)
    return jnp.pad(x, pad)


def feed(spec: PoolSpec, w: Weights, prompts: PromptStore, pool: Pool, chunk: int, visible: int) -> Pool:
    """Every slot feeds its last token, writing ring column `clock` (in chunk `chunk`) and attending to its
    prompt and the first `visible` chunks, and draws its row's next token."""
    plan = spec.plan
    Q, Sq, S, C, T, N = plan.queues, plan.slots_per_queue, plan.slots, plan.chunk_len, plan.ring, plan.max_new_tokens
    sl = pool.slots
    flat = lambda x: x.reshape(S, *x.shape[2:])  # noqa: E731 - [Q, Sq, ...] -> [S, ...]
    column = jnp.arange(visible * C)
    written_at = pool.clock - jnp.mod(pool.clock - column, T)  # the clock that last wrote each column
    allowed = jnp.concatenate([flat(sl.prompt_mask), written_at[None, :] >= flat(sl.start)[:, None]], axis=1)
    positions = flat(sl.prompt_len + pool.clock - sl.start)
    offset = jnp.mod(pool.clock, T) - chunk * C
    # Interactive: a paused slot's ring columns hold its turn's keys/values until the host appends or parks it.
    keep = flat(sl.held) if plan.interactive else None
    args = (flat(sl.last), positions, allowed, pool.cache, chunk, offset, visible, keep)
    if plan.scanned:
        hidden, cache, experts = decode_step_scanned(w.model.cfg, w.params, *args, merged=plan.merged_softmax)
    else:
        hidden, cache, experts = model_decode_step(w.model.cfg, w.params, w.layers, *args, merged=plan.merged_softmax)
    tokens, logprobs = draw(spec, prompts, w.model.logits(hidden).reshape(Q, Sq, -1), jnp.arange(Q)[:, None],
                            sl.row, sl.count)
    active = ~sl.done
    tokens = jnp.where(active, tokens, plan.pad_id)
    stopped = active & jnp.isin(tokens, plan.stops())
    rows = record(pool.rows, sl.row, sl.count, tokens, logprobs, stopped, active, pool.version)
    if plan.routing:  # the fed token is the row's token count - 1
        rows = record_routing(rows, sl.row, sl.count - 1, experts.reshape(Q, Sq, *experts.shape[1:]), active)
    count = sl.count + active
    slots = sl._replace(last=tokens, count=count, done=sl.done | stopped | (count >= N))
    if plan.interactive:  # a turn that ends holds its slot for the host
        done, held, full = turn_ends(plan, stopped, count, sl.turn_start)
        slots = slots._replace(done=sl.done | (active & done), held=sl.held | (active & held))
        rows = rows._replace(finished=mark(rows.finished, sl.row, active & full))
    return pool._replace(clock=pool.clock + 1, slots=slots, rows=rows, cache=spec.pin("cache", cache))


def refill(spec: PoolSpec, prompts: PromptStore, pool: Pool, width: int) -> Pool:
    """Free slots take the next pending rows of their queue, at most `width` per queue: the prompt's keys/values
    copied into the slot, the first token drawn, writing from the next column on."""
    plan = spec.plan
    Q, Rq, Sq, N, M = plan.queues, plan.rows_per_queue, plan.slots_per_queue, plan.max_new_tokens, width
    sl = pool.slots
    free = free_slots(plan, sl)
    queue_ids = jnp.arange(Q)[:, None]
    rank = jnp.cumsum(free, axis=1) - 1  # [Q, Sq] the free slots' order within their queue
    n = jnp.minimum(jnp.minimum(jnp.sum(free, axis=1), Rq - pool.pending), M)  # [Q] rows that start now
    starting = free & (rank < n[:, None])
    # Per queue, M starters: starter m takes slot target[m] (Sq = none) and row pending + m.
    target = _per_queue(lambda r: jnp.full((M,), Sq, jnp.int32).at[r].set(jnp.arange(Sq), mode="drop"),
                        jnp.where(starting, rank, M))
    valid = jnp.arange(M)[None, :] < n[:, None]  # [Q, M]
    row = jnp.where(valid, pool.pending[:, None] + jnp.arange(M), Rq)
    prompt = local_prompt(plan, prompts, queue_ids, jnp.minimum(row, Rq - 1))  # [Q, M]
    cache = _copy_prompts(plan, pool.cache, prompts.store, target, prompt)
    first, first_lp = draw(spec, prompts, _pick(prompts.logits, prompt), queue_ids, row, jnp.zeros_like(row))
    first_stop = jnp.isin(first, plan.stops())
    rows = record(pool.rows, row, jnp.zeros_like(row), first, first_lp, first_stop, valid, pool.version)
    masks = _pick(prompts.mask, prompt)  # [Q, M, P]
    if plan.interactive:
        masks = _widen(masks, -1, N)

    def put(field, values):  # slot field [Q, Sq, ...] <- values [Q, M, ...] at the starters' slots
        return _per_queue(lambda f, t, v: f.at[t].set(v, mode="drop"), field, target, values)

    slots = Slots(row=put(sl.row, row), start=put(sl.start, jnp.broadcast_to(pool.clock, row.shape)),
                  count=put(sl.count, jnp.ones_like(row)), last=put(sl.last, first),
                  done=put(sl.done, first_stop | (N <= 1)),
                  prompt_len=put(sl.prompt_len, jnp.sum(masks, -1, dtype=jnp.int32)),
                  prompt_mask=put(sl.prompt_mask, masks), held=sl.held, turn_start=sl.turn_start)
    if plan.interactive:
        done, held, full = turn_ends(plan, first_stop, jnp.ones_like(row), 0)
        slots = slots._replace(done=put(sl.done, done), held=put(sl.held, held),
                               turn_start=put(sl.turn_start, jnp.zeros_like(row)))
        rows = rows._replace(finished=mark(rows.finished, row, valid & full))
    return pool._replace(pending=pool.pending + n, slots=slots, rows=rows, cache=spec.pin("cache", cache))


def free_slots(plan: Plan, slots: Slots):
    """[Q, Sq] bool: slots a pending row may take (interactive: not held for the host)."""
    return slots.done & ~slots.held if plan.interactive else slots.done


def _copy_prompts(plan: Plan, cache: DecodeCache, store: KVCache, target, prompt) -> DecodeCache:
    """Prompt `prompt[q, m]`'s keys/values into the prompt segment of slot `target[q, m]` (Sq = none), every layer."""
    Q, Sq = plan.queues, plan.slots_per_queue

    def copy_prompt(segment, stored):  # segment [(L,) S, KVH, P, Dh] <- stored [(L,) Q, W, KVH, P, Dh]
        if segment.shape[-2] != stored.shape[-2]:  # interactive: [prompt | context] segments take the prompt first
            put = jax.vmap(lambda seg, st, t, src: seg.at[t, :, :st.shape[-2]].set(st[src], mode="drop"))
        else:
            put = jax.vmap(lambda seg, st, t, src: seg.at[t].set(st[src], mode="drop"))
        if segment.ndim == 4:  # one layer
            return put(segment.reshape(Q, Sq, *segment.shape[1:]), stored, target, prompt).reshape(segment.shape)
        shaped = segment.reshape(segment.shape[0], Q, Sq, *segment.shape[2:])
        return jax.vmap(put, (0, 0, None, None))(shaped, stored, target, prompt).reshape(segment.shape)

    def copy_layers(per_layer, stored):
        if plan.scanned:
            (prompt_segment, *chunks), = per_layer
            return ((copy_prompt(prompt_segment, stored), *chunks),)
        return tuple((copy_prompt(segment, stored[i]), *chunks) for i, (segment, *chunks) in enumerate(per_layer))

    return kv_quant.per_part(lambda c, s: DecodeCache(copy_layers(c.k, s.k), copy_layers(c.v, s.v)), cache, store)


def step(spec: PoolSpec, w: Weights, prompts: PromptStore, pool: Pool, chunk: int, visible: int) -> Pool:
    """`feed`, then refill the slots that became free (continuous batching; static batching never refills)."""
    plan = spec.plan
    pool = feed(spec, w, prompts, pool, chunk, visible)
    if plan.slots == plan.rows:  # static batching: nothing is ever pending
        return pool
    # No slot to refill (most steps), a few, or more (a wave of rows that started together and all ran to N).
    Rq, Sq = plan.rows_per_queue, plan.slots_per_queue
    few = max(1, -(-Sq // 4))  # the usual refill width: a step's prompt copies are sized by it, not by all slots
    starting = jnp.max(jnp.minimum(jnp.sum(free_slots(plan, pool.slots), axis=1), Rq - pool.pending))
    branch = jnp.where(starting == 0, 0, jnp.where(starting <= few, 1, 2))
    return jax.lax.switch(branch, (lambda p: p, functools.partial(refill, spec, prompts, width=few),
                                   functools.partial(refill, spec, prompts, width=Sq)), pool)


def finished(plan: Plan, pool: Pool):
    """Every slot is free and no row is pending (interactive: nothing can decode until the host acts)."""
    if plan.interactive:
        free = free_slots(plan, pool.slots)
        return jnp.all(pool.slots.done) & jnp.all(~jnp.any(free, axis=1) | (pool.pending >= plan.rows_per_queue))
    return jnp.all(pool.slots.done) & jnp.all(pool.pending >= plan.rows_per_queue)


def decode_chunk(spec: PoolSpec, w: Weights, prompts: PromptStore, pool: Pool, chunk: int, lap: bool,
                 steps=None) -> Pool:
    """Decode in chunk `chunk` of the ring until the clock leaves it (or nothing is left to decode).

    The first pass over the ring (`lap` False) attends to the chunks written so far and runs while the clock is
    in the chunk. A lap (a later pass, with fewer slots than rows) attends to the whole ring and runs `steps`
    steps (default C, from the chunk's first column): a counter, so the compiled loop states its trip count."""
    plan = spec.plan
    if not lap:
        end = (chunk + 1) * plan.chunk_len
        return jax.lax.while_loop(lambda p: (p.clock < end) & ~finished(plan, p),
                                  lambda p: step(spec, w, prompts, p, chunk, chunk + 1), pool)
    steps = plan.chunk_len if steps is None else steps
    return jax.lax.while_loop(lambda c: (c[0] < steps) & ~finished(plan, c[1]),
                              lambda c: (c[0] + 1, step(spec, w, prompts, c[1], chunk, plan.chunks)),
                              (jnp.int32(0), pool))[1]


def laps(plan: Plan) -> int:
    """Passes over the ring after the first, at worst (every row runs to N). A row needs at most N - 1 <= T steps
    after it starts and a free slot takes the next row at once, so the i-th row of a queue starts by step
    (i // Sq) T and every row is done after ceil(Rq / Sq) passes: the first, then the laps."""
    return -(-plan.rows_per_queue // plan.slots_per_queue) - 1


def decode(spec: PoolSpec, w: Weights, prompts: PromptStore, pool: Pool) -> Pool:
    """Decode until every row is done: the first pass over the ring, then (continuous batching) the laps. Every
    loop is bounded by a counter, so the compiled program states its worst case and the planner can read its
    trip counts."""
    plan = spec.plan
    with jax.named_scope("decode"):
        for chunk in range(plan.chunks):  # the first pass over the ring reads only the chunks written so far
            pool = decode_chunk(spec, w, prompts, pool, chunk, lap=False)
        if plan.slots < plan.rows:  # later passes ("laps"): every column may belong to a row in flight

            def lap(carry):
                done_laps, p = carry
                for chunk in range(plan.chunks):
                    p = decode_chunk(spec, w, prompts, p, chunk, lap=True)
                return done_laps + 1, p

            pool = jax.lax.while_loop(lambda c: (c[0] < laps(plan)) & ~finished(plan, c[1]), lap,
                                      (jnp.int32(0), pool))[1]
    return pool


def outputs(plan: Plan, pool: Pool, version=None, prompts: PromptStore | None = None) -> SampleOutput:
    """The rows, in order, as [R, ...] arrays. Without the interactive records, every token was drawn with the
    params of `version`. A mixture of experts' rows carry their routing, their prompts' from `prompts`."""
    R, N = plan.rows, plan.max_new_tokens
    out = pool.rows
    lengths = out.lengths.reshape(R)
    completion_mask = jnp.arange(N)[None, :] < lengths[:, None]
    if plan.interactive:
        loss_mask, versions = out.drawn.reshape(R, N), out.version.reshape(R, N)
    else:
        loss_mask, versions = completion_mask, jnp.where(completion_mask, version, -1).astype(jnp.int32)
    routing = prompt_routing = None
    if plan.routing:
        routing = out.routing.reshape(R, N, *out.routing.shape[3:])
        rows = jnp.broadcast_to(jnp.arange(plan.rows_per_queue), (plan.queues, plan.rows_per_queue))
        prompt = local_prompt(plan, prompts, jnp.arange(plan.queues)[:, None], rows)  # [Q, Rq]
        prompt_routing = _pick(prompts.routing, prompt).reshape(R, *prompts.routing.shape[2:])
    return SampleOutput(tokens=out.tokens.reshape(R, N), logprobs=out.logprobs.reshape(R, N),
                        completion_mask=completion_mask, lengths=lengths, truncated=~out.stopped.reshape(R),
                        loss_mask=loss_mask, version=versions, routing=routing, prompt_routing=prompt_routing)


def start(spec: PoolSpec, w: Weights, prompts, key, version) -> tuple[PromptStore, Pool]:
    """Fill the pool: the prompts prefilled (`prompts`: tokens, mask, index), every slot's first token drawn."""
    store = prefill(spec, w.model, prompts.tokens, prompts.mask, key, prompts.index)
    return store, first_tokens(spec, store, version if spec.plan.interactive else None)


@functools.partial(jax.jit, static_argnames=("graphdef", "spec"))
def sample(graphdef, params, prompts, key, version, *, spec: PoolSpec) -> SampleOutput:
    """Sample G completions for each of the B left-padded prompts (rows b*G .. b*G+G-1 belong to prompt b), in
    one program: `start` (prefill, first tokens), `decode` until every row is done, `outputs`. `prompts` is the
    sampler's (tokens [B, P], mask [B, P], index [B] or None); `key`: see `prefill`; `version` [] int32: the
    params' version, recorded with every token."""
    w = weights(graphdef, params, spec.plan)
    store, pool = start(spec, w, prompts, key, version)
    return outputs(spec.plan, decode(spec, w, store, pool), version, store)
