"""Every piece of training state in one Orbax checkpoint, saved asynchronously, restored with fallback.

One checkpoint (a step directory under `RUN_DIR/checkpoints`) holds these Orbax items:

    params      current params                         StandardSave (sharded arrays)
    opt_state   optimiser state                        StandardSave
    behaviour   behaviour params, only when a separate copy exists (v > 1)
    reference   reference params, only when they differ from the initial ones (after a swap)
    rng         the trainer's PRNG key as raw key data StandardSave (uint32 array)
    meta        iteration, epoch, behaviour version, counters, which optional items exist   JsonSave
    data        the prompt iterator's state            JsonSave
    config      the resolved run config                JsonSave

Restoring places every array directly in the sharding of the abstract target the trainer passes,
so a multi-host run never materialises a whole tensor on one host. The latest checkpoint that
restores cleanly wins: one that fails (a missing or truncated file, unreadable metadata, or arrays whose
content fingerprint differs from the one recorded at save time, e.g. a flipped bit) is logged
with its step and the reason, moved aside to `checkpoints_corrupt/` so the run can save that step
again, and the previous one is tried.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import threading
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from jgrpo.config import CheckpointConfig
from jgrpo.config.errors import UserError
from jgrpo.parallel.fingerprint import fingerprint
from jgrpo.parallel.host_arrays import broadcast_json
from jgrpo.training.checkpoint_handlers import ArrayHandler

log = logging.getLogger(__name__)

_ARRAY_ITEMS = ("params", "opt_state", "behaviour", "reference")


@dataclasses.dataclass
class RunCounters:
    """The run's counters, checkpointed as JSON in `meta`. A checkpoint written before a counter existed resumes
    it from 0; one written with a counter this version does not know is refused by name (never dropped)."""

    prompt_width: int = 0  # the padded prompt width compiled so far (it only grows)
    optimizer_steps: int = 0  # applied optimiser steps (the lr schedule counts these)
    nonfinite_in_a_row: int = 0
    nonfinite_total: int = 0
    empty_steps: int = 0  # steps with nothing in the loss (skipped with optim.skip_empty_steps)
    behaviour_refreshes: int = 0  # behaviour <- current copies so far (v > 1 or adaptive)
    refresh_requested: int = 0  # adaptive v: why the next iteration refreshes (REFRESH_REASONS), 0 = not
    batches_drawn: int = 0  # async rollouts: prompt batches taken from the data (trained or dropped)
    stale_dropped: int = 0  # async rollouts: batches dropped as staler than rollout.max_staleness

    @classmethod
    def from_json(cls, saved: dict) -> RunCounters:
        unknown = sorted(set(saved) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise IncompatibleCheckpoint(f"the checkpoint has run counters this version of jgrpo does not know: "
                                         f"{unknown}; resume it with the jgrpo version that wrote it")
        return cls(**{name: int(value) for name, value in saved.items()})

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class TrainState:
    """What a run needs to continue exactly where it stopped."""

    params: Any
    opt_state: Any
    behaviour: Any | None  # a separate pytree only when v > 1
    reference: Any | None  # only when it differs from the initial params (after a reference swap)
    rng: jax.Array  # typed PRNG key
    iteration: int  # iterations completed
    epoch: int  # epochs completed
    behaviour_version: int  # the iteration whose current params the behaviour copy holds
    data_state: dict  # the prompt iterator's get_state()
    counters: RunCounters = dataclasses.field(default_factory=RunCounters)
    # In flight (`rollout.weight_updates`): the sampler's state at this iteration's boundary, {"arrays", "meta"}
    # (jgrpo/rollout/in_flight_snapshot.py), saved as the items `stream` and `stream_meta`; None: not kept.
    rollout_stream: dict | None = None


class CheckpointError(RuntimeError):
    """No checkpoint in the run directory could be restored."""


class IncompatibleCheckpoint(CheckpointError, UserError):
    """A readable checkpoint this run cannot continue (never quarantined as corrupt: it is not)."""


class CheckpointNotFound(CheckpointError, UserError):
    """The step asked for (`--step N`) is not in the run directory."""


def _abstract(tree):
    """Arrays -> ShapeDtypeStructs that keep the sharding, so restore places each leaf where it belongs."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)), tree)


