// Fused residual add + RMSNorm, forward and backward: the CUDA twin of triton_kernels/rms_norm.py (math
// and shapes in seqpar/ops/rms_norm.py).
//
//   residual_out = x + residual                       (rounded to T; no residual: residual_out is x)
//   rstd         = rsqrt(mean(residual_out^2) + eps)  fp32, of the rounded residual_out
//   y            = T(T(residual_out * rstd) * w)      HF LlamaRMSNorm: normalise, round, then scale
//   backward:      n = residual_out * rstd, g = dy * w
//                  dx = dresidual = rstd * (g - n * mean(g * n)) + dresidual_out;  dw = sum_rows(dy * n)
//                  (dresidual: the same values in a second tensor, written only when asked for)
//
// Layout (csrc/row_reduce.cuh): a thread owns VPT vectors of VEC elements (16 bytes, or VEC = 1 when
// pointers, h or strides do not allow it) of each column chunk of its row. Three kinds of kernel:
//   kWarp    warp per row (several rows per block), the row in registers, shuffle-only reductions;
//   kBlock   block per row, the row in registers; the forward's launch takes the most threads per row
//            (fewest vectors a thread, up to 4) that still leave two blocks resident per SM
//            (rows::resident_plan): h = 16384 in 2-byte types 512 threads x 4 vectors, not 1024 x 2 (44
//            registers: one block per SM);
//   kChunked (forward) block per row for rows longer than the threads' registers (any h is accepted): two
//            passes over the chunks, the earlier chunks re-read (residual_out was just written: mostly L2).
//
// Backward: a block sums dw over the rows it visits (one wave of blocks) and writes one fp32 partial row;
// reduce_partials_kernel sums the partial rows (no atomics: deterministic). Rows that fit a warp's or a
// block's registers (h <= 4096 with 16-byte vectors): a row per warp or block, its row sum mean(g * n) a
// reduction over it, the running sums in registers (kWarp blocks fold their row slots through shared
// memory at the end). Longer rows (the block plan would be kChunked): a row-sum pass (bwd_row_sums_kernel)
// writes each row's sum, then blocks of one column chunk each (bwd_columns_kernel, one vector per thread)
// stream the rows with no reduction, their running sums in registers: the LayerNorm backward's design
// (csrc/bias_dropout_add_layer_norm.cu). The row-sum pass reads grad_y and residual_out once more (5 tensor
// passes where 3 are the minimum, 6 where grad_residual_out makes it 4); it replaced a block per row whose
// sums lived in shared or global memory.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>

#include "dtypes.cuh"
#include "row_reduce.cuh"

