#!/usr/bin/env bash
# Copy a run directory (metrics, samples, checkpoints) from worker 0 to this machine.
source "$(dirname "$0")/common.sh"
USAGE="usage: tpu_scripts/copy.sh REMOTE_RUN_DIR [LOCAL_DIR] [common options]
REMOTE_RUN_DIR is relative to ~/$REMOTE_DIR on worker 0 (e.g. runs/qwen-gsm8k); LOCAL_DIR defaults to '.'.
A run whose output_dir is a gs:// bucket needs no copy: read it with gsutil / gcloud storage."
parse_common "$USAGE" "$@"
[ "${#ARGS[@]}" -ge 1 ] || die "REMOTE_RUN_DIR is required (see --help)"
mapfile -t scope < <(gcloud_scope)
run gcloud compute tpus tpu-vm scp --recurse "$TPU_NAME:~/$REMOTE_DIR/${ARGS[0]}" "${ARGS[1]:-.}" \
  "${scope[@]}" --worker=0
