#!/usr/bin/env bash
# The README's first command as a new user meets it, timed: a fresh clone, a fresh virtualenv, no pip cache, no
# converted model and no XLA compilation cache, then `bash .ci/install --quickstart && python -m jgrpo.train
# configs/quickstart.yaml`. Then this machine's sampling speed (benchmarks/sampler.py, jgrpo only, 32 rows x
# 128 tokens) so that readers can scale the time to their machine. A benchmark, not a test.
#
#   bash benchmarks/quickstart_fresh.sh [WORKDIR] [key=value ...]    # overrides go to jgrpo.train
#
# Clones the repository's committed HEAD (uncommitted changes are not measured). Prints the phases' seconds and
# one JSON line; the run directory is WORKDIR/jgrpo/runs/quickstart.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
WORK=${1:-$(mktemp -d /tmp/jgrpo-fresh.XXXXXX)}
shift || true
mkdir -p "$WORK"
rm -rf "$WORK/jgrpo" "$WORK/venv" "$WORK/cache"
export PIP_NO_CACHE_DIR=1 JGRPO_CACHE="$WORK/cache"  # a fresh machine: nothing downloaded, converted or compiled
unset XLA_FLAGS JAX_PLATFORMS

now() { date +%s.%N; }
t0=$(now)
git clone --quiet "$REPO" "$WORK/jgrpo"
cd "$WORK/jgrpo"
python -m venv "$WORK/venv"
# shellcheck disable=SC1091
source "$WORK/venv/bin/activate"
t1=$(now)
bash .ci/install --quickstart
t2=$(now)
python -m jgrpo.train configs/quickstart.yaml "$@"
t3=$(now)
python benchmarks/sampler.py --configs 32x128 --skip transformers --skip tunix | tail -1 > "$WORK/sampler.json"

python - "$t0" "$t1" "$t2" "$t3" "$WORK/sampler.json" <<'EOF'
import json, os, sys
t0, t1, t2, t3 = map(float, sys.argv[1:5])
sampler = json.loads(open(sys.argv[5]).read())
out = {"clone_and_venv_s": round(t1 - t0, 1), "install_s": round(t2 - t1, 1), "quickstart_s": round(t3 - t2, 1),
       "total_s": round(t3 - t0, 1), "cores": len(os.sched_getaffinity(0)), "sampler": sampler}
print(f"clone + venv {out['clone_and_venv_s']:.0f} s, install {out['install_s']:.0f} s, "
      f"quickstart {out['quickstart_s']:.0f} s: {out['total_s'] / 60:.1f} min on {out['cores']} cores")
print(json.dumps(out))
EOF
