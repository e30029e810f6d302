// Fused scale + causal mask + softmax + dropout over an attention score matrix, forward and backward:
// the middle of Megatron's non-flash attention core (the two GEMMs q k^T and P v stay in torch).
//
// Scores are a contiguous [b, H, s_q, s_k] tensor (one row per (batch, head, query i)). Per row:
//   forward   P_j = softmax_j(scale * x_j + mask_j)     mask_j = -inf where causal and j > i
//             D_j = P_j * keep_j / (1 - p)
//             keep_j = philox(seed + row_offset + (head * b + batch) * s_q + i, j) >= p
//   backward  given G_j = dL/dD_j:  gP_j = G_j * keep_j / (1 - p),
//             dL/dx_j = scale * P_j * (gP_j - sum_k gP_k P_k)
// The dropout rows are head-major (seqpar.ops.attention_core.attention_keep_mask), so the masks are the
// ones the torch reference and the Triton kernels draw. Nothing mask-sized is stored: backward
// regenerates keep from the same counters (once per element; a per-row bitmask in shared memory serves
// the second pass).
//
// One thread block per row. Pass 1 reduces over the row (max and sum, or the gP . P dot product);
// pass 2 re-reads it (from L2) and writes. Any s_k works (no register tile to size).
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "dtypes.cuh"
#include "philox.cuh"

