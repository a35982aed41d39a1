"""Typed, frozen run configuration: one dataclass per section, each field with its type, default and checks.

Loading (defaults <- YAML file <- dotted CLI overrides, every value coerced to its field's type) is
`jgrpo.config.loading`; docs/configuration.md lists every field (`jgrpo.config.docs`).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from jgrpo.config.env import EnvConfig  # the env section lives in its own file too
from jgrpo.config.errors import ConfigError  # noqa: F401 - re-exported: callers import it from jgrpo.config
from jgrpo.config.errors import check as _check
from jgrpo.config.grpo import GRPOConfig  # the grpo section lives in its own file; importable from here too
from jgrpo.config.rollout import RolloutConfig  # so does the rollout section


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoraConfig:
    # Adapter rank; 0 = full fine-tuning. With rank > 0 only the adapters train: the base weights stay frozen,
    # the reference policy is the base itself and a behaviour copy holds adapters only (docs/lora.md).
    rank: int = 0
    alpha: float = 16.0  # the low-rank term is scaled by alpha / rank (PEFT's lora_alpha)
    # The decoder projections that get an adapter. No dropout: it would make log-probs stochastic.
    targets: tuple[Literal["q", "k", "v", "o", "gate", "up", "down"], ...] = ("q", "k", "v", "o", "gate", "up", "down")

    def __post_init__(self):
        _check(self.rank >= 0, "model.lora.rank", self.rank, "0 (off) or a positive integer")
        _check(self.alpha > 0, "model.lora.alpha", self.alpha, "a positive number")
        _check(bool(self.targets) and len(set(self.targets)) == len(self.targets), "model.lora.targets",
               self.targets, "a non-empty list without repeats")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    # A built-in name (smollm2-135m-instruct), a local HF directory or .gguf file, or a hub id.
    name: str = "smollm2-135m-instruct"
    # Master weights and AdamW state; float32 for training (bfloat16 halves them but rounds away small updates).
    # With LoRA: the frozen base's dtype (bfloat16 halves it and loses nothing); adapters are always float32.
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    # Matmuls, activations and the KV cache; bfloat16 on TPUs and GPUs (logits and log-probs stay float32).
    compute_dtype: Literal["float32", "bfloat16"] = "float32"
    # What the layer scan recomputes in the backward pass: nothing, everything, or all but matmuls.
    remat: Literal["none", "full", "dots"] = "none"
    # Attention implementation; auto = by the platform of the mesh's devices: custom on CPU and NVIDIA GPUs, splash
    # (the Pallas kernel) on TPU; cudnn is cuDNN's fused attention (why: docs/configuration.md).
    attention: Literal["auto", "custom", "xla", "cudnn", "splash"] = "auto"
    # Mixture-of-experts models (Qwen3-MoE): how the experts' matmuls run; auto = by the platform: megablox (the
    # Pallas grouped matmul) on TPU, sorted_tiles on CPU and GPU; ragged is jax.lax.ragged_dot; dense (every expert on
    # every token) is the test reference (why: docs/configuration.md). Dense models ignore it.
    moe_impl: Literal["auto", "sorted_tiles", "megablox", "ragged", "dense"] = "auto"
    # Mixture-of-experts models with mesh.expert > 1: how tokens reach the devices of their experts (why:
    # docs/configuration.md). all_gather: every device of an expert group gathers the group's tokens, runs its
    # experts, and a reduce-scatter sums the outputs back (any platform); ragged_all_to_all: each (token, expert)
    # assignment goes only to its expert's device and back (TPU; XLA:CPU lacks the op). auto: TPU ragged_all_to_all,
    # else all_gather.
    moe_dispatch: Literal["auto", "all_gather", "ragged_all_to_all"] = "auto"
    # Mixture-of-experts models: rollout = every trainer forward sends each token to the experts the sampler's
    # forward chose (routing replay, R3; docs/algorithm.md §16); none = the trainer's router decides. A dense
    # model with rollout is a config error.
    routing_replay: Literal["none", "rollout"] = "none"
    # Mixture-of-experts models: the router's load-balance loss (transformers' load_balancing_loss_func, k at an
    # even load) and z loss (mean logsumexp^2 of its logits) are added to the loss with these weights; 0 (off) for
    # RL, whatever the model's config.json says for pretraining. Logged either way (moe/aux_loss, moe/z_loss).
    router_aux_loss_coef: float = 0.0
    router_z_loss_coef: float = 0.0
    # Tokens per chunk when computing log-probs from hidden states (never materialise [B, T, V]).
    logprob_chunk: int = 256
    # Trainer forward/backward: compute each prompt once for its G completions instead of once per row
    # (same numbers; the prompt's share of the work drops by G). Off = plain [prompt | completion] rows.
    share_prompts: bool = True
    # The trainer's forwards (the reference's and pi_k's log-prob passes, the update) over packed micro-batches:
    # completions end to end in rows of model.packing_width slots instead of each padded to max_new_tokens, each
    # group's prompt once (same loss and gradients; jgrpo/training/packed_layout.py, docs/configuration.md).
    packing: bool = False
    # The slots of a packed row: 0 = the completion width (max_new_tokens, or env.max_total_tokens) rounded up to 8.
    packing_width: int = 0
    # A packed micro-batch computes only its rows in use, rounded up to the first of these fractions of its rows
    # that holds them (or all): one program per bucket, all compiled in the first iteration. () = always all rows.
    packing_row_buckets: tuple[float, ...] = (0.25, 0.5, 0.75, 0.875)
    lora: LoraConfig = LoraConfig()

    def __post_init__(self):
        _check(self.logprob_chunk > 0, "model.logprob_chunk", self.logprob_chunk, "a positive integer")
        _check(not self.packing or self.share_prompts, "model.packing", True,
               "it needs model.share_prompts=true (packing keeps the shared-prompt forward: each group's prompt "
               "once); set model.share_prompts: true, or model.packing: false")
        _check(self.packing_width >= 0, "model.packing_width", self.packing_width, "0 (auto) or a positive integer")
        _check(all(0 < f < 1 for f in self.packing_row_buckets), "model.packing_row_buckets",
               list(self.packing_row_buckets), "fractions strictly between 0 and 1, e.g. [0.5, 0.75] (or [])")
        for name in ("router_aux_loss_coef", "router_z_loss_coef"):
            _check(getattr(self, name) >= 0, f"model.{name}", getattr(self, name), "a number >= 0 (0 = off)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshConfig:
    # Mesh axis sizes; at most one may be -1 (= all remaining devices).
    data: int = 1
    fsdp: int = -1
    # Expert parallelism (mixtures of experts): the experts are split over this axis, E / expert per device (FSDP
    # within); everything else is data-parallel over it (jgrpo/models/expert_parallel.py). 1 = off.
    expert: int = 1
    tensor: int = 1
    # Placement. 0 = the sampler and the trainer share every device. n > 0 = disaggregated: the first n devices
    # form the sampler's sub-mesh and the rest the trainer's, each with the axes above (the -1 axis absorbs its
    # devices); each publish of the weights is one resharding copy between them (`time/weight_sync`). With
    # several processes the sampler gets the last n devices as whole processes (n a multiple of the devices per
    # process, the trainer's a multiple of n) and the weights cross in one collective
    # (parallel/weights/process_crossing.py).
    rollout_devices: int = 0

    def __post_init__(self):
        sizes = {"data": self.data, "fsdp": self.fsdp, "expert": self.expert, "tensor": self.tensor}
        for name, size in sizes.items():
            _check(size == -1 or size >= 1, f"mesh.{name}", size, "a positive integer or -1")
        _check(list(sizes.values()).count(-1) <= 1, "mesh", sizes, "at most one axis may be -1")
        _check(self.rollout_devices >= 0, "mesh.rollout_devices", self.rollout_devices,
               "0 (shared devices) or the number of devices for the sampler")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplerConfig:
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off
    max_new_tokens: int = 128
    # Extra stop ids besides the tokenizer's EOS and end-of-turn ids.
    stop_token_ids: tuple[int, ...] = ()
    # Prompt lengths are rounded up to a multiple of this, so recompiles stay rare.
    prompt_bucket: int = 64
    # The dtype of the weights the sampler reads (the sampling-layout copy, and the behaviour copy when v > 1).
    # bfloat16 halves their memory. With model.compute_dtype=bfloat16 the matmuls see the same bf16 weights
    # either way (only norms and the embedding row are rounded), so the behaviour policy barely moves; on a TPU
    # the decode step even reads bf16 either way: XLA rounds float32 weights once per sampling call into a bf16
    # temporary (Qwen2.5-0.5B, v5e: the same 1.03 GB per step, 2.1 GiB more per chip; docs/tpu_plans.md).
    # float32 keeps the sampler's log-probs exactly those of the trained weights. int8: every layer projection
    # weight-only int8 (per-output-channel scales; norms, biases, embeddings in model.compute_dtype), quantized at
    # each weight sync: a decode step reads a quarter of float32's weight bytes (half of bf16's); the sampler is
    # then another policy than the trained one, so set grpo.masked_is or grpo.truncated_is (docs/algorithm.md).
    weights_dtype: Literal["float32", "bfloat16", "int8"] = "float32"
    # With int8 weights, the input embedding and the lm_head int8 too (one scale per vocabulary row, tied or not):
    # for a small model they are a large share of what a decode step reads (Qwen2.5-0.5B: 0.27 of 0.99 GB).
    quantize_embeddings: bool = False
    # The sampler's KV cache: auto = model.compute_dtype (as the trainer's forward computes keys and values), or
    # float32, bfloat16, int8 (keys and values with one scale per token and KV head, models/kv_quant.py). On a
    # long-context run the cache is most of what a decode step reads (DeepScaleR 1.5B, v5e: 4.2 of 7.3 GB at its
    # last step); int8 reads a quarter of float32's bytes, half of bf16's. Like int8 weights it makes the sampler
    # another policy (set grpo.masked_is or grpo.truncated_is); the evaluator keeps the compute dtype.
    kv_cache_dtype: Literal["auto", "float32", "bfloat16", "int8"] = "auto"
    # The KV cache is pages of page_size tokens (0 = by platform, docs/configuration.md): a group's prompt is stored
    # once for its G rows, a row takes pages as it grows and gives them back when it stops.
    page_size: int = 0
    # Pages of each queue's pool (a queue per device of the row axis; 0 = every prompt's pages and every slot's row
    # at its longest: nothing is ever preempted). Fewer admit rows by the memory they use at their own lengths:
    # where a step finds too few pages, the youngest rows are preempted and drawn again from their start (the same
    # keys: the same tokens up to rounding; counted as sampler/preempted).
    kv_pages: int = 0
    # The decode attention over pages: xla (blocks of pages up to the step's longest row) or pallas (a TPU kernel
    # that reads each row's live pages only); auto = by platform (docs/configuration.md).
    paged_attention: Literal["auto", "xla", "pallas"] = "auto"
    # How often a whole-batch sampling call may halve its slots as rows finish (the rows left moved to the first
    # slots: their page tables move, not their keys/values); -1 = by platform (docs/configuration.md).
    shrink: int = -1
    # Multi-turn episodes: steps the sampler decodes between returns to the host (where paused turns are seen);
    # 0 = a quarter of a turn, at least 8 (`rollout.episodes.episode_chunk`).
    decode_chunk: int = 0
    # The decode step's layer loop: unrolled over per-layer weights and pools (no per-step copies on CPU), or
    # one lax.scan over the stacked ones (one layer to compile); auto = by platform (docs/configuration.md).
    decode_layers: Literal["auto", "unrolled", "scanned"] = "auto"
    # How a token is drawn from the processed distribution (same distribution, different cost per backend):
    # inverse_cdf, gumbel or categorical; auto = by platform (docs/configuration.md).
    draw: Literal["auto", "inverse_cdf", "gumbel", "categorical"] = "auto"
    # How the top-k / top-p thresholds are found (same tokens kept): sort (lax.top_k) or bisect (32 passes over
    # the row, no sort); auto = by platform (docs/configuration.md).
    threshold_search: Literal["auto", "sort", "bisect"] = "auto"
    # Rows decoded at once. 0 = all of the batch's rows (static batching: the batch decodes until its longest
    # row stops); fewer = continuous batching: a slot whose row stops takes the next pending row, so a long
    # tail of completion lengths does not leave slots decoding padding (docs/guide.md; measured in
    # docs/benchmarks.md#rollout-engine). Same samples up to float rounding.
    slots: int = 0

    def __post_init__(self):
        _check(self.temperature >= 0, "sampler.temperature", self.temperature, ">= 0 (0 = greedy)")
        _check(self.top_k >= 0, "sampler.top_k", self.top_k, ">= 0 (0 = off)")
        _check(0 < self.top_p <= 1, "sampler.top_p", self.top_p, "in (0, 1] (1 = off)")
        _check(0 <= self.min_p < 1, "sampler.min_p", self.min_p, "in [0, 1) (0 = off)")
        _check(self.max_new_tokens > 0, "sampler.max_new_tokens", self.max_new_tokens, "a positive integer")
        _check(self.prompt_bucket > 0, "sampler.prompt_bucket", self.prompt_bucket, "a positive integer")
        _check(self.decode_chunk >= 0, "sampler.decode_chunk", self.decode_chunk, ">= 0 (0 = the sampler's choice)")
        _check(self.page_size >= 0, "sampler.page_size", self.page_size, ">= 0 (0 = by platform)")
        _check(self.kv_pages >= 0, "sampler.kv_pages", self.kv_pages, ">= 0 (0 = every slot's row at its longest)")
        _check(self.shrink >= -1, "sampler.shrink", self.shrink, ">= 0, or -1 = by platform")
        _check(self.slots >= 0, "sampler.slots", self.slots, ">= 0 (0 = one slot per row)")
        _check(not self.quantize_embeddings or self.weights_dtype == "int8", "sampler.quantize_embeddings", True,
               f"false with sampler.weights_dtype={self.weights_dtype}: embeddings are quantized with int8 weights "
               "only (set sampler.weights_dtype: int8)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimConfig:
    learning_rate: float = 1e-6
    schedule: Literal["constant", "cosine"] = "constant"
    warmup_steps: int = 0
    decay_steps: int | None = None  # cosine horizon in optimiser steps (None = the whole run)
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    max_grad_norm: float | None = 1.0  # global-norm clipping; None = off
    # A step with nothing in the loss (every group of the minibatch masked as zero-variance; with beta = 0 also
    # every advantage 0) has a zero gradient, yet AdamW would still move along its momentum and the schedule
    # would advance. True: such a step leaves params, optimiser state and schedule untouched (counted as
    # loss/empty_steps). False: step anyway, as TRL and verl do.
    skip_empty_steps: bool = True

    def __post_init__(self):
        _check(self.learning_rate > 0, "optim.learning_rate", self.learning_rate, "> 0")
        _check(self.warmup_steps >= 0, "optim.warmup_steps", self.warmup_steps, ">= 0")
        _check(self.weight_decay >= 0, "optim.weight_decay", self.weight_decay, ">= 0")
        _check(0 <= self.b1 < 1, "optim.b1", self.b1, "in [0, 1)")
        _check(0 <= self.b2 < 1, "optim.b2", self.b2, "in [0, 1)")
        _check(self.max_grad_norm is None or self.max_grad_norm > 0, "optim.max_grad_norm",
               self.max_grad_norm, "None or > 0")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataConfig:
    # A built-in task (arithmetic, countdown, word_problems) or a local JSONL / Parquet / save_to_disk path, or a
    # hub id.
    source: str = "arithmetic"
    split: str = "train"
    format: Literal["auto", "gsm8k", "math", "aime", "custom"] = "auto"
    question_field: str = "question"
    answer_field: str = "answer"
    batch_size: int = 4  # B prompts per iteration (each expanded to G samples)
    shuffle_seed: int = 0
    epochs: int = 1
    system_prompt: str | None = None
    instruction_suffix: str = ""
    max_prompt_length: int = 256
    truncate_long_prompts: bool = False  # False: drop and count; True: keep the last tokens
    skip_bad_rows: bool = False  # False: a bad row is an error naming file, row and field
    # Built-in tasks.
    task_seed: int = 0  # which problems are generated (the train/test split itself never depends on it)
    num_examples: int = 10000
    num_test_examples: int = 200
    arithmetic_digits: int = 2
    arithmetic_operators: str = "+"
    countdown_numbers: int = 3

    def __post_init__(self):
        _check(self.batch_size >= 1, "data.batch_size", self.batch_size, "a positive integer")
        _check(self.epochs >= 1, "data.epochs", self.epochs, "a positive integer")
        _check(self.max_prompt_length > 0, "data.max_prompt_length", self.max_prompt_length, "> 0")
        _check(self.arithmetic_digits >= 1, "data.arithmetic_digits", self.arithmetic_digits, ">= 1")
        _check(set(self.arithmetic_operators) <= set("+-*") and self.arithmetic_operators != "",
               "data.arithmetic_operators", self.arithmetic_operators, "a non-empty subset of '+-*'")
        _check(self.countdown_numbers >= 2, "data.countdown_numbers", self.countdown_numbers, ">= 2")
        _check(self.num_examples >= 1, "data.num_examples", self.num_examples, "a positive integer")
        _check(self.num_test_examples >= 1, "data.num_test_examples", self.num_test_examples, "a positive integer")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RewardConfig:
    # Reward function names from jgrpo.rewards, summed with these weights.
    functions: tuple[str, ...] = ("exact_numeric",)
    weights: tuple[float, ...] = (1.0,)
    timeout_s: float = 5.0  # a reward call running longer gives 0 and is counted
    num_workers: int = 2  # reward worker processes (a stuck call is killed with its process)
    # DAPO's soft overlong punishment (arXiv 2503.14476 eq. 13), in tokens: a completion longer than
    # max_new_tokens - overlong_buffer gets -overlong_penalty * (length - (max_new_tokens - overlong_buffer)) /
    # overlong_buffer added to its reward (-overlong_penalty at max_new_tokens), logged as reward/overlong. 0 = off.
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0

    def __post_init__(self):
        _check(self.num_workers >= 1, "reward.num_workers", self.num_workers, "a positive integer")
        _check(len(self.functions) >= 1, "reward.functions", self.functions, "at least one reward function")
        _check(len(self.weights) == len(self.functions), "reward.weights", self.weights,
               f"one weight per function ({len(self.functions)})")
        _check(self.timeout_s > 0, "reward.timeout_s", self.timeout_s, "> 0")
        _check(self.overlong_buffer >= 0, "reward.overlong_buffer", self.overlong_buffer, ">= 0 (0 = off)")
        _check(self.overlong_penalty >= 0, "reward.overlong_penalty", self.overlong_penalty, ">= 0")
        _check("overlong" not in self.functions, "reward.functions", self.functions,
               "no function named 'overlong' (the name of the overlong punishment's column)")

    def component_names(self) -> tuple[str, ...]:
        """The reward table's columns after the total: each function, then `overlong` when it is on."""
        return self.functions + (("overlong",) if self.overlong_buffer else ())

    def component_weights(self) -> tuple[float, ...]:
        """Each column's weight in the total (the punishment is added as is)."""
        return self.weights + ((1.0,) if self.overlong_buffer else ())


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    every: int = 50  # iterations between saves (0 = only at the end and on SIGTERM)
    keep: int = 3
    async_save: bool = True
    resume: bool = True  # resume from the latest complete checkpoint in the run directory
    # zstd-compress the arrays (Orbax's default). Trained float weights barely compress, and the compression
    # runs on the host's cores while the next iteration samples: off by default (benchmarks/checkpoint.py).
    compress: bool = False

    def __post_init__(self):
        _check(self.every >= 0, "checkpoint.every", self.every, ">= 0")
        _check(self.keep >= 1, "checkpoint.keep", self.keep, ">= 1")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoggingConfig:
    tensorboard: bool = True
    progress_bar: bool = True
    samples_every: int = 10  # iterations between dumps of prompts/completions (0 = never)
    # A Weights & Biases project to log to as well (empty: none); needs the wandb extra (pip install 'jgrpo[wandb]').
    wandb_project: str = ""
    # online (login and network), offline (RUN_DIR/wandb, `wandb sync` later) or disabled.
    wandb_mode: Literal["online", "offline", "disabled"] = "online"

    def __post_init__(self):
        _check(self.samples_every >= 0, "logging.samples_every", self.samples_every, ">= 0")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunConfig:
    output_dir: str = "runs/default"
    seed: int = 0
    iterations: int = 100
    eval_every: int = 0  # iterations between held-out evaluations (0 = never); the last iteration always is one
    # Evaluate the untrained model before the first iteration (logged as iteration 0), so the run ends with a
    # before / after comparison on the held-out split.
    eval_before: bool = False
    eval_samples: int = 4  # n samples per test prompt for pass@k and maj@k (0: greedy accuracy only, ~3x cheaper)
    # The k of pass@k and maj@k, each 1..eval_samples (empty: 1 and eval_samples).
    eval_k: tuple[int, ...] = ()
    # Test prompts per sampler call (0 = data.batch_size): evaluation has no update, so it can batch wider.
    eval_batch_size: int = 0
    # The evaluations every run.eval_every iterations use the test split's first N prompts (rounded up to whole
    # eval batches; 0 = all): a cheap curve while training. Before the first and after the last: always all.
    eval_prompts: int = 0
    # A field of the test rows' references (e.g. the word problems' held_out, a MATH file's type): greedy accuracy,
    # pass@k and maj@k are also reported per value of it ("held_out/True/greedy_accuracy"). "" = not grouped.
    eval_group_by: str = ""
    # Optimiser steps in a row with a NaN/inf loss or gradient (each skipped) before the run stops.
    max_nonfinite_steps: int = 3

    def __post_init__(self):
        _check(self.iterations >= 1, "run.iterations", self.iterations, "a positive integer")
        _check(self.max_nonfinite_steps >= 1, "run.max_nonfinite_steps", self.max_nonfinite_steps, ">= 1")
        _check(self.eval_every >= 0, "run.eval_every", self.eval_every, ">= 0")
        _check(self.eval_samples >= 0, "run.eval_samples", self.eval_samples, ">= 0")
        _check(all(1 <= k <= self.eval_samples for k in self.eval_k), "run.eval_k", list(self.eval_k),
               f"values in 1..run.eval_samples={self.eval_samples} (k samples out of the n drawn per prompt)"
               if self.eval_samples else f"needs run.eval_samples >= {max(self.eval_k, default=1)} (none are "
               "drawn: run.eval_samples=0; jgrpo.eval: --samples)")
        _check(self.eval_batch_size >= 0, "run.eval_batch_size", self.eval_batch_size, ">= 0")
        _check(self.eval_prompts >= 0, "run.eval_prompts", self.eval_prompts, ">= 0")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    sampler: SamplerConfig = dataclasses.field(default_factory=SamplerConfig)
    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
    grpo: GRPOConfig = dataclasses.field(default_factory=GRPOConfig)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    reward: RewardConfig = dataclasses.field(default_factory=RewardConfig)
    env: EnvConfig = dataclasses.field(default_factory=EnvConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    logging: LoggingConfig = dataclasses.field(default_factory=LoggingConfig)
    run: RunConfig = dataclasses.field(default_factory=RunConfig)

    def __post_init__(self):
        rows, g = self.data.batch_size * self.grpo.num_generations, self.grpo
        _check(rows % (g.num_minibatches * g.micro_batches) == 0, "grpo.micro_batches", g.micro_batches,
               f"data.batch_size * grpo.num_generations = {self.data.batch_size} * {g.num_generations} = {rows} "
               f"rows must split into grpo.num_minibatches * grpo.micro_batches = {g.num_minibatches} * "
               f"{g.micro_batches} equal parts")
        if self.rollout.mode == "window":
            _check(isinstance(self.grpo.behaviour_refresh, int), "rollout.mode", "window",
                   "it needs a fixed grpo.behaviour_refresh, not adaptive (a window is the v iterations one behaviour "
                   "policy serves)")
            _check(not self.grpo.dynamic_sampling_rounds, "rollout.mode", "window",
                   "it needs grpo.dynamic_sampling_rounds=0 (dynamic sampling draws extra rounds for a short "
                   "batch)")
        if self.rollout.mode == "async":
            _check(self.grpo.behaviour_refresh == 1, "grpo.behaviour_refresh", self.grpo.behaviour_refresh,
                   "1 with rollout.mode=async: the producer samples with the newest published params "
                   "(rollout.publish_every, rollout.max_staleness), there is no behaviour copy to refresh")
            _check(not self.grpo.dynamic_sampling_rounds, "rollout.mode", "async",
                   "it needs grpo.dynamic_sampling_rounds=0 (the producer's batches are fixed when sampled)")
        if self.env.on:
            self._check_env()
        if self.model.packing and self.model.packing_width:
            _check(self.model.packing_width >= self.completion_tokens, "model.packing_width", self.model.packing_width,
                   f">= the completion width {self.completion_tokens} (sampler.max_new_tokens, or env.max_total_tokens "
                   "with an environment): a packed row must hold the longest completion, or 0 (auto)")
        if self.rollout.role != "both":
            _check(not self.mesh.rollout_devices, "mesh.rollout_devices", self.mesh.rollout_devices,
                   f"0 with rollout.role={self.rollout.role}: each job samples or trains on all of its own devices")
        if self.mesh.rollout_devices:
            _check(self.model.lora.rank == 0, "mesh.rollout_devices", self.mesh.rollout_devices,
                   "0 with LoRA (model.lora.rank > 0): the frozen base would need a copy on the sampler's devices")

    def _check_env(self) -> None:
        e = self.env
        _check(e.max_total_tokens >= self.sampler.max_new_tokens, "env.max_total_tokens", e.max_total_tokens,
               f">= sampler.max_new_tokens={self.sampler.max_new_tokens} (one turn's budget)")
        _check(self.grpo.advantage_reward_normalisation != "per_reward", "grpo.advantage_reward_normalisation",
               "per_reward", f"group with env.name={e.name}: the environment's rewards are no reward.functions "
                             "column to normalise on its own")

    @property
    def completion_tokens(self) -> int:
        """N, the width of a row's tokens after its prompt: env.max_total_tokens with an environment (turns and
        replies together), else sampler.max_new_tokens."""
        return self.env.max_total_tokens if self.env.on else self.sampler.max_new_tokens

    @property
    def samples_on_policy(self) -> bool:
        """Whether every batch is sampled by the params it trains (v = 1 and not async): then lp_alpha is pi_k."""
        return self.grpo.behaviour_refresh == 1 and self.rollout.mode != "async"
