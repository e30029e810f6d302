#!/usr/bin/env bash
# On the GPU machine, one part per device call (each ends inside the 10-minute limit of one call):
#
#   bash bench/gpu_suite.sh tests-attention   gpu tests of the attention core (Triton compiles dominate)
#   bash bench/gpu_suite.sh tests             every other gpu-marked test
#   bash bench/gpu_suite.sh layer             python -m seqpar bench --device cuda (the paper's five
#                                             experiments, 22B layer) + Megatron-Core's layer, same shape
#   bash bench/gpu_suite.sh kernels           bench_layernorm_dropout, bench_attention, bench_llama_ops
#   bash bench/gpu_suite.sh overlap           bench_overlap (chunked-GEMM cost on one GPU)
#
# Every part installs seqpar first (CMake rebuilds only what changed: build/ is kept on a warm machine),
# keeps Triton's cache in .triton_cache/ (also kept between calls on a warm machine), installs the
# peers' wheels from .whl/ when it was carried (bench/fetch_gpu_wheels.sh makes it, here), and writes
# logs and result rows under $OUT (default bench/results/run-<date>). Back on the development machine,
# copy the rows into bench/results/ and run `python bench/gpu_summary.py` over them.
set -uo pipefail
cd "$(dirname "$0")/.."
part="${1:-}"
OUT="${OUT:-bench/results/run-$(date +%Y%m%d-%H%M%S)}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 SEQPAR_BUILD_CUDA=1 SEQPAR_CUDA_ARCHS="${SEQPAR_CUDA_ARCHS:-90}"
export TRITON_CACHE_DIR="$PWD/.triton_cache"
limit() { timeout --signal=INT "$1" "${@:2}"; }   # keep each step inside the call's 10 minutes

if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
# One set-up log per part: the device tool brings back at most 8 files from $OUT, and "kernels" writes 6.
{ python3 -m pip install --no-build-isolation --no-deps -e . 2>&1 | tail -3; python3 -m seqpar info 2>&1; } \
  | tee "$OUT/setup-$part.log"

case "$part" in
  tests-attention)
    limit 540 python3 -m pytest -q -m gpu -ra tests/ops/test_attention_core.py 2>&1 | tee "$OUT/gpu_tests_attention.log" | tail -30 ;;
  tests)
    limit 540 python3 -m pytest -q -m gpu -ra tests --deselect tests/ops/test_attention_core.py 2>&1 \
      | tee "$OUT/gpu_tests.log" | tail -30 ;;
  layer)
    limit 300 python3 -m seqpar bench --device cuda --json "$OUT/layer_bench.json" --plot "$OUT/layer_bench.png" 2>&1 \
      | tee "$OUT/layer_bench.log"
    limit 240 python3 bench/bench_megatron_layer.py --out "$OUT" 2>&1 | tee "$OUT/bench_megatron_layer.log" ;;
  kernels)
    limit 200 python3 bench/bench_layernorm_dropout.py --out "$OUT" --tokens 256,1024,16384 --hidden 1024,4096,12288 \
      2>&1 | tee "$OUT/bench_layernorm_dropout.log" | tail -40
    limit 240 python3 bench/bench_attention.py --out "$OUT" --seqlens 1024,2048,4096 --head-dims 64,128 \
      2>&1 | tee "$OUT/bench_attention.log" | tail -40
    [ -f bench/bench_llama_ops.py ] && limit 120 python3 bench/bench_llama_ops.py --out "$OUT" 2>&1 \
      | tee "$OUT/bench_llama_ops.log" | tail -40 ;;
  overlap)
    limit 540 python3 bench/bench_overlap.py --out "$OUT" --iters 5 --layer-iters 20 2>&1 | tee "$OUT/bench_overlap.log" | tail -40 ;;
  *)
    echo "usage: bash bench/gpu_suite.sh {tests-attention|tests|layer|kernels|overlap}" >&2; exit 2 ;;
esac
ls -la "$OUT"
