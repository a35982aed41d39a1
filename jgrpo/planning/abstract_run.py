"""A run without weights, for a TPU slice that is not here: abstract params and the trainer's programs, lowered.

`topology_devices("v5e:2x4")` describes a TPU slice's devices with libtpu's compiler (no TPU attached);
`abstract_run` builds the run's mesh over them, its params / optimiser state as `jax.ShapeDtypeStruct`s with
the training and sampling shardings (from the model's shape description, `models.shapes`) and its
`StepFunctions` and `Sampler`, built as the trainer builds them (`jgrpo.training.programs`); `lower_iteration`
lowers the programs of one iteration (`programs.iteration_programs`: sample, assemble, ref_logprobs, lp_k,
m2po_mask, shuffle, update, behaviour, eval) exactly as the trainer calls them, through the same functions
(`Sampler.lower`, the `StepFunctions` jits, the sampling copy). A test checks the list against the programs a real
run compiles (tests/planning/test_programs.py).
"""

from __future__ import annotations

import dataclasses
import math
import os

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jgrpo import tpu_attached
from jgrpo.config import Config, ConfigError
from jgrpo.data import bucketed_length
from jgrpo.models.frozen_base import sample_layout
from jgrpo.models.hf import model_options
from jgrpo.models.llm import abstract_model, param_logical_axes
from jgrpo.models.lora import join_adapters, split_adapters, with_lora
from jgrpo.models.quantize import sampler_copy
from jgrpo.models.shapes import model_shapes
from jgrpo.parallel.mesh import (
    SAMPLE_RULES,
    TRAIN_RULES,
    Rules,
    logical_shardings,
    make_mesh,
    mesh_platform,
    replicated,
    row_sharding,
)
from jgrpo.parallel.weights.copies import param_copier
from jgrpo.planning.roofline import CHIPS, Chip
from jgrpo.rollout.sampling_weights import sampling_copy
from jgrpo.sampling.methods import SamplingMethod
from jgrpo.sampling.sampler import Prompts, Sampler
from jgrpo.training.programs import iteration_programs, step_functions
from jgrpo.training.steps import StepFunctions

# Topologies checked on this project's machines (a name is "<chip>:<AxB[xC]>").
EXAMPLE_TOPOLOGIES = ("v5e:2x4", "v5p:2x2x2", "v6e:2x4", "v4:2x2x1")


def describe_host_to_libtpu() -> None:
    """Before libtpu loads for the compiler on a machine without a TPU: describe this host to it, so loading it
    prints no "could not determine TPU worker hostnames / accelerator type" errors (the values only name the local
    host; the topology is the argument), and let several planners compile at once (no TPU is opened, so libtpu's
    one-process lock guards nothing). Values the user set win. A function, not an import side effect: importing
    the planner on a TPU VM must leave that VM's environment alone.
    """
    if tpu_attached():
        return
    for name, value in (("TPU_SKIP_MDS_QUERY", "1"), ("TPU_WORKER_HOSTNAMES", "localhost"), ("TPU_WORKER_ID", "0"),
                        ("TPU_ACCELERATOR_TYPE", "v5litepod-8"), ("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")):
        os.environ.setdefault(name, value)


def topology_devices(name: str) -> tuple[list, Chip]:
    """The devices of TPU topology `name` (deviceless) and its chip, or a ConfigError naming the choices."""
    chip_name = name.split(":", 1)[0]
    if ":" not in name or chip_name not in CHIPS:
        raise ConfigError(f"unknown TPU topology '{name}': use <chip>:<shape> with chip one of {sorted(CHIPS)}, "
                         f"e.g. {', '.join(EXAMPLE_TOPOLOGIES)}")
    describe_host_to_libtpu()
    try:
        from jax.experimental import topologies

        topology = topologies.get_topology_desc(topology_name=name, platform="tpu")
    except Exception as e:  # noqa: BLE001 - libtpu missing, or a shape the chip does not come in
        raise ConfigError(f"cannot describe TPU topology '{name}' ({type(e).__name__}: {e}); libtpu must be installed "
                         f"(pip install \"jax[tpu]\"); examples that work: {', '.join(EXAMPLE_TOPOLOGIES)}") from e
    return list(topology.devices), CHIPS[chip_name]



