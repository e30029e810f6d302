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
// registers between the passes over them; the forward's kChunked rows (h > 16384: the paper's 530B and 1T
// models have h = 20480 and 25600) take as many chunks as they need, and the passes after the first
// re-read the chunks that are not in registers (residual_out was just written by the same thread: from L2
// mostly). Any h is accepted.
// When the pointers, h and the row strides allow it, a run is one 16-byte vector (VEC = 16 / sizeof(T):
// half a dropout group for 2-byte types, a quarter for fp32); otherwise a run is one whole 16-column
// dropout group moved with scalar accesses (VEC = 16, columns past h masked; the block-per-row forward
// then uses at most 512 threads, 128 registers each). Either way a run's mask comes from one Philox call
// (mask_words + mask_run).
//
// Forward: warp per row while a lane holds at most kFwdWarpVectors 16-byte runs (h <= 1024 for 2-byte
// types, 512 for fp32; 4 rows per block), block per row beyond; three passes over a row (residual_out and
// its sum; the sums of d = r - mean and d * d; y). A warp per row of h = 4096 (16 runs, 128 values a lane) took
// 174 registers and 12% occupancy on an H200 and ran 2.6x slower than the block per row of the Triton
// forward (381 vs 146 us at 16384 x 4096 bf16); the RMSNorm forward keeps the same 4-run cap. A block per
// row takes the most threads that still leave two blocks resident per SM (rows::resident_plan, up to
// kFwdBlockVectors runs a thread): h = 8192 in 2-byte types 512 threads x 2 runs, h = 12288 384 x 4, where
// the fewest runs a thread (1024 x 1, 768 x 2) left one block per SM.
// Backward: a block sums dw, db and dbias over the rows it visits (one wave of blocks), writes them as one
// fp32 partial row per quantity, and reduce_partials_kernel sums the partial rows (no atomics:
// deterministic). Rows of up to kColumnsMinHidden = 4096 columns: a row per warp or block, whose row sums
// (mean(g), mean(g * x_hat)) are reductions over it. Those running column sums are 3 fp32 values per owned
// element: in registers they would cost 384 registers per lane for a warp-per-row h = 4096, so the
// warp-per-row backward is used only while a lane owns at most two 16-byte runs (h <= 512 for 2-byte types,
// 256 for fp32; sums in registers), and the block per row (<= 512 threads) beyond keeps them in shared
// memory (3 * h * 4 bytes; each thread owns its columns, so no synchronisation). Wider rows: a row-sum pass
// (bwd_row_sums_kernel) writes each row's two sums, then blocks of one column chunk each
// (bwd_columns_kernel, one 16-byte run per thread) stream the rows with no reduction and their column sums
// in registers. A block per row of h = 12288 held the whole row (117 registers, 147 KB of shared-memory
// sums: one 384-thread block per SM) and took 1.3 ms at 16384 x 12288 bf16 on an H200, 2.8x its memory
// time (commit 96c73a0); the row-sum pass reads grad_y and residual_out once more (7 tensor passes, not 5)
// but every pass streams at 50% occupancy or more. The backward draws the mask where it is used, so no
// decisions are kept in registers.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <tuple>
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
constexpr int kFwdBlockVectors = 4;        // 16-byte runs per thread of the block-per-row forward, at most
constexpr int kBwdWarpVectors = 2;         // 16-byte runs per lane of the warp-per-row backward (registers)
constexpr int kBwdWarpElements = 16;       // so at most 16 elements per lane
constexpr int kBwdWarpRows = 16;           // rows per block of the warp-per-row backward (512 threads)
constexpr int kBwdMaxThreads = 512;        // block-per-row backward: up to 128 registers per thread
constexpr int kBwdWarpSmemFloats = (kBwdWarpRows - 1) * kWarp * kBwdWarpElements;  // fold of row slots
constexpr int kScalarRun = kMaskGroup;     // VEC of the scalar-access kernels: one whole dropout group
constexpr int64_t kColumnsMinHidden = 4096; // wider rows: backward by row-sum pass + column-chunk blocks
constexpr int kRowSumThreads = 256;        // block of the row-sum pass (one row per block)
constexpr int kColumnThreads = 256;        // block of the column-chunk backward (one run per thread)

// True when the runs of VEC elements of T are single 16-byte vectors (else: scalar-access runs of a group).
template <typename T, int VEC>
constexpr bool kVectorRun = VEC * sizeof(T) == 16;