namespace seqpar {
namespace rmsnorm {

using namespace rows;

constexpr int kFwdWarpRows = 4;             // rows per block of the warp-per-row forward (128 threads)
constexpr int kBwdWarpRows = 16;            // rows per block of the warp-per-row backward (512 threads)
constexpr int kBwdMaxThreads = 512;         // block-per-row backward: up to 128 registers per thread
constexpr int kFoldElements = 8;            // running sums folded per shared-memory round (kWarp backward)
constexpr int kRowSumThreads = 256;         // block of the row-sum pass (one row per block)
constexpr int kColumnThreads = 256;         // block of the column-chunk backward (one vector per thread)

// Vectors per thread per chunk, the most each kernel is instantiated for (ptxas -v: no spills at these).
// Forward: 4 (a thread of a 1024-thread block has 64 registers; a warp-per-row lane with 8 vectors spills
// for fp16 although it may use 255). Backward, running sums in registers: at most 4 vectors per thread, and
// 16 elements per lane of a warp per row, 8 per thread of a block per row (h <= 4096 with 16-byte vectors,
// as the LayerNorm backward: a 512-thread block holding 16 took 84-110 registers, one block per SM, whose
// row reductions left the SM idle); a longer row takes the column-chunk backward.
constexpr int fwd_max_vpt(RowKind) { return 4; }
constexpr int bwd_max_vpt(RowKind kind, int vec) { return std::min(4, (kind == RowKind::kWarp ? 16 : 8) / vec); }

struct FwdArgs {
  const void* x;
  const void* residual;  // nullptr: no residual (residual_out is x, nothing is written for it)
  const void* w;
  void* y;               // [rows, h] contiguous
  void* residual_out;    // [rows, h] contiguous; nullptr iff residual is
  float* rstd;
  int wdtype;            // dtype code of w
  int64_t rows, h, stride_x, stride_res;
  float eps;
};

struct BwdArgs {
  const void* grad_y;             // [rows, h] contiguous
  const void* grad_residual_out;  // [rows, h] contiguous; nullptr: no gradient reached residual_out
  const void* residual_out;       // row stride stride_ro
  const void* w;
  const float* rstd;
  void* grad_x;                   // [rows, h] contiguous
  void* grad_residual;            // [rows, h] contiguous, the same values; nullptr: not wanted
  float* part_w;                  // [num_partials, h]; row p: block p (bwd_columns_kernel: row block p)
  int wdtype;
  int64_t rows, h, stride_ro;
};

template <RowKind KIND>
constexpr int threads_bound(bool forward) {
  if (KIND == RowKind::kWarp) return kWarp * (forward ? kFwdWarpRows : kBwdWarpRows);
  return forward ? kMaxThreads : kBwdMaxThreads;
}

template <typename T, int VEC, int VPT, RowKind KIND>
__global__ void __launch_bounds__(threads_bound<KIND>(true)) fwd_kernel(const FwdArgs a, const int64_t chunks_arg) {
  constexpr bool kWarpRow = KIND == RowKind::kWarp;
  const int64_t chunks = KIND == RowKind::kChunked ? chunks_arg : 1;
  const int tpr = kWarpRow ? kWarp : blockDim.x;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (kWarpRow ? kFwdWarpRows : 1) + threadIdx.y;
  if (kWarpRow && row >= a.rows) return;  // block rows always exist (grid = rows)
  const int64_t nvec = a.h / VEC, chunk_vecs = static_cast<int64_t>(tpr) * VPT;
  const bool has_res = a.residual != nullptr;
  const T* x = static_cast<const T*>(a.x) + row * a.stride_x;
  const T* res = has_res ? static_cast<const T*>(a.residual) + row * a.stride_res : nullptr;
  T* res_out = has_res ? static_cast<T*>(a.residual_out) + row * a.h : nullptr;

  Pack<T, VEC> r[VPT];  // residual_out of the current chunk, rounded to T: backward sees exactly these
  float ss[1] = {0.0f};
  for (int64_t c = 0; c < chunks; ++c) {
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int64_t j = c * chunk_vecs + threadIdx.x + static_cast<int64_t>(k) * tpr;
      if (j < nvec) {
        r[k] = load_pack<T, VEC>(x + j * VEC);
        if (has_res) {
          const Pack<T, VEC> rv = load_pack<T, VEC>(res + j * VEC);
#pragma unroll
          for (int i = 0; i < VEC; ++i) r[k].v[i] = from_float<T>(__fadd_rn(to_float(r[k].v[i]), to_float(rv.v[i])));
          store_pack<T, VEC>(res_out + j * VEC, r[k]);
        }
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          const float v = to_float(r[k].v[i]);
          ss[0] += v * v;
        }
      }
    }
  }
  row_allreduce<kWarpRow>(ss);
  const float rstd = rsqrtf(ss[0] / static_cast<float>(a.h) + a.eps);
  if (threadIdx.x == 0) a.rstd[row] = rstd;
  const T* stored = has_res ? res_out : x;  // where chunked rows re-read residual_out's values from
  T* y = static_cast<T*>(a.y) + row * a.h;
  // Backwards over the chunks: the last one is still in registers.
  for (int64_t c = chunks - 1; c >= 0; --c) {
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int64_t j = c * chunk_vecs + threadIdx.x + static_cast<int64_t>(k) * tpr;
      if (j < nvec) {
        if (KIND == RowKind::kChunked && c != chunks - 1) r[k] = load_pack<T, VEC>(stored + j * VEC);
        float wv[VEC];
        load_params<VEC>(a.w, j * VEC, a.h, true, a.wdtype, wv);
        Pack<T, VEC> out;
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          const float n = to_float(from_float<T>(to_float(r[k].v[i]) * rstd));  // HF: round, then scale
          out.v[i] = from_float<T>(n * wv[i]);
        }
        store_pack<T, VEC>(y + j * VEC, out);
      }
    }
  }
}

