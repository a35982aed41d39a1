"""The sampler's record (`SampleOutput`), the static shape of a sampling program (`Plan`, `PoolSpec`), and the
dynamic state its loop carries (`PromptStore`, `Pool`), with the dimension names the shape comments use:

    B  prompts                 G  samples per prompt        R = B*G  rows (completions)
    N  tokens per row           (max_new_tokens)            V  vocabulary
    Q  queues (one per shard of the row axis)               Rq = R/Q  rows a queue serves
    S  slots (rows decoding at once)                        Sq = S/Q  slots a queue owns
    W  prompts a queue's rows come from                     P  prompt width (left-padded)
    ps page size (tokens)      NP pages of a queue's pool   pp  pages of a prompt, OP  own pages of a row

`record` and `record_routing` write a step's tokens into the rows, `turn_ends` says where a turn ends.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jgrpo.models.paged_kv import PagedKV
from jgrpo.sampling.pages import FreePages


class SampleOutput(NamedTuple):
    """The sampled rows, per token [R, N] and per row [R]. A row's tokens are what the sampler drew and, between
    turns (the slot interface), tokens the host appended: `loss_mask` tells them apart."""

    tokens: jax.Array  # [R, N] int32; pad_id after the row's last token
    logprobs: jax.Array  # [R, N] float32 log-prob under the sampled distribution; 0 where not drawn
    completion_mask: jax.Array  # [R, N] bool; the row's tokens (the stop token included)
    lengths: jax.Array  # [R] int32 the row's tokens
    truncated: jax.Array  # [R] bool; True when the row hit its token budget without a stop id
    loss_mask: jax.Array  # [R, N] bool; the tokens the sampler drew (appended ones are False)
    version: jax.Array  # [R, N] int32; the weights version that drew each token (-1 where not drawn)
    # [R] bool: the row is in the loss and in its group's statistics; None: every row is (False: a multi-turn
    # episode whose environment failed, env.on_failure: mask).
    valid: jax.Array | None = None
    # A mixture of experts: the experts each position ran through, per layer, from the forward that computed it
    # (uint8 when E <= 256, else int16): `routing` [R, N, L, k] the row's tokens (a token's entry is written when
    # it is fed; the row's last token is never fed: 0), `prompt_routing` [R, P, L, k] its prompt's, from the
    # prefill (left padding: 0). What routing replay (`model.routing_replay`) gives the trainer's forwards.
    routing: jax.Array | None = None
    prompt_routing: jax.Array | None = None
    # [R] int32: how often the row was preempted for lack of pages and drawn again from its start (the same keys:
    # the same tokens up to rounding). Summed into `sampler/preempted`.
    preempted: jax.Array | None = None

    def map(self, fn) -> SampleOutput:
        """`fn` applied to every field that is set (a missing `valid` stays None)."""
        return SampleOutput(*(None if x is None else fn(x) for x in self))


class Plan(NamedTuple):
    """The static shape of one sampling program (hashable: part of the jit cache key)."""

    rows: int  # R
    num_samples: int  # G
    max_new_tokens: int  # N
    slots: int  # S
    queues: int  # Q
    page_size: int  # ps
    pages: int  # NP, pages of a queue's pool (page id NP = none)
    prompt_pages: int  # pp, pages of the widest prompt
    own_pages: int  # OP, pages of a row's own tokens at most
    stop_ids: tuple[int, ...]
    pad_id: int
    scanned: bool  # the decode step's layers under one lax.scan (else unrolled)
    attention: str = "xla"  # `sampler.paged_attention` resolved
    block: int = 8  # table entries the xla attention reads at a time
    # `generate`: the loop runs on fewer slots once fewer rows are left (halving Sq up to `shrink` times), the
    # rows still decoding moved to the first slots (their page tables move, not their keys/values).
    shrink: int = 0
    may_preempt: bool = False  # the pool has fewer pages than every slot's row at its longest (`sampler.kv_pages`)
    # The slot interface (`jgrpo.sampling.turns`): a row whose turn ends (a stop id, or `turn_tokens` drawn) keeps
    # its slot, paused, until the host appends tokens to it or finishes it; tokens record their weights version;
    # a row takes its pages for N tokens when it starts (an episode cannot be drawn again: its environment moved on).
    interactive: bool = False
    turn_tokens: int = 0  # 0: max_new_tokens
    append_width: int = 0  # the tokens an append prefills: a turn's last drawn token and the appended ids
    chunk: int = 0  # the slot interface returns to the host every `chunk` decode steps
    # A stream (`jgrpo.sampling.stream`) of this many lanes (0: none): the slot interface for single-turn rows fed
    # a batch at a time into lanes of the pool while it decodes; a row that stops is complete (its slot free at
    # once, never held for the host), waiting rows start oldest batch first, and the pool counts the slots that
    # drew a token (`Pool.busy`).
    lanes: int = 0
    # A mixture of experts records the experts of every position it runs (`SampleOutput.routing`): (layers L,
    # experts per token k, the record's dtype); None for a dense model.
    routing: tuple[int, int, str] | None = None
    # The KV cache's dtype (`sampler.kv_cache_dtype` resolved): a float dtype, or "int8" (models/kv_quant.py).
    kv_dtype: str = "float32"

    @property
    def rows_per_queue(self) -> int:  # Rq
        return self.rows // self.queues

    @property
    def stream(self) -> bool:
        return self.lanes > 0

    @property
    def slots_per_queue(self) -> int:  # Sq
        return self.slots // self.queues

    @property
    def turn_limit(self) -> int:
        return self.turn_tokens or self.max_new_tokens

    def stops(self) -> jax.Array:
        return jnp.asarray(self.stop_ids or (-1,), jnp.int32)  # -1 never matches a token: "no stop ids"


class PoolSpec(NamedTuple):
    """The static part of a sampling program: its shapes, how a token is drawn, where its arrays live
    (`layout(name, x)` pins the sharding of the prefill cache, the pages, the per-queue arrays; None on one
    device). Hashable: a static argument of the jitted programs."""

    plan: Plan
    method: Any  # jgrpo.sampling.methods.SamplingMethod
    layout: Any = None

    def pin(self, name: str, x):
        return x if self.layout is None else self.layout(name, x)


class Weights(NamedTuple):
    """The params a program decodes with, in the forms the steps read them: the merged model (its config and
    logits), the params pytree, and for the unrolled decode the layers as separate arrays."""

    model: Any
    params: dict
    layers: tuple | None


class PromptStore(NamedTuple):
    """What rows start from, per queue: its W prompts, prefilled once into pages the G rows of each share."""

    logits: jax.Array  # [Q, W, V] each prompt's last logits (its rows' first tokens are drawn from them)
    length: jax.Array  # [Q, W] int32 each prompt's real tokens
    table: jax.Array  # [Q, W, pp] int32 each prompt's pages (NP past its last)
    keys: jax.Array  # [Q, W] each prompt's sample key
    index: jax.Array  # [Q, W] int32 each prompt's index in its own batch
    first: jax.Array  # [Q] int32 the queue's first prompt (global index)
    routing: jax.Array | None = None  # [Q, W, P, L, k] the prompts' experts (a mixture of experts)
    order: jax.Array | None = None  # [Q, W] int32 (a stream): each prompt's batch number; older rows start first


class Slots(NamedTuple):  # every field [Q, Sq]
    row: jax.Array  # int32 the queue-local row the slot decodes; Rq = none
    last: jax.Array  # int32 the row's latest token, fed at the next step
    done: jax.Array  # bool: nothing to decode (the slot is free, or its row stopped)
    held: jax.Array | None = None  # bool (interactive): the row's turn ended; the slot waits for the host


class Rows(NamedTuple):  # the output and each row's pages, per queue-local row
    tokens: jax.Array  # [Q, Rq, N] int32
    logprobs: jax.Array  # [Q, Rq, N] float32
    lengths: jax.Array  # [Q, Rq] int32 tokens so far (drawn and appended)
    stopped: jax.Array  # [Q, Rq] bool
    pages: jax.Array  # [Q, Rq, OP] int32 the row's own pages (NP: not taken)
    queued: jax.Array  # [Q, Rq] bool: waiting for a slot (not started yet, or preempted to start again)
    preempted: jax.Array  # [Q, Rq] int32 times the row was preempted
    drawn: jax.Array | None = None  # [Q, Rq, N] bool (interactive): drawn by the sampler, not appended
    version: jax.Array | None = None  # [Q, Rq, N] int32 (interactive): the weights version that drew the token
    finished: jax.Array | None = None  # [Q, Rq] bool (interactive): the row is complete (its budget or the host)
    turn_start: jax.Array | None = None  # [Q, Rq] int32 (interactive): the index of the turn's first drawn token
    routing: jax.Array | None = None  # [Q, Rq, N, L, k] the experts of each fed token (a mixture of experts)


class Pool(NamedTuple):
    """The decode state: what every step reads and writes."""

    clock: jax.Array  # [] int32 decode steps taken
    free: FreePages  # the pages no row holds
    refs: jax.Array  # [Q, W] int32 each prompt's rows not complete yet (its pages go with the last)
    slots: Slots
    rows: Rows
    cache: PagedKV
    version: jax.Array | None = None  # [] int32 (interactive): the version of the params decoding now
    busy: jax.Array | None = None  # [] int32 (a stream): slot-steps that drew a token (utilization: busy / S clock)


def queue_prompts(batch: int, rows: int, queues: int, group: int) -> np.ndarray:
    """[Q, W] the prompts each queue's rows come from (queue q's rows q*R/Q .. are prompts row // G), padded
    with the queue's last prompt; a queue's local prompt index of local row r is (q*R/Q + r) // G - first[q]."""
    per_queue = rows // queues
    first = np.arange(queues) * per_queue // group
    last = (np.arange(queues) * per_queue + per_queue - 1) // group
    width = int((last - first).max()) + 1
    return np.minimum(first[:, None] + np.arange(width)[None, :], last[:, None])


