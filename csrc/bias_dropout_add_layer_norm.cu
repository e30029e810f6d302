// Fused bias + dropout + residual-add + LayerNorm, forward and backward: the CUDA twin of
// triton_kernels/bias_dropout_add_layer_norm.py (math and shapes in seqpar/ops/bias_dropout_add_layer_norm.py).
//
//   keep         = mask_byte(seed, row_offset + row, col) >= P                (csrc/philox.cuh)
//   residual_out = residual + (keep ? (x + bias) * scale : 0)                   scale = float(256 / (256 - P))
//   y            = (residual_out - mean) * rstd * w + b                         stats of the rounded residual_out
//   backward:      g = dy * w;  dres = rstd * (g - mean(g) - x_hat * mean(g * x_hat)) + dres_out
//                  dx = keep ? dres * scale : 0;  dw = sum_rows(dy * x_hat), db = sum_rows(dy), dbias = sum_rows(dx)
//
// Layout (the row machinery of csrc/row_reduce.cuh): a block is TPR x RPB threads (threads per row x rows
// per block). kWarp kernels have TPR = 32, one warp per row, and reduce with shuffles only; kBlock and
// kChunked kernels have one block per row (RPB = 1) and reduce with shuffles plus one shared-memory step.
// A thread owns VPT runs of VEC contiguous columns of each column chunk of its row (TPR * VPT runs),
// strided by TPR runs so a warp's accesses are contiguous. kWarp and kBlock rows are one chunk, held in
// registers between the passes over them (the backward's second pass re-reads the row when a thread owns
// more than 16 elements); kChunked rows (h > 16384: the paper's 530B and 1T models have h = 20480 and
// 25600) take as many chunks as they need, and the passes after the first re-read the chunks that are
// not in registers (residual_out was just written by the same thread: from L2 mostly). Any h is accepted.
// When the pointers, h and the row strides allow it, a run is one 16-byte vector (VEC = 16 / sizeof(T):
// half a dropout group for 2-byte types, a quarter for fp32); otherwise a run is one whole 16-column
// dropout group moved with scalar accesses (VEC = 16, columns past h masked; the block-per-row forward
// then uses at most 512 threads, 128 registers each). Either way a run's mask comes from one Philox call
// (mask_words + mask_run).
//
// Forward: warp per row while a lane holds at most kFwdWarpVectors 16-byte runs (h <= 1024 for 2-byte
// types, 512 for fp32; 4 rows per block), block per row beyond; three passes over a row (residual_out and
// its sum; the centred sum of squares; y). A warp per row of h = 4096 (16 runs, 128 values per lane) took
// 174 registers and 12% occupancy on an H200 and ran 2.6x slower than the block per row of the Triton
// forward (381 vs 146 us at 16384 x 4096 bf16); the RMSNorm forward keeps the same 4-run cap.
// Backward: the block sums dw, db and dbias over the rows it visits (a grid-stride loop, one wave of
// blocks), writes them as one fp32 partial row per quantity, and reduce_partials_kernel sums the partial
// rows (no atomics: deterministic). Those running sums are 3 fp32 values per owned element: in registers
// they would cost 384 registers per lane for a warp-per-row h = 4096, so the warp-per-row backward is used
// only while a lane owns at most two 16-byte runs (h <= 512 for 2-byte types, 256 for fp32; sums in
// registers), and block per row (<= 512 threads, 128 registers each) beyond keeps the sums in shared
// memory (3 * h * 4 bytes; each thread owns its columns, so no synchronisation) or, for rows too long for
// the device's shared memory, in the block's own partial rows in global memory (no other block touches
// them). The backward draws the mask in its second pass over the row, where it is used, so no decisions
// are kept in registers.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "dtypes.cuh"
#include "philox.cuh"
#include "row_reduce.cuh"

