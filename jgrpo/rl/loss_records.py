"""The loss kernel's inputs and terms as records (docs/algorithm.md §3, §4): what `objectives.grpo_loss` takes, and
what it hands, whole, to its metrics (`diagnostics.loss_metrics`).

Per-token arrays are [N, T] (N completion rows, T completion tokens), per-row ones [N]:

    LossInputs   what every objective needs: the log-probs of the three policies (pi_theta, the behaviour alpha,
                 pi_k), the rows' advantages, the completion mask
    LossExtras   what only some objectives or metrics read, each None when off: the KL's inputs, M2PO's mask, the
                 metrics' extra inputs, the rows a packed micro-batch covers
    LossTerms    what the loss computed on the way (ratio, clip sides, corrections' weights and drops, the KL, the
                 two parts of the loss): its metrics count them
"""

from __future__ import annotations

from typing import NamedTuple

import jax

from jgrpo.rl.advantages import GroupAdvantages


class LossInputs(NamedTuple):
    """What every objective needs. Only `lp` carries a gradient."""

    lp: jax.Array  # [N, T] float32: the current params' log-probs (pi_theta)
    lp_alpha: jax.Array  # [N, T] float32: the behaviour policy's, recorded by the sampler
    # [N, T] float32: pi_k's, the params at the start of the outer iteration. None: this is inner step 1, where
    # pi_k is the current policy, so stop_gradient(lp) stands in (the `current` ratio is then pi / sg(pi)).
    lp_k: jax.Array | None
    adv: GroupAdvantages  # fields [N]: the matching rows of `group_advantages`
    completion_mask: jax.Array  # [N, T] bool: the tokens in the loss (the sampler drew them)


class LossExtras(NamedTuple):
    """The optional inputs of `grpo_loss`, each None when unused."""

    # The KL term (grpo.beta > 0): the reference's log-probs, untruncated and temperature-scaled (the sampler's
    # `tempered_logprobs`), and pi_theta's, untruncated like them (with gradient; None: `lp`, right when the
    # sampler does not truncate).
    lp_ref: jax.Array | None = None
    lp_kl: jax.Array | None = None
    # [N, T] bool: the tokens M2PO drops (`corrections.m2po_drop`, decided over the whole batch before the updates).
    m2po_drop: jax.Array | None = None
    # Metrics only: per-token policy entropy; the trainer's log-probs at the behaviour params (e.g. `lp` itself at
    # v = 1, i = 1) for the sampler-vs-trainer mismatch; k - version(behaviour), reported as is.
    entropy: jax.Array | None = None
    lp_behaviour_trainer: jax.Array | None = None
    staleness: jax.Array | int | None = None
    # [N] bool: the rows this call covers (None: all); the others add nothing to the loss or the metrics (a packed
    # micro-batch holds some of its minibatch's rows, `training.packed_passes`).
    rows: jax.Array | None = None


class LossTerms(NamedTuple):
    """What `grpo_loss` computed from its inputs, for its metrics: per-token [N, T] unless noted, None where off."""

    mask: jax.Array  # bool: the loss tokens (completion tokens of the rows in the loss)
    ratio: jax.Array  # the ratio in the clip (with gradient)
    clipped_low: jax.Array  # bool: the clip's (or CISPO's weight's) lower side
    clipped_high: jax.Array  # bool: its upper side
    dual_clipped: jax.Array  # bool: floored by the dual clip
    is_weight: jax.Array | None  # truncated importance sampling's weight
    sequence_masked: jax.Array | None  # [N] bool: the rows off-policy sequence masking drops
    mis_dropped: jax.Array | None  # bool: the tokens masked importance sampling drops
    kl: jax.Array | None  # the per-token KL estimate (grpo.beta > 0)
    pg_loss: jax.Array  # [] the policy-gradient part of the loss
    kl_loss: jax.Array  # [] the KL part (0 without one)
