#!/usr/bin/env bash
# Create (or reuse) .venv with torch, triton and seqpar installed in editable mode, then activate it.
# Sourced by tools/run_tests.sh and tools/run_bench.sh. The venv sees system site-packages, so a GPU
# machine's preinstalled CUDA torch/triton are reused instead of downloaded.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
if [ ! -x .venv/bin/python ]; then
  python3 -m venv --system-site-packages .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
if ! python -c "import torch" 2>/dev/null; then
  echo "seqpar setup: installing torch==${SEQPAR_TORCH_VERSION:-2.13.0}"
  python -m pip install -q "torch==${SEQPAR_TORCH_VERSION:-2.13.0}"
fi
if command -v nvcc >/dev/null 2>&1 && [ -z "${SEQPAR_BUILD_CUDA:-}" ]; then
  export SEQPAR_BUILD_CUDA=1   # nvcc is here: a CUDA build failure must be loud
fi
# The editable install picks up Python changes by itself; re-install (and rebuild seqpar._C) only when
# what the build reads changed (tools/install_stamp.py).
stamp_file=.venv/.seqpar_install_stamp
stamp=$(python tools/install_stamp.py)
if [ -f "$stamp_file" ] && [ "$(cat "$stamp_file")" = "$stamp" ] && python -c "import seqpar" 2>/dev/null; then
  echo "seqpar setup: seqpar is installed and nothing it builds from changed; not re-installing"
else
  echo "seqpar setup: installing seqpar (editable) with test extras"
  rm -f "$stamp_file"
  python -m pip install -q -e ".[test]"
  echo "$stamp" > "$stamp_file"
fi
