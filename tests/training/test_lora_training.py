"""GRPO with LoRA (`model.lora`): only the adapters train, the reference is the frozen base itself, behaviour and
checkpoints hold adapters only, resume is bit-exact and refuses another base."""

import shutil

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jgrpo.config.loading import load_config
from jgrpo.models.builtin import resolve_model_dir
from jgrpo.models.hf import load_model
from jgrpo.models.lora import is_adapter
from jgrpo.training.checkpoint import IncompatibleCheckpoint
from jgrpo.training.metrics_log import read_metrics
from jgrpo.training.trainer import Trainer
from tests.helpers import tiny_config

LORA = ["model.lora.rank=4", "model.lora.alpha=8", "logging.samples_every=0", "optim.learning_rate=1e-2"]


def _config(run_dir, *overrides):
    return tiny_config(run_dir, *LORA, *overrides)


def _host(tree):
    return jax.tree.map(np.asarray, jax.device_get(tree))


def _bytes(tree) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(tree))


def test_only_adapters_train_and_the_reference_is_the_base_without_a_copy(tmp_path):
    # v = 2 with two minibatches and the recentred ratio (lp_k computed with the adapters), beta > 0 with a
    # reference swap at the epoch boundary (8 prompts / batch 4): every policy of Algorithm 1 with LoRA.
    config = _config(tmp_path, "grpo.behaviour_refresh=2", "grpo.num_minibatches=2", "grpo.inner_steps=2",
                     "grpo.off_policy_ratio=recentred", "grpo.beta=0.1", "grpo.swap_reference=true",
                     "data.num_examples=8", "data.epochs=2", "run.iterations=3", "checkpoint.every=1")
    trainer = Trainer(config)
    try:
        _, loaded, _ = load_model("tiny-random-llama")
        base = trainer.frozen.train
        assert all(is_adapter(name) for name in trainer.state.params["layers"])
        assert sorted(base["layers"]) == sorted(loaded["layers"])  # the loaded model, adapters taken out
        # The optimiser holds state for the adapters only (AdamW: two moments per adapter, no base weight).
        assert _bytes(trainer.state.opt_state) < 2 * _bytes(trainer.state.params) + 1024
        # The reference (beta > 0, swapped later) is the base's own arrays with a frozen copy of the adapters: no
        # copy of the weights exists for it (without swaps it is the base alone: the planner test below).
        reference, initial = trainer.reference, _host(trainer.state.params)
        assert all(reference["layers"][name] is base["layers"][name] for name in base["layers"])
        for name, value in initial["layers"].items():
            np.testing.assert_array_equal(np.asarray(reference["layers"][name]), value)
        assert trainer.run() == "done"
        # Both halves of every adapter moved (B from the first step, A once B is non-zero); the base did not.
        after = _host(trainer.state.params)
        for name in initial["layers"]:
            assert not np.array_equal(initial["layers"][name], after["layers"][name]), name
        for name, value in _host(base["layers"]).items():
            np.testing.assert_array_equal(value, np.asarray(loaded["layers"][name]), err_msg=name)
        records = read_metrics(tmp_path)
        assert [r["behaviour_version"] for r in records] == [0, 0, 2]
        for record in records:
            assert np.isfinite(record["loss/loss"]) and np.isfinite(record["kl/mean"])
        # Sampler (base + behaviour adapters, sampling layout) and trainer agree at the behaviour params, with the
        # adapters trained away from their init by iteration 3.
        assert records[2]["mismatch/logprob_max"] < 1e-4
        # The swapped reference: the adapters of the end of epoch 0, still on the same base arrays.
        assert all(is_adapter(name) for name in trainer.state.reference["layers"])
        assert trainer.reference["layers"]["q"] is base["layers"]["q"]
        swapped = np.asarray(trainer.state.reference["layers"]["q_lora_b"])
        assert not np.array_equal(swapped, initial["layers"]["q_lora_b"])
        # The checkpoint holds adapters, their optimiser state and the behaviour / reference adapters: not the base.
        saved = tmp_path / "checkpoints" / "3"
        size = sum(f.stat().st_size for f in saved.rglob("*") if f.is_file())
        assert size < _bytes(base) / 2, (size, _bytes(base))
    finally:
        trainer.close()


