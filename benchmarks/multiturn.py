"""Multi-turn episodes, side by side: `env.schedule: pool` vs `turn_sync`, with slow and fast environments.

SmolLM2-135M-Instruct on CPU plays a scripted environment of 3-5 turns per episode (the number drawn from the
episode's seed; each reply a short user message) with an injected latency per environment step of 0, 1x and 4x
the median turn's decode time, measured in the run (the median drawn tokens of a turn x the decode step time of
the episodes' sampler, every slot decoding, timed over two chunks). Schedules: `turn_sync`; `pool`
with `env.resume_after` set to the latency in decode chunks (0 for an instant environment: what a user sets for an
environment of known latency, so the host rarely stalls the pool); `pool` with the default `resume_after: 1`
whatever the latency; and both schedules with half as many slots as episodes (`sampler.slots`: the memory for
half the rows' keys/values; `turn_sync` then plays the episodes in two waves, `pool` lets a paused episode give its
slot to the next one and resume in a free slot). One environment worker per episode (`--workers`), so an episode
never queues behind another's latency. Each runs the same batch and keys, after one untimed run that
compiles. Useful tokens/s counts the tokens in the loss (drawn by the sampler, not appended) over the wall time of
the batch's episodes.

    python benchmarks/multiturn.py                       # 4 prompts x 4 episodes, 48 tokens per turn
    python benchmarks/multiturn.py --chunk 48            # one decode chunk per turn (the host sees turns less often)
    python benchmarks/multiturn.py --latencies 0,1       # only these latencies (in median turns)

Prints a table, then one JSON line with every figure. Targets (#37): pool >= 1.5x turn_sync at 1x latency, and
never slower at 0.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from hardware import usable_cores  # benchmarks/ is on sys.path when run as a script

from jgrpo.config.errors import exits_on_user_error
from jgrpo.envs.base import Environment, StepResult

ROOT = Path(__file__).resolve().parents[1]
LATENCY = "JGRPO_BENCH_LATENCY_S"  # read by the environment in its worker process


class ScriptedTurns(Environment):
    """3-5 turns (from the seed); each reply asks for a one-word answer or an explanation (from the seed: turns of
    varied length, as an agent's short tool calls and long reasoning); reward 1 at the end."""

    ASKS = ("Answer in one word: is that right?", "Explain your reasoning in a few sentences.")

    def reset(self, row, seed):
        self.random = random.Random(seed)
        self.turns, self.seen = self.random.randint(3, 5), 0
        return [{"role": "user", "content": row["question"] + " " + self.random.choice(self.ASKS)}]

    def step(self, turn):
        time.sleep(float(os.environ.get(LATENCY, "0")))
        self.seen += 1
        if self.seen >= self.turns:
            return StepResult([], 1.0, True)
        return StepResult([{"role": "user", "content": self.random.choice(self.ASKS)}], 0.0, False)


def config(args, run_dir):
    from jgrpo.config.loading import load_config

    return load_config(ROOT / "configs" / "quickstart.yaml", [
        f"run.output_dir={run_dir}", "env.name=multiturn:ScriptedTurns", f"env.num_workers={args.workers}",
        f"sampler.max_new_tokens={args.turn}", f"env.max_total_tokens={args.total}", "env.max_append_tokens=32",
        "env.max_turns=5", "env.timeout_s=3600", f"data.batch_size={args.prompts}", "grpo.num_generations=4",
        "sampler.temperature=1.0",
        f"sampler.decode_chunk={args.chunk}", "logging.samples_every=0", "checkpoint.every=0",
        "data.max_prompt_length=128", "sampler.prompt_bucket=32"])


def chunk_time(trainer, prompts) -> float:
    """Seconds per decode chunk of the episodes' own sampler (its interactive decode step, every slot of a slot
    per episode decoding): the unit of `env.resume_after` and of a turn's decode time in this run."""
    import jax

    sampler, params = trainer.episodes.sampler, trainer.state.params
    state = sampler.advance(params, sampler.start(params, prompts, jax.random.key(0)), 1)  # compiled before
    jax.block_until_ready(state.pool)
    start = time.perf_counter()
    state = sampler.advance(params, state, 2)
    jax.block_until_ready(state.pool)
    return (time.perf_counter() - start) / 2


def turn_lengths(loss_mask: np.ndarray) -> list[int]:
    """Drawn tokens of each turn: the runs of True in each row's loss mask."""
    lengths = []
    for row in loss_mask:
        edges = np.diff(np.concatenate([[0], row.astype(np.int8), [0]]))
        lengths += list(np.flatnonzero(edges == -1) - np.flatnonzero(edges == 1))
    return lengths


SCHEDULES = ("turn_sync", "pool", "pool, resume_after 1", "turn_sync, half the slots", "pool, half the slots")


def play(trainer, batch, schedule: str, latency: float, chunk_s: float = 1.0):
    """(seconds, useful tokens, rollout) of the batch's episodes with a fresh set of workers at `latency`."""
    import dataclasses

    from jgrpo.envs.workers import EnvironmentWorkers

    runner, source = trainer.episodes, trainer.collector.source
    os.environ[LATENCY] = str(latency)
    runner.workers.close()
    runner.workers = EnvironmentWorkers(trainer.config)
    # pool: rejoin after as many decode chunks as the environment takes (0 for an instant one), so the host rarely
    # waits; "resume_after 1" is the default whatever the latency.
    name = schedule.split(",")[0]
    resume_after = 1 if "resume_after 1" in schedule else math.ceil(latency / chunk_s - 1e-9)
    runner.env = dataclasses.replace(trainer.config.env, schedule=name, resume_after=resume_after)
    rows = len(batch) * trainer.config.grpo.num_generations
    runner.sampler = runner.sampler.replace(slots=rows // 2 if "half" in schedule else None)
    opened = source._opened(batch)
    prompts = source.prompt_arrays(opened, trainer.state.counters)
    start = time.perf_counter()
    rollout = source.sample(trainer.state.params, opened, prompts, source.sample_key(0))
    seconds = time.perf_counter() - start
    failed = {k: v for k, v in rollout.metrics.items() if k.startswith("env/failures") and v}
    if failed:  # e.g. a latency over env.timeout_s: the time would not be of whole episodes
        raise RuntimeError(f"{schedule} at latency {latency:.2f} s: episodes failed ({failed})")
    return seconds, int(np.asarray(rollout.samples.loss_mask).sum()), rollout


@exits_on_user_error
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=4, help="prompts per batch (x 4 episodes)")
    p.add_argument("--turn", type=int, default=48, help="sampler.max_new_tokens: tokens per turn")
    p.add_argument("--total", type=int, default=384, help="env.max_total_tokens")
    p.add_argument("--chunk", type=int, default=0, help="sampler.decode_chunk (0: the episodes' default)")
    p.add_argument("--workers", type=int, default=0,
                   help="env.num_workers (0: one per episode, so no episode queues behind another's latency)")
    p.add_argument("--latencies", default="0,1,4", help="latencies to run, in median turns (comma-separated)")
    args = p.parse_args()
    args.workers = args.workers or 4 * args.prompts
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # multiturn:ScriptedTurns in the workers
    from jgrpo.training.trainer import Trainer

    with tempfile.TemporaryDirectory() as run_dir:
        trainer = Trainer(config(args, run_dir))
        try:
            batch = next(trainer.data)
            play(trainer, batch, "pool", 0.0)  # compiles the episodes' programs
            play(trainer, batch, "pool, half the slots", 0.0)
            play(trainer, batch, "turn_sync, half the slots", 0.0)
            seconds, _, first = play(trainer, batch, "turn_sync", 0.0)
            print(f"compiled; turn_sync at 0 latency {seconds:.1f} s", file=sys.stderr, flush=True)
            source = trainer.collector.source
            chunk_s = chunk_time(trainer, source.prompt_arrays(source._opened(batch), trainer.state.counters))
            trainer.episodes.opened.clear()
            per_step = chunk_s / trainer.episodes.sampler.decode_chunk
            print(f"decode step {per_step * 1e3:.1f} ms", file=sys.stderr, flush=True)
            median_turn = statistics.median(turn_lengths(np.asarray(first.samples.loss_mask)))
            turn_s = median_turn * per_step
            results = []
            for factor in (float(x) for x in args.latencies.split(",")):
                row = {"latency_x": factor, "latency_s": factor * turn_s}
                for schedule in SCHEDULES:
                    seconds, useful, rollout = play(trainer, batch, schedule, factor * turn_s, chunk_s)
                    print(f"latency {factor:g}x ({factor * turn_s:.2f} s), {schedule}: {seconds:.1f} s, "
                          f"{useful} useful tokens, {rollout.metrics['env/turns']:.1f} turns", file=sys.stderr,
                          flush=True)
                    row[schedule] = {"seconds": seconds, "useful_tokens": useful, "tokens_per_s": useful / seconds,
                                     "wait_s": rollout.metrics["env/wait_s"], "turns": rollout.metrics["env/turns"]}
                for schedule in SCHEDULES:  # against turn_sync with as many slots
                    baseline = row["turn_sync, half the slots" if "half" in schedule else "turn_sync"]
                    row[schedule]["vs_turn_sync"] = row[schedule]["tokens_per_s"] / baseline["tokens_per_s"]
                results.append(row)
        finally:
            trainer.close()
    print(f"{usable_cores()} cores; {args.prompts} prompts x 4 episodes of 3-5 turns, {args.turn} tokens per turn; "
          f"decode step {per_step * 1e3:.1f} ms, median turn {median_turn:.0f} tokens = {turn_s:.2f} s",
          file=sys.stderr)
    print("\n| latency | schedule | useful tok/s | vs turn_sync (same slots) | s | host waited |")
    print("|---|---|---:|---:|---:|---:|")
    for r in results:
        for schedule in SCHEDULES:
            x = r[schedule]
            print(f"| {r['latency_x']:g}x ({r['latency_s']:.2f} s) | {schedule} | {x['tokens_per_s']:.1f} | "
                  f"{x['vs_turn_sync']:.2f}x | {x['seconds']:.1f} | {x['wait_s']:.1f} s |")
    print(json.dumps({"args": vars(args), "decode_step_s": per_step, "median_turn_tokens": median_turn,
                      "results": results}))


if __name__ == "__main__":
    sys.exit(main())
