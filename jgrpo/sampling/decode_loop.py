"""The sampler's program, top-down: prefill the prompts into pages once, then decode every row one token a step,
a slot taking the next row as soon as its row stops and pages are free.

`jgrpo.sampling.sampler.Sampler` validates and lays out the inputs; this module is what runs on the device, as
named functions of explicit state (the `Pool`, and the `PromptStore` rows start from; `jgrpo.sampling.state`):

1. `prefill` (`jgrpo.sampling.prefill`): the B prompts (left-padded) run once through the model; each prompt's
   keys/values go to pages of its queue's pool (`models/paged_kv.py`), which its G rows share, and its last
   logits give its rows' first tokens;
2. `admit`: free slots take the first waiting rows of their queue (continuous batching), as pages allow: a row
   starts when a page is free for its first token, beside one for every running row about to open a page;
3. `feed`: every slot's row feeds its last token (`models/decode_step.py`): its keys/values go to the row's own
   page, taken from the free pages when a page starts (`ensure_pages`), and it attends to its prompt's pages and
   its own (only those: `models/paged_attention.py`); its next token is drawn. A row that stops gives its pages
   back, and the last row of a prompt its prompt's pages too (`release`);
4. `decode`: `step`s (a `feed`, then `admit` if a slot is free) until every row is done. With `plan.shrink`, once
   no row waits and few are left the loop goes on with half the slots, the rows moved to the first ones
   (`compact`: their page tables move, not their keys/values), so a long tail of lengths decodes a small batch.

A row never runs out of pages mid-way: when the pages of a queue cannot cover this step's new pages, its youngest
rows (fewest tokens) are preempted: their pages given back, their tokens dropped, and they wait to start again
(`preempt`). They draw their tokens again with the same keys, so they end as they would have, up to rounding
(counted: `SampleOutput.preempted`). By default a pool has pages for every slot's row at its longest, and nothing
is ever preempted; `sampler.kv_pages` trades that for more rows in flight.

Rows are served by Q queues, one per shard of the row axis (queue q owns rows q*R/Q .., slots q*S/Q .. and its
own pool of pages), so every gather and write stays on the device that holds the row. `sample` is all of this in
one jitted program; the slot interface (`jgrpo.sampling.turns`) runs the same functions as separate programs.

Randomness: row r draws its token t with `fold_in(fold_in(key, r), t)`, whatever slot it runs in and whatever
else is in flight: the same key gives the same tokens with any slot count, up to float rounding.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jgrpo.models.decode_step import StepInputs, StepOptions, decode_step
from jgrpo.models.layer_stack import unstack_layers
from jgrpo.models.llm import merge_model
from jgrpo.models.paged_kv import PageView
from jgrpo.sampling import pages
from jgrpo.sampling.prefill import prefill
from jgrpo.sampling.state import (
    Plan,
    Pool,
    PoolSpec,
    PromptStore,
    Rows,
    SampleOutput,
    Slots,
    Weights,
    mark,
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
_put = jax.vmap(lambda x, i, v: x.at[i].set(v, mode="drop"))  # per queue: x [Q, R, ...] <- v [Q, n, ...] at i [Q, n]


def local_prompt(plan: Plan, store: PromptStore, q, row):
    """The queue-local prompt index of queue-local rows `row` [Q, n] of queues `q` [Q, 1]."""
    Rq = plan.rows_per_queue
    return jnp.minimum((q * Rq + row) // plan.num_samples - store.first[q], store.logits.shape[1] - 1)


def _queues(plan: Plan):
    return jnp.arange(plan.queues)[:, None]


def draw(spec: PoolSpec, store: PromptStore, logits, q, row, count):
    """Token `count` of rows `row` (queue-local, [Q, n]) from `logits` [Q, n, V]: tokens, log-probs [Q, n].
    Row r of prompt b (index i_b in its batch) draws with fold_in(fold_in(key_b, i_b * G + r mod G), count)."""
    plan, method = spec.plan, spec.method
    Rq, G = plan.rows_per_queue, plan.num_samples
    prompt = local_prompt(plan, store, q, jnp.minimum(row, Rq - 1))
    row_id = _pick(store.index, prompt) * G + (q * Rq + row) % G
    keys = jax.vmap(lambda k, r, t: jax.random.fold_in(jax.random.fold_in(k, r), t))(
        _pick(store.keys, prompt).reshape(-1), row_id.reshape(-1), count.reshape(-1))
    tokens, logprobs = method.choose(method.process_logits(logits.reshape(-1, logits.shape[-1])), keys)
    return tokens.reshape(row.shape), logprobs.reshape(row.shape)


# ------------------------------------------------------------------ 1. prefill: jgrpo.sampling.prefill


# ------------------------------------------------------------------ 2. admit


def free_slots(plan: Plan, slots: Slots):
    """[Q, Sq] bool: slots a waiting row may take (interactive: not held for the host)."""
    return slots.done & ~slots.held if plan.interactive else slots.done


def _opening(plan: Plan, pool: Pool):
    """[Q, Sq] bool: running slots whose next token starts a page of its row's own."""
    length = _pick(pool.rows.lengths, jnp.minimum(pool.slots.row, plan.rows_per_queue - 1))
    return ~pool.slots.done & ((length - 1) % plan.page_size == 0)