template <typename T, int VEC, int VPT, RowKind KIND>
__global__ void __launch_bounds__(threads_bound<KIND>(false), bwd_min_blocks(KIND, VPT * VEC))
    bwd_kernel(const BwdArgs a) {
  static_assert(KIND != RowKind::kChunked, "longer rows take bwd_columns_kernel");
  constexpr bool kWarpRow = KIND == RowKind::kWarp;
  const int tpr = kWarpRow ? kWarp : blockDim.x;
  const int rpb = kWarpRow ? kBwdWarpRows : 1;
  const int64_t nvec = a.h / VEC;
  const bool has_gro = a.grad_residual_out != nullptr;

  float acc[VPT][VEC];  // running dw of the thread's columns
#pragma unroll
  for (int k = 0; k < VPT; ++k)
#pragma unroll
    for (int i = 0; i < VEC; ++i) acc[k][i] = 0.0f;

  // Grid-stride over groups of rpb rows; the trip count is uniform across the block.
  const int64_t stride = static_cast<int64_t>(gridDim.x) * rpb;
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * rpb; base < a.rows; base += stride) {
    const int64_t row = base + threadIdx.y;
    if (kWarpRow && row >= a.rows) break;  // warps never synchronise inside the loop
    const float rstd = a.rstd[row];
    const T* ro = static_cast<const T*>(a.residual_out) + row * a.stride_ro;
    const T* gy = static_cast<const T*>(a.grad_y) + row * a.h;
    const T* gro = has_gro ? static_cast<const T*>(a.grad_residual_out) + row * a.h : nullptr;
    // The row is held in registers with grad_residual_out: all of the row's reads are in flight before
    // the block-wide reduction, rather than a second memory round trip after it.
    Pack<T, VEC> rv[VPT], gv[VPT], ov[VPT];
    float dot[1] = {0.0f};  // sum(g * n)
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int64_t j = threadIdx.x + static_cast<int64_t>(k) * tpr;
      if (j < nvec) {
        rv[k] = load_pack<T, VEC>(ro + j * VEC);
        gv[k] = load_pack<T, VEC>(gy + j * VEC);
        if (has_gro) ov[k] = load_pack<T, VEC>(gro + j * VEC);
        float wv[VEC];
        load_params<VEC>(a.w, j * VEC, a.h, true, a.wdtype, wv);
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          const float n = to_float(rv[k].v[i]) * rstd;
          const float dy = to_float(gv[k].v[i]);
          dot[0] += dy * wv[i] * n;
          acc[k][i] += dy * n;
        }
      }
    }
    row_allreduce<kWarpRow>(dot);
    const float mean_gn = dot[0] / static_cast<float>(a.h);
    T* gx = static_cast<T*>(a.grad_x) + row * a.h;
    T* gres = a.grad_residual != nullptr ? static_cast<T*>(a.grad_residual) + row * a.h : nullptr;
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int64_t j = threadIdx.x + static_cast<int64_t>(k) * tpr;
      if (j < nvec) {
        float wv[VEC];
        load_params<VEC>(a.w, j * VEC, a.h, true, a.wdtype, wv);
        Pack<T, VEC> out;
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          const float n = to_float(rv[k].v[i]) * rstd;
          const float g = to_float(gv[k].v[i]) * wv[i];
          const float go = has_gro ? to_float(ov[k].v[i]) : 0.0f;
          out.v[i] = from_float<T>(rstd * (g - n * mean_gn) + go);
        }
        store_pack<T, VEC>(gx + j * VEC, out);
        if (gres != nullptr) store_pack<T, VEC>(gres + j * VEC, out);
      }
    }
  }

  if (a.part_w == nullptr) return;  // a frozen weight: no dw (uniform, so no barrier below is left waiting)
  float* const part = a.part_w + static_cast<int64_t>(blockIdx.x) * a.h;
  constexpr int E = VPT * VEC;  // running sums per thread
  if constexpr (kWarpRow) {
    // Fold the rpb row slots into slot 0, kFoldElements sums per round through shared memory.
    constexpr int G = E < kFoldElements ? E : kFoldElements;
    __shared__ float fold[kBwdWarpRows - 1][G][kWarp];
#pragma unroll
    for (int e0 = 0; e0 < E; e0 += G) {
      __syncthreads();  // the previous round's readers are done
      if (threadIdx.y > 0) {
#pragma unroll
        for (int e = 0; e < G; ++e) fold[threadIdx.y - 1][e][threadIdx.x] = acc[(e0 + e) / VEC][(e0 + e) % VEC];
      }
      __syncthreads();
      if (threadIdx.y == 0) {
        for (unsigned s = 0; s + 1 < blockDim.y; ++s) {
#pragma unroll
          for (int e = 0; e < G; ++e) acc[(e0 + e) / VEC][(e0 + e) % VEC] += fold[s][e][threadIdx.x];
        }
      }
    }
    if (threadIdx.y != 0) return;
  }
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
    const int64_t j = threadIdx.x + static_cast<int64_t>(k) * tpr;
    if (j < nvec) {
      Pack<float, VEC> pk;
#pragma unroll
      for (int i = 0; i < VEC; ++i) pk.v[i] = acc[k][i];
      store_pack<float, VEC>(part + j * VEC, pk);
    }
  }
}

