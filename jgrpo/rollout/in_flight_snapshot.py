"""The in-flight producer's state between two decode chunks (`Flight`), and its snapshot: what a checkpoint keeps
so that a resumed run goes on as the run that was not killed (`rollout.weight_updates: in_flight`).

The producer keeps each row's keys/values as the versions that fed its tokens computed them, so a row in flight
cannot be regenerated without those versions. The snapshot keeps the sampler's pool itself: taken at the chunk
boundary where version v takes effect (v = the iteration of the trainer's checkpoint, a multiple of
`checkpoint.every`), before v does, it holds

- every array of the pool (its page pools with the rows' keys/values, the rows' tokens, log-probs and versions,
  the slots, the free pages, the counters) and of its prompt store;
- the batches it had sampled that the trainer had not taken (queued, or complete and waiting for an older one):
  their rows, versions and metrics;
- where it was: the version in effect, the batches handed over and drawn, which batch each lane holds.

Prompts are not kept: the resumed run reads the batches the trainer had not taken from the data again (from the
checkpoint's data position, in order) and scores the sampled ones again. Cost per checkpoint, on disk and in the
host's memory while it is written: the pool (its KV pages: `sampler.kv_pages`, by default the lanes' prompts and
one row at its longest per slot) and up to lag sampled batches' rows. It does not grow with the staleness bound
beyond the lanes' prompts (max_staleness - lag + 1 batches of them).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jgrpo.parallel.host_arrays import fetch
from jgrpo.sampling.decode_loop import outputs
from jgrpo.sampling.state import SampleOutput
from jgrpo.sampling.turns import SlotState


@dataclasses.dataclass
class Flight:
    """The in-flight producer's loop state."""

    state: SlotState  # the stream
    version: int  # the version decoding now
    params: Any  # its params
    handed: int  # the index of the next batch to hand to the trainer
    in_lane: dict = dataclasses.field(default_factory=dict)  # lane -> (batch index, batch, data state after it)
    complete: dict = dataclasses.field(default_factory=dict)  # index -> (rows, batch, data state): not handed yet
    mark: tuple = (0, 0)  # the pool's (busy, clock) when the last batch was handed over
    wall: float = dataclasses.field(default_factory=time.perf_counter)


def rows_of(state: SlotState, rows: np.ndarray) -> SampleOutput:
    """The pool's rows `rows` (global indices, in order) as numpy."""
    out = fetch(_outputs(state.spec.plan, state.pool, state.store))
    return out.map(lambda x: np.asarray(x)[rows])


_outputs = jax.jit(lambda plan, pool, store: outputs(plan, pool, store=store), static_argnums=0)


def _is_key(x) -> bool:
    return jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def take_snapshot(f: Flight, queued: list, next_index: int) -> dict:
    """{"arrays": numpy arrays (nested dicts), "meta": JSON} of the producer at this boundary; `queued`: the
    items handed over and not taken."""
    leaves = jax.tree.leaves((f.state.store, f.state.pool))
    pool = {str(i): np.asarray(jax.device_get(jax.random.key_data(x) if _is_key(x) else x))
            for i, x in enumerate(leaves)}
    rows, batches = {}, []
    for item in queued:
        if isinstance(item, BaseException):
            continue
        rows[str(item.index)] = _fields(jax.device_get(item.rollout.samples))
        batches.append({"index": item.index, "version": item.version, "metrics": item.metrics or {}})
    for index, (host, _, _) in f.complete.items():
        rows[str(index)] = _fields(host)
        batches.append({"index": index, "version": None, "metrics": {}})
    arrays = {"pool": pool, "drained": f.state.drained.copy(), "batch_rows": rows}
    meta = {"version": f.version, "handed": f.handed, "next_index": next_index, "mark": list(f.mark),
            "lanes": {str(lane): index for lane, (index, _, _) in f.in_lane.items()}, "batches": batches,
            "layout": jax.tree.map(lambda x: [list(x.shape), str(x.dtype)], arrays)}
    return {"arrays": arrays, "meta": meta}


def _fields(samples: SampleOutput) -> dict:
    return {name: np.asarray(x) for name, x in samples._asdict().items() if x is not None}


def restore_flight(f: Flight, saved: dict) -> tuple[Flight, dict]:
    """(`f`, a fresh stream of the same spec, with the snapshot's pool, drained rows and counters; the sampled
    batches' rows by index (numpy SampleOutput))."""
    arrays, meta = saved["arrays"], saved["meta"]
    fresh, treedef = jax.tree.flatten((f.state.store, f.state.pool))
    if len(fresh) != len(arrays["pool"]):
        raise ValueError(f"the checkpoint's in-flight pool has {len(arrays['pool'])} arrays, this run's "
                         f"{len(fresh)}: resume with the sampler settings that wrote it")
    leaves = []
    for i, like in enumerate(fresh):
        value = arrays["pool"][str(i)]
        shape = np.shape(value)[:like.ndim] if _is_key(like) else np.shape(value)  # (a key's data: one axis more)
        if tuple(shape) != tuple(like.shape):
            raise ValueError(f"the checkpoint's in-flight pool array {i} is {np.shape(value)}, this run's "
                             f"{like.shape}: resume with the sampler settings that wrote it")
        value = jax.random.wrap_key_data(value, impl=jax.random.key_impl(like)) if _is_key(like) else value
        leaves.append(jax.device_put(value, like.sharding))
    store, pool = jax.tree.unflatten(treedef, leaves)
    state = SlotState(f.state.spec, store, pool, np.asarray(arrays["drained"], bool))
    batch_rows = {int(index): SampleOutput(**{k: np.asarray(v) for k, v in rows.items()})
                  for index, rows in arrays["batch_rows"].items()}
    return Flight(state, int(meta["version"]), None, int(meta["handed"]), mark=tuple(meta["mark"])), batch_rows
