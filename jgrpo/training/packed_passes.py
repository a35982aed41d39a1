"""Packed micro-batches for the trainer's forwards: `model.packing` (#40). Their sizes, the host side, one forward.

The padded programs run micro-batches of r rows, every completion padded to N tokens. Packed, the completions go
end to end into blocks of [K, W] slots (K·W = r·N, a padded micro-batch's completion slots) and their groups'
prompts into blocks of [Kp, Wp] (`PROMPT_GROUPS`·(r/G)·P slots; a completion row holds one group and attends
over its group's prompt row and itself: Wp + W keys, as the padded rows' P + N), as `packing.plan_packing` plans
them on the host from the lengths: the whole batch for the log-prob passes (`pack_batch`), each minibatch
alone for the update (`pack_minibatches`). The programs (packed_layout.py) run only the micro-batches that hold
tokens of a fixed buffer, so nothing recompiles when the count changes.

The buffer holds one micro-batch per group (the worst case: a group a micro-batch), so each packed per-token field
is r/G times the size of its padded [C, r, N] form: small for token ids, not for a mixture of experts' replayed
routing at r/G >> 1 (a tighter bound, or a few buffer sizes, is a later step).

Here: the sizes (`packed_sizes`; `PackingTarget`: the trainer's), the host side (`plan_batch`: lengths -> plan ->
device arrays, `PackedBatch`) and one micro-batch's forward (`predicting_states`).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jgrpo.models.packed_forward import PackedStreams, forward_packed, predecessor_hidden
from jgrpo.parallel.host_arrays import fetch
from jgrpo.parallel.mesh import Rules, row_sharding
from jgrpo.training.packing import PackedSizes, pack, pack_prompts, plan_packing

# A packed micro-batch holds the groups whose completions fit it: with short completions more than a padded
# micro-batch's r / G groups, whose prompts must fit its prompt block too. Every prompt slot is computed, used or
# not, so the block costs: sized for PROMPT_GROUPS times r / G prompts. 2, because a row holds one group: at the
# arithmetic lengths (mean 70-82 of 256) a group of 8 fills 3 rows of N, so K = r rows hold 2 groups' completions
# (benchmarks/packing.py); a larger block only adds prompt work (4 cost 7-10% a micro-batch, benchmarks/
# packed_step.py). Too small a block opens micro-batches the completions did not need.
PROMPT_GROUPS = 2


def packed_sizes(*, rows: int, new_tokens: int, prompt_width: int, group_size: int, groups: int, shards: int,
                 width: int = 0, block: int = 8) -> PackedSizes:
    """The blocks of a packed micro-batch for padded micro-batches of `rows` x (`prompt_width` + `new_tokens`):
    W = `width` or N rounded up to `block`, K = r·N / W rounded down to whole shards but at least a group a shard
    (so any group fits an empty micro-batch), Wp = P, Kp = `PROMPT_GROUPS`·r / G (at least one a shard)."""
    W = width or -(-new_tokens // block) * block
    if W < new_tokens:
        raise ValueError(f"a packed width of {W} is less than max_new_tokens = {new_tokens}")
    per_shard = max(rows * new_tokens // W // shards, group_size)
    prompt_rows = min(max(PROMPT_GROUPS * rows // group_size // shards, 1), -(-groups // shards)) * shards
    return PackedSizes(rows=per_shard * shards, width=W, prompt_rows=prompt_rows, prompt_width=prompt_width,
                       micro_batches=groups, shards=shards)


def data_shards(mesh, rules, chunks: int, rows: int) -> int:
    """D: how many data shards the trainer's [C, r] rows split over (`row_sharding`), 1 where they do not split."""
    spec = row_sharding(mesh, rules, (chunks, rows // chunks), row_axis=1).spec
    axes = spec[1] if len(spec) > 1 and spec[1] else ()
    return math.prod(mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else axes))


class PackedBatch(NamedTuple):
    """One batch as packed micro-batches: arrays [U, Kp, Wp] (prompt_*) and [U, K, W]; `count` of the U hold tokens."""

    prompt_tokens: jax.Array
    prompt_group: jax.Array  # the group whose prompt is there, -1 on padding
    prompt_positions: jax.Array  # 0, 1, ... within the prompt
    tokens: jax.Array  # completion tokens, each the input at its slot and the target predicted for it
    group: jax.Array  # its group, -1 on padding
    segment: jax.Array  # 1, 2, ... per completion of a packed row, 0 on padding
    positions: jax.Array  # its prompt's real length + j (as when sampled)
    row: jax.Array  # the completion (row of the batch) it belongs to, -1 on padding
    index: jax.Array  # j, its index in that completion
    prompt_last: jax.Array  # for j = 0: where its prompt's last token sits in the flattened prompt block
    prompt_row: jax.Array  # [U, K]: the prompt row of each packed row's group (`packing.PackingPlan.prompt_row`)
    count: jax.Array  # int32 scalar
    owns: jax.Array  # [U, n] bool: the rows (of the n packed) whose group the micro-batch holds, each row in one
    prompt_routing: jax.Array | None = None  # MoE replay: [U, Kp, Wp, L, k]
    routing: jax.Array | None = None  # [U, K, W, L, k]
    rows_used: jax.Array | None = None  # [U]: the rows in use of each data shard's (a prefix; the most of any shard)


# The fields with a packed completion row on axis 0 of a micro-batch: what running fewer rows cuts.
ROW_FIELDS = ("tokens", "group", "segment", "positions", "row", "index", "prompt_last", "prompt_row", "routing")


def plan_batch(sizes: PackedSizes, prompt_tokens, prompt_mask, tokens, completion_mask, group_size: int,
               prompt_routing=None, routing=None) -> PackedBatch:
    """Plan a batch's packing from its lengths (on the host) and gather its fields into it (on the device).
    prompt_tokens, prompt_mask [B, P] (left-padded); tokens, completion_mask [R, N] (real tokens first, R = B·G);
    `prompt_routing` [B, P, L, k] and `routing` [R, N, L, k]: experts to replay, if any."""
    prompt_real, real = (np.asarray(x).astype(bool) for x in fetch((prompt_mask, completion_mask)))
    prompt_lengths = prompt_real.sum(1)
    P = prompt_real.shape[1]
    if not (prompt_real == (np.arange(P)[None] >= (P - prompt_lengths)[:, None])).all():
        raise ValueError("packing needs left-padded prompts (prompt_mask a suffix)")
    lengths = real.sum(1)
    if not (real == (np.arange(real.shape[1])[None] < lengths[:, None])).all():
        raise ValueError("packing needs every completion's real tokens first (completion_mask a prefix)")
    plan = plan_packing(lengths, sizes, group_size, prompt_lengths)
    group = np.where(plan.row >= 0, plan.row // group_size, -1)
    U = sizes.micro_batches
    # Where each group's prompt ends in its micro-batch's flattened prompt block: the first token predicts from it.
    flat_group = plan.prompt_group.reshape(U, -1)
    flat_position = plan.prompt_position.reshape(U, -1)
    is_last = (flat_group >= 0) & (flat_position == prompt_lengths[np.maximum(flat_group, 0)] - 1)
    last = np.zeros((U, len(prompt_lengths)), np.int32)
    u, at = np.nonzero(is_last)
    last[u, flat_group[u, at]] = at
    prompt_last = last[np.arange(U)[:, None, None], np.maximum(group, 0)]
    return PackedBatch(
        prompt_tokens=pack_prompts(prompt_tokens, plan, prompt_lengths),
        prompt_group=jnp.asarray(plan.prompt_group), prompt_positions=jnp.asarray(plan.prompt_position),
        tokens=pack(tokens, plan), group=jnp.asarray(group, jnp.int32), segment=jnp.asarray(plan.segment),
        positions=jnp.asarray(np.where(group >= 0, prompt_lengths[np.maximum(group, 0)] + plan.position, 0),
                              jnp.int32),
        row=jnp.asarray(plan.row), index=jnp.asarray(plan.position), prompt_last=jnp.asarray(prompt_last),
        prompt_row=jnp.asarray(plan.prompt_row),
        count=jnp.int32(plan.micro_batches), owns=jnp.asarray(plan.owner[None] == np.arange(U)[:, None]),
        prompt_routing=None if prompt_routing is None else pack_prompts(prompt_routing, plan, prompt_lengths),
        routing=None if routing is None else pack(routing, plan), rows_used=jnp.asarray(_rows_used(plan.row, sizes)))


def _rows_used(row: np.ndarray, sizes: PackedSizes) -> np.ndarray:
    """[U]: how many of each data shard's rows a micro-batch uses, counted to its last row in use (first fit fills
    a shard's rows from its first), the most of any shard."""
    U, K = row.shape[:2]
    in_use = (row >= 0).any(-1).reshape(U, sizes.shards, K // sizes.shards)
    last = np.where(in_use.any(-1), in_use.shape[-1] - np.argmax(in_use[..., ::-1], axis=-1), 0)
    return last.max(-1).astype(np.int32)


def row_buckets(rows_per_shard: int, fractions) -> list[int]:
    """The rows per data shard a packed micro-batch can run at (`model.packing_row_buckets`): each fraction of its
    rows, rounded up, and all of them."""
    return sorted({max(1, math.ceil(f * rows_per_shard)) for f in fractions} | {rows_per_shard})


def on_rows_in_use(fn, micro: PackedBatch, fractions, shards: int, on_rows=None, rows_out: bool = False):
    """fn(micro) computed on the rows `micro` uses only: each data shard's first k rows, k the first of the
    `row_buckets` that holds `micro.rows_used` (one branch per bucket, `lax.switch`: every one compiled, one run).
    `rows_out`: fn returns [rows, ...], given back as [K, ...] with zeros in the rows not run; else the same shapes
    in every branch. `on_rows`: the sharding constraint for the cut rows."""
    K = micro.tokens.shape[0]
    sizes = row_buckets(K // shards, fractions)
    if len(sizes) == 1:
        return fn(micro)

    def branch(k):
        def run(m):
            out = fn(first_rows(m, k, shards, on_rows))
            if not rows_out:
                return out
            per_shard = out.reshape(shards, k, *out.shape[1:])
            padding = ((0, 0), (0, K // shards - k)) + ((0, 0),) * (out.ndim - 1)
            return jnp.pad(per_shard, padding).reshape(K, *out.shape[1:])
        return run

    index = jnp.searchsorted(jnp.asarray(sizes, jnp.int32), micro.rows_used)
    return jax.lax.switch(index, [branch(k) for k in sizes], micro)


def first_rows(micro: PackedBatch, k: int, shards: int, on_rows=None) -> PackedBatch:
    """A micro-batch cut to each data shard's first k rows (its `ROW_FIELDS`; the prompt block stays whole)."""
    def cut(x):
        x = x.reshape(shards, -1, *x.shape[1:])[:, :k].reshape(shards * k, *x.shape[1:])
        return x if on_rows is None else on_rows(x)

    return micro._replace(**{f: cut(getattr(micro, f)) for f in ROW_FIELDS if getattr(micro, f) is not None})


def packed_shapes(sizes: PackedSizes, rows: int, routing: tuple | None = None,
                  minibatches: int | None = None) -> PackedBatch:
    """A `PackedBatch` of `sizes` as `jax.ShapeDtypeStruct`s (the planner's, which has no lengths): `rows` the rows
    it packs, `routing` (L, k, dtype) of a replayed record or None, `minibatches` M for the update's stack."""
    lead = () if minibatches is None else (minibatches,)
    U = sizes.micro_batches
    block, prompt = lead + (U, sizes.rows, sizes.width), lead + (U, sizes.prompt_rows, sizes.prompt_width)

    def shaped(shape, dtype=jnp.int32):
        return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))

    replayed = routing is not None
    return PackedBatch(*(shaped(prompt) for _ in range(3)), *(shaped(block) for _ in range(7)),
                       shaped(lead + (U, sizes.rows)), shaped(lead),
                       shaped(lead + (U, rows), bool),
                       shaped(prompt + routing[:2], routing[2]) if replayed else None,
                       shaped(block + routing[:2], routing[2]) if replayed else None, shaped(lead + (U,)))


class PackingTarget(NamedTuple):
    """Where the trainer's packed rows go: its mesh and rules, the C chunks of its padded [C, r] rows (whose data
    shards a packed row's group stays on), the packed width (`model.packing_width`, 0: N rounded up to 8) and the
    group size G."""

    mesh: Mesh
    rules: Rules
    chunks: int
    width: int
    group_size: int

    def sizes(self, rows: int, new_tokens: int, prompt_width: int, groups: int) -> PackedSizes:
        """`packed_sizes` of a plan of `groups` groups of the trainer's R = `rows` rows, on its data shards."""
        return packed_sizes(rows=rows // self.chunks, new_tokens=new_tokens, prompt_width=prompt_width,
                            group_size=self.group_size, groups=groups,
                            shards=data_shards(self.mesh, self.rules, self.chunks, rows), width=self.width)


def pack_batch(target: PackingTarget, prompt_tokens, prompt_mask, tokens, completion_mask, routing=None) -> PackedBatch:
    """`plan_batch` for the trainer's batch (`target`): the sizes from its shapes and the data shards its rows split
    over, the experts to replay from its `routing` [C, r, P+N-1, L, k], the rows placed on those shards. For the
    log-prob passes, which run over the whole batch."""
    (R, N), (B, P) = tokens.shape, prompt_tokens.shape
    sizes = target.sizes(R, N, P, groups=B)
    flat = None if routing is None else routing.reshape((R,) + routing.shape[2:])
    packed = _plan_rows(sizes, prompt_tokens, prompt_mask, tokens, completion_mask, R // B, flat)
    return _placed(target.mesh, target.rules, packed, row_axis=1)


def pack_minibatches(target: PackingTarget, batch, minibatches: int) -> PackedBatch:
    """The update's packing: each of the `minibatches` minibatches (its chunks of the trainer's [C, r] rows, as
    dealt: after a group shuffle, the shuffled rows) planned alone, as `pack_batch` plans the whole batch, its
    row ids local to it; fields stacked [M, U, ...] (U: a minibatch's groups), `count` [M].
    From the update's batch (a `step_batch.StepBatch`): its `inputs`, `input_mask` [C, r, P+N-1], `targets`
    [C, r, N], `lengths` [C, r] (each completion's real tokens) and `routing` [C, r, P+N-1, L, k] or None."""
    inputs, targets = batch.inputs, batch.targets
    C, r, N = targets.shape
    G, P = target.group_size, inputs.shape[2] + 1 - N
    rows = C // minibatches * r  # a minibatch's
    sizes = target.sizes(C * r, N, P, groups=rows // G)
    # The masks on the host in one round trip (each minibatch's plan reads them there).
    lengths, prompt_mask = (np.asarray(x) for x in fetch((batch.lengths, batch.input_mask[..., :P])))
    real = np.arange(N)[None] < lengths.reshape(C * r, 1)
    flat_inputs, flat_prompt_mask = inputs.reshape(C * r, -1), prompt_mask.reshape(C * r, P)
    flat_targets = targets.reshape(C * r, N)
    routing = batch.routing
    flat_routing = None if routing is None else routing.reshape((C * r,) + routing.shape[2:])
    packed = []
    for m in range(minibatches):
        own, groups = slice(m * rows, (m + 1) * rows), slice(m * rows, (m + 1) * rows, G)
        packed.append(_plan_rows(sizes, flat_inputs[groups, :P], flat_prompt_mask[groups], flat_targets[own],
                                 real[own], G, None if flat_routing is None else flat_routing[own]))
    return _placed(target.mesh, target.rules, jax.tree.map(lambda *x: jnp.stack(x), *packed), row_axis=2)


def _plan_rows(sizes: PackedSizes, prompt_tokens, prompt_mask, tokens, completion_mask, group_size: int,
               routing=None) -> PackedBatch:
    """`plan_batch` of rows whose experts to replay are `routing` [R, P+N-1, L, k] (input position P+j is
    completion token j; a completion's last token is never an input, its slot gets expert 0)."""
    prompt_routing = None
    if routing is not None:
        P = prompt_tokens.shape[1]
        prompt_routing = routing[::group_size, :P]
        routing = jnp.pad(routing[:, P:], ((0, 0), (0, 1)) + ((0, 0),) * (routing.ndim - 2))
    return plan_batch(sizes, prompt_tokens, prompt_mask, tokens, completion_mask, group_size, prompt_routing,
                      routing)


def _placed(mesh, rules, packed: PackedBatch, row_axis: int) -> PackedBatch:
    """The packed rows (axis `row_axis`) on the data shards the plan dealt them to."""
    return jax.tree.map(lambda x: jax.device_put(x, row_sharding(mesh, rules, x.shape, row_axis=row_axis))
                        if x.ndim > row_axis else x, packed)


def predicting_states(model, micro: PackedBatch, replay: bool, shards: int, group_size: int = 1,
                      new_tokens: int | None = None, on_rows=None):
    """One packed micro-batch (fields without the U axis, rows in `shards` data shards): the hidden states
    [K, W, D] that predict its tokens. With
    `new_tokens` N (the update, a mixture of experts): also the experts the router picks (prompt [Kp, Wp, L, k],
    completion [K, W, L, k]) and each layer's `moe.RouterStats`, over the tokens the padded forward runs
    (prompts G = `group_size` times; a completion's token N-1 is never an input there)."""
    routing = (micro.prompt_routing, micro.routing) if replay and micro.routing is not None else None
    stats = new_tokens is not None
    counted = (micro.group >= 0) & (micro.index < new_tokens - 1) if stats else None
    streams = PackedStreams(micro.prompt_tokens, micro.prompt_group, micro.prompt_positions, micro.tokens, micro.group,
                            micro.segment, micro.positions, micro.prompt_row, routing)
    prompt, completion, chosen, *router = forward_packed(model, streams, shards, router_stats=stats,
                                                         group_size=group_size, counted=counted, on_rows=on_rows)
    hidden = predecessor_hidden(prompt, completion, micro.index, micro.prompt_last)
    return (hidden, chosen, router[0]) if stats else hidden
