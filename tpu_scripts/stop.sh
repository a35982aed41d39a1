#!/usr/bin/env bash
# Stop the training run on every worker with SIGTERM: jgrpo saves a checkpoint and exits cleanly.
source "$(dirname "$0")/common.sh"
USAGE="usage: tpu_scripts/stop.sh [common options]
Sends SIGTERM to 'python3 -m jgrpo.train' on every worker (a checkpoint is written before exit);
launch.sh with the same config resumes from it."
parse_common "$USAGE" "$@"
[ "${#ARGS[@]}" -eq 0 ] || die "unexpected arguments: ${ARGS[*]} (see --help)"
ssh_all "pkill -TERM -f 'python3 -m jgrpo.train' || true"