// Vectors per thread of each kind of kernel (only VPT up to these are instantiated: build time grows with
// each instantiation). kWarp: 4 (forward) or 2 (backward) runs per lane. kBlock: enough for
// kBlockMaxHidden (forward) or kColumnsMinHidden (backward) columns; the forward's kChunked uses exactly
// the kBlock maximum per chunk (ptxas -v: no spills).
constexpr int max_threads(bool forward, int vec) {
  return !forward ? kBwdMaxThreads : vec == kScalarRun ? kFwdScalarMaxThreads : kMaxThreads;
}
constexpr int warp_vpt(bool forward) { return forward ? kFwdWarpVectors : kBwdWarpVectors; }
constexpr int block_vpt(bool forward, int vec) {
  return pow2_ceil(cdiv((forward ? kBlockMaxHidden : kColumnsMinHidden) / vec, max_threads(forward, vec)));
}
// The forward's block per row may hold more runs per thread than the fewest that cover its row (resident_plan
// trades threads for resident rows): up to kFwdBlockVectors 16-byte runs (ptxas: 68-72 registers for 2-byte
// types at 4, under a 512-thread bound), scalar runs at block_vpt.
constexpr int fwd_block_max_vpt(int vec) {
  return vec == kScalarRun ? block_vpt(true, vec) : std::max(block_vpt(true, vec), kFwdBlockVectors);
}

template <RowKind KIND, bool kForward, int VEC>
constexpr int threads_bound() {
  return KIND == RowKind::kWarp ? kWarp * (kForward ? kFwdWarpRows : kBwdWarpRows) : max_threads(kForward, VEC);
}
// The forward's __launch_bounds__: a block per row with VPT runs a thread never has more threads than the
// widest such row needs (kBlockMaxHidden / VEC / VPT), so ptxas may give each thread the registers of its VPT
// runs (4 runs of 2-byte types: 512 threads, up to 128 registers; a 1024-thread bound would cap them at 64).
template <RowKind KIND, int VEC, int VPT>
constexpr int fwd_threads_bound() {
  return KIND == RowKind::kBlock
             ? std::min(max_threads(true, VEC), round_up_warp(cdiv(kBlockMaxHidden / VEC, VPT)))
             : threads_bound<KIND, true, VEC>();
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
  float* part_w;     // [num_partials, h] each; row p: block p (bwd_columns_kernel: row block p);
  float* part_b;     // nullptr: that sum is not computed (a frozen norm's dw / db, no bias or a frozen one)
  float* part_bias;
  int64_t rows, h;
  float scale;
  uint32_t threshold24;
  uint64_t seed;
  int64_t row_offset;
};

template <typename T, int VEC, int VPT, RowKind KIND>
__global__ void __launch_bounds__(fwd_threads_bound<KIND, VEC, VPT>()) fwd_kernel(const FwdArgs a,
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
  const float m0 = stat[0] * inv_h;
  // Pass 2, chunks C-1 .. 0 (the last one is still in registers): the sums of d = r - m0 and of d * d, for
  // the corrected two-pass statistics (seqpar/ops/bias_dropout_add_layer_norm.py: exact for a constant row).
  float centred[2] = {0.0f, 0.0f};
  for (int64_t c = chunks - 1; c >= 0; --c) {
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int64_t j = c * chunk_vecs + threadIdx.x + static_cast<int64_t>(k) * tpr;
      if (j < nvec) {
        if (kChunked && c != chunks - 1) r[k] = load_run<T, VEC>(res_out, j * VEC, a.h, kVector);
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          const float d = to_float(r[k].v[i]) - m0;
          if (kVector || j * VEC + i < a.h) {
            centred[0] += d;
            centred[1] += d * d;
          }
        }
      }
    }
  }
  row_allreduce<kWarpRow>(centred);
  // Divided by h, not multiplied by inv_h: a constant row has d = delta everywhere, sum(d) = h * delta and
  // sum(d * d) = h * delta**2 exactly, and only a correctly rounded division gives back delta and delta**2
  // (var 0). inv_h is rounded unless h is a power of two: var came out near 6e-8 * delta**2, which at eps
  // 1e-12 moved a constant row of 12345.678's rstd by 2-3 % (h 1000, 12288, 20480 on an H200).
  const float h_f = static_cast<float>(a.h);
  const float shift = centred[0] / h_f;
  const float mean = m0 + shift;
  // Not fmaxf: it makes a NaN variance (inf - inf on rows of values ~1e27 and more) 0, and the row a finite
  // ~1e33 where the torch reference and F.layer_norm give NaN.
  const float var = centred[1] / h_f - shift * shift;
  const float rstd = rsqrtf((var < 0.0f ? 0.0f : var) + a.eps);
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

