"""What a step batch's layout is: how the model runs over the batch, given to the log-prob passes (`logprob_passes`)
and the update (`update_steps`) as an object, so neither branches on padded vs packed. Two layouts answer the same
calls: `padded_layout.PaddedLayout` (every completion padded to N, the default) and `packed_layout.PackedLayout`
(completions end to end in packed micro-batches, `model.packing`).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import jax


class MinibatchSums(NamedTuple):
    """One minibatch's micro-batches summed: what the optimiser step applies and reports."""

    grads: Any  # the gradients, a pytree of the trained params
    loss: jax.Array  # [] the summed loss
    metrics: dict  # the summed metric accumulators (`rl.diagnostics.combine_metrics`)
    layout_metrics: dict  # the layout's own (the packed micro-batches used and their fill; {} padded)


class LayoutPlans(NamedTuple):
    """A layout's plans as abstract arrays (the planner's), and the trip counts its loops are costed at."""

    passes: Any = None  # the log-prob passes' plan (None: the layout plans nothing)
    update: Any = None  # the update's plan, every minibatch's
    passes_trips: int | None = None  # a loop whose trip count is an argument: the count its cost is taken at
    update_trips: int | None = None


class Layout(Protocol):
    """The calls a layout answers (`step_batch.StepBatch` is the batch, [C, r, ...])."""

    def plan_passes(self, prompt_tokens, prompt_mask, samples, batch) -> Any:
        """On the host: the log-prob passes' plan of the batch (None where the layout plans nothing)."""

    def plan_update(self, batch) -> Any:
        """On the host: the update's plan of the batch as dealt to its minibatches (None where nothing is planned)."""

    def logprobs(self, params, batch, plan, kind: str) -> jax.Array:
        """Traced: the [C, r, N] log-probs of the batch's completion tokens (`kind`: `StepModel.token_logprobs`)."""

    def gradients(self, params, frozen, mb, plan, minibatch, objective) -> MinibatchSums:
        """Traced: minibatch `minibatch`'s chunks `mb` [U, r, ...], each micro-batch's `objective(forward, rows,
        share, covered)` (`update_steps.UpdateSteps`) and its gradient with respect to `params` (`frozen`, a LoRA
        base, joined unchanged), summed."""

    def abstract_plans(self, prompts: int, prompt_width: int, micro_batches: int | None = None) -> LayoutPlans:
        """The plans as the planner lowers the programs with them, for batches of `prompts` prompts."""
