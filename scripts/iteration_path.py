"""Which files one training iteration passes through, and how often control comes back to the loop.

    python scripts/iteration_path.py [--overrides grpo.behaviour_refresh=4 ...] [--calls] [--checkout DIR]

Runs configs/tiny.yaml for two of three iterations and profiles the second (everything compiled, so what runs is
the host-side Python of an iteration, as on an accelerator; not the last, which also saves a checkpoint). It
counts, among jgrpo's own files:
  - files entered: every jgrpo/*.py with a function called during the iteration, and among them those of the
    rooms an iteration's algorithm lives in (rollout, sampling, rewards, rl, training; not the helpers of
    config, parallel, models, data);
  - returns to the loop: how many times a call from trainer.py into another jgrpo file returns there, i.e. how
    often the loop gets control back; counted per file and per room (a call into another room than the loop's
    own, training/, e.g. the rollout room's collector); and callbacks, calls into trainer.py made from another
    file (another room handing control back to the loop in the middle of its own work);
  - hops: calls from one jgrpo file into another.
Jitted functions run as compiled programs and count as one call into the file that defines them.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the jgrpo checkout profiled (--checkout: another, e.g. a worktree)
COMMON = ["reward.functions=[iteration_path:space_fraction]", "logging.samples_every=0", "checkpoint.every=0",
          "logging.progress_bar=false", "logging.tensorboard=false", "run.eval_every=0", "run.iterations=3"]


def space_fraction(prompt: str, completion: str, reference: dict) -> float:
    return completion.count(" ") / len(completion) if completion else 0.0


def _jgrpo_file(filename: str) -> str | None:
    path = Path(filename)
    try:
        return path.resolve().relative_to(ROOT).as_posix() if "jgrpo" in path.parts else None
    except ValueError:
        return None


def profile_iteration(overrides: list[str]) -> dict:
    sys.path[:0] = [str(ROOT), str(Path(__file__).resolve().parent)]
    from jgrpo.config.loading import load_config
    from jgrpo.training.trainer import Trainer

    with tempfile.TemporaryDirectory() as tmp:
        config = load_config(ROOT / "configs" / "tiny.yaml", [*COMMON, *overrides, f"run.output_dir={tmp}"])
        trainer = Trainer(config)
        try:
            trainer.train_iteration()  # compiles
            files, hops, calls = collections.Counter(), collections.Counter(), []
            loop_returns = room_returns = callbacks = 0
            stack: list[str | None] = []
            loop = "jgrpo/training/trainer.py"

            def tracer(frame, event, arg):
                nonlocal loop_returns, room_returns, callbacks
                if event == "call":
                    here = _jgrpo_file(frame.f_code.co_filename)
                    caller = next((f for f in reversed(stack) if f is not None), None)
                    stack.append(here)
                    if here is not None:
                        files[here] += 1
                        if caller is not None and caller != here:
                            hops[(caller, here)] += 1
                            calls.append(f"{caller} -> {here}:{frame.f_code.co_name}")
                            callbacks += here == loop and loop in stack[:-1]
                elif event == "return" and stack:
                    here = stack.pop()
                    caller = next((f for f in reversed(stack) if f is not None), None)
                    if here is not None and here != loop and caller == loop and _in_loop(frame):
                        loop_returns += 1
                        room_returns += _room(here) != _room(loop)

            sys.setprofile(tracer)
            try:
                trainer.train_iteration()
            finally:
                sys.setprofile(None)
        finally:
            trainer.close()
    rooms = ("jgrpo/rollout/", "jgrpo/sampling/", "jgrpo/rewards/", "jgrpo/rl/", "jgrpo/training/")
    return {"files": len(files), "algorithm_files": sum(f.startswith(rooms) for f in files),
            "hops": sum(hops.values()), "returns_to_loop": loop_returns, "returns_from_other_rooms": room_returns,
            "callbacks": callbacks,
            "file_list": sorted(files), "calls": calls}


def _room(name: str) -> str:
    """jgrpo/rollout/collector.py -> jgrpo/rollout; a top-level module is a room of its own."""
    return name.rsplit("/", 1)[0] if name.count("/") > 1 else name


def _in_loop(frame) -> bool:
    """The returning call was made by the loop itself (train_iteration or a trainer.py helper it runs)."""
    caller = frame.f_back
    while caller is not None and _jgrpo_file(caller.f_code.co_filename) is None:
        caller = caller.f_back
    return caller is not None and _jgrpo_file(caller.f_code.co_filename) == "jgrpo/training/trainer.py"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--overrides", nargs="*", default=[], help="config overrides, e.g. grpo.behaviour_refresh=4")
    parser.add_argument("--calls", action="store_true", help="print every call between two files")
    parser.add_argument("--checkout", type=Path, help="profile the jgrpo of this checkout (default: this one)")
    args = parser.parse_args(argv)
    if args.checkout:
        global ROOT
        ROOT = args.checkout.resolve()
    result = profile_iteration(args.overrides)
    print(f"files entered: {result['files']} ({result['algorithm_files']} in the algorithm's rooms)")
    for name in result["file_list"]:
        print(f"  {name}")
    print(f"calls between files (hops): {result['hops']}; returns to the loop from another file: "
          f"{result['returns_to_loop']}, from another room: {result['returns_from_other_rooms']}; "
          f"callbacks into the loop: {result['callbacks']}")
    if args.calls:
        print("\n".join(result["calls"]))
    counts = ("files", "algorithm_files", "hops", "returns_to_loop", "returns_from_other_rooms", "callbacks")
    print(json.dumps({k: result[k] for k in counts}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
