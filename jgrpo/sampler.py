"""On-device sampling for rollouts: one prefill, then the whole decode inside `lax.while_loop`.

One jitted program per (prompt batch shape, samples per prompt, max new tokens, method, stop ids):

1. prefill: the B prompts (left-padded) run once through the model, filling a [L, B, P] KV cache;
2. that cache is broadcast to the G samples of each prompt (rows b*G .. b*G+G-1) inside a
   preallocated [L, B*G, P+N] cache, so a prompt is never prefilled G times;
3. decode: a `while_loop` feeds the last token of every row through `models.decode.decode_step`
   (layers unrolled over per-layer weights and per-layer [R, KVH, S, Dh] caches, so nothing is
   sliced or transposed per step), writes its keys/values in place (the caches are part of the loop
   carry), draws the next token with the sampling method and stops as soon as every row has
   produced a stop id or N tokens.

The cache never leaves the jitted program (it is created and consumed inside), so there is no
host-visible buffer to donate and no cache-sized copy per call. Slots are laid out as
[left padding | prompt | generated], so the cache is exactly P + N long and cannot overflow;
prompts longer than allowed are rejected (or left-truncated) by `left_pad_prompts` before that.

Randomness: row r draws step t with `fold_in(fold_in(key, r), t)`. A row's tokens depend only on
the key, its global row index and the model, not on the batch sharding.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from jgrpo.mesh import SAMPLE_RULES, Rules, logical_shardings, logical_to_spec
from jgrpo.models.decode import DecodeCache, decode_cache_from_prefill, decode_step, unstack_layers
from jgrpo.models.llm import init_cache, merge_model, param_logical_axes, position_ids_from_mask
from jgrpo.sampling_methods import SamplingMethod

__all__ = ["SampleOutput", "SamplingMethod", "generate", "left_pad_prompts", "stop_ids_for"]

# Tokens that close a turn in the chat templates of the supported families (besides the EOS id).
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "<|endoftext|>", "<end_of_turn>")


class SampleOutput(NamedTuple):
    tokens: jax.Array  # [B*G, N] int32; pad_id after a row's stop token
    logprobs: jax.Array  # [B*G, N] float32 log-prob under the sampled distribution; 0 where masked
    completion_mask: jax.Array  # [B*G, N] bool; True for generated tokens, the stop token included
    lengths: jax.Array  # [B*G] int32 number of generated tokens
    truncated: jax.Array  # [B*G] bool; True when the row hit max_new_tokens without a stop id


def left_pad_prompts(
    prompts: Sequence[Sequence[int]],
    *,
    pad_id: int,
    bucket: int = 1,
    max_prompt_length: int | None = None,
    truncate: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
    """Token-id lists -> (tokens [B, P] int32, mask [B, P] bool), left-padded to a multiple of `bucket`.

    A prompt longer than `max_prompt_length` is an error naming it, or, with `truncate`, keeps its
    last `max_prompt_length` tokens (the end of a chat prompt is where the question and the
    assistant header are).
    """
    if not prompts:
        raise ValueError("no prompts to pad")
    if bucket < 1:
        raise ValueError(f"bucket must be a positive integer, got {bucket}")
    rows = [list(p) for p in prompts]
    for i, row in enumerate(rows):
        if not row:
            raise ValueError(f"prompt {i} is empty")
        if max_prompt_length is not None and len(row) > max_prompt_length:
            if not truncate:
                raise ValueError(
                    f"prompt {i} has {len(row)} tokens, more than max_prompt_length={max_prompt_length} "
                    "(shorten it, raise the limit, or enable left truncation)"
                )
            rows[i] = row[-max_prompt_length:]
    longest = max(len(r) for r in rows)
    width = -(-longest // bucket) * bucket
    if max_prompt_length is not None:  # the bucket never pushes past the limit the caller sized things for
        width = min(width, max(max_prompt_length, longest))
    tokens = np.full((len(rows), width), pad_id, np.int32)
    mask = np.zeros((len(rows), width), bool)
    for i, row in enumerate(rows):
        tokens[i, width - len(row):] = row
        mask[i, width - len(row):] = True
    return tokens, mask


def stop_ids_for(tokenizer, extra: Sequence[int] = ()) -> tuple[int, ...]:
    """The tokenizer's EOS id, every end-of-turn token its vocabulary has, and `extra`; sorted, unique."""
    ids = set(int(i) for i in extra)
    eos = tokenizer.eos_token_id
    ids.update([eos] if isinstance(eos, int) else list(eos or ()))
    vocab = tokenizer.get_vocab()
    ids.update(vocab[t] for t in END_OF_TURN_TOKENS if t in vocab)
    if not ids:
        raise ValueError("the tokenizer has no EOS or end-of-turn token; pass stop ids explicitly")
    return tuple(sorted(ids))


