"""Which pages of each queue's pool are free (`FreePages`), and taking and giving them back, inside the program.

A queue's free pages are a stack: `stack[q, :count[q]]` are free, the top is `count[q] - 1`. `take` pops a page for
each slot that wants one (as many as there are: the rest get NP, "none"), `give` pushes pages back (NP entries are
skipped). Both are a few vectorised integer ops per queue: no loop, no host round trip.

How many pages a pool has (`pool_pages`): the budget, or by default enough for every slot's row at its longest
beside every prompt, so that nothing is ever preempted (the memory of the slot pool before pages, less the G - 1
copies of each prompt).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class FreePages(NamedTuple):
    stack: jax.Array  # [Q, NP] int32: the free pages are stack[q, :count[q]]
    count: jax.Array  # [Q] int32


def pages_for(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


def pool_pages(budget: int, prompts: int, prompt_pages: int, slots: int, own_pages: int) -> int:
    """Pages of one queue's pool: `budget` (0: every prompt's pages and every slot's row at its longest), checked
    against the least that can make progress: every prompt's pages and one row's."""
    least = prompts * prompt_pages + own_pages
    pages = budget or prompts * prompt_pages + slots * own_pages
    if pages < least:
        raise ValueError(f"sampler.kv_pages={budget} per queue is too few: this batch's {prompts} prompts take up to "
                         f"{prompts * prompt_pages} pages and one row {own_pages} more (at least {least})")
    return pages


def initial(pages: int, used: jax.Array) -> FreePages:
    """Pages `used[q]` .. NP - 1 of each queue free (the first `used[q]` hold its prompts); the lowest on top."""
    queues = used.shape[0]
    stack = jnp.broadcast_to(pages - 1 - jnp.arange(pages, dtype=jnp.int32), (queues, pages))
    return FreePages(stack, (pages - used).astype(jnp.int32))


def take(free: FreePages, wanted: jax.Array) -> tuple[FreePages, jax.Array]:
    """A page for each True of `wanted` [Q, n] while the queue has free pages: (free, pages [Q, n], NP = none)."""
    pages = free.stack.shape[1]
    rank = jnp.cumsum(wanted, axis=1, dtype=jnp.int32) - 1
    got = wanted & (rank < free.count[:, None])
    at = jnp.clip(free.count[:, None] - 1 - rank, 0, pages - 1)
    taken = jnp.where(got, jnp.take_along_axis(free.stack, at, axis=1), pages)
    return FreePages(free.stack, free.count - jnp.sum(got, axis=1, dtype=jnp.int32)), taken


def give(free: FreePages, pages: jax.Array) -> FreePages:
    """Pages [Q, ...] back on their queue's stack (entries NP skipped)."""
    total = free.stack.shape[1]
    flat = pages.reshape(pages.shape[0], -1)
    back = flat < total
    at = jnp.where(back, free.count[:, None] + jnp.cumsum(back, axis=1, dtype=jnp.int32) - 1, total)
    stack = jax.vmap(lambda s, i, p: s.at[i].set(p, mode="drop"))(free.stack, at, flat)
    return FreePages(stack, free.count + jnp.sum(back, axis=1, dtype=jnp.int32))


def prompt_tables(length: jax.Array, page_size: int, prompt_pages: int, none: int) -> tuple[jax.Array, jax.Array]:
    """Each queue's prompts [Q, W] (`length` real tokens each) laid out one after another from page 0:
    (table [Q, W, pp], `none` past each prompt's pages; the pages they use, per queue [Q])."""
    count = -(-length // page_size)  # [Q, W]
    start = jnp.cumsum(count, axis=1) - count
    entry = jnp.arange(prompt_pages)
    table = jnp.where(entry < count[..., None], start[..., None] + entry, none)
    return table.astype(jnp.int32), jnp.sum(count, axis=1, dtype=jnp.int32)
