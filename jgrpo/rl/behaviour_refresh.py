"""When the behaviour policy is refreshed (behaviour <- current): every v iterations, or adaptively from Theorem 1.

The paper refreshes every fixed v iterations. Its Theorem 1 says what staleness costs:

    J(pi) - J(pi_k) >= L_alpha(pi) - 2 M TV(pi, alpha) - 2 TV(pi_k, alpha)

so `behaviour_refresh: adaptive` refreshes when the measured distance says the samples are too stale: after an
iteration whose last update saw TV(pi_theta, alpha) > `refresh_tv`, or whose penalty 2 M TV(pi_theta, alpha) +
2 TV(pi_k, alpha) exceeded `refresh_penalty_fraction` of |L_alpha|, and at the latest `refresh_max_iterations`
after the previous refresh. TV(pi_theta, alpha) is the last update's estimate, from the params that update
started from (the one its forward pass saw). The decision is taken at the end of an iteration and kept in the
run counters, so a resumed run refreshes exactly when the uninterrupted one would.
"""

from __future__ import annotations

import numpy as np

from jgrpo.config import GRPOConfig

# Why a refresh happens; the code is what the run counters keep between an iteration and the next.
REFRESH_REASONS = {1: "refresh_tv", 2: "refresh_penalty_fraction"}


class RefreshPolicy:
    def __init__(self, grpo: GRPOConfig):
        self.grpo = grpo
        self.adaptive = grpo.behaviour_refresh == "adaptive"

    def due(self, k: int, behaviour_version: int, has_copy: bool, requested: int) -> str | None:
        """Why iteration `k` samples from a fresh copy of the current params, or None when it does not."""
        if not has_copy:
            return "first iteration" if k == 0 else "resumed without a behaviour copy"
        if not self.adaptive:
            v = self.grpo.behaviour_refresh
            return f"every {v} iterations" if k % v == 0 else None
        if requested:
            return f"grpo.{REFRESH_REASONS[requested]} exceeded at iteration {k}"
        if k - behaviour_version >= self.grpo.refresh_max_iterations:
            return f"grpo.refresh_max_iterations={self.grpo.refresh_max_iterations} reached"
        return None

    def request(self, update_metrics: list[dict]) -> tuple[int, str]:
        """After an iteration's updates (their finalised metrics): (reason code, explanation), code 0 = stay."""
        if not self.adaptive:
            return 0, ""
        bounded = [m for m in update_metrics if float(m["bound_row_count"]) > 0]
        if not bounded:  # every group masked: nothing was measured
            return 0, ""
        last = bounded[-1]
        tv = float(last["tv_theta_alpha"])
        g = self.grpo
        if g.refresh_tv is not None and tv > g.refresh_tv:
            return 1, f"TV(pi_theta, alpha) = {tv:.4f} > grpo.refresh_tv = {g.refresh_tv}"
        if g.refresh_penalty_fraction is not None:
            exact = [float(m["tv_k_alpha"]) for m in bounded if float(m["lp_k_exact"]) > 0]
            tv_k = float(np.mean(exact)) if exact else 0.0
            penalty = 2.0 * float(last["tv_weight_M"]) * tv + 2.0 * tv_k
            surrogate = abs(float(last["surrogate_alpha"]))
            if penalty > g.refresh_penalty_fraction * surrogate:
                return 2, (f"Theorem 1 penalty {penalty:.4f} > grpo.refresh_penalty_fraction = "
                           f"{g.refresh_penalty_fraction} x |L_alpha| = {surrogate:.4f}")
        return 0, ""
