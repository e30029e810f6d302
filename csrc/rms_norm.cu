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
//   kBlock   block per row, the row in registers;
//   kChunked block per row for rows longer than the threads' registers (any h is accepted): two passes
//            over the chunks, the earlier chunks re-read (residual_out was just written: mostly from L2).
//
// Backward: the block sums dw over the rows it visits (a grid-stride loop, one wave of blocks) and writes
// one fp32 partial row; reduce_partials_kernel sums the partial rows (no atomics: deterministic). The
// running sums live in registers (kWarp blocks fold their row slots through shared memory at the end),
// or for kChunked in dynamic shared memory (h floats), or, for rows too long for shared memory, in the
// block's own partial row in global memory (no other block touches it).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
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
constexpr int kStaticSmemSlack = 8 * 1024;  // static shared memory of the kernels, generously

// Vectors per thread per chunk, the most each kernel is instantiated for (ptxas -v: no spills at these).
// Forward: 4 (a thread of a 1024-thread block has 64 registers; a warp-per-row lane with 8 vectors spills
// for fp16 although it may use 255). Backward with running sums in registers: at most 16 elements and 4
// vectors per thread (the row and the gradient are held as well); kChunked keeps its sums in memory and
// holds 4 vectors.
constexpr int fwd_max_vpt(RowKind) { return 4; }
constexpr int bwd_max_vpt(RowKind kind, int vec) { return kind == RowKind::kChunked ? 4 : std::min(4, 16 / vec); }

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
  float* part_w;                  // [num_partials, h]; row blockIdx.x belongs to block blockIdx.x
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
    bwd_kernel(const BwdArgs a, const int64_t chunks_arg, const bool smem_sums) {
  constexpr bool kWarpRow = KIND == RowKind::kWarp, kChunked = KIND == RowKind::kChunked;
  const int64_t chunks = kChunked ? chunks_arg : 1;
  const int tpr = kWarpRow ? kWarp : blockDim.x;
  const int rpb = kWarpRow ? kBwdWarpRows : 1;
  const int64_t nvec = a.h / VEC, chunk_vecs = static_cast<int64_t>(tpr) * VPT;
  const bool has_gro = a.grad_residual_out != nullptr;
  float* const part = a.part_w + static_cast<int64_t>(blockIdx.x) * a.h;

  // Running dw: registers, or (kChunked) memory where thread t owns the columns of its vectors.
  float acc[kChunked ? 1 : VPT][VEC];
  float* acc_mem = nullptr;
  if constexpr (kChunked) {
    extern __shared__ float4 dynamic_smem[];
    acc_mem = smem_sums ? reinterpret_cast<float*>(dynamic_smem) : part;
    for (int64_t j = threadIdx.x; j < nvec; j += tpr) {
#pragma unroll
      for (int i = 0; i < VEC; ++i) acc_mem[j * VEC + i] = 0.0f;
    }
  } else {
#pragma unroll
    for (int k = 0; k < VPT; ++k)
#pragma unroll
      for (int i = 0; i < VEC; ++i) acc[k][i] = 0.0f;
  }

  // Grid-stride over groups of rpb rows; the trip count is uniform across the block.
  const int64_t stride = static_cast<int64_t>(gridDim.x) * rpb;
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * rpb; base < a.rows; base += stride) {
    const int64_t row = base + threadIdx.y;
    if (kWarpRow && row >= a.rows) break;  // warps never synchronise inside the loop
    const float rstd = a.rstd[row];
    const T* ro = static_cast<const T*>(a.residual_out) + row * a.stride_ro;
    const T* gy = static_cast<const T*>(a.grad_y) + row * a.h;
    const T* gro = has_gro ? static_cast<const T*>(a.grad_residual_out) + row * a.h : nullptr;
    // A row held in registers has grad_residual_out loaded with it: all of the row's reads are in flight
    // before the block-wide reduction, rather than a second memory round trip after it.
    Pack<T, VEC> rv[VPT], gv[VPT], ov[kChunked ? 1 : VPT];
    float dot[1] = {0.0f};  // sum(g * n)
    for (int64_t c = 0; c < chunks; ++c) {
#pragma unroll
      for (int k = 0; k < VPT; ++k) {
        const int64_t j = c * chunk_vecs + threadIdx.x + static_cast<int64_t>(k) * tpr;
        if (j < nvec) {
          rv[k] = load_pack<T, VEC>(ro + j * VEC);
          gv[k] = load_pack<T, VEC>(gy + j * VEC);
          if constexpr (!kChunked) {
            if (has_gro) ov[k] = load_pack<T, VEC>(gro + j * VEC);
          }
          float wv[VEC], dw[VEC];
          load_params<VEC>(a.w, j * VEC, a.h, true, a.wdtype, wv);
#pragma unroll
          for (int i = 0; i < VEC; ++i) {
            const float n = to_float(rv[k].v[i]) * rstd;
            const float dy = to_float(gv[k].v[i]);
            dot[0] += dy * wv[i] * n;
            dw[i] = dy * n;
          }
          if constexpr (kChunked) {
            float* p = acc_mem + j * VEC;  // 16-byte aligned for VEC > 1: h % VEC == 0, aligned buffers
            Pack<float, VEC> cur = load_pack<float, VEC>(p);
#pragma unroll
            for (int i = 0; i < VEC; ++i) cur.v[i] += dw[i];
            store_pack<float, VEC>(p, cur);
          } else {
#pragma unroll
            for (int i = 0; i < VEC; ++i) acc[k][i] += dw[i];
          }
        }
      }
    }
    row_allreduce<kWarpRow>(dot);
    const float mean_gn = dot[0] / static_cast<float>(a.h);
    T* gx = static_cast<T*>(a.grad_x) + row * a.h;
    T* gres = a.grad_residual != nullptr ? static_cast<T*>(a.grad_residual) + row * a.h : nullptr;
    for (int64_t c = chunks - 1; c >= 0; --c) {  // the last chunk is still in registers
#pragma unroll
      for (int k = 0; k < VPT; ++k) {
        const int64_t j = c * chunk_vecs + threadIdx.x + static_cast<int64_t>(k) * tpr;
        if (j < nvec) {
          if (kChunked && c != chunks - 1) {
            rv[k] = load_pack<T, VEC>(ro + j * VEC);
            gv[k] = load_pack<T, VEC>(gy + j * VEC);
          }
          float wv[VEC], go[VEC];
          load_params<VEC>(a.w, j * VEC, a.h, true, a.wdtype, wv);
          if (has_gro) {
            const Pack<T, VEC> o = kChunked ? load_pack<T, VEC>(gro + j * VEC) : ov[kChunked ? 0 : k];
#pragma unroll
            for (int i = 0; i < VEC; ++i) go[i] = to_float(o.v[i]);
          } else {
#pragma unroll
            for (int i = 0; i < VEC; ++i) go[i] = 0.0f;
          }
          Pack<T, VEC> out;
#pragma unroll
          for (int i = 0; i < VEC; ++i) {
            const float n = to_float(rv[k].v[i]) * rstd;
            const float g = to_float(gv[k].v[i]) * wv[i];
            out.v[i] = from_float<T>(rstd * (g - n * mean_gn) + go[i]);
          }
          store_pack<T, VEC>(gx + j * VEC, out);
          if (gres != nullptr) store_pack<T, VEC>(gres + j * VEC, out);
        }
      }
    }
  }

  if constexpr (kChunked) {
    if (smem_sums) {
      for (int64_t j = threadIdx.x; j < nvec; j += tpr) {
#pragma unroll
        for (int i = 0; i < VEC; ++i) part[j * VEC + i] = acc_mem[j * VEC + i];
      }
    }  // else the sums already are the partial row
  } else {
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
}