namespace seqpar {
namespace bdaln {

using namespace rows;

constexpr int kFwdScalarMaxThreads = 512;  // block-per-row forward with scalar runs: 128 registers per thread
constexpr int64_t kBlockMaxHidden = 16384;  // longest row one pass of a block holds; longer rows: kChunked
constexpr int kFwdWarpRows = 4;            // rows per block of the warp-per-row forward
constexpr int kFwdWarpVectors = 4;         // 16-byte runs per lane of the warp-per-row forward
constexpr int kBwdWarpVectors = 2;         // 16-byte runs per lane of the warp-per-row backward (registers)
constexpr int kBwdWarpElements = 16;       // so at most 16 elements per lane
constexpr int kBwdWarpRows = 16;           // rows per block of the warp-per-row backward (512 threads)
constexpr int kBwdMaxThreads = 512;        // block-per-row backward: up to 128 registers per thread
constexpr int kBwdWarpSmemFloats = (kBwdWarpRows - 1) * kWarp * kBwdWarpElements;  // fold of row slots
constexpr int kScalarRun = kMaskGroup;     // VEC of the scalar-access kernels: one whole dropout group
constexpr int kStaticSmemSlack = 8 * 1024; // static shared memory of the kernels, generously

// True when the runs of VEC elements of T are single 16-byte vectors (else: scalar-access runs of a group).
template <typename T, int VEC>
constexpr bool kVectorRun = VEC * sizeof(T) == 16;

// Vectors per thread of each kind of kernel (only VPT up to these are instantiated: build time grows with
// each instantiation). kWarp: 4 (forward) or 2 (backward) runs per lane. kBlock: enough
// for kBlockMaxHidden columns; kChunked uses exactly the kBlock maximum per chunk (ptxas -v: no spills).
constexpr int max_threads(bool forward, int vec) {
  return !forward ? kBwdMaxThreads : vec == kScalarRun ? kFwdScalarMaxThreads : kMaxThreads;
}
constexpr int warp_vpt(bool forward) { return forward ? kFwdWarpVectors : kBwdWarpVectors; }
constexpr int block_vpt(bool forward, int vec) { return pow2_ceil(cdiv(kBlockMaxHidden / vec, max_threads(forward, vec))); }

template <RowKind KIND, bool kForward, int VEC>
constexpr int threads_bound() {
  return KIND == RowKind::kWarp ? kWarp * (kForward ? kFwdWarpRows : kBwdWarpRows) : max_threads(kForward, VEC);
}

// The mask words of run j (columns j * VEC ..) of global row mask_row: one Philox call.
template <int VEC>
__device__ __forceinline__ MaskWords run_mask(uint64_t seed, uint64_t mask_row, int64_t j) {
  const uint64_t col0 = static_cast<uint64_t>(j) * VEC;
  return mask_run<VEC>(mask_words(seed, mask_row, static_cast<uint32_t>(col0 / kMaskGroup)), col0);
}

struct FwdArgs {
  const void* x;
  const void* bias;  // nullptr: no bias
  const void* residual;
  const void* w;
  const void* b;
  void* y;
  void* residual_out;
  float* mean;
  float* rstd;
  int wdtype;  // dtype code of w and b
  int64_t rows, h, stride_x, stride_res;
  float eps, scale;
  uint32_t threshold24;  // P << 24; 0: no dropout
  uint64_t seed;
  int64_t row_offset;    // global row of local row 0
};

struct BwdArgs {
  const void* grad_y;
  const void* grad_residual_out;
  const void* residual_out;
  const void* w;
  const float* mean;
  const float* rstd;
  int wdtype;  // dtype code of w
  void* grad_x;
  void* grad_residual;
  float* part_w;     // [num_partials, h] each; row blockIdx.x belongs to block blockIdx.x
  float* part_b;
  float* part_bias;  // nullptr: no bias gradient
  int64_t rows, h;
  float scale;
  uint32_t threshold24;
  uint64_t seed;
  int64_t row_offset;
};

template <typename T, int VEC, int VPT, RowKind KIND>
__global__ void __launch_bounds__(threads_bound<KIND, true, VEC>()) fwd_kernel(const FwdArgs a,
                                                                                 const int64_t chunks_arg) {
  constexpr bool kVector = kVectorRun<T, VEC>;
  constexpr bool kWarpRow = KIND == RowKind::kWarp, kChunked = KIND == RowKind::kChunked;
  const int64_t chunks = kChunked ? chunks_arg : 1;
  const int tpr = kWarpRow ? kWarp : blockDim.x;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (kWarpRow ? kFwdWarpRows : 1) + threadIdx.y;
  if (kWarpRow && row >= a.rows) return;  // block rows always exist (grid = rows)
  const int64_t nvec = (a.h + VEC - 1) / VEC, chunk_vecs = static_cast<int64_t>(tpr) * VPT;
  const T* x = static_cast<const T*>(a.x) + row * a.stride_x;
  const T* res = static_cast<const T*>(a.residual) + row * a.stride_res;
  const T* bias = static_cast<const T*>(a.bias);
  T* res_out = static_cast<T*>(a.residual_out) + row * a.h;
  const uint64_t mask_row = static_cast<uint64_t>(a.row_offset + row);
  const bool dropout = a.threshold24 != 0;

  // Pass 1, chunks 0 .. C-1: residual_out, rounded to T (the statistics are of what backward will see).
  Pack<T, VEC> r[VPT];  // residual_out of the chunk in registers
  float stat[1] = {0.0f};
  for (int64_t c = 0; c < chunks; ++c) {
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int64_t j = c * chunk_vecs + threadIdx.x + static_cast<int64_t>(k) * tpr;
      if (j < nvec) {
        const Pack<T, VEC> xv = load_run<T, VEC>(x, j * VEC, a.h, kVector);
        const Pack<T, VEC> rv = load_run<T, VEC>(res, j * VEC, a.h, kVector);
        Pack<T, VEC> bv;
        if (bias != nullptr) bv = load_run<T, VEC>(bias, j * VEC, a.h, kVector);
        MaskWords mask{};
        if (dropout) mask = run_mask<VEC>(a.seed, mask_row, j);
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          float v = to_float(xv.v[i]);
          if (bias != nullptr) v = __fadd_rn(v, to_float(bv.v[i]));
          if (dropout) v = keep_column(mask, i, a.threshold24) ? __fmul_rn(v, a.scale) : 0.0f;
          // _rn intrinsics: no FMA contraction, so residual_out rounds exactly like the torch reference.
          // (Columns past h of a scalar run load as 0 and add 0 to the sum.)
          r[k].v[i] = from_float<T>(__fadd_rn(to_float(rv.v[i]), v));
          stat[0] += to_float(r[k].v[i]);
        }
        store_run<T, VEC>(res_out, j * VEC, a.h, kVector, r[k]);
      }
    }
  }
  row_allreduce<kWarpRow>(stat);
  const float inv_h = 1.0f / static_cast<float>(a.h);
  const float mean = stat[0] * inv_h;
  // Pass 2, chunks C-1 .. 0 (the last one is still in registers): the centred sum of squares.
  stat[0] = 0.0f;
  for (int64_t c = chunks - 1; c >= 0; --c) {
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int64_t j = c * chunk_vecs + threadIdx.x + static_cast<int64_t>(k) * tpr;
      if (j < nvec) {
        if (kChunked && c != chunks - 1) r[k] = load_run<T, VEC>(res_out, j * VEC, a.h, kVector);
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          const float d = to_float(r[k].v[i]) - mean;
          if (kVector || j * VEC + i < a.h) stat[0] += d * d;
        }
      }
    }
  }
  row_allreduce<kWarpRow>(stat);
  const float rstd = rsqrtf(stat[0] * inv_h + a.eps);
  if (threadIdx.x == 0) {
    a.mean[row] = mean;
    a.rstd[row] = rstd;
  }
  // Pass 3, chunks 0 .. C-1 (chunk 0 is in registers now): y.
  T* y = static_cast<T*>(a.y) + row * a.h;
  for (int64_t c = 0; c < chunks; ++c) {
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int64_t j = c * chunk_vecs + threadIdx.x + static_cast<int64_t>(k) * tpr;
      if (j < nvec) {
        if (kChunked && c != 0) r[k] = load_run<T, VEC>(res_out, j * VEC, a.h, kVector);
        float wv[VEC], bv[VEC];
        load_params<VEC>(a.w, j * VEC, a.h, kVector, a.wdtype, wv);
        load_params<VEC>(a.b, j * VEC, a.h, kVector, a.wdtype, bv);
        Pack<T, VEC> out;
#pragma unroll
        for (int i = 0; i < VEC; ++i) out.v[i] = from_float<T>((to_float(r[k].v[i]) - mean) * rstd * wv[i] + bv[i]);
        store_run<T, VEC>(y, j * VEC, a.h, kVector, out);
      }
    }
  }
}

