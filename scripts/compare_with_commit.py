"""Does this checkout train exactly like commit REV? `python scripts/compare_with_commit.py REV`.

Runs the tiny config for a few iterations in each rollout mode that matters (MODES), and in the layouts and models
only this machine's comparison covers (EXTRA_MODES: packed micro-batches, a mixture of experts, an int8 sampler),
once with REV (checked out in a temporary git worktree) and once with this working tree, on this machine, in fresh
processes with the same environment, and compares, bit for bit:
  - the completion token ids every update trained on (the step batch's targets),
  - every per-iteration metric (but wall-clock times and queue waits, which no two runs share),
  - the final params (a hash of every leaf's bytes, and each leaf's L1 / L2 norms).
It prints one line per mode (`bit-for-bit equal`, or the first differences) and exits 1 if any mode differs.

A move of files, or a rewrite that must not change behaviour, is checked by running it against the commit
before. Across machines XLA's CPU code differs by processor, so exact equality is a same-machine check;
tests/test_golden_run.py holds a recorded run (`--write-golden`) to tolerances for CI.

    python scripts/compare_with_commit.py HEAD~3                 # this tree against three commits back
    python scripts/compare_with_commit.py REV --modes sync_v1 lora
    python scripts/compare_with_commit.py REV --write-golden tests/testdata/golden_run.json   # record REV's run
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

# mode -> (iterations, overrides of configs/tiny.yaml)
MODES = {
    "sync_v1": (3, ["grpo.behaviour_refresh=1"]),
    "sync_v4_recentred_m2po": (3, ["grpo.behaviour_refresh=4", "grpo.off_policy_ratio=recentred",
                                   "grpo.m2po_tau=0.05", "grpo.inner_steps=2"]),
    "window": (4, ["rollout.mode=window", "grpo.behaviour_refresh=2"]),
    "async_staleness_0": (3, ["rollout.mode=async", "rollout.max_staleness=0"]),
    "dynamic_sampling": (3, ["grpo.mask_zero_variance=true", "grpo.dynamic_sampling_rounds=2",
                             "reward.functions=[compare_with_commit:spaces_on_even_answers]"]),
    "lora": (3, ["model.lora.rank=4", "model.lora.alpha=8"]),
}
# Modes compared on this machine only (tests/test_golden_run.py holds MODES): the packed layout's passes and update,
# a mixture of experts replaying its routing (padded and packed), the sampler's int8 copy.
MOE = ["model.name=tiny-random-qwen3-moe", "model.routing_replay=rollout"]
PACKED = ["model.packing=true", "grpo.inner_steps=2", "grpo.num_minibatches=2", "grpo.masked_is=token"]
EXTRA_MODES = {
    "packing": (3, PACKED),
    "moe": (3, MOE),
    "moe_packing": (3, [*MOE, *PACKED]),
    "int8_sampler": (3, ["sampler.weights_dtype=int8"]),
}
COMMON = ["reward.functions=[compare_with_commit:space_fraction]", "optim.learning_rate=1e-2",
          "logging.samples_every=0", "checkpoint.every=0", "logging.progress_bar=false", "logging.tensorboard=false",
          "run.eval_every=0"]
# Metrics that measure the machine, not the computation: never the same twice.
WALL_CLOCK = ("time/", "rollout/trainer_wait", "rollout/producer_idle", "rollout/queue_depth", "throughput/")
# XLA:CPU code for AVX at most on x86, as tests/conftest.py compiles the suite's: the golden recordings were made
# so, and code with fused multiply-adds rounds otherwise (docs/testing.md).
CPU_ISA_FLAG = "--xla_cpu_max_isa=AVX" if platform.machine().lower() in ("x86_64", "amd64") else ""
ENV = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"--xla_force_host_platform_device_count=2 {CPU_ISA_FLAG}".strip(),
       "JGRPO_COMPILATION_CACHE": "0"}


def space_fraction(prompt: str, completion: str, reference: dict) -> float:
    """A reward with spread inside every group of a random tiny model's samples: the fraction of spaces."""
    return completion.count(" ") / len(completion) if completion else 0.0


def spaces_on_even_answers(prompt: str, completion: str, reference: dict) -> float:
    """`space_fraction` where the answer is even, else 0: about half the groups have no signal, so dynamic
    sampling draws extra rounds."""
    return space_fraction(prompt, completion, reference) if int(reference["answer"]) % 2 == 0 else 0.0


