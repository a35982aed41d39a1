"""Training-step speed, side by side: jgrpo vs PyTorch + transformers, one GRPO update on the same batch.

One step = forward + backward + global-norm clipping + AdamW update of the GRPO token-mean loss (clipped
ratio to the behaviour log-probs, k3 KL to reference log-probs, beta 0.04) on R sequences of P prompt +
N completion tokens (default 16 x (64 + 128) = 16 x 192, SmolLM2-135M-Instruct, float32). Both sides
load the same converted HF checkpoint and see the same token ids, masks, advantages and recorded
log-probs. Both run the vocabulary projection only on the N completion positions (transformers:
`logits_to_keep`, as TRL does). PyTorch runs every row's prompt; jgrpo by default computes each prompt once
for its G rows (`model.share_prompts`, same numbers; `--no-share-prompts` runs every row like PyTorch).

tokens/s counts the R * (P + N - 1) tokens a step scores. jgrpo is compiled once (untimed);
PyTorch gets one untimed warm-up step; then each side runs `--steps` timed steps, the median is kept.
MFU = FLOPs as executed by each side (6 per parameter-token of the matmuls plus attention, backward = 2x
forward; a shared prompt counts once per group) / time / peak, where peak is `--peak-tflops` or else a
large matmul measured here in the step's dtype.

    python benchmarks/train_step.py                                   # SmolLM2, CPU, both sides
    python benchmarks/train_step.py --dtype bfloat16 --model qwen2.5-0.5b-random --skip torch   # accelerator

Prints a table, then one JSON line with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np
from hardware import matmul_peak_flops, usable_cores  # benchmarks/ is on sys.path when run as a script

from jgrpo.config.errors import exits_on_user_error  # noqa: E402

BETA, CLIP_EPS, LR = 0.04, 0.2, 1e-6
# Random-weight stand-ins for models the hub would serve (unreachable offline): name -> LLMConfig fields.
RANDOM_MODELS = {
    "qwen2.5-0.5b-random": dict(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24, num_heads=14, num_kv_heads=2,
        head_dim=64, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True, qkv_bias=True,
        architecture="qwen2"),
}


def build_model(name: str, *, dtype: str = "float32", remat: str = "none"):
    """(graphdef, params, LLMConfig): a built-in/HF model, or a random-weight preset from RANDOM_MODELS."""
    if name in RANDOM_MODELS:
        from flax import nnx

        from jgrpo.models.llm import LLM, LLMConfig, split_model

        cfg = LLMConfig(**RANDOM_MODELS[name], param_dtype=dtype, compute_dtype=dtype, remat=remat)
        graphdef, params = split_model(LLM(cfg, rngs=nnx.Rngs(0)))
        return graphdef, params, cfg
    from jgrpo.models.hf import load_model
    from jgrpo.models.llm import ModelOptions

    return load_model(name, ModelOptions(param_dtype=dtype, compute_dtype=dtype, remat=remat))


def add_batch_arguments(parser: argparse.ArgumentParser, model_help: str | None = None) -> None:
    """The model and GRPO batch shape flags every training-side benchmark takes (same defaults everywhere)."""
    parser.add_argument("--model", default="smollm2-135m-instruct", help=model_help)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--generations", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)


def synthetic_batch(cfg, *, prompts: int, generations: int, prompt_len: int, new_tokens: int, seed: int = 0):
    """Host arrays of one sampled batch: left-padded prompts, completions (some stopped early), rewards."""
    rng = np.random.default_rng(seed)
    rows = prompts * generations
    prompt_tokens = rng.integers(3, cfg.vocab_size, (prompts, prompt_len), dtype=np.int32)
    prompt_mask = np.ones((prompts, prompt_len), bool)
    for b in range(prompts):  # left padding of different widths, as real chat prompts have
        prompt_mask[b, : b * prompt_len // (4 * prompts)] = False
    tokens = rng.integers(3, cfg.vocab_size, (rows, new_tokens), dtype=np.int32)
    lengths = rng.integers(new_tokens // 2, new_tokens + 1, rows)
    completion_mask = np.arange(new_tokens)[None, :] < lengths[:, None]
    rewards = rng.integers(0, 2, rows).astype(np.float32)
    rewards[::generations] = 1.0 - rewards[1::generations]  # no group with zero variance
    return dict(prompt_tokens=prompt_tokens, prompt_mask=prompt_mask, tokens=tokens,
                completion_mask=completion_mask, rewards=rewards)


def jgrpo_step_setup(graphdef, params, host, *, chunk: int, generations: int, share_prompts: bool = True,
                     frozen=None):
    """(StepFunctions, StepBatch with lp_alpha = lp_ref = the model's own log-probs, opt_state).

    `frozen`: a LoRA base (then `params` are its adapters, the only thing the step trains)."""
    import jax
    import jax.numpy as jnp

    from jgrpo.config import GRPOConfig, MeshConfig, OptimConfig
    from jgrpo.models.lora import join_adapters
    from jgrpo.parallel.mesh import make_mesh
    from jgrpo.sampling.methods import SamplingMethod
    from jgrpo.sampling.state import SampleOutput
    from jgrpo.training.optimizer import make_optimizer
    from jgrpo.training.step_options import StepOptions
    from jgrpo.training.steps import StepFunctions

    grpo = GRPOConfig(num_generations=generations, beta=BETA, clip_eps_low=CLIP_EPS, clip_eps_high=CLIP_EPS)
    optimizer = make_optimizer(OptimConfig(learning_rate=LR, max_grad_norm=1.0), total_steps=1000)
    options = StepOptions(grpo=grpo, method=SamplingMethod(), logprob_chunk=chunk, new_tokens=host["tokens"].shape[1],
                          share_prompts=share_prompts)
    steps = StepFunctions(graphdef=graphdef, params=params, mesh=make_mesh(MeshConfig()), optimizer=optimizer,
                          options=options, frozen=frozen)
    mask = jnp.asarray(host["completion_mask"], bool)
    samples = SampleOutput(tokens=jnp.asarray(host["tokens"]), logprobs=jnp.zeros(mask.shape, jnp.float32),
                           completion_mask=mask, lengths=mask.sum(-1, dtype=jnp.int32),
                           truncated=jnp.zeros(mask.shape[0], bool), loss_mask=mask,
                           version=jnp.zeros(mask.shape, jnp.int32))
    batch, _ = steps.assemble(host["prompt_tokens"], host["prompt_mask"], samples, host["rewards"])
    lp = steps.passes.pi_k(join_adapters(params, frozen), batch)  # on-policy: behaviour = reference = current params
    batch = batch._replace(lp_alpha=lp, lp_ref=lp)
    return steps, jax.block_until_ready(batch), steps.init_opt_state(params)


def bench_jgrpo(args, host) -> dict:
    import jax
    import jax.numpy as jnp

    graphdef, params, cfg = build_model(args.model, dtype=args.dtype, remat=args.remat)
    steps, batch, opt_state = jgrpo_step_setup(graphdef, params, host, chunk=args.chunk,
                                               generations=args.generations, share_prompts=args.share_prompts)
    minibatch, first = jnp.int32(0), jnp.bool_(True)
    start = time.perf_counter()
    params, opt_state, metrics = jax.block_until_ready(steps.updates.step(params, opt_state, batch, minibatch, first))
    compile_s = time.perf_counter() - start
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        params, opt_state, metrics = jax.block_until_ready(steps.updates.step(params, opt_state, batch, minibatch,
                                                                              first))
        times.append(time.perf_counter() - start)
    return {"seconds": statistics.median(times), "first_step_s": compile_s, "loss": float(metrics["loss"]),
            "cfg": cfg}


def torch_grpo_loss(lp, lp_old, lp_ref, advantages, mask):
    """The same token-mean GRPO loss in PyTorch: clipped ratio to the behaviour policy, k3 KL, beta."""
    import torch

    ratio = torch.exp(lp - lp_old)
    surrogate = torch.minimum(ratio * advantages, torch.clamp(ratio, 1 - CLIP_EPS, 1 + CLIP_EPS) * advantages)
    kl = torch.exp(lp_ref - lp) - (lp_ref - lp) - 1
    per_token = -(surrogate - BETA * kl)
    return (per_token * mask).sum() / mask.sum()


def bench_torch(args, host) -> dict:
    import torch
    import transformers

    from jgrpo.models.builtin import resolve_model_dir

    torch.set_num_threads(usable_cores())
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    model = transformers.AutoModelForCausalLM.from_pretrained(resolve_model_dir(args.model), dtype=dtype)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    g, n = args.generations, host["tokens"].shape[1]
    seq = np.concatenate([np.repeat(host["prompt_tokens"], g, 0), host["tokens"]], 1)
    full_mask = np.concatenate([np.repeat(host["prompt_mask"], g, 0), host["completion_mask"]], 1)
    positions = np.maximum(np.cumsum(full_mask, 1) - 1, 0)
    inputs = torch.tensor(seq[:, :-1], dtype=torch.long)
    attention_mask = torch.tensor(full_mask[:, :-1], dtype=torch.long)
    position_ids = torch.tensor(positions[:, :-1], dtype=torch.long)
    targets = torch.tensor(host["tokens"], dtype=torch.long)
    mask = torch.tensor(host["completion_mask"], dtype=torch.float32)
    rewards = torch.tensor(host["rewards"]).view(-1, g)
    advantages = ((rewards - rewards.mean(1, keepdim=True)) / torch.sqrt(rewards.var(1, unbiased=False,
                                                                                      keepdim=True) + 1e-4))
    advantages = advantages.reshape(-1, 1)

    def logprobs():
        logits = model(input_ids=inputs, attention_mask=attention_mask, position_ids=position_ids,
                       logits_to_keep=n).logits.float()  # [R, N, V]
        return torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0]

    with torch.no_grad():
        lp_old = logprobs()  # on-policy: behaviour = reference = current params

    def step():
        optimizer.zero_grad(set_to_none=True)
        loss = torch_grpo_loss(logprobs(), lp_old, lp_old, advantages, mask)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        return float(loss)

    start = time.perf_counter()
    step()
    warmup = time.perf_counter() - start
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        loss = step()
        times.append(time.perf_counter() - start)
    return {"seconds": statistics.median(times), "first_step_s": warmup, "loss": loss}


def train_flops_per_token(cfg, context: float) -> float:
    """Forward+backward matmul FLOPs per token read (3x forward), logits only on the completion share."""
    D, F, L = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers  # noqa: N806
    H, KVH, Dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim  # noqa: N806
    per_layer = D * (H + 2 * KVH) * Dh + H * Dh * D + 3 * D * F + 2 * H * Dh * context  # attention: QK^T and PV
    return 3 * 2 * L * per_layer


def step_flops(cfg, *, prompts: int, generations: int, prompt_len: int, new_tokens: int, shared: bool) -> float:
    """FLOPs of one step as executed: each prompt once per row, or once per group when `shared`."""
    rows, length = prompts * generations, prompt_len + new_tokens - 1
    logits = 3 * 2 * cfg.hidden_size * cfg.vocab_size * rows * new_tokens
    if not shared:
        return train_flops_per_token(cfg, context=length / 2) * rows * length + logits
    completion = new_tokens - 1  # completion queries see the whole prompt and their own prefix
    return (train_flops_per_token(cfg, context=prompt_len / 2) * prompts * prompt_len
            + train_flops_per_token(cfg, context=prompt_len + completion / 2) * rows * completion + logits)


def matmul_peak_tflops(dtype: str, size: int = 2048, repeats: int = 5) -> float:
    """Best-of-`repeats` TFLOP/s of a jitted square matmul: this machine's practical peak."""
    return matmul_peak_flops(dtype, size, repeats) / 1e12


@exits_on_user_error
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_batch_arguments(p, model_help=f"built-in name / HF dir, or a random preset: {', '.join(RANDOM_MODELS)}")
    p.add_argument("--chunk", type=int, default=None, help="log-prob chunk (default: the config default)")
    p.add_argument("--remat", default="none", choices=("none", "full", "dots"))
    p.add_argument("--steps", type=int, default=3, help="timed steps per side (median kept)")
    p.add_argument("--peak-tflops", type=float, default=None, help="device peak for MFU (default: measured)")
    p.add_argument("--skip", action="append", default=[], choices=("jgrpo", "torch"))
    p.add_argument("--share-prompts", action=argparse.BooleanOptionalAction, default=True,
                   help="jgrpo computes each prompt once per group of G rows (model.share_prompts, the default)")
    args = p.parse_args()
    if args.chunk is None:
        from jgrpo.config import ModelConfig

        args.chunk = ModelConfig().logprob_chunk
    import jax

    rows, length = args.prompts * args.generations, args.prompt_len + args.new_tokens - 1
    load_before = os.getloadavg()[0]
    peak = args.peak_tflops or matmul_peak_tflops(args.dtype)
    cfg = build_model(args.model)[2] if "jgrpo" in args.skip else None
    results, errors = {}, {}
    host = synthetic_batch(cfg or build_model(args.model)[2], prompts=args.prompts, generations=args.generations,
                           prompt_len=args.prompt_len, new_tokens=args.new_tokens)
    for name, bench in (("jgrpo", bench_jgrpo), ("torch", bench_torch)):
        if name in args.skip:
            continue
        try:
            results[name] = bench(args, host)
            print(f"  {name}: {results[name]['seconds']:.2f} s/step (first {results[name]['first_step_s']:.1f} s, "
                  f"loss {results[name]['loss']:.5f})", file=sys.stderr)
        except Exception as e:  # noqa: BLE001 - one side failing must not hide the other's figures
            errors[name] = f"{type(e).__name__}: {e}"
            print(f"  {name} failed: {errors[name]}", file=sys.stderr)
    cfg = results.get("jgrpo", {}).pop("cfg", None) or cfg or build_model(args.model)[2]
    load_after = os.getloadavg()[0]

    tokens = rows * length  # what a step scores; MFU counts each side's FLOPs as executed
    shape = dict(prompts=args.prompts, generations=args.generations, prompt_len=args.prompt_len,
                 new_tokens=args.new_tokens)
    side_flops = {"jgrpo": step_flops(cfg, **shape, shared=args.share_prompts and args.generations > 1),
                  "torch": step_flops(cfg, **shape, shared=False)}
    print(f"| {rows} x {length + 1} tokens, {args.model}, {args.dtype}, {jax.devices()[0].device_kind} "
          f"| s/step | tokens/s | MFU (peak {peak:.2f} TFLOP/s) |")
    print("|---|---|---|---|")
    figures = {}
    for name in ("jgrpo", "torch"):
        if name in results:
            s = results[name]["seconds"]
            figures[name] = {"s_per_step": s, "tokens_per_s": tokens / s, "mfu": side_flops[name] / s / (peak * 1e12),
                             "first_step_s": results[name]["first_step_s"], "loss": results[name]["loss"]}
            print(f"| {name} | {s:.2f} | {tokens / s:.0f} | {100 * figures[name]['mfu']:.1f}% |")
        else:
            print(f"| {name} | {errors.get(name, 'skipped')[:80]} | - | - |")
    ratio = figures["jgrpo"]["tokens_per_s"] / figures["torch"]["tokens_per_s"] if len(figures) == 2 else None
    if ratio:
        print(f"| jgrpo / torch | | {ratio:.2f}x | |")
    print(f"(load average {load_before:.1f} before, {load_after:.1f} after; {usable_cores()} cores; "
          f"log-prob chunk {args.chunk}, remat {args.remat}, jgrpo shares prompts: {args.share_prompts})")
    print(json.dumps({"benchmark": "train_step", "model": args.model, "dtype": args.dtype, "rows": rows,
                      "tokens_per_row": length, "new_tokens": args.new_tokens, "chunk": args.chunk,
                      "remat": args.remat, "share_prompts": args.share_prompts,
                      "device": jax.devices()[0].device_kind, "peak_tflops": peak,
                      "load_average": [load_before, load_after], "cpu_count": usable_cores(), **figures,
                      "jgrpo_over_torch": ratio, "errors": errors}))


if __name__ == "__main__":
    sys.exit(main())
