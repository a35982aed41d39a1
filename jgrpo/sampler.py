"""On-device sampling for rollouts: one prefill, then the whole decode inside `lax.while_loop`.

One jitted program per (prompt batch shape, samples per prompt, max new tokens, method, stop ids):

1. prefill: the B prompts (left-padded) run once through the model, filling a [L, B, P] KV cache;
2. that cache is broadcast to the G samples of each prompt (rows b*G .. b*G+G-1) in the
   preallocated decode cache, so a prompt is never prefilled G times;
3. decode: `while_loop`s feed the last token of every row through `models.decode.decode_step`
   (layers unrolled over per-layer weights and per-layer caches, so nothing is sliced or
   transposed per step), write its keys/values in place (the caches are part of the loop carry),
   draw the next token with the sampling method and stop as soon as every row has produced a stop
   id or N tokens. The generated slots come in chunks of C (`decode_chunking`), one loop per chunk,
   and a step attends only to the prompt and the chunks filled so far: at 64 rows x 256 tokens
   attention over every slot of a full-length cache was ~40% of a step on CPU.

The cache never leaves the jitted program (it is created and consumed inside), so there is no
host-visible buffer to donate and no cache-sized copy per call. Slots are laid out as
[left padding | prompt | generated chunks], sized from P and N, so the cache cannot overflow;
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
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jgrpo.mesh import SAMPLE_RULES, Rules, logical_shardings, logical_to_spec, mesh_platform, row_sharding
from jgrpo.models.attention_backends import mesh_context
from jgrpo.models.decode import (
    DecodeCache,
    decode_cache_from_prefill,
    decode_step,
    decode_step_scanned,
    resolve_decode_layers,
    unstack_layers,
)
from jgrpo.models.llm import init_cache, merge_model, param_logical_axes, position_ids_from_mask
from jgrpo.sampling_methods import SamplingMethod

__all__ = ["SampleOutput", "SamplingMethod", "decode_options", "generate", "lower_generate",
           "stop_ids_for"]

# Tokens that close a turn in the chat templates of the supported families (besides the EOS id).
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "<|endoftext|>", "<end_of_turn>")


class SampleOutput(NamedTuple):
    tokens: jax.Array  # [B*G, N] int32; pad_id after a row's stop token
    logprobs: jax.Array  # [B*G, N] float32 log-prob under the sampled distribution; 0 where masked
    completion_mask: jax.Array  # [B*G, N] bool; True for generated tokens, the stop token included
    lengths: jax.Array  # [B*G] int32 number of generated tokens
    truncated: jax.Array  # [B*G] bool; True when the row hit max_new_tokens without a stop id


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
    prompt_cache: NamedSharding  # one layer's prompt segment [R, KVH, P, Dh]
    chunk_cache: NamedSharding  # one layer's generated chunk [R, KVH, C, Dh]
    rows: NamedSharding  # [R, ...]


def _layout(mesh: Mesh, rules: Rules, cfg, batch: int, rows: int, prompt_len: int, chunk_len: int) -> _Layout:
    def sharding(axes, shape):
        return NamedSharding(mesh, logical_to_spec(axes, rules, shape, mesh))

    return _Layout(
        prefill_cache=sharding(("layers", "batch", "length", "kv_heads", "head_dim"),
                               (cfg.num_layers, batch, prompt_len, cfg.num_kv_heads, cfg.head_dim)),
        prompt_cache=sharding(("batch", "kv_heads", "length", "head_dim"),
                              (rows, cfg.num_kv_heads, prompt_len, cfg.head_dim)),
        chunk_cache=sharding(("batch", "kv_heads", "length", "head_dim"),
                             (rows, cfg.num_kv_heads, chunk_len, cfg.head_dim)),
        rows=row_sharding(mesh, rules, (rows, 1)),
    )


def _constrain(x, sharding):
    return x if sharding is None else jax.lax.with_sharding_constraint(x, sharding)


def _constrain_cache(cache: DecodeCache, layout: _Layout | None) -> DecodeCache:
    if layout is None:
        return cache

    def sharding(s, x):  # a stacked segment [L, ...] keeps its layer axis whole
        return s if x.ndim == 4 else NamedSharding(s.mesh, PartitionSpec(None, *s.spec))

    def segments(per_layer):  # each layer (or the one stacked entry): (prompt segment, chunk 0, chunk 1, ...)
        return tuple((_constrain(prompt, sharding(layout.prompt_cache, prompt)),
                      *(_constrain(c, sharding(layout.chunk_cache, c)) for c in chunks))
                     for prompt, *chunks in per_layer)

    return DecodeCache(segments(cache.k), segments(cache.v))


def _platform(mesh: Mesh | None) -> str:
    return mesh_platform(mesh) if mesh is not None else jax.devices()[0].platform


def decode_options(sampler_config) -> dict:
    """`generate`'s decode keywords from a `jgrpo.config.SamplerConfig`."""
    return dict(decode_chunk=sampler_config.decode_chunk or None, decode_layers=sampler_config.decode_layers)


