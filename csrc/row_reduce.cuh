// Row machinery shared by the row-wise kernels (normalisations over the last dimension h of a [rows, h]
// matrix) and the vectorised elementwise kernels:
//   (Pack<T, N>, N elements moved as one access, comes from dtypes.cuh;)
//   * warp / row all-reductions (a row is one warp, or one whole block);
//   * the launch plan of a row kernel (warp per row or block per row, vectors per thread, column chunks)
//     and the compile-time dispatch over the plans that are instantiated;
//   * the deterministic column reduction of a backward pass: every block writes one fp32 partial row of
//     [n_partials, h] buffers and reduce_partials_kernel sums them (no atomics).
// Every piece is a template or inline, so several .cu files may include this header.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "dtypes.cuh"

namespace seqpar {
namespace rows {

constexpr int kWarp = 32;
constexpr int kMaxThreads = 1024;

// N values of a parameter vector of n elements whose dtype (fp32, fp16 or bf16) is a runtime code, uniform
// across the grid (so the branch is free), from element c0 of p: one pack access when `vector` (c0 a
// multiple of N, c0 + N <= n), else scalar accesses of the elements below n (zeros past it), as load_run.
template <int N>
__device__ __forceinline__ void load_params(const void* p, int64_t c0, int64_t n, bool vector, int dtype,
                                            float (&out)[N]) {
  if (dtype == kFloat32) {
    const Pack<float, N> v = load_run<float, N>(static_cast<const float*>(p), c0, n, vector);
#pragma unroll
    for (int i = 0; i < N; ++i) out[i] = v.v[i];
  } else if (dtype == kFloat16) {
    const Pack<__half, N> v = load_run<__half, N>(static_cast<const __half*>(p), c0, n, vector);
#pragma unroll
    for (int i = 0; i < N; ++i) out[i] = to_float(v.v[i]);
  } else {
    const Pack<__nv_bfloat16, N> v = load_run<__nv_bfloat16, N>(static_cast<const __nv_bfloat16*>(p), c0, n, vector);
#pragma unroll
    for (int i = 0; i < N; ++i) out[i] = to_float(v.v[i]);
  }
}

// The block's dynamic shared memory as T* (under host emulation, tests/cuda_emulation/shim.h: one static
// buffer shared by the emulated block's threads).
template <typename T>
__device__ __forceinline__ T* dynamic_shared() {
#if defined(SEQPAR_HOST_EMULATION)
  return reinterpret_cast<T*>(emulated_dynamic_shared());
#else
  extern __shared__ float4 seqpar_dynamic_smem[];
  return reinterpret_cast<T*>(seqpar_dynamic_smem);
#endif
}

__device__ __forceinline__ float warp_allreduce(float v) {
#pragma unroll
  for (int offset = kWarp / 2; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// Sum N values over the threads of a row. WARP: the row is one warp (threadIdx.x = lane). Otherwise the
// row is the whole block (blockDim.y == 1); every thread of the block must call it.
template <bool WARP, int N>
__device__ __forceinline__ void row_allreduce(float (&v)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) v[i] = warp_allreduce(v[i]);
  if constexpr (!WARP) {
    __shared__ float smem[kMaxThreads / kWarp][N];
    const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, warps = blockDim.x / kWarp;
    __syncthreads();  // readers of a previous call are done with smem
    if (lane == 0) {
#pragma unroll
      for (int i = 0; i < N; ++i) smem[warp][i] = v[i];
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < N; ++i) v[i] = warp_allreduce(lane < warps ? smem[lane][i] : 0.0f);
  }
}

// Up to three [n_partials, h] fp32 partial buffers and the [h] fp32 outputs their column sums go to;
// blockIdx.y picks the buffer (a null part[q] is skipped).
struct PartialSums {
  const float* part[3];
  float* out[3];
};

// out_q[col] = sum over the n_partials rows of part_q[:, col]. Block (kWarp, 8), grid (cdiv(h, kWarp), count).
// A template only so that every translation unit including this header may instantiate it.
template <int kRowsPerBlock = 8>
__global__ void reduce_partials_kernel(const PartialSums sums, int64_t n_partials, int64_t h) {
  __shared__ float smem[kRowsPerBlock][kWarp + 1];
  const int64_t col = static_cast<int64_t>(blockIdx.x) * kWarp + threadIdx.x;
  // Ternaries, not sums.part[blockIdx.y]: a dynamic index would copy the parameters to local memory.
  const float* part = blockIdx.y == 0 ? sums.part[0] : blockIdx.y == 1 ? sums.part[1] : sums.part[2];
  float* out = blockIdx.y == 0 ? sums.out[0] : blockIdx.y == 1 ? sums.out[1] : sums.out[2];
  if (part == nullptr) return;  // uniform per block
  float acc = 0.0f;
  if (col < h) {
    for (int64_t r = threadIdx.y; r < n_partials; r += kRowsPerBlock) acc += part[r * h + col];
  }
  smem[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && col < h) {
    for (int s = 1; s < kRowsPerBlock; ++s) acc += smem[s][threadIdx.x];
    out[col] = acc;
  }
}

constexpr int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
constexpr int round_up_warp(int64_t v) { return static_cast<int>(cdiv(v, kWarp) * kWarp); }
constexpr int pow2_ceil(int64_t v) {
  int p = 1;
  while (p < v) p <<= 1;
  return p;
}
constexpr int elem_size(int dtype) { return dtype == kFloat32 ? 4 : 2; }

#if !defined(SEQPAR_HOST_EMULATION)  // <<<>>> needs nvcc; host emulation (tests/cuda_emulation) compiles with g++
// Launches `count` partial buffers' column sums on `stream` (a template: instantiated only where used).
template <int kRowsPerBlock = 8>
void launch_reduce_partials(const PartialSums& sums, int count, int64_t n_partials, int64_t h,
                                   cudaStream_t stream, const char* what) {
  const dim3 block(kWarp, kRowsPerBlock), grid(static_cast<unsigned>(cdiv(h, kWarp)), static_cast<unsigned>(count));
  reduce_partials_kernel<kRowsPerBlock><<<grid, block, 0, stream>>>(sums, n_partials, h);
  check_cuda(cudaGetLastError(), what);
}
#endif

// How a row kernel covers a row of nvec vectors: a block of tpr x rpb threads (threads per row x rows per
// block); a thread owns vpt vectors of each column chunk of tpr * vpt vectors, strided by tpr vectors so
// that a warp's accesses are contiguous.
enum class RowKind : int {
  kWarp = 0,     // warp per row (tpr = 32, rpb rows per block); the row fits the lanes' registers
  kBlock = 1,    // block per row (rpb = 1); the row fits the threads' registers
  kChunked = 2,  // block per row, vpt at the kernel's maximum; the row is covered in `chunks` chunks
};

struct Plan {
  RowKind kind;
  int vpt;         // vectors per thread per chunk (a power of two)
  int tpr;         // threads per row
  int rpb;         // rows per block
  int64_t chunks;  // column chunks of the row (1 unless kChunked)
};

// Resident blocks per SM a backward row kernel of `kind` whose threads hold `elements` elements of a row
// (VPT * VEC) is compiled for (__launch_bounds__'s second argument): two 512-thread blocks per SM, so at
// most 64 registers per thread, where a block per row holds at most 8 elements per thread (h = 4096 in
// 2-byte types), so that one block's loads overlap the other's block-wide reduction (two barriers per
// row). Otherwise 0, no minimum: their registers would spill, and an explicit 1 changes ptxas's
// allocation (the chunked LayerNorm backward took 71 registers instead of 62, one block per SM, not 2).
constexpr int bwd_min_blocks(RowKind kind, int elements) { return kind == RowKind::kBlock && elements <= 8 ? 2 : 0; }

// Warp per row with rpb rows per block (the caller checked that nvec <= 32 * the kernel's maximum vpt).
inline Plan warp_plan(int64_t nvec, int rpb) { return {RowKind::kWarp, pow2_ceil(cdiv(nvec, kWarp)), kWarp, rpb, 1}; }

// Block per row with vpt vectors per thread: the row's vectors over vpt threads, rounded up to a warp.
inline Plan block_plan_vpt(int64_t nvec, int vpt) {
  return {RowKind::kBlock, vpt, round_up_warp(cdiv(nvec, vpt)), 1, 1};
}

// Block per row: the row in registers when max_threads threads with at most max_vpt vectors each cover it
// (the fewest vectors per thread that do), else chunks of max_threads x chunk_vpt vectors.
inline Plan block_plan(int64_t nvec, int max_threads, int max_vpt, int chunk_vpt) {
  if (nvec <= static_cast<int64_t>(max_threads) * max_vpt)
    return block_plan_vpt(nvec, pow2_ceil(cdiv(nvec, max_threads)));
  const int tpr = static_cast<int>(std::min<int64_t>(max_threads, round_up_warp(cdiv(nvec, chunk_vpt))));
  return {RowKind::kChunked, chunk_vpt, tpr, 1, cdiv(nvec, static_cast<int64_t>(tpr) * chunk_vpt)};
}

// A forward keeps at least this many rows resident per SM where it can (resident_plan).
constexpr int kResidentRows = 2;

// The plans a forward's launch chooses from (resident_plan): `plan`, and for a block per row the same row
// with 2, 4, .. up to max_vpt times its vectors per thread (half, a quarter, .. the threads).
inline std::vector<Plan> plan_candidates(const Plan& plan, int64_t nvec, int max_vpt) {
  std::vector<Plan> out{plan};
  if (plan.kind == RowKind::kBlock)
    for (int vpt = plan.vpt * 2; vpt <= max_vpt; vpt *= 2) out.push_back(block_plan_vpt(nvec, vpt));
  return out;
}

// The forward's launch plan: of plan_candidates, in order (most threads per row first), the first that keeps
// kResidentRows blocks resident per SM (blocks_per_sm(plan): the occupancy calculator's count for its
// kernel), else the first with the most. Why: a block per row loads its row, then reduces it (block-wide
// barriers) and stores its outputs; with one block per SM the memory system idles through the reductions
// and stores, where a second row would be loading. On an H200 the LayerNorm forward's block per row of
// h = 12288 (768 threads, 50 registers: one block per SM) took 0.66 ms at 16384 x 12288 bf16, 58% of the
// copy bandwidth, while the RMSNorm forward's 1024-thread blocks of h = 8192 (30 registers: two per SM)
// reached 85%, and the Triton LayerNorm forward of h = 4096 (four 512-thread programs per SM) 86%.
template <typename BlocksPerSm>
Plan resident_plan(const Plan& plan, int64_t nvec, int max_vpt, BlocksPerSm&& blocks_per_sm) {
  Plan best = plan;
  int best_blocks = 0;
  for (const Plan& candidate : plan_candidates(plan, nvec, max_vpt)) {
    const int blocks = blocks_per_sm(candidate);
    if (blocks > best_blocks) best = candidate, best_blocks = blocks;
    if (best_blocks >= kResidentRows) break;
  }
  return best;
}

// What a launch-plan query returns to Python: (kind "warp" / "block" / "chunked", vectors per thread, threads
// per row, rows per block, column chunks, resident blocks per SM of the plan's kernel).
using PlanInfo = std::tuple<std::string, int, int, int, int64_t, int>;
inline PlanInfo plan_info(const Plan& p, int blocks_per_sm) {
  const char* kind = p.kind == RowKind::kWarp ? "warp" : p.kind == RowKind::kBlock ? "block" : "chunked";
  return {kind, p.vpt, p.tpr, p.rpb, p.chunks, blocks_per_sm};
}

// Calls fn(std::integral_constant<int, VPT>{}) for vpt in {1, 2, 4, ..., kMax} (kMax <= 32; only those
// instantiated: build time grows with each instantiation).
template <int kMax, typename Fn>
void dispatch_vpt(int vpt, Fn&& fn) {
  static_assert(kMax >= 1 && kMax <= 32, "vectors per thread");
  switch (vpt) {
    case 1: fn(std::integral_constant<int, 1>{}); return;
#define SEQPAR_VPT_CASE(N)                  \
  case N:                                   \
    if constexpr (kMax >= N) {              \
      fn(std::integral_constant<int, N>{}); \
      return;                               \
    }                                       \
    break;
    SEQPAR_VPT_CASE(2)
    SEQPAR_VPT_CASE(4)
    SEQPAR_VPT_CASE(8)
    SEQPAR_VPT_CASE(16)
    SEQPAR_VPT_CASE(32)
#undef SEQPAR_VPT_CASE
    default: break;
  }
  throw std::logic_error("seqpar: no kernel instantiated for " + std::to_string(vpt) + " vectors per thread");
}

// Calls fn(T{}, std::integral_constant<int, VEC>{}) for the dtype code; VEC = 16 bytes of T when
// `vectorized`, else kScalarVec (elements a thread moves with scalar accesses as one run: 1, or e.g. a
// whole 16-column dropout group so that one Philox call serves the run).
template <int kScalarVec = 1, typename Fn>
void dispatch_type_vec(int dtype, bool vectorized, Fn&& fn) {
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    if (vectorized) {
      fn(tag, std::integral_constant<int, static_cast<int>(16 / sizeof(T))>{});
    } else {
      fn(tag, std::integral_constant<int, kScalarVec>{});
    }
  });
}

// vectorized = 16-byte accesses: h, every row stride and every (non-null) pointer must allow them.
inline void check_aligned(const char* op, bool vectorized, int64_t h, int dtype, std::initializer_list<uintptr_t> ptrs,
                          std::initializer_list<int64_t> strides) {
  if (!vectorized) return;
  const int vec = 16 / elem_size(dtype);
  bool ok = h % vec == 0;
  for (uintptr_t p : ptrs) ok = ok && p % 16 == 0;
  for (int64_t s : strides) ok = ok && s % vec == 0;
  if (!ok)
    throw std::invalid_argument(std::string(op) + ": vectorized=True needs 16-byte aligned pointers and sizes and "
                                "strides divisible by " + std::to_string(vec));
}

// Raises the kernel's dynamic shared-memory limit to `bytes` (the default is 48 KiB minus static memory).
template <typename Kernel>
void allow_smem(Kernel kernel, size_t bytes, const char* what) {
  if (bytes > 0)
    check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)),
               what);
}

