#!/usr/bin/env bash
# The quickstart_tools seeds experiment (issue #37; docs/experiments.md): configs/quickstart_tools.yaml with seeds
# 0, 1, 2, each evaluated on the 50 held-out products before training and after its last iteration (greedy accuracy,
# tool-call validity, turns), beside the untrained model without the tool (env.tools=[]).
#   bash experiments/tools/run.sh [OUT]          # default runs/tools; then: python experiments/tools/report.py OUT
set -euo pipefail
OUT=${1:-runs/tools}
mkdir -p "$OUT"
for seed in 0 1 2; do
  if [ ! -f "$OUT/seed$seed/metrics.jsonl" ] || ! grep -q '"iteration": 30,' "$OUT/seed$seed/metrics.jsonl"; then
    /usr/bin/time -f "seed $seed: %e s" python -m jgrpo.train configs/quickstart_tools.yaml "run.seed=$seed" \
      "run.output_dir=$OUT/seed$seed"
  fi
done
python -m jgrpo.eval configs/quickstart_tools.yaml "env.tools=[]" "env.first_turn_prefix=" | tail -1 > "$OUT/no_tool.json"
