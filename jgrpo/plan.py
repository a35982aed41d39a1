"""Will a run fit a TPU slice? `python -m jgrpo.plan CONFIG [section.field=value ...] --topology v5e:2x4`.

Compiles the programs of one training iteration for a real TPU topology, on any machine: XLA's TPU compiler
ships in libtpu (`pip install "jax[tpu]"`) and compiles for the devices of
`jax.experimental.topologies.get_topology_desc` without a TPU attached (run with `JAX_PLATFORMS=cpu`).
No weights are read: the params are `jax.ShapeDtypeStruct`s with the run's training and sampling shardings,
from the model's shape description (`models.shapes`). The programs are the trainer's own, built by the same
public functions (`sampler.lower_generate`, `train_step.StepFunctions`):

    sample        the sampler's generate (B prompts x G samples) from the sampling-layout params
    assemble      sampler outputs + rewards -> the step batch and advantages
    ref_logprobs  reference log-probs (beta > 0)
    lp_k          log-probs at the start of the iteration (when `lp_k_source` is "computed")
    update        one optimiser step (params and optimiser state donated)
    behaviour     the copy current -> behaviour in the sampling layout (v > 1)
    eval          held-out generate, greedy, when run.eval_every is set

For each program, per chip: argument, output and temporary bytes and the compile time. The iteration's peak
is the worst program's live set: the buffers that live across the whole iteration (current params, optimiser
state, reference, behaviour copy, the step batch) plus that program's own arguments, temporaries and new
outputs. The last line printed is one JSON record.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time

from jgrpo import tpu_attached  # noqa: E402 - its import settles JAX_PLATFORMS before jax is imported

# Planning compiles for a TPU that is not here: never let jax try to initialise one. Without a TPU, describe
# this host to libtpu so that loading it for the compiler does not print "could not determine TPU worker
# hostnames / accelerator type" errors (the values only name the local host; the topology is the argument).
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if not tpu_attached():
    for name, value in (("TPU_SKIP_MDS_QUERY", "1"), ("TPU_WORKER_HOSTNAMES", "localhost"), ("TPU_WORKER_ID", "0"),
                        ("TPU_ACCELERATOR_TYPE", "v5litepod-8")):
        os.environ.setdefault(name, value)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402

from jgrpo.config import Config, load_config  # noqa: E402
from jgrpo.data import bucketed_length  # noqa: E402
from jgrpo.mesh import SAMPLE_RULES, TRAIN_RULES, Rules, logical_shardings, logical_to_spec, make_mesh, replicated  # noqa: E402
from jgrpo.models.llm import abstract_model, param_logical_axes  # noqa: E402
from jgrpo.models.shapes import model_shapes  # noqa: E402
from jgrpo.optim import make_optimizer  # noqa: E402
from jgrpo.sampler import lower_generate  # noqa: E402
from jgrpo.sampling_methods import SamplingMethod  # noqa: E402
from jgrpo.train_step import StepFunctions  # noqa: E402

GIB = 2**30


@dataclasses.dataclass(frozen=True)
class Chip:
    hbm_gib: float  # HBM per chip
    bf16_tflops: float  # peak dense bf16 TFLOP/s per chip
    hbm_gbps: float  # HBM bandwidth per chip, GB/s


# Published per-chip figures (Google Cloud TPU documentation, "TPU versions": v4, v5e, v5p, v6e pages).
CHIPS = {
    "v4": Chip(hbm_gib=32, bf16_tflops=275, hbm_gbps=1228),
    "v5e": Chip(hbm_gib=16, bf16_tflops=197, hbm_gbps=819),
    "v5p": Chip(hbm_gib=95, bf16_tflops=459, hbm_gbps=2765),
    "v6e": Chip(hbm_gib=32, bf16_tflops=918, hbm_gbps=1640),
}
# Topologies checked on this project's machines (a name is "<chip>:<AxB[xC]>").
EXAMPLE_TOPOLOGIES = ("v5e:2x4", "v5p:2x2x2", "v6e:2x4", "v4:2x2x1")


def topology_devices(name: str) -> tuple[list, Chip]:
    """The devices of TPU topology `name` (deviceless) and its chip, or a ValueError naming the choices."""
    chip_name = name.split(":", 1)[0]
    if ":" not in name or chip_name not in CHIPS:
        raise ValueError(f"unknown TPU topology '{name}': use <chip>:<shape> with chip one of {sorted(CHIPS)}, "
                         f"e.g. {', '.join(EXAMPLE_TOPOLOGIES)}")
    try:
        from jax.experimental import topologies

        topology = topologies.get_topology_desc(topology_name=name, platform="tpu")
    except Exception as e:  # noqa: BLE001 - libtpu missing, or a shape the chip does not come in
        raise ValueError(f"cannot describe TPU topology '{name}' ({type(e).__name__}: {e}); libtpu must be installed "
                         f"(pip install \"jax[tpu]\"); examples that work: {', '.join(EXAMPLE_TOPOLOGIES)}") from e
    return list(topology.devices), CHIPS[chip_name]


@dataclasses.dataclass
class ProgramReport:
    name: str
    compile_s: float
    argument_bytes: int
    output_bytes: int
    temp_bytes: int
    alias_bytes: int
    resident_argument_bytes: int  # arguments that are the iteration's resident buffers (not extra)

    @property
    def live_bytes(self) -> int:
        """Bytes this program adds on top of the resident buffers while it runs."""
        extra_args = self.argument_bytes - self.resident_argument_bytes
        return extra_args + self.temp_bytes + self.output_bytes - self.alias_bytes


def per_chip_bytes(tree) -> int:
    """Bytes one chip holds of a pytree of sharded arrays / ShapeDtypeStructs (the largest shard of each leaf)."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        shape = leaf.sharding.shard_shape(leaf.shape) if leaf.sharding is not None else leaf.shape
        total += math.prod(shape) * jnp.dtype(leaf.dtype).itemsize
    return total


