"""Where each completion token goes when a minibatch's completions are packed into fixed [K, W] blocks.

The update and the log-prob passes pad every completion to `sampler.max_new_tokens` N: with the quickstart's
lengths (mean 70 of 256) three slots in four are padding. Packing puts several completions end to end in a row of
width W (each one segment), so a micro-batch of r padded rows [r, N] becomes K packed rows [K, W] with K·W = r·N
(no more memory) and far fewer of them are needed. Shapes stay fixed: a minibatch has a buffer of U micro-batches
(`grpo.micro_batches`), of which the plan uses 1 to U; the rest are padding the step skips.

The plan is a host function of the completion lengths alone, deterministic, so every process computes the same
one (the lengths are global), and the gathers that apply it run on the device (`pack`, `unpack`: any per-token
field, any trailing dims, with no code of its own). Rules, in this order:
  - whole groups: a group's G completions share a prompt the packed forward computes once per micro-batch, so a
    group never spans two micro-batches; one that does not fit opens the next (overflow);
  - groups are dealt to the data shards first (K rows = D shards of K/D rows), to the shard with the fewest
    tokens so far (ties: the lowest), so a group stays on one device and the shards' loads stay even;
  - within a shard and micro-batch, each completion goes to the first of its rows with room (first fit), in the
    order of the minibatch's rows (which follows the group shuffle), so the plan depends on nothing else.
A completion of length 0 (an episode that failed) takes no slot. A group that cannot fit an empty micro-batch of
its shard (K/D rows of W) is a `ValueError`: the caller sizes K and W so that it never happens (K/D >= G when
W < 2N).
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
import numpy as np


class PackingPlan(NamedTuple):
    """Where each packed slot's token comes from. Arrays [U, K, W]; a padding slot has row -1."""

    row: np.ndarray  # int32: the completion (row of the minibatch) of this slot's token, -1 for padding
    position: np.ndarray  # int32: its index j in that completion (0 for padding)
    segment: np.ndarray  # int32: 1, 2, ... numbering the completions of a packed row in order; 0 for padding
    micro_batches: int  # how many of the U micro-batches hold tokens (the others are all padding)

    @property
    def fill(self) -> float:
        """Real tokens over packed slots in the micro-batches used."""
        used = self.row[: self.micro_batches]
        return float((used >= 0).sum() / max(used.size, 1))


def plan_packing(lengths, *, group_size: int, rows: int, width: int, micro_batches: int,
                 shards: int = 1) -> PackingPlan:
    """The packing of one minibatch's completions (`lengths` [n], groups of `group_size` consecutive rows) into
    `micro_batches` blocks of `rows` x `width` slots, the rows split over `shards` data shards (see the module)."""
    lengths = np.asarray(lengths, np.int64)
    if lengths.ndim != 1 or len(lengths) % group_size:
        raise ValueError(f"{len(lengths)} completions are not whole groups of {group_size}")
    if rows % shards:
        raise ValueError(f"{rows} packed rows do not split over {shards} data shards")
    if lengths.max(initial=0) > width:
        raise ValueError(f"a completion of {lengths.max()} tokens is longer than the packed width {width}")
    per_shard = rows // shards
    row = np.full((micro_batches, rows, width), -1, np.int32)
    position = np.zeros((micro_batches, rows, width), np.int32)
    segment = np.zeros((micro_batches, rows, width), np.int32)
    load = np.zeros(shards, np.int64)  # tokens dealt to each shard so far
    current = np.zeros(shards, np.int64)  # the micro-batch each shard is filling
    used = np.zeros((micro_batches, rows), np.int64)  # slots taken in each packed row
    for first in range(0, len(lengths), group_size):
        group = lengths[first:first + group_size]
        shard = int(np.argmin(load))
        load[shard] += group.sum()
        block = slice(shard * per_shard, (shard + 1) * per_shard)
        placed = _first_fit(group, used[current[shard], block], width)
        if placed is None:  # overflow: the group opens the shard's next micro-batch
            current[shard] += 1
            if current[shard] >= micro_batches:
                raise ValueError(f"the groups do not fit {micro_batches} micro-batches of {rows} x {width} "
                                 f"(shard {shard} of {shards}); raise the packed rows or width")
            placed = _first_fit(group, used[current[shard], block], width)
            if placed is None:
                raise ValueError(f"a group of {group_size} completions ({group.tolist()} tokens) does not fit "
                                 f"{per_shard} empty rows of {width}")
        u = int(current[shard])
        for member, n, local_row in zip(range(first, first + group_size), group.tolist(), placed, strict=True):
            if n == 0:
                continue
            k = shard * per_shard + local_row
            start = int(used[u, k])
            row[u, k, start:start + n] = member
            position[u, k, start:start + n] = np.arange(n)
            segment[u, k, start:start + n] = segment[u, k, :start].max(initial=0) + 1
            used[u, k] += n
    return PackingPlan(row, position, segment, int(current.max()) + 1 if len(lengths) else 0)


def _first_fit(lengths: np.ndarray, used: np.ndarray, width: int) -> list[int] | None:
    """The row each completion goes to (first with room), filling a copy of `used`; None if one does not fit."""
    used, placed = used.copy(), []
    for n in lengths:
        room = np.flatnonzero(used + n <= width)
        if n and not len(room):
            return None
        k = int(room[0]) if n else 0
        used[k] += n
        placed.append(k)
    return placed


def pack(x, plan: PackingPlan, fill=0):
    """A per-token field [n, N, ...] -> [U, K, W, ...] laid out as `plan` says (padding slots: `fill`)."""
    x = jnp.asarray(x)
    real = jnp.asarray(plan.row) >= 0
    gathered = x[jnp.maximum(jnp.asarray(plan.row), 0), jnp.asarray(plan.position)]
    return jnp.where(real.reshape(real.shape + (1,) * (x.ndim - 2)), gathered, jnp.asarray(fill, x.dtype))


def unpack(packed, plan: PackingPlan, n_rows: int, n_tokens: int, fill=0):
    """The inverse of `pack`: [U, K, W, ...] -> [n_rows, n_tokens, ...]; slots no packed token came from
    (positions past a completion's length) hold `fill`."""
    packed = jnp.asarray(packed)
    rows = jnp.where(jnp.asarray(plan.row) >= 0, jnp.asarray(plan.row), n_rows)  # padding: out of range, dropped
    out = jnp.full((n_rows, n_tokens) + packed.shape[3:], fill, packed.dtype)
    return out.at[rows, jnp.asarray(plan.position)].set(packed, mode="drop")