// ---------------------------------------------------------------------------------------------- launch
inline Plan fwd_plan(int64_t h, int vec) {
  const int64_t nvec = h / vec;
  if (nvec <= static_cast<int64_t>(kWarp) * fwd_max_vpt(RowKind::kWarp)) return warp_plan(nvec, kFwdWarpRows);
  return block_plan(nvec, kMaxThreads, fwd_max_vpt(RowKind::kBlock), fwd_max_vpt(RowKind::kChunked));
}

inline Plan bwd_plan(int64_t h, int vec) {
  const int64_t nvec = h / vec;
  if (nvec <= static_cast<int64_t>(kWarp) * bwd_max_vpt(RowKind::kWarp, vec)) return warp_plan(nvec, kBwdWarpRows);
  return block_plan(nvec, kBwdMaxThreads, bwd_max_vpt(RowKind::kBlock, vec), bwd_max_vpt(RowKind::kChunked, vec));
}

// Calls fn(std::integral_constant<int, VPT>{}, std::integral_constant<RowKind, KIND>{}) for the kernel of
// `plan`; only VPT up to the kind's maximum are instantiated (kChunked: exactly its maximum).
template <bool kForward, int VEC, typename Fn>
void dispatch_plan(const Plan& plan, Fn&& fn) {
  using Warp = std::integral_constant<RowKind, RowKind::kWarp>;
  using Block = std::integral_constant<RowKind, RowKind::kBlock>;
  using Chunked = std::integral_constant<RowKind, RowKind::kChunked>;
  constexpr int kWarpMax = kForward ? fwd_max_vpt(RowKind::kWarp) : bwd_max_vpt(RowKind::kWarp, VEC);
  constexpr int kBlockMax = kForward ? fwd_max_vpt(RowKind::kBlock) : bwd_max_vpt(RowKind::kBlock, VEC);
  constexpr int kChunkVpt = kForward ? fwd_max_vpt(RowKind::kChunked) : bwd_max_vpt(RowKind::kChunked, VEC);
  switch (plan.kind) {
    case RowKind::kWarp: dispatch_vpt<kWarpMax>(plan.vpt, [&](auto vpt) { fn(vpt, Warp{}); }); return;
    case RowKind::kBlock: dispatch_vpt<kBlockMax>(plan.vpt, [&](auto vpt) { fn(vpt, Block{}); }); return;
    case RowKind::kChunked:
      if (plan.vpt != kChunkVpt) break;
      fn(std::integral_constant<int, kChunkVpt>{}, Chunked{});
      return;
  }
  throw std::logic_error("add_rms_norm: no kernel instantiated for this plan");
}

