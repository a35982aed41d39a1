#!/usr/bin/env bash
# Rollout modes on the quickstart (configs/quickstart.yaml: SmolLM2-135M-Instruct, 2-digit addition, v = 4,
# 24 iterations, held-out greedy accuracy every 6): sync, window (the same tokens and training as sync, by
# construction and test) and async (a producer thread, publish every iteration, max_staleness 3: the same
# bound on staleness as v = 4, but each batch sampled by the freshest params the bound allows). Same seed,
# same prompts. Keeps each run's metrics in experiments/rollout/results/<mode>/ and draws the curves.
#
#   bash experiments/rollout/run.sh [OUT_DIR]      # default runs/rollout; ~6 min per run on one core
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="${1:-runs/rollout}"
mkdir -p "$out"
pin=()
if [[ -n "${JGRPO_CPUS:-}" ]]; then  # e.g. JGRPO_CPUS=0: one core, one XLA thread, comparable seconds
  pin=(taskset -c "$JGRPO_CPUS")
  export XLA_FLAGS="--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1 ${XLA_FLAGS:-}"
fi
runs=(
  "sync|"
  "window|rollout.mode=window"
  "async|rollout.mode=async grpo.behaviour_refresh=1 rollout.max_staleness=3"
)
for entry in "${runs[@]}"; do
  name="${entry%%|*}"
  read -r -a overrides <<< "${entry#*|}"
  if [[ -f "$here/results/$name/metrics.jsonl" ]]; then echo "=== $name: done"; continue; fi
  echo "=== $name ${overrides[*]:-}"
  "${pin[@]}" python -m jgrpo.train configs/quickstart.yaml "run.output_dir=$out/$name" run.eval_every=6 \
    logging.progress_bar=false "${overrides[@]}" > "$out/$name.log" 2>&1
  mkdir -p "$here/results/$name"
  cp "$out/$name/metrics.jsonl" "$out/$name/config.yaml" "$here/results/$name/"
done
python -m jgrpo.plot "$here/results/sync" "$here/results/window" "$here/results/async" \
  -o docs/experiments/rollout_modes.png
