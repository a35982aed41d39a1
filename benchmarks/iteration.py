"""One GRPO iteration end to end: jgrpo on-policy (v=1) and off-policy (v=4), side by side with Tunix's GRPO learner.

Same shape on every side: SmolLM2-135M-Instruct in float32, 4 prompts x 4 samples x 128 new tokens (every
row forced to the full length: no stop ids), prompts left-padded to 64 tokens, beta 0.04 (k3 KL to the
initial params), clip 0.2, AdamW, one optimiser step per iteration. jgrpo's time per phase comes from the
trainer's own `time/*` metrics (sampling, rewards, log-probs, update, weight sync, checkpoint: every iteration by
default, never with --checkpoint-every 0);
the first iteration compiles and is reported apart, the others are averaged. Tunix (PyPI google-tunix==0.1.7,
its own virtualenv, see benchmarks/sampler.py) runs `GRPOLearner.train` on the same model files with the
vanilla rollout engine, no checkpoints; its warm iteration time is the interval between consecutive calls of
its reward function (one call per iteration). A Tunix failure is reported in the table, not raised.

    python benchmarks/iteration.py                         # jgrpo v=1, v=4 and Tunix
    python benchmarks/iteration.py --checkpoint-every 0    # like for like: no checkpoints on either side
    python benchmarks/iteration.py --skip tunix --dtype bfloat16 --model /path/to/hf_dir      # accelerator

Prints a table, then one JSON line with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from hardware import usable_cores  # noqa: E402
from sampler import MESSAGES, TUNIX_CONFIG_FROM_HF, ensure_tunix_venv  # noqa: E402
from train_step import add_batch_arguments  # noqa: E402 - the sampler benchmark owns the Tunix virtualenv

from jgrpo.config.errors import exits_on_user_error  # noqa: E402

PHASES = ("sample", "reward", "logprobs", "update", "weight_sync", "checkpoint")


def bench_jgrpo(args, refresh: int, iterations: int, run_dir: Path) -> dict:
    from jgrpo.config.loading import load_config
    from jgrpo.training.trainer import Trainer

    overrides = [
        f"model.name={args.model}", f"model.param_dtype={args.dtype}", f"model.compute_dtype={args.dtype}",
        f"data.batch_size={args.prompts}", "data.source=arithmetic", "data.max_prompt_length=64",
        f"grpo.num_generations={args.generations}", f"grpo.behaviour_refresh={refresh}", "grpo.beta=0.04",
        f"sampler.max_new_tokens={args.new_tokens}", f"sampler.prompt_bucket={args.prompt_len}",
        "optim.learning_rate=1e-6", f"checkpoint.every={args.checkpoint_every}", "checkpoint.keep=1",
        "logging.tensorboard=false", "logging.progress_bar=false", "logging.samples_every=0",
        # With checkpoint.every=0 the trainer still saves at its last iteration: make that one never come.
        f"run.iterations={iterations if args.checkpoint_every else 10**6}",
        f"run.output_dir={run_dir}", "reward.num_workers=1", *getattr(args, "overrides", ()),
    ]
    trainer = Trainer(load_config(None, overrides))
    source = trainer.collector.source  # every row runs to max_new_tokens, as on the Tunix side: no stop ids
    source.sampler = source.sampler.replace(stop_ids=())
    try:
        records = [trainer.train_iteration() for _ in range(iterations)]
        trainer.checkpointer.wait()
    finally:
        trainer.close()
    warm = records[1:]
    mean = {p: statistics.mean(r.get(f"time/{p}", 0.0) for r in warm) for p in PHASES + ("iteration",)}
    tokens = statistics.mean(r["throughput/tokens_per_s"] for r in warm)
    return {"first_iteration_s": records[0]["time/iteration"], "phases_s": mean, "tokens_per_s": tokens,
            "iterations_timed": len(warm), "weight_syncs": [r.get("time/weight_sync", 0.0) for r in records]}


# Runs inside the Tunix virtualenv: GRPOLearner on the same safetensors, iteration times from its reward calls.
TUNIX_SCRIPT = TUNIX_CONFIG_FROM_HF + '''
import json, sys, time
import jax, jax.numpy as jnp, numpy as np, optax
from transformers import AutoTokenizer
from tunix.models.llama3 import model as model_lib, params as params_lib
from tunix.rl import rl_cluster as rl_cluster_lib
from tunix.rl.grpo import grpo_learner
from tunix.rl.rollout import base_rollout

model_dir, spec = sys.argv[1], json.loads(sys.argv[2])
B, G, N, P, iters = spec["prompts"], spec["generations"], spec["new_tokens"], spec["prompt_len"], spec["iterations"]
cfg = tunix_llama_config(model_lib, model_dir)
mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
with jax.set_mesh(mesh):
    actor = params_lib.create_model_from_safe_tensors(model_dir, cfg, mesh, dtype=jnp.float32)
    reference = params_lib.create_model_from_safe_tensors(model_dir, cfg, mesh, dtype=jnp.float32)
tokenizer = AutoTokenizer.from_pretrained(model_dir)
calls = []
def reward(prompts, completions, **kwargs):
    calls.append(time.perf_counter())
    return [float(len(c) % 2) for c in completions]
training = rl_cluster_lib.RLTrainingConfig(
    actor_optimizer=optax.adamw(1e-6, weight_decay=0.0), eval_every_n_steps=10**6, max_steps=iters,
    mini_batch_size=B, train_micro_batch_size=B, rollout_micro_batch_size=B, compute_logps_micro_batch_size=B)
rollout = base_rollout.RolloutConfig(max_tokens_to_generate=N, max_prompt_length=P, kv_cache_size=P + N + 256,
                                     temperature=1.0, top_p=1.0, eos_tokens=[-1])
roles = {r: mesh for r in (rl_cluster_lib.Role.ACTOR, rl_cluster_lib.Role.REFERENCE, rl_cluster_lib.Role.ROLLOUT)}
cluster = rl_cluster_lib.RLCluster(actor=actor, reference=reference, tokenizer=tokenizer, cluster_config=
    rl_cluster_lib.ClusterConfig(role_to_mesh=roles, rollout_engine="vanilla", offload_to_cpu=False,
                                 training_config=training, rollout_config=rollout))
learner = grpo_learner.GRPOLearner(rl_cluster=cluster, reward_fns=reward, algo_config=grpo_learner.GRPOConfig(
    num_generations=G, num_iterations=1, beta=0.04, epsilon=0.2, loss_agg_mode="token-mean"))
messages = spec["messages"]
texts = [tokenizer.apply_chat_template([{"role": "user", "content": m}], add_generation_prompt=True, tokenize=False)
         for m in messages]
data = [{"prompts": np.array([texts[(i * B + j) % len(texts)] for j in range(B)])} for i in range(iters)]
start = time.perf_counter()
learner.train(data)
total = time.perf_counter() - start
print("RESULT " + json.dumps({"reward_calls": [c - start for c in calls], "total_s": total}))
'''


def bench_tunix(args) -> dict:
    from jgrpo.models.builtin import resolve_model_dir

    python = ensure_tunix_venv(args.tunix_venv)
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(TUNIX_SCRIPT)
    spec = {"prompts": args.prompts, "generations": args.generations, "new_tokens": args.new_tokens,
            "prompt_len": args.prompt_len, "iterations": args.tunix_iterations, "messages": MESSAGES}
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "XLA_FLAGS")}
    proc = subprocess.run([str(python), f.name, str(resolve_model_dir(args.model)), json.dumps(spec)],
                          capture_output=True, text=True, env=env)
    os.unlink(f.name)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"Tunix run failed (exit {proc.returncode}): {proc.stderr.strip()[-600:]}")
    result = json.loads(lines[-1][len("RESULT "):])
    calls = result["reward_calls"]
    warm = [b - a for a, b in zip(calls[1:], calls[2:], strict=False)]  # call 1 -> 2 still compiles the update
    if not warm:
        raise RuntimeError(f"Tunix ran {len(calls)} iterations; need >= 3 for a warm one")
    return {"first_iteration_s": calls[1], "iteration_s": statistics.mean(warm), "iterations_timed": len(warm),
            "total_s": result["total_s"]}


@exits_on_user_error
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_batch_arguments(p)
    p.add_argument("--iterations", type=int, default=3, help="jgrpo iterations per run (the first compiles)")
    p.add_argument("--off-policy-iterations", type=int, default=5, help="v=4: 5 covers one refresh after the first")
    p.add_argument("--checkpoint-every", type=int, default=1,
                   help="jgrpo saves every N iterations (0 = never, like the Tunix side)")
    p.add_argument("--tunix-iterations", type=int, default=4, help="Tunix: the first two compile")
    p.add_argument("--tunix-venv", type=Path, default=Path("/tmp/tunix-venv"))
    p.add_argument("--skip", action="append", default=[], choices=("on_policy", "off_policy", "tunix"))
    args = p.parse_args()

    load_before = os.getloadavg()[0]
    results, errors = {}, {}
    runs = {"on_policy": lambda d: bench_jgrpo(args, 1, args.iterations, d),
            "off_policy": lambda d: bench_jgrpo(args, 4, args.off_policy_iterations, d),
            "tunix": lambda d: bench_tunix(args)}
    for name, run in runs.items():
        if name in args.skip:
            continue
        try:
            with tempfile.TemporaryDirectory() as run_dir:
                results[name] = run(Path(run_dir))
            print(f"  {name}: {json.dumps(results[name])}", file=sys.stderr)
        except Exception as e:  # noqa: BLE001 - one side failing must not hide the others' figures
            errors[name] = f"{type(e).__name__}: {e}"
            print(f"  {name} failed: {errors[name]}", file=sys.stderr)
    load_after = os.getloadavg()[0]

    tunix_s = results.get("tunix", {}).get("iteration_s")
    generated = args.prompts * args.generations * args.new_tokens
    print(f"| {args.prompts} prompts x {args.generations} x {args.new_tokens} new tokens, {args.model}, {args.dtype} "
          "| " + " | ".join(PHASES) + " | iteration s | first (compile) s | tokens/s | / Tunix |")
    print("|" + "---|" * (len(PHASES) + 5))
    for name, label in (("on_policy", "jgrpo v=1"), ("off_policy", "jgrpo v=4")):
        if name not in results:
            print(f"| {label} | {errors.get(name, 'skipped')[:80]} |")
            continue
        r = results[name]
        ratio = r["phases_s"]["iteration"] / tunix_s if tunix_s else None
        r["over_tunix"] = ratio
        print(f"| {label} | " + " | ".join(f"{r['phases_s'][p]:.2f}" for p in PHASES)
              + f" | {r['phases_s']['iteration']:.1f} | {r['first_iteration_s']:.1f} | {r['tokens_per_s']:.0f} | "
              + (f"{ratio:.2f}x |" if ratio else "- |"))
    if tunix_s:
        t = results["tunix"]
        print("| Tunix 0.1.7 GRPOLearner | " + " | ".join("-" for _ in PHASES)
              + f" | {tunix_s:.1f} | {t['first_iteration_s']:.1f} | {generated / tunix_s:.0f} | 1.00x |")
    else:
        print(f"| Tunix 0.1.7 GRPOLearner | {errors.get('tunix', 'skipped')[:120]} |")
    saves = f"every {args.checkpoint_every} iteration(s)" if args.checkpoint_every else "never"
    print(f"(load average {load_before:.1f} before, {load_after:.1f} after; {usable_cores()} cores; jgrpo "
          f"checkpoints {saves}, Tunix never; weight_sync with v=4 is averaged over the timed iterations)")
    print(json.dumps({"benchmark": "iteration", "model": args.model, "dtype": args.dtype, "prompts": args.prompts,
                      "generations": args.generations, "new_tokens": args.new_tokens, "prompt_len": args.prompt_len,
                      "load_average": [load_before, load_after], "cpu_count": usable_cores(),
                      "checkpoint_every": args.checkpoint_every, **results,
                      "errors": errors}))


if __name__ == "__main__":
    sys.exit(main())