// Running column sums (dw, db, dbias) of the block-per-row and warp-per-row backward, by kind of kernel:
// kWarp in registers (a lane owns few elements; row slots are folded through shared memory at the end);
// kBlock in dynamic shared memory ([3][h] floats, h <= kColumnsMinHidden), where thread t owns the columns
// of its runs j = t (mod blockDim.x). VECTOR: the runs are 16-byte vectors (every run lies inside the
// row); else scalar runs whose columns past h are skipped.
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
  static_assert(KIND == RowKind::kBlock, "wider rows take bwd_columns_kernel");
  float* base;  // sum q is base + q * h (16-byte aligned for VECTOR, as h % VEC == 0)
  int64_t h;
  __device__ __forceinline__ void init(int64_t h_, float* const (&parts)[3]) {
    h = h_;
    base = dynamic_shared<float>();
    const int64_t nvec = (h + VEC - 1) / VEC;
    Pack<float, VEC> zero;
#pragma unroll
    for (int i = 0; i < VEC; ++i) zero.v[i] = 0.0f;
#pragma unroll
    for (int q = 0; q < 3; ++q) {
      if (parts[q] == nullptr) continue;  // uniform
      for (int64_t j = threadIdx.x; j < nvec; j += blockDim.x)
        shared_store_run<float, VEC>(base + q * h, j * VEC, h, VECTOR, zero);
    }
  }
  // Only called for owned runs (j < nvec) of summed quantities; no other thread touches them, so no
  // synchronisation.
  __device__ __forceinline__ void add(int q, int, int64_t j, const float (&v)[VEC]) {
    float* sum = base + q * h;
    Pack<float, VEC> cur = load_run<float, VEC>(sum, j * VEC, h, VECTOR);
#pragma unroll
    for (int i = 0; i < VEC; ++i) cur.v[i] += v[i];
    shared_store_run<float, VEC>(sum, j * VEC, h, VECTOR, cur);
  }
  __device__ __forceinline__ void write(float* const (&parts)[3], int64_t nvec, int64_t) {
#pragma unroll
    for (int q = 0; q < 3; ++q) {
      if (parts[q] == nullptr) continue;
      float* out = parts[q] + static_cast<int64_t>(blockIdx.x) * h;
      for (int64_t j = threadIdx.x; j < nvec; j += blockDim.x)
        store_run<float, VEC>(out, j * VEC, h, VECTOR, load_run<float, VEC>(base + q * h, j * VEC, h, VECTOR));
    }
  }
};

