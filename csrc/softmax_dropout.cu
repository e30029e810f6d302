// Fused causal mask + softmax + dropout over an attention score matrix, forward and backward: the middle
// of Megatron's non-flash attention core (the GEMMs stay in torch; the softmax scale is their alpha, so the
// scores arrive scaled and q k^T never exists unscaled in a 16-bit type).
//
// Scores are a contiguous [b, H, s_q, s_k] tensor (one row per (batch, head, query i)). Per row:
//   forward   P_j = softmax_j(x_j + mask_j)              mask_j = -inf where causal and j > i
//             D_j = P_j * keep_j * drop_scale            drop_scale = float(256 / (256 - P))
//             keep_j = mask_byte(seed, row_offset + (head * b + batch) * s_q + i, j) >= P   (csrc/philox.cuh)
//   backward  given G_j = dL/dD_j:  gP_j = G_j * keep_j * drop_scale,
//             dL/dx_j = P_j * (gP_j - sum_k gP_k P_k)
// Infinite scores (fp16 overflow of large logits) are read as +-FLT_MAX, which gives softmax's limit
// instead of NaN: the +inf entries of a row share its mass equally, -inf entries get 0, and a row of
// -inf only is uniform. (NaN scores stay NaN.)
// The dropout rows are head-major (seqpar.ops.attention_core.attention_keep_mask), so the masks are the
// ones the torch reference and the Triton kernels draw. Nothing mask-sized is stored: backward
// regenerates keep from the same counters (a per-row bitmask in shared memory serves its second pass).
//
// One thread block per row. Pass 1 reduces over the row (max and sum, or the gP . P dot product);
// pass 2 re-reads it (from L2) and writes. Any s_k works (no register tile to size). The passes that
// draw the mask go over 16-column groups: a thread owns whole groups (one Philox call, 16 decisions)
// and moves each as two (fp32: four) 16-byte vectors when the rows allow it.
#include <cuda_runtime.h>

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "dtypes.cuh"
#include "philox.cuh"
#include "row_reduce.cuh"

