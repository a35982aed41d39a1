"""The jitted numeric core of a GRPO iteration, composed: batch assembly, the log-prob passes, and the update.

Everything here is a pure function of arrays and param pytrees, compiled once per run with explicit shardings over
the mesh (shapes are fixed: B prompts x G samples, the run's prompt width P and max_new_tokens N), so iterations
after the first never recompile. `StepFunctions` builds the parts of one run from its `StepOptions`:

    assembly   the step batch from the sampler's record and the rewards (`step_batch`: its row layout)
    layout     how the model runs over the batch: padded (`padded_layout`) or packed (`packed_layout`,
               `model.packing`), one object both other parts are given
    passes     the log-prob passes before the update: the reference's, pi_k's, M2PO's mask (`logprob_passes`)
    updates    the optimiser steps over the batch (`update_steps`)

and the trainer calls two of them: `build` (assembly and passes) and `update`.
"""

from __future__ import annotations

import jax
import optax
from jax.sharding import Mesh

from jgrpo.models.llm import model_config, param_logical_axes
from jgrpo.models.lora import join_adapters
from jgrpo.parallel.mesh import TRAIN_RULES, Rules, logical_shardings, replicated
from jgrpo.parallel.weights.copies import param_copier
from jgrpo.sampling.state import SampleOutput
from jgrpo.training.logprob_passes import LogprobPasses
from jgrpo.training.packed_layout import PackedLayout
from jgrpo.training.padded_layout import PaddedLayout
from jgrpo.training.step_batch import BatchAssembly, StepBatch
from jgrpo.training.step_model import StepModel
from jgrpo.training.step_options import StepOptions
from jgrpo.training.update_steps import UpdateSteps


class StepFunctions:
    """The jitted functions of one run, closed over its static configuration and shardings.

    Shapes (B, P) come from the arguments, so a new prompt width compiles new programs once; the trainer
    keeps the width fixed after the first batch (see `Trainer`).
    """

    def __init__(self, *, graphdef, params, mesh: Mesh, optimizer: optax.GradientTransformation,
                 options: StepOptions, rules: Rules = TRAIN_RULES, frozen: dict | None = None):
        """`params` are what trains (with LoRA the adapters only); `frozen` is the LoRA base, passed to every
        program that runs the model (`jgrpo.models.frozen_base`), never trained, donated or copied."""
        self.param_shardings = logical_shardings(param_logical_axes(params), mesh, rules, shapes=params)
        abstract_opt = jax.eval_shape(optimizer.init, params)
        self.opt_shardings = optax.tree_map_params(
            optimizer, lambda _, sharding: sharding, abstract_opt, self.param_shardings,
            transform_non_params=lambda _: replicated(mesh),
        )
        self.model = StepModel(graphdef, model_config(graphdef, join_adapters(params, frozen)), mesh, rules, options)
        self.assembly = BatchAssembly(self.model, options)
        self.layout = (PackedLayout if options.packing else PaddedLayout)(self.model, options)
        self.passes = LogprobPasses(self.model, self.layout, options)
        self.updates = UpdateSteps(self.model, self.layout, optimizer,
                                   (self.param_shardings, self.opt_shardings), options)
        self.init_opt_state = jax.jit(optimizer.init, out_shardings=self.opt_shardings)
        # A real copy (new buffers) even where layouts agree: the original is donated to the next update.
        self.copy_params = param_copier(self.param_shardings)
        self.assemble = jax.jit(self.assembly.assemble)

    @property
    def lp_k_source(self) -> str:
        """Where the loss's pi_k log-probs come from (`rl.lp_k.lp_k_source`)."""
        return self.passes.lp_k_source

    @property
    def num_experts(self) -> int:
        return self.model.cfg.num_experts

    @property
    def optimizer(self) -> optax.GradientTransformation:
        return self.updates.optimizer

    def build(self, prompt_tokens, prompt_mask, samples: SampleOutput, rewards, *, reference, current,
              frozen=None) -> StepBatch:
        """The update's batch: the prompts [B, P], the sampler's record of their rows and the reward table, with
        the log-probs of the `reference` params (beta > 0) and of the `current` ones (pi_k, when `lp_k_source` is
        "computed"), and M2PO's token mask. Every program on the train mesh. With LoRA, `reference` and `current`
        are adapters (the reference may have none) and `frozen` the base they join."""
        # How often rows were preempted is a statistic of the sampler (the iteration record's), not training data:
        # the programs take the same inputs whatever the sampler did (the planner lowers them without it).
        batch, _ = self.assemble(prompt_tokens, prompt_mask, samples._replace(preempted=None), rewards)
        plan = self.layout.plan_passes(prompt_tokens, prompt_mask, samples, batch) if self.passes.run_model else None
        batch = self.passes.run(batch, plan, reference=reference, current=current, frozen=frozen)
        return jax.block_until_ready(batch)

    def update(self, params, opt_state, batch: StepBatch, shuffle_key=None, frozen=None):
        """The update (`UpdateSteps.run`): grpo.inner_steps passes over `batch`, each grpo.num_minibatches optimiser
        steps; returns (params, optimiser state, each step's metrics on the host)."""
        return self.updates.run(params, opt_state, batch, shuffle_key, frozen)
