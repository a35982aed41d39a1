"""One command for an accelerator machine: train-step MFU, sampler tokens/s against the HBM roofline, and whole GRPO
iterations at v=1 and v=4, written to OUT/accelerator.json after every figure (a run cut off still leaves those).

    bash benchmarks/accelerator.sh OUT              # on the GPU/TPU machine: installs carried wheels, then runs this
    python benchmarks/accelerator.py --out OUT [--budget-s 240] [--only train sampler iteration]
    python benchmarks/accelerator.py --dry-run    # CPU smoke run, tiny shapes (CI), to runs/accelerator: no figures

Parts, most valuable first, each skipped once the time budget is spent:
1. hardware: the device, its published bf16 peak and HBM bandwidth, and the measured ones (a large bf16 matmul,
   a large copy);
2. train: one GRPO update (forward, backward, AdamW) in bf16 compute on Qwen2.5-0.5B shapes with random weights,
   8 prompts x G=16, 128 prompt + 200 new tokens; MFU = model FLOPs (6 per parameter-token plus attention, each
   prompt once per group) / time / peak. Then the same on SmolLM2-135M's real weights (needs `gguf`);
3. sampler: 64, 256 and 1024 rows x 200 new tokens (no stop ids: every row decodes to the end) on Qwen2.5-0.5B
   shapes, bf16 weights and cache; tokens/s against the HBM roofline (every step reads the weights and the
   filled cache once: bytes / bandwidth);
4. iteration: `jgrpo.train`'s trainer on the built-in arithmetic task with SmolLM2, v=1 and v=4, 16 x 16 rows;
   the first iteration compiles and is reported apart.
Figures: median of the timed repeats after one compiling call. `--dry-run` runs every part on CPU with a tiny
random model and a few tokens, in about a minute.
"""

from __future__ import annotations

import argparse
import json
import statistics
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
    from jgrpo.models.llm import LLM, split_model
    from jgrpo.models.shapes import model_shapes

    cfg = model_shapes("tiny-random-llama" if dry else name, param_dtype="float32", compute_dtype="bfloat16",
                       attention=resolve_attention("auto", jax.devices()[0].platform))
    graphdef, params = split_model(LLM(cfg, rngs=nnx.Rngs(0)))
    return graphdef, params, cfg


def train(peak: float, model: str, dry: bool) -> dict:
    import jax
    import jax.numpy as jnp

    from jgrpo.planning.roofline import iteration_model_flops

    if model == "smollm2":
        from jgrpo.models.hf import load_model

        name = "tiny-random-llama" if dry else "smollm2-135m-instruct"
        graphdef, params, cfg = load_model(name, param_dtype="float32", compute_dtype="bfloat16")
    else:
        graphdef, params, cfg = random_model(QWEN, dry)
    shape = dict(prompts=2, generations=4, prompt_len=16, new_tokens=8) if dry else \
        dict(prompts=8, generations=16, prompt_len=128, new_tokens=200)
    host = synthetic_batch(cfg, **shape)
    steps, batch, opt_state = jgrpo_step_setup(graphdef, params, host, chunk=64, generations=shape["generations"])
    state = {"params": params, "opt_state": opt_state}

    def step():
        state["params"], state["opt_state"], metrics = steps.train_step(state["params"], state["opt_state"], batch,
                                                                        jnp.int32(0), jnp.bool_(True))
        jax.block_until_ready(metrics)

    first, seconds = timed(step, 3)
    flops = iteration_model_flops(cfg, prompts=shape["prompts"], samples=shape["generations"],
                                  prompt_len=shape["prompt_len"], new_tokens=shape["new_tokens"], train_passes=1,
                                  forward_passes=0)["train"]
    return {"model": model, "attention": cfg.attention, **shape, "first_step_s": first, "step_s": seconds,
            "model_flops": flops, "mfu": flops / seconds / peak}


