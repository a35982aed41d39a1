"""Checkpoint round trip of every piece of training state, fallback past corrupt checkpoints, SIGTERM flag."""

import logging
import os
import signal

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from jgrpo.config import CheckpointConfig, MeshConfig
from jgrpo.parallel.fingerprint import fingerprint
from jgrpo.parallel.mesh import SAMPLE_RULES, TRAIN_RULES, make_mesh, place
from jgrpo.training.checkpoint import Checkpointer, CheckpointError, PreemptionFlag, RunCounters, TrainState

AXES = {"embed": P("embed", "mlp"), "norm": P(None)}


def _params(mesh, seed, rules=TRAIN_RULES):
    k1, k2 = jax.random.split(jax.random.key(seed))
    tree = {"embed": jax.random.normal(k1, (128, 64)), "norm": jax.random.normal(k2, (64,))}
    return place(tree, AXES, mesh, rules)


def _state(mesh, iteration, *, behaviour=True, reference=True):
    params = _params(mesh, iteration)
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2))
    opt_state = opt.init(params)
    grads = jax.tree.map(jnp.ones_like, params)
    _, opt_state = opt.update(grads, opt_state, params)  # non-trivial mu, nu, count
    return TrainState(
        params=params,
        opt_state=opt_state,
        behaviour=_params(mesh, 100 + iteration, SAMPLE_RULES) if behaviour else None,
        reference=_params(mesh, 200 + iteration) if reference else None,
        rng=jax.random.fold_in(jax.random.key(7), iteration),
        iteration=iteration,
        epoch=iteration // 3,
        behaviour_version=iteration - 1,
        data_state={"next_index": iteration * 4, "epoch": 0},
        counters=RunCounters(nonfinite_total=1),
    )


def _assert_trees_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.fixture(scope="module")
def mesh():
    return make_mesh(MeshConfig(data=1, fsdp=4, tensor=2))


def test_saving_small_replicated_arrays_compiles_nothing(tmp_path, mesh, compile_counter):
    # Orbax's replica-parallel save slices a replicated array per replica, one compiled slice program per shape:
    # 136 of them (3.8 s) in a tiny MoE run's first save. Arrays below REPLICA_SLICE_MIN_BYTES are written whole.
    state = _state(mesh, 1)
    assert any(len(leaf.sharding.device_set) > 1 and leaf.sharding.is_fully_replicated
               for leaf in jax.tree.leaves(state.params))  # the norm: replicated over the 8 devices
    for tree in (state.params, state.opt_state, {"key_data": jax.random.key_data(state.rng)}, state.behaviour,
                 state.reference):
        fingerprint(tree)  # the save's own checksum programs, compiled before counting
    ckpt = Checkpointer(tmp_path, CheckpointConfig(keep=1))
    compile_counter.count, compile_counter.active = 0, True
    try:
        ckpt.save(state)
        ckpt.wait()
    finally:
        compile_counter.active = False
        ckpt.close()
    assert compile_counter.count == 0, f"the save compiled {compile_counter.count} programs"


def test_round_trip_of_every_piece(tmp_path, mesh):
    ckpt = Checkpointer(tmp_path, CheckpointConfig(keep=2), resolved_config={"run": {"seed": 3}})
    saved = _state(mesh, 4)
    ckpt.save(saved)
    ckpt.wait()
    # The target only supplies structure and layout: restore into a state holding other values.
    restored = ckpt.restore(_state(mesh, 1))
    ckpt.close()
    for name in ("params", "opt_state", "behaviour", "reference"):
        _assert_trees_equal(getattr(restored, name), getattr(saved, name))
    np.testing.assert_array_equal(jax.random.key_data(restored.rng), jax.random.key_data(saved.rng))
    assert jax.random.key_impl(restored.rng) == jax.random.key_impl(saved.rng)
    assert (restored.iteration, restored.epoch, restored.behaviour_version) == (4, 1, 3)
    assert restored.data_state == saved.data_state
    assert restored.counters == RunCounters(nonfinite_total=1)
    # Arrays come back in the target's shardings: training layout for params, sampling layout for behaviour.
    assert restored.params["embed"].sharding.spec == saved.params["embed"].sharding.spec == P("fsdp", "tensor")
    assert restored.behaviour["embed"].sharding.spec == P(None, "tensor")
    # The opt state keeps optax's NamedTuple structure, so it can be fed straight back to the optimiser.
    assert int(restored.opt_state[1][0].count) == 1
    assert (tmp_path / "checkpoints" / "4" / "config").is_dir()


def test_optional_items_absent(tmp_path, mesh):
    ckpt = Checkpointer(tmp_path, CheckpointConfig(async_save=False))
    ckpt.save(_state(mesh, 2, behaviour=False, reference=False))
    restored = ckpt.restore(_state(mesh, 1))
    ckpt.close()
    assert restored.behaviour is None and restored.reference is None
    assert not (tmp_path / "checkpoints" / "2" / "behaviour").exists()


def test_keeps_last_k_and_empty_dir_restores_none(tmp_path, mesh):
    ckpt = Checkpointer(tmp_path, CheckpointConfig(keep=2))
    assert ckpt.restore(_state(mesh, 1)) is None
    for it in (1, 2, 3):
        ckpt.save(_state(mesh, it))
    ckpt.wait()
    assert ckpt.manager.all_steps() == [2, 3]
    assert ckpt.should_save(10, last=False) is False and ckpt.should_save(3, last=True) is True
    ckpt.close()