@dataclasses.dataclass(frozen=True)
class _Layout:
    """Shardings of the decode state (hashable, so it can be a static argument of the jitted program)."""

    prefill_cache: NamedSharding  # [L, B, P, KVH, Dh]
    cache: NamedSharding  # one layer's decode cache [R, KVH, S, Dh]
    rows: NamedSharding  # [R, ...]


def _layout(mesh: Mesh, rules: Rules, cfg, batch: int, rows: int, prompt_len: int, total_len: int) -> _Layout:
    def sharding(axes, shape):
        return NamedSharding(mesh, logical_to_spec(axes, rules, shape, mesh))

    return _Layout(
        prefill_cache=sharding(("layers", "batch", "length", "kv_heads", "head_dim"),
                               (cfg.num_layers, batch, prompt_len, cfg.num_kv_heads, cfg.head_dim)),
        cache=sharding(("batch", "kv_heads", "length", "head_dim"),
                       (rows, cfg.num_kv_heads, total_len, cfg.head_dim)),
        rows=NamedSharding(mesh, logical_to_spec(("batch", None), rules, (rows, 1), mesh)),
    )


def _constrain(x, sharding):
    return x if sharding is None else jax.lax.with_sharding_constraint(x, sharding)


def _check_prompts(prompt_tokens, prompt_mask) -> int | None:
    """Validate shapes and left padding; return the longest real prompt (None if not visible here)."""
    if prompt_tokens.ndim != 2 or prompt_tokens.shape != prompt_mask.shape:
        raise ValueError(
            f"prompt_tokens {prompt_tokens.shape} and prompt_mask {prompt_mask.shape} must both be [B, P]"
        )
    if isinstance(prompt_mask, jax.Array) and not prompt_mask.is_fully_addressable:
        return None  # multi-process global array: each process validated its own rows when it built them
    mask = np.asarray(prompt_mask, bool)
    if not mask[:, -1].all():
        bad = np.flatnonzero(~mask[:, -1]).tolist()
        raise ValueError(f"prompts {bad} do not end at the last column: prompts must be left-padded and non-empty")
    if (np.diff(mask.astype(np.int8), axis=1) < 0).any():
        raise ValueError("prompt_mask has padding after a real token: prompts must be left-padded")
    return int(mask.sum(axis=1).max())


def generate(
    graphdef,
    params,
    prompt_tokens,
    prompt_mask,
    *,
    num_samples: int,
    max_new_tokens: int,
    method: SamplingMethod,
    stop_ids: Sequence[int],
    key: jax.Array,
    mesh: Mesh | None = None,
    rules: Rules = SAMPLE_RULES,
    pad_id: int = 0,
) -> SampleOutput:
    """Sample `num_samples` completions for each left-padded prompt; rows b*G .. b*G+G-1 belong to prompt b.

    `params` may be any params pytree of `graphdef` (current or behaviour policy). With a `mesh`,
    rows are sharded over the batch axes and heads over tensor (`rules`, SAMPLE_RULES by default);
    params in another layout (e.g. the FSDP training layout, or one device) are resharded first, once per
    call; params already in the sampling layout are used as they are.
    """
    if num_samples < 1 or max_new_tokens < 1:
        raise ValueError(f"num_samples={num_samples} and max_new_tokens={max_new_tokens} must be positive")
    if not isinstance(method, SamplingMethod):
        raise TypeError(f"method must be a SamplingMethod, got {type(method).__name__}")
    longest = _check_prompts(prompt_tokens, prompt_mask)
    stop_ids = tuple(sorted({int(i) for i in stop_ids}))
    batch, prompt_len = prompt_tokens.shape
    cfg = merge_model(graphdef, params).cfg
    limit = getattr(cfg, "max_position_embeddings", None)
    if limit and (longest or prompt_len) + max_new_tokens > limit:
        raise ValueError(
            f"a prompt of {longest or prompt_len} tokens plus max_new_tokens={max_new_tokens} needs more positions "
            f"than the model's max_position_embeddings={limit}"
        )
    layout = None
    if mesh is not None:
        params = jax.device_put(params, logical_shardings(param_logical_axes(params), mesh, rules, shapes=params))
        rows = batch * num_samples
        layout = _layout(mesh, rules, cfg, batch, rows, prompt_len, prompt_len + max_new_tokens)
    return _generate(
        graphdef, params, jnp.asarray(prompt_tokens, jnp.int32), jnp.asarray(prompt_mask, bool), key,
        num_samples=num_samples, max_new_tokens=max_new_tokens, method=method, stop_ids=stop_ids,
        pad_id=int(pad_id), layout=layout,
    )