def per_chip_bytes(tree) -> int:
    """Bytes one chip holds of a pytree of sharded arrays / ShapeDtypeStructs (the largest shard of each leaf)."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        shape = leaf.sharding.shard_shape(leaf.shape) if leaf.sharding is not None else leaf.shape
        total += math.prod(shape) * jnp.dtype(leaf.dtype).itemsize
    return total


def parameter_count(tree) -> int:
    return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(tree))


def _abstract(tree, shardings):
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def _rows(mesh: Mesh, rules: Rules, shape, dtype) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype, sharding=row_sharding(mesh, rules, shape))



@dataclasses.dataclass
class AbstractRun:
    """A run's model and state as ShapeDtypeStructs with their shardings, and its step functions."""

    mesh: Mesh
    cfg: object  # LLMConfig
    graphdef: object
    params: dict  # training layout: what trains (with LoRA the adapters)
    sample_params: dict  # sampling layout
    opt_state: object
    steps: StepFunctions
    sampler: Sampler
    base: dict | None = None  # LoRA's frozen base, training layout (`jgrpo.models.frozen_base`)
    sample_base: dict | None = None  # and its sampling-layout copy, only where that layout or dtype differs

    def whole(self, sample: bool = False) -> dict:
        """The model's params (adapters joined with their base) in the training or sampling layout."""
        if sample:
            return join_adapters(self.sample_params, self.sample_base or self.base)
        return join_adapters(self.params, self.base)


def abstract_run(config: Config, devices: list, *, train_rules: Rules = TRAIN_RULES,
                 sample_rules: Rules = SAMPLE_RULES) -> AbstractRun:
    """The run's mesh over `devices`, its abstract params / optimiser state and its StepFunctions (no weights)."""
    c, g, m = config, config.grpo, config.model
    mesh = make_mesh(c.mesh, devices)
    cfg = model_shapes(m.name, model_options(m, mesh_platform(mesh)))
    if m.lora.rank:
        cfg = with_lora(cfg, m.lora.rank, m.lora.alpha, m.lora.targets)
    graphdef, shapes = abstract_model(cfg)
    axes = param_logical_axes(shapes)
    params = _abstract(shapes, logical_shardings(axes, mesh, train_rules, shapes=shapes))
    convert = sampler_copy(c.sampler.weights_dtype, m.compute_dtype, c.sampler.quantize_embeddings)  # cast or int8
    copied = jax.eval_shape(convert, shapes)
    sample_params = _abstract(copied, logical_shardings(param_logical_axes(copied), mesh, sample_rules,
                                                        shapes=copied))
    base = sample_base = None
    if m.lora.rank:  # what trains is the adapters; the base is frozen and held once per distinct layout
        (params, base), sample_params = split_adapters(params), split_adapters(sample_params)[0]
        shapes = split_adapters(shapes)[0]
        layout = sample_layout(base, mesh, c.sampler, m.compute_dtype, sample_rules)  # as the trainer decides
        if layout is not None:
            shardings, convert = layout
            copied_base = base if convert is None else jax.eval_shape(convert, base)
            sample_base = jax.tree.map(lambda b, s: jax.ShapeDtypeStruct(b.shape, b.dtype, sharding=s),
                                       copied_base, shardings)
    # The run's sampler (stop id 0 stands for the tokenizer's: only the program's shape matters here).
    # Multi-turn episodes (env.name): a row is the whole episode, env.max_total_tokens wide; the sampler's decode
    # is planned at that width (the pool's turns and appends run inside that cache).
    sampler = Sampler.from_config(c.sampler, graphdef=graphdef, num_samples=g.num_generations, stop_ids=(0,),
                                  pad_id=0, mesh=mesh, cfg=cfg).replace(rules=sample_rules,
                                                                        max_new_tokens=c.completion_tokens)
    steps, _ = step_functions(config, graphdef=graphdef, params=params, mesh=mesh, method=sampler.method,
                              iterations=c.run.iterations, frozen=base, rules=train_rules)
    opt_state = _abstract(jax.eval_shape(steps.optimizer.init, shapes), steps.opt_shardings)
    return AbstractRun(mesh, cfg, graphdef, params, sample_params, opt_state, steps, sampler, base, sample_base)




@dataclasses.dataclass
class Program:
    name: str
    lowered: object  # jax.stages.Lowered
    resident_argument_bytes: int  # its arguments that are the iteration's resident buffers (not extra)
    runs: float = 1.0  # times per iteration
    # A packed program's loop over the micro-batches it uses, whose trip count is an argument: the count its cost
    # is taken at (`hlo_cost.HloCost.traced_trips`); None for the others
    traced_trips: int | None = None


