#!/usr/bin/env bash
# Compile csrc/ into a private build folder (default /tmp/seqpar_cuda_build) without installing:
# lets several people check that their CUDA code compiles without clobbering each other's build.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="${1:-/tmp/seqpar_cuda_build}"
PY="${PYTHON:-$REPO/.venv/bin/python}"
cmake -S "$REPO" -B "$BUILD" -DSEQPAR_OUTPUT_DIR="$BUILD/out" -DPython_EXECUTABLE="$PY" \
  -Dpybind11_DIR="$("$PY" -c 'import pybind11; print(pybind11.get_cmake_dir())')" \
  -DCMAKE_CUDA_ARCHITECTURES="${SEQPAR_CUDA_ARCHS:-90}" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$BUILD" -j 2
ls "$BUILD/out"
