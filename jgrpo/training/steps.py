"""The jitted numeric core of a GRPO iteration: batch assembly, log-probs, and one optimiser step.

Everything here is a pure function of arrays and param pytrees, compiled once per run with explicit
shardings over the mesh (shapes are fixed: B prompts x G samples, the run's prompt width P and
max_new_tokens N), so iterations after the first never recompile.

Row layout: the R = B*G completion rows are cut into C = num_minibatches * micro_batches chunks of r
rows, stacked on a leading unsharded axis [C, r, ...] whose rows are sharded over the data-parallel mesh
axes. Minibatch m is chunks [m*U, (m+1)*U) (U = micro_batches): a slice of the leading axis, local on
every device, and each micro-batch spans all devices.

Sequences are [prompt (left-padded, P) | completion (N)]; the model reads all but the last token and the
hidden state at slot P-1+j predicts completion token j. The G rows of a group are consecutive and share
their prompt, so with `share_prompts` (and chunks of whole groups) the model computes each prompt once
(`models.shared_prompt`).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding

from jgrpo.config import GRPOConfig
from jgrpo.models.attention_backends import mesh_context_factory
from jgrpo.models.llm import abstract_model, merge_model, model_config, param_logical_axes, position_ids_from_mask
from jgrpo.models.lora import is_adapter, join_adapters, without_lora
from jgrpo.models.shared_prompt import forward_shared_prompts
from jgrpo.parallel.host_arrays import fetch
from jgrpo.parallel.mesh import (
    TRAIN_RULES,
    Rules,
    logical_shardings,
    logical_to_spec,
    replicated,
    row_sharding,
)
from jgrpo.parallel.weights.copies import param_copier
from jgrpo.rl.advantages import GroupAdvantages, group_advantages
from jgrpo.rl.corrections import m2po_drop
from jgrpo.rl.diagnostics import extreme_kind, finalize_metrics
from jgrpo.rl.logprobs import token_logprobs
from jgrpo.rl.lp_k import lp_k_source
from jgrpo.rl.objectives import grpo_loss, step_has_signal, step_normaliser
from jgrpo.rl.routing_replay import forward_metrics, sampler_ran, sequence_routing
from jgrpo.sampling.methods import SamplingMethod
from jgrpo.sampling.state import SampleOutput
from jgrpo.training.packed_steps import PackedSteps


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


def _stack_sum(metrics: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """Reduce micro-batch accumulators stacked on axis 0 (extremes by min / max, everything else by sum)."""
    reduce = {"min": jnp.min, "max": jnp.max, None: jnp.sum}
    return {key: reduce[extreme_kind(key)](value, axis=0) for key, value in metrics.items()}


class _InContext:
    """A jitted function called and lowered inside `context()` (where its tracing must happen)."""

    def __init__(self, jitted, context):
        self.jitted, self.context = jitted, context

    def __call__(self, *args, **kwargs):
        with self.context():
            return self.jitted(*args, **kwargs)

    def lower(self, *args, **kwargs):
        with self.context():
            return self.jitted.lower(*args, **kwargs)


class StepOptions(NamedTuple):
    """What the step functions compute, besides the model, its params and the mesh."""

    grpo: GRPOConfig  # the objective and the loop's shape
    method: SamplingMethod  # the sampler's: the log-probs process the logits as it does
    logprob_chunk: int  # positions per log-prob chunk (`rl.logprobs`)
    new_tokens: int  # N, the sampler's max_new_tokens
    share_prompts: bool = True  # compute each prompt once for its group (`models.shared_prompt`)
    skip_empty_steps: bool = True  # a step with nothing in the loss changes nothing
    reward_weights: tuple[float, ...] | None = None  # of the reward table's columns (per-reward advantages)
    on_policy: bool | None = None  # the sampling params are always pi_k (`Config.samples_on_policy`)
    routing_replay: bool = False  # a mixture of experts' forwards use the sampler's experts (`model.routing_replay`)
    router_loss_coefs: tuple[float, float] = (0.0, 0.0)  # load balance, z (`model.router_*_loss_coef`)
    packing: bool = False  # the log-prob passes over packed micro-batches (`model.packing`, `packed_passes`)
    packing_width: int = 0  # W of a packed row (`model.packing_width`; 0: max_new_tokens rounded up to 8)
    packing_row_buckets: tuple[float, ...] = ()  # `model.packing_row_buckets`: () = every packed row computed


class StepFunctions(PackedSteps):
    """The jitted functions of one run, closed over its static configuration and shardings.

    Shapes (B, P) come from the arguments, so a new prompt width compiles new programs once; the trainer
    keeps the width fixed after the first batch (see `Trainer`).
    """

    def __init__(self, *, graphdef, params, mesh: Mesh, optimizer: optax.GradientTransformation,
                 options: StepOptions, rules: Rules = TRAIN_RULES, frozen: dict | None = None):
        """`params` are what trains (with LoRA the adapters only); `frozen` is the LoRA base, passed to every
        program that runs the model (`jgrpo.models.frozen_base`), never trained, donated or copied."""
        o = options
        grpo = o.grpo
        self.graphdef, self.mesh, self.grpo, self.optimizer = graphdef, mesh, grpo, optimizer
        self.reward_weights = o.reward_weights  # of the reward table's columns (per-reward advantages only)
        self.method, self.chunk, self.new_tokens = o.method, o.logprob_chunk, o.new_tokens
        self.share_prompts, self.skip_empty_steps, self.rules = o.share_prompts, o.skip_empty_steps, rules
        self.routing_replay, self.router_loss_coefs = o.routing_replay, o.router_loss_coefs
        self.packing, self.packing_width, self.packing_row_buckets = o.packing, o.packing_width, o.packing_row_buckets
        self.chunks = grpo.num_minibatches * grpo.micro_batches
        self.lp_k_source = lp_k_source(grpo, o.on_policy)
        # Log-probs shard the vocabulary over the axes that shard the weights (`token_logprobs`): rows over the
        # data axis only, vocabulary over fsdp and tensor. Constraints where a dimension does not divide are
        # dropped by logical_to_spec (then XLA chooses, as without them).
        vocab_rules = {"batch": "data", "length": None, "embed": None, "vocab": ("fsdp", "tensor")}
        self.vocab_parallel = (("embed", "vocab"), ("batch", "length", "vocab"), vocab_rules)
        self.param_shardings = logical_shardings(param_logical_axes(params), mesh, rules, shapes=params)
        abstract_opt = jax.eval_shape(optimizer.init, params)
        self.opt_shardings = optax.tree_map_params(
            optimizer, lambda _, sharding: sharding, abstract_opt, self.param_shardings,
            transform_non_params=lambda _: replicated(mesh),
        )
        cfg = model_config(graphdef, join_adapters(params, frozen))
        self.num_experts = cfg.num_experts
        # The reference of a LoRA run is the base alone: the same model without adapter leaves.
        self.base_graphdef = abstract_model(without_lora(cfg))[0] if cfg.lora_rank else None
        # Programs that run the model are traced in the mesh context where the attention kernel needs it.
        context = mesh_context_factory(cfg, mesh)
        self.init_opt_state = jax.jit(optimizer.init, out_shardings=self.opt_shardings)
        # A real copy (new buffers) even where layouts agree: the original is donated to the next update.
        self.copy_params = param_copier(self.param_shardings)
        self.assemble = jax.jit(self._assemble)
        self.logprobs = _InContext(jax.jit(functools.partial(self._all_logprobs, kind="sampled")), context)
        self.reference_logprobs = _InContext(jax.jit(functools.partial(self._all_logprobs, kind="kl")), context)
        self.logprobs_packed, self.reference_logprobs_packed = (_InContext(jax.jit(functools.partial(
            self._all_logprobs_packed, kind=kind), static_argnames="rows"), context) for kind in ("sampled", "kl"))
        self.shuffle_groups = jax.jit(self._shuffle_groups)
        self.m2po_mask = jax.jit(self._m2po_mask)
        self.train_step, self.train_step_packed = (_InContext(jax.jit(
            step, out_shardings=(self.param_shardings, self.opt_shardings, None), donate_argnums=(0, 1),
        ), context) for step in (self._train_step, self._train_step_packed))

    def check_rows(self, rows: int) -> None:
        if rows % self.chunks:
            raise ValueError(
                f"data.batch_size * grpo.num_generations = {rows} rows cannot be split into "
                f"grpo.num_minibatches * grpo.micro_batches = {self.chunks} equal parts"
            )

    def _rows(self, x: jax.Array) -> jax.Array:
        """Constrain a chunked [C, r, ...] array: rows over the data-parallel axes (when they divide r)."""
        return jax.lax.with_sharding_constraint(x, row_sharding(self.mesh, self.rules, x.shape, row_axis=1))

    # ------------------------------------------------------------------ batch

    def build(self, prompt_tokens, prompt_mask, samples: SampleOutput, rewards, *, reference, current,
              frozen=None) -> StepBatch:
        """The update's batch: the prompts [B, P], the sampler's record of their rows and the reward table, with
        the log-probs of the `reference` params (beta > 0) and of the `current` ones (pi_k, when `lp_k_source` is
        "computed"), and M2PO's token mask. Every program on the train mesh. With LoRA, `reference` and `current`
        are adapters (the reference may have none) and `frozen` the base they join."""
        # How often rows were preempted is a statistic of the sampler (the iteration record's), not training data:
        # the programs take the same inputs whatever the sampler did (the planner lowers them without it).
        batch, _ = self.assemble(prompt_tokens, prompt_mask, samples._replace(preempted=None), rewards)
        passes = self.grpo.beta > 0 or self.lp_k_source == "computed"
        packed = self.pack(prompt_tokens, prompt_mask, samples, batch) if self.packing and passes else None
        rows = samples.tokens.shape[0]

        def logprobs(params, padded, packed_pass):
            return padded(params, batch) if packed is None else packed_pass(params, packed, rows=rows)

        if self.grpo.beta > 0:
            batch = batch._replace(lp_ref=logprobs(join_adapters(reference, frozen), self.reference_logprobs,
                                                   self.reference_logprobs_packed))
        if self.lp_k_source == "computed":
            batch = batch._replace(lp_k=logprobs(join_adapters(current, frozen), self.logprobs,
                                                 self.logprobs_packed))
        if self.grpo.m2po_tau is not None:
            batch = batch._replace(m2po_drop=self.m2po_mask(batch))
        return jax.block_until_ready(batch)

    def update(self, params, opt_state, batch: StepBatch, shuffle_key=None, frozen=None):
        """grpo.inner_steps passes over `batch`, each grpo.num_minibatches optimiser steps (params and optimiser
        state donated to each); with `shuffle_key`, whole groups are re-dealt to the minibatches at every inner
        step after the first. Returns (params, optimiser state, each step's metrics on the host)."""
        g = self.grpo
        metrics = []
        for inner in range(g.inner_steps):
            dealt = batch
            if inner and shuffle_key is not None:
                dealt = self.shuffle_groups(batch, jax.random.fold_in(shuffle_key, inner))
            packed = self.pack_minibatches(dealt) if self.packing else None
            for minibatch in range(g.num_minibatches):
                first = inner == 0 and minibatch == 0
                step = self.train_step if packed is None else functools.partial(self.train_step_packed,
                                                                                   packed=packed)
                params, opt_state, m = step(params, opt_state, dealt, jnp.int32(minibatch), jnp.bool_(first),
                                            frozen=frozen)
                metrics.append(m)
        return params, opt_state, fetch(metrics)

    def _assemble(self, prompt_tokens, prompt_mask, samples: SampleOutput, rewards):
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
            return self._rows(x.reshape((C, R // C) + x.shape[1:]))

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
            lengths=chunked(samples.completion_mask.sum(axis=1).astype(jnp.int32)) if self.packing else None,
        )
        return batch, adv

    # -------------------------------------------------------------- log-probs

    def _predicting_states(self, model, micro: StepBatch, new_tokens: int):
        """(the hidden states at slots P-1 ... P+N-2 [r, N, D], which predict completion tokens 0 ... N-1; the
        experts the router picks at every input position [r, P+N-1, L, k] and its `RouterStats`, None and None for
        a dense model). With routing replay the forward sends each token to `micro.routing`'s experts instead."""
        inputs, input_mask, positions = micro.inputs, micro.input_mask, micro.positions
        replay = micro.routing if self.routing_replay else None
        rows, P = inputs.shape[0], inputs.shape[1] + 1 - new_tokens
        G, stats = self.grpo.num_generations, bool(self.num_experts)
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

    def _sequence_logprobs(self, params, micro: StepBatch, *, kind: str = "sampled", with_kl: bool = False):
        """Per-token [r, N] log-probs of `micro.targets` under `params` (docs/algorithm.md §6), and for a mixture
        of experts the forward's router losses and routing metrics (`rl.routing_replay`; else an empty dict).

        kind "sampled": (lp, entropy) under the sampling method's distribution (truncated like the sampler's),
        plus, `with_kl` and a truncating method, the untruncated tempered log-probs for the KL term.
        kind "kl": (untruncated tempered lp, entropy), what the reference contributes to the KL.
        """
        model = self._model(params)
        targets = micro.targets
        hidden, chosen, router = self._predicting_states(model, micro, targets.shape[1])
        logprobs = self._token_logprobs(model, hidden, targets, kind, with_kl)
        if router is None:
            return logprobs, {}
        ran = sampler_ran(micro.input_mask, micro.completion_mask[:, -1], micro.inputs.shape[1] + 1 - targets.shape[1])
        return logprobs, forward_metrics(router, chosen, micro.routing, ran)

    def _model(self, params):
        """The model of `params` (a LoRA run's reference, without adapters, is the base model)."""
        adapters = any(is_adapter(name) for name in params["layers"])
        return merge_model(self.graphdef if adapters or self.base_graphdef is None else self.base_graphdef, params)

    def _token_logprobs(self, model, hidden, targets, kind: str, with_kl: bool = False):
        """`rl.logprobs.token_logprobs` of `targets` [r, T] from the `hidden` states predicting them [r, T, D] (see
        `_sequence_logprobs` for `kind`), the vocabulary sharded as the weights."""
        tempered = self.method.tempered_logprobs
        process = tempered if kind == "kl" else self.method.process_logits
        untruncated = tempered if kind == "sampled" and with_kl and self.method.truncates else None
        unembedding = model.unembedding()
        table, logits, rules = self.vocab_parallel
        shapes = (unembedding.shape, (hidden.shape[0], self.chunk, unembedding.shape[1]))
        vocab_parallel = tuple(NamedSharding(self.mesh, logical_to_spec(names, rules, shape, self.mesh))
                               for names, shape in zip((table, logits), shapes, strict=True))
        return token_logprobs(hidden, unembedding, targets, chunk=self.chunk, process_logits=process,
                              untruncated=untruncated, compute_dtype=model.cfg.compute_dtype,
                              vocab_parallel=vocab_parallel)

    def _all_logprobs(self, params, batch: StepBatch, kind: str):
        """[C, r, N] log-probs of every chunk (one chunk at a time: the memory of one micro-batch)."""
        return self._rows(jax.lax.map(lambda micro: self._sequence_logprobs(params, micro, kind=kind)[0][0], batch))

    def _m2po_mask(self, batch: StepBatch) -> jax.Array:
        """[C, r, N] bool: M2PO's dropped tokens, decided over the whole batch (needs `batch.lp_k`)."""
        in_loss_tokens = batch.completion_mask & batch.adv.in_loss[..., None].astype(bool)
        return self._rows(m2po_drop(batch.lp_k, batch.lp_alpha, in_loss_tokens, self.grpo.m2po_tau))

    def _shuffle_groups(self, batch: StepBatch, key) -> StepBatch:
        """The batch with its groups dealt to the chunks in a random order (a group's G rows stay together and
        in order, so minibatches hold whole groups and the shared-prompt forward still applies)."""
        G = self.grpo.num_generations

        def permute(x):  # [C, r, ...] -> same shape, whole groups moved
            flat = x.reshape((-1, G) + x.shape[2:])  # [R/G, G, ...]
            order = jax.random.permutation(key, flat.shape[0])
            return self._rows(flat[order].reshape(x.shape))

        return jax.tree.map(permute, batch)

    # ------------------------------------------------------------------ update

    def _loss(self, params, micro: StepBatch, norm, first_update, frozen=None):
        (lp, entropy, *lp_kl), routing = self._sequence_logprobs(join_adapters(params, frozen), micro,
                                                                 with_kl=self.grpo.beta > 0)
        return self._objective(lp, entropy, lp_kl, routing, micro, norm, first_update, self.grpo.micro_batches)

    def _objective(self, lp, entropy, lp_kl, routing, micro: StepBatch, norm, first_update, micro_batches,
                   rows=None):
        """The loss of one micro-batch given its forward's log-probs [r, N] (`lp` with gradient, `entropy`, and in
        a list the KL's if any) and router metrics, with `micro`'s fields (its `rows` only, None for all); the
        router losses count as a share of the step's `micro_batches`."""
        own = jax.lax.stop_gradient(lp)
        if self.lp_k_source == "computed":
            later = micro.lp_k
        elif self.lp_k_source == "behaviour":
            later = micro.lp_alpha
        else:
            later = own
        lp_k = jnp.where(first_update, own, later)
        # lp itself stands in for the trainer's behaviour log-probs: the host keeps that mismatch metric only
        # for updates where the current params are the behaviour params (first update after a refresh).
        loss, metrics = grpo_loss(lp, micro.lp_alpha, lp_k, micro.lp_ref, micro.adv, micro.completion_mask, norm,
                                  self.grpo, entropy=entropy, lp_behaviour_trainer=lp,
                                  lp_kl=lp_kl[0] if lp_kl else None, m2po_drop=micro.m2po_drop, rows=rows)
        if "router_aux_loss" in routing:  # a micro-batch's share: the step's value is the micro-batches' mean
            for name, coef in zip(("router_aux_loss", "router_z_loss"), self.router_loss_coefs, strict=True):
                routing[name] = routing[name] / micro_batches
                loss = loss + coef * routing[name] if coef else loss
        return loss, {**metrics, **routing}

    def _minibatch(self, batch: StepBatch, minibatch):
        """Minibatch `minibatch`'s chunks [U, r, ...] of the batch, and its `step_normaliser`."""
        U = self.grpo.micro_batches
        mb = jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(x, minibatch * U, U, axis=0), batch)
        norm = step_normaliser(mb.completion_mask.reshape(-1, mb.completion_mask.shape[-1]),
                               mb.adv.in_loss.reshape(-1), self.grpo, max_new_tokens=self.new_tokens)
        return mb, norm

    def _train_step(self, params, opt_state, batch: StepBatch, minibatch, first_update, frozen=None):
        """One optimiser step on minibatch `minibatch` (traced), accumulating gradients over its micro-batches.

        Gradients and the optimiser cover `params` only; `frozen` (the LoRA base) goes into the forward unchanged.
        """
        mb, norm = self._minibatch(batch, minibatch)
        grad_fn = jax.value_and_grad(self._loss, has_aux=True)

        def micro_step(grads, micro):
            (loss, metrics), g = grad_fn(params, micro, norm, first_update, frozen)
            return jax.tree.map(jnp.add, grads, g), (loss, metrics)

        zeros = jax.tree.map(jnp.zeros_like, params)
        grads, (losses, metrics) = jax.lax.scan(micro_step, zeros, mb)
        return self._apply(params, opt_state, grads, losses.sum(), _stack_sum(metrics), mb, norm, first_update)

    def _apply(self, params, opt_state, grads, loss, metrics, mb: StepBatch, norm, first_update):
        """The optimiser step with a minibatch's summed gradients, loss and metric accumulators.

        A non-finite loss or gradient norm leaves params and optimiser state untouched (the step is skipped
        and reported in the metrics as `nonfinite` = 1). So does, with `skip_empty_steps`, a step with nothing
        in the loss (`empty` = 1; `objectives.step_has_signal`): its gradient is 0, but AdamW would still move
        along its momentum and count the step in its schedule.
        `lp_k_exact` = 1 flags the updates whose lp_k is the real pi_k (see `lp_k_source`).
        """
        grad_norm = optax.tree.norm(grads)
        updates, new_opt_state = self.optimizer.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        has_signal = step_has_signal(mb.adv, norm, self.grpo)
        apply = finite & has_signal if self.skip_empty_steps else finite
        keep = functools.partial(jnp.where, apply)
        params = jax.tree.map(keep, new_params, params)
        opt_state = jax.tree.map(keep, new_opt_state, opt_state)
        out = finalize_metrics(metrics)
        lp_k_exact = jnp.logical_or(first_update, self.lp_k_source != "self")
        out.update(grad_norm=grad_norm, nonfinite=(~finite).astype(jnp.float32),
                   empty=(~has_signal).astype(jnp.float32), lp_k_exact=lp_k_exact.astype(jnp.float32))
        return params, opt_state, out