// Running column sums (dw, db, dbias) of the backward, by kind of kernel: kWarp in registers (a lane owns
// few elements; row slots are folded through shared memory at the end); kBlock in dynamic shared memory
// ([3][h] floats); kChunked in the block's own partial rows in global memory (rows too long for shared
// memory). In memory, thread t owns the columns of its runs j = t (mod blockDim.x), in every chunk. VECTOR:
// the runs are 16-byte vectors (every run lies inside the row); else scalar runs whose columns past h are
// skipped.
template <int VEC, int VPT, RowKind KIND, bool VECTOR>
struct ColumnSums;

template <int VEC, int VPT>
struct ColumnSums<VEC, VPT, RowKind::kWarp, true> {
  float acc[3][VPT][VEC];
  __device__ __forceinline__ void init(int64_t, float* const (&)[3]) {
#pragma unroll
    for (int q = 0; q < 3; ++q)
#pragma unroll
      for (int k = 0; k < VPT; ++k)
#pragma unroll
        for (int i = 0; i < VEC; ++i) acc[q][k][i] = 0.0f;
  }
  __device__ __forceinline__ void add(int q, int k, int64_t, const float (&v)[VEC]) {
#pragma unroll
    for (int i = 0; i < VEC; ++i) acc[q][k][i] += v[i];
  }
  // Fold the kBwdWarpRows row slots into slot 0, which writes partial row blockIdx.x.
  __device__ __forceinline__ void write(float* const (&parts)[3], int64_t nvec, int64_t h) {
    constexpr int E = VPT * VEC;
    static_assert(E <= kBwdWarpElements, "warp-per-row backward register budget");
    __shared__ float smem[kBwdWarpSmemFloats];
#pragma unroll
    for (int q = 0; q < 3; ++q) {
      if (parts[q] == nullptr) continue;  // uniform
      __syncthreads();  // the previous quantity's readers are done with smem
      if (threadIdx.y > 0) {
#pragma unroll
        for (int e = 0; e < E; ++e) smem[((threadIdx.y - 1) * E + e) * kWarp + threadIdx.x] = acc[q][e / VEC][e % VEC];
      }
      __syncthreads();
      if (threadIdx.y == 0) {
        for (unsigned s = 1; s < blockDim.y; ++s) {
#pragma unroll
          for (int e = 0; e < E; ++e) acc[q][e / VEC][e % VEC] += smem[((s - 1) * E + e) * kWarp + threadIdx.x];
        }
        float* out = parts[q] + static_cast<int64_t>(blockIdx.x) * h;
#pragma unroll
        for (int k = 0; k < VPT; ++k) {
          const int64_t j = threadIdx.x + static_cast<int64_t>(k) * kWarp;
          if (j < nvec) {
            Pack<float, VEC> pk;
#pragma unroll
            for (int i = 0; i < VEC; ++i) pk.v[i] = acc[q][k][i];
            store_pack<float, VEC>(out + j * VEC, pk);
          }
        }
      }
    }
  }
};