// Rows too long for one block's registers: the row sums first (bwd_row_sums_kernel: one block of
// kRowSumThreads per row writes row_sums[row] = sum(g * n), row_sums: [rows] fp32), then
// bwd_columns_kernel: block (x, y) owns vector x * kColumnThreads + threadIdx.x of the rows y, y + gridDim.y,
// ...: no reduction and no barrier in its loop, its columns' running dw in registers, written at the end
// as its columns of partial row y. Column chunks go in gridDim.x, the few row blocks (one wave) in gridDim.y.
template <typename T, int VEC>
__global__ void __launch_bounds__(kRowSumThreads) bwd_row_sums_kernel(const BwdArgs a, float* row_sums) {
  const int64_t row = blockIdx.x, nvec = a.h / VEC;
  const float rstd = a.rstd[row];
  const T* ro = static_cast<const T*>(a.residual_out) + row * a.stride_ro;
  const T* gy = static_cast<const T*>(a.grad_y) + row * a.h;
  float dot[1] = {0.0f};
#pragma unroll 4
  for (int64_t j = threadIdx.x; j < nvec; j += blockDim.x) {
    const Pack<T, VEC> rk = load_pack<T, VEC>(ro + j * VEC), gk = load_pack<T, VEC>(gy + j * VEC);
    float wv[VEC];
    load_params<VEC>(a.w, j * VEC, a.h, true, a.wdtype, wv);
#pragma unroll
    for (int i = 0; i < VEC; ++i) dot[0] += to_float(gk.v[i]) * wv[i] * (to_float(rk.v[i]) * rstd);
  }
  row_allreduce<false>(dot);
  if (threadIdx.x == 0) row_sums[row] = dot[0];
}

