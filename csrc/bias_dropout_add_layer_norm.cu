// Fused bias + dropout + residual-add + LayerNorm, forward and backward: the CUDA twin of
// triton_kernels/bias_dropout_add_layer_norm.py (math and shapes in seqpar/ops/bias_dropout_add_layer_norm.py).
//
//   keep         = mask_byte(seed, row_offset + row, col) >= P                (csrc/philox.cuh)
//   residual_out = residual + (keep ? (x + bias) * scale : 0)                   scale = float(256 / (256 - P))
//   y            = (residual_out - mean) * rstd * w + b                         stats of the rounded residual_out
//   backward:      g = dy * w;  dres = rstd * (g - mean(g) - x_hat * mean(g * x_hat)) + dres_out
//                  dx = keep ? dres * scale : 0;  dw = sum_rows(dy * x_hat), db = sum_rows(dy), dbias = sum_rows(dx)
//
// Layout: a block is TPR x RPB threads (threads per row x rows per block). WARP kernels have TPR = 32, one
// warp per row, and reduce with shuffles only; the others have one block per row (RPB = 1) and reduce with
// shuffles plus one shared-memory step. A thread owns VPT runs of VEC contiguous columns of its row,
// strided by TPR runs so a warp's accesses are contiguous; the row stays in registers between the passes
// over it (the backward's second pass re-reads it when a thread owns more than 16 elements). When the
// pointers, h and the row strides allow it, a run is one 16-byte vector (VEC = 16 / sizeof(T): half a
// dropout group for 2-byte types, a quarter for fp32); otherwise a run is one whole 16-column dropout group
// moved with scalar accesses (VEC = 16, columns past h masked; the block-per-row forward then uses at most
// 512 threads, 128 registers each). Either way a run's mask comes from one Philox call (mask_words +
// mask_run).
//
// Forward: warp per row for 16-byte runs and h <= 4096 (4 rows per block), block per row beyond.
// Backward: the block sums dw, db and dbias over the rows it visits (a grid-stride loop, one wave of
// blocks), writes them as one fp32 partial row, and a second small kernel sums the partial rows (no
// atomics: deterministic). Those running sums are 3 fp32 values per owned element: in registers they
// would cost 384 registers per lane for a warp-per-row h = 4096, so the warp-per-row backward is used
// only while a lane owns at most two 16-byte runs (h <= 512 for 2-byte types, 256 for fp32; sums in
// registers), and block-per-row (<= 512 threads, 128 registers each) beyond keeps the sums in shared
// memory (3 * h * 4 bytes; each thread owns its columns, so no synchronisation). The backward draws the
// mask in its second pass over the row, where it is used, so no decisions are kept in registers.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "dtypes.cuh"
#include "philox.cuh"

