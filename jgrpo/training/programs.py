"""An iteration's compiled programs, built one way for the trainer and the planner.

The trainer runs them on its devices; `jgrpo.plan` lowers them for a TPU slice that is not here. Both build the
step functions with `step_functions` and read which programs an iteration runs from `iteration_programs`, so "the
planner compiles what the trainer runs" holds by construction (and tests/planning/test_programs.py checks it
against a real run).
"""

from __future__ import annotations

import jax

from jgrpo.config import Config, ConfigError
from jgrpo.parallel.mesh import TRAIN_RULES, Rules
from jgrpo.rl.lp_k import lp_k_source
from jgrpo.rollout.sampling_weights import sampling_copy
from jgrpo.training.optimizer import learning_rate_schedule, make_optimizer
from jgrpo.training.step_options import StepOptions
from jgrpo.training.steps import StepFunctions


def step_functions(config: Config, *, graphdef, params, mesh, method, iterations: int, frozen=None,
                   rules: Rules = TRAIN_RULES):
    """(StepFunctions, learning-rate schedule) of a run of `iterations` iterations: `params` are what trains (LoRA:
    the adapters, `frozen` the base), `method` the sampler's (the log-probs process the logits as it does)."""
    g, m = config.grpo, config.model
    total_updates = max(iterations * g.inner_steps * g.num_minibatches, 1)
    options = StepOptions(grpo=g, method=method, logprob_chunk=m.logprob_chunk,
                          new_tokens=config.completion_tokens, share_prompts=m.share_prompts,
                          skip_empty_steps=config.optim.skip_empty_steps,
                          reward_weights=config.reward.component_weights(), on_policy=config.samples_on_policy,
                          routing_replay=m.routing_replay == "rollout",
                          router_loss_coefs=(m.router_aux_loss_coef, m.router_z_loss_coef),
                          packing=m.packing, packing_width=m.packing_width,
                          packing_row_buckets=m.packing_row_buckets)
    steps = StepFunctions(graphdef=graphdef, params=params, frozen=frozen, mesh=mesh, rules=rules,
                          optimizer=make_optimizer(config.optim, total_updates), options=options)
    steps.assembly.check_rows(config.data.batch_size * g.num_generations)
    n = config.mesh.expert
    if n > 1 and (not steps.num_experts or steps.num_experts % n):
        what = f"its {steps.num_experts} experts" if steps.num_experts else "no experts (a dense model)"
        raise ConfigError(f"mesh.expert={n} splits a mixture of experts' experts over {n} devices, but {m.name} has "
                          f"{what}; set mesh.expert to a divisor of the expert count, or 1 (use mesh.data or "
                          "mesh.fsdp for data parallelism)")
    if steps.num_experts and config.sampler.weights_dtype == "int8":
        raise ConfigError(f"sampler.weights_dtype=int8 quantizes the layer projections, but {m.name} is a mixture "
                          "of experts, whose grouped expert matmuls (model.moe_impl) take float weights only; set "
                          "sampler.weights_dtype: bfloat16 or float32")
    if not steps.num_experts:
        if m.routing_replay == "rollout":
            raise ConfigError(f"model.routing_replay=rollout replays a mixture of experts' routing, but {m.name} is "
                              "a dense model (no experts); set model.routing_replay: none")
        for name in ("router_aux_loss_coef", "router_z_loss_coef"):
            if getattr(m, name):
                raise ConfigError(f"model.{name}={getattr(m, name)} weighs a mixture of experts' router loss, but "
                                  f"{m.name} is a dense model (no router); set it to 0")
    # Jitted: the trainer reads an iteration's rates from it (optim/lr), one compiled call each.
    return steps, jax.jit(learning_rate_schedule(config.optim, total_updates))


def iteration_programs(config: Config) -> tuple[str, ...]:
    """The programs one iteration of `config` runs, in order:

        sample        the sampler (B prompts x G samples; window mode: v iterations' prompts in one pool)
        assemble      prompts + samples + rewards -> the step batch (advantages)
        ref_logprobs  the reference's log-probs (beta > 0)
        lp_k          pi_k's log-probs, when a later update needs them (`steps.lp_k_source`)
        m2po_mask     M2PO's token mask over the batch (grpo.m2po_tau)
        shuffle       groups re-dealt to the minibatches at inner steps after the first
        update        one optimiser step (inner_steps x num_minibatches of them)
        behaviour     the sampler's copy of the current params (`sampling_weights.sampling_copy`)
        eval          held-out greedy sampling (run.eval_every)
    """
    g = config.grpo
    names = ["sample", "assemble"]
    if g.beta > 0:
        names.append("ref_logprobs")
    if lp_k_source(g, config.samples_on_policy) == "computed":
        names.append("lp_k")
    if g.m2po_tau is not None:
        names.append("m2po_mask")
    if g.shuffles_minibatches and g.inner_steps > 1:
        names.append("shuffle")
    names.append("update")
    if sampling_copy(config) is not None:
        names.append("behaviour")
    if config.run.eval_every:
        names.append("eval")
    return tuple(names)
