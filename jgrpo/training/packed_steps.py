"""The trainer's programs over packed micro-batches (`model.packing`, #40): the log-prob passes and the update.

`StepFunctions` (steps.py) pads every completion to N = `sampler.max_new_tokens`; with `model.packing` its
passes and its update run the same model over packed micro-batches instead (`packed_passes`: the plan, the
sizes, one micro-batch's forward), from the same batch record, for the same numbers:
  - a log-prob pass runs the micro-batches of a whole-batch plan and scatters its log-probs back to [C, r, N];
  - an update step plans its minibatch alone (its rows as dealt, after any group shuffle) and, for each packed
    micro-batch it uses (a loop with a traced trip count over a buffer of one per group: nothing recompiles when
    the count changes), runs the forward, scatters the log-probs to the minibatch's [n, N] rows and takes
    `grpo_loss` over the rows whose group the micro-batch holds. Every other per-token field (lp_alpha, lp_k,
    lp_ref, the loss and M2PO masks) stays in the padded layout: the loss reads it there. Each row is in exactly
    one micro-batch, the step's normaliser fixes every token's weight, so the sum over micro-batches is the
    padded step's loss, gradient and metrics (tests/training/test_packed_update.py);
  - in both, a micro-batch computes only its rows in use, rounded up to a bucket (`model.packing_row_buckets`,
    `packed_passes.on_rows_in_use`: a branch per bucket), so a group that leaves a row or two empty costs less.
A mixture of experts' router losses are a micro-batch's mean as padded, over the packed micro-batches used.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jgrpo.models.lora import join_adapters
from jgrpo.models.moe import RouterStats
from jgrpo.parallel.mesh import row_sharding
from jgrpo.rl.diagnostics import combine_metrics, extreme_kind
from jgrpo.rl.routing_replay import forward_metrics, routing_metrics
from jgrpo.training.packed_passes import (
    PackedBatch,
    data_shards,
    on_rows_in_use,
    pack_batch,
    pack_minibatches,
    predicting_states,
    row_buckets,
)
from jgrpo.training.packing import PackingPlan, unpack


class PackedSteps:
    """The packed programs of `StepFunctions`, which they are methods of (its attributes: the mesh, the model's
    functions, the loss)."""

    def pack(self, prompt_tokens, prompt_mask, samples, batch) -> PackedBatch:
        """The log-prob passes' plan: the batch's completions and prompts as packed micro-batches."""
        return pack_batch(self.mesh, self.rules, self.chunks, self.packing_width, prompt_tokens, prompt_mask,
                          samples.tokens, samples.completion_mask, batch.routing if self.routing_replay else None)

    def pack_minibatches(self, batch) -> PackedBatch:
        """The update's plan: each minibatch of the (dealt) batch packed alone, fields [M, U, ...]."""
        return pack_minibatches(self.mesh, self.rules, self.grpo.num_minibatches, self.packing_width,
                                self.grpo.num_generations, batch.inputs, batch.input_mask, batch.targets,
                                batch.lengths, batch.routing)

    def _all_logprobs_packed(self, params, packed: PackedBatch, rows: int, kind: str):
        """`_all_logprobs` over packed micro-batches (`training.packed_passes`): [C, r, N], 0 where no token."""
        model = self._model(params)
        shards = data_shards(self.mesh, self.rules, self.chunks, rows)  # as pack_batch dealt the groups
        fields = packed._replace(count=None)

        def logprobs(micro):
            hidden = predicting_states(model, micro, self.routing_replay, shards, on_rows=self._on_rows)
            return self._token_logprobs(model, hidden, micro.tokens, kind)[0]

        def one(u, lp):
            micro = self._micro(fields, u)
            return lp.at[u].set(on_rows_in_use(logprobs, micro, self.packing_row_buckets, shards, self._on_rows,
                                               rows_out=True))

        # Only the micro-batches that hold tokens: a loop with a traced trip count over the fixed buffer.
        lp = jax.lax.fori_loop(0, packed.count, one, jnp.zeros(packed.tokens.shape, jnp.float32))
        out = unpack(lp, PackingPlan(packed.row, packed.index, packed.segment, 0), rows, self.new_tokens)
        return self._rows(out.reshape(self.chunks, rows // self.chunks, self.new_tokens))

    def _on_rows(self, x):
        """Activations [rows, ...] of a packed micro-batch with their rows on the data shards. Without it XLA kept
        the FSDP-split hidden dimension split and replicated the rows in the packed layer stack (a TPU plan of the
        GSM8K config: 45.5 GiB of temporaries on a 16 GiB v5e; with it 12.4 GiB live, benchmarks/packed_plan.py)."""
        return jax.lax.with_sharding_constraint(x, row_sharding(self.mesh, self.rules, x.shape, row_axis=0))

    def _micro(self, fields: PackedBatch, u) -> PackedBatch:
        """Packed micro-batch `u` of a plan's fields, its rows (axis 0) on the data shards the plan dealt them to."""
        micro = jax.tree.map(lambda x: self._on_rows(x[u]), fields._replace(owns=None, rows_used=None))
        return micro._replace(owns=fields.owns[u], rows_used=fields.rows_used[u])

    def _train_step_packed(self, params, opt_state, batch, minibatch, first_update, frozen=None, packed=None):
        """`_train_step` over minibatch `minibatch`'s packed micro-batches (`packed`: `pack_minibatches`)."""
        mb, norm = self._minibatch(batch, minibatch)
        rows = jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), mb)  # the minibatch's [n, ...] rows
        plan = jax.tree.map(lambda x: x[minibatch], packed)
        count, fields = plan.count, plan._replace(count=None)
        grad_fn = jax.value_and_grad(self._packed_loss, has_aux=True)
        shards = self._update_shards(rows)

        def micro_step(u, carry):
            grads, loss, metrics = carry
            micro = self._micro(fields, u)
            (micro_loss, micro_metrics), g = on_rows_in_use(
                lambda m: grad_fn(params, rows, m, count, norm, first_update, frozen), micro,
                self.packing_row_buckets, shards, self._on_rows)
            return jax.tree.map(jnp.add, grads, g), loss + micro_loss, combine_metrics(metrics, micro_metrics)

        first = jax.tree.map(lambda x: x[0], fields)
        shapes = jax.eval_shape(grad_fn, params, rows, first, count, norm, first_update, frozen)[0][1]
        identity = {"min": jnp.inf, "max": -jnp.inf, None: 0.0}
        empty = {key: jnp.full(x.shape, identity[extreme_kind(key)], x.dtype) for key, x in shapes.items()}
        zeros = jax.tree.map(jnp.zeros_like, params)
        grads, loss, metrics = jax.lax.fori_loop(0, count, micro_step, (zeros, jnp.float32(0.0), empty))
        params, opt_state, out = self._apply(params, opt_state, grads, loss, metrics, mb, norm, first_update)
        buckets = row_buckets(plan.tokens.shape[1] // shards, self.packing_row_buckets)
        return params, opt_state, {**out, **_packing_metrics(plan, buckets, shards)}

    def _update_shards(self, rows) -> int:
        """D of the update's packed rows (as `pack_minibatches` dealt them): from the minibatch's `rows`."""
        return data_shards(self.mesh, self.rules, self.chunks, rows.targets.shape[0] * self.grpo.num_minibatches)

    def _packed_loss(self, params, rows, micro: PackedBatch, count, norm, first_update, frozen=None):
        """One packed micro-batch's loss over the minibatch's `rows` (`_objective` of the rows it holds)."""
        model = self._model(join_adapters(params, frozen))
        shards = self._update_shards(rows)
        moe = bool(self.num_experts)
        out = predicting_states(model, micro, self.routing_replay, shards, self.grpo.num_generations,
                                self.new_tokens if moe else None, self._on_rows)
        hidden, chosen, router = out if moe else (out, None, None)
        logprobs = self._token_logprobs(model, hidden, micro.tokens, "sampled", self.grpo.beta > 0)
        n, N = rows.targets.shape
        lp, entropy, *lp_kl = (unpack(x, PackingPlan(micro.row, micro.index, micro.segment, 0), n, N)
                               for x in logprobs)
        routing = {} if router is None else _router_metrics(router, chosen, micro, self.grpo.num_generations)
        return self._objective(lp, entropy, lp_kl, routing, rows, norm, first_update, count, rows=micro.owns)


def _router_metrics(router: RouterStats, chosen, micro: PackedBatch, group_size: int) -> dict:
    """`routing_replay.forward_metrics` of a packed forward: the routing compared over the positions the sampler
    ran, each prompt token once per completion of its group (as in the padded rows), a completion's token j where
    token j + 1 follows it in the row (its last token is never fed)."""
    segment = micro.segment
    fed = (segment > 0) & (jnp.pad(segment[:, 1:], ((0, 0), (0, 1))) == segment)
    metrics = forward_metrics(router, chosen[1], micro.routing, fed)
    if micro.routing is not None:
        prompt = routing_metrics(chosen[0], micro.prompt_routing, micro.prompt_group >= 0)
        metrics.update({key: metrics[key] + group_size * prompt[key] for key in prompt})
    return metrics


def _packing_metrics(plan: PackedBatch, buckets: list[int], shards: int) -> dict:
    """The packed micro-batches a step used (`packing_micro_batches`, and `_max` over an iteration's steps), their
    fill (real tokens over packed slots, per stream) and the share of their rows computed (`buckets`: the rows per
    data shard a micro-batch can run at, `packed_passes.row_buckets`)."""
    used = jnp.arange(plan.tokens.shape[0]) < plan.count  # [U]
    count = plan.count.astype(jnp.float32)
    run = jnp.asarray(buckets, jnp.int32)[jnp.searchsorted(jnp.asarray(buckets, jnp.int32), plan.rows_used)]
    computed = jnp.sum(jnp.where(used, run, 0)) * shards / jnp.maximum(count * plan.tokens.shape[1], 1.0)

    def fill(real):  # [U, rows, width] bool
        slots = count * real.shape[1] * real.shape[2]
        return jnp.sum(real & used[:, None, None]) / jnp.maximum(slots, 1.0)

    return {"packing_micro_batches": count, "packing_micro_batches_max": count,
            "packing_fill": fill(plan.row >= 0), "packing_prompt_fill": fill(plan.prompt_group >= 0),
            "packing_rows_computed": computed}