template <typename T, int VEC>
__global__ void __launch_bounds__(kColumnThreads) bwd_columns_kernel(const BwdArgs a, const float* row_sums) {
  const int64_t nvec = a.h / VEC;
  const int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= nvec) return;  // no barrier below: a thread past the row just leaves
  const bool has_gro = a.grad_residual_out != nullptr;
  const float inv_h = 1.0f / static_cast<float>(a.h);
  float wv[VEC], acc[VEC];
  load_params<VEC>(a.w, j * VEC, a.h, true, a.wdtype, wv);
#pragma unroll
  for (int i = 0; i < VEC; ++i) acc[i] = 0.0f;
  for (int64_t row = blockIdx.y; row < a.rows; row += gridDim.y) {
    const float rstd = a.rstd[row], mean_gn = row_sums[row] * inv_h;
    const Pack<T, VEC> rv = load_pack<T, VEC>(static_cast<const T*>(a.residual_out) + row * a.stride_ro + j * VEC);
    const Pack<T, VEC> gv = load_pack<T, VEC>(static_cast<const T*>(a.grad_y) + row * a.h + j * VEC);
    Pack<T, VEC> ov;
    if (has_gro) ov = load_pack<T, VEC>(static_cast<const T*>(a.grad_residual_out) + row * a.h + j * VEC);
    Pack<T, VEC> out;
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      const float n = to_float(rv.v[i]) * rstd;
      const float dy = to_float(gv.v[i]);
      const float go = has_gro ? to_float(ov.v[i]) : 0.0f;
      out.v[i] = from_float<T>(rstd * (dy * wv[i] - n * mean_gn) + go);
      acc[i] += dy * n;
    }
    store_pack<T, VEC>(static_cast<T*>(a.grad_x) + row * a.h + j * VEC, out);
    if (a.grad_residual != nullptr) store_pack<T, VEC>(static_cast<T*>(a.grad_residual) + row * a.h + j * VEC, out);
  }
  if (a.part_w == nullptr) return;  // a frozen weight: no dw
  Pack<float, VEC> pk;
#pragma unroll
  for (int i = 0; i < VEC; ++i) pk.v[i] = acc[i];
  store_pack<float, VEC>(a.part_w + static_cast<int64_t>(blockIdx.y) * a.h + j * VEC, pk);
}

// ---------------------------------------------------------------------------------------------- launch
// A block per row here has the fewest vectors per thread that cover the row; the launch may take more
// (fwd_candidates, resident_plan).
inline Plan fwd_plan(int64_t h, int vec) {
  const int64_t nvec = h / vec;
  if (nvec <= static_cast<int64_t>(kWarp) * fwd_max_vpt(RowKind::kWarp)) return warp_plan(nvec, kFwdWarpRows);
  return block_plan(nvec, kMaxThreads, fwd_max_vpt(RowKind::kBlock), fwd_max_vpt(RowKind::kChunked));
}

// The plans the forward's launch chooses from (tests/cuda_emulation runs every one).
inline std::vector<Plan> fwd_candidates(int64_t h, int vec) {
  return plan_candidates(fwd_plan(h, vec), h / vec, fwd_max_vpt(RowKind::kBlock));
}

// kChunked: the row does not fit a block's registers, and takes the row-sum pass + column-chunk blocks.
inline Plan bwd_plan(int64_t h, int vec) {
  const int64_t nvec = h / vec;
  if (nvec <= static_cast<int64_t>(kWarp) * bwd_max_vpt(RowKind::kWarp, vec)) return warp_plan(nvec, kBwdWarpRows);
  const int block_vpt = bwd_max_vpt(RowKind::kBlock, vec);
  return block_plan(nvec, kBwdMaxThreads, block_vpt, block_vpt);
}

inline int64_t column_chunks(int64_t h, int vec) { return cdiv(h / vec, kColumnThreads); }