def _first(*names):
    """The first of `module:attribute` paths that imports: the same runner serves the layouts before and after."""
    for name in names:
        module, _, attr = name.partition(":")
        try:
            return getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError):
            continue
    raise ImportError(f"none of {names} imports here")


def _update_programs(steps) -> list[tuple]:
    """(owner, attribute) of the jitted optimiser step(s) of the step functions, in the layouts before and after
    they were composed of parts (one step, then a padded and a packed one)."""
    if hasattr(steps, "updates"):
        return [(steps.updates, "step")]
    return [(steps, name) for name in ("train_step", "train_step_packed") if hasattr(steps, name)]


def _recording(update, tokens: list):
    """`update` (an optimiser step) that first appends the completion tokens of its batch to `tokens`."""
    import numpy as np

    def recording_update(params, opt_state, batch, *args, **kwargs):
        tokens.append(np.asarray(batch.targets).reshape(-1, batch.targets.shape[-1]).tolist())
        return update(params, opt_state, batch, *args, **kwargs)

    return recording_update


def _params_record(params) -> dict:
    import jax
    import numpy as np

    leaves = jax.tree_util.tree_flatten_with_path(jax.device_get(params))[0]
    digest, norms = hashlib.sha256(), {}
    for path, leaf in leaves:
        array = np.ascontiguousarray(leaf)
        digest.update(array.tobytes())
        norms[jax.tree_util.keystr(path)] = [float(np.abs(array).astype(np.float64).sum()),
                                             float(np.sqrt((array.astype(np.float64) ** 2).sum()))]
    return {"sha256": digest.hexdigest(), "norms": norms}


def record_mode(mode: str, run_dir: Path) -> dict:
    """Train one mode in this process with the jgrpo that imports here; tokens, metrics and final params."""

    load_config = _first("jgrpo.config.loading:load_config", "jgrpo.config_loading:load_config")
    trainer_class = _first("jgrpo.training.trainer:Trainer", "jgrpo.trainer:Trainer")
    iterations, overrides = {**MODES, **EXTRA_MODES}[mode]
    config = load_config(ROOT / "configs" / "tiny.yaml",
                         [*COMMON, *overrides, f"run.iterations={iterations}", f"run.output_dir={run_dir}"])
    trainer = trainer_class(config)
    tokens: list = []
    for owner, name in _update_programs(trainer.steps):
        setattr(owner, name, _recording(getattr(owner, name), tokens))
    try:
        trainer.run()
    finally:
        trainer.close()
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    metrics = [{k: v for k, v in m.items() if not k.startswith(WALL_CLOCK)} for m in metrics]
    return {"tokens": tokens, "metrics": metrics, "params": _params_record(trainer.state.params)}


def record(modes: list[str], out: Path) -> None:
    with tempfile.TemporaryDirectory(prefix="jgrpo-golden-") as tmp:
        results = {mode: record_mode(mode, Path(tmp) / mode) for mode in modes}
    out.write_text(json.dumps(results))


def run_recorder(checkout: Path, modes: list[str], out: Path, env: dict | None = None) -> None:
    """Record `modes` in a fresh process that imports jgrpo from `checkout` (this file's code drives it)."""
    path = os.pathsep.join([str(checkout), str(HERE)])
    env = {**os.environ, **ENV, **(env or {}), "PYTHONPATH": path}
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--record", str(out), "--modes", *modes],
                          cwd=checkout, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"recording in {checkout} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")