def sampler(rows: int, hbm_bytes_per_s: float, dry: bool) -> dict:
    import jax
    import jax.numpy as jnp

    from jgrpo.config import SamplerConfig
    from jgrpo.models.decode import resolve_decode_layers
    from jgrpo.models.quantize import cast_floating
    from jgrpo.parallel.mesh import param_copier
    from jgrpo.sampling.sampler import Prompts, Sampler

    platform = jax.devices()[0].platform
    graphdef, params, cfg = random_model(QWEN, dry)
    params = param_copier(None, cast_floating("bfloat16"))(params)
    G, P, N = 16, (16 if dry else 128), (8 if dry else 200)
    B = max(rows // G, 1)
    tokens = jax.random.randint(jax.random.key(0), (B, P), 3, cfg.vocab_size, jnp.int32)
    mask = jnp.ones((B, P), bool)
    config = SamplerConfig(max_new_tokens=N)  # auto decode choices and draw for this platform
    sampler = Sampler.from_config(config, graphdef=graphdef, num_samples=G, stop_ids=(), pad_id=0, mesh=None,
                                  cfg=cfg)
    method = sampler.method

    def run():
        out = sampler.generate(params, Prompts(tokens, mask), jax.random.key(1))
        jax.block_until_ready(out.tokens)

    first, seconds = timed(run, 2)
    weights = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    mean_cache = 2 * cfg.num_layers * B * G * cfg.num_kv_heads * (P + N / 2) * cfg.head_dim * 2  # bf16 keys, values
    roofline = B * G / ((weights + mean_cache) / hbm_bytes_per_s)  # tokens/s if every step only read HBM once
    return {"rows": B * G, "new_tokens": N, "decode_layers": resolve_decode_layers("auto", platform),
            "draw": method.draw, "first_call_s": first, "seconds": seconds, "tokens_per_s": B * G * N / seconds,
            "roofline_tokens_per_s": roofline, "fraction_of_roofline": B * G * N / seconds / roofline}


def iteration(refresh: int, dry: bool) -> dict:
    args = SimpleNamespace(model="tiny-random-llama" if dry else "smollm2-135m-instruct", dtype="bfloat16",
                           prompts=2 if dry else 16, generations=4 if dry else 16, new_tokens=8 if dry else 128,
                           prompt_len=16 if dry else 64, checkpoint_every=0)
    with tempfile.TemporaryDirectory() as run_dir:
        return {"v": refresh, "rows": args.prompts * args.generations, "new_tokens": args.new_tokens,
                **bench_iteration(args, refresh, 3 if dry else 6, Path(run_dir))}


@exits_on_user_error
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/accelerator",
                        help="directory for accelerator.json, written as figures arrive (default: runs/accelerator)")
    parser.add_argument("--budget-s", type=float, default=240.0, help="skip the parts not started by then")
    parser.add_argument("--only", nargs="+", choices=("train", "sampler", "iteration"))
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on whatever devices there are (CI)")
    args = parser.parse_args()
    dry, start = args.dry_run, time.perf_counter()
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
    parts = [("train", "qwen2.5-0.5b-shapes", lambda: train(peak, "qwen", dry)),
             ("train", "smollm2", lambda: train(peak, "smollm2", dry))]
    parts += [("sampler", f"rows_{r}", lambda r=r: sampler(r, bandwidth, dry)) for r in ((16, 32) if dry else
                                                                                          (64, 256, 1024))]
    parts += [("iteration", f"v{v}", lambda v=v: iteration(v, dry)) for v in (1, 4)]
    for part, name, measure in parts:
        if args.only and part not in args.only:
            continue
        if time.perf_counter() - start > args.budget_s:
            results["skipped"].append(f"{part}/{name}: over the {args.budget_s:.0f} s budget")
            save()
            continue
        try:
            results.setdefault(part, {})[name] = measure()
        except Exception as e:  # noqa: BLE001 - a missing wheel or an unsupported kernel must not cost the rest
            results.setdefault(part, {})[name] = {"error": f"{type(e).__name__}: {e}"}
        print(f"{part}/{name}: {json.dumps(results[part][name], default=str)}", flush=True)
        save()
    results["seconds"] = time.perf_counter() - start
    save()


if __name__ == "__main__":
    sys.exit(main())
