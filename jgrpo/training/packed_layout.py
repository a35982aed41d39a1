"""The packed layout of a step batch (`model.packing`, #40): the trainer's forwards over packed micro-batches.

The calls of a layout (`layout.Layout`), as the padded layout answers them, for the same numbers, from the same batch
record; the plans, sizes and one micro-batch's forward are `packed_passes`'s:
  - the log-prob passes run the micro-batches of a whole-batch plan and scatter their log-probs back to [C, r, N];
  - an update step plans its minibatch alone (its rows as dealt, after any group shuffle) and, for each packed
    micro-batch it uses (a loop with a traced trip count over a buffer of one per group: nothing recompiles when
    the count changes), runs the forward, scatters the log-probs to the minibatch's [n, N] rows and takes the
    objective over the rows whose group the micro-batch holds. Every other per-token field (lp_alpha, lp_k,
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
from jgrpo.parallel.mesh import replicated, row_sharding
from jgrpo.rl.diagnostics import combine_metrics, extreme_kind
from jgrpo.rl.routing_replay import forward_metrics, routing_metrics
from jgrpo.sampling.layout import routing_record
from jgrpo.training.layout import LayoutPlans, MinibatchSums
from jgrpo.training.packed_passes import (
    PackedBatch,
    PackingTarget,
    data_shards,
    on_rows_in_use,
    pack_batch,
    pack_minibatches,
    packed_shapes,
    predicting_states,
    row_buckets,
)
from jgrpo.training.packing import PackingPlan, unpack
from jgrpo.training.step_batch import StepBatch
from jgrpo.training.step_model import Forward, StepModel, forward_of
from jgrpo.training.step_options import StepOptions


class PackedLayout:
    """Completions end to end in packed micro-batches; the passes' plan covers the batch, the update's each
    minibatch."""

    def __init__(self, model: StepModel, options: StepOptions):
        self.model, self.grpo, self.new_tokens = model, options.grpo, options.new_tokens
        self.row_buckets, self.routing_replay = options.packing_row_buckets, options.routing_replay
        self.target = PackingTarget(model.mesh, model.rules, options.chunks, options.packing_width,
                                    options.grpo.num_generations)

    def plan_passes(self, prompt_tokens, prompt_mask, samples, batch: StepBatch) -> PackedBatch:
        """The log-prob passes' plan: the batch's completions and prompts as packed micro-batches."""
        return pack_batch(self.target, prompt_tokens, prompt_mask, samples.tokens, samples.completion_mask,
                          batch.routing if self.routing_replay else None)

    def plan_update(self, batch: StepBatch) -> PackedBatch:
        """The update's plan: each minibatch of the (dealt) batch packed alone, fields [M, U, ...]."""
        return pack_minibatches(self.target, batch, self.grpo.num_minibatches)

    def logprobs(self, params, batch: StepBatch, plan: PackedBatch, kind: str) -> jax.Array:
        """[C, r, N] log-probs of the batch's rows from the packed micro-batches of `plan` (`plan_passes`), 0 where
        no token (the batch itself gives only its shape)."""
        C, r = batch.targets.shape[:2]
        model = self.model.of(params)
        shards = data_shards(self.model.mesh, self.model.rules, C, C * r)  # as pack_batch dealt the groups
        fields = plan._replace(count=None)

        def logprobs(micro):
            hidden = predicting_states(model, micro, self.routing_replay, shards, on_rows=self._on_rows)
            return self.model.token_logprobs(model, hidden, micro.tokens, kind)[0]

        def one(u, lp):
            micro = self._micro(fields, u)
            return lp.at[u].set(on_rows_in_use(logprobs, micro, self.row_buckets, shards, self._on_rows,
                                               rows_out=True))

        # Only the micro-batches that hold tokens: a loop with a traced trip count over the fixed buffer.
        lp = jax.lax.fori_loop(0, plan.count, one, jnp.zeros(plan.tokens.shape, jnp.float32))
        out = unpack(lp, PackingPlan(plan.row, plan.index, plan.segment, 0), C * r, self.new_tokens)
        return self.model.rows(out.reshape(C, r, self.new_tokens))

    def gradients(self, params, frozen, mb: StepBatch, plan: PackedBatch, minibatch, objective) -> MinibatchSums:
        """Minibatch `minibatch`'s packed micro-batches (`plan`: `plan_update`'s, every minibatch's), each
        `objective(forward, rows, share, covered)`'s gradient over the minibatch's rows `mb` [U, r, ...] it covers."""
        rows = jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), mb)  # the minibatch's [n, ...] rows
        plan = jax.tree.map(lambda x: x[minibatch], plan)
        count, fields = plan.count, plan._replace(count=None)
        shards = self._update_shards(rows)

        def loss(params, micro):
            return objective(self._forward(join_adapters(params, frozen), rows, micro), rows, count, micro.owns)

        grad_fn = jax.value_and_grad(loss, has_aux=True)

        def micro_step(u, carry):
            grads, total, metrics = carry
            micro = self._micro(fields, u)
            (micro_loss, micro_metrics), g = on_rows_in_use(lambda m: grad_fn(params, m), micro, self.row_buckets,
                                                            shards, self._on_rows)
            return jax.tree.map(jnp.add, grads, g), total + micro_loss, combine_metrics(metrics, micro_metrics)

        first = jax.tree.map(lambda x: x[0], fields)
        shapes = jax.eval_shape(grad_fn, params, first)[0][1]
        identity = {"min": jnp.inf, "max": -jnp.inf, None: 0.0}
        empty = {key: jnp.full(x.shape, identity[extreme_kind(key)], x.dtype) for key, x in shapes.items()}
        zeros = jax.tree.map(jnp.zeros_like, params)
        grads, total, metrics = jax.lax.fori_loop(0, count, micro_step, (zeros, jnp.float32(0.0), empty))
        buckets = row_buckets(plan.tokens.shape[1] // shards, self.row_buckets)
        return MinibatchSums(grads, total, metrics, _packing_metrics(plan, buckets, shards))

    def abstract_plans(self, prompts: int, prompt_width: int, micro_batches: int | None = None) -> LayoutPlans:
        """The plans as the programs receive them (`packed_passes.packed_shapes`, placed on the data shards as
        `pack_batch` / `pack_minibatches` place them) for batches of `prompts` prompts `prompt_width` wide: the
        passes' (the whole batch) and the update's (each minibatch), and the micro-batches each program's loop is
        costed at: `micro_batches` per minibatch (default grpo.micro_batches, as padded), at most the buffer."""
        g, mesh, rules = self.grpo, self.model.mesh, self.model.rules
        R, M, N = prompts * g.num_generations, g.num_minibatches, self.new_tokens
        record = routing_record(self.model.cfg)  # (L, k, dtype) of a mixture of experts' record, else None

        def placed(plan, row_axis):
            return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=row_sharding(
                mesh, rules, x.shape, row_axis=row_axis) if len(x.shape) > row_axis else replicated(mesh)), plan)

        whole = self.target.sizes(R, N, prompt_width, groups=prompts)
        minibatch = self.target.sizes(R, N, prompt_width, groups=prompts // M)
        per_minibatch = micro_batches or g.micro_batches
        return LayoutPlans(passes=placed(packed_shapes(whole, R, record if self.routing_replay else None), 1),
                           update=placed(packed_shapes(minibatch, R // M, record, minibatches=M), 2),
                           passes_trips=min(per_minibatch * M, whole.micro_batches),
                           update_trips=min(per_minibatch, minibatch.micro_batches))

    def _forward(self, params, rows: StepBatch, micro: PackedBatch) -> Forward:
        """One packed micro-batch's forward, its log-probs scattered to the minibatch's [n, N] `rows`."""
        model = self.model.of(params)
        shards = self._update_shards(rows)
        G, moe = self.grpo.num_generations, bool(self.model.cfg.num_experts)
        out = predicting_states(model, micro, self.routing_replay, shards, G, self.new_tokens if moe else None,
                                self._on_rows)
        hidden, chosen, router = out if moe else (out, None, None)
        logprobs = self.model.token_logprobs(model, hidden, micro.tokens, "sampled", self.grpo.beta > 0)
        n, N = rows.targets.shape
        unpacked = tuple(unpack(x, PackingPlan(micro.row, micro.index, micro.segment, 0), n, N) for x in logprobs)
        return forward_of(unpacked, {} if router is None else _router_metrics(router, chosen, micro, G))

    def _on_rows(self, x):
        """Activations [rows, ...] of a packed micro-batch with their rows on the data shards. Without it XLA kept
        the FSDP-split hidden dimension split and replicated the rows in the packed layer stack (a TPU plan of the
        GSM8K config: 45.5 GiB of temporaries on a 16 GiB v5e; with it 12.4 GiB live, benchmarks/packed_plan.py)."""
        return self.model.rows(x, row_axis=0)

    def _micro(self, fields: PackedBatch, u) -> PackedBatch:
        """Packed micro-batch `u` of a plan's fields, its rows (axis 0) on the data shards the plan dealt them to."""
        micro = jax.tree.map(lambda x: self._on_rows(x[u]), fields._replace(owns=None, rows_used=None))
        return micro._replace(owns=fields.owns[u], rows_used=fields.rows_used[u])

    def _update_shards(self, rows: StepBatch) -> int:
        """D of the update's packed rows (as `pack_minibatches` dealt them): from the minibatch's `rows`."""
        return data_shards(self.model.mesh, self.model.rules, self.target.chunks,
                           rows.targets.shape[0] * self.grpo.num_minibatches)


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