// Blocks of `kernel` that one SM of the current device holds at once with `threads` threads and `smem` bytes of
// dynamic shared memory each (the CUDA occupancy calculator; 0: it cannot launch so).
template <typename Kernel>
int resident_blocks(Kernel kernel, int threads, size_t smem, const char* what) {
  int blocks = 0;
  check_cuda(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, threads, smem), what);
  return blocks;
}

// make() (a launch plan for rows of h columns on the current device), computed once per (device, h) for the
// calling instantiation (Tag: its kernel's template arguments): the occupancy queries behind a plan run
// once per shape, not at every launch.
template <typename Tag, typename Make>
Plan memo_plan(int64_t h, Make&& make) {
  static std::mutex mutex;
  static std::map<std::pair<int, int64_t>, Plan> plans;
  int device = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  const std::pair<int, int64_t> key{device, h};
  {
    std::lock_guard<std::mutex> lock(mutex);
    const auto found = plans.find(key);
    if (found != plans.end()) return found->second;
  }
  const Plan plan = make();  // outside the lock: it may query the device
  std::lock_guard<std::mutex> lock(mutex);
  return plans.emplace(key, plan).first->second;
}

// Multiprocessors and the opt-in shared memory per block of the current device.
struct DeviceInfo {
  int sms;
  int smem_optin;
};

inline DeviceInfo device_info() {
  int device = 0;
  DeviceInfo info{1, 48 * 1024};
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  check_cuda(cudaDeviceGetAttribute(&info.sms, cudaDevAttrMultiProcessorCount, device), "SM count");
  check_cuda(cudaDeviceGetAttribute(&info.smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device),
             "shared memory per block");
  return info;
}

}  // namespace rows
}  // namespace seqpar