// Calls fn(std::integral_constant<int, VPT>{}, std::integral_constant<RowKind, KIND>{}) for the kernel of
// `plan`; only VPT up to the kind's maximum are instantiated (kChunked, forward only: exactly its maximum).
template <bool kForward, int VEC, typename Fn>
void dispatch_plan(const Plan& plan, Fn&& fn) {
  using Warp = std::integral_constant<RowKind, RowKind::kWarp>;
  using Block = std::integral_constant<RowKind, RowKind::kBlock>;
  using Chunked = std::integral_constant<RowKind, RowKind::kChunked>;
  constexpr int kWarpMax = kForward ? fwd_max_vpt(RowKind::kWarp) : bwd_max_vpt(RowKind::kWarp, VEC);
  constexpr int kBlockMax = kForward ? fwd_max_vpt(RowKind::kBlock) : bwd_max_vpt(RowKind::kBlock, VEC);
  switch (plan.kind) {
    case RowKind::kWarp: dispatch_vpt<kWarpMax>(plan.vpt, [&](auto vpt) { fn(vpt, Warp{}); }); return;
    case RowKind::kBlock: dispatch_vpt<kBlockMax>(plan.vpt, [&](auto vpt) { fn(vpt, Block{}); }); return;
    case RowKind::kChunked:
      if constexpr (kForward) {
        constexpr int kChunkVpt = fwd_max_vpt(RowKind::kChunked);
        if (plan.vpt != kChunkVpt) break;
        fn(std::integral_constant<int, kChunkVpt>{}, Chunked{});
        return;
      }
      break;
  }
  throw std::logic_error("add_rms_norm: no kernel instantiated for this plan");
}

inline void check_args(int64_t h, int wdtype) {
  if (h <= 0 || h >= (int64_t(1) << 31))
    throw std::invalid_argument("add_rms_norm: hidden size " + std::to_string(h) + " must be in [1, 2**31)");
  if (wdtype != kFloat32 && wdtype != kFloat16 && wdtype != kBFloat16)
    throw std::invalid_argument("add_rms_norm: unsupported weight dtype code " + std::to_string(wdtype));
}

constexpr const char* kOccupancy = "add_rms_norm occupancy";

// Resident blocks per SM of the forward kernel of `plan`.
template <typename T, int VEC>
int fwd_blocks_per_sm(const Plan& plan) {
  int blocks = 0;
  dispatch_plan<true, VEC>(plan, [&](auto vpt, auto kind) {
    const auto kernel = fwd_kernel<T, VEC, decltype(vpt)::value, decltype(kind)::value>;
    blocks = resident_blocks(kernel, plan.tpr * plan.rpb, 0, kOccupancy);
  });
  return blocks;
}

// The forward's launch plan for rows of h columns on the current device: resident_plan over fwd_candidates.
template <typename T, int VEC>
Plan fwd_launch_plan(int64_t h) {
  return memo_plan<std::tuple<FwdArgs, T, std::integral_constant<int, VEC>>>(h, [h] {
    return resident_plan(fwd_plan(h, VEC), h / VEC, fwd_max_vpt(RowKind::kBlock), fwd_blocks_per_sm<T, VEC>);
  });
}

// Resident blocks per SM of the backward kernel of `plan` (kChunked: of bwd_columns_kernel).
template <typename T, int VEC>
int bwd_blocks_per_sm(const Plan& plan) {
  if (plan.kind == RowKind::kChunked)
    return std::max(resident_blocks(bwd_columns_kernel<T, VEC>, kColumnThreads, 0, kOccupancy), 1);
  int blocks = 0;
  dispatch_plan<false, VEC>(plan, [&](auto vpt, auto kind) {
    const auto kernel = bwd_kernel<T, VEC, decltype(vpt)::value, decltype(kind)::value>;
    blocks = resident_blocks(kernel, plan.tpr * plan.rpb, 0, kOccupancy);
  });
  return std::max(blocks, 1);
}

}  // namespace rmsnorm