@dataclasses.dataclass
class Iteration:
    run: AbstractRun
    resident: dict[str, int]  # per-chip bytes of the buffers alive across the whole iteration
    programs: list[Program]
    shape: dict[str, int]  # B prompts, G samples, P prompt width, N new tokens


program_names = iteration_programs  # the planner's older name


def lower_iteration(config: Config, devices: list, *, names: tuple[str, ...] | None = None,
                    train_rules: Rules = TRAIN_RULES, sample_rules: Rules = SAMPLE_RULES,
                    packed_micro_batches: int | None = None) -> Iteration:
    """Lower the programs of one iteration of `config` over `devices` (all, or those in `names`). With
    `model.packing`, the packed programs cost `packed_micro_batches` micro-batches per minibatch (default: as many
    as padded, grpo.micro_batches); their memory is the worst case whatever the count (a fixed buffer)."""
    c, g = config, config.grpo
    run = abstract_run(config, devices, train_rules=train_rules, sample_rules=sample_rules)
    hosts = len({d.process_index for d in devices})
    if c.data.batch_size % hosts:
        raise ValueError(f"data.batch_size={c.data.batch_size} prompts cannot be split over the {hosts} hosts of "
                         f"this slice (each host loads an equal share): use a multiple of {hosts}")
    B, G, N = c.data.batch_size, g.num_generations, c.completion_tokens
    shape = {"B": B, "G": G, "P": bucketed_length(c.data.max_prompt_length, c.sampler.prompt_bucket), "N": N}
    runs = iteration_programs(config)
    wanted = [n for n in runs if names is None or n in names]
    resident = _resident(config, run)
    lowered = {**_sampling_programs(config, run, resident, shape, sample_rules, wanted),
               **_step_programs(config, run, resident, shape, wanted, packed_micro_batches)}
    return Iteration(run, resident, [lowered[n] for n in wanted], shape)


def _resident(config: Config, run: AbstractRun) -> dict[str, int]:
    """Per-chip bytes of the buffers alive across the whole iteration (the step batch's added later)."""
    g = config.grpo
    resident = {"params": per_chip_bytes(run.params), "opt_state": per_chip_bytes(run.opt_state)}
    if run.base is not None:  # LoRA: the frozen base, once (twice where the sampling layout differs)
        resident["base"] = per_chip_bytes(run.base)
        resident["sample_base"] = per_chip_bytes(run.sample_base) if run.sample_base is not None else 0
    if g.beta > 0:  # a copy of the initial params; with LoRA the base itself, or a frozen adapter copy after a swap
        resident["reference"] = resident["params"] if run.base is None or g.swap_reference else 0
    # A copy that lives across iterations: the behaviour policy's, or the last one published to the async producer
    # (with two jobs: the trainer's copy of what the rollout job holds, the base of the next publish's changes).
    if (kind := sampling_copy(config)) in ("behaviour", "published"):
        resident[kind] = per_chip_bytes(run.sample_params)
    return resident


def _sampling_copy(resident: dict) -> int:
    """The resident copy the sampler reads, if any (`_resident`)."""
    return resident.get("behaviour", resident.get("published", 0))


