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
import json
import sys

from jgrpo.config.errors import UserError, exits_on_user_error
from jgrpo.config.loading import load_config
from jgrpo.models.paged_attention_tpu import read_granule
from jgrpo.planning.abstract_run import (  # noqa: F401 - re-exported for callers of the planner
    EXAMPLE_TOPOLOGIES,
    Iteration,
    abstract_run,
    lower_iteration,
    parameter_count,
    per_chip_bytes,
    topology_devices,
)
from jgrpo.planning.fit import GIB, fit, plan_iteration  # noqa: F401 - plan_iteration re-exported
from jgrpo.planning.paged_rows import KVShape, paged_row_tokens, roofline_tokens_per_s, rows_in_flight, step_reads
from jgrpo.planning.roofline import Chip, roofline


def _gib(n: float) -> str:
    return f"{n / GIB:7.2f}"


def _trainable(plan: dict) -> str:
    """", 1.7M trainable (LoRA)" when only part of the params train."""
    n = plan.get("trainable_parameters", plan["parameters"])
    return "" if n == plan["parameters"] else f", {n / 1e6:.1f}M trainable (LoRA)"


def report_lines(topology: str, chip: Chip, plan: dict, hbm_gib: float) -> list[str]:
    """A human-readable table of one plan (per chip), ending with the verdict and the roofline."""
    speed = plan["roofline"]
    lines = [f"== {plan['model']} on {topology} ({plan['chips']} chips, {plan['hosts']} host(s) loading "
             f"{plan['prompts_per_host']:g} prompts each, mesh "
             f"{plan['mesh']}), {plan['parameters'] / 1e9:.2f}B params{_trainable(plan)}; per chip: GiB of "
             f"{hbm_gib:g} HBM, "
             f"TFLOP, HBM GB and ICI GB sent (loops counted), roofline ms",
             f"{'program':<14}{'args':>8}{'outputs':>8}{'temps':>8}{'live':>8}{'compile s':>11}{'TFLOP':>9}"
             f"{'GB':>9}{'ICI GB':>8}{'ms':>10}  runs  bound"]
    for p in plan["programs"]:
        lines.append(f"{p['name']:<14}{_gib(p['argument_bytes'])}{_gib(p['output_bytes'])}{_gib(p['temp_bytes'])}"
                     f"{_gib(p['live_bytes'])}{p['compile_s']:11.1f}{p['flops'] / 1e12:9.3f}{p['hbm_bytes'] / 1e9:9.2f}"
                     f"{p['loops'].get('collective_bytes', 0) / 1e9:8.2f}"
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
    lines += [f"'{p['name']}' was refused by XLA's TPU compiler ({p['refused']}): its cost is unknown"
              for p in plan["programs"] if p.get("refused")]
    lines.append(f"at best (roofline per chip: {chip.bf16_tflops:g} TFLOP/s, HBM {chip.hbm_gbps:g} GB/s, ICI "
                 f"{chip.ici_gbps:g} GB/s): "
                 f"{speed['iteration_s']:.2f} s per iteration (sampling {speed['sample_s']:.2f} s, training "
                 f"{speed['train_s']:.2f} s); {speed['sample_tokens_per_s_per_chip']:,.0f} sampled and "
                 f"{speed['train_tokens_per_s_per_chip']:,.0f} trained tokens/s per chip; MFU <= {speed['mfu']:.1%} "
                 f"(training step alone <= {speed['update_mfu']:.1%})")
    sample = next((p for p in plan["programs"] if p["name"] == "sample"), None)
    if sample and sample.get("step_bytes"):
        def by_dtype(field):
            return ", ".join(f"{n / 1e9:.3f} GB {dtype}" for dtype, n in sample.get(field, {}).items())

        weights, cache = by_dtype("decode_weight_bytes"), by_dtype("decode_cache_bytes")
        lines.append(f"sampler: the last decode step reads {sample['step_bytes'] / 1e9:.3f} GB of HBM per chip"
                     + (f"; of the weights: {weights}" if weights else "")
                     + (f"; of the KV cache: {cache}" if cache else ""))
    if plan.get("sampler"):
        lines.append(sampler_line(plan["sampler"], chip, hbm_gib, sample))
    return lines


def sampler_line(s: dict, chip: Chip, hbm_gib: float, sample: dict | None) -> str:
    """The paged cache on a chip: its pool, and the rows that fit beside everything else it holds while sampling,
    reserving their longest or holding half of it (a row's mean over its life when it runs to N), with what a step
    then reads and its roofline tokens/s (docs/tpu_plans.md)."""
    kv = KVShape(**s["kv"])
    free = hbm_gib * GIB - s["without_pool_bytes"]
    G, P, N, ps = s["group"], s["prompt_width"], s["new_tokens"], s["page_size"]
    longest = rows_in_flight(free, paged_row_tokens(P, N - 1, G, ps), kv)
    half = rows_in_flight(free, paged_row_tokens(P, (N - 1) / 2, G, ps), kv)
    weights = sum((sample or {}).get("decode_weight_bytes", {}).values())
    granule = read_granule(kv.dtype, ps) if s["attention"] == "pallas" else ps  # xla reads whole pages
    reads = step_reads(weights, kv, [(P, (N - 1) // 2)] * half, page_size=ps, prompt_width=P, new_tokens=N,
                       granule=granule)
    return (f"sampler cache: pages of {ps} tokens ({s['attention']} attention), a pool of {s['pages']} pages = "
            f"{s['pool_bytes'] / GIB:.2f} GiB per chip; beside the rest ({s['without_pool_bytes'] / GIB:.2f} GiB), "
            f"{longest} rows per chip fit at their longest, {half} at half of it, where a step reads "
            f"{reads.paged / 1e9:.3f} GB ({reads.paged_over_live:.2f}x the live minimum): "
            f"{roofline_tokens_per_s(half, reads.paged, chip.hbm_gbps):,.0f} tokens/s per chip at best")


@exits_on_user_error
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jgrpo.plan", description=__doc__.split("\n\n")[0])
    parser.add_argument("config", help="a YAML config, e.g. configs/paper_gsm8k_qwen05b_on_policy.yaml")
    parser.add_argument("overrides", nargs="*", help="section.field=value overrides")
    parser.add_argument("--topology", action="append", required=True,
                        help=f"TPU topology, e.g. {', '.join(EXAMPLE_TOPOLOGIES)} (several allowed)")
    parser.add_argument("--hbm-gib", type=float, default=None, help="override the chip's HBM capacity (GiB)")
    parser.add_argument("--fit", action="store_true",
                        help="search model.remat, grpo.micro_batches, model.logprob_chunk and the mesh for the "
                             "fastest plan that fits (compiles several candidates: minutes per candidate for 1B+)")
    parser.add_argument("--packed-micro-batches", type=int, default=None,
                        help="with model.packing=true: the packed micro-batches per minibatch to cost its programs "
                             "at (default grpo.micro_batches, as padded: every row at full length; fewer for short "
                             "completions, e.g. from benchmarks/packing.py); memory is the worst case either way")
    args = parser.parse_intermixed_args(argv)  # overrides before, between or after the flags
    config = load_config(args.config, args.overrides)
    records = []
    for topology in args.topology:
        devices, chip = topology_devices(topology)
        try:
            cache: dict = {}  # compiled programs, shared with the search below
            plan = plan_iteration(config, devices, cache=cache, packed_micro_batches=args.packed_micro_batches)
        except UserError as e:  # e.g. a mesh this slice cannot hold: say which topology
            raise type(e)(f"{topology}: {e}") from None
        plan["roofline"] = roofline(plan, chip)
        hbm = args.hbm_gib if args.hbm_gib is not None else chip.hbm_gib
        print("\n".join(report_lines(topology, chip, plan, hbm)), flush=True)
        record = {"topology": topology, "hbm_gib": hbm, "fits": plan["peak_bytes"] <= hbm * GIB, **plan}
        if config.model.packing:
            record["packed_micro_batches"] = args.packed_micro_batches or config.grpo.micro_batches
        if args.fit:
            print(f"-- searching for the fastest plan that fits {hbm:g} GiB per chip on {topology}", flush=True)
            best, tried = fit(args.config, args.overrides, devices, chip, hbm, cache=cache,
                              log=lambda line: print(line, flush=True), packed_micro_batches=args.packed_micro_batches)
            if best is None:
                print(f"no plan fits: the smallest peak tried is {min(c.peak_gib for c in tried):.2f} GiB "
                      f"({len(tried)} candidates)")
            else:
                print(f"fastest plan that fits ({len(tried)} candidates tried): {' '.join(best.overrides)}")
                print("\n".join(report_lines(topology, chip, best.plan, hbm)), flush=True)
            record["fit"] = None if best is None else {"overrides": list(best.overrides), "peak_gib": best.peak_gib,
                                                       "iteration_s": best.iteration_s, "tried": len(tried)}
        records.append(record)
    print(json.dumps({"plans": records}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