template <typename T, int VEC, int VPT, RowKind KIND>
__global__ void __launch_bounds__(threads_bound<KIND, false, VEC>(), bwd_min_blocks(KIND, VPT * VEC))
    bwd_kernel(const BwdArgs a) {
  constexpr bool kVector = kVectorRun<T, VEC>;
  constexpr bool kWarpRow = KIND == RowKind::kWarp;
  static_assert(kVector || !kWarpRow, "warp-per-row kernels use 16-byte runs");
  // The row (residual_out, grad_y) stays in registers between the two passes over it: a thread owns at
  // most 16 elements of it (h <= kColumnsMinHidden; wider rows take bwd_columns_kernel).
  static_assert(VPT * VEC <= 16, "a thread holds at most 16 elements of its row");
  // A block-per-row kernel that keeps its row loads grad_residual_out with it too: all of the row's reads
  // are in flight before the block-wide reduction (two barriers), rather than a second memory round trip
  // after it. Warp-per-row rows reduce with shuffles alone, and their lanes' registers are full (ptxas
  // spilled with grad_residual_out held as well).
  constexpr bool kKeepGro = !kWarpRow;
  const int tpr = kWarpRow ? kWarp : blockDim.x;
  const int rpb = kWarpRow ? kBwdWarpRows : 1;
  const int64_t nvec = (a.h + VEC - 1) / VEC;
  const bool dropout = a.threshold24 != 0;
  const bool bias_sum = a.part_bias != nullptr;
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
    Pack<T, VEC> rv[VPT], gv[VPT], ov[kKeepGro ? VPT : 1];
    float dots[2] = {0.0f, 0.0f};  // sum(g), sum(g * x_hat)
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int64_t j = threadIdx.x + static_cast<int64_t>(k) * tpr;
      if (j < nvec) {
        rv[k] = load_run<T, VEC>(ro, j * VEC, a.h, kVector);
        gv[k] = load_run<T, VEC>(gy, j * VEC, a.h, kVector);
        if constexpr (kKeepGro) ov[k] = load_run<T, VEC>(gro, j * VEC, a.h, kVector);
        float wv[VEC], dw[VEC], db[VEC];
        weights(k, j, wv);
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          const float x_hat = (to_float(rv[k].v[i]) - mean) * rstd;
          const float dy = to_float(gv[k].v[i]);  // 0 past h: adds nothing below
          const float g = dy * wv[i];
          dots[0] += g;
          dots[1] += g * x_hat;
          dw[i] = dy * x_hat;
          db[i] = dy;
        }
        // A block per row skips the shared-memory sums of a frozen norm (nullptr: uniform); a warp's are
        // registers, left unconditional (the guard took fp16 from 74 to 86 registers) and never written.
        if (kWarpRow || a.part_w != nullptr) sums.add(0, k, j, dw);
        if (kWarpRow || a.part_b != nullptr) sums.add(1, k, j, db);
      }
    }
    row_allreduce<kWarpRow>(dots);
    const float mean_g = dots[0] * inv_h, mean_gx = dots[1] * inv_h;
    T* gx = static_cast<T*>(a.grad_x) + off;
    T* gres = static_cast<T*>(a.grad_residual) + off;
    const uint64_t mask_row = static_cast<uint64_t>(a.row_offset + row);
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int64_t j = threadIdx.x + static_cast<int64_t>(k) * tpr;
      if (j < nvec) {
        Pack<T, VEC> ok;
        if constexpr (kKeepGro) {
          ok = ov[k];
        } else {
          ok = load_run<T, VEC>(gro, j * VEC, a.h, kVector);
        }
        MaskWords mask{};
        if (dropout) mask = run_mask<VEC>(a.seed, mask_row, j);
        Pack<T, VEC> res_pack, x_pack;
        float wv[VEC], dbias[VEC];
        weights(k, j, wv);
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          const float x_hat = (to_float(rv[k].v[i]) - mean) * rstd;
          const float g = to_float(gv[k].v[i]) * wv[i];
          const float d_res = rstd * (g - mean_g - x_hat * mean_gx) + to_float(ok.v[i]);
          const float d_x = !dropout ? d_res : keep_column(mask, i, a.threshold24) ? d_res * a.scale : 0.0f;
          dbias[i] = d_x;
          res_pack.v[i] = from_float<T>(d_res);
          x_pack.v[i] = from_float<T>(d_x);
        }
        if (bias_sum) sums.add(2, k, j, dbias);
        store_run<T, VEC>(gres, j * VEC, a.h, kVector, res_pack);
        store_run<T, VEC>(gx, j * VEC, a.h, kVector, x_pack);
      }
    }
  }
  float* const parts[3] = {a.part_w, a.part_b, a.part_bias};
  sums.write(parts, nvec, a.h);
}

// Resident blocks per SM bwd_columns_kernel is compiled for: 4 with 16-byte runs, so at most 64 registers
// and 50% occupancy (without the bound ptxas took 74-79 registers, 3 blocks). With it bf16 spills one value
// (ptxas: 8 bytes stored, 4 loaded): stored before the row loop, reloaded once per row from L1, beside the
// row's three 16-byte loads from DRAM; holding the LayerNorm weight out of registers did not remove it.
// Scalar runs of 16 columns (odd h, unaligned tensors): no minimum (194-210 registers; bounded to 128 they
// spilled 176-676 bytes).
template <typename T, int VEC>
constexpr int columns_min_blocks() { return kVectorRun<T, VEC> ? 4 : 0; }

// Rows wider than kColumnsMinHidden: the row sums first, then blocks of one column chunk each.
// bwd_row_sums_kernel: one block of kRowSumThreads per row writes row_sums[row] = sum(g) and
// row_sums[rows + row] = sum(g * x_hat) (row_sums: [2, rows] fp32).
template <typename T, int VEC>
__global__ void __launch_bounds__(kRowSumThreads) bwd_row_sums_kernel(const BwdArgs a, float* row_sums) {
  constexpr bool kVector = kVectorRun<T, VEC>;
  const int64_t row = blockIdx.x, nvec = (a.h + VEC - 1) / VEC;
  const float mean = a.mean[row], rstd = a.rstd[row];
  const T* ro = static_cast<const T*>(a.residual_out) + row * a.h;
  const T* gy = static_cast<const T*>(a.grad_y) + row * a.h;
  float dots[2] = {0.0f, 0.0f};
#pragma unroll 4
  for (int64_t j = threadIdx.x; j < nvec; j += blockDim.x) {
    const Pack<T, VEC> rk = load_run<T, VEC>(ro, j * VEC, a.h, kVector);
    const Pack<T, VEC> gk = load_run<T, VEC>(gy, j * VEC, a.h, kVector);
    float wv[VEC];
    load_params<VEC>(a.w, j * VEC, a.h, kVector, a.wdtype, wv);  // zeros past h: adds nothing
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      const float g = to_float(gk.v[i]) * wv[i];
      dots[0] += g;
      dots[1] += g * ((to_float(rk.v[i]) - mean) * rstd);
    }
  }
  row_allreduce<false>(dots);
  if (threadIdx.x == 0) {
    row_sums[row] = dots[0];
    row_sums[a.rows + row] = dots[1];
  }
}

