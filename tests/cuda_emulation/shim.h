// Host emulation of CUDA kernels, for CPU tests of their logic (tests/test_cuda_emulation.py): a kernel
// source compiled by g++ with SEQPAR_HOST_EMULATION defined (its <<<>>> entry points, which need nvcc, drop
// out; its plans and other host helpers stay),
// each CUDA thread of a block run as a std::thread, __syncthreads as a block barrier, warp shuffles through
// a per-warp exchange with barriers, __shared__ arrays as statics (blocks run one after another). What it
// checks: indexing, masking, reductions, partial sums against an independent reference. What it cannot:
// timing, the memory model, anything a real GPU adds (the gpu-marked tests run the same kernels there).
#pragma once
#define SEQPAR_HOST_EMULATION 1
#define __global__
#define __device__
#define __host__
#define __shared__ static
#define __launch_bounds__(...)
#include <barrier>
#include <cmath>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

struct Dim3 {
  unsigned x = 1, y = 1, z = 1;
};
inline thread_local Dim3 threadIdx;
inline Dim3 blockIdx, blockDim, gridDim;

namespace emulation {
inline std::unique_ptr<std::barrier<>> block_barrier;
inline std::vector<std::unique_ptr<std::barrier<>>> warp_barriers;
inline float shuffle_slots[32][32];                // [warp][lane], blocks of up to 1024 threads
alignas(16) inline float dynamic_shared[64 * 1024];  // 256 KiB
inline unsigned linear_thread() { return threadIdx.y * blockDim.x + threadIdx.x; }
}  // namespace emulation

inline void* emulated_dynamic_shared() { return emulation::dynamic_shared; }
inline void __syncthreads() { emulation::block_barrier->arrive_and_wait(); }
inline float __shfl_xor_sync(unsigned, float v, int offset) {
  const unsigned t = emulation::linear_thread(), warp = t / 32, lane = t % 32;
  emulation::shuffle_slots[warp][lane] = v;
  emulation::warp_barriers[warp]->arrive_and_wait();
  const float r = emulation::shuffle_slots[warp][lane ^ offset];
  emulation::warp_barriers[warp]->arrive_and_wait();
  return r;
}
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline int64_t min(int64_t a, int64_t b) { return a < b ? a : b; }  // CUDA's device min
using std::isinf;                                                    // CUDA's device isinf
inline float __fmul_rn(float a, float b) { return a * b; }
inline float rsqrtf(float v) { return 1.0f / std::sqrt(v); }
inline float __expf(float v) { return std::exp(v); }            // the GPU's is an approximation (ex2.approx)
// div.approx.f32, to its range: 0 (NaN for an infinite a) where 2^126 < |b| < 2^128, else a / b (the
// approximation's 2 ulp are not modelled). No kernel uses it: csrc/swiglu.cu lost silu's far tail to it.
inline float __fdividef(float a, float b) {
  const float m = std::fabs(b);
  if (m > 0x1p126f && m < INFINITY) return std::isinf(a) ? NAN : 0.0f;
  return a / b;
}

// Runs `kernel` (a callable running one thread's code) for every thread of every block of `grid`.
inline void launch(Dim3 grid, Dim3 block, const std::function<void()>& kernel) {
  gridDim = grid;
  blockDim = block;
  const unsigned n = block.x * block.y * block.z;
  for (unsigned bz = 0; bz < grid.z; ++bz)
    for (unsigned by = 0; by < grid.y; ++by)
      for (unsigned bx = 0; bx < grid.x; ++bx) {
        blockIdx = {bx, by, bz};
        emulation::block_barrier = std::make_unique<std::barrier<>>(n);
        emulation::warp_barriers.clear();
        for (unsigned w = 0; w * 32 < n; ++w)
          emulation::warp_barriers.push_back(std::make_unique<std::barrier<>>(std::min(32u, n - 32 * w)));
        std::vector<std::thread> threads;
        for (unsigned t = 0; t < n; ++t)
          threads.emplace_back([&, t] {
            threadIdx = {t % block.x, (t / block.x) % block.y, t / (block.x * block.y)};
            kernel();
          });
        for (auto& thread : threads) thread.join();
      }
}
