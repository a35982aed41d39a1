"""Where each completion token goes when a minibatch's completions are packed into fixed [K, W] blocks.

The update and the log-prob passes pad every completion to `sampler.max_new_tokens` N: with the quickstart's
lengths (mean 70 of 256) three slots in four are padding. Packing puts several completions end to end in a row of
width W (each one segment), so a micro-batch of r padded rows [r, N] becomes K packed rows [K, W], by default with
K·W = r·N (the caller sizes the blocks, `PackedSizes`: `packed_passes.packed_sizes`), and fewer of them are needed.
Shapes stay fixed: a buffer of U micro-batches, of which the plan uses 1 to U; the rest are padding the step skips.

The plan is a host function of the completion lengths alone, deterministic (so every process of a pod computes the
same one from the global lengths, which `host_arrays.fetch` brings to every host), and the gathers that apply it run
on the device (`pack`, `unpack`: any per-token field, any trailing dims, with no code of its own). Rules, in order:
  - whole groups: a group's G completions share a prompt the packed forward computes once per micro-batch, so a
    group never spans two micro-batches; one that does not fit opens the next (overflow);
  - groups are dealt to the data shards first (K rows = D shards of K/D rows), to the shard with the fewest
    tokens so far (ties: the lowest), so a group stays on one device and the shards' loads stay even;
  - within a shard and micro-batch, each completion goes to the first of its rows with room that is empty or
    holds its group's completions (first fit), in the order of the minibatch's rows (which follows the group
    shuffle), so the plan depends on nothing else. A row holds one group: its completions attend to one prompt,
    whose keys the packed forward gathers for the row (`prompt_row`), as many as a padded row's;
  - with `prompt_lengths`, each group's prompt goes once into the micro-batch's prompt block [Kp, Wp] (the
    shard's Kp/D rows, first fit, positions from 0), and a group fits a micro-batch only if its completions and
    its prompt both do: the packed forward (models/packed_forward.py) computes the prompt there, once.
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
    prompt_group: np.ndarray | None = None  # [U, Kp, Wp] int32: the group whose prompt is there, -1 for padding
    prompt_position: np.ndarray | None = None  # [U, Kp, Wp] int32: the index in that prompt (its real tokens)
    owner: np.ndarray | None = None  # [n] int32: the micro-batch holding each row's group (a row of length 0 too)
    prompt_row: np.ndarray | None = None  # [U, K] int32: the prompt-block row of each packed row's group (0: none)

    @property
    def fill(self) -> float:
        """Real tokens over packed slots in the micro-batches used."""
        used = self.row[: self.micro_batches]
        return float((used >= 0).sum() / max(used.size, 1))


class PackedSizes(NamedTuple):
    """The blocks a minibatch's completions (and their groups' prompts) are packed into: U micro-batches of [K, W]
    completion slots and [Kp, Wp] prompt slots (`packed_passes.packed_sizes` sizes them for the trainer)."""

    rows: int  # K: packed completion rows per micro-batch
    width: int  # W >= N
    prompt_rows: int = 0  # Kp (0: no prompt block)
    prompt_width: int = 0  # Wp >= P
    micro_batches: int = 1  # U: the buffer (a micro-batch holds at least one group: never more than the groups)
    shards: int = 1  # D: data shards the rows split over (a group stays on one)


def plan_packing(lengths, sizes: PackedSizes, group_size: int, prompt_lengths=None) -> PackingPlan:
    """The packing of one minibatch's completions (`lengths` [n], groups of `group_size` consecutive rows) into
    `sizes.micro_batches` blocks of `sizes.rows` x `sizes.width` slots, the rows split over `sizes.shards` data
    shards, and with `prompt_lengths` [n / group_size] the groups' prompts into blocks of `sizes.prompt_rows` x
    `sizes.prompt_width` (see the module)."""
    rows, width, prompt_rows, prompt_width, micro_batches, shards = sizes
    lengths = np.asarray(lengths, np.int64)
    if lengths.ndim != 1 or len(lengths) % group_size:
        raise ValueError(f"{len(lengths)} completions are not whole groups of {group_size}")
    if rows % shards:
        raise ValueError(f"{rows} packed rows do not split over {shards} data shards")
    if lengths.max(initial=0) > width:
        raise ValueError(f"a completion of {lengths.max()} tokens is longer than the packed width {width}")
    prompts = None
    if prompt_lengths is not None:
        prompts = np.asarray(prompt_lengths, np.int64)
        if prompts.shape != (len(lengths) // group_size,):
            raise ValueError(f"{prompts.size} prompt lengths for {len(lengths) // group_size} groups")
        if prompt_rows < shards or prompt_rows % shards:
            raise ValueError(f"{prompt_rows} packed prompt rows do not split over {shards} data shards")
        if prompts.max(initial=0) > prompt_width:
            raise ValueError(f"a prompt of {prompts.max()} tokens is longer than the packed prompt width "
                             f"{prompt_width}")
        prompt_per_shard = prompt_rows // shards
        prompt_group = np.full((micro_batches, prompt_rows, prompt_width), -1, np.int32)
        prompt_position = np.zeros((micro_batches, prompt_rows, prompt_width), np.int32)
        prompt_used = np.zeros((micro_batches, prompt_rows), np.int64)
    per_shard = rows // shards
    row = np.full((micro_batches, rows, width), -1, np.int32)
    position = np.zeros((micro_batches, rows, width), np.int32)
    segment = np.zeros((micro_batches, rows, width), np.int32)
    load = np.zeros(shards, np.int64)  # tokens dealt to each shard so far
    current = np.zeros(shards, np.int64)  # the micro-batch each shard is filling
    used = np.zeros((micro_batches, rows), np.int64)  # slots taken in each packed row
    owner = np.zeros(len(lengths), np.int32)
    row_prompt = np.zeros((micro_batches, rows), np.int32)
    for first in range(0, len(lengths), group_size):
        group = lengths[first:first + group_size]
        shard = int(np.argmin(load))
        load[shard] += group.sum()
        block = slice(shard * per_shard, (shard + 1) * per_shard)
        if prompts is None:
            prompt, prompt_block = None, None
        else:
            prompt = prompts[first // group_size: first // group_size + 1]
            prompt_block = slice(shard * prompt_per_shard, (shard + 1) * prompt_per_shard)
        fitted = _fit_group(group, used[current[shard], block], width, prompt,
                            prompt is not None and prompt_used[current[shard], prompt_block], prompt_width)
        if fitted is None:  # overflow: the group opens the shard's next micro-batch
            current[shard] += 1
            if current[shard] >= micro_batches:
                raise ValueError(f"the groups do not fit {micro_batches} micro-batches of {rows} x {width} "
                                 f"(shard {shard} of {shards}); raise the packed rows or width")
            fitted = _fit_group(group, used[current[shard], block], width, prompt,
                                prompt is not None and prompt_used[current[shard], prompt_block], prompt_width)
            if fitted is None:
                raise ValueError(f"a group of {group_size} completions ({group.tolist()} tokens) does not fit "
                                 f"{per_shard} empty rows of {width}")
        placed, prompt_row = fitted
        u = int(current[shard])
        owner[first:first + group_size] = u
        if prompt_row is not None:
            g, k = first // group_size, shard * prompt_per_shard + prompt_row
            start, n = int(prompt_used[u, k]), int(prompts[g])
            prompt_group[u, k, start:start + n] = g
            prompt_position[u, k, start:start + n] = np.arange(n)
            prompt_used[u, k] += n
            row_prompt[u, [shard * per_shard + r for r, length in zip(placed, group, strict=True) if length]] = k
        for member, n, local_row in zip(range(first, first + group_size), group.tolist(), placed, strict=True):
            if n == 0:
                continue
            k = shard * per_shard + local_row
            start = int(used[u, k])
            row[u, k, start:start + n] = member
            position[u, k, start:start + n] = np.arange(n)
            segment[u, k, start:start + n] = segment[u, k, :start].max(initial=0) + 1
            used[u, k] += n
    count = int(current.max()) + 1 if len(lengths) else 0
    if prompts is None:
        return PackingPlan(row, position, segment, count, owner=owner)
    return PackingPlan(row, position, segment, count, prompt_group, prompt_position, owner, row_prompt)


def _fit_group(group, used, width, prompt, prompt_used, prompt_width):
    """(the rows of the group's completions, the prompt row of its prompt or None) where both fit, else None."""
    placed = _first_fit(group, used, width, exclusive=True)
    if placed is None or prompt is None:
        return None if placed is None else (placed, None)
    prompt_row = _first_fit(prompt, prompt_used, prompt_width)
    return None if prompt_row is None else (placed, prompt_row[0])


def _first_fit(lengths: np.ndarray, used: np.ndarray, width: int, exclusive: bool = False) -> list[int] | None:
    """The row each item goes to (first with room), filling a copy of `used`; None if one does not fit.
    `exclusive`: rows others already use are closed (the items share rows only among themselves)."""
    closed = used > 0 if exclusive else np.zeros(len(used), bool)
    used, placed = used.copy(), []
    for n in lengths:
        room = np.flatnonzero((used + n <= width) & ~closed)
        if n and not len(room):
            return None
        k = int(room[0]) if n else 0
        used[k] += n
        placed.append(k)
    return placed


def pack(x, plan: PackingPlan, fill=0):
    """A per-token field [n, N, ...] -> [U, K, W, ...] laid out as `plan` says (padding slots: `fill`)."""
    return _gather(x, plan.row, plan.position, fill)


def pack_prompts(x, plan: PackingPlan, lengths, fill=0):
    """A per-token prompt field [n / G, P, ...], left-padded (real `lengths` [n / G]), -> the plan's prompt blocks
    [U, Kp, Wp, ...] (padding slots: `fill`)."""
    x, group = jnp.asarray(x), jnp.asarray(plan.prompt_group)
    offset = x.shape[1] - jnp.asarray(lengths, jnp.int32)[jnp.maximum(group, 0)]  # where the real tokens start
    return _gather(x, plan.prompt_group, offset + jnp.asarray(plan.prompt_position), fill)


def _gather(x, row, position, fill):
    x, row = jnp.asarray(x), jnp.asarray(row)
    gathered = x[jnp.maximum(row, 0), jnp.asarray(position)]
    real = row >= 0
    return jnp.where(real.reshape(real.shape + (1,) * (x.ndim - 2)), gathered, jnp.asarray(fill, x.dtype))


def unpack(packed, plan: PackingPlan, n_rows: int, n_tokens: int, fill=0):
    """The inverse of `pack`: [U, K, W, ...] (or one micro-batch's [K, W, ...], with its plan's [K, W] arrays) ->
    [n_rows, n_tokens, ...]; slots no packed token came from (positions past a completion's length) hold `fill`."""
    packed = jnp.asarray(packed)
    rows = jnp.where(jnp.asarray(plan.row) >= 0, jnp.asarray(plan.row), n_rows)  # padding: out of range, dropped
    out = jnp.full((n_rows, n_tokens) + packed.shape[rows.ndim:], fill, packed.dtype)
    return out.at[rows, jnp.asarray(plan.position)].set(packed, mode="drop")
