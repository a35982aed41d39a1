"""Expert parallelism: a mixture of experts' matmuls with the experts split over the mesh's `expert` axis.

With `mesh.expert` = n > 1 each device of an expert group (the n devices that differ only in their `expert`
coordinate) holds E / n experts, their weights FSDP-sharded within (gathered per layer as every weight is), and
its own share of the tokens: everything outside the experts' matmuls is data-parallel over the expert axis. The
experts' matmuls run per device under `shard_map` (the context mesh, `jax.set_mesh`), by `model.moe_dispatch`:

- `all_gather`: each device gathers its group's tokens with their experts and gates, runs its own experts on the
  assignments that are theirs (the others get gate 0 and add nothing), and a reduce-scatter sums each token's k
  outputs back onto the device the token came from. Every platform runs it; it moves every token to every
  device of the group (n - 1 token rows in, n - 1 output rows out per token), whatever k.

- `ragged_all_to_all` (TPU): each (token, expert) assignment goes only to the device that holds its expert
  (`jax.lax.ragged_all_to_all`, sizes exchanged first), runs there, and comes back the same way; the gates are
  applied where the token lives. It moves (n - 1)/n of the k assignments per token: fewer rows than all_gather's
  n - 1 when k < n, as many at k = n. XLA:CPU has no such op: on a CPU mesh the same exchange runs as a pure-JAX
  emulation (all-gathers, for tests only), and the config refuses the choice there.

Rows that do not split over the expert axis (too few, e.g. a small decode batch) stay whole on every device of the
group: each runs its experts on all of them and a sum over the group adds the outputs. The values and gradients
equal the unsplit layer's up to float summation order (tested against `mesh.expert` = 1).

Every assignment stays in the per-device static buffer of the chosen `moe_impl` (dropless, nothing recompiles):
with all_gather that buffer holds the whole group's assignments, and with ragged_all_to_all the receive buffer
has room for the whole group's (any device's experts may get them all). `sorted_tiles` and `ragged` compute the
whole static buffer (the price of fixed shapes without a capacity factor: n times the routed work); `megablox`
skips the rows that are not this device's (their expert id is one past its experts) and computes only the
routed rows. A planner's count of its FLOPs is the kernel's static estimate, the whole buffer: an upper bound.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jgrpo.config.errors import ConfigError
from jgrpo.parallel.mesh import BATCH_AXES, dividing_axes
from jgrpo.parallel.platform_defaults import resolve

DISPATCHES = ("all_gather", "ragged_all_to_all")
# What `model.moe_dispatch: auto` picks by platform (reasons: docs/configuration.md).
DISPATCH_AUTO = {"cpu": "all_gather", "tpu": "ragged_all_to_all", "gpu": "all_gather", "other": "all_gather"}


def resolve_moe_dispatch(choice: str, platform: str) -> str:
    """`model.moe_dispatch` ("auto" or one of DISPATCHES) on devices of `platform`."""
    dispatch = resolve("model.moe_dispatch", choice, DISPATCHES, DISPATCH_AUTO, platform)
    if dispatch == "ragged_all_to_all" and platform == "cpu":
        raise ConfigError("model.moe_dispatch=ragged_all_to_all: XLA:CPU has no ragged all-to-all; on CPU use "
                          "all_gather (or auto). Its TPU programs can be checked here: python -m jgrpo.plan CONFIG "
                          "--topology v5p:2x2x2")
    return dispatch


def expert_groups() -> int:
    """n, the size of the context mesh's expert axis (1 without a mesh or without the axis)."""
    mesh = jax.sharding.get_abstract_mesh()
    return 1 if mesh.empty or "expert" not in mesh.axis_names else mesh.shape["expert"]


class ExpertWeights(NamedTuple):
    """A layer's experts: gate, up [E, D, F] and down [E, F, D]."""

    gate: jax.Array
    up: jax.Array
    down: jax.Array


