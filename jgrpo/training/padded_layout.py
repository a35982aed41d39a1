"""The padded layout of a step batch (`layout.Layout`): every completion padded to N = `sampler.max_new_tokens`, a
micro-batch one chunk [r, ...] of the batch's [C, r, ...] rows (`step_batch`). The default; `packed_layout` is the
other. With the G rows of a group in one chunk and `share_prompts`, the padded forward computes each prompt once
(`models.shared_prompt`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jgrpo.models.lora import join_adapters
from jgrpo.models.shared_prompt import forward_shared_prompts
from jgrpo.rl.diagnostics import extreme_kind
from jgrpo.rl.routing_replay import forward_metrics, sampler_ran
from jgrpo.training.layout import LayoutPlans, MinibatchSums
from jgrpo.training.step_batch import StepBatch
from jgrpo.training.step_model import Forward, StepModel, forward_of
from jgrpo.training.step_options import StepOptions


class PaddedLayout:
    """Every completion padded to N; the micro-batches are the batch's chunks."""

    def __init__(self, model: StepModel, options: StepOptions):
        self.model, self.grpo = model, options.grpo
        self.share_prompts, self.routing_replay = options.share_prompts, options.routing_replay

    def plan_passes(self, prompt_tokens, prompt_mask, samples, batch: StepBatch) -> None:
        return None  # the passes run over the batch's own chunks

    def plan_update(self, batch: StepBatch) -> None:
        return None

    def abstract_plans(self, prompts: int, prompt_width: int, micro_batches: int | None = None) -> LayoutPlans:
        return LayoutPlans()

    def logprobs(self, params, batch: StepBatch, plan: None, kind: str) -> jax.Array:
        """[C, r, N] log-probs of every chunk (one chunk at a time: the memory of one micro-batch)."""
        return self.model.rows(jax.lax.map(lambda micro: self.forward(params, micro, kind=kind).lp, batch))

    def gradients(self, params, frozen, mb: StepBatch, plan: None, minibatch, objective) -> MinibatchSums:
        """A minibatch's chunks `mb` [U, r, ...], one micro-batch at a time (a scan), each `objective(forward,
        micro, share)`'s gradient with respect to `params` (`frozen`, a LoRA base, joins them unchanged)."""
        micro_batches, with_kl = self.grpo.micro_batches, self.grpo.beta > 0

        def loss(params, micro):
            return objective(self.forward(join_adapters(params, frozen), micro, with_kl=with_kl), micro,
                             micro_batches)

        grad_fn = jax.value_and_grad(loss, has_aux=True)

        def micro_step(grads, micro):
            (micro_loss, metrics), g = grad_fn(params, micro)
            return jax.tree.map(jnp.add, grads, g), (micro_loss, metrics)

        zeros = jax.tree.map(jnp.zeros_like, params)
        grads, (losses, metrics) = jax.lax.scan(micro_step, zeros, mb)
        return MinibatchSums(grads, losses.sum(), _stack_sum(metrics), {})

    def forward(self, params, micro: StepBatch, kind: str = "sampled", with_kl: bool = False) -> Forward:
        """The per-token [r, N] log-probs of `micro.targets` under `params` (docs/algorithm.md §6; `kind` and
        `with_kl`: `StepModel.token_logprobs`), and for a mixture of experts the forward's router losses and
        routing metrics (`rl.routing_replay`)."""
        model = self.model.of(params)
        targets = micro.targets
        hidden, chosen, router = self._predicting_states(model, micro, targets.shape[1])
        logprobs = self.model.token_logprobs(model, hidden, targets, kind, with_kl)
        if router is None:
            return forward_of(logprobs, {})
        ran = sampler_ran(micro.input_mask, micro.completion_mask[:, -1], micro.inputs.shape[1] + 1 - targets.shape[1])
        return forward_of(logprobs, forward_metrics(router, chosen, micro.routing, ran))

    def _predicting_states(self, model, micro: StepBatch, new_tokens: int):
        """(the hidden states at slots P-1 ... P+N-2 [r, N, D], which predict completion tokens 0 ... N-1; the
        experts the router picks at every input position [r, P+N-1, L, k] and its `RouterStats`, None and None for
        a dense model). With routing replay the forward sends each token to `micro.routing`'s experts instead."""
        inputs, input_mask, positions = micro.inputs, micro.input_mask, micro.positions
        replay = micro.routing if self.routing_replay else None
        rows, P = inputs.shape[0], inputs.shape[1] + 1 - new_tokens
        G, stats = self.grpo.num_generations, bool(self.model.cfg.num_experts)
        if self.share_prompts and G > 1 and rows % G == 0 and new_tokens > 1:
            def first_of_group(x):  # [r, ...] -> [r/G, ...]: the group's shared prompt
                return x[:, :P].reshape(rows // G, G, P, *x.shape[2:])[:, 0]

            prompt, completion, chosen, *router = forward_shared_prompts(
                model, first_of_group(inputs), first_of_group(input_mask), inputs[:, P:], input_mask[:, P:],
                positions[:, P:], None if replay is None else (first_of_group(replay), replay[:, P:]), stats)
            if chosen is not None:
                chosen = jnp.concatenate([jnp.repeat(chosen[0], G, axis=0), chosen[1]], axis=1)
            hidden = jnp.concatenate([jnp.repeat(prompt[:, -1:], G, axis=0), completion], axis=1)
            return hidden, chosen, router[0] if router else None
        hidden, _, chosen, *router = model.routed(inputs, positions, input_mask, routing=replay,
                                                  router_stats=stats)  # [r, P+N-1, D]
        return hidden[:, P - 1 :], chosen, router[0] if router else None


def _stack_sum(metrics: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """Reduce micro-batch accumulators stacked on axis 0 (extremes by min / max, everything else by sum)."""
    reduce = {"min": jnp.min, "max": jnp.max, None: jnp.sum}
    return {key: reduce[extreme_kind(key)](value, axis=0) for key, value in metrics.items()}
