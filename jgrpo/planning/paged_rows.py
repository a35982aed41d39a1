"""How many rows a chip can decode at once, and what one decode step reads, with the paged KV cache and with the
slot pool it replaced: the arithmetic `jgrpo.plan` and benchmarks/paged_kv.py report.

Decode is bound by the bytes a step reads: the weights once, then every row's keys and values. The weights take
the same bytes at any row count, so a step's cost per token falls as rows are added, until the cache fills the
chip: rows in flight are what the cache's memory allows beside everything else the chip holds while sampling.

- Paged (`models/paged_kv.py`): a row holds its prompt's pages (shared by the G rows of its group: 1/G each) and
  its own pages for the tokens it has fed, rounded up to whole pages; a step reads those tokens, the `pallas`
  kernel's part-full pages rounded up to its read granule (a tile's rows, `read_granule`), the `xla` blocks' whole
  pages (the HLO cost cannot see inside the kernel, so this is counted here from the page tables' lengths).
- The slot pool (before pages): every slot held its prompt at the batch's padded width and a ring of N - 1
  columns rounded up to its decode chunks, and each queue the prompts once more (the prompt store); a step read
  the prompt segment and the chunks written so far, whatever the row's own length.

`live_minimum` is what no cache layout can read less of: the weights and each row's real prompt and own tokens.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class KVShape:
    """One chip's share of a token's keys and values: layers, KV heads on the chip, head_dim, the cache's dtype."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: str  # "bfloat16", "float32", ... or "int8" (values and a float32 scale per token and head)

    def token_bytes(self) -> float:
        per_head = self.head_dim * (1 if self.dtype == "int8" else jnp.dtype(self.dtype).itemsize)
        per_head += 4 if self.dtype == "int8" else 0
        return 2 * self.layers * self.kv_heads * per_head


def slot_pool_chunking(new_tokens: int) -> tuple[int, int]:
    """(chunk length, chunks) of the slot pool's ring for N new tokens (its `decode_chunking` default)."""
    columns = max(new_tokens - 1, 1)
    chunk = min(columns, max(64, -(-columns // 8)))
    return chunk, -(-columns // chunk)


def paged_row_tokens(prompt_len: float, own_tokens: float, group: int, page_size: int) -> float:
    """Token slots a row holds in pages: its share of its prompt's pages and its own pages."""
    return (math.ceil(prompt_len / page_size) / group + math.ceil(own_tokens / page_size)) * page_size


def slot_pool_row_tokens(prompt_width: int, new_tokens: int, group: int) -> float:
    """Token slots a slot of the old pool held: its prompt segment, its ring, its share of the prompt store."""
    chunk, chunks = slot_pool_chunking(new_tokens)
    return prompt_width + chunk * chunks + prompt_width / group


def rows_in_flight(free_bytes: float, row_tokens: float, kv: KVShape) -> int:
    """Rows whose keys/values fit in `free_bytes`, each holding `row_tokens` token slots."""
    return int(free_bytes // (row_tokens * kv.token_bytes())) if row_tokens > 0 else 0


@dataclasses.dataclass(frozen=True)
class StepReads:
    """Bytes one decode step reads on a chip: the weights, and the cache by layout."""

    weights: float
    paged: float  # the weights and each row's live pages
    slot_pool: float  # the weights and each slot's prompt segment and chunks written so far
    live_minimum: float  # the weights and each row's real tokens

    @property
    def paged_over_live(self) -> float:
        return self.paged / self.live_minimum

    @property
    def slot_pool_over_live(self) -> float:
        return self.slot_pool / self.live_minimum


def step_reads(weights_bytes: float, kv: KVShape, rows: list[tuple[int, int]], *, page_size: int,
               prompt_width: int, new_tokens: int, granule: int | None = None) -> StepReads:
    """What a decode step reads with `rows` in flight, each (its prompt's real tokens, its own tokens so far),
    when part-full pages are read in multiples of `granule` tokens (a divisor of `page_size`; None: whole pages)."""
    chunk, _ = slot_pool_chunking(new_tokens)
    tb = kv.token_bytes()
    g = granule or page_size
    if page_size % g:
        raise ValueError(f"a read granule of {g} tokens does not divide pages of {page_size}")
    paged = sum((math.ceil(p / g) + math.ceil(o / g)) * g for p, o in rows)
    slots = sum(prompt_width + (o // chunk + 1) * chunk for _, o in rows)
    live = sum(p + o for p, o in rows)
    return StepReads(weights_bytes, weights_bytes + paged * tb, weights_bytes + slots * tb, weights_bytes + live * tb)


def roofline_tokens_per_s(rows: int, step_bytes: float, hbm_gbps: float) -> float:
    """Tokens a second a chip makes at `rows` rows when a step costs its bytes over the chip's HBM bandwidth."""
    return rows / (step_bytes / (hbm_gbps * 1e9)) if step_bytes else 0.0
