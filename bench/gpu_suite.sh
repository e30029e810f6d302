#!/usr/bin/env bash
# One call on a GPU machine: install seqpar (with the CUDA extension), run the gpu-marked tests, run
# every benchmark, and leave logs and result rows under $OUT (default bench/results/run-<date>).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-bench/results/run-$(date +%Y%m%d-%H%M%S)}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 SEQPAR_BUILD_CUDA=1 SEQPAR_CUDA_ARCHS="${SEQPAR_CUDA_ARCHS:-90}"
python3 -m pip install --no-build-isolation --no-deps -e . 2>&1 | tail -3 | tee "$OUT/install.log"
python3 -m seqpar info 2>&1 | tee "$OUT/info.log"
python3 -m pytest -q -m gpu -ra tests 2>&1 | tee "$OUT/gpu_tests.log" | tail -30
python3 -m seqpar bench --device cuda --json "$OUT/layer_bench.json" 2>&1 | tee "$OUT/layer_bench.log"
# Reduced sweeps (the scripts' full defaults take well over the 10 minutes one device call may run):
# the issue-target configurations only. Override with SEQPAR_BENCH_FULL=1.
declare -A SWEEP=(
  [bench_layernorm_dropout]="--tokens 16384 --hidden 1024,4096,12288"
  [bench_attention]="--seqlens 2048,4096 --head-dims 128"
  [bench_overlap]="--iters 5 --layer-iters 20"
)
for script in bench/bench_layernorm_dropout.py bench/bench_attention.py bench/bench_overlap.py; do
  [ -f "$script" ] || continue
  name=$(basename "$script" .py)
  extra=""; [ "${SEQPAR_BENCH_FULL:-0}" = 1 ] || extra="${SWEEP[$name]:-}"
  # shellcheck disable=SC2086
  python3 "$script" --out "$OUT" $extra 2>&1 | tee "$OUT/$name.log" | tail -40
done
ls -la "$OUT"