template <int VEC, int VPT, RowKind KIND, bool VECTOR>
struct ColumnSums {
  static constexpr bool kShared = KIND == RowKind::kBlock;
  float* base;  // sum q is base + q * stride (h floats; 16-byte aligned for VECTOR, as h % VEC == 0)
  int64_t stride, h;
  __device__ __forceinline__ void init(int64_t h_, float* const (&parts)[3]) {
    h = h_;
    if constexpr (kShared) {
      extern __shared__ float4 dynamic_smem[];
      base = reinterpret_cast<float*>(dynamic_smem);
      stride = h;
    } else {  // the partial buffers are one [2 or 3, num_partials, h] allocation
      base = parts[0] + static_cast<int64_t>(blockIdx.x) * h;
      stride = parts[1] - parts[0];
    }
    const int64_t nvec = (h + VEC - 1) / VEC;
    Pack<float, VEC> zero;
#pragma unroll
    for (int i = 0; i < VEC; ++i) zero.v[i] = 0.0f;
#pragma unroll
    for (int q = 0; q < 3; ++q) {
      if (parts[q] == nullptr) continue;  // uniform
      for (int64_t j = threadIdx.x; j < nvec; j += blockDim.x)
        store_run<float, VEC>(base + q * stride, j * VEC, h, VECTOR, zero);
    }
  }
  // Only called for owned runs (j < nvec) of summed quantities; no other thread touches them, so no
  // synchronisation.
  __device__ __forceinline__ void add(int q, int, int64_t j, const float (&v)[VEC]) {
    float* sum = base + q * stride;
    Pack<float, VEC> cur = load_run<float, VEC>(sum, j * VEC, h, VECTOR);
#pragma unroll
    for (int i = 0; i < VEC; ++i) cur.v[i] += v[i];
    store_run<float, VEC>(sum, j * VEC, h, VECTOR, cur);
  }
  __device__ __forceinline__ void write(float* const (&parts)[3], int64_t nvec, int64_t) {
    if constexpr (kShared) {
#pragma unroll
      for (int q = 0; q < 3; ++q) {
        if (parts[q] == nullptr) continue;
        float* out = parts[q] + static_cast<int64_t>(blockIdx.x) * h;
        for (int64_t j = threadIdx.x; j < nvec; j += blockDim.x)
          store_run<float, VEC>(out, j * VEC, h, VECTOR, load_run<float, VEC>(base + q * h, j * VEC, h, VECTOR));
      }
    }  // else the sums already are the partial rows
  }
};