def latest_data_state(run_dir) -> dict | None:
    """The data iterator state of the newest checkpoint in `run_dir`, read without any array (None when there is
    no checkpoint or it cannot be read: the full restore then decides), so a resume onto other data can be
    refused before a model loads. With several processes, process 0 decides whether there is one for all (a
    collective): a process that looked after another had made the folder would open Orbax's barriers alone."""
    directory = epath.Path(run_dir) / "checkpoints"
    if not broadcast_json(directory.is_dir()):
        return None
    try:
        manager = ocp.CheckpointManager(directory if "://" in str(directory) else directory.absolute(),
                                        options=ocp.CheckpointManagerOptions(read_only=True, create=False))
        try:
            step = manager.latest_step()
            if step is None:
                return None
            return manager.restore(step, args=ocp.args.Composite(data=ocp.args.JsonRestore()))["data"]
        finally:
            manager.close()
    except Exception:  # noqa: BLE001 - unreadable here means: let the restore itself report it (or fall back)
        return None


class Checkpointer:
    """Save and restore `TrainState` under `run_dir/checkpoints` with Orbax's CheckpointManager."""

    def __init__(self, run_dir: str | Path, config: CheckpointConfig, resolved_config: dict | None = None,
                 read_only: bool = False, base: tuple[str, list[int]] | None = None,
                 processes: frozenset[int] | None = None):
        """`read_only` (evaluation, export) never writes, moves or cleans up anything: a training run may be
        saving into the same directory at that moment. `base` = (name, fingerprint) of a LoRA run's frozen
        base: recorded with every save, and a checkpoint of adapters trained on another base is refused.
        `processes`: the processes that hold the state and make every call, when not all of them do
        (`checkpoint_split.SplitCheckpointer`); the first writes the files."""
        self.base = base
        self.processes = processes
        self.primary = min(processes) if processes else 0
        self.run_dir = epath.Path(run_dir)  # a local folder or a bucket (gs://...)
        self.directory = self.run_dir / "checkpoints"
        self.config = config
        self.resolved_config = resolved_config or {}
        self.read_only = read_only
        if not read_only:
            self._report_partial_saves()
        # (every handler is told which processes call it: by default process 0 writes an item's files)
        processing = ocp.options.MultiprocessingOptions(primary_host=self.primary, active_processes=processes)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=config.keep,
            enable_async_checkpointing=config.async_save,
            create=not read_only and processes is None,  # (Orbax refuses it with active_processes: made below)
            read_only=read_only,
            cleanup_tmp_directories=not read_only,  # partial saves of a killed run; reported above, then removed
            multiprocessing_options=processing,
        )
        if processes is not None and not read_only:
            self.directory.mkdir(parents=True, exist_ok=True)
        # Orbax wants an absolute path; a bucket path is one already (and absolute() would mangle its "//").
        directory = self.directory if "://" in str(self.directory) else self.directory.absolute()
        registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
        for name in _ARRAY_ITEMS + ("rng", "stream"):
            handler = ArrayHandler(use_compression=config.compress, multiprocessing_options=processing)
            registry.add(name, ocp.args.StandardSave, handler)
            registry.add(name, ocp.args.StandardRestore, handler)
        for name in ("meta", "data", "config", "stream_meta"):
            handler = ocp.JsonCheckpointHandler(multiprocessing_options=processing)
            registry.add(name, ocp.args.JsonSave, handler)
            registry.add(name, ocp.args.JsonRestore, handler)
        self.manager = ocp.CheckpointManager(directory, options=options, handler_registry=registry)

    # ------------------------------------------------------------------ save

    def should_save(self, iteration: int, last: bool) -> bool:
        """Every `checkpoint.every` iterations, and always after the final one."""
        return last or (self.config.every > 0 and iteration % self.config.every == 0)

    def save(self, state: TrainState) -> None:
        """Start saving `state` as step `state.iteration`; returns once the arrays are copied off the device.

        The write itself continues in the background when `checkpoint.async_save` is on, so the params may be
        donated to the next training step right away.
        """
        step = state.iteration
        if step in self.manager.all_steps():  # e.g. the final save right after a periodic one
            return
        rng = {"key_data": jax.random.key_data(state.rng)}
        arrays = {"params": state.params, "opt_state": state.opt_state, "rng": rng}
        if state.behaviour is not None:
            arrays["behaviour"] = state.behaviour
        if state.reference is not None:
            arrays["reference"] = state.reference
        # One holder among several processes: Orbax takes its arrays (all addressable here) for pmap's host-local
        # ones and refuses them; as numpy the holder (process 0: Orbax writes numpy from there) writes them whole,
        # and a restore lays them out as before.
        saved = jax.device_get(arrays) if self.processes is not None and len(self.processes) == 1 else arrays
        fingerprints = {name: fingerprint(tree) for name, tree in arrays.items()}  # (the stream's added below)
        items = {
            **{name: ocp.args.StandardSave(tree) for name, tree in saved.items()},
            "meta": ocp.args.JsonSave(
                {
                    "iteration": state.iteration,
                    "epoch": state.epoch,
                    "behaviour_version": state.behaviour_version,
                    "has_behaviour": state.behaviour is not None,
                    "has_reference": state.reference is not None,
                    "has_stream": state.rollout_stream is not None,
                    "rng_impl": str(jax.random.key_impl(state.rng)),
                    "counters": state.counters.to_json(),
                    "fingerprints": fingerprints,
                    **({"base": {"name": self.base[0], "fingerprint": self.base[1]}} if self.base else {}),
                    "saved_at": time.time(),
                }
            ),
            "data": ocp.args.JsonSave(state.data_state),
            "config": ocp.args.JsonSave(self.resolved_config),
        }
        if state.rollout_stream is not None:  # host arrays, fingerprinted beside the others
            items["stream"] = ocp.args.StandardSave(state.rollout_stream["arrays"])
            items["stream_meta"] = ocp.args.JsonSave(state.rollout_stream["meta"])
            fingerprints["stream"] = fingerprint(state.rollout_stream["arrays"])
        self.manager.save(step, args=ocp.args.Composite(**items), force=True)

    def wait(self) -> None:
        """Block until a background save has been committed to disk."""
        self.manager.wait_until_finished()

    def close(self) -> None:
        """Finish a background save and release the manager (safe to call twice)."""
        if getattr(self, "_closed", False):
            return
        self._closed = True
        self.manager.wait_until_finished()
        self.manager.close()

    # --------------------------------------------------------------- restore

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def restore(self, target: TrainState, step: int | None = None) -> TrainState | None:
        """The newest restorable checkpoint (or exactly `step`), laid out like `target`; None if there is none.

        `target` supplies structure, dtypes and shardings: its params / opt_state / rng arrays (concrete
        or ShapeDtypeStruct). Behaviour and reference use `target.behaviour` / `target.reference` when given,
        else the layout of `target.params`.
        """
        return self._first_usable(step, lambda candidate: self._restore_step(candidate, target))

    def restore_params(self, abstract_params, step: int | None = None):
        """(params, iteration) of the newest restorable checkpoint (or `step`); None if there is none.

        For evaluation and export: only the current params are read, laid out like `abstract_params`.
        """
        def read(candidate):
            meta = self.manager.restore(candidate, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
            self._check_base(meta)
            layout = {"params": _abstract(abstract_params)}
            restored = self.manager.restore(
                candidate, args=ocp.args.Composite(params=ocp.args.StandardRestore(layout["params"])))
            _check_restored_shapes(restored, layout)
            if fingerprint(restored["params"]) != meta["fingerprints"]["params"]:
                raise CheckpointError("item 'params' does not match the fingerprint recorded at save time (corrupt)")
            return restored["params"], int(meta["iteration"])

        return self._first_usable(step, read, quarantine=False)

    def _first_usable(self, step: int | None, read, quarantine: bool = True):
        steps = sorted(self.manager.all_steps(), reverse=True)
        if step is not None:
            if step not in steps:
                raise CheckpointNotFound(f"no checkpoint for step {step} in {self.directory}; found {sorted(steps)}")
            return read(step)
        failures = []
        for candidate in steps:
            try:
                return read(candidate)
            except IncompatibleCheckpoint:
                raise
            except Exception as e:  # noqa: BLE001 - any failure to read a checkpoint means: use an older one
                reason = f"{type(e).__name__}: {e}".splitlines()[0][:300]
                log.warning("checkpoint step %d in %s is unusable (%s); falling back to the previous one",
                            candidate, self.directory, reason)
                failures.append((candidate, reason))
                if quarantine and not self.read_only:
                    self._quarantine(candidate)
        if failures:
            raise CheckpointError(
                f"no usable checkpoint in {self.directory}: "
                + "; ".join(f"step {s}: {r}" for s, r in failures)
                + ". Move the run directory aside (or set checkpoint.resume=false with a new run.output_dir)."
            )
        return None

    def _restore_step(self, step: int, target: TrainState) -> TrainState:
        head = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore(),
                                                                  data=ocp.args.JsonRestore()))
        meta, data_state = head["meta"], head["data"]
        if meta.get("iteration") != step:
            raise CheckpointError(f"metadata says iteration {meta.get('iteration')} but the step is {step}")
        self._check_base(meta)
        params_layout = _abstract(target.params)
        abstract = {
            "params": params_layout,
            "opt_state": _abstract(target.opt_state),
            "rng": _abstract({"key_data": jax.random.key_data(target.rng)}),
        }
        if meta["has_behaviour"]:
            abstract["behaviour"] = _abstract(target.behaviour) if target.behaviour is not None else params_layout
        if meta["has_reference"]:
            abstract["reference"] = _abstract(target.reference) if target.reference is not None else params_layout
        restored = self.manager.restore(
            step, args=ocp.args.Composite(**{k: ocp.args.StandardRestore(v) for k, v in abstract.items()})
        )
        _check_restored_shapes(restored, abstract)
        for name in abstract:
            if fingerprint(restored[name]) != meta["fingerprints"][name]:
                raise CheckpointError(f"item '{name}' does not match the fingerprint recorded at save time (corrupt)")
        stream = self._restore_stream(step, meta) if meta.get("has_stream") else None
        rng = jax.random.wrap_key_data(restored["rng"]["key_data"], impl=meta["rng_impl"])
        log.info("restored checkpoint step %d from %s", step, self.directory)
        return TrainState(
            params=restored["params"],
            opt_state=restored["opt_state"],
            behaviour=restored.get("behaviour"),
            reference=restored.get("reference"),
            rng=rng,
            iteration=int(meta["iteration"]),
            epoch=int(meta["epoch"]),
            behaviour_version=int(meta["behaviour_version"]),
            data_state=data_state,
            counters=RunCounters.from_json(meta.get("counters", {})),
            rollout_stream=stream,
        )

    def _restore_stream(self, step: int, meta: dict) -> dict:
        """The in-flight sampler's snapshot: its JSON, then its host arrays laid out as that says."""
        stream_meta = self.manager.restore(step, args=ocp.args.Composite(
            stream_meta=ocp.args.JsonRestore()))["stream_meta"]
        like = jax.tree.map(lambda spec: np.zeros(spec[0], spec[1]), stream_meta["layout"],
                            is_leaf=lambda x: isinstance(x, list) and len(x) == 2 and isinstance(x[1], str))
        arrays = self.manager.restore(step, args=ocp.args.Composite(stream=ocp.args.StandardRestore(like)))["stream"]
        if fingerprint(arrays) != meta["fingerprints"]["stream"]:
            raise CheckpointError("item 'stream' does not match the fingerprint recorded at save time (corrupt)")
        return {"arrays": jax.tree.map(np.asarray, arrays), "meta": stream_meta}

    # ------------------------------------------------------------- internals

    def _check_base(self, meta: dict) -> None:
        """LoRA adapters continue only on the base they were trained on (and full params only without one)."""
        saved = meta.get("base")
        if saved is None and self.base is None:
            return
        if saved is None or self.base is None:
            raise IncompatibleCheckpoint(
                f"the checkpoint holds {'LoRA adapters' if saved else 'full params'} but this run "
                f"{'trains full params' if saved else 'trains LoRA adapters'}: set model.lora as the run that wrote it")
        if saved["fingerprint"] != self.base[1]:
            raise IncompatibleCheckpoint(
                f"the checkpoint's LoRA adapters were trained on the base {saved['name']!r}, whose weights differ "
                f"from this run's base {self.base[0]!r} (content fingerprints differ): resume on the same base")

    def _report_partial_saves(self) -> None:
        if jax.process_index() != self.primary or not self.directory.is_dir():
            return
        for path in sorted(self.directory.iterdir()):
            if ".orbax-checkpoint-tmp" in path.name:
                log.warning("ignoring partial checkpoint %s (its save never finished; removed)", path)

    def _quarantine(self, step: int) -> None:
        """Move an unusable step aside: kept for inspection, and the run may save that step number again."""
        if jax.process_index() == self.primary:
            src = self.directory / str(step)
            if src.exists():
                dest_dir = self.run_dir / "checkpoints_corrupt"
                dest_dir.mkdir(parents=True, exist_ok=True)
                dest = dest_dir / f"{step}.{int(time.time())}"
                src.rename(dest)
                log.warning("moved unusable checkpoint step %d to %s", step, dest)
        if jax.process_count() > 1:
            ocp.multihost.sync_global_processes(f"jgrpo_quarantine_{step}", processes=self.processes)
        self.manager.reload()