def test_compiled_programs_hold_the_base_once_and_train_the_adapters_only():
    # XLA's own accounting, for a v5e slice (libtpu's compiler, no TPU): the reference forward's arguments are the
    # base weights and the batch (no merged or copied weights), the update donates only adapters and their
    # optimiser state, and no reference copy is resident. Full fine-tuning of the same model for comparison.
    pytest.importorskip("libtpu", reason="the TPU compiler comes with jax[tpu] (bash .ci/install installs it)")
    from jgrpo.plan import plan_iteration, topology_devices

    devices, _ = topology_devices("v5e:2x4")
    overrides = ["checkpoint.every=0", "grpo.beta=0.1", "grpo.behaviour_refresh=2"]
    lora = plan_iteration(load_config("configs/tiny.yaml", overrides + ["model.lora.rank=4"]), devices)
    full = plan_iteration(load_config("configs/tiny.yaml", overrides), devices)
    res, programs = lora["resident_bytes"], {p["name"]: p for p in lora["programs"]}
    assert lora["parameters"] > 10 * lora["trainable_parameters"] and full["trainable_parameters"] == full["parameters"]
    assert res["reference"] == 0 and full["resident_bytes"]["reference"] == full["resident_bytes"]["params"]
    assert res["behaviour"] < res["base"] / 10  # the behaviour copy: adapters only (in the sampling layout)
    ref = programs["ref_logprobs"]
    assert res["base"] + res["step_batch"] <= ref["argument_bytes"] <= 1.1 * (res["base"] + res["step_batch"])
    update = programs["update"]
    assert res["params"] + res["opt_state"] - 64 <= update["alias_bytes"] < res["base"]  # the base is not donated
    assert lora["peak_bytes"] < full["peak_bytes"]


def _different_base(tmp_path):
    """A copy of the tiny model with one weight changed: the same shapes, another base."""
    copy = tmp_path / "other_base"
    shutil.copytree(resolve_model_dir("tiny-random-llama"), copy)
    weights = load_file(copy / "model.safetensors")
    name = next(n for n in sorted(weights) if n.endswith("q_proj.weight"))
    weights[name] = weights[name] + np.float32(0.01).astype(weights[name].dtype)
    save_file(weights, copy / "model.safetensors", metadata={"format": "pt"})
    return copy


def _train(run_dir, iterations, *overrides):
    config = _config(run_dir, "grpo.behaviour_refresh=2", "grpo.inner_steps=2", "grpo.beta=0.05",
                     f"run.iterations={iterations}", "checkpoint.every=1", *overrides)
    trainer = Trainer(config)
    try:
        assert trainer.run() == "done"
        return _host((trainer.state.params, trainer.state.opt_state, trainer.state.behaviour))
    finally:
        trainer.close()


def test_resume_is_bit_exact_and_refuses_another_base(tmp_path):
    straight = _train(tmp_path / "straight", 3)
    _train(tmp_path / "resumed", 1)  # stops mid-window: the behaviour adapters (v = 2) come from the checkpoint
    resumed = _train(tmp_path / "resumed", 3)
    for a, b in zip(jax.tree.leaves(straight), jax.tree.leaves(resumed), strict=True):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(IncompatibleCheckpoint, match=r"trained on the base 'tiny-random-llama'.*other_base"):
        _train(tmp_path / "resumed", 4, f"model.name={_different_base(tmp_path)}")
    with pytest.raises(IncompatibleCheckpoint, match="holds LoRA adapters but this run trains full params"):
        _train(tmp_path / "resumed", 4, "model.lora.rank=0")


def test_a_bfloat16_base_trains_float32_adapters_and_is_never_widened(tmp_path):
    # model.param_dtype=bfloat16 with LoRA: the frozen base is bfloat16 (half the memory), the adapters and their
    # AdamW moments stay float32, and the sampler (weights_dtype float32) reads the base in bfloat16 too.
    trainer = Trainer(_config(tmp_path, "model.param_dtype=bfloat16", "run.iterations=1", "checkpoint.every=0"))
    try:
        assert {x.dtype.name for x in jax.tree.leaves(trainer.frozen.train)} == {"bfloat16"}
        # (On this 8-device mesh the sampling layout differs, so the sampler holds its own copy: bfloat16 too.)
        assert {x.dtype.name for x in jax.tree.leaves(trainer.frozen.sample)} == {"bfloat16"}
        assert trainer.frozen.sample_copy_bytes == _bytes(trainer.frozen.train)
        floats = [x for x in jax.tree.leaves((trainer.state.params, trainer.state.opt_state)) if x.ndim > 1]
        assert floats and {x.dtype.name for x in floats} == {"float32"}
        initial = _host(trainer.state.params)
        record = trainer.train_iteration()
        assert np.isfinite(record["loss/loss"]) and record["mismatch/logprob_max"] < 1e-4
        assert not np.array_equal(initial["layers"]["q_lora_b"], np.asarray(trainer.state.params["layers"]["q_lora_b"]))
    finally:
        trainer.close()
