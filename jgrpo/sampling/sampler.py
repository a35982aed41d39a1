"""On-device sampling for rollouts: `generate` checks and lays out the prompts, `slot_decoding` runs them.

One jitted program per (prompt batch shape, samples per prompt, max new tokens, slots, method, stop ids):
the prompts are prefilled once, then a pool of slots decodes inside `lax.while_loop`s with the KV cache
in the loop carry (`jgrpo.sampling.slot_pool`, `jgrpo.models.decode`). By default there is one slot per row
(static batching: the batch decodes until its longest row stops); `slots` < rows is continuous batching:
a slot whose row stops takes the next pending row, so long-tailed completion lengths do not leave slots
decoding padding (docs/configuration.md, `sampler.slots`).

The cache never leaves the jitted program (it is created and consumed inside), so there is no
host-visible buffer to donate and no cache-sized copy per call. Slots are laid out as
[prompt | generated ring], sized from P and N, so the cache cannot overflow; prompts longer than allowed
are rejected (or left-truncated) by `left_pad_prompts` before that.

Randomness: row r draws its token t with `fold_in(fold_in(key, r), t)`. A row's tokens depend only on
the key, its global row index and the model, not on the batch sharding or the slot count.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jgrpo.models.attention_backends import mesh_context
from jgrpo.models.decode import DecodeCache, resolve_decode_layers
from jgrpo.models.llm import model_config, param_logical_axes
from jgrpo.parallel.mesh import SAMPLE_RULES, Rules, logical_shardings, logical_to_spec, mesh_platform, row_sharding
from jgrpo.sampling.methods import SamplingMethod
from jgrpo.sampling.slot_pool import Plan, SampleOutput, decode_chunking, sample

__all__ = ["SampleOutput", "SamplingMethod", "decode_chunking", "decode_options", "generate", "lower_generate",
           "stop_ids_for"]

# Tokens that close a turn in the chat templates of the supported families (besides the EOS id).
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "<|endoftext|>", "<end_of_turn>")


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
    """Shardings of the decode state; hashable (a static argument of the jitted program) and called by it as
    `pin(name, x)` to constrain the prefill cache, the decode cache, the per-queue arrays and the prompt store."""

    prefill_cache: NamedSharding  # [L, B, P, KVH, Dh]
    prompt_cache: NamedSharding  # one layer's prompt segment [S, KVH, P, Dh]
    chunk_cache: NamedSharding  # one layer's generated chunk [S, KVH, C, Dh]
    queues: NamedSharding | None  # [Q, ...]: one queue per shard of the row axis (None: one queue)

    def __call__(self, name: str, x):
        if name == "prefill":
            return jax.tree.map(lambda c: _constrain(c, self.prefill_cache), x)
        if name == "cache":
            return _constrain_cache(x, self)
        if self.queues is None:
            return x
        if name == "store":  # [L, Q, W, KVH, P, Dh]
            return _constrain(x, NamedSharding(self.queues.mesh, PartitionSpec(None, *self.queues.spec)))
        return _constrain(x, self.queues)  # "queues"


def _queue_count(mesh: Mesh | None, rules: Rules, rows: int, slots: int) -> int:
    """Q: the number of shards of the row axis when rows and slots both split evenly over them, else 1."""
    if mesh is None:
        return 1
    axes = row_sharding(mesh, rules, (rows, 1)).spec[0]
    shards = int(np.prod([mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else axes or ())]))
    return shards if rows % shards == 0 and slots % shards == 0 else 1


def _plan_and_layout(mesh, rules, cfg, batch, prompt_len, *, num_samples, max_new_tokens, slots, stop_ids, pad_id,
                     decode_chunk, decode_layers) -> tuple[Plan, _Layout | None]:
    rows = batch * num_samples
    slots = rows if slots is None else min(slots, rows)
    if slots < 1:
        raise ValueError(f"slots={slots} must be positive (None = one slot per row)")
    queues = _queue_count(mesh, rules, rows, slots)
    chunk_len, chunks = decode_chunking(max_new_tokens, decode_chunk)
    plan = Plan(num_samples=num_samples, max_new_tokens=max_new_tokens, slots=slots, queues=queues,
                chunk_len=chunk_len, chunks=chunks,
                scanned=resolve_decode_layers(decode_layers, _platform(mesh)) == "scanned",
                stop_ids=tuple(sorted({int(i) for i in stop_ids})), pad_id=int(pad_id))
    if mesh is None:
        return plan, None

    def sharding(axes, shape):
        return NamedSharding(mesh, logical_to_spec(axes, rules, shape, mesh))

    cache_axes = ("batch", "kv_heads", "length", "head_dim")
    layout = _Layout(
        prefill_cache=sharding(("layers", "batch", "length", "kv_heads", "head_dim"),
                               (cfg.num_layers, batch, prompt_len, cfg.num_kv_heads, cfg.head_dim)),
        prompt_cache=sharding(cache_axes, (slots, cfg.num_kv_heads, prompt_len, cfg.head_dim)),
        chunk_cache=sharding(cache_axes, (slots, cfg.num_kv_heads, chunk_len, cfg.head_dim)),
        queues=row_sharding(mesh, rules, (queues,)) if queues > 1 else None,
    )
    return plan, layout


def _constrain(x, sharding):
    return x if sharding is None else jax.lax.with_sharding_constraint(x, sharding)


def _constrain_cache(cache: DecodeCache, layout: _Layout) -> DecodeCache:
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
    return dict(decode_chunk=sampler_config.decode_chunk or None, decode_layers=sampler_config.decode_layers,
                slots=sampler_config.slots or None)


def _typed(key):
    """A raw uint32 key (`jax.random.PRNGKey`) as a typed key, so one key and [B] keys cannot be confused."""
    return key if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else jax.random.wrap_key_data(key)


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
    slots: int | None = None,
    prompt_index=None,
) -> SampleOutput:
    """Sample `num_samples` completions for each left-padded prompt; rows b*G .. b*G+G-1 belong to prompt b.

    `params` may be any params pytree of `graphdef` (current or behaviour policy). With a `mesh`,
    rows are sharded over the batch axes and heads over tensor (`rules`, SAMPLE_RULES by default);
    params in another layout (e.g. the FSDP training layout, or one device) are resharded first, once per
    call; params already in the sampling layout are used as they are. `decode_chunk` sets the length of
    the cache chunks the decode attends to one by one (default: `decode_chunking`'s choice) and
    `decode_layers` whether the decode step unrolls the layers or scans them (`models.decode`; "auto": by
    the platform); `slots` how many rows decode at once (None: all of them, static batching; fewer:
    continuous batching, `jgrpo.sampling.slot_pool`). These change speed and compile time, never the samples.

    `key` is one key, or [B] keys with `prompt_index` [B]: prompts of several batches sampled at once, each with
    its batch's key and its index in that batch, get the tokens their own batch would get (`slot_decoding.sample`).
    """
    if num_samples < 1 or max_new_tokens < 1:
        raise ValueError(f"num_samples={num_samples} and max_new_tokens={max_new_tokens} must be positive")
    if not isinstance(method, SamplingMethod):
        raise TypeError(f"method must be a SamplingMethod, got {type(method).__name__}")
    longest = _check_prompts(prompt_tokens, prompt_mask)
    stop_ids = tuple(sorted({int(i) for i in stop_ids}))
    batch, prompt_len = prompt_tokens.shape
    cfg = model_config(graphdef, params)
    limit = getattr(cfg, "max_position_embeddings", None)
    if limit and (longest or prompt_len) + max_new_tokens > limit:
        raise ValueError(
            f"a prompt of {longest or prompt_len} tokens plus max_new_tokens={max_new_tokens} needs more positions "
            f"than the model's max_position_embeddings={limit}"
        )
    plan, layout = _plan_and_layout(mesh, rules, cfg, batch, prompt_len, num_samples=num_samples,
                                    max_new_tokens=max_new_tokens, slots=slots, stop_ids=stop_ids, pad_id=pad_id,
                                    decode_chunk=decode_chunk, decode_layers=decode_layers)
    if mesh is not None:
        params = jax.device_put(params, logical_shardings(param_logical_axes(params), mesh, rules, shapes=params))
    with mesh_context(cfg.attention, mesh):  # the prefill's attention kernel may need it
        return sample(graphdef, params, jnp.asarray(prompt_tokens, jnp.int32), jnp.asarray(prompt_mask, bool),
                      _typed(key), prompt_index, method=method, plan=plan, constrain=layout)


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
    slots: int | None = None,
    prompt_index: jax.ShapeDtypeStruct | None = None,
) -> jax.stages.Lowered:
    """The program `generate` runs for these shapes, lowered for `mesh` but not compiled or run.

    Every argument may be abstract (`jax.ShapeDtypeStruct` with a sharding; `params` in the sampling layout
    of `rules`) and the mesh may be made of devices this machine does not have (a TPU topology): this is how
    `jgrpo.plan` compiles the sampler for a TPU slice. `cfg` is the model's LLMConfig.
    """
    batch, prompt_len = prompt_tokens.shape
    plan, layout = _plan_and_layout(mesh, rules, cfg, batch, prompt_len, num_samples=num_samples,
                                    max_new_tokens=max_new_tokens, slots=slots, stop_ids=stop_ids, pad_id=pad_id,
                                    decode_chunk=decode_chunk, decode_layers=decode_layers)
    with mesh_context(cfg.attention, mesh):
        return sample.lower(graphdef, params, prompt_tokens, prompt_mask, key, prompt_index, method=method, plan=plan,
                            constrain=layout)