template <typename T, int VEC, int VPT, RowKind KIND>
__global__ void __launch_bounds__(threads_bound<KIND, false, VEC>(), bwd_min_blocks(KIND, VPT * VEC))
    bwd_kernel(const BwdArgs a, const int64_t chunks_arg) {
  constexpr bool kVector = kVectorRun<T, VEC>;
  constexpr bool kWarpRow = KIND == RowKind::kWarp, kChunked = KIND == RowKind::kChunked;
  static_assert(kVector || !kWarpRow, "warp-per-row kernels use 16-byte runs");
  // The row (residual_out, grad_y) stays in registers between the two passes over it while a thread owns
  // at most 16 elements of it; beyond that (h > 8192 in 2-byte types, chunked rows) the second pass reads
  // it again (from L2), or ptxas spills.
  constexpr bool kKeepRow = !kChunked && VPT * VEC <= 16;
  // A block-per-row kernel that keeps its row loads grad_residual_out with it too: all of the row's reads
  // are in flight before the block-wide reduction (two barriers), rather than a second memory round trip
  // after it. Warp-per-row rows reduce with shuffles alone, and their lanes' registers are full (ptxas
  // spilled with grad_residual_out held as well).
  constexpr bool kKeepGro = kKeepRow && !kWarpRow;
  const int64_t chunks = kChunked ? chunks_arg : 1;
  const int tpr = kWarpRow ? kWarp : blockDim.x;
  const int rpb = kWarpRow ? kBwdWarpRows : 1;
  const int64_t nvec = (a.h + VEC - 1) / VEC, chunk_vecs = static_cast<int64_t>(tpr) * VPT;
  const bool dropout = a.threshold24 != 0;
  const bool has_bias = a.part_bias != nullptr;
  const float inv_h = 1.0f / static_cast<float>(a.h);

  // LayerNorm weight: kept in registers by the warp-per-row kernel; the block-per-row kernels (whose
  // registers go to their wide rows) re-read it per row, from L1 / L2 (it is small and shared by all rows).
  float w_reg[kWarpRow ? VPT : 1][VEC];
  if constexpr (kWarpRow) {
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int64_t j = threadIdx.x + static_cast<int64_t>(k) * tpr;
      if (j < nvec) {
        load_params<VEC>(a.w, j * VEC, a.h, true, a.wdtype, w_reg[k]);
      } else {
#pragma unroll
        for (int i = 0; i < VEC; ++i) w_reg[k][i] = 0.0f;
      }
    }
  }
  const auto weights = [&](int k, int64_t j, float(&out)[VEC]) {
    if constexpr (kWarpRow) {
#pragma unroll
      for (int i = 0; i < VEC; ++i) out[i] = w_reg[k][i];
    } else {
      load_params<VEC>(a.w, j * VEC, a.h, kVector, a.wdtype, out);
    }
  };
  ColumnSums<VEC, VPT, KIND, kVector> sums;
  {
    float* const parts[3] = {a.part_w, a.part_b, a.part_bias};
    sums.init(a.h, parts);
  }

  // Grid-stride over groups of rpb rows; the trip count is uniform across the block.
  const int64_t stride = static_cast<int64_t>(gridDim.x) * rpb;
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * rpb; base < a.rows; base += stride) {
    const int64_t row = base + threadIdx.y;
    if (kWarpRow && row >= a.rows) break;  // warps never synchronise inside the loop
    const int64_t off = row * a.h;
    const float mean = a.mean[row], rstd = a.rstd[row];
    const T* ro = static_cast<const T*>(a.residual_out) + off;
    const T* gy = static_cast<const T*>(a.grad_y) + off;
    const T* gro = static_cast<const T*>(a.grad_residual_out) + off;
    Pack<T, VEC> rv[kKeepRow ? VPT : 1], gv[kKeepRow ? VPT : 1], ov[kKeepGro ? VPT : 1];
    float dots[2] = {0.0f, 0.0f};  // sum(g), sum(g * x_hat)
    for (int64_t c = 0; c < chunks; ++c) {
#pragma unroll
      for (int k = 0; k < VPT; ++k) {
        const int64_t j = c * chunk_vecs + threadIdx.x + static_cast<int64_t>(k) * tpr;
        if (j < nvec) {
          const Pack<T, VEC> rk = load_run<T, VEC>(ro, j * VEC, a.h, kVector);
          const Pack<T, VEC> gk = load_run<T, VEC>(gy, j * VEC, a.h, kVector);
          if constexpr (kKeepRow) {
            rv[k] = rk;
            gv[k] = gk;
          }
          if constexpr (kKeepGro) ov[k] = load_run<T, VEC>(gro, j * VEC, a.h, kVector);
          float wv[VEC], dw[VEC], db[VEC];
          weights(k, j, wv);
#pragma unroll
          for (int i = 0; i < VEC; ++i) {
            const float x_hat = (to_float(rk.v[i]) - mean) * rstd;
            const float dy = to_float(gk.v[i]);  // 0 past h: adds nothing below
            const float g = dy * wv[i];
            dots[0] += g;
            dots[1] += g * x_hat;
            dw[i] = dy * x_hat;
            db[i] = dy;
          }
          sums.add(0, k, j, dw);
          sums.add(1, k, j, db);
        }
      }
    }
    row_allreduce<kWarpRow>(dots);
    const float mean_g = dots[0] * inv_h, mean_gx = dots[1] * inv_h;
    T* gx = static_cast<T*>(a.grad_x) + off;
    T* gres = static_cast<T*>(a.grad_residual) + off;
    const uint64_t mask_row = static_cast<uint64_t>(a.row_offset + row);
    for (int64_t c = 0; c < chunks; ++c) {
#pragma unroll
      for (int k = 0; k < VPT; ++k) {
        const int64_t j = c * chunk_vecs + threadIdx.x + static_cast<int64_t>(k) * tpr;
        if (j < nvec) {
          Pack<T, VEC> ok, rk, gk;
          if constexpr (kKeepGro) {
            ok = ov[k];
          } else {
            ok = load_run<T, VEC>(gro, j * VEC, a.h, kVector);
          }
          if constexpr (kKeepRow) {
            rk = rv[k];
            gk = gv[k];
          } else {
            rk = load_run<T, VEC>(ro, j * VEC, a.h, kVector);
            gk = load_run<T, VEC>(gy, j * VEC, a.h, kVector);
          }
          MaskWords mask{};
          if (dropout) mask = run_mask<VEC>(a.seed, mask_row, j);
          Pack<T, VEC> res_pack, x_pack;
          float wv[VEC], dbias[VEC];
          weights(k, j, wv);
#pragma unroll
          for (int i = 0; i < VEC; ++i) {
            const float x_hat = (to_float(rk.v[i]) - mean) * rstd;
            const float g = to_float(gk.v[i]) * wv[i];
            const float d_res = rstd * (g - mean_g - x_hat * mean_gx) + to_float(ok.v[i]);
            const float d_x = !dropout ? d_res : keep_column(mask, i, a.threshold24) ? d_res * a.scale : 0.0f;
            dbias[i] = d_x;
            res_pack.v[i] = from_float<T>(d_res);
            x_pack.v[i] = from_float<T>(d_x);
          }
          if (has_bias) sums.add(2, k, j, dbias);
          store_run<T, VEC>(gres, j * VEC, a.h, kVector, res_pack);
          store_run<T, VEC>(gx, j * VEC, a.h, kVector, x_pack);
        }
      }
    }
  }
  float* const parts[3] = {a.part_w, a.part_b, a.part_bias};
  sums.write(parts, nvec, a.h);
}

