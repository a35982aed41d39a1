"""Does compressing checkpoints pay? `checkpoint.compress` on vs off, side by side in one run.

Saves a SmolLM2-135M-sized training state (params, AdamW moments after one update, a behaviour copy for
v > 1) through jgrpo's Checkpointer, asynchronously as training does, and reports per setting: the
blocking part of the save (what an iteration waits for), the whole save until the background write ends,
the CPU seconds the process spent (the background write competes with the next iteration's sampling for
the host's cores), and the bytes on disk. Weights are random normal at SmolLM2's init scale: trained
float32 weights have the same near-incompressible mantissas.

    python benchmarks/checkpoint.py [--repeats 2] [--no-behaviour]

Prints a table and, last, one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import jgrpo  # noqa: E402, F401 - first: it keeps jax on the CPU quietly where libtpu has no TPU
from jgrpo.config.errors import exits_on_user_error  # noqa: E402


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _state(behaviour: bool):
    import jax
    import jax.numpy as jnp
    import optax

    from jgrpo.models.builtin import resolve_model_dir
    from jgrpo.models.hf_format import llm_config_from_hf
    from jgrpo.models.llm import abstract_model
    from jgrpo.training.checkpoint import RunCounters, TrainState

    cfg = llm_config_from_hf(json.loads((resolve_model_dir("smollm2-135m-instruct") / "config.json").read_text()))
    _, abstract = abstract_model(cfg)
    leaves, tree = jax.tree.flatten(abstract)
    keys = jax.random.split(jax.random.key(0), len(leaves))
    params = jax.tree.unflatten(tree, [0.02 * jax.random.normal(k, x.shape, x.dtype)
                                       for k, x in zip(keys, leaves, strict=True)])
    opt = optax.adamw(1e-5)
    opt_state = opt.init(params)
    grads = jax.tree.unflatten(tree, [jax.random.normal(jax.random.fold_in(k, 1), x.shape, x.dtype)
                                      for k, x in zip(keys, leaves, strict=True)])
    _, opt_state = opt.update(grads, opt_state, params)  # moments as varied as real ones
    return TrainState(params=params, opt_state=opt_state, behaviour=jax.tree.map(jnp.copy, params) if behaviour
                      else None, reference=None, rng=jax.random.key(0), iteration=1, epoch=0, behaviour_version=0,
                      data_state={}, counters=RunCounters())


def _measure(state, compress: bool) -> dict:
    from jgrpo.config import CheckpointConfig
    from jgrpo.training.checkpoint import Checkpointer

    with tempfile.TemporaryDirectory() as run_dir:
        ckpt = Checkpointer(run_dir, CheckpointConfig(compress=compress, keep=1))
        cpu, start = _cpu_seconds(), time.perf_counter()
        ckpt.save(state)
        blocking = time.perf_counter() - start
        ckpt.wait()
        total = time.perf_counter() - start
        cpu = _cpu_seconds() - cpu
        size = sum(f.stat().st_size for f in Path(run_dir).rglob("*") if f.is_file())
        ckpt.close()
    return {"blocking_s": blocking, "total_s": total, "cpu_s": cpu, "mb": size / 1e6}


@exits_on_user_error
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2, help="saves per setting (the best is reported)")
    parser.add_argument("--no-behaviour", action="store_true", help="leave out the behaviour copy (v = 1)")
    args = parser.parse_args(argv)
    state = _state(behaviour=not args.no_behaviour)
    results = {}
    for _ in range(args.repeats):  # alternate, so load drifts hit both settings alike
        for compress in (False, True):
            m = _measure(state, compress)
            best = results.get(compress)
            results[compress] = m if best is None or m["total_s"] < best["total_s"] else best
    print(f"SmolLM2-135M training state, {os.cpu_count()} cores, best of {args.repeats}")
    print("| checkpoint.compress | blocking s | whole save s | CPU s | MB on disk |")
    print("|---|---|---|---|---|")
    for compress, m in results.items():
        print(f"| {str(compress).lower()} | {m['blocking_s']:.2f} | {m['total_s']:.2f} | {m['cpu_s']:.2f} | "
              f"{m['mb']:.0f} |")
    off, on = results[False], results[True]
    summary = {"compress_off": off, "compress_on": on, "size_ratio_on_off": on["mb"] / off["mb"],
               "cpu_ratio_on_off": on["cpu_s"] / off["cpu_s"], "total_ratio_on_off": on["total_s"] / off["total_s"]}
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
