"""The state of the sampler's slot pool, and the dimension names its shape comments use.

    B  prompts                 G  samples per prompt        R = B*G  rows (completions)
    N  tokens per row           (max_new_tokens)            V  vocabulary
    Q  queues (one per shard of the row axis)               Rq = R/Q  rows a queue serves
    S  slots (rows decoding at once)                        Sq = S/Q  slots a queue owns
    W  prompts a queue's rows come from                     P  prompt width (left-padded)
    C  chunk length             T = chunks*C  ring columns  L layers, KVH kv heads, Dh head dim

A program's static shape is its `Plan`; with how tokens are drawn and where arrays live it is a `PoolSpec`, the
static argument of every jitted function of `jgrpo.sampling.slot_pool`. The dynamic state is the `PromptStore`
(the prefilled prompts slots are filled from) and the `Pool` (clock, pending rows, slots, rows, cache); `record`
and `record_routing` write a step's tokens into the rows, `turn_ends` says where a turn ends.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jgrpo.models.decode import DecodeCache
from jgrpo.models.llm import KVCache


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

    def map(self, fn) -> SampleOutput:
        """`fn` applied to every field that is set (a missing `valid` stays None)."""
        return SampleOutput(*(None if x is None else fn(x) for x in self))


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

    rows: int  # R
    num_samples: int  # G
    max_new_tokens: int  # N
    slots: int  # S
    queues: int  # Q
    chunk_len: int  # C
    chunks: int
    scanned: bool  # decode_step_scanned instead of the unrolled decode_step
    stop_ids: tuple[int, ...]
    pad_id: int
    # The slot interface (`jgrpo.sampling.turns`): a row whose turn ends (a stop id, or `turn_tokens` drawn) keeps
    # its slot, paused, until the host appends tokens to it or finishes it; tokens record their weights version;
    # each slot's prompt segment holds the row's whole context (P + N columns). The ring holds one turn.
    interactive: bool = False
    turn_tokens: int = 0  # 0: max_new_tokens
    append_width: int = 0  # W, the tokens an append prefills: a turn's last drawn token and the appended ids
    # A mixture of experts records the experts of every position it runs (`SampleOutput.routing`): (layers L,
    # experts per token k, the record's dtype); None for a dense model.
    routing: tuple[int, int, str] | None = None
    # The KV cache's dtype (`sampler.kv_cache_dtype` resolved): a float dtype, or "int8" (models/kv_quant.py).
    kv_dtype: str = "float32"
    merged_softmax: bool = False  # the decode's softmax per cache segment (`sampler.decode_softmax: segments`)

    @property
    def rows_per_queue(self) -> int:  # Rq
        return self.rows // self.queues

    @property
    def slots_per_queue(self) -> int:  # Sq
        return self.slots // self.queues

    @property
    def ring(self) -> int:  # T
        return self.chunks * self.chunk_len

    @property
    def turn_limit(self) -> int:
        return self.turn_tokens or self.max_new_tokens

    def stops(self) -> jax.Array:
        return jnp.asarray(self.stop_ids or (-1,), jnp.int32)  # -1 never matches a token: "no stop ids"


class PoolSpec(NamedTuple):
    """The static part of a sampling program: its shapes, how a token is drawn, where its arrays live
    (`layout(name, x)` pins the sharding of the prefill cache, the decode cache, the per-queue arrays and the
    prompt store; None on one device). Hashable: a static argument of the jitted programs."""

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
    """What slots are filled from, per queue: the prefilled prompts its rows come from (W of them)."""

    store: KVCache  # [L, Q, W, KVH, P, Dh] keys / values
    logits: jax.Array  # [Q, W, V] each prompt's last logits (its rows' first tokens are drawn from them)
    mask: jax.Array  # [Q, W, P] bool
    keys: jax.Array  # [Q, W] each prompt's sample key
    index: jax.Array  # [Q, W] int32 each prompt's index in its own batch
    first: jax.Array  # [Q] int32 the queue's first prompt (global index)
    tokens: jax.Array | None = None  # [Q, W, P] int32 the prompts' ids (interactive: a turn prefills its context)
    routing: jax.Array | None = None  # [Q, W, P, L, k] the prompts' experts (a mixture of experts)


class Slots(NamedTuple):  # every field [Q, Sq] (prompt_mask [Q, Sq, P])
    row: jax.Array  # int32 the queue-local row the slot decodes; Rq = none
    start: jax.Array  # int32 the clock at which the row feeds its first token (writes its first column)
    count: jax.Array  # int32 tokens drawn for the row so far = the index of the next one
    last: jax.Array  # int32 the row's latest token, fed at the next step
    done: jax.Array  # bool: the row has stopped (or the slot is empty): the slot is free
    prompt_len: jax.Array  # int32 real tokens in the row's prompt (interactive: its context before this turn)
    prompt_mask: jax.Array  # bool [Q, Sq, P] (interactive: [Q, Sq, P + N], the row's context)
    held: jax.Array | None = None  # bool (interactive): the row's turn ended; the slot waits for the host
    turn_start: jax.Array | None = None  # int32 (interactive): the index of the turn's first drawn token


class Rows(NamedTuple):  # the output, per queue-local row
    tokens: jax.Array  # [Q, Rq, N] int32
    logprobs: jax.Array  # [Q, Rq, N] float32
    lengths: jax.Array  # [Q, Rq] int32
    stopped: jax.Array  # [Q, Rq] bool
    drawn: jax.Array | None = None  # [Q, Rq, N] bool (interactive): drawn by the sampler, not appended
    version: jax.Array | None = None  # [Q, Rq, N] int32 (interactive): the weights version that drew the token
    finished: jax.Array | None = None  # [Q, Rq] bool (interactive): the row is complete (its budget or the host)
    routing: jax.Array | None = None  # [Q, Rq, N, L, k] the experts of each fed token (a mixture of experts)


class Pool(NamedTuple):
    """The decode state: what every step reads and writes."""

    clock: jax.Array  # [] int32 decode steps taken = the ring column written next (mod T)
    pending: jax.Array  # [Q] int32 the next queue-local row waiting for a slot (Rq = none left)
    slots: Slots
    rows: Rows
    cache: DecodeCache
    version: jax.Array | None = None  # [] int32 (interactive): the version of the params decoding now


def queue_prompts(batch: int, rows: int, queues: int, group: int) -> np.ndarray:
    """[Q, W] the prompts each queue's rows come from (queue q's rows q*R/Q .. are prompts row // G), padded
    with the queue's last prompt; a queue's local prompt index of local row r is (q*R/Q + r) // G - first[q]."""
    per_queue = rows // queues
    first = np.arange(queues) * per_queue // group
    last = (np.arange(queues) * per_queue + per_queue - 1) // group
    width = int((last - first).max()) + 1
    return np.minimum(first[:, None] + np.arange(width)[None, :], last[:, None])


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
    return turn_over | full, turn_over & ~full, full


def mark(flags, row, where):
    """flags [Q, Rq] bool set at rows `row` [Q, n] where `where`."""
    return jax.vmap(lambda f, r, w: f.at[jnp.where(w, r, f.shape[0])].set(True, mode="drop"))(flags, row, where)
