"""When the behaviour policy refreshes: fixed v, and adaptive v from Theorem 1 (`jgrpo.rl.behaviour_refresh`)."""

import jax
import numpy as np
import pytest

from jgrpo.config import ConfigError, GRPOConfig
from jgrpo.config.loading import load_config
from jgrpo.rl.behaviour_refresh import RefreshPolicy
from jgrpo.training.metrics_log import read_metrics
from jgrpo.training.trainer import Trainer


def _update(tv=0.1, tv_k=0.05, M=1.0, surrogate=0.5, rows=8.0, exact=1.0):
    return {"tv_theta_alpha": tv, "tv_k_alpha": tv_k, "tv_weight_M": M, "surrogate_alpha": surrogate,
            "bound_row_count": rows, "lp_k_exact": exact}


def test_fixed_v_refreshes_every_v_iterations():
    policy = RefreshPolicy(GRPOConfig(behaviour_refresh=3))
    due = [policy.due(k, behaviour_version=3 * (k // 3), has_copy=k > 0, requested=0) is not None for k in range(7)]
    assert due == [True, False, False, True, False, False, True]
    assert policy.request([_update(tv=10.0)]) == (0, "")  # measurements never change a fixed v


def test_adaptive_rules_from_hand_numbers():
    # TV rule: the LAST update with rows in the loss decides (0.3 > 0.2), not the first (0.1).
    policy = RefreshPolicy(GRPOConfig(behaviour_refresh="adaptive", refresh_tv=0.2))
    code, why = policy.request([_update(tv=0.1), _update(tv=0.3), _update(tv=5.0, rows=0.0)])
    assert code == 1 and "0.3000 > grpo.refresh_tv = 0.2" in why
    assert policy.request([_update(tv=0.3), _update(tv=0.15)])[0] == 0
    assert policy.request([_update(rows=0.0)])[0] == 0  # nothing measured: stay
    # Penalty rule: 2 M TV + 2 TV_k = 2 * 1.5 * 0.1 + 2 * mean(0.05, 0.07) = 0.3 + 0.12 = 0.42 against
    # fraction * |L_alpha| = 0.8 * |-0.5| = 0.4 -> refresh; with fraction 0.9 (0.45) -> stay. TV_k averages only
    # the updates whose lp_k is exact (the 0.9 of an inexact one is ignored).
    updates = [_update(tv=0.2, tv_k=0.05, M=1.5), _update(tv=0.3, tv_k=0.9, exact=0.0),
               _update(tv=0.1, tv_k=0.07, M=1.5, surrogate=-0.5)]
    policy = RefreshPolicy(GRPOConfig(behaviour_refresh="adaptive", refresh_penalty_fraction=0.8))
    code, why = policy.request(updates)
    assert code == 2 and "penalty 0.4200" in why
    policy = RefreshPolicy(GRPOConfig(behaviour_refresh="adaptive", refresh_penalty_fraction=0.9))
    assert policy.request(updates)[0] == 0
    # due: a request, else the cap counted from the last refresh.
    policy = RefreshPolicy(GRPOConfig(behaviour_refresh="adaptive", refresh_tv=0.2, refresh_max_iterations=4))
    assert "refresh_tv" in policy.due(5, behaviour_version=4, has_copy=True, requested=1)
    assert policy.due(7, behaviour_version=4, has_copy=True, requested=0) is None
    assert "refresh_max_iterations=4" in policy.due(8, behaviour_version=4, has_copy=True, requested=0)


def test_adaptive_config_errors():
    with pytest.raises(ConfigError, match="needs grpo.refresh_tv or grpo.refresh_penalty_fraction"):
        GRPOConfig(behaviour_refresh="adaptive")
    with pytest.raises(ConfigError, match="grpo.behaviour_refresh"):
        GRPOConfig(behaviour_refresh=0)
    with pytest.raises(ConfigError, match="grpo.refresh_tv"):
        GRPOConfig(behaviour_refresh="adaptive", refresh_tv=-1.0)
    config = load_config("configs/tiny.yaml", ["grpo.behaviour_refresh=adaptive", "grpo.refresh_tv=0.1"])
    assert config.grpo.behaviour_refresh == "adaptive" and config.grpo.keeps_behaviour_copy
    assert load_config("configs/tiny.yaml", ["grpo.behaviour_refresh=4"]).grpo.behaviour_refresh == 4


def _run(run_dir, iterations, *overrides):
    config = load_config("configs/tiny.yaml", [
        f"run.output_dir={run_dir}", f"run.iterations={iterations}", "checkpoint.every=1", "logging.samples_every=0",
        "reward.functions=[tests.helpers:length_parity]", "grpo.behaviour_refresh=adaptive",
        "grpo.inner_steps=2", "grpo.beta=0.0", "optim.learning_rate=1e-2", *overrides])
    trainer = Trainer(config)
    try:
        assert trainer.run() == "done"
        return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(trainer.state.params))]
    finally:
        trainer.close()


def _refreshed(run_dir):
    return [int(r["behaviour/refreshed"]) for r in read_metrics(run_dir) if "behaviour/refreshed" in r]


def test_adaptive_refreshes_resume_exactly(tmp_path):
    # refresh_tv tiny: every iteration's last update (the second, after the params moved) requests a refresh, so
    # every iteration samples from a fresh copy. The request is kept in the checkpoint: a run resumed at
    # iteration 2 refreshes at iteration 3 like the straight run (the cap, 16, would not) and ends bit-equal.
    tv = ["grpo.refresh_tv=1e-9"]
    straight = _run(tmp_path / "straight", 4, *tv)
    assert _refreshed(tmp_path / "straight") == [1, 1, 1, 1]
    _run(tmp_path / "resumed", 2, *tv)
    resumed = _run(tmp_path / "resumed", 4, *tv)
    assert _refreshed(tmp_path / "resumed") == [1, 1, 1, 1]
    assert all(np.array_equal(a, b) for a, b in zip(straight, resumed, strict=True))
    # Never far enough by TV: the cap alone refreshes, every 3 iterations (0 and 3), and staleness grows between.
    _run(tmp_path / "capped", 4, "grpo.refresh_tv=1e9", "grpo.refresh_max_iterations=3")
    assert _refreshed(tmp_path / "capped") == [1, 0, 0, 1]
    assert [r["theorem1/staleness"] for r in read_metrics(tmp_path / "capped")] == [0, 1, 2, 0]