// Running sums of a chunked backward row in shared memory when they fit (h floats), else in global memory.
inline size_t bwd_smem_bytes(const Plan& plan, int64_t h, const DeviceInfo& dev) {
  const size_t bytes = sizeof(float) * static_cast<size_t>(h);
  return plan.kind == RowKind::kChunked && bytes + kStaticSmemSlack <= static_cast<size_t>(dev.smem_optin) ? bytes : 0;
}

inline void check_args(int64_t h, int wdtype) {
  if (h <= 0 || h >= (int64_t(1) << 31))
    throw std::invalid_argument("add_rms_norm: hidden size " + std::to_string(h) + " must be in [1, 2**31)");
  if (wdtype != kFloat32 && wdtype != kFloat16 && wdtype != kBFloat16)
    throw std::invalid_argument("add_rms_norm: unsupported weight dtype code " + std::to_string(wdtype));
}

// Resident blocks per SM of the backward kernel of `plan`.
template <typename T, int VEC>
int bwd_blocks_per_sm(const Plan& plan, size_t smem) {
  int blocks = 0;
  dispatch_plan<false, VEC>(plan, [&](auto vpt, auto kind) {
    const auto kernel = bwd_kernel<T, VEC, decltype(vpt)::value, decltype(kind)::value>;
    allow_smem(kernel, smem, "add_rms_norm shared memory");
    check_cuda(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, plan.tpr * plan.rpb, smem),
               "add_rms_norm occupancy");
  });
  return std::max(blocks, 1);
}

}  // namespace rmsnorm

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
    const Plan plan = fwd_plan(h, kVec);
    dispatch_plan<true, kVec>(plan, [&](auto vpt, auto kind) {
      const dim3 block(plan.tpr, plan.rpb), grid(static_cast<unsigned>(cdiv(rows, plan.rpb)));
      fwd_kernel<T, kVec, decltype(vpt)::value, decltype(kind)::value><<<grid, block, 0, s>>>(a, plan.chunks);
    });
  });
  check_cuda(cudaGetLastError(), "add_rms_norm_fwd launch");
}

