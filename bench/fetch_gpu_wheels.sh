#!/usr/bin/env bash
# Run HERE (a machine with PyPI), not on the GPU machine: download the peers' wheels that the GPU machine
# lacks into .whl/ (git-ignored), for Python 3.12 there. bench/gpu_suite.sh installs them when .whl/ is
# carried (device tool: carry [".whl"]). Both need only torch, triton, numpy, packaging, which are there.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
# one version of each: gpu_suite.sh installs .whl/*.whl in one pip call, which two versions of a package fail
rm -f .whl/megatron_core-*.whl .whl/liger_kernel-*.whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any -d .whl \
  "megatron-core==${MEGATRON_CORE_VERSION:-0.16.1}" "liger-kernel==${LIGER_KERNEL_VERSION:-0.8.5}"
ls -la .whl