def differences(ours: dict, theirs: dict, rtol: float = 0.0, atol: float = 0.0,
                atol_by_key: dict[str, float] | None = None, added: frozenset[str] = frozenset()) -> list[str]:
    """What differs between two recordings of one mode; floats within `rtol` relative or `atol` absolute (for a
    metric named in `atol_by_key`, that one) count as equal (all 0: exactly). Metrics named in `added` were made
    after `theirs` was recorded: where `theirs` lacks them, nothing is compared."""
    import math

    found = []
    if ours["tokens"] != theirs["tokens"]:
        pairs = zip(ours["tokens"], theirs["tokens"], strict=False)
        first = next((i for i, (a, b) in enumerate(pairs) if a != b), None)
        found.append(f"token ids differ (first at update {first}; {len(ours['tokens'])} vs "
                     f"{len(theirs['tokens'])} updates)")

    def close(a, b, key: str = "") -> bool:
        if isinstance(a, float) and isinstance(b, float | int) or isinstance(b, float) and isinstance(a, int):
            floor = (atol_by_key or {}).get(key, atol)
            return (a == b or (math.isnan(a) and math.isnan(b))
                    or abs(a - b) <= max(rtol * max(abs(a), abs(b)), floor))
        return a == b

    if len(ours["metrics"]) != len(theirs["metrics"]):
        found.append(f"{len(ours['metrics'])} vs {len(theirs['metrics'])} metric records")
    for i, (a, b) in enumerate(zip(ours["metrics"], theirs["metrics"], strict=False)):
        for key in sorted((set(a) | set(b)) - (added - set(b))):
            if key not in a or key not in b or not close(a[key], b[key], key):
                found.append(f"iteration {a.get('iteration', i)} {key}: {a.get(key)!r} vs {b.get(key)!r}")
    if rtol == 0 and ours["params"]["sha256"] != theirs["params"]["sha256"]:
        found.append("final params differ (sha256 of every leaf's bytes)")
    for leaf in sorted(set(ours["params"]["norms"]) | set(theirs["params"]["norms"])):
        a, b = ours["params"]["norms"].get(leaf), theirs["params"]["norms"].get(leaf)
        if a is None or b is None or not all(close(x, y) for x, y in zip(a, b, strict=True)):
            found.append(f"final params {leaf}: L1/L2 {a} vs {b}")
    return found


@contextlib.contextmanager
def worktree(rev: str):
    tmp = Path(tempfile.mkdtemp(prefix="jgrpo-rev-"))
    subprocess.run(["git", "worktree", "add", "--detach", str(tmp), rev], cwd=ROOT, check=True, capture_output=True)
    try:
        yield tmp
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(tmp)], cwd=ROOT, capture_output=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("rev", nargs="?", help="the commit to compare with (any git revision)")
    parser.add_argument("--modes", nargs="+", choices=(*MODES, *EXTRA_MODES),
                        help="default: every mode (with --write-golden: MODES, the golden file's)")
    parser.add_argument("--write-golden", type=Path, help="record REV's run into this file instead of comparing")
    parser.add_argument("--record", type=Path, help=argparse.SUPPRESS)  # internal: record here, in this process
    args = parser.parse_args(argv)
    args.modes = args.modes or [*MODES, *([] if args.write_golden else EXTRA_MODES)]
    if args.record:
        record(args.modes, args.record)
        return 0
    if not args.rev:
        parser.error("give the commit to compare with, e.g. HEAD~1")
    with tempfile.TemporaryDirectory() as tmp, worktree(args.rev) as theirs:
        run_recorder(theirs, args.modes, Path(tmp) / "theirs.json")
        if args.write_golden:
            args.write_golden.write_text(json.dumps(json.loads((Path(tmp) / "theirs.json").read_text()), indent=0))
            print(f"recorded {args.rev}'s run of {', '.join(args.modes)} in {args.write_golden}")
            return 0
        run_recorder(ROOT, args.modes, Path(tmp) / "ours.json")
        theirs_run, ours_run = (json.loads((Path(tmp) / f"{n}.json").read_text()) for n in ("theirs", "ours"))
    differ = False
    for mode in args.modes:
        # Metrics REV never logged have nothing to be compared with: named, not counted as differences.
        keys = [{k for r in run[mode]["metrics"] for k in r} for run in (ours_run, theirs_run)]
        new = frozenset(keys[0] - keys[1])
        found = differences(ours_run[mode], theirs_run[mode], added=new)
        differ |= bool(found)
        updates = len(ours_run[mode]["tokens"])
        print(f"{mode:<24} " + (f"bit-for-bit equal ({updates} updates' token ids, "
                                f"{len(ours_run[mode]['metrics'])} metric records, final params)" if not found
                                else "DIFFERS: " + "; ".join(found[:5]) + (" ..." if len(found) > 5 else ""))
              + (f"; new metrics, not compared: {', '.join(sorted(new))}" if new else ""))
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
