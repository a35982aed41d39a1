"""One iteration's training data, the `StepBatch`: assembled from the sampler's record and the rewards, its groups
re-dealt between inner steps, and described without data for the planner.

Row layout: the R = B*G completion rows are cut into C = num_minibatches * micro_batches chunks of r rows, stacked on
a leading unsharded axis [C, r, ...] whose rows are sharded over the data-parallel mesh axes. Minibatch m is chunks
[m*U, (m+1)*U) (U = micro_batches): a slice of the leading axis, local on every device, and each micro-batch spans
all devices.

Sequences are [prompt (left-padded, P) | completion (N)]; the model reads all but the last token and the hidden state
at slot P-1+j predicts completion token j. The G rows of a group are consecutive and share their prompt.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jgrpo.models.llm import position_ids_from_mask
from jgrpo.parallel.mesh import row_sharding
from jgrpo.rl.advantages import GroupAdvantages, group_advantages
from jgrpo.rl.routing_replay import sequence_routing
from jgrpo.sampling.layout import routing_record
from jgrpo.sampling.state import SampleOutput
from jgrpo.training.step_model import StepModel
from jgrpo.training.step_options import StepOptions


class StepBatch(NamedTuple):
    """One iteration's training data, [C, r, ...] (see the module doc). lp_k / lp_ref are None when unused."""

    inputs: jax.Array  # [C, r, P+N-1] int32: prompt and completion tokens but the last
    input_mask: jax.Array  # [C, r, P+N-1] bool: real tokens (left padding and post-stop padding False)
    positions: jax.Array  # [C, r, P+N-1] int32
    targets: jax.Array  # [C, r, N] int32: the completion tokens
    completion_mask: jax.Array  # [C, r, N] bool: the tokens in the loss (the sampler drew them)
    lp_alpha: jax.Array  # [C, r, N] float32: behaviour log-probs recorded by the sampler
    adv: GroupAdvantages  # fields [C, r]
    lp_k: jax.Array | None = None  # [C, r, N] float32
    lp_ref: jax.Array | None = None  # [C, r, N] float32
    m2po_drop: jax.Array | None = None  # [C, r, N] bool: the tokens M2PO drops (`corrections.m2po_drop`)
    # [C, r, P+N-1, L, k] uint8 / int16 (a mixture of experts): the experts the sampler ran each input position through
    # (`rl.routing_replay`); replayed by every forward with `routing_replay`, else only compared with.
    routing: jax.Array | None = None
    lengths: jax.Array | None = None  # [C, r] int32: each completion's real tokens (the packed update plans by them)


class StepInputs(NamedTuple):
    """What a step batch is assembled from: the prompts [B, P], the sampler's record of their R = B*G rows, and the
    reward table [R, 1 + F] (the total, then each reward's column) or the totals [R]."""

    prompt_tokens: jax.Array
    prompt_mask: jax.Array
    samples: SampleOutput
    rewards: jax.Array