// ---------------------------------------------------------------------------------------------- launch
// vector: the runs are 16-byte vectors (else scalar-access runs of one dropout group: block per row only).
inline Plan fwd_plan(int64_t h, int vec, bool vector) {
  const int64_t nvec = cdiv(h, vec);
  if (vector && nvec <= kWarp * kFwdWarpVectors) return warp_plan(nvec, kFwdWarpRows);
  return block_plan(nvec, max_threads(true, vec), block_vpt(true, vec), block_vpt(true, vec));
}

// kBlock keeps its running sums in shared memory (3 * h floats, the opt-in limit raised by allow_smem):
// where they do not fit the device (h > ~13900 on an A100) the row takes the kChunked kernel (one chunk),
// whose sums live in its partial rows in global memory.
inline Plan bwd_plan(int64_t h, int vec, bool vector, const DeviceInfo& dev) {
  const int64_t nvec = cdiv(h, vec);
  if (vector && nvec <= kWarp * kBwdWarpVectors) return warp_plan(nvec, kBwdWarpRows);
  Plan plan = block_plan(nvec, max_threads(false, vec), block_vpt(false, vec), block_vpt(false, vec));
  if (plan.kind == RowKind::kBlock && 3 * sizeof(float) * h + kStaticSmemSlack > static_cast<size_t>(dev.smem_optin)) {
    plan.kind = RowKind::kChunked;
    plan.vpt = block_vpt(false, vec);
    plan.tpr = round_up_warp(cdiv(nvec, plan.vpt));
    plan.chunks = 1;
  }
  return plan;
}

// Calls fn(std::integral_constant<int, VPT>{}, std::integral_constant<RowKind, KIND>{}) for the kernel of
// `plan`; only VPT up to the kind's maximum are instantiated (kChunked: exactly its VPT).
template <bool kForward, typename T, int VEC, typename Fn>
void dispatch_plan(const Plan& plan, Fn&& fn) {
  using Warp = std::integral_constant<RowKind, RowKind::kWarp>;
  using Block = std::integral_constant<RowKind, RowKind::kBlock>;
  using Chunked = std::integral_constant<RowKind, RowKind::kChunked>;
  constexpr int kBlockVpt = block_vpt(kForward, VEC);
  switch (plan.kind) {
    case RowKind::kWarp:
      if constexpr (kVectorRun<T, VEC>) {
        dispatch_vpt<warp_vpt(kForward)>(plan.vpt, [&](auto vpt) { fn(vpt, Warp{}); });
        return;
      }
      break;  // warp-per-row plans need 16-byte vectors
    case RowKind::kBlock: dispatch_vpt<kBlockVpt>(plan.vpt, [&](auto vpt) { fn(vpt, Block{}); }); return;
    case RowKind::kChunked:
      if (plan.vpt != kBlockVpt) break;
      fn(std::integral_constant<int, kBlockVpt>{}, Chunked{});
      return;
  }
  throw std::logic_error("bias_dropout_add_layer_norm: no kernel instantiated for this plan");
}

