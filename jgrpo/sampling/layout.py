"""Where a sampling program's arrays live on the mesh, and its static shape (`Plan`) for one batch of prompts.

Rows are sharded over the mesh's batch axes and heads over tensor (the sampling rules). Each shard of the row
axis is one queue of the sampler (`jgrpo.sampling.state`) with its own pool of pages, so admissions, gathers,
page writes and output writes stay on the device that holds the row; the prefill cache, the page pools and the
per-queue arrays are pinned to those shardings inside the program (`Layout.__call__`).

Per-backend choices (each a `sampler.*` key whose 0 / -1 / auto means this table):
- `page_size`: tokens per page. A row wastes half a page on average (its last page part full, and its prompt's),
  and a page is the unit a step reads: CPU 16 (measured: docs/configuration.md), GPU 16 (vLLM's default: its
  kernels' page), TPU 64 (a page of a 2-KV-head, 64-dim bf16 model is 16 KB per layer: DMA-sized for the kernel).
- `shrink`: how often `generate` may halve its slots as rows finish. CPU 3: a CPU step costs what its rows
  compute (measured: docs/configuration.md); accelerators 0: a decode step there reads the weights whatever the
  row count, and each level is one more compiled loop.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jgrpo.models import kv_quant
from jgrpo.models.decode_step import resolve_decode_layers
from jgrpo.models.kv_quant import resolve_kv_dtype
from jgrpo.models.layer_stack import moe_layer_count
from jgrpo.models.paged_attention import resolve_paged_attention
from jgrpo.models.paged_kv import PagedKV
from jgrpo.parallel.mesh import Rules, logical_to_spec, mesh_platform, row_sharding
from jgrpo.sampling.pages import pages_for, pool_pages
from jgrpo.sampling.state import Plan, queue_prompts

PAGE_SIZE_AUTO = {"cpu": 16, "tpu": 64, "gpu": 16, "other": 16}
SHRINK_AUTO = {"cpu": 0, "tpu": 0, "gpu": 0, "other": 0}  # each level is one more compiled loop (docs)
BLOCK_TOKENS = 256  # the xla paged attention reads this many tokens' pages at a time


@dataclasses.dataclass(frozen=True)
class Layout:
    """Shardings of the decode state; hashable (part of a program's static `PoolSpec`) and called by it as
    `pin(name, x)` to constrain the prefill cache, the page pools and the per-queue arrays, or to replicate a
    small array every host reads ("replicated")."""

    prefill_cache: NamedSharding  # [L, B, P, KVH, Dh]
    pages: NamedSharding  # one layer's pool [Q, NP, KVH, ps, Dh]
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


def _by_platform(value: int | None, table: dict, name: str) -> int:
    return table.get(name, table["other"]) if value is None or value < 0 else value


def plan_and_layout(sampler, batch: int, prompt_len: int, cfg, interactive: bool = False,
                    lanes: int = 0) -> tuple[Plan, Layout | None]:
    """The program's static shape for `batch` prompts of width `prompt_len`, and (with a mesh) its layout.
    `sampler` is the `jgrpo.sampling.sampler.Sampler` (its options); `cfg` the model's LLMConfig; `interactive`:
    the slot interface's programs (`jgrpo.sampling.turns`: a turn at a time, rows paused between turns); `lanes`
    > 0: its single-turn form that batches of batch / lanes prompts are fed into (`jgrpo.sampling.stream`)."""
    s = sampler
    stream = lanes > 0
    interactive = interactive or stream
    where = platform(s.mesh)
    turn = (s.turn_tokens or s.max_new_tokens) if interactive and not stream else s.max_new_tokens
    rows = batch * s.num_samples
    slots = rows if s.slots is None else min(s.slots, rows)
    if slots < 1:
        raise ValueError(f"slots={slots} must be positive (None = one slot per row)")
    queues = queue_count(s.mesh, s.rules, rows, slots)
    if stream and batch // lanes % queues:  # a lane holds the same number of its batch's prompts in every queue
        queues = 1
    page_size = _by_platform(s.page_size or None, PAGE_SIZE_AUTO, where)
    prompt_pages = pages_for(prompt_len, page_size)
    # A row's own tokens: those it feeds after its prompt (N - 1; multi-turn rows: all N, drawn and appended).
    own_pages = max(1, pages_for(s.max_new_tokens if interactive else s.max_new_tokens - 1, page_size))
    prompts = queue_prompts(batch, rows, queues, s.num_samples).shape[1]
    # Multi-turn rows keep their pages while they wait between turns, parked or not: by default, room for them all.
    holders = rows // queues if interactive and not stream else slots // queues
    pages = pool_pages(s.kv_pages, prompts, prompt_pages, holders, own_pages)
    plan = Plan(rows=rows, num_samples=s.num_samples, max_new_tokens=s.max_new_tokens, slots=slots, queues=queues,
                page_size=page_size, pages=pages, prompt_pages=prompt_pages, own_pages=own_pages,
                stop_ids=tuple(sorted({int(i) for i in s.stop_ids})), pad_id=int(s.pad_id),
                scanned=resolve_decode_layers(s.decode_layers, where) == "scanned",
                attention=resolve_paged_attention(s.paged_attention, where),
                block=attention_block(prompt_pages + own_pages, page_size),
                shrink=0 if interactive else _by_platform(s.shrink, SHRINK_AUTO, where),
                may_preempt=pages < prompts * prompt_pages + holders * own_pages,
                interactive=interactive, lanes=lanes, turn_tokens=turn if interactive else 0,
                append_width=min(s.max_new_tokens, 1 + (s.append_tokens or s.max_new_tokens)) if interactive else 0,
                chunk=(s.decode_chunk or max(8, -(-turn // 4))) if interactive else 0,
                routing=routing_record(cfg), kv_dtype=resolve_kv_dtype(s.kv_cache_dtype, cfg.compute_dtype))
    if s.mesh is None:
        return plan, None

    def sharding(axes, shape):
        return NamedSharding(s.mesh, logical_to_spec(axes, s.rules, shape, s.mesh))

    queue_axes = row_sharding(s.mesh, s.rules, (queues,)).spec[0] if queues > 1 else None
    heads = sharding(("kv_heads",), (cfg.num_kv_heads,)).spec[0]
    layout = Layout(
        prefill_cache=sharding(("layers", "batch", "length", "kv_heads", "head_dim"),
                               (cfg.num_layers, batch, prompt_len, cfg.num_kv_heads, cfg.head_dim)),
        pages=NamedSharding(s.mesh, PartitionSpec(queue_axes, None, heads)),
        queues=row_sharding(s.mesh, s.rules, (queues,)) if queues > 1 else None,
    )
    return plan, layout


def attention_block(entries: int, page_size: int) -> int:
    """Table entries the xla paged attention reads at a time: at most BLOCK_TOKENS' worth, spread evenly over the
    fewest blocks that cover a row's whole table. A block past the table's end only reads padding: SmolLM2's 7-entry
    tables (64 + 48 tokens in pages of 16) read 16 entries a step with blocks of BLOCK_TOKENS // 16 (2.3x the
    bytes, and as much again for the copy into the dot's layout on CPU)."""
    most = max(1, BLOCK_TOKENS // page_size)
    return -(-entries // -(-entries // most))


def routing_record(cfg) -> tuple[int, int, str] | None:
    """(L, k, dtype) of a mixture of experts' routing record (L: its MoE layers): uint8 ids while E <= 256, else
    int16."""
    if not getattr(cfg, "num_experts", 0):
        return None
    return moe_layer_count(cfg), cfg.experts_per_token, "uint8" if cfg.num_experts <= 256 else "int16"


def _constrain(x, sharding):
    return x if sharding is None else jax.lax.with_sharding_constraint(x, sharding)


def _constrain_cache(cache: PagedKV, layout: Layout) -> PagedKV:
    def sharding(x):  # a stacked pool [L, Q, ...] keeps its layer axis whole
        spec = layout.pages.spec
        return layout.pages if x.ndim == 5 else NamedSharding(layout.pages.mesh, PartitionSpec(None, *spec))

    return kv_quant.per_part(lambda c: jax.tree.map(lambda x: _constrain(x, sharding(x)), c), cache)
