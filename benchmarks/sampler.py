"""Sampling speed, side by side: jgrpo vs transformers `generate` (PyTorch) vs Tunix's sampler (JAX).

All three sample SmolLM2-135M-Instruct (the same converted safetensors checkpoint) in float32 at
temperature 1 with no truncation, every row forced to the full length (no stop ids), for each
(rows, new tokens) configuration. Each JAX sampler runs once untimed at the same shapes (compilation)
and once timed; transformers gets a short untimed warm-up. tokens/s counts generated tokens only
(prefill included in the time, as in a rollout). The fraction of peak compares the model FLOPs of
those tokens with a large float32 matmul measured here.

Tunix (PyPI google-tunix==0.1.7) runs in its own virtualenv (created on first use, with jax/flax
pinned to the versions of this environment) because its dependency pins conflict with ours; a
failure to install or load it is reported in the table instead of stopping the run.

    python benchmarks/sampler.py                      # 32/64 rows x 128/256 tokens, all three
    python benchmarks/sampler.py --configs 64x256 --skip tunix

Prints a table, then one JSON line with every figure.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from hardware import matmul_peak_flops, usable_cores  # benchmarks/ is on sys.path when run as a script

from jgrpo.config.errors import exits_on_user_error  # noqa: E402

MODEL = "smollm2-135m-instruct"
MESSAGES = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain gravity in one sentence.",
    "List three prime numbers.",
    "Why is the sky blue?",
    "Translate 'good morning' into Spanish.",
    "What is 17 times 3?",
    "Name a famous painter.",
]
PROMPT_WIDTH = 64  # every prompt left-padded to 64 tokens in all three samplers
TUNIX_VERSION = "0.1.7"


def prompts(tokenizer, rows: int) -> list[list[int]]:
    from jgrpo.data.prompts import chat_prompt_ids

    return [chat_prompt_ids(tokenizer, MESSAGES[i % len(MESSAGES)]) for i in range(rows)]


def matmul_peak_gflops(size: int = 2048, repeats: int = 5) -> float:
    return matmul_peak_flops("float32", size, repeats) / 1e9


def flops_per_token(cfg, context: float) -> float:
    """Matmul FLOPs of one generated token: every projection, the logits, and attention over `context` keys."""
    D, F, L = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers  # noqa: N806
    H, KVH, Dh, V = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size  # noqa: N806
    per_layer = D * (H + 2 * KVH) * Dh + H * Dh * D + 3 * D * F
    attention = 2 * H * Dh * context
    return 2 * (L * (per_layer + attention) + D * V)


@functools.cache
def _jgrpo_model():
    from jgrpo.models.hf import load_model, load_tokenizer

    return load_tokenizer(MODEL), *load_model(MODEL)  # tokenizer, graphdef, params, cfg


def bench_jgrpo(rows: int, new: int, seed: int = 0) -> float:
    import jax

    from jgrpo.data.prompts import left_pad, pad_id_for
    from jgrpo.sampling.sampler import Prompts, Sampler

    tokenizer, graphdef, params, _ = _jgrpo_model()
    tokens, mask = left_pad(prompts(tokenizer, rows), pad_id=pad_id_for(tokenizer), bucket=PROMPT_WIDTH)
    sampler = Sampler(graphdef, max_new_tokens=new, pad_id=tokenizer.pad_token_id)  # temperature 1, no stop ids

    def run(key):
        return sampler.generate(params, Prompts(tokens, mask), key)

    jax.block_until_ready(run(key=jax.random.key(seed)))  # compile
    start = time.perf_counter()
    out = jax.block_until_ready(run(key=jax.random.key(seed + 1)))
    seconds = time.perf_counter() - start
    assert int(out.lengths.min()) == new, "rows must run to full length"
    return rows * new / seconds


@functools.cache
def _transformers_model():
    import torch
    import transformers

    from jgrpo.models.hf import load_tokenizer, resolve_model_dir

    model = transformers.AutoModelForCausalLM.from_pretrained(resolve_model_dir(MODEL), dtype=torch.float32)
    return load_tokenizer(MODEL), model.eval()


def bench_transformers(rows: int, new: int, seed: int = 0) -> float:
    import torch

    from jgrpo.data.prompts import left_pad, pad_id_for

    tokenizer, model = _transformers_model()
    tokens, mask = left_pad(prompts(tokenizer, rows), pad_id=pad_id_for(tokenizer), bucket=PROMPT_WIDTH)
    input_ids, attention_mask = torch.tensor(tokens, dtype=torch.long), torch.tensor(mask, dtype=torch.long)
    # top_k=0 / top_p=1: plain temperature-1 sampling; min_new_tokens: no early stop.
    run = functools.partial(model.generate, input_ids, attention_mask=attention_mask, do_sample=True,
                            temperature=1.0, top_k=0, top_p=1.0, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    with torch.no_grad():
        run(max_new_tokens=4, min_new_tokens=4)  # warm-up (no compilation in eager PyTorch)
        start = time.perf_counter()
        out = run(max_new_tokens=new, min_new_tokens=new)
    seconds = time.perf_counter() - start
    assert out.shape[1] - tokens.shape[1] == new
    return rows * new / seconds


# Prepended to every script that runs inside the Tunix virtualenv: Tunix's Llama3 config from our config.json.
TUNIX_CONFIG_FROM_HF = textwrap.dedent('''
    def tunix_llama_config(model_lib, model_dir):
        import json

        hf = json.load(open(f"{model_dir}/config.json"))
        return model_lib.ModelConfig(
            num_layers=hf["num_hidden_layers"], vocab_size=hf["vocab_size"], embed_dim=hf["hidden_size"],
            hidden_dim=hf["intermediate_size"], num_heads=hf["num_attention_heads"], head_dim=hf["head_dim"],
            num_kv_heads=hf["num_key_value_heads"], rope_theta=hf["rope_theta"], norm_eps=hf["rms_norm_eps"],
            weight_tying=hf["tie_word_embeddings"])
''')

# Runs inside the Tunix virtualenv: loads Tunix's Llama3 from the same safetensors and times its sampler.
TUNIX_SCRIPT = TUNIX_CONFIG_FROM_HF + textwrap.dedent('''
    import json, sys, time
    import jax, jax.numpy as jnp, numpy as np
    from transformers import AutoTokenizer
    from tunix.generate import sampler as sampler_lib
    from tunix.models.llama3 import model as model_lib, params as params_lib

    model_dir, configs, width = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
    messages = json.loads(sys.argv[4])
    cfg = tunix_llama_config(model_lib, model_dir)
    model = params_lib.create_model_from_safe_tensors(model_dir, cfg, dtype=jnp.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": m}], add_generation_prompt=True,
                                           tokenize=False) for m in messages]
    results = {}
    for rows, new in configs:
        sampler = sampler_lib.Sampler(model, tokenizer, sampler_lib.CacheConfig(
            cache_size=width + new, num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim))
        batch = [texts[i % len(texts)] for i in range(rows)]
        # top_p=1.0 is Tunix's plain temperature sampling (greedy otherwise); eos -1: rows never stop early.
        kwargs = dict(max_generation_steps=new, max_prompt_length=width, temperature=1.0, top_p=1.0,
                      eos_tokens=[-1], pad_output=True)
        sampler(batch, seed=0, **kwargs)  # compile
        start = time.perf_counter()
        out = sampler(batch, seed=1, **kwargs)
        seconds = time.perf_counter() - start
        assert all(len(t) == new for t in out.tokens), [len(t) for t in out.tokens]
        results[f"{rows}x{new}"] = rows * new / seconds
    print("RESULT " + json.dumps(results))
''')


def ensure_tunix_venv(venv: Path) -> Path:
    python = venv / "bin" / "python"
    probe = [str(python), "-c", "import tunix.generate.sampler, tunix.models.llama3.params"]
    if python.exists() and subprocess.run(probe, capture_output=True).returncode == 0:
        return python
    import flax
    import jax

    print(f"creating the Tunix virtualenv in {venv} (one-off, a few minutes)", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pins = [f"google-tunix=={TUNIX_VERSION}", f"jax=={jax.__version__}", f"jaxlib=={jax.__version__}",
            f"flax=={flax.__version__}"]
    subprocess.run([str(python), "-m", "pip", "install", "-q", *pins], check=True)
    subprocess.run(probe, check=True, capture_output=True)
    return python


def bench_tunix(rows: int, new: int, venv: Path) -> float:
    from jgrpo.models.hf import resolve_model_dir

    python = ensure_tunix_venv(venv)
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(TUNIX_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "XLA_FLAGS")}
    proc = subprocess.run(
        [str(python), f.name, str(resolve_model_dir(MODEL)), json.dumps([[rows, new]]), str(PROMPT_WIDTH),
         json.dumps(MESSAGES)], capture_output=True, text=True, env=env,
    )
    os.unlink(f.name)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"Tunix run failed (exit {proc.returncode}): {proc.stderr.strip()[-600:]}")
    return json.loads(lines[-1][len("RESULT "):])[f"{rows}x{new}"]


@exits_on_user_error
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", default="32x128,32x256,64x128,64x256", help="comma-separated ROWSxNEW_TOKENS")
    p.add_argument("--skip", action="append", default=[], choices=("jgrpo", "transformers", "tunix"))
    p.add_argument("--tunix-venv", type=Path, default=Path("/tmp/tunix-venv"))
    args = p.parse_args()
    configs = [tuple(int(x) for x in c.split("x")) for c in args.configs.split(",")]

    cfg = _jgrpo_model()[3]
    load_before = os.getloadavg()
    peak = matmul_peak_gflops()
    print(f"float32 matmul peak on this CPU: {peak:.0f} GFLOP/s ({usable_cores()} cores, "
          f"load average {load_before[0]:.1f})", file=sys.stderr)
    # Config by config, the three samplers back to back, so a shared machine's load hits them alike.
    runners = {"jgrpo": bench_jgrpo, "transformers": bench_transformers,
               "tunix": functools.partial(bench_tunix, venv=args.tunix_venv)}
    results: dict = {name: {} for name in runners}
    errors: dict = {}
    loads = {}
    for rows, new in configs:
        key = f"{rows}x{new}"
        for name, run in runners.items():
            if name in args.skip or name in errors:
                continue
            try:
                results[name][key] = run(rows, new)
                print(f"  {name} {key}: {results[name][key]:.1f} tok/s (load {os.getloadavg()[0]:.1f})",
                      file=sys.stderr, flush=True)
            except Exception as e:  # noqa: BLE001 - one sampler failing must not hide the others' figures
                errors[name] = f"{type(e).__name__}: {e}"
                print(f"  {name} failed: {errors[name]}", file=sys.stderr, flush=True)
        loads[key] = os.getloadavg()[0]
    load_after = os.getloadavg()
    peak = max(peak, matmul_peak_gflops())  # the best of two measurements: other load only ever lowers it

    names = list(runners)
    header = ["rows x new", *[f"{n} tok/s" for n in names], "jgrpo/tunix", "jgrpo/transformers", "jgrpo % peak",
              "load avg"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    figures = []
    for rows, new in configs:
        key = f"{rows}x{new}"
        tps = {n: results.get(n, {}).get(key) for n in names}
        cell = {n: (f"{v:.1f}" if v else errors.get(n, "skipped")[:60]) for n, v in tps.items()}
        ratio = {n: (tps["jgrpo"] / tps[n] if tps["jgrpo"] and tps[n] else None) for n in ("tunix", "transformers")}
        flops = flops_per_token(cfg, context=PROMPT_WIDTH + new / 2)
        frac = tps["jgrpo"] * flops / (peak * 1e9) if tps["jgrpo"] else None
        print(f"| {rows} x {new} | " + " | ".join(cell[n] for n in names) + " | "
              + " | ".join(f"{ratio[n]:.2f}x" if ratio[n] else "-" for n in ("tunix", "transformers"))
              + (f" | {100 * frac:.0f}%" if frac else " | -") + f" | {loads[key]:.1f} |")
        figures.append({"rows": rows, "new_tokens": new, **{f"{n}_tok_s": tps[n] for n in names},
                        "jgrpo_over_tunix": ratio["tunix"], "jgrpo_over_transformers": ratio["transformers"],
                        "jgrpo_fraction_of_matmul_peak": frac, "load_average": loads[key]})
    print(f"(load average {load_before[0]:.1f} before, {load_after[0]:.1f} after; {usable_cores()} cores)")
    print(json.dumps({"benchmark": "sampler", "model": MODEL, "dtype": "float32", "matmul_peak_gflops": peak,
                      "load_average": [load_before[0], load_after[0]], "cpu_count": usable_cores(),
                      "results": figures, "errors": errors}))


if __name__ == "__main__":
    sys.exit(main())