def run_experts(experts, x, ids, gates, weights: ExpertWeights, dispatch: str = "all_gather", kernel: bool = False):
    """`experts(x [M, D], ids [M, k], gates [M, k], gate, up, down) -> [M, D]` (a `moe.IMPLEMENTATIONS` entry) with
    the layer's expert `weights`, over the expert axis of the context mesh when it has one of size > 1; as it is
    otherwise, except that a `kernel` (a Pallas call, which XLA cannot partition) on a context mesh runs per device
    over the rows."""
    gate, up, down = weights
    n = expert_groups()
    mesh = jax.sharding.get_abstract_mesh()
    if n == 1 and kernel and not mesh.empty:
        tokens, whole = PartitionSpec(dividing_axes(mesh, BATCH_AXES, x.shape[0]), None), PartitionSpec()
        return jax.shard_map(experts, mesh=mesh, in_specs=(tokens, tokens, tokens, whole, whole, whole),
                             out_specs=tokens, check_vma=False)(x, ids, gates, gate, up, down)
    if n == 1:
        return experts(x, ids, gates, gate, up, down)
    if dispatch not in DISPATCHES:
        raise ValueError(f"moe_dispatch must be one of {DISPATCHES}, got '{dispatch}'")
    E = gate.shape[0]
    if E % n:
        raise ValueError(f"{E} experts do not split over an expert axis of {n} devices")
    local = E // n
    rows = dividing_axes(mesh, BATCH_AXES, x.shape[0])
    gathered = rows is not None and "expert" in rows
    tokens, weights = PartitionSpec(rows, None), PartitionSpec("expert", None, None)

    emulate = mesh.abstract_device.platform == "cpu"  # XLA:CPU has no ragged all-to-all

    # Assignments of another device's experts (or a static buffer's padding): a kernel skips id `local` (one past
    # its experts) at no cost; the other implementations take expert 0 with gate 0 (computed, adding nothing).
    skip = local if kernel else 0

    def per_device(x, ids, gates, gate, up, down):
        if gathered and dispatch == "ragged_all_to_all":
            return _exchange_assignments(experts, x, ids, gates, gate, up, down, n, emulate, skip)
        if gathered:  # the group's tokens, in the group's order
            x, ids, gates = (jax.lax.all_gather(a, "expert", axis=0, tiled=True) for a in (x, ids, gates))
        else:  # the same rows on every device, each of which uses them differently: their gradients add up.
            # Said explicitly: a gather's indices that differ per device do not make its operand's cotangent a sum
            # by themselves (jax 0.10.2: the tokens' gradient of sorted_tiles came back one device's share).
            x, ids, gates = (jax.lax.pcast(a, "expert", to="varying") for a in (x, ids, gates))
        mine = ids - jax.lax.axis_index("expert") * local  # this device's experts are 0 .. local - 1
        here = (mine >= 0) & (mine < local)
        y = experts(x, jnp.where(here, mine, skip), jnp.where(here, gates, 0), gate, up, down)
        if gathered:
            return jax.lax.psum_scatter(y, "expert", scatter_dimension=0, tiled=True)
        return jax.lax.psum(y, "expert")

    # A Pallas call's outputs carry no per-device typing (jax 0.10.2 refuses it under check_vma): unchecked there,
    # tested equal to the unsplit layer in values and gradients like the rest.
    return jax.shard_map(per_device, mesh=mesh, in_specs=(tokens, tokens, tokens, weights, weights, weights),
                         out_specs=tokens, check_vma=not kernel)(x, ids, gates, gate, up, down)


def _exchange_assignments(experts, x, ids, gates, gate, up, down, n: int, emulate: bool, skip: int):
    """The ragged_all_to_all dispatch on one device: its m tokens' m*k assignments sorted by expert (so by the
    device that holds it), each sent there, run by its expert, sent back, then weighted by the gates here."""
    m, k = ids.shape
    local = gate.shape[0]
    assignments = m * k
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    rows = x[order // k]  # [A, D] in expert order: one contiguous chunk per destination device
    send = jnp.bincount(flat // local, length=n).astype(jnp.int32)  # [n] rows to each device
    table = jax.lax.all_gather(send, "expert")  # [n, n]: table[i, j] rows device i sends device j
    me = jax.lax.axis_index("expert")
    recv = table[:, me]  # rows each device sends this one
    sent_before = jnp.cumsum(send) - send  # where each destination's chunk starts here
    recv_before = jnp.cumsum(recv) - recv  # where each source's chunk lands here (sources in device order)
    # Where this device's chunk lands on each receiver: after the chunks of the devices before it.
    lands_at = jnp.sum(jnp.where(jnp.arange(n)[:, None] < me, table, 0), axis=0)
    # Where each source's chunk came from on it (for the way back): after its chunks for devices before this one.
    came_from = jnp.sum(jnp.where(jnp.arange(n)[None, :] < me, table, 0), axis=1)
    capacity = n * assignments  # static: every token of the group could pick this device's experts
    there = (rows, (flat[order] % local).astype(jnp.int32)[:, None])
    received, expert = (_ragged_all_to_all(a, capacity, sent_before, send, lands_at, recv, emulate) for a in there)
    real = jnp.arange(capacity) < jnp.sum(recv)
    one = jnp.where(real, 1, 0).astype(x.dtype)[:, None]
    y = experts(received, jnp.where(real[:, None], expert, skip), one, gate, up, down)  # [capacity, D], ungated
    back = _ragged_all_to_all(y, assignments, recv_before, recv, came_from, send, emulate)  # [A, D] in `order`
    y = jnp.zeros_like(back).at[order].set(back).reshape(m, k, -1)
    return jnp.einsum("mk,mkd->md", gates, y)


def _ragged_all_to_all(rows, capacity: int, input_offsets, send_sizes, output_offsets, recv_sizes, emulate: bool):
    """`jax.lax.ragged_all_to_all` over the expert axis into a zero buffer of `capacity` rows; with `emulate`, the
    same result from all-gathers (each device reads its slices out of every device's rows)."""
    out = jnp.zeros((capacity, *rows.shape[1:]), rows.dtype)
    if not emulate:
        return jax.lax.ragged_all_to_all(rows, out, input_offsets, send_sizes, output_offsets, recv_sizes,
                                         axis_name="expert")
    me = jax.lax.axis_index("expert")
    every_rows = jax.lax.all_gather(rows, "expert")  # [n, A, ...]
    starts, sizes, lands = (jax.lax.all_gather(a, "expert")[:, me] for a in (input_offsets, send_sizes, output_offsets))
    slot = jnp.arange(capacity)
    hit = (slot[None] >= lands[:, None]) & (slot[None] < (lands + sizes)[:, None])  # [n, capacity]
    source = jnp.argmax(hit, axis=0)
    row = jnp.clip(starts[source] + slot - lands[source], 0, rows.shape[0] - 1)
    got = every_rows[source, row]
    return jnp.where(jnp.any(hit, axis=0).reshape(-1, *[1] * (rows.ndim - 1)), got, out)
