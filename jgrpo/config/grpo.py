"""The `grpo` section of the run configuration (jgrpo/config/sections.py): the objective and the loop shape of
docs/algorithm.md, every variant a switch."""

from __future__ import annotations

import dataclasses
from typing import Literal

from jgrpo.config.errors import check as _check


@dataclasses.dataclass(frozen=True, kw_only=True)
class GRPOConfig:
    """The objective and the loop shape of docs/algorithm.md; names follow it."""

    num_generations: int = 8  # G completions per prompt
    # v: behaviour <- current every v iterations (1 = on-policy), or "adaptive": when the measured distance to
    # the behaviour policy says so (refresh_tv, refresh_penalty_fraction; from Theorem 1 of arXiv 2505.22257), at
    # the latest every refresh_max_iterations (docs/algorithm.md §14).
    behaviour_refresh: int | Literal["adaptive"] = 1
    # Adaptive v: refresh before the next sampling when the last update's TV(pi_theta, alpha) exceeds refresh_tv,
    # or when Theorem 1's penalty 2 M TV(pi_theta, alpha) + 2 TV(pi_k, alpha) exceeds refresh_penalty_fraction
    # of |L_alpha| (the surrogate it is subtracted from). None = that rule is off.
    refresh_tv: float | None = None
    refresh_penalty_fraction: float | None = None
    refresh_max_iterations: int = 16
    inner_steps: int = 1  # i: optimiser steps per batch of samples
    num_minibatches: int = 1  # each inner step may be split into minibatches (one update each)
    micro_batches: int = 1  # gradient accumulation inside one update
    # Advantages (docs/algorithm.md §2).
    advantage_scale: Literal["group", "batch", "none"] = "group"
    advantage_std: Literal["population", "bessel"] = "population"
    advantage_eps_placement: Literal["inside_sqrt", "add_to_std"] = "inside_sqrt"
    advantage_eps: float = 1e-4
    mask_zero_variance: bool = True
    # With several reward functions: normalise their weighted sum within the group (`sum`, GRPO), or each
    # function's reward within the group before the weighted sum, then the sum by its batch std (`per_reward`:
    # GDPO, arXiv 2601.05242; distinct reward combinations keep distinct advantages).
    advantage_reward_normalisation: Literal["sum", "per_reward"] = "sum"
    # DAPO's overlong filtering (arXiv 2503.14476 §3.4): completions cut at sampler.max_new_tokens (no stop
    # token) leave the loss; they still count in their group's advantages.
    overlong_filter: bool = False
    # DAPO's dynamic sampling (arXiv 2503.14476 §3.2; docs/algorithm.md §15): groups with zero reward variance
    # are replaced by groups with signal from at most dynamic_sampling_rounds extra rounds of
    # dynamic_sampling_oversample x B prompts drawn from the data; a batch still short keeps masked zero-variance
    # groups (counted). 0 = off.
    dynamic_sampling_rounds: int = 0
    dynamic_sampling_oversample: int = 1
    # Surrogate (docs/algorithm.md §3).
    off_policy_ratio: Literal["behaviour", "recentred", "current"] = "behaviour"
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    dual_clip: float | None = None  # c > 1 caps the loss of negative advantages; None = off
    truncated_is: Literal["none", "token", "sequence"] = "none"
    truncated_is_cap: float = 2.0
    sequence_ratio: bool = False  # GSPO: one length-normalised ratio per sequence
    # Off-policy sequence masking (DeepSeek-V3.2, arXiv 2512.02556 eq. 9): a completion with a negative
    # advantage whose mean log(alpha / pi_theta) over its tokens exceeds delta leaves the surrogate. None = off.
    sequence_mask_delta: float | None = None
    # Masked importance sampling (verl's rollout rejection, IcePop, Geo-RS): tokens ("token") or whole completions
    # ("sequence", by the geometric mean over its tokens) whose pi_k / alpha lies outside [low, high] leave the
    # surrogate. pi_k is the trainer's own forward, so at v = 1 this drops exactly the sampler/trainer mismatch.
    masked_is: Literal["none", "token", "sequence"] = "none"
    masked_is_low: float = 0.5
    masked_is_high: float = 2.0
    # M2PO (arXiv 2510.01161): before the updates, mask the batch's tokens with the largest (log pi_k/alpha)^2
    # until the mean (log pi_k/alpha)^2 of the rest is <= tau (0.04 in the paper). None = off.
    m2po_tau: float | None = None
    # M2PO's objective: "paper" (the mask replaces the clip: the unclipped ratio x A on the tokens kept, as in the
    # paper) or "clipped" (the mask and PPO's clip together). Applies to policy_loss clip only.
    m2po_form: Literal["paper", "clipped"] = "paper"
    # The policy-gradient term: PPO's clipped surrogate, or CISPO (MiniMax-M1, arXiv 2506.13585):
    # sg(min(r, 1 + cispo_eps_high)) * A * log pi_theta, r the ratio of off_policy_ratio, every token keeps a
    # gradient; cispo_eps_low (None = no lower bound, as in the paper) bounds the weight below at 1 - eps_low.
    policy_loss: Literal["clip", "cispo"] = "clip"
    cispo_eps_high: float = 0.28
    cispo_eps_low: float | None = None
    # KL to the reference (beta = 0 removes the reference entirely).
    beta: float = 0.04
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    swap_reference: bool = False  # reference <- current after every epoch
    # Aggregation (docs/algorithm.md §4); sum_norm_length is Dr.GRPO's constant L (None = sampler.max_new_tokens).
    aggregation: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"] = "token_mean"
    sum_norm_length: int | None = None
    # Re-deal whole groups to the minibatches at every inner step after the first (PPO-style reshuffling).
    # None = on exactly when it changes anything: inner_steps > 1 and num_minibatches > 1.
    shuffle_minibatches: bool | None = None

    def __post_init__(self):
        for name in ("num_generations", "inner_steps", "num_minibatches", "micro_batches", "refresh_max_iterations"):
            _check(getattr(self, name) >= 1, f"grpo.{name}", getattr(self, name), "a positive integer")
        _check(self.behaviour_refresh == "adaptive" or (isinstance(self.behaviour_refresh, int)
                                                        and self.behaviour_refresh >= 1),
               "grpo.behaviour_refresh", self.behaviour_refresh, "a positive integer or 'adaptive'")
        _check(self.dynamic_sampling_rounds >= 0, "grpo.dynamic_sampling_rounds", self.dynamic_sampling_rounds,
               ">= 0 (0 = off)")
        _check(self.dynamic_sampling_oversample >= 1, "grpo.dynamic_sampling_oversample",
               self.dynamic_sampling_oversample, "a positive integer (batches of B prompts per extra round)")
        _check(not self.dynamic_sampling_rounds or self.mask_zero_variance, "grpo.dynamic_sampling_rounds",
               self.dynamic_sampling_rounds, "0 unless grpo.mask_zero_variance (the groups a batch is still short "
               "of are masked zero-variance groups)")
        for name in ("refresh_tv", "refresh_penalty_fraction"):
            _check(getattr(self, name) is None or getattr(self, name) > 0, f"grpo.{name}", getattr(self, name),
                   "None or > 0")
        if self.behaviour_refresh == "adaptive":
            _check(self.refresh_tv is not None or self.refresh_penalty_fraction is not None,
                   "grpo.behaviour_refresh", self.behaviour_refresh,
                   "'adaptive' needs grpo.refresh_tv or grpo.refresh_penalty_fraction (else it is a fixed v)")
        _check(self.num_generations >= 2, "grpo.num_generations", self.num_generations, ">= 2 (a group)")
        _check(self.advantage_eps >= 0, "grpo.advantage_eps", self.advantage_eps, ">= 0")
        _check(0 <= self.clip_eps_low < 1, "grpo.clip_eps_low", self.clip_eps_low, "in [0, 1)")
        _check(self.clip_eps_high >= 0, "grpo.clip_eps_high", self.clip_eps_high, ">= 0")
        _check(self.dual_clip is None or self.dual_clip > 1, "grpo.dual_clip", self.dual_clip, "None or > 1")
        _check(self.truncated_is_cap > 0, "grpo.truncated_is_cap", self.truncated_is_cap, "> 0")
        _check(self.sequence_mask_delta is None or self.sequence_mask_delta >= 0, "grpo.sequence_mask_delta",
               self.sequence_mask_delta, "None or >= 0")
        _check(0 <= self.masked_is_low < self.masked_is_high, "grpo.masked_is_low", (self.masked_is_low,
               self.masked_is_high), "0 <= masked_is_low < masked_is_high")
        _check(self.m2po_tau is None or self.m2po_tau > 0, "grpo.m2po_tau", self.m2po_tau, "None or > 0")
        _check(self.cispo_eps_high > 0, "grpo.cispo_eps_high", self.cispo_eps_high, "> 0")
        _check(self.cispo_eps_low is None or 0 <= self.cispo_eps_low < 1, "grpo.cispo_eps_low", self.cispo_eps_low,
               "None or in [0, 1)")
        if self.policy_loss == "cispo":  # CISPO has no min with a clipped side, and its weight is per token
            _check(self.dual_clip is None, "grpo.dual_clip", self.dual_clip, "None with grpo.policy_loss=cispo")
            _check(not self.sequence_ratio, "grpo.sequence_ratio", self.sequence_ratio,
                   "false with grpo.policy_loss=cispo")
        _check(self.beta >= 0, "grpo.beta", self.beta, ">= 0")
        _check(
            self.sum_norm_length is None or self.sum_norm_length > 0,
            "grpo.sum_norm_length", self.sum_norm_length, "None or a positive integer",
        )
        # pi/alpha * min(pi_k/alpha, C) would weigh the behaviour ratio twice (at the first stale update,
        # effectively (pi_k/alpha)^2): truncated IS corrects the pi/pi_k ratio only (the decoupled form).
        _check(self.truncated_is == "none" or self.off_policy_ratio == "current", "grpo.truncated_is",
               self.truncated_is, f"only with grpo.off_policy_ratio=current (got {self.off_policy_ratio!r}): the "
               "truncated weight min(pi_k/alpha, C) already corrects for the behaviour policy, so the clipped "
               "ratio must be pi/pi_k")

    @property
    def keeps_behaviour_copy(self) -> bool:
        """Whether the behaviour policy is a separate copy of the params (v > 1 or adaptive), not the params."""
        return self.behaviour_refresh != 1

    @property
    def shuffles_minibatches(self) -> bool:
        """Whether minibatches are re-dealt at each inner step (`shuffle_minibatches`, None = auto)."""
        if self.shuffle_minibatches is None:
            return self.inner_steps > 1 and self.num_minibatches > 1
        return self.shuffle_minibatches
