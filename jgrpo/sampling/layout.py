"""Where a sampling program's arrays live on the mesh, and its static shape (`Plan`) for one batch of prompts.

Rows are sharded over the mesh's batch axes and heads over tensor (the sampling rules). Each shard of the row
axis is one queue of the slot pool (`jgrpo.sampling.pool`), so refills, gathers and output writes stay on the
device that holds the row; the prefill cache, the decode cache, the per-queue arrays and the prompt store are
pinned to those shardings inside the program (`Layout.__call__`).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jgrpo.models import kv_quant
from jgrpo.models.decode import DecodeCache, resolve_decode_layers, resolve_decode_softmax
from jgrpo.models.kv_quant import resolve_kv_dtype
from jgrpo.models.layer_stack import moe_layer_count
from jgrpo.parallel.mesh import Rules, logical_to_spec, mesh_platform, row_sharding
from jgrpo.sampling.pool import Plan, decode_chunking


@dataclasses.dataclass(frozen=True)
class Layout:
    """Shardings of the decode state; hashable (part of a program's static `PoolSpec`) and called by it as
    `pin(name, x)` to constrain the prefill cache, the decode cache, the per-queue arrays and the prompt store,
    or to replicate a small array every host reads ("replicated")."""

    prefill_cache: NamedSharding  # [L, B, P, KVH, Dh]
    prompt_cache: NamedSharding  # one layer's prompt segment [S, KVH, P, Dh]
    chunk_cache: NamedSharding  # one layer's generated chunk [S, KVH, C, Dh]
    queues: NamedSharding | None  # [Q, ...]: one queue per shard of the row axis (None: one queue)

    def __call__(self, name: str, x):
        if name == "prefill":
            return jax.tree.map(lambda c: _constrain(c, self.prefill_cache), x)
        if name == "cache":
            return _constrain_cache(x, self)
        if name == "replicated":
            return _constrain(x, NamedSharding(self.prefill_cache.mesh, PartitionSpec()))
        if self.queues is None:
            return x
        if name == "store":  # [L, Q, W, KVH, P, Dh]
            return _constrain(x, NamedSharding(self.queues.mesh, PartitionSpec(None, *self.queues.spec)))
        return _constrain(x, self.queues)  # "queues"


def queue_count(mesh: Mesh | None, rules: Rules, rows: int, slots: int) -> int:
    """Q: the number of shards of the row axis when rows and slots both split evenly over them, else 1."""
    if mesh is None:
        return 1
    axes = row_sharding(mesh, rules, (rows, 1)).spec[0]
    shards = int(np.prod([mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else axes or ())]))
    return shards if rows % shards == 0 and slots % shards == 0 else 1


def platform(mesh: Mesh | None) -> str:
    return mesh_platform(mesh) if mesh is not None else jax.devices()[0].platform


def plan_and_layout(sampler, batch: int, prompt_len: int, cfg, interactive: bool = False) -> tuple[Plan, Layout | None]:
    """The program's static shape for `batch` prompts of width `prompt_len`, and (with a mesh) its layout.
    `sampler` is the `jgrpo.sampling.sampler.Sampler` (its options); `cfg` the model's LLMConfig; `interactive`:
    the slot interface's programs (`jgrpo.sampling.turns`: a turn at a time, the row's context in the prompt
    segment)."""
    s = sampler
    turn = (s.turn_tokens or s.max_new_tokens) if interactive else s.max_new_tokens
    rows = batch * s.num_samples
    slots = rows if s.slots is None else min(s.slots, rows)
    if slots < 1:
        raise ValueError(f"slots={slots} must be positive (None = one slot per row)")
    queues = queue_count(s.mesh, s.rules, rows, slots)
    chunk_len, chunks = decode_chunking(turn, s.decode_chunk)  # the ring holds one turn
    plan = Plan(rows=rows, num_samples=s.num_samples, max_new_tokens=s.max_new_tokens, slots=slots, queues=queues,
                chunk_len=chunk_len, chunks=chunks,
                scanned=resolve_decode_layers(s.decode_layers, platform(s.mesh)) == "scanned",
                stop_ids=tuple(sorted({int(i) for i in s.stop_ids})), pad_id=int(s.pad_id), interactive=interactive,
                turn_tokens=turn if interactive else 0,
                append_width=min(s.max_new_tokens, 1 + (s.append_tokens or s.max_new_tokens)) if interactive else 0,
                routing=routing_record(cfg), kv_dtype=resolve_kv_dtype(s.kv_cache_dtype, cfg.compute_dtype),
                merged_softmax=resolve_decode_softmax(s.decode_softmax, platform(s.mesh)) == "segments")
    segment = prompt_len + s.max_new_tokens if interactive else prompt_len  # a slot's prompt segment
    if s.mesh is None:
        return plan, None

    def sharding(axes, shape):
        return NamedSharding(s.mesh, logical_to_spec(axes, s.rules, shape, s.mesh))

    cache_axes = ("batch", "kv_heads", "length", "head_dim")
    layout = Layout(
        prefill_cache=sharding(("layers", "batch", "length", "kv_heads", "head_dim"),
                               (cfg.num_layers, batch, prompt_len, cfg.num_kv_heads, cfg.head_dim)),
        prompt_cache=sharding(cache_axes, (slots, cfg.num_kv_heads, segment, cfg.head_dim)),
        chunk_cache=sharding(cache_axes, (slots, cfg.num_kv_heads, chunk_len, cfg.head_dim)),
        queues=row_sharding(s.mesh, s.rules, (queues,)) if queues > 1 else None,
    )
    return plan, layout


def routing_record(cfg) -> tuple[int, int, str] | None:
    """(L, k, dtype) of a mixture of experts' routing record (L: its MoE layers): uint8 ids while E <= 256, else
    int16."""
    if not getattr(cfg, "num_experts", 0):
        return None
    return moe_layer_count(cfg), cfg.experts_per_token, "uint8" if cfg.num_experts <= 256 else "int16"


def _constrain(x, sharding):
    return x if sharding is None else jax.lax.with_sharding_constraint(x, sharding)


def _constrain_cache(cache: DecodeCache, layout: Layout) -> DecodeCache:
    def sharding(s, x):  # a stacked segment [L, ...] keeps its layer axis whole
        return s if x.ndim == 4 else NamedSharding(s.mesh, PartitionSpec(None, *s.spec))

    def segments(per_layer):  # each layer (or the one stacked entry): (prompt segment, chunk 0, chunk 1, ...)
        return tuple((_constrain(prompt, sharding(layout.prompt_cache, prompt)),
                      *(_constrain(c, sharding(layout.chunk_cache, c)) for c in chunks))
                     for prompt, *chunks in per_layer)

    return kv_quant.per_part(lambda c: DecodeCache(segments(c.k), segments(c.v)), cache)