class _DecodeState(NamedTuple):
    step: jax.Array  # [] int32: index of the next token to generate
    cache: DecodeCache  # L x [R, KVH, S, Dh]
    last: jax.Array  # [R] int32 the latest token of every row
    done: jax.Array  # [R] bool
    tokens: jax.Array  # [R, N] int32
    logprobs: jax.Array  # [R, N] float32
    lengths: jax.Array  # [R] int32


@functools.partial(
    jax.jit,
    static_argnames=("graphdef", "num_samples", "max_new_tokens", "method", "stop_ids", "pad_id", "layout"),
)
def _generate(graphdef, params, prompt_tokens, prompt_mask, key, *, num_samples, max_new_tokens, method,
              stop_ids, pad_id, layout):
    rows_sharding = None if layout is None else layout.rows
    model = merge_model(graphdef, params)
    B, P = prompt_tokens.shape
    G, N = num_samples, max_new_tokens
    R = B * G  # rows
    stops = jnp.asarray(stop_ids or (-1,), jnp.int32)  # -1 never matches a token: "no stop ids"

    # Per-row streams from the one key; row indices are global, so sharding cannot change them.
    row_keys = jax.vmap(jax.random.fold_in, (None, 0))(key, jnp.arange(R))  # [R]

    def draw(logits, step):  # logits [R, V] -> tokens [R], their log-probs [R]
        keys = jax.vmap(jax.random.fold_in, (0, None))(row_keys, step)
        return method.choose(method.process_logits(logits), keys)

    with jax.named_scope("prefill"):
        prefill_cache = jax.tree.map(
            lambda c: _constrain(c, None if layout is None else layout.prefill_cache), init_cache(model.cfg, B, P)
        )
        positions = position_ids_from_mask(prompt_mask)  # [B, P]
        hidden, prefill_cache = model(prompt_tokens, positions, prompt_mask, prefill_cache, 0)
        last_logits = model.logits(hidden[:, -1])  # [B, V]; left padding puts every prompt's end last
        # Each prompt's cache, shared by its G rows, in per-layer full-length caches. L x [R, KVH, S, Dh]
        cache = jax.tree.map(lambda c: _constrain(c, None if layout is None else layout.cache),
                             decode_cache_from_prefill(prefill_cache, G, N))
    layers = unstack_layers(params["layers"])  # once per call, outside the loop

    prompt_lengths = jnp.repeat(jnp.sum(prompt_mask, axis=1, dtype=jnp.int32), G)  # [R]
    # Generated slots are all marked real up front: causality alone hides the ones not yet written.
    kv_mask = _constrain(jnp.concatenate([jnp.repeat(prompt_mask, G, axis=0), jnp.ones((R, N), bool)], 1),
                         rows_sharding)  # [R, S]
    first, first_lp = draw(jnp.repeat(last_logits, G, axis=0), 0)
    state = _DecodeState(
        step=jnp.int32(1),
        cache=cache,
        last=first,
        done=jnp.isin(first, stops),
        tokens=_constrain(jnp.full((R, N), pad_id, jnp.int32).at[:, 0].set(first), rows_sharding),
        logprobs=_constrain(jnp.zeros((R, N), jnp.float32).at[:, 0].set(first_lp), rows_sharding),
        lengths=jnp.ones((R,), jnp.int32),
    )

    def keep_going(s: _DecodeState):
        return (s.step < N) & ~jnp.all(s.done)

    def advance(s: _DecodeState) -> _DecodeState:
        # Feed token step-1 (at slot P + step - 1) and draw token `step`.
        positions = prompt_lengths + s.step - 1  # [R]
        hidden, cache = decode_step(model.cfg, params, layers, s.last, positions, kv_mask, s.cache, P + s.step - 1)
        if layout is not None:
            cache = jax.tree.map(lambda c: _constrain(c, layout.cache), cache)
        tokens, logprobs = draw(model.logits(hidden), s.step)  # [R], [R]
        active = ~s.done
        tokens = jnp.where(active, tokens, pad_id)
        logprobs = jnp.where(active, logprobs, 0.0)
        return _DecodeState(
            step=s.step + 1,
            cache=cache,
            last=tokens,
            done=s.done | jnp.isin(tokens, stops),
            tokens=jax.lax.dynamic_update_slice(s.tokens, tokens[:, None], (0, s.step)),
            logprobs=jax.lax.dynamic_update_slice(s.logprobs, logprobs[:, None], (0, s.step)),
            lengths=s.lengths + active.astype(jnp.int32),
        )

    with jax.named_scope("decode"):
        state = jax.lax.while_loop(keep_going, advance, state)
    completion_mask = jnp.arange(N)[None, :] < state.lengths[:, None]
    return SampleOutput(
        tokens=state.tokens,
        logprobs=state.logprobs,
        completion_mask=completion_mask,
        lengths=state.lengths,
        truncated=~state.done,
    )