namespace seqpar {
namespace {

struct RowInfo {
  int64_t n_valid;   // columns 0 .. n_valid - 1 are unmasked
  uint64_t drop_row; // global head-major dropout row
};

__device__ __forceinline__ RowInfo row_info(int64_t row, int64_t batch, int64_t heads, int64_t s_q, int64_t s_k,
                                            bool causal, int64_t row_offset) {
  const int64_t i = row % s_q;
  const int64_t bh = row / s_q;  // batch-major in memory: bh = batch * heads + head
  const int64_t b_idx = bh / heads;
  const int64_t h_idx = bh % heads;
  RowInfo info;
  info.n_valid = causal ? (i + 1 < s_k ? i + 1 : s_k) : s_k;
  info.drop_row = static_cast<uint64_t>(row_offset + (h_idx * batch + b_idx) * s_q + i);
  return info;
}

// A score as the softmax reads it: +-inf -> +-FLT_MAX (see the top of the file).
__device__ __forceinline__ float finite_score(float x) { return isinf(x) ? copysignf(FLT_MAX, x) : x; }

// (max, sum of exp(x - max)) pairs: the online-softmax combine. An empty side (no valid column) has l = 0;
// a side that read a NaN score has l = NaN and is never empty, whatever its max (-inf when it read only
// NaNs: they never pass x > m), so the NaN reaches the row's sum and every probability of the row is NaN,
// as in torch. (Testing m == -inf for empty dropped such a side: the row normalised without its NaN.)
__device__ __forceinline__ void combine(float& m, float& l, float m_other, float l_other) {
  if (l_other == 0.0f) return;
  if (l == 0.0f) {
    m = m_other;
    l = l_other;
    return;
  }
  const float m_new = fmaxf(m, m_other);
  l = l * expf(m - m_new) + l_other * expf(m_other - m_new);
  m = m_new;
}

template <int THREADS>
__device__ void block_max_sum(float& m, float& l) {
  __shared__ float sm_m[THREADS / 32], sm_l[THREADS / 32];
  for (int off = 16; off > 0; off >>= 1) {
    const float m_o = __shfl_xor_sync(0xffffffffu, m, off);
    const float l_o = __shfl_xor_sync(0xffffffffu, l, off);
    combine(m, l, m_o, l_o);
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) {
    sm_m[warp] = m;
    sm_l[warp] = l;
  }
  __syncthreads();
  m = -INFINITY;
  l = 0.0f;
  for (int w = 0; w < THREADS / 32; ++w) combine(m, l, sm_m[w], sm_l[w]);
}

template <int THREADS>
__device__ float block_sum(float x) {
  __shared__ float sm[THREADS / 32];
  for (int off = 16; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) sm[warp] = x;
  __syncthreads();
  float total = 0.0f;
  for (int w = 0; w < THREADS / 32; ++w) total += sm[w];
  return total;
}

// One 16-column group of a row from column j0: two 16-byte vectors (four for fp32) when `vector`, else
// scalar accesses of the columns below n.
constexpr int kGroup = kMaskGroup;
template <typename T>
using Group = Pack<T, kGroup>;

template <typename T>
__device__ __forceinline__ Group<T> load_group(const T* row, int64_t j0, int64_t n, bool vector) {
  constexpr int kVec = 16 / sizeof(T);
  Group<T> out;
#pragma unroll
  for (int v = 0; v < kGroup / kVec; ++v) {
    const Pack<T, kVec> part = load_run<T, kVec>(row, j0 + v * kVec, n, vector);
#pragma unroll
    for (int i = 0; i < kVec; ++i) out.v[v * kVec + i] = part.v[i];
  }
  return out;
}

template <typename T>
__device__ __forceinline__ void store_group(T* row, int64_t j0, int64_t n, bool vector, const Group<T>& g) {
  constexpr int kVec = 16 / sizeof(T);
#pragma unroll
  for (int v = 0; v < kGroup / kVec; ++v) {
    Pack<T, kVec> part;
#pragma unroll
    for (int i = 0; i < kVec; ++i) part.v[i] = g.v[v * kVec + i];
    store_run<T, kVec>(row, j0 + v * kVec, n, vector, part);
  }
}

// scores (in): scale * q k^T; scores (out): dropped probabilities D (only when dropout is on).
// vectorized: rows start 16-byte aligned (s_k a multiple of 16 / sizeof(T), aligned pointers).
template <typename T, int THREADS>
__global__ void __launch_bounds__(THREADS)
softmax_dropout_fwd_kernel(T* __restrict__ scores, T* __restrict__ probs, int64_t batch, int64_t heads,
                           int64_t s_q, int64_t s_k, bool causal, uint64_t seed, int64_t row_offset,
                           uint32_t threshold24, float drop_scale, bool vectorized) {
  const int64_t row = blockIdx.x;
  const RowInfo info = row_info(row, batch, heads, s_q, s_k, causal, row_offset);
  const bool dropout = threshold24 != 0;
  T* x_row = scores + row * s_k;
  T* p_row = probs + row * s_k;

  float m = -INFINITY, l = 0.0f;
  for (int64_t j = threadIdx.x; j < info.n_valid; j += THREADS) {
    const float x = finite_score(to_float(x_row[j]));
    if (x > m) {
      l = l * expf(m - x) + 1.0f;  // expf(-inf) = 0 on the first element
      m = x;
    } else {
      l += expf(x - m);
    }
  }
  block_max_sum<THREADS>(m, l);  // column 0 is always valid and finite_score is never -inf: l >= 1
  const float inv_l = 1.0f / l;

  for (int64_t g = threadIdx.x; g * kGroup < s_k; g += THREADS) {
    const int64_t j0 = g * kGroup;
    const bool vector = vectorized && j0 + kGroup <= s_k;
    const Group<T> x = load_group<T>(x_row, j0, s_k, vector);
    MaskWords mask{};
    if (dropout && j0 < info.n_valid) mask = mask_words(seed, info.drop_row, static_cast<uint32_t>(g));
    Group<T> prob, dropped;
#pragma unroll
    for (int i = 0; i < kGroup; ++i) {
      const bool valid = j0 + i < info.n_valid;
      prob.v[i] = from_float<T>(valid ? expf(finite_score(to_float(x.v[i])) - m) * inv_l : 0.0f);
      // Dropped from the rounded probability, exactly like the torch reference.
      dropped.v[i] = from_float<T>(valid && keep_column(mask, i, threshold24) ? to_float(prob.v[i]) * drop_scale
                                                                              : 0.0f);
    }
    store_group<T>(p_row, j0, s_k, vector, prob);
    if (dropout) store_group<T>(x_row, j0, s_k, vector, dropped);
  }
}

// grad (in): dL/dD; grad (out): dL/dx (x = scale * q k^T). dropped (optional out): D regenerated.
template <typename T, int THREADS>
__global__ void __launch_bounds__(THREADS)
softmax_dropout_bwd_kernel(const T* __restrict__ probs, T* __restrict__ grad, T* __restrict__ dropped,
                           int64_t batch, int64_t heads, int64_t s_q, int64_t s_k, bool causal,
                           uint64_t seed, int64_t row_offset, uint32_t threshold24, float drop_scale,
                           bool vectorized) {
  uint16_t* keep_bits_smem = rows::dynamic_shared<uint16_t>();  // a 16-bit word per 16-column group (dropout)
  const int64_t row = blockIdx.x;
  const RowInfo info = row_info(row, batch, heads, s_q, s_k, causal, row_offset);
  const bool dropout = threshold24 != 0;
  const T* p_row = probs + row * s_k;
  T* g_row = grad + row * s_k;

  // Pass 1: dot = sum_j gP_j P_j over the unmasked columns; a group's keep bits are kept for pass 2 (the
  // same thread owns the group then).
  float dot = 0.0f;
  for (int64_t g = threadIdx.x; g * kGroup < info.n_valid; g += THREADS) {
    const int64_t j0 = g * kGroup;
    const bool vector = vectorized && j0 + kGroup <= s_k;
    const Group<T> gv = load_group<T>(g_row, j0, s_k, vector);
    const Group<T> pv = load_group<T>(p_row, j0, s_k, vector);
    uint32_t bits = 0xFFFFu;
    if (dropout) {
      bits = keep_bits<kGroup>(mask_words(seed, info.drop_row, static_cast<uint32_t>(g)), threshold24);
      keep_bits_smem[g] = static_cast<uint16_t>(bits);
    }
    const float z = dropout ? drop_scale : 1.0f;
#pragma unroll
    for (int i = 0; i < kGroup; ++i)
      if (j0 + i < info.n_valid && (bits >> i) & 1u) dot += to_float(gv.v[i]) * z * to_float(pv.v[i]);
  }
  dot = block_sum<THREADS>(dot);

  for (int64_t g = threadIdx.x; g * kGroup < s_k; g += THREADS) {
    const int64_t j0 = g * kGroup;
    const bool vector = vectorized && j0 + kGroup <= s_k;
    const Group<T> gv = load_group<T>(g_row, j0, s_k, vector);
    const Group<T> pv = load_group<T>(p_row, j0, s_k, vector);
    const uint32_t bits = dropout && j0 < info.n_valid ? keep_bits_smem[g] : 0xFFFFu;
    Group<T> g_score, d;
#pragma unroll
    for (int i = 0; i < kGroup; ++i) {
      float gs = 0.0f, dv = 0.0f;
      if (j0 + i < info.n_valid) {
        const float prob = to_float(pv.v[i]);
        const float z = !dropout ? 1.0f : (bits >> i) & 1u ? drop_scale : 0.0f;
        gs = prob * (to_float(gv.v[i]) * z - dot);
        dv = prob * z;
      }
      g_score.v[i] = from_float<T>(gs);
      d.v[i] = from_float<T>(dv);
    }
    store_group<T>(g_row, j0, s_k, vector, g_score);
    if (dropped != nullptr) store_group<T>(dropped + row * s_k, j0, s_k, vector, d);
  }
}

template <typename Fn>
void dispatch_threads(int64_t s_k, Fn&& fn) {
  // Enough threads to keep a row's loads in flight without idling most of them on short rows.
  if (s_k <= 128) {
    fn(std::integral_constant<int, 32>{});
  } else if (s_k <= 2048) {
    fn(std::integral_constant<int, 128>{});
  } else {
    fn(std::integral_constant<int, 256>{});
  }
}

void check_sizes(const char* what, int64_t batch, int64_t heads, int64_t s_q, int64_t s_k, int threshold) {
  if (batch < 0 || heads < 0 || s_q < 0 || s_k < 0)
    throw std::invalid_argument(std::string(what) + ": negative size");
  if (s_k >= (int64_t(1) << 31)) throw std::invalid_argument(std::string(what) + ": s_k must be < 2**31");
  if (batch * heads * s_q >= (int64_t(1) << 31))
    throw std::invalid_argument(std::string(what) + ": b * heads * s_q must be < 2**31 rows");
  if (threshold < 0 || threshold > 255)
    throw std::invalid_argument(std::string(what) + ": dropout threshold P must be in [0, 256), got " +
                                std::to_string(threshold));
}

// 16-byte vectors: every row starts on a 16-byte boundary.
template <typename T>
bool rows_aligned(int64_t s_k, std::initializer_list<uintptr_t> ptrs) {
  bool ok = s_k % (16 / sizeof(T)) == 0;
  for (uintptr_t p : ptrs) ok = ok && p % 16 == 0;
  return ok;
}

}  // namespace

// The entry points launch with <<<>>>, which needs nvcc: host emulation (tests/cuda_emulation, g++) stops here.
#if !defined(SEQPAR_HOST_EMULATION)
void attention_softmax_dropout_fwd(uintptr_t scores, uintptr_t probs, int64_t batch, int64_t heads, int64_t s_q,
                                   int64_t s_k, int dtype, bool causal, uint64_t seed, int64_t row_offset,
                                   int threshold, uintptr_t stream) {
  check_sizes("attention_softmax_dropout_fwd", batch, heads, s_q, s_k, threshold);
  const int64_t rows = batch * heads * s_q;
  if (rows == 0 || s_k == 0) return;
  const float scale_p = threshold > 0 ? dropout_scale(threshold) : 1.0f;
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    const bool vectorized = rows_aligned<T>(s_k, {scores, probs});
    dispatch_threads(s_k, [&](auto threads) {
      constexpr int THREADS = decltype(threads)::value;
      softmax_dropout_fwd_kernel<T, THREADS>
          <<<static_cast<unsigned>(rows), THREADS, 0, reinterpret_cast<cudaStream_t>(stream)>>>(
              reinterpret_cast<T*>(scores), reinterpret_cast<T*>(probs), batch, heads, s_q, s_k, causal, seed,
              row_offset, static_cast<uint32_t>(threshold) << 24, scale_p, vectorized);
    });
  });
  check_cuda(cudaGetLastError(), "attention_softmax_dropout_fwd launch");
}

