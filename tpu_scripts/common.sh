#!/usr/bin/env bash
# Shared by every tpu_scripts/*.sh: flag parsing, defaults, and `run`, which prints each gcloud
# command (shell-quoted, copy-pastable) and executes it unless --dry-run was given.
# Settings come from flags, else from the environment (TPU_NAME, ZONE, PROJECT, ACCELERATOR, RUNTIME).
set -euo pipefail

TPU_NAME="${TPU_NAME:-jgrpo}"
ZONE="${ZONE:-us-central1-a}"
PROJECT="${PROJECT:-}"
ACCELERATOR="${ACCELERATOR:-v5litepod-8}"
RUNTIME="${RUNTIME:-}"
DRY_RUN=0
REMOTE_DIR="${REMOTE_DIR:-jgrpo}"   # the checkout's folder in each worker's home
LOG_FILE="${LOG_FILE:-jgrpo-train.log}"
ARGS=()

COMMON_HELP="Common options (or environment variables):
  --name NAME          TPU VM / pod slice name            (TPU_NAME, default jgrpo)
  --zone ZONE          Cloud zone                          (ZONE, default us-central1-a)
  --project PROJECT    Cloud project; default: gcloud's    (PROJECT)
  --accelerator TYPE   v5litepod-8, v5p-32, v6e-16, ...    (ACCELERATOR, default v5litepod-8)
  --runtime VERSION    TPU VM image; default from the type (RUNTIME)
  --dry-run            print the gcloud commands, run nothing
  -h, --help           this help"

# parse_common "$usage" "$@": consumes the common flags, leaves the rest in ARGS.
parse_common() {
  local usage="$1"; shift
  while [ $# -gt 0 ]; do
    case "$1" in
      --name) TPU_NAME="$2"; shift 2 ;;
      --zone) ZONE="$2"; shift 2 ;;
      --project) PROJECT="$2"; shift 2 ;;
      --accelerator) ACCELERATOR="$2"; shift 2 ;;
      --runtime) RUNTIME="$2"; shift 2 ;;
      --dry-run) DRY_RUN=1; shift ;;
      -h|--help) printf '%s\n\n%s\n' "$usage" "$COMMON_HELP"; exit 0 ;;
      *) ARGS+=("$1"); shift ;;
    esac
  done
  if [ -z "$RUNTIME" ]; then RUNTIME="$(runtime_for "$ACCELERATOR")"; fi
}

# The TPU VM software version that matches each generation.
runtime_for() {
  case "$1" in
    v5litepod-*|v5e-*) echo "v2-alpha-tpuv5-lite" ;;
    v5p-*) echo "v2-alpha-tpuv5" ;;
    v6e-*) echo "v2-alpha-tpuv6e" ;;
    v4-*) echo "tpu-ubuntu2204-base" ;;
    *) echo "unknown accelerator type '$1' (expected v5litepod-N, v5p-N, v6e-N or v4-N)" >&2; return 1 ;;
  esac
}

# Flags every gcloud call shares.
gcloud_scope() {
  local scope=(--zone="$ZONE")
  if [ -n "$PROJECT" ]; then scope+=(--project="$PROJECT"); fi
  printf '%s\n' "${scope[@]}"
}

run() {
  printf '+'; printf ' %q' "$@"; printf '\n'
  if [ "$DRY_RUN" -eq 0 ]; then "$@"; fi
}

# ssh_all COMMAND: run one shell command on every worker of the slice at once.
ssh_all() {
  local scope; mapfile -t scope < <(gcloud_scope)
  run gcloud compute tpus tpu-vm ssh "$TPU_NAME" "${scope[@]}" --worker=all --command="$1"
}

die() { echo "error: $*" >&2; exit 2; }
