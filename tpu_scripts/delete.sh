#!/usr/bin/env bash
# Delete the TPU VM / pod slice (and its queued resource, if it was created through one).
source "$(dirname "$0")/common.sh"
USAGE="usage: tpu_scripts/delete.sh [--queued] [common options]
Deletes NAME. With --queued, deletes the queued resource NAME-qr and the slice it holds."
QUEUED=0
parse_common "$USAGE" "$@"
for a in "${ARGS[@]+"${ARGS[@]}"}"; do
  case "$a" in
    --queued) QUEUED=1 ;;
    *) die "unknown option '$a' (see --help)" ;;
  esac
done
mapfile -t scope < <(gcloud_scope)
if [ "$QUEUED" -eq 1 ]; then
  run gcloud compute tpus queued-resources delete "$TPU_NAME-qr" "${scope[@]}" --force --quiet
else
  run gcloud compute tpus tpu-vm delete "$TPU_NAME" "${scope[@]}" --quiet
fi