inline size_t bwd_smem_bytes(const Plan& plan, int64_t h) {
  return plan.kind == RowKind::kBlock ? 3 * sizeof(float) * static_cast<size_t>(h) : 0;
}

// Resident blocks per SM of the backward kernel of `plan`.
template <typename T, int VEC>
int bwd_blocks_per_sm(const Plan& plan, size_t smem) {
  int blocks = 0;
  dispatch_plan<false, T, VEC>(plan, [&](auto vpt, auto kind) {
    const auto kernel = bwd_kernel<T, VEC, decltype(vpt)::value, decltype(kind)::value>;
    allow_smem(kernel, smem, "bias_dropout_add_layer_norm shared memory");
    check_cuda(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, plan.tpr * plan.rpb, smem),
               "bias_dropout_add_layer_norm occupancy");
  });
  return std::max(blocks, 1);
}

inline void check_sizes(int64_t h, int wdtype) {
  if (h <= 0 || h >= (int64_t(1) << 31))
    throw std::invalid_argument("bias_dropout_add_layer_norm: hidden size " + std::to_string(h) +
                                " must be in [1, 2**31)");
  if (wdtype != kFloat32 && wdtype != kFloat16 && wdtype != kBFloat16)
    throw std::invalid_argument("bias_dropout_add_layer_norm: unsupported LayerNorm parameter dtype code " +
                                std::to_string(wdtype));
}

// Dropout threshold P in [0, 256) (0: no dropout); its scale float(256 / (256 - P)), as every backend's.
inline void check_threshold(int threshold) {
  if (threshold < 0 || threshold > 255)
    throw std::invalid_argument("bias_dropout_add_layer_norm: dropout threshold P must be in [0, 256), got " +
                                std::to_string(threshold));
}
inline float drop_scale(int threshold) { return threshold > 0 ? dropout_scale(threshold) : 1.0f; }

}  // namespace bdaln

void bias_dropout_add_layer_norm_fwd(uintptr_t x, uintptr_t bias, uintptr_t residual, uintptr_t ln_weight,
                                     uintptr_t ln_bias, uintptr_t y, uintptr_t residual_out, uintptr_t mean,
                                     uintptr_t rstd, int64_t rows, int64_t h, int64_t stride_x, int64_t stride_res,
                                     int dtype, int wdtype, bool vectorized, float eps, int threshold, uint64_t seed,
                                     int64_t row_offset, uintptr_t stream) {
  using namespace bdaln;
  check_sizes(h, wdtype);
  check_threshold(threshold);
  check_aligned("bias_dropout_add_layer_norm", vectorized, h, dtype,
                {x, bias, residual, y, residual_out, ln_weight, ln_bias}, {stride_x, stride_res});
  if (rows == 0) return;
  if (rows >= (int64_t(1) << 31))  // the grid is rows / rpb blocks in gridDim.x (at most 2**31 - 1)
    throw std::invalid_argument("bias_dropout_add_layer_norm: rows must be < 2**31");
  const FwdArgs a{reinterpret_cast<const void*>(x), reinterpret_cast<const void*>(bias),
                  reinterpret_cast<const void*>(residual), reinterpret_cast<const void*>(ln_weight),
                  reinterpret_cast<const void*>(ln_bias), reinterpret_cast<void*>(y),
                  reinterpret_cast<void*>(residual_out), reinterpret_cast<float*>(mean),
                  reinterpret_cast<float*>(rstd), wdtype, rows, h, stride_x, stride_res, eps, drop_scale(threshold),
                  static_cast<uint32_t>(threshold) << 24, seed, row_offset};
  const auto s = reinterpret_cast<cudaStream_t>(stream);
  dispatch_type_vec<kScalarRun>(dtype, vectorized, [&](auto tag, auto vec) {
    using T = decltype(tag);
    constexpr int kVec = decltype(vec)::value;
    const Plan plan = fwd_plan(h, kVec, kVectorRun<T, kVec>);
    dispatch_plan<true, T, kVec>(plan, [&](auto vpt, auto kind) {
      const dim3 block(plan.tpr, plan.rpb), grid(static_cast<unsigned>(cdiv(rows, plan.rpb)));
      fwd_kernel<T, kVec, decltype(vpt)::value, decltype(kind)::value><<<grid, block, 0, s>>>(a, plan.chunks);
    });
  });
  check_cuda(cudaGetLastError(), "bias_dropout_add_layer_norm_fwd launch");
}