// bwd_columns_kernel: block (x, y) owns the runs x * kColumnThreads + threadIdx.x (one run of VEC columns per
// thread) of the rows y, y + gridDim.y, ...; it reads their row sums from row_sums, so its loop has no
// reduction and no barrier, and keeps its columns' running sums (dw, db, dbias) in registers, written at
// the end as its columns of partial row y. Its registers do not grow with h (the block-per-row kernel's
// hold the whole row: 117 registers, one 384-thread block per SM at h = 12288). Column chunks go in
// gridDim.x (up to 2**31 - 1), the few row blocks (one wave) in gridDim.y.
template <typename T, int VEC>
__global__ void __launch_bounds__(kColumnThreads, columns_min_blocks<T, VEC>())
    bwd_columns_kernel(const BwdArgs a, const float* row_sums) {
  constexpr bool kVector = kVectorRun<T, VEC>;
  const int64_t nvec = (a.h + VEC - 1) / VEC;
  const int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= nvec) return;  // no barrier below: a thread past the row just leaves
  const bool dropout = a.threshold24 != 0;
  const float inv_h = 1.0f / static_cast<float>(a.h);
  float wv[VEC], acc[3][VEC];
  load_params<VEC>(a.w, j * VEC, a.h, kVector, a.wdtype, wv);
#pragma unroll
  for (int i = 0; i < VEC; ++i) acc[0][i] = acc[1][i] = acc[2][i] = 0.0f;
  for (int64_t row = blockIdx.y; row < a.rows; row += gridDim.y) {
    const int64_t off = row * a.h;
    const float mean = a.mean[row], rstd = a.rstd[row];
    const float mean_g = row_sums[row] * inv_h, mean_gx = row_sums[a.rows + row] * inv_h;
    const Pack<T, VEC> rk = load_run<T, VEC>(static_cast<const T*>(a.residual_out) + off, j * VEC, a.h, kVector);
    const Pack<T, VEC> gk = load_run<T, VEC>(static_cast<const T*>(a.grad_y) + off, j * VEC, a.h, kVector);
    const Pack<T, VEC> ok = load_run<T, VEC>(static_cast<const T*>(a.grad_residual_out) + off, j * VEC, a.h, kVector);
    MaskWords mask{};
    if (dropout) mask = run_mask<VEC>(a.seed, static_cast<uint64_t>(a.row_offset + row), j);
    Pack<T, VEC> res_pack, x_pack;
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      const float x_hat = (to_float(rk.v[i]) - mean) * rstd;
      const float dy = to_float(gk.v[i]);  // 0 past h: adds nothing below
      const float d_res = rstd * (dy * wv[i] - mean_g - x_hat * mean_gx) + to_float(ok.v[i]);
      const float d_x = !dropout ? d_res : keep_column(mask, i, a.threshold24) ? d_res * a.scale : 0.0f;
      acc[0][i] += dy * x_hat;
      acc[1][i] += dy;
      acc[2][i] += d_x;
      res_pack.v[i] = from_float<T>(d_res);
      x_pack.v[i] = from_float<T>(d_x);
    }
    store_run<T, VEC>(static_cast<T*>(a.grad_residual) + off, j * VEC, a.h, kVector, res_pack);
    store_run<T, VEC>(static_cast<T*>(a.grad_x) + off, j * VEC, a.h, kVector, x_pack);
  }
  float* const parts[3] = {a.part_w, a.part_b, a.part_bias};
#pragma unroll
  for (int q = 0; q < 3; ++q) {
    if (parts[q] == nullptr) continue;  // a sum not computed
    Pack<float, VEC> pk;
#pragma unroll
    for (int i = 0; i < VEC; ++i) pk.v[i] = acc[q][i];
    store_run<float, VEC>(parts[q] + static_cast<int64_t>(blockIdx.y) * a.h, j * VEC, a.h, kVector, pk);
  }
}

