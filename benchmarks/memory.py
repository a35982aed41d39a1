"""Peak memory of one GRPO training step: jgrpo (with/without remat, chunked/unchunked log-probs) vs PyTorch.

Same step and batch as benchmarks/train_step.py (SmolLM2-135M-Instruct, float32, 16 x 192 tokens).

- jgrpo: XLA's compiled memory analysis of the jitted update, nothing executed: arguments (params, AdamW
  state, batch) + outputs + temporaries - donated (aliased) buffers. That is the live set XLA plans for the
  step's peak, exactly, per device.
- PyTorch: measured, in a fresh process with glibc told to mmap every allocation above 64 KiB
  (MALLOC_MMAP_THRESHOLD_), so freed tensors leave the resident set at once and RSS follows live tensors.
  The figure is the peak RSS sampled every millisecond during a warm step (AdamW state already created)
  minus the RSS of the process after `import torch, transformers` and before the model exists: params,
  grads, AdamW state, batch and activations, like the jgrpo figure. Allocator slack makes it an upper
  bound (tracemalloc would miss tensor storage entirely, which bypasses Python's allocator).

    python benchmarks/memory.py
    python benchmarks/memory.py --skip torch --chunks 64,128 --remat none,full,dots

Prints a table, then one JSON line with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from train_step import add_batch_arguments, build_model, jgrpo_step_setup, synthetic_batch  # noqa: E402

from jgrpo.config.errors import exits_on_user_error  # noqa: E402

MiB = 2**20


def jgrpo_compiled_bytes(args, host, remat: str, chunk: int) -> dict:
    import jax
    import jax.numpy as jnp

    graphdef, params, _ = build_model(args.model, dtype=args.dtype, remat=remat)
    steps, batch, opt_state = jgrpo_step_setup(graphdef, params, host, chunk=chunk, generations=args.generations)
    compiled = steps.updates.step.lower(params, opt_state, batch, jnp.int32(0), jnp.bool_(True)).compile()
    m = compiled.memory_analysis()
    del compiled, params, opt_state, batch
    jax.clear_caches()
    peak = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
    return {"peak_bytes": peak, "temp_bytes": m.temp_size_in_bytes, "argument_bytes": m.argument_size_in_bytes}


def lora_vs_full(args, host, rank: int, remat: str = "full", chunk: int = 32) -> dict:
    """One training step with full fine-tuning and with LoRA rank `rank` (all seven projections, alpha = 2 rank;
    float32 and bfloat16 base), side by side: compiled peak bytes (the base is an argument, never donated) and
    the median step time."""
    import statistics

    import jax
    import jax.numpy as jnp

    from jgrpo.models.hf import load_model
    from jgrpo.models.llm import ModelOptions
    from jgrpo.models.lora import LORA_TARGETS, split_adapters

    out = {}
    adapters = (rank, 2.0 * rank, LORA_TARGETS)
    # The third side keeps the frozen base in bfloat16 (model.param_dtype) while the adapters stay float32.
    for name, lora, base_dtype in (("full", (0, 16.0, ()), args.dtype), (f"lora{rank}", adapters, args.dtype),
                                   (f"lora{rank}, bfloat16 base", adapters, "bfloat16")):
        graphdef, params, cfg = load_model(args.model, ModelOptions(param_dtype=base_dtype, compute_dtype=args.dtype,
                                                                    remat=remat), lora=lora)
        frozen = None
        if lora[0]:
            params, frozen = split_adapters(params)
        steps, batch, opt_state = jgrpo_step_setup(graphdef, params, host, chunk=chunk, generations=args.generations,
                                                   frozen=frozen)
        step_args = (params, opt_state, batch, jnp.int32(0), jnp.bool_(True))
        m = steps.updates.step.lower(*step_args, frozen=frozen).compile().memory_analysis()
        times = []
        for _ in range(1 + args.lora_steps):  # the first call compiles
            start = time.perf_counter()
            params, opt_state, _ = jax.block_until_ready(steps.updates.step(params, *step_args[1:], frozen=frozen))
            step_args = (params, opt_state, *step_args[2:])
            times.append(time.perf_counter() - start)
        out[name] = {"peak_bytes": m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
                     - m.alias_size_in_bytes, "temp_bytes": m.temp_size_in_bytes,
                     "trainable": sum(x.size for x in jax.tree.leaves(params)), "seconds": statistics.median(times[1:])}
        del steps, batch, opt_state, params, frozen, step_args
        jax.clear_caches()
    return out


def torch_rss_worker(args) -> None:
    """Runs in its own process (see `torch_peak_bytes`); prints the peak RSS delta of one warm step."""
    import psutil
    import torch  # noqa: F401 - imported before the baseline so its own memory is not counted
    import transformers  # noqa: F401
    from train_step import bench_torch

    process = psutil.Process()
    baseline = process.memory_info().rss
    peak = [0]
    sampling = threading.Event()

    def sample():
        while True:
            if sampling.is_set():
                peak[0] = max(peak[0], process.memory_info().rss)
            time.sleep(0.001)

    threading.Thread(target=sample, daemon=True).start()
    cfg = build_model(args.model)[2]
    host = synthetic_batch(cfg, prompts=args.prompts, generations=args.generations, prompt_len=args.prompt_len,
                           new_tokens=args.new_tokens)
    # bench_torch runs one warm-up step (creates AdamW state) then `steps` timed steps; sample during those.
    args.steps = 1
    original_perf = time.perf_counter
    calls = [0]

    def perf_counter():  # the 3rd call starts the timed step (1st/2nd bracket the warm-up)
        calls[0] += 1
        if calls[0] == 3:
            sampling.set()
        return original_perf()

    time.perf_counter = perf_counter
    bench_torch(args, host)
    print("RESULT " + json.dumps({"peak_bytes": peak[0] - baseline}))


def torch_peak_bytes(args) -> dict:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    cmd = [sys.executable, __file__, "--torch-worker", "--model", args.model, "--dtype", args.dtype,
           "--prompts", str(args.prompts), "--generations", str(args.generations), "--prompt-len",
           str(args.prompt_len), "--new-tokens", str(args.new_tokens)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"torch worker failed (exit {proc.returncode}): {proc.stderr.strip()[-600:]}")
    return json.loads(lines[-1][len("RESULT "):])


@exits_on_user_error
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_batch_arguments(p)
    p.add_argument("--remat", default="none,full,dots", help="comma-separated remat policies")
    p.add_argument("--chunks", default="32,128", help="comma-separated log-prob chunks (>= new tokens = unchunked)")
    p.add_argument("--skip", action="append", default=[], choices=("jgrpo", "torch", "lora"))
    p.add_argument("--lora-rank", type=int, default=16, help="LoRA rank of the LoRA-vs-full comparison")
    p.add_argument("--lora-steps", type=int, default=3, help="timed steps per side of that comparison")
    p.add_argument("--torch-worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.torch_worker:
        torch_rss_worker(args)
        return

    cfg = build_model(args.model)[2]
    host = synthetic_batch(cfg, prompts=args.prompts, generations=args.generations, prompt_len=args.prompt_len,
                           new_tokens=args.new_tokens)
    rows, length = args.prompts * args.generations, args.prompt_len + args.new_tokens - 1
    figures, errors = [], {}
    if "jgrpo" not in args.skip:
        for remat in args.remat.split(","):
            for chunk in (int(c) for c in args.chunks.split(",")):
                r = jgrpo_compiled_bytes(args, host, remat, chunk)
                figures.append({"side": "jgrpo", "remat": remat, "chunk": chunk, **r})
                print(f"  jgrpo remat={remat} chunk={chunk}: {r['peak_bytes'] / MiB:.0f} MiB", file=sys.stderr)
    if "torch" not in args.skip:
        try:
            figures.append({"side": "torch", "remat": "none", "chunk": None, **torch_peak_bytes(args)})
        except Exception as e:  # noqa: BLE001 - report, keep the jgrpo figures
            errors["torch"] = f"{type(e).__name__}: {e}"

    print(f"| {rows} x {length + 1} tokens, {args.model}, {args.dtype} | remat | log-prob chunk | peak MiB | "
          "of which temporaries MiB | vs PyTorch |")
    print("|---|---|---|---|---|---|")
    torch_peak = next((f["peak_bytes"] for f in figures if f["side"] == "torch"), None)
    for f in figures:
        chunk = "-" if f["chunk"] is None else (f"{f['chunk']}" if f["chunk"] < args.new_tokens
                                                else f"{f['chunk']} (unchunked)")
        temp = f"{f['temp_bytes'] / MiB:.0f}" if "temp_bytes" in f else "-"
        ratio = f"{f['peak_bytes'] / torch_peak:.2f}x" if torch_peak else "-"
        method = "compiled" if f["side"] == "jgrpo" else "RSS"
        print(f"| {f['side']} ({method}) | {f['remat']} | {chunk} | {f['peak_bytes'] / MiB:.0f} | {temp} | {ratio} |")
    if errors:
        print(f"| torch | {errors['torch'][:100]} |")
    lora = {}
    if "lora" not in args.skip:  # the target: LoRA rank 16 at <= 0.6x the memory of full fine-tuning
        lora = lora_vs_full(args, host, args.lora_rank)
        full = lora["full"]
        print("\n| remat full, log-prob chunk 32 | trainable params | peak MiB | vs full | step s | vs full |")
        print("|---|---|---|---|---|---|")
        for name, f in lora.items():
            print(f"| {name} | {f['trainable'] / 1e6:.2f}M | {f['peak_bytes'] / MiB:.0f} | "
                  f"{f['peak_bytes'] / full['peak_bytes']:.2f}x | {f['seconds']:.2f} | "
                  f"{f['seconds'] / full['seconds']:.2f}x |")
    print(json.dumps({"benchmark": "memory", "model": args.model, "dtype": args.dtype, "rows": rows,
                      "tokens_per_row": length, "results": figures, "errors": errors, "lora_vs_full": lora}))


if __name__ == "__main__":
    sys.exit(main())
