#!/usr/bin/env bash
# Create a Cloud TPU VM or pod slice, directly or through a queued resource.
source "$(dirname "$0")/common.sh"
USAGE="usage: tpu_scripts/create.sh [--queued] [--spot] [common options]
Creates the TPU VM / pod slice NAME of type ACCELERATOR in ZONE.
  --queued   ask through a queued resource (waits for capacity instead of failing)
  --spot     spot capacity (cheaper, preemptible; jgrpo resumes from its last checkpoint)"
QUEUED=0; SPOT=0
parse_common "$USAGE" "$@"
for a in "${ARGS[@]+"${ARGS[@]}"}"; do
  case "$a" in
    --queued) QUEUED=1 ;;
    --spot) SPOT=1 ;;
    *) die "unknown option '$a' (see --help)" ;;
  esac
done
mapfile -t scope < <(gcloud_scope)
extra=()
if [ "$SPOT" -eq 1 ]; then extra+=(--spot); fi
if [ "$QUEUED" -eq 1 ]; then
  run gcloud compute tpus queued-resources create "$TPU_NAME-qr" "${scope[@]}" --node-id="$TPU_NAME" \
    --accelerator-type="$ACCELERATOR" --runtime-version="$RUNTIME" "${extra[@]+"${extra[@]}"}"
else
  run gcloud compute tpus tpu-vm create "$TPU_NAME" "${scope[@]}" \
    --accelerator-type="$ACCELERATOR" --version="$RUNTIME" "${extra[@]+"${extra[@]}"}"
fi