def admit(spec: PoolSpec, store: PromptStore, pool: Pool, width: int) -> Pool:
    """Free slots take the first waiting rows of their queue, at most `width` per queue, as pages allow: a row's
    first token is drawn from its prompt's last logits. Multi-turn rows take their pages for N tokens now."""
    plan = spec.plan
    Rq, N, M = plan.rows_per_queue, plan.max_new_tokens, width
    sl, rows = pool.slots, pool.rows
    free = free_slots(plan, sl)
    if plan.interactive:
        room = pool.free.count // plan.own_pages
    else:  # a page for each starter's first token, beside one for every running row about to open a page
        room = pool.free.count - jnp.sum(_opening(plan, pool), axis=1)
    n = jnp.minimum(jnp.minimum(jnp.sum(free, axis=1), jnp.sum(rows.queued, axis=1)), jnp.maximum(room, 0))
    n = jnp.minimum(n, M)  # [Q] rows that start now
    slot_rank = jnp.cumsum(free, axis=1) - 1
    row_rank = jnp.cumsum(rows.queued, axis=1) - 1
    # Per queue, M starters: starter m takes slot target[m] (Sq = none) and the m-th waiting row.
    def starters(rank, ok, size):  # [Q, size] -> [Q, M]: the index whose rank is m, `size` where none
        return jax.vmap(lambda r, o: jnp.full((M,), size, jnp.int32).at[jnp.where(o, r, M)].set(
            jnp.arange(size, dtype=jnp.int32), mode="drop"))(rank, ok)

    target = starters(slot_rank, free & (slot_rank < n[:, None]), free.shape[1])
    valid = jnp.arange(M)[None, :] < n[:, None]  # [Q, M]
    q = _queues(plan)
    if plan.stream:  # the oldest batch's rows first (lanes are reused: a row's index says nothing of its age)
        local = jnp.arange(Rq)[None, :]
        age = _pick(store.order, local_prompt(plan, store, q, local)) * Rq + local
        row = jnp.argsort(jnp.where(rows.queued, age, jnp.iinfo(jnp.int32).max), axis=1)[:, :M].astype(jnp.int32)
    else:
        row = starters(row_rank, rows.queued & (row_rank < n[:, None]), Rq)
    row = jnp.where(valid, row, Rq)
    prompt = local_prompt(plan, store, q, jnp.minimum(row, Rq - 1))
    first, first_lp = draw(spec, store, _pick(store.logits, prompt), q, row, jnp.zeros_like(row))
    first_stop = jnp.isin(first, plan.stops())
    rows = record(rows._replace(queued=_put(rows.queued, row, jnp.zeros_like(valid))), row, jnp.zeros_like(row),
                  first, first_lp, first_stop, valid, pool.version)
    free_pages = pool.free
    if plan.interactive:  # the row's pages for all its N tokens
        free_pages, got = pages.take(free_pages, jnp.repeat(valid, plan.own_pages, axis=1))
        rows = rows._replace(pages=_put(rows.pages, row, got.reshape(*row.shape, plan.own_pages)))
    put = lambda field, values: _put(field, target, values)  # noqa: E731 - slot field <- the starters' values
    done = first_stop | (N <= 1)
    slots = sl._replace(row=put(sl.row, row), last=put(sl.last, first), done=put(sl.done, done))
    if plan.interactive:
        done, held, full = turn_ends(plan, first_stop, jnp.ones_like(row), 0)
        slots = slots._replace(done=put(sl.done, done), held=put(sl.held, held))
        rows = rows._replace(finished=mark(rows.finished, row, valid & full),
                             turn_start=_put(rows.turn_start, row, jnp.zeros_like(row)))
        done = full  # a row that used its N tokens with its first is complete: its pages go back now
    pool = pool._replace(free=free_pages, slots=slots, rows=rows)
    return release(spec, store, pool, row, valid & done)


