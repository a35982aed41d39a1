#!/usr/bin/env bash
# Follow the training log of one worker (process 0 writes the metrics; every worker logs).
source "$(dirname "$0")/common.sh"
USAGE="usage: tpu_scripts/logs.sh [--worker N] [--lines N] [common options]
Tails ~/$LOG_FILE on worker N (default 0) and follows it."
WORKER=0; LINES=100
parse_common "$USAGE" "$@"
set -- "${ARGS[@]+"${ARGS[@]}"}"
while [ $# -gt 0 ]; do
  case "$1" in
    --worker) WORKER="$2"; shift 2 ;;
    --lines) LINES="$2"; shift 2 ;;
    *) die "unknown option '$1' (see --help)" ;;
  esac
done
mapfile -t scope < <(gcloud_scope)
run gcloud compute tpus tpu-vm ssh "$TPU_NAME" "${scope[@]}" --worker="$WORKER" \
  --command="tail -n $LINES -f ~/$LOG_FILE"