def _check_restored_shapes(restored: dict, abstract: dict) -> None:
    """Orbax restores what it finds; make sure every expected leaf came back with the expected shape."""
    for name, tree in abstract.items():
        if name not in restored:
            raise CheckpointError(f"item '{name}' is missing")
        got = jax.tree.leaves(restored[name])
        want = jax.tree.leaves(tree)
        if len(got) != len(want):
            raise CheckpointError(f"item '{name}' has {len(got)} arrays, expected {len(want)}")
        for g, w in zip(got, want, strict=True):
            if tuple(np.shape(g)) != tuple(w.shape):
                raise CheckpointError(f"item '{name}' has an array of shape {np.shape(g)}, expected {w.shape}")


class PreemptionFlag:
    """SIGTERM (a preemption notice) sets a flag; the loop saves at the next iteration boundary and exits.

    The handler does nothing else: saving from inside a signal handler could interrupt a half-done update.
    With several processes, `requested()` ORs the flag over all of them so every process stops together.
    """

    def __init__(self):
        self._event = threading.Event()
        self._previous = None

    def install(self) -> PreemptionFlag:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        return self

    def uninstall(self) -> None:
        if self._previous is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def _handle(self, signum, frame) -> None:  # noqa: ARG002 - signal handler signature
        self._event.set()

    def set(self) -> None:
        self._event.set()

    def requested(self) -> bool:
        local = self._event.is_set()
        if jax.process_count() == 1:
            return local
        from jax.experimental import multihost_utils

        flags = multihost_utils.process_allgather(np.asarray([local], dtype=np.int32))
        return bool(np.any(flags))
