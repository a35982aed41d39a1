#!/usr/bin/env bash
# Start one training run on all workers of the slice at once (JAX multi-controller: every host runs
# the same command; jax.distributed.initialize() finds the others on Cloud TPU by itself).
source "$(dirname "$0")/common.sh"
USAGE="usage: tpu_scripts/launch.sh CONFIG [key=value ...] [common options]
Runs 'python -m jgrpo.train CONFIG key=value ...' in the background on every worker; output goes to
~/$LOG_FILE on each. Use a gs:// bucket as run.output_dir so every host writes one shared checkpoint,
and launch the same command again after a preemption: it resumes from the latest checkpoint."
parse_common "$USAGE" "$@"
[ "${#ARGS[@]}" -ge 1 ] || die "CONFIG is required (see --help)"
cmd="cd ~/$REMOTE_DIR && nohup python3 -m jgrpo.train"
for a in "${ARGS[@]}"; do cmd+=" $(printf '%q' "$a")"; done
cmd+=" > ~/$LOG_FILE 2>&1 &"
ssh_all "$cmd"
