#!/usr/bin/env bash
# On the GPU machine: bash bench/gpu_suite.sh PART [PART...], parts run in the order given, in one device
# call. Every step has its own limit, and all of them share the call's budget SUITE_SECONDS (default 570 s,
# inside a 600 s call): a step's limit is cut to what is left, and a step with under 10 s left is skipped
# (the log says so). A call cut off keeps the files of the steps that finished.
#
#   tests      every gpu-marked test, 12 pytest-xdist workers (the image has pytest-xdist): Triton's
#              compiles, which dominate, run on 12 of the 16 cores (limit 300 s; 377 tests took 164 s)
#   norms      bench_layernorm_dropout, its compiles first, in parallel (120 + 280 s). Both GPU runs so far
#              were cut at their limits, compiling in series (a torch.compile afresh per configuration,
#              Triton's kernels per row count; the log did not say how much of the time): at 0200fea
#              (two design experiments, since decided and removed) 161 s before the 256-row
#              configurations; at 9466f0b (one, the LayerNorm's pipelined backward, since decided and
#              removed) 157 s for the five 16384-row configurations of h 1024 / 4096 / 12288 (30 s each).
#              Now six processes (one per h and p) first run each compiling provider once per
#              configuration, untimed (--compile-only), into Triton's and Inductor's on-disk caches; the
#              timed run's log gives each provider's seconds and Inductor's cache hits. torch-eager is
#              left out: no target reads it
#   llama      bench_llama_ops, its compiles first, in parallel as for norms (100 + 220 s; took 126 s in
#              the second run, before its two design variants joined: 4 more RMSNorm configurations; and
#              before the standalone dropout joined: 2 configurations of 4 fast providers, one
#              torch.compile each)
#   attention  bench_attention, its Triton compiles first, in parallel (100 + 150 s; took 25 + 90 s)
#   layer      python -m seqpar bench --device cuda (the paper's five experiments, 22B layer),
#              Megatron-Core's layer at the same shape, bench_overlap's chunked-GEMM cost
#              (--part gemm,project) (150 + 120 + 150 s; took 41 s, -, 11 s)
#   profile    bench/profile_kernels.py: torch.profiler, then Nsight Compute (throughput vs peak,
#              occupancy, registers) over one fwd+bwd step of the attention, LayerNorm, RMSNorm and SwiGLU
#              kernels and their peers, for the note on a missed target (100 + 300 s; torch took 16 s, ncu
#              ran past 170 s; it profiles the cases of the targets missed most first)
# ("took": the first GPU run, an H200, 2026-11-25; the install took 40 s cold.) The second run (H200,
# 2026-11-26, 0200fea): the install 30 s cold, tests 219 s (416 tests), attention 38 + 109 s, norms past
# 161 s with the 256-row configurations still to go, layer 47 + 23 + 14 s, llama 126 s.
# The third run (H200, 2026-11-27, 0f39ed5 / 9466f0b): install 33 s, info 14 s, tests 226 s (448 tests),
# layer 51 + 23 + 16 s: 363 s in one call; norms cut at 157 s. The fourth run (H200, 2026-11-28, 508368d):
# `norms layer` 330 s (install 34 s, info 11 s, norms 62 + 131 s, layer 52 + 22 + 18 s), then `llama tests`
# 385 s (llama 59 + 167 s, tests 139 s: 446 passed). With 15 device minutes (a start takes 35-60 s of them)
# and a machine that stays warm only 30 s after a call, two calls issued back to back: after a change to
# the kernels, `tests llama` first (SUITE_SECONDS=560: about 140 + 230 s), then at once `norms` (and
# `layer` or `attention` if the budget left allows) with SUITE_SECONDS the budget left less 40 s; the
# torch-compile rows, timed since bfb3195, add about 20-40 s to norms and llama. `profile` for a missed
# target's note. SUITE_SECONDS is whole seconds (a fraction is dropped).
#
# The call installs seqpar first (CMake rebuilds only what changed: build/ is kept on a warm machine),
# keeps Triton's cache in .triton_cache/ (also kept on a warm machine), and installs the peers' wheels
# from .whl/ when it was carried (bench/fetch_gpu_wheels.sh makes it, here). Under $OUT (default
# bench/results/run-<date>) it writes one log, suite.log (the set-up and every step's output, the gpu
# tests' summary too), and the benchmarks' rows: 8 files with every part, the most the device tool
# brings back (gpu_summary.py draws the plots here). If installing seqpar fails, the call stops there:
# every step after it would measure nothing.
# At its limit a step gets SIGINT (the log then says exit status 124), and a benchmark writes the rows it
# measured so far instead of losing them; SIGKILL follows 20 s later. The parallel compile steps' own
# per-process timeouts run with --foreground: a timeout in its own process group would keep the step's
# SIGINT from its process, and the step would outlive its limit (cut by SUITE_SECONDS below theirs).
# Every step runs whatever the ones before it did; the call ends with a summary line (the steps that
# failed, a cut one included, and those skipped) and exits 1 when a step failed. Back on the development machine, copy the rows into
# bench/results/ and run `python bench/gpu_summary.py` over them.
set -uo pipefail
cd "$(dirname "$0")/.."
usage="usage: bash bench/gpu_suite.sh PART [PART...]; the parts are tests, norms, llama, attention, layer, profile"
[ $# -gt 0 ] || { echo "$usage" >&2; exit 2; }
for part in "$@"; do
  case "$part" in
    tests|norms|llama|attention|layer|profile) ;;
    *) echo "gpu_suite.sh: unknown part '$part'; $usage" >&2; exit 2 ;;
  esac
