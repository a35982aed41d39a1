"""`rollout.mode: window`: the v iterations one behaviour policy serves, sampled together in one slot pool, give the
tokens and the training `sync` gives (paper Algorithm 1), and a run resumed inside a window ends bit-equal."""

import jax
import numpy as np
import pytest

from jgrpo.config import ConfigError
from jgrpo.config.loading import load_config
from jgrpo.rollout.sources import RolloutSource
from jgrpo.training.trainer import Trainer
from tests.helpers import tiny_config

# v = 4 on the 8-device mesh (tiny.yaml: fsdp over all 8); 6 batches per epoch, so the window of iterations
# 4..7 reads into epoch 1, whose reference swap must wait until iteration 6 is trained.
WINDOW = ["grpo.behaviour_refresh=4", "grpo.off_policy_ratio=recentred", "grpo.beta=0.04",
          "grpo.swap_reference=true", "data.num_examples=24", "data.epochs=3", "optim.learning_rate=1e-2"]


def _run(run_dir, iterations, mode, monkeypatch, *overrides):
    """Train; returns (params leaves, data state, {iteration: tokens sampled}, windows sampled)."""
    config = tiny_config(run_dir, f"run.iterations={iterations}", "checkpoint.every=1", "logging.samples_every=0",
                         f"rollout.mode={mode}", *WINDOW, *overrides)
    tokens, windows = {}, []
    first_batch, sample_window = RolloutSource.first, RolloutSource._sample_window

    def spy_first(self, params, iteration, counters, version=0):
        rollout = first_batch(self, params, iteration, counters, version)
        tokens[iteration] = np.asarray(rollout.samples.tokens)
        return rollout

    def spy_window(self, params, batches, first, version):
        windows.append((first, len(batches)))
        return sample_window(self, params, batches, first, version)

    monkeypatch.setattr(RolloutSource, "first", spy_first)
    monkeypatch.setattr(RolloutSource, "_sample_window", spy_window)
    trainer = Trainer(config)
    try:
        assert trainer.run() == "done"
        params = [np.asarray(x) for x in jax.tree.leaves(jax.device_get(trainer.state.params))]
        return params, trainer.state.data_state, tokens, windows, trainer.state.epoch
    finally:
        trainer.close()


def test_window_samples_and_trains_like_sync(tmp_path, monkeypatch):
    sync, sync_data, sync_tokens, _, sync_epoch = _run(tmp_path / "sync", 8, "sync", monkeypatch)
    window, window_data, window_tokens, windows, window_epoch = _run(tmp_path / "window", 8, "window", monkeypatch)
    assert windows == [(0, 4), (4, 4)]  # two pools of 4 iterations' prompts, at the refreshes
    assert sorted(window_tokens) == list(range(8))
    for k in range(8):
        np.testing.assert_array_equal(sync_tokens[k], window_tokens[k], err_msg=f"iteration {k + 1}")
    assert sync_epoch == window_epoch == 1 and sync_data == window_data
    moved = max(float(np.abs(a - b).max()) for a, b in zip(sync, _run(tmp_path / "ref", 1, "sync", monkeypatch)[0],
                                                               strict=True))
    assert moved > 1e-4  # training really moved the params, so agreeing below is not trivial
    for a, b in zip(sync, window, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)


def test_window_resumed_inside_a_window_is_bit_exact(tmp_path, monkeypatch):
    straight, straight_data, straight_tokens, _, _ = _run(tmp_path / "straight", 8, "window", monkeypatch)
    _run(tmp_path / "resumed", 6, "window", monkeypatch)  # stops after iteration 6, inside the window 4..7
    resumed, resumed_data, resumed_tokens, windows, _ = _run(tmp_path / "resumed", 8, "window", monkeypatch)
    assert windows == [(4, 4)]  # the whole window sampled again, iterations 5 and 6 skipped
    for k in (6, 7):
        np.testing.assert_array_equal(straight_tokens[k], resumed_tokens[k])
    assert resumed_data == straight_data
    assert all(np.array_equal(a, b) for a, b in zip(straight, resumed, strict=True))


def test_window_needs_a_fixed_v_and_no_dynamic_sampling():
    with pytest.raises(ConfigError, match="rollout.mode.*fixed grpo.behaviour_refresh"):
        load_config("configs/tiny.yaml", ["rollout.mode=window", "grpo.behaviour_refresh=adaptive",
                                          "grpo.refresh_tv=0.1"])
    with pytest.raises(ConfigError, match="rollout.mode.*dynamic_sampling_rounds=0"):
        load_config("configs/tiny.yaml", ["rollout.mode=window", "grpo.behaviour_refresh=2",
                                          "grpo.dynamic_sampling_rounds=1"])
