"""GRPO on the tiny random Qwen3-MoE (configs/tiny_moe.yaml): the router learns under routing replay, sampler and
trainer agree in float32 with the experts split over 2 devices (mesh.expert), iteration 2 compiles nothing, a
replayed run resumes bit for bit, and LoRA adapts attention only (experts and router bit for bit unchanged)."""

import jax
import numpy as np
import pytest

from jgrpo.config import ConfigError
from jgrpo.models.hf import load_model
from jgrpo.training.trainer import Trainer
from tests.helpers import QUIET, assert_resume_is_bit_exact, tiny_config


def _config(run_dir, *overrides):
    # tiny.yaml's run on configs/tiny_moe.yaml's model; the space-fraction reward varies inside every group.
    return tiny_config(run_dir, "model.name=tiny-random-qwen3-moe", *QUIET, "optim.learning_rate=1e-2", *overrides)


def _host(tree):
    return jax.tree.map(np.asarray, jax.device_get(tree))


REPLAYED = ("model.routing_replay=rollout", "grpo.behaviour_refresh=2", "grpo.num_minibatches=2", "mesh.expert=2",
            "model.router_aux_loss_coef=0.01", "model.router_z_loss_coef=0.001", "run.iterations=2",
            "checkpoint.every=1", "checkpoint.keep=2")


def _state(trainer):
    return _host((trainer.state.params, trainer.state.opt_state, trainer.state.behaviour))


def test_replayed_training_moves_the_router_matches_the_sampler_never_recompiles_and_resumes_bit_for_bit(
        tmp_path, compile_counter):
    # v = 2: iteration 2 samples with the behaviour copy made at iteration 1 and replays its routing. The 8 experts
    # are split over 2 devices (mesh.expert, data-parallel over them elsewhere): the sampler's decode and prefill,
    # the trainer's forwards and the update all run split. Iteration 2 compiles nothing (routing changes from
    # iteration to iteration, shapes do not; tests/training/test_recompile.py's rule, for a mixture of experts).
    trainer = Trainer(_config(tmp_path / "straight", *REPLAYED))
    try:
        assert dict(trainer.mesh.shape)["expert"] == 2
        assert trainer.state.params["layers"]["experts_up"].sharding.spec[1] == "expert"
        first = trainer.train_iteration()  # compiles
        trainer.checkpointer.wait()
        compile_counter.count, compile_counter.active = 0, True
        second = trainer.train_iteration()
        trainer.checkpointer.wait()
        compile_counter.active = False
        assert compile_counter.count == 0, f"iteration 2 compiled {compile_counter.count} programs"
        assert second["behaviour_version"] == 0 and trainer.checkpointer.latest_step() == 2
        straight = _state(trainer)
    finally:
        compile_counter.active = False
        trainer.close()
    _, initial, _ = load_model("tiny-random-qwen3-moe")
    for name in ("router", "experts_gate", "experts_up", "experts_down", "q"):  # the router learns through the gates
        assert not np.array_equal(np.asarray(initial["layers"][name]), straight[0]["layers"][name]), name
    assert first["loss/grad_norm"] > 0
    # Float32: replayed, the trainer's (split) forward gives the sampler's log-probs; its router agrees everywhere.
    assert first["moe/lp_mismatch"] <= 1e-5 and first["mismatch/logprob_max"] < 1e-5
    assert first["moe/routing_mismatch"] == 0 and first["moe/routing_count"] > 0 and first["moe/expert_load_max"] >= 1
    assert 1.5 < first["moe/aux_loss"] < 4 and first["moe/z_loss"] > 0  # k = 2 at an even load
    # Resumed from iteration 1's checkpoint (the run directory as it was then), iteration 2 again: the same bits.
    assert_resume_is_bit_exact(tmp_path / "straight", 2, lambda d: _config(d, *REPLAYED), _state, straight)


def test_routing_replay_or_router_losses_on_a_dense_model_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="model.routing_replay=rollout .* tiny-random-llama is a dense model"):
        Trainer(tiny_config(tmp_path, "model.routing_replay=rollout", *QUIET))
    with pytest.raises(ConfigError, match="model.router_z_loss_coef=0.001 .* tiny-random-llama is a dense model"):
        Trainer(tiny_config(tmp_path, "model.router_z_loss_coef=1e-3", *QUIET))


def test_lora_adapts_attention_and_leaves_experts_and_router_untouched(tmp_path):
    trainer = Trainer(_config(tmp_path, "model.lora.rank=4", "model.lora.alpha=8"))  # default targets: all 7
    try:
        adapters = sorted(trainer.state.params["layers"])
        assert adapters == sorted(f"{t}_lora_{ab}" for t in "qkvo" for ab in "ab")  # the MLP targets dropped
        initial = _host(trainer.state.params)
        trainer.train_iteration()
        trained, base = _host(trainer.state.params), _host(trainer.frozen.train)
    finally:
        trainer.close()
    assert any(not np.array_equal(initial["layers"][n], trained["layers"][n]) for n in adapters)
    _, loaded, _ = load_model("tiny-random-qwen3-moe")
    for name in ("router", "experts_gate", "experts_up", "experts_down"):
        np.testing.assert_array_equal(base["layers"][name], np.asarray(loaded["layers"][name]))


def test_lora_with_mlp_targets_only_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match=r"model.lora.targets=\['gate', 'up'\]: LoRA on a mixture-of-experts"):
        Trainer(_config(tmp_path, "model.lora.rank=4", "model.lora.targets=[gate,up]"))
