"""The test rewards of tests/helpers.py score what their docstrings say (the trainer tests rely on their spread)."""

import pytest

from tests.helpers import length_parity, parity_on_even_answers, space_fraction, tiny_config


@pytest.mark.parametrize(("completion", "want"), [("", 0.0), ("ab", 0.0), (" a b", 0.5), ("    ", 1.0)])
def test_space_fraction(completion, want):
    assert space_fraction("q", completion, {}) == want


@pytest.mark.parametrize(("completion", "want"), [("", 0.0), ("a", 1.0), ("ab", 0.0)])
def test_length_parity(completion, want):
    assert length_parity("q", completion, {}) == want


@pytest.mark.parametrize(("answer", "completion", "want"), [("4", "a", 1.0), ("4", "ab", 0.0), ("3", "a", 0.0)])
def test_parity_on_even_answers(answer, completion, want):
    assert parity_on_even_answers("q", completion, {"answer": answer}) == want


def test_tiny_config_puts_the_run_dir_and_reward_before_the_overrides(tmp_path):
    config = tiny_config(tmp_path, "grpo.beta=0.5", "reward.functions=[tests.helpers:length_parity]")
    assert config.run.output_dir == str(tmp_path) and config.grpo.beta == 0.5
    assert config.reward.functions == ("tests.helpers:length_parity",)  # an override wins over the default reward
    assert tiny_config(reward=None).reward.functions == tiny_config(tmp_path, reward=None).reward.functions