done
if ! [[ "${SUITE_SECONDS:-570}" =~ ^([0-9]+)(\.[0-9]*)?$ ]]; then
  echo "gpu_suite.sh: SUITE_SECONDS must be a number of seconds, got '${SUITE_SECONDS:-}'" >&2
  exit 2
fi
SUITE_SECONDS="${BASH_REMATCH[1]}"   # whole seconds: bash arithmetic has no fractions
OUT="${OUT:-bench/results/run-$(date +%Y%m%d-%H%M%S)}"
mkdir -p "$OUT"
LOG="$OUT/suite.log"
export PYTHONUNBUFFERED=1 SEQPAR_BUILD_CUDA=1 SEQPAR_CUDA_ARCHS="${SEQPAR_CUDA_ARCHS:-90}"
export TRITON_CACHE_DIR="$PWD/.triton_cache"
# The steps that failed ("name (exit N)") and were skipped, for the summary line that ends the call.
FAILED=() SKIPPED=() STEPS=0
# step NAME SECONDS COMMAND...: the limit cut to the budget left; SIGINT at the limit, SIGKILL 20 s later;
# output to the log. Returns the command's exit status (1 when skipped).
step() {
  local name="$1" seconds="$2" left=$((SUITE_SECONDS - SECONDS)) status; shift 2
  STEPS=$((STEPS + 1))
  [ "$seconds" -gt "$left" ] && seconds=$left
  if [ "$seconds" -lt 10 ]; then
    echo "=== $(date +%T) [$name] skipped (${left}s of SUITE_SECONDS left): $*" | tee -a "$LOG"
    SKIPPED+=("$name")
    return 1
  fi
  echo "=== $(date +%T) [$name] $* (limit ${seconds}s)" | tee -a "$LOG"
  timeout --kill-after=20 --signal=INT "$seconds" "$@" 2>&1 | tee -a "$LOG" | tail -40
  status=${PIPESTATUS[0]}
  echo "=== $(date +%T) [$name] exit status $status" | tee -a "$LOG"
  # 124: cut at its limit (its rows so far are kept, but it did not finish)
  [ "$status" -eq 0 ] || FAILED+=("$name (exit $status$([ "$status" -eq 124 ] && echo ': cut at its limit'))")
  return "$status"
}