def _largest_file(directory):
    files = [os.path.join(r, f) for r, _, fs in os.walk(directory) for f in fs]
    return max(files, key=os.path.getsize)


@pytest.mark.parametrize("damage", ["truncate_params", "flip_bit_params", "delete_opt_state_manifest", "delete_meta"])
def test_corrupt_latest_falls_back_to_previous(tmp_path, mesh, caplog, damage):
    ckpt = Checkpointer(tmp_path, CheckpointConfig(keep=3))
    ckpt.save(_state(mesh, 1))
    ckpt.save(_state(mesh, 2))
    ckpt.close()
    latest = tmp_path / "checkpoints" / "2"
    if damage == "truncate_params":
        victim = _largest_file(latest / "params" / "ocdbt.process_0" / "d")
        with open(victim, "r+b") as f:
            f.truncate(os.path.getsize(victim) // 2)
    elif damage == "flip_bit_params":  # silent on disk: only the recorded fingerprints catch it
        victim = _largest_file(latest / "params" / "ocdbt.process_0" / "d")
        data = bytearray(open(victim, "rb").read())
        data[len(data) // 2] ^= 0x10
        open(victim, "wb").write(data)
    elif damage == "delete_opt_state_manifest":
        os.remove(latest / "opt_state" / "manifest.ocdbt")
    else:
        for name in os.listdir(latest / "meta"):
            os.remove(latest / "meta" / name)

    fresh = Checkpointer(tmp_path, CheckpointConfig(keep=3))
    with caplog.at_level(logging.WARNING, logger="jgrpo.training.checkpoint"):
        restored = fresh.restore(_state(mesh, 9))
    assert restored.iteration == 1
    _assert_trees_equal(restored.params, _state(mesh, 1).params)
    assert any("step 2" in r.getMessage() and "unusable" in r.getMessage() for r in caplog.records)
    # The bad step is moved aside, so the resumed run can save step 2 again.
    assert fresh.manager.all_steps() == [1]
    assert len(list((tmp_path / "checkpoints_corrupt").iterdir())) == 1
    fresh.save(_state(mesh, 2))
    fresh.close()


def test_no_usable_checkpoint_is_a_clear_error(tmp_path, mesh):
    ckpt = Checkpointer(tmp_path, CheckpointConfig())
    ckpt.save(_state(mesh, 1))
    ckpt.close()
    os.remove(tmp_path / "checkpoints" / "1" / "params" / "manifest.ocdbt")
    with pytest.raises(CheckpointError, match="no usable checkpoint"):
        Checkpointer(tmp_path, CheckpointConfig()).restore(_state(mesh, 1))


def test_fingerprint_ignores_sharding_and_sees_one_bit(mesh):
    from jgrpo.parallel.fingerprint import fingerprint

    x = jax.random.normal(jax.random.key(0), (16, 8))
    sharded = place({"a": x}, {"a": P("embed", "mlp")}, mesh, TRAIN_RULES)
    assert fingerprint({"a": x}) == fingerprint(sharded)
    flipped = jax.lax.bitcast_convert_type(
        jax.lax.bitcast_convert_type(x, jnp.uint32).at[3, 5].add(1), jnp.float32
    )
    assert fingerprint({"a": flipped}) != fingerprint({"a": x})
    # Hand-derived: bits 1, 2 at flat indices 0, 1 -> 1*1 + 2*3 = 7.
    assert fingerprint([jnp.array([1, 2], jnp.uint32)]) == [7]


def test_sigterm_sets_the_preemption_flag():
    flag = PreemptionFlag().install()
    try:
        assert not flag.requested()
        os.kill(os.getpid(), signal.SIGTERM)
        assert flag.requested()
    finally:
        flag.uninstall()
    assert signal.getsignal(signal.SIGTERM) is not flag._handle


def test_run_counters_restore_old_checkpoints_and_refuse_unknown_ones():
    from jgrpo.training.checkpoint import IncompatibleCheckpoint

    # Written before empty_steps existed (an older jgrpo): the missing counter starts at 0.
    old = {"prompt_width": 64, "optimizer_steps": 7, "nonfinite_in_a_row": 0, "nonfinite_total": 1}
    assert RunCounters.from_json(old) == RunCounters(prompt_width=64, optimizer_steps=7, nonfinite_total=1)
    assert RunCounters.from_json(RunCounters(empty_steps=3).to_json()) == RunCounters(empty_steps=3)
    with pytest.raises(IncompatibleCheckpoint, match="does not know: \\['tokens_seen'\\]"):
        RunCounters.from_json({**old, "tokens_seen": 5})


def test_compressed_and_plain_checkpoints_restore_either_way(tmp_path, mesh):
    # checkpoint.compress changed its default (benchmarks/checkpoint.py): runs saved with Orbax's zstd resume.
    saved = _state(mesh, 2)
    for compress in (True, False):
        run_dir = tmp_path / f"compress_{compress}"
        ckpt = Checkpointer(run_dir, CheckpointConfig(compress=compress))
        ckpt.save(saved)
        ckpt.close()
        restored = Checkpointer(run_dir, CheckpointConfig(compress=not compress)).restore(_state(mesh, 1))
        _assert_trees_equal(restored.params, saved.params)
        _assert_trees_equal(restored.opt_state, saved.opt_state)
    sizes = {c: sum(f.stat().st_size for f in (tmp_path / f"compress_{c}").rglob("*") if f.is_file())
             for c in (True, False)}
    assert sizes[True] < sizes[False]  # the switch reaches Orbax (the test state's moments compress well)