int64_t add_rms_norm_bwd_partials(int64_t rows, int64_t h, int dtype, bool vectorized) {
  using namespace rmsnorm;
  check_args(h, kFloat32);
  if (rows <= 0) return 1;
  const DeviceInfo dev = device_info();
  int rpb = 1, blocks_per_sm = 1;
  dispatch_type_vec(dtype, vectorized, [&](auto tag, auto vec) {
    const Plan plan = bwd_plan(h, decltype(vec)::value);
    rpb = plan.rpb;
    blocks_per_sm = bwd_blocks_per_sm<decltype(tag), decltype(vec)::value>(plan, bwd_smem_bytes(plan, h, dev));
  });
  // One wave of resident blocks, each writing one partial row: few partial rows, little reduction traffic.
  return std::max<int64_t>(1, std::min<int64_t>(cdiv(rows, rpb), static_cast<int64_t>(dev.sms) * blocks_per_sm));
}

void add_rms_norm_bwd(uintptr_t grad_y, uintptr_t grad_residual_out, uintptr_t residual_out, int64_t stride_ro,
                      uintptr_t weight, uintptr_t rstd, uintptr_t grad_x, uintptr_t grad_residual, uintptr_t partials,
                      int64_t num_partials, uintptr_t grad_weight, int64_t rows, int64_t h, int dtype, int wdtype,
                      bool vectorized, uintptr_t stream) {
  using namespace rmsnorm;
  check_args(h, wdtype);
  if (num_partials < 1) throw std::invalid_argument("add_rms_norm: num_partials must be >= 1");
  check_aligned("add_rms_norm", vectorized, h, dtype,
                {grad_y, grad_residual_out, residual_out, weight, grad_x, grad_residual, partials}, {stride_ro});
  const auto s = reinterpret_cast<cudaStream_t>(stream);
  float* part = reinterpret_cast<float*>(partials);  // [num_partials, h]
  if (rows > 0) {
    const BwdArgs a{reinterpret_cast<const void*>(grad_y), reinterpret_cast<const void*>(grad_residual_out),
                    reinterpret_cast<const void*>(residual_out), reinterpret_cast<const void*>(weight),
                    reinterpret_cast<const float*>(rstd), reinterpret_cast<void*>(grad_x),
                    reinterpret_cast<void*>(grad_residual), part, wdtype, rows, h, stride_ro};
    const DeviceInfo dev = device_info();
    dispatch_type_vec(dtype, vectorized, [&](auto tag, auto vec) {
      using T = decltype(tag);
      constexpr int kVec = decltype(vec)::value;
      const Plan plan = bwd_plan(h, kVec);
      const size_t smem = bwd_smem_bytes(plan, h, dev);
      dispatch_plan<false, kVec>(plan, [&](auto vpt, auto kind) {
        const auto kernel = bwd_kernel<T, kVec, decltype(vpt)::value, decltype(kind)::value>;
        allow_smem(kernel, smem, "add_rms_norm shared memory");
        kernel<<<static_cast<unsigned>(num_partials), dim3(plan.tpr, plan.rpb), smem, s>>>(a, plan.chunks, smem > 0);
      });
    });
    check_cuda(cudaGetLastError(), "add_rms_norm_bwd launch");
  } else {
    check_cuda(cudaMemsetAsync(part, 0, sizeof(float) * num_partials * h, s), "add_rms_norm_bwd memset");
  }
  const PartialSums sums{{part, nullptr, nullptr}, {reinterpret_cast<float*>(grad_weight), nullptr, nullptr}};
  launch_reduce_partials(sums, 1, num_partials, h, s, "add_rms_norm reduce launch");
}

}  // namespace seqpar