class BatchAssembly:
    """Step batches of one run: from its options (the objective, the chunks, the reward weights, the layout)."""

    def __init__(self, model: StepModel, options: StepOptions):
        self.model, self.grpo, self.chunks = model, options.grpo, options.chunks
        self.reward_weights, self.new_tokens = options.reward_weights, options.new_tokens
        self.lengths = options.packing  # the packed update plans its minibatches from each completion's length

    def check_rows(self, rows: int) -> None:
        if rows % self.chunks:
            raise ValueError(
                f"data.batch_size * grpo.num_generations = {rows} rows cannot be split into "
                f"grpo.num_minibatches * grpo.micro_batches = {self.chunks} equal parts"
            )

    def assemble(self, prompt_tokens, prompt_mask, samples: SampleOutput, rewards):
        """Sampler record + rewards -> StepBatch (without lp_k / lp_ref) and the flat advantages.

        The record's tokens follow the prompts (its completion mask marks the real ones); its loss mask (the tokens
        the sampler drew) is what the loss sums over, with lp_alpha their log-probs. `rewards` is [R] (the total)
        or the reward table [R, 1 + F] (the total, then each column of `reward_weights`, which per-reward
        advantages need); rows the sampler truncated leave the loss with `grpo.overlong_filter`.
        """
        tokens, completion_mask, truncated = samples.tokens, samples.completion_mask, samples.truncated
        R, B = tokens.shape[0], prompt_tokens.shape[0]
        G, C = R // B, self.chunks
        seq = jnp.concatenate([jnp.repeat(prompt_tokens, G, axis=0), tokens], axis=1)  # [R, P+N]
        mask = jnp.concatenate([jnp.repeat(prompt_mask, G, axis=0), completion_mask], axis=1)  # [R, P+N]
        positions = position_ids_from_mask(mask)  # completion token j sits at prompt_len + j, as when sampled
        table = rewards if rewards.ndim == 2 else rewards[:, None]
        # Over the whole batch, before any chunking.
        adv = group_advantages(table[:, 0], self.grpo, components=table[:, 1:], weights=self.reward_weights,
                               valid=samples.valid)
        if self.grpo.overlong_filter:
            adv = adv._replace(in_loss=adv.in_loss & ~truncated.astype(bool))

        def chunked(x):  # [R, ...] -> [C, R/C, ...]
            return self.model.rows(x.reshape((C, R // C) + x.shape[1:]))

        routing = None
        if samples.routing is not None:
            routing = chunked(sequence_routing(samples.prompt_routing, samples.routing, prompt_tokens.shape[1]))

        batch = StepBatch(
            inputs=chunked(seq[:, :-1]),
            input_mask=chunked(mask[:, :-1]),
            positions=chunked(positions[:, :-1]),
            targets=chunked(tokens),
            completion_mask=chunked(samples.loss_mask),
            lp_alpha=chunked(samples.logprobs.astype(jnp.float32)),
            adv=GroupAdvantages(*(chunked(x) for x in adv)),
            routing=routing,
            lengths=chunked(samples.completion_mask.sum(axis=1).astype(jnp.int32)) if self.lengths else None,
        )
        return batch, adv

    def abstract_inputs(self, prompts: int, prompt_width: int, reward_columns: int, valid: bool) -> StepInputs:
        """`StepInputs` of `prompts` prompts `prompt_width` wide as `jax.ShapeDtypeStruct`s on the run's mesh (the
        planner's): the reward table's `reward_columns` (1 + the rewards, or 1), the record's `valid` rows (multi-turn
        episodes) if any, and a mixture of experts' routing record."""
        R, P, N = prompts * self.grpo.num_generations, prompt_width, self.new_tokens

        def rows(shape, dtype):
            return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype),
                                        sharding=row_sharding(self.model.mesh, self.model.rules, shape))

        record = routing_record(self.model.cfg)  # (L, k, dtype) of a mixture of experts' record, else None
        samples = SampleOutput(
            tokens=rows((R, N), jnp.int32), logprobs=rows((R, N), jnp.float32), completion_mask=rows((R, N), bool),
            lengths=rows((R,), jnp.int32), truncated=rows((R,), bool), loss_mask=rows((R, N), bool),
            version=rows((R, N), jnp.int32), valid=rows((R,), bool) if valid else None,
            routing=None if record is None else rows((R, N, *record[:2]), record[2]),
            prompt_routing=None if record is None else rows((R, P, *record[:2]), record[2]))
        return StepInputs(rows((prompts, P), jnp.int32), rows((prompts, P), bool), samples,
                          rows((R, reward_columns), jnp.float32))


def shuffle_groups(batch: StepBatch, key, group_size: int, place) -> StepBatch:
    """The batch with its groups (of `group_size` consecutive rows) dealt to the chunks in a random order: a group's
    rows stay together and in order, so minibatches hold whole groups and the shared-prompt forward still applies.
    `place` constrains a [C, r, ...] array's rows (`StepModel.rows`)."""

    def permute(x):  # [C, r, ...] -> same shape, whole groups moved
        flat = x.reshape((-1, group_size) + x.shape[2:])  # [R/G, G, ...]
        order = jax.random.permutation(key, flat.shape[0])
        return place(flat[order].reshape(x.shape))

    return jax.tree.map(permute, batch)
