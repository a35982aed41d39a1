#!/usr/bin/env bash
# Issue #6: on-policy vs off-policy GRPO on SmolLM2-135M-Instruct and 2-digit addition, every run from
# base.yaml with the same seed, data order and number of samples. Runs one after another (resumable: a run
# whose directory already holds its last checkpoint is skipped by the trainer's own resume), then plots.
#
#   bash experiments/arithmetic/run_all.sh [OUT_DIR]      # default runs/arithmetic
#
# Set JGRPO_CPUS (e.g. "0") to pin every process to those cores with taskset; XLA then runs one thread per
# core so the wall-clock per iteration is comparable across runs.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="${1:-runs/arithmetic}"
mkdir -p "$out"
pin=()
if [[ -n "${JGRPO_CPUS:-}" ]]; then
  pin=(taskset -c "$JGRPO_CPUS")
  export XLA_FLAGS="--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1 ${XLA_FLAGS:-}"
fi

# name | overrides (on top of base.yaml)
runs=(
  "v1_i1|"
  "v1_i1_masked|grpo.mask_zero_variance=true"
  "v4_i1|grpo.behaviour_refresh=4"
  "v10_i1|grpo.behaviour_refresh=10"
  "v10_i1_recentred|grpo.behaviour_refresh=10 grpo.off_policy_ratio=recentred"
  "v10_i1_current|grpo.behaviour_refresh=10 grpo.off_policy_ratio=current"
  "v1_i4|grpo.inner_steps=4"
  # LoRA rank 16 (#21, docs/lora.md): 10x the full fine-tuning lr, alpha = 2 r, 60 iterations
  "v4_i1_lora16|grpo.behaviour_refresh=4 model.lora.rank=16 model.lora.alpha=32 optim.learning_rate=2e-4 run.iterations=60 run.eval_before=true"
)

if [[ ! -f "$out/untrained_eval.json" ]]; then
  "${pin[@]}" python -m jgrpo.eval "$here/base.yaml" | tail -n 1 > "$out/untrained_eval.json"
fi
for entry in "${runs[@]}"; do
  name="${entry%%|*}"
  read -r -a overrides <<< "${entry#*|}"
  echo "=== $name ${overrides[*]:-}"
  "${pin[@]}" python -m jgrpo.train "$here/base.yaml" "run.output_dir=$out/$name" logging.progress_bar=false \
    "${overrides[@]}" > "$out/$name.log" 2>&1
done
python experiments/arithmetic/report.py "$out"
