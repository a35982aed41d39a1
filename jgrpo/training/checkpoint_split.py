"""The checkpoint of a job whose trainer holds only some of its processes (`mesh.rollout_devices` across processes).

There the sampler gets whole processes, which hold no part of the training state: Orbax cannot write an array
from a process without a shard of it, so only the trainer's processes (the "holders") save and restore, with
Orbax's `active_processes`. Every process still runs the same loop: the others skip the writes, and on a resume
they receive from the first holder what steers the loop (iteration, epoch, counters, data position), while the
state's arrays stay where they live (each process's view of them holds nothing of its own: a program on devices
it does not hold runs nothing there).
"""

from __future__ import annotations

import jax
from etils import epath

from jgrpo.parallel.host_arrays import gather_json
from jgrpo.training.checkpoint import Checkpointer, CheckpointError, RunCounters, TrainState


def make_checkpointer(run_dir, config, mesh: jax.sharding.Mesh, **kwargs) -> Checkpointer | SplitCheckpointer:
    """A `Checkpointer` where `mesh` (the trainer's) spans every process, else a `SplitCheckpointer`."""
    holders = frozenset(d.process_index for d in mesh.devices.flat)
    if len(holders) == jax.process_count():
        return Checkpointer(run_dir, config, **kwargs)
    return SplitCheckpointer(run_dir, config, holders, **kwargs)


class SplitCheckpointer:
    """`Checkpointer`'s interface for every process of the job; the holders' calls do the work (module doc)."""

    def __init__(self, run_dir, config, holders: frozenset[int], **kwargs):
        self.holders, self.primary = holders, min(holders)
        self.inner = Checkpointer(run_dir, config, processes=holders, **kwargs) \
            if jax.process_index() in holders else None
        self.directory = epath.Path(run_dir) / "checkpoints"
        self.config = config

    should_save = Checkpointer.should_save  # (reads self.config only)

    def save(self, state: TrainState) -> None:
        if self.inner is not None:
            self.inner.save(state)

    def wait(self) -> None:
        if self.inner is not None:
            self.inner.wait()

    def close(self) -> None:
        if self.inner is not None:
            self.inner.close()

    def restore(self, target: TrainState, step: int | None = None) -> TrainState | None:
        """The holders' `Checkpointer.restore`; the others get its loop facts with `target`'s arrays (a collective:
        every process calls it). A holder's error reaches every process."""
        restored, facts = None, None
        try:
            if self.inner is not None:
                restored = self.inner.restore(target, step)
            if restored is not None:
                facts = {"iteration": restored.iteration, "epoch": restored.epoch,
                         "behaviour_version": restored.behaviour_version, "data_state": restored.data_state,
                         "counters": restored.counters.to_json(), "behaviour": restored.behaviour is not None,
                         "reference": restored.reference is not None}
        except Exception as e:  # noqa: BLE001 - shared below, then raised on every process
            error = e
            facts = {"error": f"{type(e).__name__}: {e}"}
        else:
            error = None
        facts = gather_json(facts if jax.process_index() == self.primary else None)[self.primary]
        if error is not None:
            raise error
        if facts is not None and "error" in facts:
            raise CheckpointError(f"the trainer's processes could not restore the checkpoint: {facts['error']}")
        if facts is None or restored is not None:
            return restored
        return TrainState(
            params=target.params, opt_state=target.opt_state, rng=target.rng,
            behaviour=_nothing_here(target.behaviour or target.params) if facts["behaviour"] else None,
            reference=_nothing_here(target.reference or target.params) if facts["reference"] else None,
            iteration=facts["iteration"], epoch=facts["epoch"], behaviour_version=facts["behaviour_version"],
            data_state=facts["data_state"], counters=RunCounters.from_json(facts["counters"]))


def _nothing_here(tree):
    """Arrays laid out like `tree` (arrays or ShapeDtypeStructs with shardings) of which this process holds no
    shard: its view of the holders' state."""
    return jax.tree.map(lambda x: jax.make_array_from_single_device_arrays(x.shape, x.sharding, [], dtype=x.dtype),
                        tree)