// ---------------------------------------------------------------------------------------------- launch
// vector: the runs are 16-byte vectors (else scalar-access runs of one dropout group: block per row only).
// A block per row here has the fewest runs per thread that cover the row; the launch may take more
// (fwd_candidates, resident_plan).
inline Plan fwd_plan(int64_t h, int vec, bool vector) {
  const int64_t nvec = cdiv(h, vec);
  if (vector && nvec <= kWarp * kFwdWarpVectors) return warp_plan(nvec, kFwdWarpRows);
  return block_plan(nvec, max_threads(true, vec), block_vpt(true, vec), block_vpt(true, vec));
}

// The plans the forward's launch chooses from (tests/cuda_emulation runs every one).
inline std::vector<Plan> fwd_candidates(int64_t h, int vec, bool vector) {
  return plan_candidates(fwd_plan(h, vec, vector), cdiv(h, vec), fwd_block_max_vpt(vec));
}

// The backward of rows of up to kColumnsMinHidden columns: a warp per row while a lane holds at most
// kBwdWarpVectors runs, else a block per row whose running sums live in shared memory (3 * h floats, at most
// 48 KiB, the opt-in limit raised by allow_smem). Wider rows take columns_bwd (no Plan).
inline Plan bwd_plan(int64_t h, int vec, bool vector) {
  const int64_t nvec = cdiv(h, vec);
  if (vector && nvec <= kWarp * kBwdWarpVectors) return warp_plan(nvec, kBwdWarpRows);
  return block_plan(nvec, max_threads(false, vec), block_vpt(false, vec), block_vpt(false, vec));
}

// Rows wider than kColumnsMinHidden: bwd_row_sums_kernel, then bwd_columns_kernel on a grid of
// (column_chunks, row blocks).
inline bool columns_bwd(int64_t h) { return h > kColumnsMinHidden; }
inline int64_t column_chunks(int64_t h, int vec) { return cdiv(cdiv(h, vec), kColumnThreads); }

// Calls fn(std::integral_constant<int, VPT>{}, std::integral_constant<RowKind, KIND>{}) for the kernel of
// `plan`; only VPT up to the kind's maximum are instantiated (kChunked, forward only: exactly its VPT).
template <bool kForward, typename T, int VEC, typename Fn>
void dispatch_plan(const Plan& plan, Fn&& fn) {
  using Warp = std::integral_constant<RowKind, RowKind::kWarp>;
  using Block = std::integral_constant<RowKind, RowKind::kBlock>;
  using Chunked = std::integral_constant<RowKind, RowKind::kChunked>;
  constexpr int kBlockVpt = kForward ? fwd_block_max_vpt(VEC) : block_vpt(false, VEC);
  constexpr int kChunkVpt = block_vpt(true, VEC);
  switch (plan.kind) {
    case RowKind::kWarp:
      if constexpr (kVectorRun<T, VEC>) {
        dispatch_vpt<warp_vpt(kForward)>(plan.vpt, [&](auto vpt) { fn(vpt, Warp{}); });
        return;
      }
      break;  // warp-per-row plans need 16-byte vectors
    case RowKind::kBlock: dispatch_vpt<kBlockVpt>(plan.vpt, [&](auto vpt) { fn(vpt, Block{}); }); return;
    case RowKind::kChunked:
      if constexpr (kForward) {
        if (plan.vpt != kChunkVpt) break;
        fn(std::integral_constant<int, kChunkVpt>{}, Chunked{});
        return;
      }
      break;
  }
  throw std::logic_error("bias_dropout_add_layer_norm: no kernel instantiated for this plan");
}

inline size_t bwd_smem_bytes(const Plan& plan, int64_t h) {
  return plan.kind == RowKind::kBlock ? 3 * sizeof(float) * static_cast<size_t>(h) : 0;
}

constexpr const char* kOccupancy = "bias_dropout_add_layer_norm occupancy";

// Resident blocks per SM of bwd_columns_kernel.
template <typename T, int VEC>
int columns_blocks_per_sm() {
  return std::max(resident_blocks(bwd_columns_kernel<T, VEC>, kColumnThreads, 0, kOccupancy), 1);
}

// Resident blocks per SM of the forward kernel of `plan`.
template <typename T, int VEC>
int fwd_blocks_per_sm(const Plan& plan) {
  int blocks = 0;
  dispatch_plan<true, T, VEC>(plan, [&](auto vpt, auto kind) {
    const auto kernel = fwd_kernel<T, VEC, decltype(vpt)::value, decltype(kind)::value>;
    blocks = resident_blocks(kernel, plan.tpr * plan.rpb, 0, kOccupancy);
  });
  return blocks;
}