int64_t bias_dropout_add_layer_norm_bwd_partials(int64_t rows, int64_t h, int dtype, bool vectorized) {
  using namespace bdaln;
  check_sizes(h, kFloat32);
  if (rows <= 0) return 1;
  const DeviceInfo dev = device_info();
  int blocks_per_sm = 1, rpb = 1;
  dispatch_type_vec<kScalarRun>(dtype, vectorized, [&](auto tag, auto vec) {
    constexpr int kVec = decltype(vec)::value;
    const Plan plan = bwd_plan(h, kVec, kVectorRun<decltype(tag), kVec>, dev);
    rpb = plan.rpb;
    blocks_per_sm = bwd_blocks_per_sm<decltype(tag), kVec>(plan, bwd_smem_bytes(plan, h));
  });
  // One wave of resident blocks, each writing one partial row: few partial rows, little reduction traffic.
  return std::max<int64_t>(1, std::min<int64_t>(cdiv(rows, rpb), static_cast<int64_t>(dev.sms) * blocks_per_sm));
}

void bias_dropout_add_layer_norm_bwd(uintptr_t grad_y, uintptr_t grad_residual_out, uintptr_t residual_out,
                                     uintptr_t ln_weight, uintptr_t mean, uintptr_t rstd, uintptr_t grad_x,
                                     uintptr_t grad_residual, uintptr_t partials, int64_t num_partials,
                                     uintptr_t grad_ln_weight, uintptr_t grad_ln_bias, uintptr_t grad_bias,
                                     int64_t rows, int64_t h, int dtype, int wdtype, bool vectorized, int threshold,
                                     uint64_t seed, int64_t row_offset, uintptr_t stream) {
  using namespace bdaln;
  check_sizes(h, wdtype);
  check_threshold(threshold);
  if (num_partials < 1) throw std::invalid_argument("bias_dropout_add_layer_norm: num_partials must be >= 1");
  check_aligned("bias_dropout_add_layer_norm", vectorized, h, dtype,
                {grad_y, grad_residual_out, residual_out, grad_x, grad_residual, ln_weight, partials}, {});
  const auto s = reinterpret_cast<cudaStream_t>(stream);
  const int count = grad_bias != 0 ? 3 : 2;
  float* part = reinterpret_cast<float*>(partials);  // [2 or 3, num_partials, h]: dw, db (, dbias)
  float* part_bias = grad_bias != 0 ? part + 2 * num_partials * h : nullptr;
  if (rows > 0) {
    const BwdArgs a{reinterpret_cast<const void*>(grad_y), reinterpret_cast<const void*>(grad_residual_out),
                    reinterpret_cast<const void*>(residual_out), reinterpret_cast<const void*>(ln_weight),
                    reinterpret_cast<const float*>(mean), reinterpret_cast<const float*>(rstd), wdtype,
                    reinterpret_cast<void*>(grad_x), reinterpret_cast<void*>(grad_residual), part,
                    part + num_partials * h, part_bias, rows, h, drop_scale(threshold),
                    static_cast<uint32_t>(threshold) << 24, seed, row_offset};
    const DeviceInfo dev = device_info();
    dispatch_type_vec<kScalarRun>(dtype, vectorized, [&](auto tag, auto vec) {
      using T = decltype(tag);
      constexpr int kVec = decltype(vec)::value;
      const Plan plan = bwd_plan(h, kVec, kVectorRun<T, kVec>, dev);
      const size_t smem = bwd_smem_bytes(plan, h);
      dispatch_plan<false, T, kVec>(plan, [&](auto vpt, auto kind) {
        const auto kernel = bwd_kernel<T, kVec, decltype(vpt)::value, decltype(kind)::value>;
        allow_smem(kernel, smem, "bias_dropout_add_layer_norm shared memory");
        kernel<<<static_cast<unsigned>(num_partials), dim3(plan.tpr, plan.rpb), smem, s>>>(a, plan.chunks);
      });
    });
    check_cuda(cudaGetLastError(), "bias_dropout_add_layer_norm_bwd launch");
  } else {
    check_cuda(cudaMemsetAsync(part, 0, sizeof(float) * count * num_partials * h, s),
               "bias_dropout_add_layer_norm_bwd memset");
  }
  const PartialSums sums{{part, part + num_partials * h, part_bias},
                         {reinterpret_cast<float*>(grad_ln_weight), reinterpret_cast<float*>(grad_ln_bias),
                          reinterpret_cast<float*>(grad_bias)}};
  launch_reduce_partials(sums, count, num_partials, h, s, "bias_dropout_add_layer_norm reduce launch");
}

}  // namespace seqpar