def _abstract(tree, shardings):
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def _rows(mesh: Mesh, rules: Rules, shape, dtype) -> jax.ShapeDtypeStruct:
    spec = logical_to_spec(("batch",) + (None,) * (len(shape) - 1), rules, shape, mesh)
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))


def _compile(name: str, lowered, resident_argument_bytes: int = 0) -> tuple[ProgramReport, object]:
    start = time.perf_counter()
    compiled = lowered.compile()
    seconds = time.perf_counter() - start
    memory = compiled.memory_analysis()
    return ProgramReport(name, seconds, int(memory.argument_size_in_bytes), int(memory.output_size_in_bytes),
                         int(memory.temp_size_in_bytes), int(memory.alias_size_in_bytes),
                         resident_argument_bytes), compiled


@dataclasses.dataclass
class AbstractRun:
    """A run's model and state as ShapeDtypeStructs with their shardings, and its step functions."""

    mesh: Mesh
    cfg: object  # LLMConfig
    graphdef: object
    params: dict  # training layout
    sample_params: dict  # sampling layout
    opt_state: object
    steps: StepFunctions


def abstract_run(config: Config, devices: list, *, train_rules: Rules = TRAIN_RULES,
                 sample_rules: Rules = SAMPLE_RULES) -> AbstractRun:
    """The run's mesh over `devices`, its abstract params / optimiser state and its StepFunctions (no weights)."""
    c, g, m = config, config.grpo, config.model
    mesh = make_mesh(c.mesh, devices)
    cfg = model_shapes(m.name, param_dtype=m.param_dtype, compute_dtype=m.compute_dtype, remat=m.remat)
    graphdef, shapes = abstract_model(cfg)
    axes = param_logical_axes(shapes)
    params = _abstract(shapes, logical_shardings(axes, mesh, train_rules, shapes=shapes))
    sample_params = _abstract(shapes, logical_shardings(axes, mesh, sample_rules, shapes=shapes))
    optimizer = make_optimizer(c.optim, max(c.run.iterations * g.inner_steps * g.num_minibatches, 1))
    steps = StepFunctions(graphdef=graphdef, params=params, mesh=mesh, grpo=g, optimizer=optimizer,
                          method=SamplingMethod.from_config(c.sampler), logprob_chunk=m.logprob_chunk,
                          new_tokens=c.sampler.max_new_tokens, share_prompts=m.share_prompts,
                          skip_empty_steps=c.optim.skip_empty_steps, rules=train_rules)
    opt_state = _abstract(jax.eval_shape(optimizer.init, shapes), steps.opt_shardings)
    return AbstractRun(mesh, cfg, graphdef, params, sample_params, opt_state, steps)