// The entry points launch with <<<>>>, which needs nvcc: host emulation (tests/cuda_emulation, g++) stops here.
#if !defined(SEQPAR_HOST_EMULATION)

void add_rms_norm_fwd(uintptr_t x, uintptr_t residual, uintptr_t weight, uintptr_t y, uintptr_t residual_out,
                      uintptr_t rstd, int64_t rows, int64_t h, int64_t stride_x, int64_t stride_res, int dtype,
                      int wdtype, bool vectorized, float eps, uintptr_t stream) {
  using namespace rmsnorm;
  check_args(h, wdtype);
  check_aligned("add_rms_norm", vectorized, h, dtype, {x, residual, weight, y, residual_out}, {stride_x, stride_res});
  if ((residual == 0) != (residual_out == 0))
    throw std::invalid_argument("add_rms_norm: residual and residual_out must both be given or both be 0");
  if (rows == 0) return;
  if (rows >= (int64_t(1) << 31)) throw std::invalid_argument("add_rms_norm: rows must be < 2**31");
  const FwdArgs a{reinterpret_cast<const void*>(x), reinterpret_cast<const void*>(residual),
                  reinterpret_cast<const void*>(weight), reinterpret_cast<void*>(y),
                  reinterpret_cast<void*>(residual_out), reinterpret_cast<float*>(rstd), wdtype, rows, h,
                  stride_x, stride_res, eps};
  const auto s = reinterpret_cast<cudaStream_t>(stream);
  dispatch_type_vec(dtype, vectorized, [&](auto tag, auto vec) {
    using T = decltype(tag);
    constexpr int kVec = decltype(vec)::value;
    const Plan plan = fwd_launch_plan<T, kVec>(h);
    dispatch_plan<true, kVec>(plan, [&](auto vpt, auto kind) {
      const dim3 block(plan.tpr, plan.rpb), grid(static_cast<unsigned>(cdiv(rows, plan.rpb)));
      fwd_kernel<T, kVec, decltype(vpt)::value, decltype(kind)::value><<<grid, block, 0, s>>>(a, plan.chunks);
    });
  });
  check_cuda(cudaGetLastError(), "add_rms_norm_fwd launch");
}

rows::PlanInfo add_rms_norm_fwd_plan(int64_t h, int dtype, bool vectorized) {
  using namespace rmsnorm;
  check_args(h, kFloat32);
  check_aligned("add_rms_norm", vectorized, h, dtype, {}, {});  // h a whole number of 16-byte vectors
  PlanInfo info;
  dispatch_type_vec(dtype, vectorized, [&](auto tag, auto vec) {
    using T = decltype(tag);
    constexpr int kVec = decltype(vec)::value;
    const Plan plan = fwd_launch_plan<T, kVec>(h);
    info = plan_info(plan, fwd_blocks_per_sm<T, kVec>(plan));
  });
  return info;
}

int64_t add_rms_norm_bwd_partials(int64_t rows, int64_t h, int dtype, bool vectorized) {
  using namespace rmsnorm;
  check_args(h, kFloat32);
  if (rows <= 0) return 1;
  const DeviceInfo dev = device_info();
  int rpb = 1, blocks_per_sm = 1;
  int64_t chunks = 1;  // the column chunks share the wave
  dispatch_type_vec(dtype, vectorized, [&](auto tag, auto vec) {
    constexpr int kVec = decltype(vec)::value;
    const Plan plan = bwd_plan(h, kVec);
    rpb = plan.rpb;
    if (plan.kind == RowKind::kChunked) chunks = column_chunks(h, kVec);
    blocks_per_sm = bwd_blocks_per_sm<decltype(tag), kVec>(plan);
  });
  // One wave of resident blocks, each writing one partial row: few partial rows, little reduction traffic.
  const int64_t wave = static_cast<int64_t>(dev.sms) * blocks_per_sm / chunks;
  return std::max<int64_t>(1, std::min<int64_t>(cdiv(rows, rpb), wave));
}