namespace seqpar {
namespace bdaln {

constexpr int kWarp = 32;
constexpr int kMaxThreads = 1024;
constexpr int kFwdScalarMaxThreads = 512;  // block-per-row forward with scalar runs: 128 registers per thread
constexpr int64_t kMaxHidden = 16384;   // shared-memory running sums: 3 * h * 4 bytes <= 192 KiB
constexpr int kFwdWarpRows = 4;         // rows per block of the warp-per-row forward
constexpr int kFwdWarpMaxHidden = 4096;
constexpr int kBwdWarpVectors = 2;      // 16-byte runs per lane of the warp-per-row backward (registers)
constexpr int kBwdWarpElements = 16;    // so at most 16 elements per lane
constexpr int kBwdWarpRows = 16;        // rows per block of the warp-per-row backward (512 threads)
constexpr int kBwdMaxThreads = 512;     // block-per-row backward: up to 128 registers per thread
constexpr int kBwdWarpSmemFloats = (kBwdWarpRows - 1) * kWarp * kBwdWarpElements;  // fold of row slots
constexpr int kScalarRun = kMaskGroup;  // VEC of the scalar-access kernels: one whole dropout group

// True when the runs of VEC elements of T are single 16-byte vectors (else: scalar-access runs of a group).
template <typename T, int VEC>
constexpr bool kVectorRun = VEC * sizeof(T) == 16;

// VEC LayerNorm parameters from run j of p (a row of h). Their dtype (fp32, fp16 or bf16) is a runtime code,
// uniform across the grid, so the branch is free and the kernels need no template parameter for it.
template <int VEC>
__device__ __forceinline__ void load_params(const void* p, int64_t j, int64_t h, bool vector, int wdtype,
                                            float (&out)[VEC]) {
  if (wdtype == kFloat32) {
    const Pack<float, VEC> v = load_run<float, VEC>(static_cast<const float*>(p), j * VEC, h, vector);
#pragma unroll
    for (int i = 0; i < VEC; ++i) out[i] = v.v[i];
  } else if (wdtype == kFloat16) {
    const Pack<__half, VEC> v = load_run<__half, VEC>(static_cast<const __half*>(p), j * VEC, h, vector);
#pragma unroll
    for (int i = 0; i < VEC; ++i) out[i] = to_float(v.v[i]);
  } else {
    const Pack<__nv_bfloat16, VEC> v =
        load_run<__nv_bfloat16, VEC>(static_cast<const __nv_bfloat16*>(p), j * VEC, h, vector);
#pragma unroll
    for (int i = 0; i < VEC; ++i) out[i] = to_float(v.v[i]);
  }
}

// The mask words of run j (columns j * VEC ..) of global row mask_row: one Philox call.
template <int VEC>
__device__ __forceinline__ MaskWords run_mask(uint64_t seed, uint64_t mask_row, int64_t j) {
  const uint64_t col0 = static_cast<uint64_t>(j) * VEC;
  return mask_run<VEC>(mask_words(seed, mask_row, static_cast<uint32_t>(col0 / kMaskGroup)), col0);
}

__device__ __forceinline__ float warp_allreduce(float v) {
#pragma unroll
  for (int offset = kWarp / 2; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// Sum N values over the threads of a row. WARP: the row is one warp. Otherwise the row is the whole block
// (RPB = 1); every thread of the block must call it.
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

template <typename T, int VEC, int VPT, bool WARP>
__global__ void __launch_bounds__(WARP ? kWarp * kFwdWarpRows : kVectorRun<T, VEC> ? kMaxThreads : kFwdScalarMaxThreads)
    fwd_kernel(const FwdArgs a) {
  constexpr bool kVector = kVectorRun<T, VEC>;
  const int tpr = WARP ? kWarp : blockDim.x;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (WARP ? kFwdWarpRows : 1) + threadIdx.y;
  if (WARP && row >= a.rows) return;  // block rows always exist (grid = rows)
  const int64_t nvec = (a.h + VEC - 1) / VEC;
  const T* x = static_cast<const T*>(a.x) + row * a.stride_x;
  const T* res = static_cast<const T*>(a.residual) + row * a.stride_res;
  const T* bias = static_cast<const T*>(a.bias);
  T* res_out = static_cast<T*>(a.residual_out) + row * a.h;
  const uint64_t mask_row = static_cast<uint64_t>(a.row_offset + row);
  const bool dropout = a.threshold24 != 0;

  Pack<T, VEC> r[VPT];  // residual_out, rounded to T: the statistics are of what backward will see
  float stat[1] = {0.0f};
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
    const int64_t j = threadIdx.x + static_cast<int64_t>(k) * tpr;
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
  row_allreduce<WARP>(stat);
  const float inv_h = 1.0f / static_cast<float>(a.h);
  const float mean = stat[0] * inv_h;
  stat[0] = 0.0f;
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
    const int64_t j = threadIdx.x + static_cast<int64_t>(k) * tpr;
    if (j < nvec) {
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        const float d = to_float(r[k].v[i]) - mean;
        if (kVector || j * VEC + i < a.h) stat[0] += d * d;
      }
    }
  }
  row_allreduce<WARP>(stat);
  const float rstd = rsqrtf(stat[0] * inv_h + a.eps);
  if (threadIdx.x == 0) {
    a.mean[row] = mean;
    a.rstd[row] = rstd;
  }
  T* y = static_cast<T*>(a.y) + row * a.h;
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
    const int64_t j = threadIdx.x + static_cast<int64_t>(k) * tpr;
    if (j < nvec) {
      float wv[VEC], bv[VEC];
      load_params<VEC>(a.w, j, a.h, kVector, a.wdtype, wv);
      load_params<VEC>(a.b, j, a.h, kVector, a.wdtype, bv);
      Pack<T, VEC> out;
#pragma unroll
      for (int i = 0; i < VEC; ++i) out.v[i] = from_float<T>((to_float(r[k].v[i]) - mean) * rstd * wv[i] + bv[i]);
      store_run<T, VEC>(y, j * VEC, a.h, kVector, out);
    }
  }
}

// Running column sums of the backward. Registers (WARP: a lane owns few elements; row slots are folded
// through shared memory at the end) or shared memory (block per row: [3][h] floats, dynamic). VECTOR: the
// runs are 16-byte vectors (every run lies inside the row); else scalar runs whose columns past h are
// skipped.
template <int VEC, int VPT, bool WARP, bool VECTOR>
struct ColumnSums;

template <int VEC, int VPT>
struct ColumnSums<VEC, VPT, true, true> {
  float acc[3][VPT][VEC];
  __device__ __forceinline__ void init(int64_t) {
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

template <int VEC, int VPT, bool VECTOR>
struct ColumnSums<VEC, VPT, false, VECTOR> {
  float* smem;  // [3][h]; thread t owns the columns of its runs j = t + k * blockDim.x
  int64_t h;
  __device__ __forceinline__ void init(int64_t h_) {
    extern __shared__ float4 dynamic_smem[];
    smem = reinterpret_cast<float*>(dynamic_smem);
    h = h_;
    const int64_t nvec = (h + VEC - 1) / VEC;
    Pack<float, VEC> zero;
#pragma unroll
    for (int i = 0; i < VEC; ++i) zero.v[i] = 0.0f;
#pragma unroll
    for (int q = 0; q < 3; ++q)
#pragma unroll
      for (int k = 0; k < VPT; ++k) {
        const int64_t j = threadIdx.x + static_cast<int64_t>(k) * blockDim.x;
        if (j < nvec) store_run<float, VEC>(smem + q * h, j * VEC, h, VECTOR, zero);
      }
  }
  // Only called for owned runs (j < nvec); no other thread touches them, so no synchronisation.
  // (VECTOR: 16-byte aligned, as h % VEC == 0.)
  __device__ __forceinline__ void add(int q, int k, int64_t j, const float (&v)[VEC]) {
    Pack<float, VEC> cur = load_run<float, VEC>(smem + q * h, j * VEC, h, VECTOR);
#pragma unroll
    for (int i = 0; i < VEC; ++i) cur.v[i] += v[i];
    store_run<float, VEC>(smem + q * h, j * VEC, h, VECTOR, cur);
  }
  __device__ __forceinline__ void write(float* const (&parts)[3], int64_t nvec, int64_t) {
#pragma unroll
    for (int q = 0; q < 3; ++q) {
      if (parts[q] == nullptr) continue;
      float* out = parts[q] + static_cast<int64_t>(blockIdx.x) * h;
#pragma unroll
      for (int k = 0; k < VPT; ++k) {
        const int64_t j = threadIdx.x + static_cast<int64_t>(k) * blockDim.x;
        if (j < nvec)
          store_run<float, VEC>(out, j * VEC, h, VECTOR, load_run<float, VEC>(smem + q * h, j * VEC, h, VECTOR));
      }
    }
  }
};

template <typename T, int VEC, int VPT, bool WARP>
__global__ void __launch_bounds__(WARP ? kWarp * kBwdWarpRows : kBwdMaxThreads) bwd_kernel(const BwdArgs a) {
  constexpr bool kVector = kVectorRun<T, VEC>;
  static_assert(kVector || !WARP, "warp-per-row kernels use 16-byte runs");
  // The row (residual_out, grad_y) stays in registers between the two passes over it while a thread owns
  // at most 16 elements; beyond that (h > 8192 in 2-byte types) the second pass reads it again (from L2),
  // or ptxas spills.
  constexpr bool kKeepRow = VPT * VEC <= 16;
  const int tpr = WARP ? kWarp : blockDim.x;
  const int rpb = WARP ? kBwdWarpRows : 1;
  const int64_t nvec = (a.h + VEC - 1) / VEC;
  const bool dropout = a.threshold24 != 0;
  const bool has_bias = a.part_bias != nullptr;
  const float inv_h = 1.0f / static_cast<float>(a.h);

  // LayerNorm weight: kept in registers by the warp-per-row kernel; the block-per-row kernel (whose
  // registers go to its wide row) re-reads it per row, from L1 / L2 (it is small and shared by all rows).
  float w_reg[WARP ? VPT : 1][VEC];
  if constexpr (WARP) {
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int64_t j = threadIdx.x + static_cast<int64_t>(k) * tpr;
      if (j < nvec) {
        load_params<VEC>(a.w, j, a.h, true, a.wdtype, w_reg[k]);
      } else {
#pragma unroll
        for (int i = 0; i < VEC; ++i) w_reg[k][i] = 0.0f;
      }
    }
  }
  const auto weights = [&](int k, int64_t j, float(&out)[VEC]) {
    if constexpr (WARP) {
#pragma unroll
      for (int i = 0; i < VEC; ++i) out[i] = w_reg[k][i];
    } else {
      load_params<VEC>(a.w, j, a.h, kVector, a.wdtype, out);
    }
  };
  ColumnSums<VEC, VPT, WARP, kVector> sums;
  sums.init(a.h);

  // Grid-stride over groups of rpb rows; the trip count is uniform across the block.
  const int64_t stride = static_cast<int64_t>(gridDim.x) * rpb;
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * rpb; base < a.rows; base += stride) {
    const int64_t row = base + threadIdx.y;
    if (WARP && row >= a.rows) break;  // warps never synchronise inside the loop
    const int64_t off = row * a.h;
    const float mean = a.mean[row], rstd = a.rstd[row];
    const T* ro = static_cast<const T*>(a.residual_out) + off;
    const T* gy = static_cast<const T*>(a.grad_y) + off;
    Pack<T, VEC> rv[kKeepRow ? VPT : 1], gv[kKeepRow ? VPT : 1];
    float dots[2] = {0.0f, 0.0f};  // sum(g), sum(g * x_hat)
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int64_t j = threadIdx.x + static_cast<int64_t>(k) * tpr;
      if (j < nvec) {
        const Pack<T, VEC> rk = load_run<T, VEC>(ro, j * VEC, a.h, kVector);
        const Pack<T, VEC> gk = load_run<T, VEC>(gy, j * VEC, a.h, kVector);
        if constexpr (kKeepRow) {
          rv[k] = rk;
          gv[k] = gk;
        }
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
    row_allreduce<WARP>(dots);
    const float mean_g = dots[0] * inv_h, mean_gx = dots[1] * inv_h;
    const T* gro = static_cast<const T*>(a.grad_residual_out) + off;
    T* gx = static_cast<T*>(a.grad_x) + off;
    T* gres = static_cast<T*>(a.grad_residual) + off;
    const uint64_t mask_row = static_cast<uint64_t>(a.row_offset + row);
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int64_t j = threadIdx.x + static_cast<int64_t>(k) * tpr;
      if (j < nvec) {
        const Pack<T, VEC> ov = load_run<T, VEC>(gro, j * VEC, a.h, kVector);
        Pack<T, VEC> rk, gk;
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
          const float d_res = rstd * (g - mean_g - x_hat * mean_gx) + to_float(ov.v[i]);
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
  float* const parts[3] = {a.part_w, a.part_b, a.part_bias};
  sums.write(parts, nvec, a.h);
}

// out_q[col] = sum over the n_partials rows of part_q[:, col] (blockIdx.y = q; part_bias may be null).
__global__ void reduce_partials_kernel(const float* part_w, const float* part_b, const float* part_bias,
                                       float* grad_w, float* grad_b, float* grad_bias, int64_t n_partials,
                                       int64_t h) {
  __shared__ float smem[8][kWarp + 1];
  const int64_t col = static_cast<int64_t>(blockIdx.x) * kWarp + threadIdx.x;
  const float* part = blockIdx.y == 0 ? part_w : blockIdx.y == 1 ? part_b : part_bias;
  float* out = blockIdx.y == 0 ? grad_w : blockIdx.y == 1 ? grad_b : grad_bias;
  if (part == nullptr) return;  // uniform per block
  float acc = 0.0f;
  if (col < h) {
    for (int64_t r = threadIdx.y; r < n_partials; r += blockDim.y) acc += part[r * h + col];
  }
  smem[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && col < h) {
    for (int s = 1; s < 8; ++s) acc += smem[s][threadIdx.x];
    out[col] = acc;
  }
}

// ---------------------------------------------------------------------------------------------- launch
struct Plan {
  bool warp;  // warp per row (else block per row)
  int vpt;    // vectors per thread (power of two)
  int tpr;    // threads per row
  int rpb;    // rows per block
};

constexpr int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

inline int pow2_ceil(int64_t v) {
  int p = 1;
  while (p < v) p <<= 1;
  return p;
}

inline int round_up_warp(int64_t v) { return static_cast<int>(cdiv(v, kWarp) * kWarp); }

inline Plan block_plan(int64_t nvec, int max_threads) {
  const int vpt = pow2_ceil(cdiv(nvec, max_threads));
  return {false, vpt, round_up_warp(cdiv(nvec, vpt)), 1};
}

// vector: the runs are 16-byte vectors (else scalar-access runs of one dropout group: block per row only).
inline Plan fwd_plan(int64_t h, int vec, bool vector) {
  const int64_t nvec = cdiv(h, vec);
  if (vector && h <= kFwdWarpMaxHidden) return {true, pow2_ceil(cdiv(nvec, kWarp)), kWarp, kFwdWarpRows};
  return block_plan(nvec, vector ? kMaxThreads : kFwdScalarMaxThreads);
}

inline Plan bwd_plan(int64_t h, int vec, bool vector) {
  const int64_t nvec = cdiv(h, vec);
  if (vector && nvec <= kWarp * kBwdWarpVectors) {
    return {true, pow2_ceil(cdiv(nvec, kWarp)), kWarp, kBwdWarpRows};
  }
  return block_plan(nvec, kBwdMaxThreads);
}

// The largest VPT each kind of kernel can be asked for with h <= kMaxHidden; only VPT up to it are
// instantiated (build time grows with each instantiation). At most 32 (dispatch_vpt's cases).
constexpr int max_vpt(bool forward, bool warp, int vec) {
  if (warp) return forward ? kFwdWarpMaxHidden / kWarp / vec : kBwdWarpVectors;
  const int64_t threads = !forward ? kBwdMaxThreads : vec == kScalarRun ? kFwdScalarMaxThreads : kMaxThreads;
  const int64_t need = (kMaxHidden / vec + threads - 1) / threads;
  int p = 1;
  while (p < need) p <<= 1;
  return p;
}

template <int kMax, typename Fn>
void dispatch_vpt(int vpt, Fn&& fn) {
  switch (vpt) {
    case 1: fn(std::integral_constant<int, 1>{}); return;
#define SEQPAR_VPT_CASE(N)                    \
  case N:                                     \
    if constexpr (kMax >= N) {                \
      fn(std::integral_constant<int, N>{});   \
      return;                                 \
    }                                         \
    break;
    SEQPAR_VPT_CASE(2)
    SEQPAR_VPT_CASE(4)
    SEQPAR_VPT_CASE(8)
    SEQPAR_VPT_CASE(16)
    SEQPAR_VPT_CASE(32)
#undef SEQPAR_VPT_CASE
    default: break;
  }
  throw std::logic_error("bias_dropout_add_layer_norm: no kernel instantiated for this plan");
}

// Calls fn(std::integral_constant<int, VPT>, std::bool_constant<WARP>) for the kernel of `plan`.
template <bool kForward, typename T, int VEC, typename Fn>
void dispatch_plan(const Plan& plan, Fn&& fn) {
  if (plan.warp) {
    if constexpr (kVectorRun<T, VEC>) {
      dispatch_vpt<max_vpt(kForward, true, VEC)>(plan.vpt, [&](auto vpt) { fn(vpt, std::true_type{}); });
      return;
    }
    throw std::logic_error("bias_dropout_add_layer_norm: warp-per-row plans need 16-byte vectors");
  }
  dispatch_vpt<max_vpt(kForward, false, VEC)>(plan.vpt, [&](auto vpt) { fn(vpt, std::false_type{}); });
}

inline size_t bwd_smem_bytes(const Plan& plan, int64_t h) { return plan.warp ? 0 : 3 * sizeof(float) * h; }

// Raises the kernel's dynamic shared-memory limit to `bytes` (fails with the CUDA error on a device with
// less, e.g. h > ~13900 on an A100). Set whenever dynamic memory is used, not only above 48 KiB: the default
// limit is 48 KiB minus the kernel's static shared memory (row_allreduce's), so h = 4096 (exactly 48 KiB of
// running sums) would otherwise fail to launch.
template <typename Kernel>
void allow_smem(Kernel kernel, size_t bytes) {
  if (bytes > 0)
    check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)),
               "bias_dropout_add_layer_norm shared memory");
}

// Resident blocks per SM of the backward kernel of `plan`.
template <typename T, int VEC>
int bwd_blocks_per_sm(const Plan& plan, int64_t h) {
  int blocks = 0;
  dispatch_plan<false, T, VEC>(plan, [&](auto vpt, auto warp) {
    const auto kernel = bwd_kernel<T, VEC, decltype(vpt)::value, decltype(warp)::value>;
    const size_t smem = bwd_smem_bytes(plan, h);
    allow_smem(kernel, smem);
    check_cuda(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, plan.tpr * plan.rpb, smem),
               "bias_dropout_add_layer_norm occupancy");
  });
  return std::max(blocks, 1);
}