def plan_iteration(config: Config, devices: list, *, train_rules: Rules = TRAIN_RULES,
                   sample_rules: Rules = SAMPLE_RULES) -> dict:
    """Compile one iteration's programs of `config` for `devices`; per-chip memory of each and of the iteration."""
    c, g, m = config, config.grpo, config.model
    run = abstract_run(config, devices, train_rules=train_rules, sample_rules=sample_rules)
    mesh, cfg, graphdef, steps = run.mesh, run.cfg, run.graphdef, run.steps
    params, sample_params, opt_state = run.params, run.sample_params, run.opt_state
    method = SamplingMethod.from_config(c.sampler)
    B, G, N = c.data.batch_size, g.num_generations, c.sampler.max_new_tokens
    R, P = B * G, bucketed_length(c.data.max_prompt_length, c.sampler.prompt_bucket)
    key = jax.ShapeDtypeStruct((), jax.eval_shape(lambda: jax.random.key(0)).dtype, sharding=replicated(mesh))
    prompts = _rows(mesh, sample_rules, (B, P), jnp.int32), _rows(mesh, sample_rules, (B, P), jnp.bool_)
    sample_kwargs = dict(cfg=cfg, max_new_tokens=N, stop_ids=(0,), mesh=mesh, rules=sample_rules)

    resident = {"params": per_chip_bytes(params), "opt_state": per_chip_bytes(opt_state)}
    if g.beta > 0:
        resident["reference"] = resident["params"]
    if g.behaviour_refresh > 1:
        resident["behaviour"] = per_chip_bytes(sample_params)
    reports = []
    behaviour_args = resident.get("behaviour", 0)
    reports.append(_compile("sample", lower_generate(graphdef, sample_params, *prompts, key, num_samples=G,
                                                     method=method, **sample_kwargs), behaviour_args)[0])
    outputs = (_rows(mesh, train_rules, (R, N), jnp.int32), _rows(mesh, train_rules, (R, N), jnp.bool_),
               _rows(mesh, train_rules, (R, N), jnp.float32), _rows(mesh, train_rules, (R,), jnp.float32))
    train_prompts = _rows(mesh, train_rules, (B, P), jnp.int32), _rows(mesh, train_rules, (B, P), jnp.bool_)
    report, compiled = _compile("assemble", steps.assemble.lower(*train_prompts, *outputs))
    reports.append(report)
    batch = _abstract(jax.eval_shape(steps.assemble, *train_prompts, *outputs), compiled.output_shardings)[0]
    lp_alpha = batch.lp_alpha
    batch = batch._replace(lp_ref=lp_alpha if g.beta > 0 else None,
                           lp_k=lp_alpha if steps.lp_k_source == "computed" else None)
    resident["step_batch"] = per_chip_bytes(batch)
    if g.beta > 0:
        reports.append(_compile("ref_logprobs", steps.reference_logprobs.lower(params, batch),
                                resident["params"] + resident["step_batch"])[0])
    if steps.lp_k_source == "computed":
        reports.append(_compile("lp_k", steps.logprobs.lower(params, batch),
                                resident["params"] + resident["step_batch"])[0])
    update = steps.train_step.lower(params, opt_state, batch, jnp.int32(0), jnp.bool_(True))
    reports.append(_compile("update", update, resident["params"] + resident["opt_state"] + resident["step_batch"])[0])
    if g.behaviour_refresh > 1:
        copy = jax.jit(lambda p: jax.tree.map(jnp.copy, p), out_shardings=jax.tree.map(lambda x: x.sharding,
                                                                                       sample_params))
        reports.append(_compile("behaviour", copy.lower(params), resident["params"])[0])
    if c.run.eval_every:
        eval_batch = c.run.eval_batch_size or B
        eval_prompts = (_rows(mesh, sample_rules, (eval_batch, P), jnp.int32),
                        _rows(mesh, sample_rules, (eval_batch, P), jnp.bool_))
        reports.append(_compile("eval", lower_generate(graphdef, sample_params, *eval_prompts, key, num_samples=1,
                                                       method=SamplingMethod(temperature=0.0), **sample_kwargs))[0])
    resident_total = sum(resident.values())
    worst = max(reports, key=lambda r: r.live_bytes)
    return {
        "model": m.name,
        "parameters": sum(math.prod(x.shape) for x in jax.tree.leaves(params)),
        "mesh": dict(mesh.shape),
        "resident_bytes": resident,
        "programs": [dataclasses.asdict(r) | {"live_bytes": r.live_bytes} for r in reports],
        "peak_bytes": resident_total + worst.live_bytes,
        "peak_program": worst.name,
        "compile_s": sum(r.compile_s for r in reports),
    }


