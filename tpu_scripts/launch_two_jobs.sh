#!/usr/bin/env bash
# Start a run as two jobs on two slices: the trainer job on one, the rollout job on the other (docs/tpu.md,
# "Two jobs"). Each slice is its own jax.distributed world; they meet at the trainer's worker 0.
source "$(dirname "$0")/common.sh"
USAGE="usage: tpu_scripts/launch_two_jobs.sh --trainer NAME --rollout NAME [--port PORT] CONFIG [key=value ...] [common options]
Runs 'python -m jgrpo.train CONFIG key=value ... rollout.role=trainer rollout.endpoint=IP:PORT' on every worker
of the trainer slice, and the same with rollout.role=rollout on every worker of the rollout slice, where IP is
the trainer slice's worker 0 (its internal address) and PORT defaults to 8477. The config must say
rollout.mode: async; both slices need the same number of hosts. Output: ~/$LOG_FILE on the trainer's workers,
~/jgrpo-rollout.log on the rollout's. Launch the same command again after a preemption of either slice."
TRAINER="" ROLLOUT="" PORT=8477 REST=()
while [ $# -gt 0 ]; do
  case "$1" in
    --trainer) TRAINER="$2"; shift 2 ;;
    --rollout) ROLLOUT="$2"; shift 2 ;;
    --port) PORT="$2"; shift 2 ;;
    *) REST+=("$1"); shift ;;
  esac
done
parse_common "$USAGE" "${REST[@]}"
if [ -z "$TRAINER" ] || [ -z "$ROLLOUT" ]; then die "--trainer NAME and --rollout NAME are required (see --help)"; fi
[ "${#ARGS[@]}" -ge 1 ] || die "CONFIG is required (see --help)"
mapfile -t scope < <(gcloud_scope)
describe=(gcloud compute tpus tpu-vm describe "$TRAINER" "${scope[@]}" --format='value(networkEndpoints[0].ipAddress)')
if [ "$DRY_RUN" -eq 1 ]; then
  run "${describe[@]}"
  ip="TRAINER_WORKER0_IP"
else
  printf '+'; printf ' %q' "${describe[@]}"; printf '\n'
  ip="$("${describe[@]}")"
  [ -n "$ip" ] || die "could not read the internal address of $TRAINER's worker 0"
fi
launch() {  # launch ROLE SLICE LOG
  local cmd="cd ~/$REMOTE_DIR && nohup python3 -m jgrpo.train"
  for a in "${ARGS[@]}" "rollout.role=$1" "rollout.endpoint=$ip:$PORT"; do cmd+=" $(printf '%q' "$a")"; done
  TPU_NAME="$2"
  ssh_all "$cmd > ~/$3 2>&1 &"
}
launch trainer "$TRAINER" "$LOG_FILE"
launch rollout "$ROLLOUT" jgrpo-rollout.log
