"""Verifiable rewards: `fn(prompt, completion, reference) -> float`, a registry, and a timeout-safe scorer."""

from jgrpo.rewards.registry import available_rewards, get_reward, register_reward
from jgrpo.rewards.scorer import RewardResult, RewardScorer

__all__ = ["RewardResult", "RewardScorer", "available_rewards", "get_reward", "register_reward"]