// Calls fn(T{}, std::integral_constant<int, VEC>{}) for the activation dtype code; VEC = 16 bytes of T when
// `vectorized`, else kScalarRun (one dropout group, scalar accesses).
template <typename Fn>
void dispatch_type_vec(int dtype, bool vectorized, Fn&& fn) {
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    if (vectorized) {
      fn(tag, std::integral_constant<int, static_cast<int>(16 / sizeof(T))>{});
    } else {
      fn(tag, std::integral_constant<int, kScalarRun>{});
    }
  });
}

inline int elem_size(int dtype) { return dtype == kFloat32 ? 4 : 2; }

inline void check_sizes(int64_t h, int wdtype) {
  if (h <= 0 || h > kMaxHidden)
    throw std::invalid_argument("bias_dropout_add_layer_norm: hidden size " + std::to_string(h) +
                                " is outside the CUDA kernel's range [1, " + std::to_string(kMaxHidden) + "]");
  if (wdtype != kFloat32 && wdtype != kFloat16 && wdtype != kBFloat16)
    throw std::invalid_argument("bias_dropout_add_layer_norm: unsupported LayerNorm parameter dtype code " +
                                std::to_string(wdtype));
}

// vectorized = 16-byte accesses: every pointer 16-byte aligned (null allowed) and every row start too.
inline void check_aligned(bool vectorized, int64_t h, int dtype, std::initializer_list<uintptr_t> ptrs,
                          std::initializer_list<int64_t> strides) {
  if (!vectorized) return;
  const int vec = 16 / elem_size(dtype);
  bool ok = h % vec == 0;
  for (uintptr_t p : ptrs) ok = ok && p % 16 == 0;
  for (int64_t s : strides) ok = ok && s % vec == 0;
  if (!ok)
    throw std::invalid_argument("bias_dropout_add_layer_norm: vectorized=True needs 16-byte aligned pointers and "
                                "h and row strides divisible by " + std::to_string(vec));
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
  check_aligned(vectorized, h, dtype, {x, bias, residual, y, residual_out, ln_weight, ln_bias}, {stride_x, stride_res});
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
  dispatch_type_vec(dtype, vectorized, [&](auto tag, auto vec) {
    using T = decltype(tag);
    constexpr int kVec = decltype(vec)::value;
    const Plan plan = fwd_plan(h, kVec, kVectorRun<T, kVec>);
    dispatch_plan<true, T, kVec>(plan, [&](auto vpt, auto warp) {
      const dim3 block(plan.tpr, plan.rpb), grid(static_cast<unsigned>(cdiv(rows, plan.rpb)));
      fwd_kernel<T, kVec, decltype(vpt)::value, decltype(warp)::value><<<grid, block, 0, s>>>(a);
    });
  });
  check_cuda(cudaGetLastError(), "bias_dropout_add_layer_norm_fwd launch");
}

