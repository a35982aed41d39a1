"""Regenerate docs/tpu_plans.md: every shipped config planned for v5e-8, v5p-8 and v6e-8 (`jgrpo.plan`).

    python benchmarks/tpu_plans.py [--configs configs/a.yaml ...] [--topologies v5e:2x4 ...]

Compiles each config's iteration for each topology with libtpu's compiler (no TPU needed; see
`jgrpo/plan.py`) and writes the table of the docs page between its markers, row by row as results come in
(a long run can be stopped and its rows kept). Identical programs of different configs compile once per
topology (the GSM8K variants share their sampler). Takes about 20 minutes per topology on a 2-core machine
with the scanned decode layers (TPU default), a third of it the two DeepScaleR (1.5B) configs.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jgrpo.config.errors import exits_on_user_error  # noqa: E402
from jgrpo.config.loading import load_config  # noqa: E402
from jgrpo.plan import GIB, plan_iteration, topology_devices  # noqa: E402
from jgrpo.planning.roofline import roofline  # noqa: E402

PAGE = "docs/tpu_plans.md"
BEGIN, END = "<!-- plans:begin -->", "<!-- plans:end -->"
TOPOLOGIES = ("v5e:2x4", "v5p:2x2x2", "v6e:2x4")
# Small models first: their rows arrive in minutes, DeepScaleR's last.
ORDER = ("tiny", "quickstart", "smollm2", "paper_gsm8k", "paper_deepscaler")


def row(config_path: str, topology: str, plan: dict, hbm_gib: float) -> str:
    speed = plan["roofline"]
    sample = next(p for p in plan["programs"] if p["name"] == "sample")
    peak = plan["peak_bytes"] / GIB
    verdict = "yes" if peak <= hbm_gib else "**no**"
    bound = speed["bound"][max(speed["program_s"], key=lambda n: speed["program_s"][n] *
                               next(p["runs"] for p in plan["programs"] if p["name"] == n))]
    return (f"| `{os.path.basename(config_path)}` | {topology} | {peak:.2f} / {hbm_gib:g} | {verdict} "
            f"| {plan['peak_program']} | {plan['compile_s']:.0f} ({sample['compile_s']:.0f}) "
            f"| {speed['iteration_s']:.3g} ({speed['sample_s']:.3g} + {speed['train_s']:.3g}) | {bound} "
            f"| {speed['sample_tokens_per_s_per_chip']:,.0f} | {speed['train_tokens_per_s_per_chip']:,.0f} "
            f"| {speed['mfu']:.1%} | {speed['update_mfu']:.1%} | {sample['step_bytes'] / 1e9:.3f} |")


HEADER = ("| config | topology | peak GiB per chip / HBM | fits | peak during | compile s (sampler) "
          "| roofline s per iteration (sample + train) | slowest program bound by | sampled tok/s/chip "
          "| trained tok/s/chip | MFU at best | training step MFU at best | last decode step GB |"
          "\n|---|---|---|---|---|---|---|---|---|---|---|---|---|")


def write(rows: list[str], stamp: str, page: str = PAGE) -> None:
    text = open(page).read()
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    body = f"\n{stamp}\n\n{HEADER}\n" + "\n".join(rows) + "\n"
    open(page, "w").write(text[:start] + body + text[end:])


@exits_on_user_error
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", nargs="*", default=None)
    parser.add_argument("--topologies", nargs="*", default=list(TOPOLOGIES))
    parser.add_argument("--page", default=PAGE, help="the page whose table is rewritten (default %(default)s)")
    args = parser.parse_args()
    configs = args.configs or sorted(glob.glob("configs/*.yaml"),
                                     key=lambda p: (next(i for i, k in enumerate(ORDER)
                                                         if os.path.basename(p).startswith(k)), p))
    overrides = ["checkpoint.every=0", "logging.tensorboard=false"]
    rows, records, started = [], [], time.time()
    import jax
    stamp = (f"Generated {time.strftime('%Y-%m-%d')} by `python benchmarks/tpu_plans.py` (jax {jax.__version__}, "
             f"libtpu's compiler on a CPU machine, no TPU).")
    for topology in args.topologies:
        devices, chip = topology_devices(topology)
        cache: dict = {}  # programs compiled for this topology, shared across configs
        for path in configs:
            t = time.time()
            config = load_config(path, overrides)
            plan = plan_iteration(config, devices, cache=cache)
            plan["roofline"] = roofline(plan, chip)
            rows.append(row(path, topology, plan, chip.hbm_gib))
            records.append({"config": path, "topology": topology, **plan})
            write(rows, stamp, args.page)
            print(f"{path} on {topology}: {time.time() - t:.0f} s; {rows[-1]}", flush=True)
    print(json.dumps({"plans": records, "seconds": time.time() - started}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
