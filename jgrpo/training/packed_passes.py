"""The log-prob passes (the reference's, pi_k's) over packed micro-batches: `model.packing` (#40).

The padded passes run C micro-batches of r rows, every completion padded to N tokens. Packed, the completions of
the whole batch go end to end into blocks of [K, W] slots (K·W = r·N, a padded micro-batch's completion slots)
and their groups' prompts into blocks of [Kp, Wp] (`PROMPT_GROUPS`·(r/G)·P slots; a completion row attends over
the whole prompt block and itself: [Kp·Wp + W] keys where the padded rows have P + N), as
`packing.plan_packing` plans them on the host from the lengths; a pass then runs only the micro-batches that hold
tokens (`lax.cond` skips the rest of a fixed buffer, so nothing recompiles when the count changes) and scatters
the log-probs back to [C, r, N]. Same numbers as the padded passes (tests/training/test_packed_passes.py).

The buffer holds one micro-batch per group (the worst case: a group a micro-batch), so each packed per-token field
is r/G times the size of its padded [C, r, N] form: small for token ids and log-probs, not for a mixture of
experts' replayed routing at r/G >> 1 (a tighter bound, or a few buffer sizes, is left to the update's packing).

Here: the sizes (`packed_sizes`), the host side (`plan_batch`: lengths -> plan -> device arrays, `PackedBatch`)
and one micro-batch's forward (`predicting_states`). The passes themselves are `StepFunctions`' (steps.py).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jgrpo.models.packed_forward import forward_packed, predecessor_hidden
from jgrpo.parallel.mesh import row_sharding
from jgrpo.training.packing import pack, pack_prompts, plan_packing


class PackedSizes(NamedTuple):
    rows: int  # K: packed completion rows per micro-batch
    width: int  # W >= N
    prompt_rows: int  # Kp
    prompt_width: int  # Wp >= P
    micro_batches: int  # U: the buffer (a micro-batch holds at least one group: never more than the groups)
    shards: int  # D: data shards the rows split over (a group stays on one)


# A packed micro-batch holds the groups whose completions fit it: with short completions several times a padded
# micro-batch's r / G groups, whose prompts must fit its prompt block too. Sized for PROMPT_GROUPS times r / G
# prompts (the arithmetic lengths' bound is 3.7x): at G = 8 and P = N / 4, 1/8 more slots than the padded
# micro-batch's. Too small a block opens micro-batches the completions did not need.
PROMPT_GROUPS = 4


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
    return PackedSizes(per_shard * shards, W, prompt_rows, prompt_width, groups, shards)


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
    count: jax.Array  # int32 scalar
    prompt_routing: jax.Array | None = None  # MoE replay: [U, Kp, Wp, L, k]
    routing: jax.Array | None = None  # [U, K, W, L, k]


def plan_batch(sizes: PackedSizes, prompt_tokens, prompt_mask, tokens, completion_mask, group_size: int,
               prompt_routing=None, routing=None) -> PackedBatch:
    """Plan a batch's packing from its lengths (on the host) and gather its fields into it (on the device).
    prompt_tokens, prompt_mask [B, P] (left-padded); tokens, completion_mask [R, N] (real tokens first, R = B·G);
    `prompt_routing` [B, P, L, k] and `routing` [R, N, L, k]: experts to replay, if any."""
    prompt_real, real = (np.asarray(x).astype(bool) for x in jax.device_get((prompt_mask, completion_mask)))
    prompt_lengths = prompt_real.sum(1)
    P = prompt_real.shape[1]
    if not (prompt_real == (np.arange(P)[None] >= (P - prompt_lengths)[:, None])).all():
        raise ValueError("packing needs left-padded prompts (prompt_mask a suffix)")
    lengths = real.sum(1)
    if not (real == (np.arange(real.shape[1])[None] < lengths[:, None])).all():
        raise ValueError("packing needs every completion's real tokens first (completion_mask a prefix)")
    plan = plan_packing(lengths, group_size=group_size, rows=sizes.rows, width=sizes.width,
                        micro_batches=sizes.micro_batches, shards=sizes.shards, prompt_lengths=prompt_lengths,
                        prompt_rows=sizes.prompt_rows, prompt_width=sizes.prompt_width)
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
        count=jnp.int32(plan.micro_batches),
        prompt_routing=None if prompt_routing is None else pack_prompts(prompt_routing, plan, prompt_lengths),
        routing=None if routing is None else pack(routing, plan))


def pack_batch(mesh, rules, chunks: int, width: int, prompt_tokens, prompt_mask, tokens, completion_mask,
               routing=None) -> PackedBatch:
    """`plan_batch` for the trainer's batch of C = `chunks` padded micro-batches: the sizes from its shapes and the
    data shards its rows split over, the experts to replay from its `routing` [C, r, P+N-1, L, k] (input position
    P+j is completion token j; a completion's last token is never an input), the rows placed on those shards."""
    (R, N), (B, P) = tokens.shape, prompt_tokens.shape
    G = R // B
    sizes = packed_sizes(rows=R // chunks, new_tokens=N, prompt_width=P, group_size=G, groups=B,
                         shards=data_shards(mesh, rules, chunks, R), width=width)
    prompt_routing = None
    if routing is not None:
        flat = routing.reshape((R,) + routing.shape[2:])
        prompt_routing = flat[::G, :P]
        routing = jnp.pad(flat[:, P:], ((0, 0), (0, 1)) + ((0, 0),) * (flat.ndim - 2))
    packed = plan_batch(sizes, prompt_tokens, prompt_mask, tokens, completion_mask, G, prompt_routing, routing)
    return jax.tree.map(lambda x: jax.device_put(x, row_sharding(mesh, rules, x.shape, row_axis=1))
                        if x.ndim >= 2 else x, packed)


def predicting_states(model, micro: PackedBatch, replay: bool, shards: int):
    """One packed micro-batch (fields without the U axis, rows in `shards` data shards): the hidden states
    [K, W, D] that predict its tokens."""
    routing = (micro.prompt_routing, micro.routing) if replay and micro.routing is not None else None
    prompt, completion, _ = forward_packed(model, micro.prompt_tokens, micro.prompt_group, micro.prompt_positions,
                                           micro.tokens, micro.group, micro.segment, micro.positions, routing,
                                           shards)
    return predecessor_hidden(prompt, completion, micro.index, micro.prompt_last)