void attention_softmax_dropout_bwd(uintptr_t probs, uintptr_t grad, uintptr_t dropped, int64_t batch,
                                   int64_t heads, int64_t s_q, int64_t s_k, int dtype, bool causal, uint64_t seed,
                                   int64_t row_offset, int threshold, uintptr_t stream) {
  check_sizes("attention_softmax_dropout_bwd", batch, heads, s_q, s_k, threshold);
  const int64_t rows = batch * heads * s_q;
  if (rows == 0 || s_k == 0) return;
  const bool dropout = threshold > 0;
  if (dropout && dropped == 0)
    throw std::invalid_argument("attention_softmax_dropout_bwd: dropout needs the `dropped` output buffer");
  const float scale_p = dropout ? dropout_scale(threshold) : 1.0f;
  const size_t smem = dropout ? static_cast<size_t>((s_k + kGroup - 1) / kGroup) * sizeof(uint16_t) : 0;
  if (smem > 47 * 1024)  // the default 48 KiB limit covers static shared memory (block_sum's) too
    throw std::invalid_argument("attention_softmax_dropout_bwd: s_k too long for the shared keep bitmask");
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    const bool vectorized = rows_aligned<T>(s_k, {probs, grad, dropped});
    dispatch_threads(s_k, [&](auto threads) {
      constexpr int THREADS = decltype(threads)::value;
      softmax_dropout_bwd_kernel<T, THREADS>
          <<<static_cast<unsigned>(rows), THREADS, smem, reinterpret_cast<cudaStream_t>(stream)>>>(
              reinterpret_cast<const T*>(probs), reinterpret_cast<T*>(grad), reinterpret_cast<T*>(dropped), batch,
              heads, s_q, s_k, causal, seed, row_offset, static_cast<uint32_t>(threshold) << 24, scale_p,
              vectorized);
    });
  });
  check_cuda(cudaGetLastError(), "attention_softmax_dropout_bwd launch");
}

#endif  // !SEQPAR_HOST_EMULATION

}  // namespace seqpar