def release(spec: PoolSpec, store: PromptStore, pool: Pool, row, ended) -> Pool:
    """Rows `row` [Q, n] that are complete where `ended`: their own pages back to the pool, and the pages of each
    prompt whose last row this was."""
    plan = spec.plan
    Rq = plan.rows_per_queue
    rows = pool.rows
    row = jnp.where(ended, row, Rq)
    held = _pick(rows.pages, jnp.minimum(row, Rq - 1))  # [Q, n, OP]
    free = pages.give(pool.free, jnp.where(ended[..., None], held, plan.pages))
    rows = rows._replace(pages=_put(rows.pages, row, jnp.full_like(held, plan.pages)))
    prompt = jnp.where(ended, local_prompt(plan, store, _queues(plan), jnp.minimum(row, Rq - 1)), store.length.shape[1])
    refs = jax.vmap(lambda r, p: r.at[p].add(-1, mode="drop"))(pool.refs, prompt)
    gone = (pool.refs > 0) & (refs == 0)  # [Q, W]
    free = pages.give(free, jnp.where(gone[..., None], store.table, plan.pages))
    return pool._replace(free=free, refs=refs, rows=rows)


# ------------------------------------------------------------------ 3. feed


def view_of(plan: Plan, store: PromptStore, rows: Rows, row, own_len) -> PageView:
    """What rows `row` [Q, n] attend to with `own_len` own tokens: their prompt's pages, then their own."""
    Rq, pp = plan.rows_per_queue, plan.prompt_pages
    row = jnp.minimum(row, Rq - 1)
    prompt = local_prompt(plan, store, _queues(plan), row)
    length = _pick(store.length, prompt)
    prompt_pages = -(-length // plan.page_size)
    both = jnp.concatenate([_pick(store.table, prompt), _pick(rows.pages, row)], axis=-1)  # [Q, n, pp + OP]
    entry = jnp.arange(pp + plan.own_pages)
    own = entry - prompt_pages[..., None]  # [Q, n, e]: the own page an entry holds (< 0: a prompt page)
    table = jnp.take_along_axis(both, jnp.clip(jnp.where(own < 0, entry, pp + own), 0, pp + plan.own_pages - 1),
                                axis=-1)
    return PageView(jnp.where(own >= plan.own_pages, plan.pages, table), prompt_pages, length, own_len)


def ensure_pages(spec: PoolSpec, store: PromptStore, pool: Pool) -> Pool:
    """Every running row whose token this step starts a page of its own gets one; where a queue has too few free
    pages, its youngest rows are preempted first (`preempt`)."""
    plan = spec.plan
    short = jnp.sum(_opening(plan, pool), axis=1) > pool.free.count
    pool = jax.lax.cond(jnp.any(short), functools.partial(preempt, spec, store), lambda p: p, pool)
    opening = _opening(plan, pool)
    free, got = pages.take(pool.free, opening)
    row = jnp.where(opening, pool.slots.row, plan.rows_per_queue)
    length = _pick(pool.rows.lengths, jnp.minimum(row, plan.rows_per_queue - 1))
    at = jax.vmap(lambda p, r, i, v: p.at[r, i].set(v, mode="drop"))
    rows = pool.rows._replace(pages=at(pool.rows.pages, row, (length - 1) // plan.page_size, got))
    return pool._replace(free=free, rows=rows)


def preempt(spec: PoolSpec, store: PromptStore, pool: Pool) -> Pool:
    """In each queue whose free pages cannot cover this step's new pages, the fewest rows that make up the
    difference, youngest first (fewest tokens, then the latest row): their pages back, their tokens dropped, their
    slots free; they wait to start again and draw the same tokens with the same keys."""
    plan = spec.plan
    Rq = plan.rows_per_queue
    sl, rows = pool.slots, pool.rows
    row = jnp.minimum(sl.row, Rq - 1)
    length = _pick(rows.lengths, row)
    running = ~sl.done
    opening = _opening(plan, pool)
    held = jnp.where(running, jnp.sum(_pick(rows.pages, row) < plan.pages, axis=-1), 0)  # [Q, Sq] pages held
    order = jnp.argsort(jnp.where(running, length * (Rq + 1) + (Rq - sl.row), jnp.iinfo(jnp.int32).max), axis=1)
    deficit = jnp.sum(opening, axis=1) - pool.free.count  # [Q]
    gained = jnp.cumsum(jnp.take_along_axis(held + opening, order, axis=1), axis=1)  # pages freed + not needed
    enough = jnp.argmax(gained >= deficit[:, None], axis=1)  # the victims: order[:enough + 1]
    victim_rank = jnp.zeros_like(order).at[_queues(plan), order].set(jnp.arange(order.shape[1])[None, :])
    victim = running & (deficit[:, None] > 0) & (victim_rank <= enough[:, None])
    free = pages.give(pool.free, jnp.where(victim[..., None], _pick(rows.pages, row), plan.pages))
    gone = jnp.where(victim, sl.row, Rq)
    reset = lambda field, value: _put(field, gone, jnp.broadcast_to(value, gone.shape + field.shape[2:]))  # noqa: E731
    rows = rows._replace(tokens=reset(rows.tokens, plan.pad_id), logprobs=reset(rows.logprobs, 0.0),
                         lengths=reset(rows.lengths, 0), stopped=reset(rows.stopped, False),
                         pages=reset(rows.pages, plan.pages), queued=reset(rows.queued, True),
                         preempted=_put(rows.preempted, gone, _pick(rows.preempted, row) + 1))
    if rows.routing is not None:
        rows = rows._replace(routing=reset(rows.routing, 0))
    slots = sl._replace(done=sl.done | victim, row=jnp.where(victim, Rq, sl.row))
    return pool._replace(free=free, slots=slots, rows=rows)


def feed(spec: PoolSpec, w: Weights, store: PromptStore, pool: Pool) -> Pool:
    """Every slot's row feeds its last token (its keys/values into its own page) and draws its next token."""
    plan = spec.plan
    Q, Rq, N, ps = plan.queues, plan.rows_per_queue, plan.max_new_tokens, plan.page_size
    if not plan.interactive:
        pool = ensure_pages(spec, store, pool)
    sl, rows = pool.slots, pool.rows
    Sq = sl.row.shape[1]  # fewer than the plan's once `decode` shrinks the loop
    active = ~sl.done
    row = jnp.minimum(sl.row, Rq - 1)
    length = _pick(rows.lengths, row)
    own = length - 1  # the fed token's index among the row's own tokens
    view = view_of(plan, store, rows, row, jnp.where(active, own + 1, 0))
    page = jnp.where(active, jnp.take_along_axis(_pick(rows.pages, row), (own // ps)[..., None], axis=-1)[..., 0],
                     plan.pages)
    flat = lambda x: x.reshape(Q * Sq, *x.shape[2:])  # noqa: E731 - [Q, Sq, ...] -> [S, ...]
    inputs = StepInputs(flat(sl.last), flat(view.prompt_len + own), view, page, own % ps)
    options = StepOptions(plan.scanned, plan.attention, plan.block)
    hidden, cache, experts = decode_step(w.model.cfg, w.params, w.layers, pool.cache, inputs, options)
    tokens, logprobs = draw(spec, store, w.model.logits(hidden).reshape(Q, Sq, -1), _queues(plan), sl.row, length)
    tokens = jnp.where(active, tokens, plan.pad_id)
    stopped = active & jnp.isin(tokens, plan.stops())
    rows = record(rows, sl.row, length, tokens, logprobs, stopped, active, pool.version)
    if plan.routing:  # the fed token is the row's token count - 1
        rows = record_routing(rows, sl.row, length - 1, experts.reshape(Q, Sq, *experts.shape[1:]), active)
    count = length + active
    ended = active & (stopped | (count >= N))
    slots = sl._replace(last=tokens, done=sl.done | ended)
    if plan.interactive:  # a turn that ends holds its slot for the host; a row that is full is complete
        done, held, full = turn_ends(plan, stopped, count, _pick(rows.turn_start, row))
        slots = sl._replace(last=tokens, done=sl.done | (active & done), held=sl.held | (active & held))
        rows = rows._replace(finished=mark(rows.finished, sl.row, active & full))
        ended = active & full
    busy = None if pool.busy is None else pool.busy + jnp.sum(active, dtype=jnp.int32)
    pool = pool._replace(clock=pool.clock + 1, slots=slots, rows=rows, cache=spec.pin("cache", cache), busy=busy)
    return release(spec, store, pool, sl.row, ended)


# ------------------------------------------------------------------ 4. decode


def step(spec: PoolSpec, w: Weights, store: PromptStore, pool: Pool) -> Pool:
    """`feed`, then free slots take waiting rows (as many as usual in one branch, all of them in another)."""
    plan = spec.plan
    pool = feed(spec, w, store, pool)
    Sq = pool.slots.row.shape[1]
    if plan.slots == plan.rows and not plan.shrink and not plan.interactive:
        # Every row had a slot from the start: only a preempted row ever waits, rarely.
        return jax.lax.cond(jnp.any(pool.rows.queued), functools.partial(admit, spec, store, width=Sq), lambda p: p,
                            pool)
    few = max(1, -(-Sq // 4))  # the usual width: a step's first tokens are sized by it, not by all slots
    starting = jnp.max(jnp.minimum(jnp.sum(free_slots(plan, pool.slots), axis=1), jnp.sum(pool.rows.queued, axis=1)))
    branch = jnp.where(starting == 0, 0, jnp.where(starting <= few, 1, 2))
    return jax.lax.switch(branch, (lambda p: p, functools.partial(admit, spec, store, width=few),
                                   functools.partial(admit, spec, store, width=Sq)), pool)


def finished(plan: Plan, pool: Pool):
    """No row waits and no slot decodes (interactive: nothing can decode until the host acts)."""
    if plan.interactive:
        free = free_slots(plan, pool.slots)
        return jnp.all(pool.slots.done) & jnp.all(~jnp.any(free, axis=1) | ~jnp.any(pool.rows.queued, axis=1))
    return jnp.all(pool.slots.done) & ~jnp.any(pool.rows.queued)


def step_bound(plan: Plan) -> int:
    """Decode steps of the worst case: every row feeding N - 1 tokens (its first is drawn from the prefill), in as
    many rounds as a queue's slots take its rows; twice that where a budget may preempt rows (drawn again)."""
    rounds = -(-plan.rows_per_queue // plan.slots_per_queue)
    return rounds * max(plan.max_new_tokens - 1, 1) * (2 if plan.may_preempt else 1)


def compact(pool: Pool, slots: int) -> Pool:
    """The pool on its first `slots` slots per queue: the slots still decoding moved to the front."""
    order = jnp.argsort(pool.slots.done, axis=1, stable=True)[:, :slots]
    return pool._replace(slots=jax.tree.map(lambda x: jnp.take_along_axis(x, order, axis=1), pool.slots))


def decode(spec: PoolSpec, w: Weights, store: PromptStore, pool: Pool) -> Pool:
    """Decode until every row is done. With `plan.shrink`, on Sq, Sq/2, ... slots per queue: a level ends when no
    row waits and half its slots are enough. Every loop is bounded by the one step counter (`step_bound`), so the
    compiled program states its worst case and the planner can read its trip counts."""
    plan = spec.plan
    bound = step_bound(plan)
    with jax.named_scope("decode"):
        levels = [plan.slots_per_queue >> i for i in range(plan.shrink + 1) if plan.slots_per_queue >> i >= 1]
        for i in range(len(levels)):
            smaller = levels[i + 1] if i + 1 < len(levels) else 0

            def go_on(p, smaller=smaller):
                running = jnp.max(jnp.sum(~p.slots.done, axis=1))
                return (p.clock < bound) & ~finished(plan, p) & (jnp.any(p.rows.queued) | (running > smaller))

            pool = jax.lax.while_loop(go_on, functools.partial(step, spec, w, store), pool)
            if smaller:
                pool = compact(pool, smaller)
    return pool


def outputs(plan: Plan, pool: Pool, version=None, store: PromptStore | None = None) -> SampleOutput:
    """The rows, in order, as [R, ...] arrays. Without the interactive records, every token was drawn with the
    params of `version`. A mixture of experts' rows carry their routing, their prompts' from `store`."""
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
        prompt = local_prompt(plan, store, _queues(plan), rows)  # [Q, Rq]
        prompt_routing = _pick(store.routing, prompt).reshape(R, *store.routing.shape[2:])
    return SampleOutput(tokens=out.tokens.reshape(R, N), logprobs=out.logprobs.reshape(R, N),
                        completion_mask=completion_mask, lengths=lengths, truncated=~out.stopped.reshape(R),
                        loss_mask=loss_mask, version=versions, routing=routing, prompt_routing=prompt_routing,
                        preempted=out.preempted.reshape(R))


def start(spec: PoolSpec, w: Weights, prompts, key, version) -> tuple[PromptStore, Pool]:
    """The pool filled: the prompts prefilled (`prompts`: tokens, mask, index), every slot's row's first token."""
    store, pool = prefill(spec, w.model, prompts.tokens, prompts.mask, key, prompts.index)
    pool = pool._replace(version=version if spec.plan.interactive else None)
    return store, admit(spec, store, pool, spec.plan.slots_per_queue)


@functools.partial(jax.jit, static_argnames=("graphdef", "spec"))
def sample(graphdef, params, prompts, key, version, *, spec: PoolSpec) -> SampleOutput:
    """Sample G completions for each of the B left-padded prompts (rows b*G .. b*G+G-1 belong to prompt b), in
    one program: `start` (prefill, first tokens), `decode` until every row is done, `outputs`. `prompts` is the
    sampler's (tokens [B, P], mask [B, P], index [B] or None); `key`: see `prefill`; `version` [] int32: the
    params' version, recorded with every token."""
    w = weights(graphdef, params, spec.plan)
    store, pool = start(spec, w, prompts, key, version)
    return outputs(spec.plan, decode(spec, w, store, pool), version, store)
