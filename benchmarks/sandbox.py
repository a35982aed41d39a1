"""The python tool's sandbox: what bubblewrap costs per call, and per iteration of a python-tool environment.

1. Calls per second of `print(1)` through `PythonTool.call` under `env.sandbox: bwrap` and `process`, the two
   interleaved call by call (so both see the same machine), plus a heavier program (`import json, re, collections`
   and a loop of 10^5) that a model's code is more like.
2. One iteration of a python-tool environment (configs/tiny_tools.yaml's random model, every turn opened with a
   whole python call: 2 prompts x 4 episodes x 2 turns, 16 calls on 1 environment worker): the iteration's time and
   `env/wait_s` (the host's wait for the environments) under each mode; iterations 2-5 of each run (the first
   compiles), both runs in this process one after the other.

    python benchmarks/sandbox.py                 # both parts
    python benchmarks/sandbox.py --calls 200 --no-run

Prints a table, then one JSON line with every figure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent))  # this checkout's jgrpo, installed or not

ROOT = Path(__file__).resolve().parent.parent
HEAVIER = "import json, re, collections\nprint(sum(i * i for i in range(10 ** 5)))"
CALL = '<tool_call>{"name": "python", "arguments": {"code": "print(6 * 7)"}}</tool_call>'


def calls_per_second(calls: int) -> dict:
    from jgrpo.config import EnvConfig
    from jgrpo.envs.sandbox import PythonTool

    tools = {mode: PythonTool(EnvConfig(sandbox=mode)) for mode in ("bwrap", "process")}
    out = {}
    for name, code in (("print", "print(1)"), ("heavier", HEAVIER)):
        seconds = {mode: [] for mode in tools}
        for _ in range(calls):
            for mode, tool in tools.items():
                start = time.perf_counter()
                tool.call({"code": code})
                seconds[mode].append(time.perf_counter() - start)
        for mode, s in seconds.items():
            out[f"{name}_{mode}_calls_per_s"] = 1 / statistics.median(s)
        bwrap, process = statistics.median(seconds["bwrap"]), statistics.median(seconds["process"])
        out[f"{name}_bwrap_over_process_s"] = bwrap / process
    return out


def iteration(mode: str, run_dir: str) -> dict:
    from jgrpo.config.loading import load_config
    from jgrpo.training.trainer import Trainer

    config = load_config(ROOT / "configs" / "tiny_tools.yaml", [
        f"run.output_dir={run_dir}", "env.tools=[python]", f"env.turn_prefix={CALL}", "env.max_turns=2",
        f"env.sandbox={mode}", "run.iterations=5", "checkpoint.every=0", "logging.samples_every=0",
        "env.num_workers=1"])
    trainer = Trainer(config)
    try:
        records = [trainer.train_iteration() for _ in range(5)][1:]
    finally:
        trainer.close()
    assert all(r["env/tool_calls"] == 16 and r["env/failed"] == 0 for r in records), records
    return {f"iteration_{mode}_s": statistics.mean(r["time/iteration"] for r in records),
            f"env_wait_{mode}_s": statistics.mean(r["env/wait_s"] for r in records)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=100, help="calls of each program in each mode")
    parser.add_argument("--no-run", action="store_true", help="only the calls, not the training iterations")
    args = parser.parse_args()
    figures = calls_per_second(args.calls)
    print(f"{'program':10s} {'bwrap calls/s':>14s} {'process calls/s':>16s} {'bwrap / process (s)':>20s}")
    for name in ("print", "heavier"):
        print(f"{name:10s} {figures[f'{name}_bwrap_calls_per_s']:14.1f} {figures[f'{name}_process_calls_per_s']:16.1f}"
              f" {figures[f'{name}_bwrap_over_process_s']:20.2f}")
    if not args.no_run:
        with tempfile.TemporaryDirectory() as tmp:
            for mode in ("bwrap", "process"):
                figures.update(iteration(mode, f"{tmp}/{mode}"))
        figures["iteration_bwrap_over_process"] = figures["iteration_bwrap_s"] / figures["iteration_process_s"]
        print(f"{'iteration':10s} {'bwrap s':>14s} {'process s':>16s} {'bwrap / process':>20s}")
        print(f"{'time':10s} {figures['iteration_bwrap_s']:14.2f} {figures['iteration_process_s']:16.2f} "
              f"{figures['iteration_bwrap_over_process']:20.2f}")
        print(f"{'env wait':10s} {figures['env_wait_bwrap_s']:14.2f} {figures['env_wait_process_s']:16.2f}")
    print(json.dumps({k: round(v, 4) for k, v in figures.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
