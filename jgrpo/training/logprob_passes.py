"""The log-prob passes over a step batch before its update: the reference's log-probs (the KL term, beta > 0),
pi_k's (when a later update needs them: `rl.lp_k.lp_k_source` "computed") and M2PO's mask (its second moment of
log pi_k / alpha over the whole batch, which needs pi_k's). Each pass runs the model over the batch in the batch's
layout (`padded_layout`, `packed_layout`), given as an object: the programs are the same for both.
"""

from __future__ import annotations

import functools

import jax

from jgrpo.models.lora import join_adapters
from jgrpo.rl.corrections import m2po_drop
from jgrpo.rl.lp_k import lp_k_source
from jgrpo.training.layout import Layout
from jgrpo.training.step_batch import StepBatch
from jgrpo.training.step_model import StepModel
from jgrpo.training.step_options import StepOptions


class LogprobPasses:
    """The passes of one run: `reference` and `pi_k` (jitted: (params, batch, plan=None) -> [C, r, N]), `m2po_mask`
    (jitted: batch -> [C, r, N] bool), and `run`, which adds what the run needs to a batch."""

    def __init__(self, model: StepModel, layout: Layout, options: StepOptions):
        self.model, self.layout, self.grpo = model, layout, options.grpo
        self.lp_k_source = lp_k_source(options.grpo, options.on_policy)
        self.reference, self.pi_k = (model.jit(functools.partial(self._logprobs, kind=kind))
                                     for kind in ("kl", "sampled"))
        self.m2po_mask = jax.jit(self._m2po_mask)

    @property
    def run_model(self) -> bool:
        """Whether the run runs a model pass before its updates (the reference's or pi_k's)."""
        return self.grpo.beta > 0 or self.lp_k_source == "computed"

    def run(self, batch: StepBatch, plan, *, reference, current, frozen=None) -> StepBatch:
        """`batch` with the log-probs of the `reference` params (beta > 0) and of the `current` ones (pi_k, when
        computed), and M2PO's token mask; `plan` is the layout's plan of the passes (`plan_passes`). With LoRA,
        `reference` and `current` are adapters (the reference may have none) and `frozen` the base they join."""
        if self.grpo.beta > 0:
            batch = batch._replace(lp_ref=self.reference(join_adapters(reference, frozen), batch, plan=plan))
        if self.lp_k_source == "computed":
            batch = batch._replace(lp_k=self.pi_k(join_adapters(current, frozen), batch, plan=plan))
        if self.grpo.m2po_tau is not None:
            batch = batch._replace(m2po_drop=self.m2po_mask(batch))
        return batch

    def received(self, assembled: StepBatch) -> dict[str, StepBatch]:
        """The batch as each program receives it, from the assembled one (abstract arrays, the planner's): `run`
        adds lp_ref, then lp_k, then M2PO's mask; the update gets them all."""
        with_ref = assembled._replace(lp_ref=assembled.lp_alpha if self.grpo.beta > 0 else None)
        with_lp_k = with_ref._replace(lp_k=assembled.lp_alpha if self.lp_k_source == "computed" else None)
        done = with_lp_k._replace(m2po_drop=assembled.completion_mask if self.grpo.m2po_tau is not None else None)
        return {"ref_logprobs": assembled, "lp_k": with_ref, "m2po_mask": with_lp_k, "update": done}

    def _logprobs(self, params, batch: StepBatch, plan=None, *, kind: str):
        return self.layout.logprobs(params, batch, plan, kind)

    def _m2po_mask(self, batch: StepBatch) -> jax.Array:
        """[C, r, N] bool: M2PO's dropped tokens, decided over the whole batch (needs `batch.lp_k`)."""
        in_loss_tokens = batch.completion_mask & batch.adv.in_loss[..., None].astype(bool)
        return self.model.rows(m2po_drop(batch.lp_k, batch.lp_alpha, in_loss_tokens, self.grpo.m2po_tau))