// The forward's launch plan for rows of h columns on the current device: resident_plan over fwd_candidates.
template <typename T, int VEC>
Plan fwd_launch_plan(int64_t h) {
  return memo_plan<std::tuple<FwdArgs, T, std::integral_constant<int, VEC>>>(h, [h] {
    return resident_plan(fwd_plan(h, VEC, kVectorRun<T, VEC>), cdiv(h, VEC), fwd_block_max_vpt(VEC),
                         fwd_blocks_per_sm<T, VEC>);
  });
}

// Resident blocks per SM of the backward kernel of `plan`.
template <typename T, int VEC>
int bwd_blocks_per_sm(const Plan& plan, size_t smem) {
  int blocks = 0;
  dispatch_plan<false, T, VEC>(plan, [&](auto vpt, auto kind) {
    const auto kernel = bwd_kernel<T, VEC, decltype(vpt)::value, decltype(kind)::value>;
    allow_smem(kernel, smem, "bias_dropout_add_layer_norm shared memory");
    blocks = resident_blocks(kernel, plan.tpr * plan.rpb, smem, kOccupancy);
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

// The entry points launch with <<<>>>, which needs nvcc: host emulation (tests/cuda_emulation, g++) stops here.
#if !defined(SEQPAR_HOST_EMULATION)

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
    const Plan plan = fwd_launch_plan<T, kVec>(h);
    dispatch_plan<true, T, kVec>(plan, [&](auto vpt, auto kind) {
      const dim3 block(plan.tpr, plan.rpb), grid(static_cast<unsigned>(cdiv(rows, plan.rpb)));
      fwd_kernel<T, kVec, decltype(vpt)::value, decltype(kind)::value><<<grid, block, 0, s>>>(a, plan.chunks);
    });
  });
  check_cuda(cudaGetLastError(), "bias_dropout_add_layer_norm_fwd launch");
}

rows::PlanInfo bias_dropout_add_layer_norm_fwd_plan(int64_t h, int dtype, bool vectorized) {
  using namespace bdaln;
  check_sizes(h, kFloat32);
  check_aligned("bias_dropout_add_layer_norm", vectorized, h, dtype, {}, {});  // h a whole number of 16-byte vectors
  PlanInfo info;
  dispatch_type_vec<kScalarRun>(dtype, vectorized, [&](auto tag, auto vec) {
    using T = decltype(tag);
    constexpr int kVec = decltype(vec)::value;
    const Plan plan = fwd_launch_plan<T, kVec>(h);
    info = plan_info(plan, fwd_blocks_per_sm<T, kVec>(plan));
  });
  return info;
}

int64_t bias_dropout_add_layer_norm_bwd_partials(int64_t rows, int64_t h, int dtype, bool vectorized) {
  using namespace bdaln;
  check_sizes(h, kFloat32);
  if (rows <= 0) return 1;
  const DeviceInfo dev = device_info();
  int blocks_per_sm = 1, rpb = 1;
  int64_t chunks = 1;  // the column chunks share the wave
  dispatch_type_vec<kScalarRun>(dtype, vectorized, [&](auto tag, auto vec) {
    using T = decltype(tag);
    constexpr int kVec = decltype(vec)::value;
    if (columns_bwd(h)) {
      chunks = column_chunks(h, kVec);
      blocks_per_sm = columns_blocks_per_sm<T, kVec>();
      return;
    }
    const Plan plan = bwd_plan(h, kVec, kVectorRun<T, kVec>);
    rpb = plan.rpb;
    blocks_per_sm = bwd_blocks_per_sm<T, kVec>(plan, bwd_smem_bytes(plan, h));
  });
  // One wave of resident blocks, each writing one partial row: few partial rows, little reduction traffic.
  const int64_t wave = static_cast<int64_t>(dev.sms) * blocks_per_sm / chunks;
  return std::max<int64_t>(1, std::min<int64_t>(cdiv(rows, rpb), wave));
}