def _gib(n: float) -> str:
    return f"{n / GIB:7.2f}"


def report_lines(topology: str, chip: Chip, plan: dict, hbm_gib: float) -> list[str]:
    """A human-readable table of one plan (per chip), ending with the verdict."""
    lines = [f"== {plan['model']} on {topology} (mesh {plan['mesh']}), {plan['parameters'] / 1e9:.2f}B params; "
             f"per chip, GiB of {hbm_gib:g} HBM",
             f"{'program':<14}{'args':>8}{'outputs':>8}{'temps':>8}{'live':>8}{'compile s':>11}"]
    for p in plan["programs"]:
        lines.append(f"{p['name']:<14}{_gib(p['argument_bytes'])}{_gib(p['output_bytes'])}{_gib(p['temp_bytes'])}"
                     f"{_gib(p['live_bytes'])}{p['compile_s']:11.1f}")
    resident = ", ".join(f"{k} {v / GIB:.2f}" for k, v in plan["resident_bytes"].items())
    lines.append(f"resident across the iteration: {resident}")
    peak = plan["peak_bytes"]
    verdict = "fits" if peak <= hbm_gib * GIB else "DOES NOT FIT"
    lines.append(f"peak {peak / GIB:.2f} GiB during '{plan['peak_program']}': {verdict} in {hbm_gib:g} GiB")
    if verdict != "fits":
        largest = sorted(plan["resident_bytes"].items(), key=lambda kv: -kv[1])[:3]
        worst = next(p for p in plan["programs"] if p["name"] == plan["peak_program"])
        lines.append("largest buffers: " + ", ".join(f"{k} {v / GIB:.2f} GiB" for k, v in largest)
                     + f", '{worst['name']}' temporaries {worst['temp_bytes'] / GIB:.2f} GiB")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jgrpo.plan", description=__doc__.split("\n\n")[0])
    parser.add_argument("config", help="a YAML config, e.g. configs/paper_gsm8k_qwen05b_on_policy.yaml")
    parser.add_argument("overrides", nargs="*", help="section.field=value overrides")
    parser.add_argument("--topology", action="append", required=True,
                        help=f"TPU topology, e.g. {', '.join(EXAMPLE_TOPOLOGIES)} (several allowed)")
    parser.add_argument("--hbm-gib", type=float, default=None, help="override the chip's HBM capacity (GiB)")
    args = parser.parse_args(argv)
    config = load_config(args.config, args.overrides)
    records = []
    for topology in args.topology:
        devices, chip = topology_devices(topology)
        try:
            plan = plan_iteration(config, devices)
        except ValueError as e:
            raise SystemExit(f"{topology}: {e}") from None
        hbm = args.hbm_gib if args.hbm_gib is not None else chip.hbm_gib
        print("\n".join(report_lines(topology, chip, plan, hbm)), flush=True)
        records.append({"topology": topology, "hbm_gib": hbm, "fits": plan["peak_bytes"] <= hbm * GIB, **plan})
    print(json.dumps({"plans": records}))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ValueError as e:  # bad topology, model or config: one clear line
        sys.exit(f"error: {e}")
