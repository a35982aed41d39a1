"""The update: grpo.inner_steps passes over a built step batch, each grpo.num_minibatches optimiser steps, each step
accumulating gradients over its micro-batches in the batch's layout (`padded_layout`, `packed_layout`), given as an
object: the step, its objective and its optimiser update are the same for both.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax

from jgrpo.parallel.host_arrays import fetch
from jgrpo.rl.diagnostics import finalize_metrics
from jgrpo.rl.loss_records import LossExtras, LossInputs
from jgrpo.rl.lp_k import lp_k_source
from jgrpo.rl.objectives import StepNorm, grpo_loss, step_has_signal, step_normaliser
from jgrpo.training.layout import Layout, MinibatchSums
from jgrpo.training.step_batch import StepBatch, shuffle_groups
from jgrpo.training.step_model import Forward, StepModel
from jgrpo.training.step_options import StepOptions


class UpdateSteps:
    """The optimiser steps of one run: `step` (jitted: one optimiser step on a minibatch, params and optimiser state
    donated), `shuffle` (jitted: the groups re-dealt to the minibatches) and `run`, the host loop over them."""

    def __init__(self, model: StepModel, layout: Layout, optimizer: optax.GradientTransformation, shardings: tuple,
                 options: StepOptions):
        """`shardings`: the trained params' and the optimiser state's."""
        self.layout, self.optimizer, self.grpo = layout, optimizer, options.grpo
        self.new_tokens, self.skip_empty_steps = options.new_tokens, options.skip_empty_steps
        self.router_loss_coefs = options.router_loss_coefs
        self.lp_k_source = lp_k_source(options.grpo, options.on_policy)
        self.step = model.jit(self._step, out_shardings=(*shardings, None), donate_argnums=(0, 1))
        self.shuffle = jax.jit(functools.partial(shuffle_groups, group_size=options.grpo.num_generations,
                                                 place=model.rows))

    def run(self, params, opt_state, batch: StepBatch, shuffle_key=None, frozen=None):
        """grpo.inner_steps passes over `batch`, each grpo.num_minibatches optimiser steps (params and optimiser
        state donated to each); with `shuffle_key`, whole groups are re-dealt to the minibatches at every inner
        step after the first. Returns (params, optimiser state, each step's metrics on the host)."""
        g = self.grpo
        metrics = []
        for inner in range(g.inner_steps):
            dealt = batch
            if inner and shuffle_key is not None:
                dealt = self.shuffle(dealt, jax.random.fold_in(shuffle_key, inner))
            plan = self.layout.plan_update(dealt)
            for minibatch in range(g.num_minibatches):
                first = inner == 0 and minibatch == 0
                params, opt_state, m = self.step(params, opt_state, dealt, jnp.int32(minibatch), jnp.bool_(first),
                                                 plan=plan, frozen=frozen)
                metrics.append(m)
        return params, opt_state, fetch(metrics)

    def _step(self, params, opt_state, batch: StepBatch, minibatch, first_update, plan=None, frozen=None):
        """One optimiser step on minibatch `minibatch` (traced), accumulating gradients over its micro-batches in the
        layout (`plan`: its plan of the dealt batch). Gradients and the optimiser cover `params` only; `frozen` (the
        LoRA base) goes into the forward unchanged."""
        mb, norm = self._minibatch(batch, minibatch)
        objective = functools.partial(self._objective, norm=norm, first_update=first_update)
        sums = self.layout.gradients(params, frozen, mb, plan, minibatch, objective)
        params, opt_state, out = self._apply(params, opt_state, sums, mb, norm, first_update)
        return params, opt_state, {**out, **sums.layout_metrics}

    def _minibatch(self, batch: StepBatch, minibatch):
        """Minibatch `minibatch`'s chunks [U, r, ...] of the batch, and its `step_normaliser`."""
        U = self.grpo.micro_batches
        mb = jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(x, minibatch * U, U, axis=0), batch)
        norm = step_normaliser(mb.completion_mask.reshape(-1, mb.completion_mask.shape[-1]),
                               mb.adv.in_loss.reshape(-1), self.grpo, max_new_tokens=self.new_tokens)
        return mb, norm

    def _objective(self, forward: Forward, fields: StepBatch, share, rows=None, *, norm: StepNorm, first_update):
        """The loss of one micro-batch given its `forward` [r, N] (`lp` with gradient) and its `fields` (`rows`: the
        rows it covers, None for all); the router losses count as a `share` of the step's micro-batches."""
        lp, routing = forward.lp, forward.routing
        own = jax.lax.stop_gradient(lp)
        if self.lp_k_source == "computed":
            later = fields.lp_k
        elif self.lp_k_source == "behaviour":
            later = fields.lp_alpha
        else:
            later = own
        lp_k = jnp.where(first_update, own, later)
        # lp itself stands in for the trainer's behaviour log-probs: the host keeps that mismatch metric only
        # for updates where the current params are the behaviour params (first update after a refresh).
        inputs = LossInputs(lp, fields.lp_alpha, lp_k, fields.adv, fields.completion_mask)
        extras = LossExtras(lp_ref=fields.lp_ref, lp_kl=forward.lp_kl, m2po_drop=fields.m2po_drop,
                            entropy=forward.entropy, lp_behaviour_trainer=lp, rows=rows)
        loss, metrics = grpo_loss(inputs, norm, self.grpo, extras)
        if "router_aux_loss" in routing:  # a micro-batch's share: the step's value is the micro-batches' mean
            for name, coef in zip(("router_aux_loss", "router_z_loss"), self.router_loss_coefs, strict=True):
                routing[name] = routing[name] / share
                loss = loss + coef * routing[name] if coef else loss
        return loss, {**metrics, **routing}

    def _apply(self, params, opt_state, sums: MinibatchSums, mb: StepBatch, norm: StepNorm, first_update):
        """The optimiser step with a minibatch's summed gradients, loss and metric accumulators.

        A non-finite loss or gradient norm leaves params and optimiser state untouched (the step is skipped
        and reported in the metrics as `nonfinite` = 1). So does, with `skip_empty_steps`, a step with nothing
        in the loss (`empty` = 1; `objectives.step_has_signal`): its gradient is 0, but AdamW would still move
        along its momentum and count the step in its schedule.
        `lp_k_exact` = 1 flags the updates whose lp_k is the real pi_k (see `lp_k_source`).
        """
        grads = sums.grads
        grad_norm = optax.tree.norm(grads)
        updates, new_opt_state = self.optimizer.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        finite = jnp.isfinite(sums.loss) & jnp.isfinite(grad_norm)
        has_signal = step_has_signal(mb.adv, norm, self.grpo)
        apply = finite & has_signal if self.skip_empty_steps else finite
        keep = functools.partial(jnp.where, apply)
        params = jax.tree.map(keep, new_params, params)
        opt_state = jax.tree.map(keep, new_opt_state, opt_state)
        out = finalize_metrics(sums.metrics)
        lp_k_exact = jnp.logical_or(first_update, self.lp_k_source != "self")
        out.update(grad_norm=grad_norm, nonfinite=(~finite).astype(jnp.float32),
                   empty=(~has_signal).astype(jnp.float32), lp_k_exact=lp_k_exact.astype(jnp.float32))
        return params, opt_state, out