void bias_dropout_add_layer_norm_bwd(uintptr_t grad_y, uintptr_t grad_residual_out, uintptr_t residual_out,
                                     uintptr_t ln_weight, uintptr_t mean, uintptr_t rstd, uintptr_t grad_x,
                                     uintptr_t grad_residual, uintptr_t partials, int64_t num_partials,
                                     uintptr_t row_sums, uintptr_t grad_ln_weight, uintptr_t grad_ln_bias,
                                     uintptr_t grad_bias, int64_t rows, int64_t h, int dtype, int wdtype,
                                     bool vectorized, int threshold, uint64_t seed, int64_t row_offset,
                                     uintptr_t stream) {
  using namespace bdaln;
  check_sizes(h, wdtype);
  check_threshold(threshold);
  if (num_partials < 1) throw std::invalid_argument("bias_dropout_add_layer_norm: num_partials must be >= 1");
  if (columns_bwd(h) && rows > 0) {
    if (row_sums == 0)
      throw std::invalid_argument("bias_dropout_add_layer_norm: rows wider than " + std::to_string(kColumnsMinHidden) +
                                  " need the [2, rows] fp32 row_sums workspace");
    if (rows >= (int64_t(1) << 31) || num_partials > 65535)  // gridDim.x of the row-sum pass, gridDim.y
      throw std::invalid_argument("bias_dropout_add_layer_norm: rows must be < 2**31 and num_partials <= 65535");
  }
  check_aligned("bias_dropout_add_layer_norm", vectorized, h, dtype,
                {grad_y, grad_residual_out, residual_out, grad_x, grad_residual, ln_weight, partials}, {});
  const auto s = reinterpret_cast<cudaStream_t>(stream);
  // The column sums asked for (an output pointer of 0: not computed, e.g. a frozen norm's) take the partial
  // buffers [count, num_partials, h] in the order dw, db, dbias; the reduction sums exactly those.
  const uintptr_t outs[3] = {grad_ln_weight, grad_ln_bias, grad_bias};
  float* parts[3] = {nullptr, nullptr, nullptr};
  PartialSums sums{{nullptr, nullptr, nullptr}, {nullptr, nullptr, nullptr}};
  int count = 0;
  for (int q = 0; q < 3; ++q) {
    if (outs[q] == 0) continue;
    parts[q] = reinterpret_cast<float*>(partials) + count * num_partials * h;
    sums.part[count] = parts[q];
    sums.out[count] = reinterpret_cast<float*>(outs[q]);
    ++count;
  }
  if (rows > 0) {
    const BwdArgs a{reinterpret_cast<const void*>(grad_y), reinterpret_cast<const void*>(grad_residual_out),
                    reinterpret_cast<const void*>(residual_out), reinterpret_cast<const void*>(ln_weight),
                    reinterpret_cast<const float*>(mean), reinterpret_cast<const float*>(rstd), wdtype,
                    reinterpret_cast<void*>(grad_x), reinterpret_cast<void*>(grad_residual), parts[0], parts[1],
                    parts[2], rows, h, drop_scale(threshold),
                    static_cast<uint32_t>(threshold) << 24, seed, row_offset};
    dispatch_type_vec<kScalarRun>(dtype, vectorized, [&](auto tag, auto vec) {
      using T = decltype(tag);
      constexpr int kVec = decltype(vec)::value;
      if (columns_bwd(h)) {
        float* sums_of_rows = reinterpret_cast<float*>(row_sums);
        bwd_row_sums_kernel<T, kVec><<<static_cast<unsigned>(rows), kRowSumThreads, 0, s>>>(a, sums_of_rows);
        const dim3 grid(static_cast<unsigned>(column_chunks(h, kVec)), static_cast<unsigned>(num_partials));
        bwd_columns_kernel<T, kVec><<<grid, kColumnThreads, 0, s>>>(a, sums_of_rows);
        return;
      }
      const Plan plan = bwd_plan(h, kVec, kVectorRun<T, kVec>);
      const size_t smem = bwd_smem_bytes(plan, h);
      dispatch_plan<false, T, kVec>(plan, [&](auto vpt, auto kind) {
        const auto kernel = bwd_kernel<T, kVec, decltype(vpt)::value, decltype(kind)::value>;
        allow_smem(kernel, smem, "bias_dropout_add_layer_norm shared memory");
        kernel<<<static_cast<unsigned>(num_partials), dim3(plan.tpr, plan.rpb), smem, s>>>(a);
      });
    });
    check_cuda(cudaGetLastError(), "bias_dropout_add_layer_norm_bwd launch");
  } else if (count > 0) {
    check_cuda(cudaMemsetAsync(reinterpret_cast<void*>(partials), 0, sizeof(float) * count * num_partials * h, s),
               "bias_dropout_add_layer_norm_bwd memset");
  }
  if (count > 0) launch_reduce_partials(sums, count, num_partials, h, s, "bias_dropout_add_layer_norm reduce launch");
}

#endif  // !SEQPAR_HOST_EMULATION

}  // namespace seqpar