void add_rms_norm_bwd(uintptr_t grad_y, uintptr_t grad_residual_out, uintptr_t residual_out, int64_t stride_ro,
                      uintptr_t weight, uintptr_t rstd, uintptr_t grad_x, uintptr_t grad_residual, uintptr_t partials,
                      int64_t num_partials, uintptr_t row_sums, uintptr_t grad_weight, int64_t rows, int64_t h,
                      int dtype, int wdtype, bool vectorized, uintptr_t stream) {
  using namespace rmsnorm;
  check_args(h, wdtype);
  if (num_partials < 1) throw std::invalid_argument("add_rms_norm: num_partials must be >= 1");
  check_aligned("add_rms_norm", vectorized, h, dtype,
                {grad_y, grad_residual_out, residual_out, weight, grad_x, grad_residual, partials}, {stride_ro});
  const auto s = reinterpret_cast<cudaStream_t>(stream);
  // [num_partials, h]; none (nullptr) for a frozen weight (grad_weight 0): no dw, no reduction
  float* part = grad_weight != 0 ? reinterpret_cast<float*>(partials) : nullptr;
  if (rows > 0) {
    const BwdArgs a{reinterpret_cast<const void*>(grad_y), reinterpret_cast<const void*>(grad_residual_out),
                    reinterpret_cast<const void*>(residual_out), reinterpret_cast<const void*>(weight),
                    reinterpret_cast<const float*>(rstd), reinterpret_cast<void*>(grad_x),
                    reinterpret_cast<void*>(grad_residual), part, wdtype, rows, h, stride_ro};
    dispatch_type_vec(dtype, vectorized, [&](auto tag, auto vec) {
      using T = decltype(tag);
      constexpr int kVec = decltype(vec)::value;
      const Plan plan = bwd_plan(h, kVec);
      if (plan.kind == RowKind::kChunked) {
        if (row_sums == 0)
          throw std::invalid_argument("add_rms_norm: rows of h = " + std::to_string(h) +
                                      " need the [rows] fp32 row_sums workspace");
        if (rows >= (int64_t(1) << 31) || num_partials > 65535)  // gridDim.x of the row-sum pass, gridDim.y
          throw std::invalid_argument("add_rms_norm: rows must be < 2**31 and num_partials <= 65535");
        float* sums_of_rows = reinterpret_cast<float*>(row_sums);
        bwd_row_sums_kernel<T, kVec><<<static_cast<unsigned>(rows), kRowSumThreads, 0, s>>>(a, sums_of_rows);
        const dim3 grid(static_cast<unsigned>(column_chunks(h, kVec)), static_cast<unsigned>(num_partials));
        bwd_columns_kernel<T, kVec><<<grid, kColumnThreads, 0, s>>>(a, sums_of_rows);
        return;
      }
      dispatch_plan<false, kVec>(plan, [&](auto vpt, auto kind) {
        bwd_kernel<T, kVec, decltype(vpt)::value, decltype(kind)::value>
            <<<static_cast<unsigned>(num_partials), dim3(plan.tpr, plan.rpb), 0, s>>>(a);
      });
    });
    check_cuda(cudaGetLastError(), "add_rms_norm_bwd launch");
  } else if (part != nullptr) {
    check_cuda(cudaMemsetAsync(part, 0, sizeof(float) * num_partials * h, s), "add_rms_norm_bwd memset");
  }
  if (part == nullptr) return;
  const PartialSums sums{{part, nullptr, nullptr}, {reinterpret_cast<float*>(grad_weight), nullptr, nullptr}};
  launch_reduce_partials(sums, 1, num_partials, h, s, "add_rms_norm reduce launch");
}

#endif  // !SEQPAR_HOST_EMULATION

}  // namespace seqpar