namespace seqpar {
namespace {

struct RowInfo {
  int64_t n_valid;   // columns 0 .. n_valid - 1 are unmasked
  uint64_t drop_row; // seed + global head-major dropout row
};

__device__ __forceinline__ RowInfo row_info(int64_t row, int64_t batch, int64_t heads, int64_t s_q, int64_t s_k,
                                            bool causal, uint64_t seed, int64_t row_offset) {
  const int64_t i = row % s_q;
  const int64_t bh = row / s_q;  // batch-major in memory: bh = batch * heads + head
  const int64_t b_idx = bh / heads;
  const int64_t h_idx = bh % heads;
  RowInfo info;
  info.n_valid = causal ? (i + 1 < s_k ? i + 1 : s_k) : s_k;
  info.drop_row = seed + static_cast<uint64_t>(row_offset + (h_idx * batch + b_idx) * s_q + i);
  return info;
}

// (max, sum of exp(x - max)) pairs: the online-softmax combine; an empty side has max = -inf.
__device__ __forceinline__ void combine(float& m, float& l, float m_other, float l_other) {
  if (m_other == -INFINITY) return;
  if (m == -INFINITY) {
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

// scores (in): raw q k^T; scores (out): dropped probabilities D (only when dropout is on).
template <typename T, int THREADS>
__global__ void __launch_bounds__(THREADS)
softmax_dropout_fwd_kernel(T* __restrict__ scores, T* __restrict__ probs, int64_t batch, int64_t heads,
                           int64_t s_q, int64_t s_k, float scale, bool causal, uint64_t seed,
                           int64_t row_offset, float p, float drop_scale, bool dropout) {
  const int64_t row = blockIdx.x;
  const RowInfo info = row_info(row, batch, heads, s_q, s_k, causal, seed, row_offset);
  T* x_row = scores + row * s_k;
  T* p_row = probs + row * s_k;

  float m = -INFINITY, l = 0.0f;
  for (int64_t j = threadIdx.x; j < info.n_valid; j += THREADS) {
    const float x = to_float(x_row[j]) * scale;
    if (x > m) {
      l = l * expf(m - x) + 1.0f;  // expf(-inf) = 0 on the first element
      m = x;
    } else {
      l += expf(x - m);
    }
  }
  block_max_sum<THREADS>(m, l);  // column 0 is always valid, so l > 0
  const float inv_l = 1.0f / l;

  for (int64_t j = threadIdx.x; j < s_k; j += THREADS) {
    float prob = 0.0f;
    if (j < info.n_valid) prob = expf(to_float(x_row[j]) * scale - m) * inv_l;
    const T prob_t = from_float<T>(prob);
    p_row[j] = prob_t;
    if (dropout) {
      // Dropped from the rounded probability, exactly like the torch reference.
      const bool keep = j < info.n_valid && philox_uniform(info.drop_row, static_cast<uint32_t>(j)) >= p;
      x_row[j] = from_float<T>(keep ? to_float(prob_t) * drop_scale : 0.0f);
    }
  }
}

// grad (in): dL/dD; grad (out): dL/d(q k^T) (scale folded in). dropped (optional out): D regenerated.
template <typename T, int THREADS>
__global__ void __launch_bounds__(THREADS)
softmax_dropout_bwd_kernel(const T* __restrict__ probs, T* __restrict__ grad, T* __restrict__ dropped,
                           int64_t batch, int64_t heads, int64_t s_q, int64_t s_k, float scale, bool causal,
                           uint64_t seed, int64_t row_offset, float p, float drop_scale, bool dropout) {
  extern __shared__ uint32_t keep_bits[];  // ceil(s_k / 32) words when dropout is on
  const int64_t row = blockIdx.x;
  const RowInfo info = row_info(row, batch, heads, s_q, s_k, causal, seed, row_offset);
  const T* p_row = probs + row * s_k;
  T* g_row = grad + row * s_k;
  const int lane = threadIdx.x % 32;

  // Pass 1: dot = sum_j gP_j P_j; the keep bits of each 32-column word come from one warp ballot.
  float dot = 0.0f;
  for (int64_t j0 = 0; j0 < info.n_valid; j0 += THREADS) {  // uniform trip count: ballots stay converged
    const int64_t j = j0 + threadIdx.x;
    const bool valid = j < info.n_valid;
    float z = valid ? 1.0f : 0.0f;
    if (dropout) {
      const bool keep = valid && philox_uniform(info.drop_row, static_cast<uint32_t>(j)) >= p;
      const uint32_t word = __ballot_sync(0xffffffffu, keep);
      if (lane == 0 && j < info.n_valid) keep_bits[j / 32] = word;  // words past the row stay unread
      z = keep ? drop_scale : 0.0f;
    }
    if (valid) dot += to_float(g_row[j]) * z * to_float(p_row[j]);
  }
  dot = block_sum<THREADS>(dot);  // its __syncthreads also publishes keep_bits

  for (int64_t j = threadIdx.x; j < s_k; j += THREADS) {
    float g_score = 0.0f, d = 0.0f;
    if (j < info.n_valid) {
      const bool keep = !dropout || ((keep_bits[j / 32] >> (j % 32)) & 1u);
      const float prob = to_float(p_row[j]);
      const float z = keep ? drop_scale : 0.0f;
      g_score = scale * prob * (to_float(g_row[j]) * z - dot);
      d = prob * z;
    }
    g_row[j] = from_float<T>(g_score);
    if (dropped != nullptr) dropped[row * s_k + j] = from_float<T>(d);
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

void check_sizes(const char* what, int64_t batch, int64_t heads, int64_t s_q, int64_t s_k, double p) {
  if (batch < 0 || heads < 0 || s_q < 0 || s_k < 0)
    throw std::invalid_argument(std::string(what) + ": negative size");
  if (s_k >= (int64_t(1) << 31)) throw std::invalid_argument(std::string(what) + ": s_k must be < 2**31");
  if (batch * heads * s_q >= (int64_t(1) << 31))
    throw std::invalid_argument(std::string(what) + ": b * heads * s_q must be < 2**31 rows");
  if (!(p >= 0.0 && p < 1.0))
    throw std::invalid_argument(std::string(what) + ": dropout p must be in [0, 1), got " + std::to_string(p));
}

// float(1 / (1 - p)) from the unrounded (double) p: bit-equal to the torch reference's fp32 * Python-float
// scale and the Triton kernels' fp32 argument; 1.0f / (1.0f - float(p)) is an ulp off for many p (e.g. 0.15).
// The keep test uses float(p), as torch's fp32 comparison does.
float drop_scale(double p) { return static_cast<float>(1.0 / (1.0 - p)); }

}  // namespace

void attention_softmax_dropout_fwd(uintptr_t scores, uintptr_t probs, int64_t batch, int64_t heads, int64_t s_q,
                                   int64_t s_k, int dtype, float scale, bool causal, uint64_t seed,
                                   int64_t row_offset, double p, uintptr_t stream) {
  check_sizes("attention_softmax_dropout_fwd", batch, heads, s_q, s_k, p);
  const int64_t rows = batch * heads * s_q;
  if (rows == 0 || s_k == 0) return;
  const bool dropout = p > 0.0;
  const float scale_p = drop_scale(p), pf = static_cast<float>(p);
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    dispatch_threads(s_k, [&](auto threads) {
      constexpr int THREADS = decltype(threads)::value;
      softmax_dropout_fwd_kernel<T, THREADS>
          <<<static_cast<unsigned>(rows), THREADS, 0, reinterpret_cast<cudaStream_t>(stream)>>>(
              reinterpret_cast<T*>(scores), reinterpret_cast<T*>(probs), batch, heads, s_q, s_k, scale, causal,
              seed, row_offset, pf, scale_p, dropout);
    });
  });
  check_cuda(cudaGetLastError(), "attention_softmax_dropout_fwd launch");
}

void attention_softmax_dropout_bwd(uintptr_t probs, uintptr_t grad, uintptr_t dropped, int64_t batch,
                                   int64_t heads, int64_t s_q, int64_t s_k, int dtype, float scale, bool causal,
                                   uint64_t seed, int64_t row_offset, double p, uintptr_t stream) {
  check_sizes("attention_softmax_dropout_bwd", batch, heads, s_q, s_k, p);
  const int64_t rows = batch * heads * s_q;
  if (rows == 0 || s_k == 0) return;
  const bool dropout = p > 0.0;
  if (dropout && dropped == 0)
    throw std::invalid_argument("attention_softmax_dropout_bwd: dropout needs the `dropped` output buffer");
  const float scale_p = drop_scale(p), pf = static_cast<float>(p);
  const size_t smem = dropout ? static_cast<size_t>((s_k + 31) / 32) * sizeof(uint32_t) : 0;
  if (smem > 47 * 1024)  // the default 48 KiB limit covers static shared memory (block_sum's) too
    throw std::invalid_argument("attention_softmax_dropout_bwd: s_k too long for the shared keep bitmask");
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    dispatch_threads(s_k, [&](auto threads) {
      constexpr int THREADS = decltype(threads)::value;
      softmax_dropout_bwd_kernel<T, THREADS>
          <<<static_cast<unsigned>(rows), THREADS, smem, reinterpret_cast<cudaStream_t>(stream)>>>(
              reinterpret_cast<const T*>(probs), reinterpret_cast<T*>(grad), reinterpret_cast<T*>(dropped), batch,
              heads, s_q, s_k, scale, causal, seed, row_offset, pf, scale_p, dropout);
    });
  });
  check_cuda(cudaGetLastError(), "attention_softmax_dropout_bwd launch");
}

}  // namespace seqpar
