"""The paged KV cache against the slot pool it replaced: rows in flight and bytes a step reads on a TPU slice
(compiled deviceless, `jgrpo.plan`), tokens/s and memory on this CPU (both engines in the same run).

TPU (v5e:2x4, `jgrpo.planning.paged_rows`): for configs/paper_deepscaler_r1distill15b_v10.yaml and
configs/paper_gsm8k_qwen05b_v10.yaml sampling a whole window (v = 10 batches of prompts at once), the sampler
program is compiled for the slice; what the chip holds while sampling without the page pool is what rows in flight
fit beside. Rows hold their live pages: in flight, a row holds what it has fed so far, which over a row's life is
half its final length on average (more precisely E[L^2] / 2 E[L] over the rows' final lengths L, the time-average
of a continuously batched pool). Lengths: GSM8K, SmolLM2-135M's own on the GSM8K-style prompts below (measured in
this run, cut at the config's 200 tokens; the 0.5B model is not on this machine); DeepScaleR, every row at the
config's 4096 cap (R1-Distill-Qwen-1.5B's own mean at 8K context is ~5,500 tokens: DeepScaleR's report, so at 4096
nearly every row is cut). `_at_mean` holds every row at its final mean length instead, `_reserved` at its maximum.

CPU: SmolLM2-135M-Instruct, 8 GSM8K-style prompts of ~200 tokens x G = 16, up to 512 new tokens at the model's own
lengths, temperature 1, the same key on both engines; the slot pool is run from a git worktree of `--rev` (the
commit before the paged cache) in a fresh process, the paged engine from this tree, each program compiled ahead
(`jit(...).lower(...).compile()`) and timed on one call, peak memory = the process's resident-set peak during that
call over its size before it. `--kv-pages` (`sampler.kv_pages`: a budget of pages; the run prints the most its rows
held at once, and a budget at or above that preempts none) and `--shrink` (`sampler.shrink`, for long CPU runs with
a long tail of lengths) set the paged run's options; with either, the paged engine runs at its defaults as well.

    python benchmarks/paged_kv.py --kv-pages 1792 --shrink 3   # docs/benchmarks.md (~15 min on 2 cores)
    python benchmarks/paged_kv.py --skip-tpu                   # the CPU part only, the paged engine's defaults

Prints a table, then one JSON line with every figure.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent.parent))  # this checkout's jgrpo, installed or not

ROOT = Path(__file__).resolve().parent.parent
QUESTIONS = ROOT / "tests" / "testdata" / "gsm8k_sample.jsonl"
# The paper configs' system prompt, and a worked example so that prompts are ~200 tokens (as GSM8K few-shot is).
SYSTEM = ("Please reason step by step, and write the final answer as a number after '####'. For example: "
          "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many "
          "clips did Natalia sell altogether in April and May? Natalia sold 48 / 2 = 24 clips in May. Natalia sold "
          "48 + 24 = 72 clips altogether in April and May. #### 72")
REV = "91affd5"  # the commit before the paged cache
CONFIGS = {"deepscaler": ("configs/paper_deepscaler_r1distill15b_v10.yaml", []),
           "gsm8k": ("configs/paper_gsm8k_qwen05b_v10.yaml", ["data.batch_size=80"])}  # 10 batches of 8 prompts


# ------------------------------------------------------------------ CPU: both engines, one process each


def worker(out: Path) -> None:
    """Sample once to compile, then once timed; write tokens/s, lengths, peak memory (this process)."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    from jgrpo.data.prompts import chat_prompt_ids, left_pad, pad_id_for
    from jgrpo.models.hf import load_model, load_tokenizer
    from jgrpo.sampling.sampler import Prompts, Sampler, SamplingMethod, stop_ids_for

    tokenizer = load_tokenizer("smollm2-135m-instruct")
    graphdef, params, _ = load_model("smollm2-135m-instruct")
    questions = [json.loads(line)["question"] for line in QUESTIONS.read_text().splitlines() if line.strip()]
    tokens, mask = left_pad([chat_prompt_ids(tokenizer, q, SYSTEM) for q in questions[:8]],
                            pad_id=pad_id_for(tokenizer), bucket=16)
    options = json.loads(os.environ.get("PAGED_KV_OPTIONS", "{}"))
    sampler = Sampler(graphdef, max_new_tokens=512, num_samples=16, method=SamplingMethod(temperature=1.0),
                      stop_ids=stop_ids_for(tokenizer), pad_id=pad_id_for(tokenizer), **options)
    # Compiled ahead of the timed call (the program `generate` runs, without running it once: half the time).
    try:
        from jgrpo.sampling.decode_loop import sample
    except ImportError:  # the slot pool's commit
        from jgrpo.sampling.slot_pool import sample
    prompts, cfg = sampler.checked(params, Prompts(tokens, mask))
    spec = sampler.spec(*tokens.shape, cfg)
    key, version = jax.random.key(1), np.int32(0)
    compiled = sample.lower(graphdef, params, prompts, key, version, spec=spec).compile()
    before, peak = _rss(), [0]
    done = threading.Event()

    def watch():
        while not done.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(0.005)

    watcher = threading.Thread(target=watch)
    watcher.start()
    start = time.perf_counter()
    out_ = compiled(params, prompts, key, version)
    jax.block_until_ready(out_.tokens)
    seconds = time.perf_counter() - start
    done.set()
    watcher.join()
    lengths = np.asarray(out_.lengths)
    preempted = int(np.asarray(out_.preempted).sum()) if getattr(out_, "preempted", None) is not None else 0
    out.write_text(json.dumps({"seconds": seconds, "tokens": int(lengths.sum()), "lengths": lengths.tolist(),
                               "prompt_lengths": mask.sum(1).tolist(), "prompt_width": int(mask.shape[1]),
                               "peak_bytes": max(peak[0] - before, 0), "preempted": preempted,
                               "ids": np.asarray(out_.tokens).tolist()}))


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def run_worker(checkout: Path, options: dict | None = None) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        env = {**os.environ, "PYTHONPATH": str(checkout), "JAX_PLATFORMS": "cpu",
               "PAGED_KV_OPTIONS": json.dumps(options or {})}
        proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker", str(out)], cwd=checkout,
                              env=env, capture_output=True, text=True)
        if proc.returncode:
            raise RuntimeError(f"the worker in {checkout} failed:\n{proc.stderr[-4000:]}")
        return json.loads(out.read_text())