# The call's last line: how many steps ran, which failed and which were skipped. Exit status 1 when one
# failed, or when $1 says so (the install did not happen); a skipped step alone (out of budget) is named
# but is no failure.
finish() {
  local status="${1:-0}" failed="none" skipped="none"
  [ ${#FAILED[@]} -eq 0 ] || { failed=$(printf '%s, ' "${FAILED[@]}"); failed=${failed%, }; status=1; }
  [ ${#SKIPPED[@]} -eq 0 ] || { skipped=$(printf '%s, ' "${SKIPPED[@]}"); skipped=${skipped%, }; }
  echo "=== $(date +%T) summary: $STEPS steps; failed: $failed; skipped: $skipped" | tee -a "$LOG"
  exit "$status"
}

if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  echo "=== $(date +%T) peers' wheels from .whl/ into /tmp/site" | tee -a "$LOG"
  if python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      .whl/*.whl >>"$LOG" 2>&1; then
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
  else
    echo "=== the wheels did not install (see above): the peers will be 'not importable'" | tee -a "$LOG"
  fi
fi
if ! step install 240 python3 -m pip install --no-build-isolation --no-deps -e .; then
  echo "=== seqpar is not installed (that step failed or was skipped): nothing after it could run; stopping" \
    | tee -a "$LOG"
  ls -la "$OUT"
  finish 1   # skipped for want of time, it is a failure too: nothing else ran
fi
step info 30 python3 -m seqpar info

for part in "$@"; do
  case "$part" in
    tests)
      pytest_args=()
      python3 -c "import xdist" 2>/dev/null && pytest_args=(-n 12)   # else one process: compiles in series
      # 120 s a test (the slowest took 82 s): a hung test must not eat the step and the parts after it
      python3 -c "import pytest_timeout" 2>/dev/null && pytest_args+=(--timeout 120)
      # One Inductor compile thread per worker: the workers are the parallelism.
      OMP_NUM_THREADS=1 TORCHINDUCTOR_COMPILE_THREADS=1 step tests 300 python3 -m pytest -q -m gpu -ra \
        --durations=15 "${pytest_args[@]}" tests ;;
    norms)
      # Compile first, six processes at once (each with its own limit; one Inductor compile thread each: the
      # processes are the parallelism), untimed; the timed run then finds the kernels in the caches. A
      # warm-up process that fails says so in the log, not in the step's status: the timed run compiles
      # what it left out.
      step norms-compile 120 bash -c 'for h in 1024 4096 12288; do for p in 0 0.1; do \
        TORCHINDUCTOR_COMPILE_THREADS=1 timeout --foreground -k 10 110 python3 bench/bench_layernorm_dropout.py --compile-only \
        --tokens 16384,1024,256 --hidden $h -p $p --providers seqpar-triton,torch-compile,liger-ln & done; done; wait'
      # 16384 tokens first: a sweep cut off at its limit keeps the full-size rows (the bandwidth targets)
      step norms 280 python3 bench/bench_layernorm_dropout.py --out "$OUT" --tokens 16384,1024,256 \
        --hidden 1024,4096,12288 --providers seqpar-triton,seqpar-cuda,torch-compile,apex-ln,te-ln,liger-ln ;;
    llama)
      # As norms: compile first, eight processes at once, untimed (the hidden sizes apply to rmsnorm / dropout / bda)
      step llama-compile 100 bash -c 'for op in rmsnorm dropout bda swiglu rope; do for h in 4096 8192; do \
        [ $op = swiglu -o $op = rope ] && [ $h = 8192 ] && continue; \
        TORCHINDUCTOR_COMPILE_THREADS=1 timeout --foreground -k 10 90 python3 bench/bench_llama_ops.py --compile-only --ops $op \
        --hidden $h --providers seqpar-triton,torch-compile,liger & \
        done; done; wait'
      # no torch-eager: no target reads it (about 30 s of device time)
      step llama 220 python3 bench/bench_llama_ops.py --out "$OUT" \
        --providers seqpar-cuda,seqpar-triton,torch-compile,liger ;;
    attention)
      # A cold bench_attention spends minutes compiling its ~50 autotune configurations one after another:
      # compile them first in four processes at once (one per head dim and dropout, each with its own
      # limit), untimed; the timed run then finds them in Triton's cache.
      step attention-compile 100 bash -c 'for d in 64 128; do for p in 0 0.1; do \
        timeout --foreground -k 10 90 python3 bench/bench_attention.py --compile-only --providers seqpar-triton --seqlens 1024 \
        --head-dims $d --dropouts $p & done; done; wait'
      step attention 150 python3 bench/bench_attention.py --out "$OUT" --seqlens 1024,2048,4096 --head-dims 64,128 \
        --providers seqpar-triton,torch-sdpa-flash,seqpar-cuda ;;
    layer)
      step layer 150 python3 -m seqpar bench --device cuda --json "$OUT/layer_bench_gpu.json"
      step megatron 120 python3 bench/bench_megatron_layer.py --out "$OUT"
      step overlap 150 python3 bench/bench_overlap.py --part gemm,project --out "$OUT" --iters 5 ;;
    profile)
      step profile-torch 100 python3 bench/profile_kernels.py --tool torch --out "$OUT"
      step profile-ncu 300 python3 bench/profile_kernels.py --tool ncu --out "$OUT" ;;
  esac
done
ls -la "$OUT"
finish