def queue_groups(rows: int, queues: int, group: int) -> np.ndarray:
    """[Q, W] how many of each queue prompt's rows the queue serves (0 for the padding prompts)."""
    per_queue = rows // queues
    prompts = queue_prompts(rows // group, rows, queues, group)
    starts = np.arange(queues)[:, None] * per_queue
    lo = np.maximum(prompts * group, starts)
    hi = np.minimum((prompts + 1) * group, starts + per_queue)
    count = np.maximum(hi - lo, 0)
    count[:, 1:] *= prompts[:, 1:] != prompts[:, :-1]  # a padding prompt repeats the last one: no rows of its own
    return count.astype(np.int32)


def record(rows: Rows, row, index, tokens, logprobs, stopped, active, version=None) -> Rows:
    """Write each active slot's token `index` of its row (queue-local scatters; inactive slots write nothing);
    interactive rows also record that the sampler drew it, with weights `version`."""
    where = jnp.where(active, row, rows.lengths.shape[1])  # out of range = dropped
    at_row = jax.vmap(lambda buf, r, v: buf.at[r].set(v, mode="drop"))
    at_token = jax.vmap(lambda buf, r, i, v: buf.at[r, i].set(v, mode="drop"))
    written = rows._replace(tokens=at_token(rows.tokens, where, index, tokens),
                            logprobs=at_token(rows.logprobs, where, index, logprobs),
                            lengths=at_row(rows.lengths, where, index + 1),
                            stopped=at_row(rows.stopped, where, stopped))
    if rows.drawn is None:
        return written
    return written._replace(drawn=at_token(rows.drawn, where, index, jnp.ones_like(active)),
                            version=at_token(rows.version, where, index, jnp.broadcast_to(version, tokens.shape)))


def record_routing(rows: Rows, row, index, experts, active) -> Rows:
    """Write the experts [Q, n, L, k] of token `index` of each active slot's row (queue-local scatters)."""
    where = jnp.where(active, row, rows.lengths.shape[1])  # out of range = dropped
    at_token = jax.vmap(lambda buf, r, i, v: buf.at[r, i].set(v, mode="drop"))
    return rows._replace(routing=at_token(rows.routing, where, index, experts.astype(rows.routing.dtype)))


def turn_ends(plan: Plan, stopped, count, turn_start):
    """Interactive: after a token, (the slot stops decoding, it is held for the host, the row is complete). A turn
    ends at a stop id or after `turn_tokens` drawn tokens; a row is complete when its N tokens are used."""
    full = count >= plan.max_new_tokens
    turn_over = stopped | (count - turn_start >= plan.turn_limit)
    if plan.stream:  # one turn: a row that stops is complete, nothing is held
        return turn_over | full, jnp.zeros_like(full), turn_over | full
    return turn_over | full, turn_over & ~full, full


def mark(flags, row, where):
    """flags [Q, Rq] bool set at rows `row` [Q, n] where `where`."""
    return jax.vmap(lambda f, r, w: f.at[jnp.where(w, r, f.shape[0])].set(True, mode="drop"))(flags, row, where)
