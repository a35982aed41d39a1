"""Per-token log-probs and entropy of given tokens, from hidden states, without ever holding [B, T, V] logits.

The vocabulary projection is done `chunk` positions at a time inside `lax.scan`, and each chunk is
wrapped in `jax.checkpoint`, so the backward pass recomputes that chunk's logits instead of storing
them: peak memory holds one [B, chunk, V] block (plus its softmax), not [B, T, V]. The projection is
`models.llm.vocab_logits`, the sampler's own: operands in the compute dtype, float32 accumulation, so
float32 logits whatever the dtype, rounded exactly as the sampler rounds them.

`process_logits` maps float32 logits [..., V] to the log-probs of the distribution that was actually
sampled (temperature, top-k/top-p/min-p truncation; -inf outside the support). In training it is the
sampler's `SamplingMethod.process_logits`, so trainer and sampler log-probs mean the same thing
(docs/algorithm.md §6). The default is the plain softmax (temperature 1, no truncation). `untruncated`, when
given, is a second map of the same logits (the tempered softmax without truncation, for the KL term):
one projection serves both.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jgrpo.models import llm

ProcessLogits = Callable[[jax.Array], jax.Array]


def _log_softmax(logits: jax.Array) -> jax.Array:
    return jax.nn.log_softmax(logits, axis=-1)


def logprobs_and_entropy(logprobs: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array]:
    """From processed log-probs [..., V]: (log-prob of `targets` [...], entropy [...]).

    Entries outside the support are -inf and contribute 0 to the entropy (p log p -> 0). The double
    `where` keeps their gradient 0 instead of 0 * inf = NaN.
    """
    finite = jnp.isfinite(logprobs)
    safe = jnp.where(finite, logprobs, 0.0)
    entropy = -jnp.sum(jnp.where(finite, jnp.exp(safe) * safe, 0.0), axis=-1)
    chosen = jnp.take_along_axis(logprobs, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
    return chosen, entropy


def token_logprobs(
    hidden: jax.Array,
    unembedding: jax.Array,
    targets: jax.Array,
    *,
    chunk: int,
    process_logits: ProcessLogits | None = None,
    untruncated: ProcessLogits | None = None,
    compute_dtype=None,
    vocab_parallel: tuple | None = None,
) -> tuple[jax.Array, ...]:
    """hidden [B, T, D] (after the final norm), unembedding [D, V], targets [B, T] int -> (logprobs, entropy).

    Both outputs are [B, T] float32: the log-prob of `targets[b, t]` under `process_logits(hidden[b, t] @
    unembedding)` and that distribution's entropy. `hidden[b, t]` must be the state that *predicts*
    `targets[b, t]` (shift before calling). T need not be a multiple of `chunk` (padded internally). A
    target outside a truncated support gets -inf: mask such positions (e.g. padding) in the loss.
    With `untruncated`, a third [B, T] output: the targets' log-probs under `untruncated(logits)`.
    `compute_dtype` (default: hidden's dtype) is the dtype of the projection's operands.
    `vocab_parallel` = (unembedding sharding, logits sharding): shard the vocabulary over the model axes
    (Megatron's vocab-parallel cross-entropy): each chip projects every row onto its slice of the vocabulary
    and the softmax reductions exchange [B, chunk] partial sums. Without it, an unembedding sharded along D
    (FSDP) makes XLA all-reduce whole [B, chunk, V] logits per chunk (the bytes, compiled for a v5e-8:
    docs/tpu_plans.md).
    """
    if hidden.ndim != 3:
        raise ValueError(f"hidden must be [B, T, D], got shape {hidden.shape}")
    if unembedding.ndim != 2 or unembedding.shape[0] != hidden.shape[2]:
        raise ValueError(f"unembedding must be [D, V] with D = {hidden.shape[2]} (hidden's last dim), "
                         f"got shape {unembedding.shape}")
    if targets.shape != hidden.shape[:2]:
        raise ValueError(f"targets must be [B, T] = {hidden.shape[:2]}, got shape {targets.shape}")
    if not jnp.issubdtype(targets.dtype, jnp.integer):
        raise ValueError(f"targets must be integer token ids, got dtype {targets.dtype}")
    if not (isinstance(chunk, int) and chunk > 0):
        raise ValueError(f"chunk must be a positive integer, got {chunk!r}")
    process = _log_softmax if process_logits is None else process_logits
    compute_dtype = hidden.dtype if compute_dtype is None else compute_dtype
    constrain_logits = (lambda x: x)
    if vocab_parallel is not None:  # resharded once, outside the chunk loop
        unembedding = jax.lax.with_sharding_constraint(unembedding, vocab_parallel[0])
        constrain_logits = functools.partial(jax.lax.with_sharding_constraint, shardings=vocab_parallel[1])
    batch, length, dim = hidden.shape
    chunk = min(chunk, length) if length else 1
    pad = (-length) % chunk
    num_chunks = (length + pad) // chunk
    # Padded positions predict token 0 from a zero state: finite, and sliced away below.
    hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
    targets = jnp.pad(targets, ((0, 0), (0, pad)))
    hidden_chunks = hidden.reshape(batch, num_chunks, chunk, dim).swapaxes(0, 1)  # [C, B, chunk, D]
    target_chunks = targets.reshape(batch, num_chunks, chunk).swapaxes(0, 1)  # [C, B, chunk]

    @jax.checkpoint  # backward recomputes this chunk's logits rather than keeping them from the forward
    def one_chunk(h, t):  # [B, chunk, D], [B, chunk]
        logits = constrain_logits(llm.vocab_logits(h, unembedding, compute_dtype))  # [B, chunk, V] float32
        out = logprobs_and_entropy(process(logits), t)
        if untruncated is not None:
            out += (jnp.take_along_axis(untruncated(logits), t[..., None].astype(jnp.int32), axis=-1)[..., 0],)
        return out

    def step(carry, xs):
        return carry, one_chunk(*xs)

    _, outputs = jax.lax.scan(step, None, (hidden_chunks, target_chunks))  # [C, B, chunk] each

    def unchunk(x):
        return x.swapaxes(0, 1).reshape(batch, num_chunks * chunk)[:, :length]

    return tuple(unchunk(x) for x in outputs)
