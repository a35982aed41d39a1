"""Will a run fit a TPU slice, and how fast at best? `python -m jgrpo.plan CONFIG [k=v ...] --topology v5e:2x4`.

Compiles the programs of one training iteration for a real TPU topology, on any machine: XLA's TPU compiler
ships in libtpu (`pip install "jax[tpu]"`) and compiles for the devices of
`jax.experimental.topologies.get_topology_desc` without a TPU attached (`abstract_run`: no weights are read,
the programs are the trainer's own). For each program, per chip: argument, output and temporary bytes, the
compile time, and the matmul FLOPs and HBM bytes it executes with loops counted (`hlo_cost`), hence its
roofline time on the chip (`roofline`). The iteration's peak is the worst program's live set: the buffers
that live across the whole iteration (current params, optimiser state, reference, behaviour copy, the step
batch) plus that program's own arguments, temporaries and new outputs. `--fit` searches remat, micro-batches,
the log-prob chunk and the mesh for the fastest plan that fits. The last line printed is one JSON record.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

# First: it settles JAX_PLATFORMS (and describes this host to libtpu) before jax is imported.
from jgrpo.abstract_run import (  # noqa: F401 - re-exported for callers of the planner
    EXAMPLE_TOPOLOGIES,
    Iteration,
    abstract_run,
    lower_iteration,
    parameter_count,
    per_chip_bytes,
    topology_devices,
)
from jgrpo.config import Config, load_config
from jgrpo.hlo_cost import HloCost
from jgrpo.hlo_inspect import summary as loop_summary
from jgrpo.mesh import SAMPLE_RULES, TRAIN_RULES, Rules
from jgrpo.roofline import Chip, iteration_model_flops, roofline

GIB = 2**30


@dataclasses.dataclass
class ProgramReport:
    name: str
    compile_s: float
    argument_bytes: int
    output_bytes: int
    temp_bytes: int
    alias_bytes: int
    resident_argument_bytes: int  # arguments that are the iteration's resident buffers (not extra)
    flops: float = 0.0  # executed matmul FLOPs per chip, loops counted (hlo_cost)
    hbm_bytes: float = 0.0  # HBM traffic per chip, loops counted (hlo_cost)
    runs: float = 1.0  # times per iteration (updates per batch; 1/v for the behaviour copy)
    loops: dict = dataclasses.field(default_factory=dict)  # collectives and big copies inside its loops

    @property
    def live_bytes(self) -> int:
        """Bytes this program adds on top of the resident buffers while it runs."""
        extra_args = self.argument_bytes - self.resident_argument_bytes
        return extra_args + self.temp_bytes + self.output_bytes - self.alias_bytes


def _compile(name: str, lowered, resident_argument_bytes: int = 0, runs: float = 1.0) -> tuple[ProgramReport, object]:
    start = time.perf_counter()
    compiled = lowered.compile()
    seconds = time.perf_counter() - start
    memory = compiled.memory_analysis()
    text = compiled.as_text()
    if os.environ.get("JGRPO_PLAN_DUMP"):  # a directory: keep each program's TPU HLO for inspection
        os.makedirs(os.environ["JGRPO_PLAN_DUMP"], exist_ok=True)
        with open(os.path.join(os.environ["JGRPO_PLAN_DUMP"], f"{name}.hlo"), "w") as f:
            f.write(text)
    cost = HloCost(text)
    return ProgramReport(name, seconds, int(memory.argument_size_in_bytes), int(memory.output_size_in_bytes),
                         int(memory.temp_size_in_bytes), int(memory.alias_size_in_bytes),
                         resident_argument_bytes, cost.flops, cost.bytes, runs, loop_summary(cost))


def plan_iteration(config: Config, devices: list, *, train_rules: Rules = TRAIN_RULES,
                   sample_rules: Rules = SAMPLE_RULES) -> dict:
    """Compile one iteration's programs of `config` for `devices`: per-chip memory and cost of each, and of the
    iteration."""
    iteration = lower_iteration(config, devices, train_rules=train_rules, sample_rules=sample_rules)
    reports = [_compile(p.name, p.lowered, p.resident_argument_bytes, p.runs) for p in iteration.programs]
    return _summarise(config, devices, iteration, reports)


def _summarise(config: Config, devices: list, iteration: Iteration, reports: list[ProgramReport]) -> dict:
    g, run, resident = config.grpo, iteration.run, iteration.resident
    B, G, P, N = (iteration.shape[k] for k in "BGPN")
    worst = max(reports, key=lambda r: r.live_bytes)
    forward_passes = (g.beta > 0) + (run.steps.lp_k_source == "computed")
    return {
        "model": config.model.name,
        "parameters": parameter_count(run.params),
        "mesh": dict(run.mesh.shape),
        "chips": len(devices),
        "hosts": len({d.process_index for d in devices}),
        "prompts_per_host": B / len({d.process_index for d in devices}),
        "model_flops": iteration_model_flops(run.cfg, prompts=B, samples=G, prompt_len=P, new_tokens=N,
                                             train_passes=g.inner_steps, forward_passes=forward_passes),
        "tokens": {"sampled": B * G * N, "trained": B * G * (P + N) * g.inner_steps},
        "resident_bytes": resident,
        "programs": [dataclasses.asdict(r) | {"live_bytes": r.live_bytes} for r in reports],
        "peak_bytes": sum(resident.values()) + worst.live_bytes,
        "peak_program": worst.name,
        "compile_s": sum(r.compile_s for r in reports),
    }


def _gib(n: float) -> str:
    return f"{n / GIB:7.2f}"


def report_lines(topology: str, chip: Chip, plan: dict, hbm_gib: float) -> list[str]:
    """A human-readable table of one plan (per chip), ending with the verdict and the roofline."""
    speed = plan["roofline"]
    lines = [f"== {plan['model']} on {topology} ({plan['chips']} chips, {plan['hosts']} host(s), mesh "
             f"{plan['mesh']}), {plan['parameters'] / 1e9:.2f}B params; per chip: GiB of {hbm_gib:g} HBM, "
             f"TFLOP and GB executed (loops counted), roofline ms",
             f"{'program':<14}{'args':>8}{'outputs':>8}{'temps':>8}{'live':>8}{'compile s':>11}{'TFLOP':>9}"
             f"{'GB':>9}{'ms':>10}  runs  bound"]
    for p in plan["programs"]:
        lines.append(f"{p['name']:<14}{_gib(p['argument_bytes'])}{_gib(p['output_bytes'])}{_gib(p['temp_bytes'])}"
                     f"{_gib(p['live_bytes'])}{p['compile_s']:11.1f}{p['flops'] / 1e12:9.3f}{p['hbm_bytes'] / 1e9:9.2f}"
                     f"{speed['program_s'][p['name']] * 1e3:10.1f}{p['runs']:6.2g}  {speed['bound'][p['name']]}")
    inside = [f"{p['name']} {p['loops']['loop_collectives']} ({p['loops']['loop_all_gathers']} all-gathers, "
              f"{p['loops']['loop_collective_bytes'] / 1e9:.2f} GB)" for p in plan["programs"]
              if p["loops"].get("loop_collectives")]
    copies = [f"{p['name']}: {', '.join(p['loops']['loop_big_copies'])}" for p in plan["programs"]
              if p["loops"].get("loop_big_copies")]
    lines.append(f"collectives inside loops: {'; '.join(inside) or 'none'}; weight/cache-sized copies inside "
                 f"loops: {'; '.join(copies) or 'none'}")
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
    lines.append(f"at best (roofline, {chip.bf16_tflops:g} TFLOP/s and {chip.hbm_gbps:g} GB/s per chip): "
                 f"{speed['iteration_s']:.2f} s per iteration (sampling {speed['sample_s']:.2f} s, training "
                 f"{speed['train_s']:.2f} s); {speed['sample_tokens_per_s_per_chip']:,.0f} sampled and "
                 f"{speed['train_tokens_per_s_per_chip']:,.0f} trained tokens/s per chip; MFU <= {speed['mfu']:.1%}")
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
        plan["roofline"] = roofline(plan, chip)
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