def _sampling_programs(config, run: AbstractRun, resident, shape, rules, wanted) -> dict[str, Program]:
    """The sampler (one iteration's prompts, or a behaviour window's), the sampling copy, held-out greedy."""
    c, g, mesh, sampler = config, config.grpo, run.mesh, run.sampler
    B, P, R = shape["B"], shape["P"], shape["B"] * shape["G"]
    key = jax.ShapeDtypeStruct((), jax.eval_shape(jax.random.key, 0).dtype, sharding=replicated(mesh))
    sampling_base = resident.get("sample_base") or resident.get("base", 0)
    sample_whole = run.whole(sample=True)
    programs = {}
    if "sample" in wanted and c.rollout.mode == "window":  # one pool for the v iterations of a behaviour window
        v = g.behaviour_refresh
        window = Prompts(*(_rows(mesh, rules, s, dtype) for s, dtype in (
            ((v * B, P), jnp.int32), ((v * B, P), jnp.bool_), ((v * B,), jnp.int32))))
        lowered = sampler.replace(slots=c.sampler.slots or R).lower(sample_whole, window,
                                                                      _rows(mesh, rules, (v * B,), key.dtype))
        programs["sample"] = Program("sample", lowered, _sampling_copy(resident) + sampling_base, runs=1 / v)
    elif "sample" in wanted:
        prompts = Prompts(_rows(mesh, rules, (B, P), jnp.int32), _rows(mesh, rules, (B, P), jnp.bool_))
        programs["sample"] = Program("sample", sampler.lower(sample_whole, prompts, key),
                                     _sampling_copy(resident) + sampling_base)
    if "behaviour" in wanted:
        copy = param_copier(jax.tree.map(lambda x: x.sharding, run.sample_params),
                            sampler_copy(c.sampler.weights_dtype, c.model.compute_dtype, c.sampler.quantize_embeddings))
        # Adaptive v plans for the worst case, a refresh every iteration.
        every = g.behaviour_refresh if isinstance(g.behaviour_refresh, int) else 1
        every = c.rollout.publish_every if c.rollout.mode == "async" else every
        programs["behaviour"] = Program("behaviour", copy.lower(run.params), resident["params"], runs=1 / every)
    if "eval" in wanted:
        eval_batch = c.run.eval_batch_size or B
        prompts = Prompts(_rows(mesh, rules, (eval_batch, P), jnp.int32), _rows(mesh, rules, (eval_batch, P),
                                                                               jnp.bool_))
        greedy = sampler.replace(num_samples=1, method=SamplingMethod(temperature=0.0))
        programs["eval"] = Program("eval", greedy.lower(sample_whole, prompts, key), sampling_base)
    return programs


def _step_programs(config, run: AbstractRun, resident, shape, wanted,
                   packed_micro_batches: int | None = None) -> dict[str, Program]:
    """The step batch's assembly, its log-prob passes, M2PO's mask, the minibatch shuffle and the update, lowered
    from the abstract inputs and plans the step functions give (`BatchAssembly.abstract_inputs`, the layout's
    `abstract_plans`: with `model.packing`, the packed programs cost `packed_micro_batches` micro-batches)."""
    c, g, steps = config, config.grpo, run.steps
    inputs = steps.assembly.abstract_inputs(shape["B"], shape["P"], 1 + len(c.reward.component_names()),
                                            valid=c.env.on)  # the reward table; episodes: rows in the loss
    assemble = steps.assemble.lower(*inputs)
    # The step batch's shardings are what the compiled assembly produces (a second compile of it is cheap).
    assembled = _abstract(jax.eval_shape(steps.assemble, *inputs), assemble.compile().output_shardings)[0]
    received = steps.passes.received(assembled)  # the batch as each program receives it
    batch = received["update"]
    resident["step_batch"] = per_chip_bytes(batch)
    read_only = resident["params"] + resident.get("base", 0) + resident["step_batch"]
    whole = run.whole()
    plans = steps.layout.abstract_plans(shape["B"], shape["P"], packed_micro_batches)
    programs = {"assemble": Program("assemble", assemble, 0)}
    if "ref_logprobs" in wanted:  # with LoRA (and no swap) the reference is the base alone
        reference = run.base if run.base is not None and not g.swap_reference else whole
        lowered = steps.passes.reference.lower(reference, received["ref_logprobs"], plan=plans.passes)
        programs["ref_logprobs"] = Program("ref_logprobs", lowered, resident["step_batch"] + per_chip_bytes(reference),
                                           traced_trips=plans.passes_trips)
    if "lp_k" in wanted:
        lowered = steps.passes.pi_k.lower(whole, received["lp_k"], plan=plans.passes)
        programs["lp_k"] = Program("lp_k", lowered, read_only, traced_trips=plans.passes_trips)
    if "m2po_mask" in wanted:
        programs["m2po_mask"] = Program("m2po_mask", steps.passes.m2po_mask.lower(received["m2po_mask"]),
                                        resident["step_batch"])
    if "shuffle" in wanted:
        key = jax.ShapeDtypeStruct((), jax.eval_shape(jax.random.key, 0).dtype, sharding=replicated(run.mesh))
        programs["shuffle"] = Program("shuffle", steps.updates.shuffle.lower(batch, key), resident["step_batch"],
                                      runs=g.inner_steps - 1)
    if "update" in wanted:
        update = steps.updates.step.lower(run.params, run.opt_state, batch, jnp.int32(0), jnp.bool_(True),
                                          plan=plans.update, frozen=run.base)
        programs["update"] = Program("update", update, read_only + resident["opt_state"],
                                     runs=g.inner_steps * g.num_minibatches, traced_trips=plans.update_trips)
    return programs
