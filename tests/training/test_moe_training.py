"""GRPO on the tiny random Qwen3-MoE (configs/tiny_moe.yaml): the router learns, sampler and trainer agree in
float32, and LoRA adapts attention only (experts and router bit for bit unchanged)."""

import jax
import numpy as np
import pytest

from jgrpo.config import ConfigError
from jgrpo.models.hf import load_model
from jgrpo.training.trainer import Trainer
from tests.helpers import QUIET, tiny_config


def _config(run_dir, *overrides):
    # tiny.yaml's run on configs/tiny_moe.yaml's model; the space-fraction reward varies inside every group.
    return tiny_config(run_dir, "model.name=tiny-random-qwen3-moe", *QUIET, "optim.learning_rate=1e-2", *overrides)


def _host(tree):
    return jax.tree.map(np.asarray, jax.device_get(tree))


def test_full_training_moves_router_and_experts_and_sampler_matches_trainer(tmp_path):
    trainer = Trainer(_config(tmp_path))
    try:
        before = _host(trainer.state.params["layers"])
        records = [trainer.train_iteration()]
        after = _host(trainer.state.params["layers"])
    finally:
        trainer.close()
    assert any(r["loss/grad_norm"] > 0 for r in records)
    for name in ("router", "experts_gate", "experts_up", "experts_down", "q"):
        assert not np.array_equal(before[name], after[name]), name  # gradients reach the router through the gates
    for r in records:  # float32: the sampler's decode and the trainer's forward route every token alike
        assert r["mismatch/logprob_max"] < 1e-5, r["mismatch/logprob_max"]


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