def decode_chunking(max_new_tokens: int, chunk_len: int | None = None) -> tuple[int, int]:
    """(chunk length C, number of chunks) for the generated slots; each chunk is one decode phase.

    A step attends only to the chunks filled so far, so smaller chunks read less of the cache; each chunk
    is one more compiled copy of the decode loop, so by default there are at most 8 and none shorter than 64.
    """
    slots = max(max_new_tokens - 1, 1)  # the last token is drawn but never fed back
    if chunk_len is None:
        chunk_len = min(slots, max(64, -(-slots // 8)))
    if chunk_len < 1:
        raise ValueError(f"decode chunk length must be positive, got {chunk_len}")
    return chunk_len, -(-slots // chunk_len)


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
    decode_chunk: int | None = None,
    decode_layers: str = "auto",
) -> SampleOutput:
    """Sample `num_samples` completions for each left-padded prompt; rows b*G .. b*G+G-1 belong to prompt b.

    `params` may be any params pytree of `graphdef` (current or behaviour policy). With a `mesh`,
    rows are sharded over the batch axes and heads over tensor (`rules`, SAMPLE_RULES by default);
    params in another layout (e.g. the FSDP training layout, or one device) are resharded first, once per
    call; params already in the sampling layout are used as they are. `decode_chunk` sets the length of
    the cache chunks the decode attends to one by one (default: `decode_chunking`'s choice) and
    `decode_layers` whether the decode step unrolls the layers or scans them (`models.decode`; "auto": by
    the platform); both change speed and compile time, never the samples.
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
        layout = _layout(mesh, rules, cfg, batch, batch * num_samples, prompt_len,
                         decode_chunking(max_new_tokens, decode_chunk)[0])
    with mesh_context(cfg.attention, mesh):  # the prefill's attention kernel may need it
        return _generate(
            graphdef, params, jnp.asarray(prompt_tokens, jnp.int32), jnp.asarray(prompt_mask, bool), key,
            num_samples=num_samples, max_new_tokens=max_new_tokens, method=method, stop_ids=stop_ids,
            pad_id=int(pad_id), layout=layout, decode_chunk=decode_chunk,
            decode_layers=resolve_decode_layers(decode_layers, _platform(mesh)),
        )


def lower_generate(
    graphdef,
    params,
    prompt_tokens: jax.ShapeDtypeStruct,
    prompt_mask: jax.ShapeDtypeStruct,
    key: jax.ShapeDtypeStruct,
    *,
    cfg,
    num_samples: int,
    max_new_tokens: int,
    method: SamplingMethod,
    stop_ids: Sequence[int],
    mesh: Mesh,
    rules: Rules = SAMPLE_RULES,
    pad_id: int = 0,
    decode_chunk: int | None = None,
    decode_layers: str = "auto",
) -> jax.stages.Lowered:
    """The program `generate` runs for these shapes, lowered for `mesh` but not compiled or run.

    Every argument may be abstract (`jax.ShapeDtypeStruct` with a sharding; `params` in the sampling layout
    of `rules`) and the mesh may be made of devices this machine does not have (a TPU topology): this is how
    `jgrpo.plan` compiles the sampler for a TPU slice. `cfg` is the model's LLMConfig.
    """
    batch, prompt_len = prompt_tokens.shape
    layout = _layout(mesh, rules, cfg, batch, batch * num_samples, prompt_len,
                     decode_chunking(max_new_tokens, decode_chunk)[0])
    with mesh_context(cfg.attention, mesh):
        return _generate.lower(
            graphdef, params, prompt_tokens, prompt_mask, key, num_samples=num_samples,
            max_new_tokens=max_new_tokens, method=method, stop_ids=tuple(sorted({int(i) for i in stop_ids})),
            pad_id=int(pad_id), layout=layout, decode_chunk=decode_chunk,
            decode_layers=resolve_decode_layers(decode_layers, _platform(mesh)),
        )


class _DecodeState(NamedTuple):
    step: jax.Array  # [] int32: index of the next token to generate
    cache: DecodeCache  # per layer: the prompt segment [R, KVH, P, Dh], then chunks [R, KVH, C, Dh]
    last: jax.Array  # [R] int32 the latest token of every row
    done: jax.Array  # [R] bool
    tokens: jax.Array  # [R, N] int32
    logprobs: jax.Array  # [R, N] float32
    lengths: jax.Array  # [R] int32


@functools.partial(
    jax.jit,
    static_argnames=("graphdef", "num_samples", "max_new_tokens", "method", "stop_ids", "pad_id", "layout",
                     "decode_chunk", "decode_layers"),
)
def _generate(graphdef, params, prompt_tokens, prompt_mask, key, *, num_samples, max_new_tokens, method,
              stop_ids, pad_id, layout, decode_chunk, decode_layers):
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
        # Each prompt's cache, shared by its G rows, then empty chunks for the generated tokens (per layer).
        chunk_len, chunks = decode_chunking(N, decode_chunk)
        scanned = decode_layers == "scanned"
        cache = decode_cache_from_prefill(prefill_cache, G, chunks, chunk_len, stacked=scanned)
        cache = _constrain_cache(cache, layout)
    layers = None if scanned else unstack_layers(params["layers"])  # once per call, outside the loop

    prompt_lengths = jnp.repeat(jnp.sum(prompt_mask, axis=1, dtype=jnp.int32), G)  # [R]
    row_prompt_mask = _constrain(jnp.repeat(prompt_mask, G, axis=0), rows_sharding)  # [R, P]
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

    def phase(chunk: int):
        """The decode loop of one chunk: steps that feed generated slots [chunk * C, (chunk + 1) * C)."""
        end = min((chunk + 1) * chunk_len + 1, N)

        def keep_going(s: _DecodeState):
            return (s.step < end) & ~jnp.all(s.done)

        def advance(s: _DecodeState) -> _DecodeState:
            # Feed token step-1 (generated slot step-1) and draw token `step`.
            positions = prompt_lengths + s.step - 1  # [R]
            offset = s.step - 1 - chunk * chunk_len
            if scanned:
                hidden, cache = decode_step_scanned(model.cfg, params, s.last, positions, row_prompt_mask, s.cache,
                                                    chunk, offset)
            else:
                hidden, cache = decode_step(model.cfg, params, layers, s.last, positions, row_prompt_mask, s.cache,
                                            chunk, offset)
            return next_state(s, _constrain_cache(cache, layout), model.logits(hidden))

        return keep_going, advance

    def next_state(s: _DecodeState, cache: DecodeCache, logits) -> _DecodeState:
        tokens, logprobs = draw(logits, s.step)  # [R], [R]
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
        for chunk in range(chunks):  # a phase whose steps are all past N (or every row done) runs 0 times
            state = jax.lax.while_loop(*phase(chunk), state)
    completion_mask = jnp.arange(N)[None, :] < state.lengths[:, None]
    return SampleOutput(
        tokens=state.tokens,
        logprobs=state.logprobs,
        completion_mask=completion_mask,
        lengths=state.lengths,
        truncated=~state.done,
    )