int64_t bias_dropout_add_layer_norm_bwd_partials(int64_t rows, int64_t h, int dtype, bool vectorized) {
  using namespace bdaln;
  check_sizes(h, kFloat32);
  if (rows <= 0) return 1;
  int device = 0, sms = 0, blocks_per_sm = 1, rpb = 1;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  check_cuda(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "SM count");
  dispatch_type_vec(dtype, vectorized, [&](auto tag, auto vec) {
    constexpr int kVec = decltype(vec)::value;
    const Plan plan = bwd_plan(h, kVec, kVectorRun<decltype(tag), kVec>);
    rpb = plan.rpb;
    blocks_per_sm = bwd_blocks_per_sm<decltype(tag), decltype(vec)::value>(plan, h);
  });
  // One wave of resident blocks, each writing one partial row: few partial rows, little reduction traffic.
  return std::max<int64_t>(1, std::min<int64_t>(cdiv(rows, rpb), static_cast<int64_t>(sms) * blocks_per_sm));
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
  check_aligned(vectorized, h, dtype, {grad_y, grad_residual_out, residual_out, grad_x, grad_residual, ln_weight}, {});
  const auto s = reinterpret_cast<cudaStream_t>(stream);
  float* part = reinterpret_cast<float*>(partials);  // [2 or 3, num_partials, h]: dw, db (, dbias)
  float* part_bias = grad_bias != 0 ? part + 2 * num_partials * h : nullptr;
  if (rows > 0) {
    const BwdArgs a{reinterpret_cast<const void*>(grad_y), reinterpret_cast<const void*>(grad_residual_out),
                    reinterpret_cast<const void*>(residual_out), reinterpret_cast<const void*>(ln_weight),
                    reinterpret_cast<const float*>(mean), reinterpret_cast<const float*>(rstd), wdtype,
                    reinterpret_cast<void*>(grad_x), reinterpret_cast<void*>(grad_residual), part,
                    part + num_partials * h, part_bias, rows, h, drop_scale(threshold),
                    static_cast<uint32_t>(threshold) << 24, seed, row_offset};
    dispatch_type_vec(dtype, vectorized, [&](auto tag, auto vec) {
      using T = decltype(tag);
      constexpr int kVec = decltype(vec)::value;
      const Plan plan = bwd_plan(h, kVec, kVectorRun<T, kVec>);
      dispatch_plan<false, T, kVec>(plan, [&](auto vpt, auto warp) {
        const auto kernel = bwd_kernel<T, kVec, decltype(vpt)::value, decltype(warp)::value>;
        const size_t smem = bwd_smem_bytes(plan, h);
        allow_smem(kernel, smem);
        kernel<<<static_cast<unsigned>(num_partials), dim3(plan.tpr, plan.rpb), smem, s>>>(a);
      });
    });
    check_cuda(cudaGetLastError(), "bias_dropout_add_layer_norm_bwd launch");
  } else {
    check_cuda(cudaMemsetAsync(part, 0, sizeof(float) * (grad_bias != 0 ? 3 : 2) * num_partials * h, s),
               "bias_dropout_add_layer_norm_bwd memset");
  }
  const dim3 block(kWarp, 8), grid(static_cast<unsigned>(cdiv(h, kWarp)), grad_bias != 0 ? 3 : 2);
  reduce_partials_kernel<<<grid, block, 0, s>>>(part, part + num_partials * h, part_bias,
                                                reinterpret_cast<float*>(grad_ln_weight),
                                                reinterpret_cast<float*>(grad_ln_bias),
                                                reinterpret_cast<float*>(grad_bias), num_partials, h);
  check_cuda(cudaGetLastError(), "bias_dropout_add_layer_norm reduce launch");
}

}  // namespace seqpar
