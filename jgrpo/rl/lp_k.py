"""Where pi_k's log-probs (lp_k, the policy at the start of the iteration) come from in the loss: a pure function
of the config, which decides whether the trainer runs a forward pass for them (docs/algorithm.md)."""

from __future__ import annotations

from typing import Literal

from jgrpo.config import GRPOConfig

# Where lp_k (log-probs at the start of the iteration) comes from after the first update of an iteration
# (at the first update it is always stop_gradient(lp): the params are still pi_k).
#   computed:  a trainer forward pass at the start of the iteration (no backward: about a third of one update's
#              forward + backward), when a later update's loss needs pi_k, or the Theorem 1 diagnostic
#              TV(pi_k, alpha) could not otherwise see every row
#   behaviour: the sampler's lp_alpha; exact when v = 1, because then pi_k is the behaviour policy
#   self:      stop_gradient(lp), exact at the first update only: a single update per batch (which therefore
#              never needs a forward for pi_k), or one minibatch whose first update sees every row (the host
#              keeps TV(pi_k, alpha) from the updates flagged `lp_k_exact`)
LpKSource = Literal["computed", "behaviour", "self"]


def lp_k_source(grpo: GRPOConfig, on_policy: bool | None = None) -> LpKSource:
    """`on_policy`: whether the sampling params are always pi_k (default: v = 1; `Config.samples_on_policy` also
    knows async rollouts, whose batches may be stale at v = 1)."""
    if grpo.m2po_tau is not None:  # M2PO's mask needs pi_k / alpha over the whole batch before the first update
        return "computed"
    updates_per_batch = grpo.inner_steps * grpo.num_minibatches
    on_policy = not grpo.keeps_behaviour_copy if on_policy is None else on_policy
    if updates_per_batch == 1:
        return "behaviour" if on_policy else "self"
    # Masked IS needs the trainer's own pi_k even at v = 1: lp_alpha in its place would never drop anything.
    needs_pi_k = (grpo.off_policy_ratio in ("recentred", "current") or grpo.truncated_is != "none"
                  or grpo.masked_is != "none")
    if needs_pi_k or (not on_policy and grpo.num_minibatches > 1):
        return "computed"
    return "behaviour" if on_policy else "self"