@contextlib.contextmanager
def worktree(rev: str):
    tmp = Path(tempfile.mkdtemp(prefix="jgrpo-rev-"))
    subprocess.run(["git", "worktree", "add", "--detach", str(tmp), rev], cwd=ROOT, check=True, capture_output=True)
    try:
        yield tmp
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(tmp)], cwd=ROOT, capture_output=True)


def live_page_peak(lengths: list[int], prompt_lengths: list[int], group: int, page_size: int) -> int:
    """The most pages rows of these final lengths hold at once when all start together (static batching, every
    row in a slot): at step t each row still drawing holds its t fed tokens' pages, and each prompt with a row
    still drawing its own pages. A `sampler.kv_pages` budget at least this never preempts a row."""
    lengths = np.asarray(lengths)
    prompt_pages = -(-np.asarray(prompt_lengths) // page_size)
    most = 0
    for t in range(int(lengths.max())):
        alive = lengths > t
        own = int(alive.sum()) * -(-t // page_size)
        prompts = int(prompt_pages[alive.reshape(-1, group).any(axis=1)].sum())
        most = max(most, own + prompts)
    return most


# ------------------------------------------------------------------ TPU: the planner's arithmetic


def tpu_figures(name: str, lengths: list[int], prompt_len: float) -> dict:
    """Rows in flight and a step's bytes over the live minimum for one config on v5e:2x4 (see the module)."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from jgrpo.config.loading import load_config
    from jgrpo.models.paged_attention_tpu import read_granule
    from jgrpo.planning.abstract_run import lower_iteration, topology_devices
    from jgrpo.planning.fit import GIB, compile_program, sampler_pages
    from jgrpo.planning.paged_rows import (
        KVShape,
        paged_row_tokens,
        rows_in_flight,
        slot_pool_row_tokens,
        step_reads,
    )

    path, overrides = CONFIGS[name]
    config = load_config(ROOT / path, overrides)
    devices, chip = topology_devices("v5e:2x4")
    iteration = lower_iteration(config, devices, names=("sample",))  # the sampler's program only
    (program,) = iteration.programs
    report = compile_program(program.name, program.lowered, program.resident_argument_bytes, program.runs,
                             iteration.run.cfg.head_dim, program.traced_trips)
    s = sampler_pages(iteration, [report])
    sample = {"decode_weight_bytes": report.decode_weight_bytes}
    kv, G, P, N, ps = KVShape(**s["kv"]), s["group"], s["prompt_width"], s["new_tokens"], s["page_size"]
    free = chip.hbm_gib * GIB - s["without_pool_bytes"]
    final = np.minimum(np.asarray(lengths, float), N)
    in_flight = float((final ** 2).sum() / (2 * final.sum()))  # a row's live tokens, time-averaged over its life
    today = rows_in_flight(free, slot_pool_row_tokens(P, N, G), kv)
    paged = rows_in_flight(free, paged_row_tokens(prompt_len, in_flight, G, ps), kv)
    at_mean = rows_in_flight(free, paged_row_tokens(prompt_len, float(final.mean()), G, ps), kv)
    reserved = rows_in_flight(free, paged_row_tokens(prompt_len, N - 1, G, ps), kv)
    # A step at `paged` rows, each at half its final length (the rows of the length mix, round robin).
    mix = [(int(round(prompt_len)), int(final[i % len(final)] // 2)) for i in range(paged)]
    weights = sum(sample["decode_weight_bytes"].values())
    # The pallas kernel reads a part-full page to a tile's rows, the xla blocks whole pages.
    granule = read_granule(kv.dtype, ps) if s["attention"] == "pallas" else ps
    reads = step_reads(weights, kv, mix, page_size=ps, prompt_width=P, new_tokens=N, granule=granule)
    # The same step with every live page read whole, at several page sizes: what the granule saves.
    whole = {size: step_reads(weights, kv, mix, page_size=size, prompt_width=P, new_tokens=N).paged_over_live
             for size in sorted({16, 32, 64, 128, ps})}
    return {"rows_today": today, "rows_paged": paged, "rows_at_mean": at_mean, "rows_reserved": reserved,
            "free_gib": free / GIB, "pool_gib": s["pool_bytes"] / GIB, "page_size": ps, "in_flight_tokens": in_flight,
            "mean_length": float(final.mean()), "bytes_paged_gb": reads.paged / 1e9,
            "bytes_over_live": reads.paged_over_live, "bytes_over_live_today": reads.slot_pool_over_live,
            "bytes_over_live_whole_pages": whole[ps], "bytes_over_live_whole_by_page": whole,
            "weights_gb": reads.weights / 1e9, "attention": s["attention"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--rev", default=REV, help="the commit of the slot pool (default: the one before pages)")
    parser.add_argument("--skip-tpu", action="store_true")
    parser.add_argument("--kv-pages", type=int, default=0, help="sampler.kv_pages for the paged run (0: default)")
    parser.add_argument("--shrink", type=int, default=0, help="sampler.shrink for the paged run (0: default)")
    parser.add_argument("--save", type=Path, help="write both CPU runs' figures (lengths, ids) to this JSON file")
    args = parser.parse_args()
    if args.worker:
        worker(args.worker)
        return 0
    with worktree(args.rev) as old:
        today = run_worker(old)
    options = {k: v for k, v in (("kv_pages", args.kv_pages), ("shrink", args.shrink)) if v}
    paged = run_worker(ROOT, options)
    default = run_worker(ROOT) if options else paged  # the paged engine at its defaults too, beside the options
    if args.save:
        args.save.write_text(json.dumps({"slot_pool": today, "paged": paged, "paged_default": default,
                                         "options": options}))
    peak = live_page_peak(paged["lengths"], paged["prompt_lengths"], 16, 16)
    same = sum(a == b for a, b in zip(today["ids"], paged["ids"], strict=True))

    def speed(r):
        return r["tokens"] / r["seconds"]

    figures = {"cpu_tokens_per_s": speed(paged) / speed(today),
               "cpu_peak_memory": paged["peak_bytes"] / max(today["peak_bytes"], 1),
               "cpu_preempted": paged["preempted"], "cpu_rows_identical": same, "cpu_rows": len(paged["ids"]),
               "prompt_copies_per_group": 1, "cpu_options": options, "cpu_live_page_peak": peak,
               "cpu_tokens_per_s_defaults": speed(default) / speed(today),
               "cpu_peak_memory_defaults": default["peak_bytes"] / max(today["peak_bytes"], 1)}
    print(f"CPU, SmolLM2 8 x 16 rows, prompts {np.mean(paged['prompt_lengths']):.0f} tokens "
          f"(width {paged['prompt_width']}), own lengths mean {np.mean(paged['lengths']):.0f}, "
          f"{100 * np.mean(np.asarray(paged['lengths']) == 512):.0f}% at 512")
    print(f"{'engine':18s} {'s':>8s} {'tokens/s':>9s} {'peak MB':>8s}")
    runs = [("slot pool", today), (f"paged {options or ''}", paged)] + ([("paged, defaults", default)] if options
                                                                        else [])
    for name, r in runs:
        print(f"{name:18s} {r['seconds']:8.1f} {speed(r):9.1f} {r['peak_bytes'] / 2**20:8.0f}")
    print(f"rows identical: {same} of {len(paged['ids'])}; preempted: {paged['preempted']}; the most pages the "
          f"rows' own lengths hold at once: {peak} (CPU pages of 16)")
    if not args.skip_tpu:
        prompt_len = float(np.mean(paged["prompt_lengths"]))
        tpu = {"deepscaler": tpu_figures("deepscaler", [4096] * 16, prompt_len),
               "gsm8k": tpu_figures("gsm8k", paged["lengths"], prompt_len)}
        print(f"{'TPU v5e:2x4':12s} {'free GiB':>9s} {'page':>5s} {'today':>6s} {'paged':>6s} {'at mean':>8s} "
              f"{'reserved':>9s} {'bytes/live':>11s} {'today':>6s}")
        for name, t in tpu.items():
            print(f"{name:12s} {t['free_gib']:9.2f} {t['page_size']:5d} {t['rows_today']:6d} {t['rows_paged']:6d} "
                  f"{t['rows_at_mean']:8d} {t['rows_reserved']:9d} {t['bytes_over_live']:11.3f} "
                  f"{t['bytes_over_live_today']:6.3f}")
        figures.update({
            "tpu_rows_in_flight": {n: t["rows_paged"] / t["rows_today"] for n, t in tpu.items()},
            "tpu_rows_in_flight_at_mean": {n: t["rows_at_mean"] / t["rows_today"] for n, t in tpu.items()},
            "tpu_rows_in_flight_reserved": {n: t["rows_reserved"] / t["rows_today"] for n, t in tpu.items()},
            "tpu_bytes_over_live": tpu["gsm8k"]["bytes_over_live"],
            "tpu_bytes_over_live_today": tpu["gsm8k"]["bytes_over_live_today"],
            "tpu_bytes_over_live_whole_pages": tpu["gsm8k"]["bytes_over_live_whole_pages"],
            "tpu_bytes_over_live_whole_by_page": tpu["gsm8k"]["bytes_over_live_whole_by_page"], "tpu": tpu})
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
