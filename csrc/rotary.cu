// Rotary position embedding ("rotate half", HF Llama's default) of q or k, forward and backward: the CUDA
// twin of triton_kernels/rotary.py (math and shapes in seqpar/ops/rotary.py).
//
//   angle_j   = float(position_offset + i) * inv_freq_j          row i of the sequence, j < d/2
//   out[:d/2] = x1 * cos - x2 * sin,   out[d/2:] = x2 * cos + x1 * sin      (x1, x2 the halves of a head)
//   backward:   the same with sin -> -sin (rotation by -angle)
//
// inv_freq comes from the caller, computed by torch exactly as HF does; cos / sin are the accurate sinf /
// cosf (no fast math), the functions torch's CUDA cos / sin use, and the rotation is evaluated with _rn
// intrinsics (no FMA contraction) in HF's order, so fp32 results match HF's.
//
// Layout: x [s, b, H, d] (q or k) with any element strides (unit stride along d). One block covers one
// sequence row i (blockIdx.x) and kRowsPerThread * blockDim.y of its b * H heads (blockIdx.y); threadIdx.x
// walks the half-head in VEC-element vectors and computes cos / sin of its columns once for all the heads
// it visits. out may be x (in place): every element is read, then written, by one thread.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "dtypes.cuh"
#include "row_reduce.cuh"

namespace seqpar {
namespace rotary {

using namespace rows;

constexpr int kThreads = 256;
constexpr int kRowsPerThread = 4;  // heads per thread per column vector: amortises the cos / sin

struct RopeArgs {
  const void* in;
  void* out;
  const float* inv_freq;         // [d / 2]
  int64_t batch, heads, half, position_offset;
  int64_t in_s, in_b, in_h;      // element strides of in
  int64_t out_s, out_b, out_h;   // element strides of out
  float sign;                    // +1 forward, -1 backward
};

template <typename T, int VEC>
__global__ void __launch_bounds__(kThreads) rope_kernel(const RopeArgs a) {
  const int64_t i = blockIdx.x;
  const int64_t rows = a.batch * a.heads, rows_per_block = static_cast<int64_t>(blockDim.y) * kRowsPerThread;
  const int64_t row0 = blockIdx.y * rows_per_block + threadIdx.y;
  const int64_t row_end = min(rows, (blockIdx.y + 1) * rows_per_block);
  const float pos = static_cast<float>(a.position_offset + i);  // HF: position_ids.float()
  const int64_t nvec = a.half / VEC;
  for (int64_t jv = threadIdx.x; jv < nvec; jv += blockDim.x) {
    float cs[VEC], sn[VEC];
    const Pack<float, VEC> f = load_pack<float, VEC>(a.inv_freq + jv * VEC);
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      const float angle = __fmul_rn(pos, f.v[e]);
      cs[e] = cosf(angle);
      sn[e] = a.sign * sinf(angle);
    }
    // Every load of this thread's kRowsPerThread heads is issued before any store: out may be in (in place),
    // so the compiler can't hoist a load above an earlier store, and a load-rotate-store loop kept one
    // head's 32 bytes in flight per thread (with 2-byte stores, store_pack's note: 3.2x Triton's time on
    // an H200). bf16: 124 registers instead of 48, two 256-thread blocks per SM instead of five, so 64 KB of
    // loads in flight per SM instead of 40 KB.
    // (batch, head) of each row in 32 bits: a launch holds fewer than 2**31 rows (rope_batches_per_launch)
    uint32_t bi[kRowsPerThread], hi[kRowsPerThread];
    Pack<T, VEC> p1[kRowsPerThread], p2[kRowsPerThread];
#pragma unroll
    for (int k = 0; k < kRowsPerThread; ++k) {
      const int64_t r = row0 + k * static_cast<int64_t>(blockDim.y);
      bi[k] = static_cast<uint32_t>(r) / static_cast<uint32_t>(a.heads);
      hi[k] = static_cast<uint32_t>(r) - bi[k] * static_cast<uint32_t>(a.heads);
      if (r < row_end) {
        const T* x = static_cast<const T*>(a.in) + i * a.in_s + bi[k] * a.in_b + hi[k] * a.in_h + jv * VEC;
        p1[k] = load_pack<T, VEC>(x);
        p2[k] = load_pack<T, VEC>(x + a.half);
      }
    }
#pragma unroll
    for (int k = 0; k < kRowsPerThread; ++k) {
      if (row0 + k * static_cast<int64_t>(blockDim.y) >= row_end) break;
      Pack<T, VEC> o1, o2;
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        const float x1 = to_float(p1[k].v[e]), x2 = to_float(p2[k].v[e]);
        o1.v[e] = from_float<T>(__fsub_rn(__fmul_rn(x1, cs[e]), __fmul_rn(x2, sn[e])));
        o2.v[e] = from_float<T>(__fadd_rn(__fmul_rn(x2, cs[e]), __fmul_rn(x1, sn[e])));
      }
      T* y = static_cast<T*>(a.out) + i * a.out_s + bi[k] * a.out_b + hi[k] * a.out_h + jv * VEC;
      store_pack<T, VEC>(y, o1);
      store_pack<T, VEC>(y + a.half, o2);
    }
  }
}

// Launch geometry: threadIdx.x over the half-head's vectors, threadIdx.y over heads (kRowsPerThread heads per
// thread), blockIdx.y over groups of ty * kRowsPerThread heads.
struct RopeGrid {
  int tx, ty;
  int64_t groups;
};

inline RopeGrid rope_grid(int64_t half, int vec, int64_t rows) {
  const int tx = static_cast<int>(std::min<int64_t>(pow2_ceil(half / vec), kWarp));
  const int ty = static_cast<int>(std::min<int64_t>(kThreads / tx, pow2_ceil(cdiv(rows, kRowsPerThread))));
  return {tx, ty, cdiv(rows, static_cast<int64_t>(ty) * kRowsPerThread)};
}

// Batches rotated per launch: gridDim.y (the row groups) is at most 65535, so one launch covers at most
// 65535 * ty * kRowsPerThread of the b * heads rows; a larger b takes several launches (b up to the
// returned count each). Throws only when one batch alone has more rows than a launch holds.
inline int64_t rope_batches_per_launch(int64_t half, int vec, int64_t b, int64_t heads) {
  const RopeGrid g = rope_grid(half, vec, b * heads);
  if (g.groups <= 65535) return b;
  const int64_t max_rows = int64_t(65535) * g.ty * kRowsPerThread;
  if (heads > max_rows) throw std::invalid_argument("rotary_embedding: heads is too large (" + std::to_string(heads) + ")");
  return max_rows / heads;
}

}  // namespace rotary

// The entry point launches with <<<>>>, which needs nvcc: host emulation (tests/cuda_emulation, g++) stops here.
#if !defined(SEQPAR_HOST_EMULATION)
// x [s, b, heads, d] -> out (may be x): element strides (s, b, head) of each, unit stride along d assumed.
// inverse: rotate by -angle (the backward). vectorized: 16-byte accesses (the caller checked alignment).
void rotary_embedding(uintptr_t x, uintptr_t out, uintptr_t inv_freq, int64_t s, int64_t b, int64_t heads, int64_t d,
                      int64_t in_s, int64_t in_b, int64_t in_h, int64_t out_s, int64_t out_b, int64_t out_h,
                      int64_t position_offset, bool inverse, int dtype, bool vectorized, uintptr_t stream) {
  using namespace rotary;
  if (d <= 0 || d % 2 != 0)
    throw std::invalid_argument("rotary_embedding: d must be even and positive, got " + std::to_string(d));
  const int64_t half = d / 2;
  check_aligned("rotary_embedding", vectorized, half, dtype, {x, out}, {in_s, in_b, in_h, out_s, out_b, out_h});
  const int64_t rows = b * heads;
  if (s == 0 || rows == 0) return;
  if (s >= (int64_t(1) << 31)) throw std::invalid_argument("rotary_embedding: s must be < 2**31");
  dispatch_type_vec(dtype, vectorized, [&](auto tag, auto vec) {
    using T = decltype(tag);
    constexpr int kVec = decltype(vec)::value;
    const int64_t step = rope_batches_per_launch(half, kVec, b, heads);
    for (int64_t b0 = 0; b0 < b; b0 += step) {
      const int64_t bn = std::min(step, b - b0);
      const RopeGrid g = rope_grid(half, kVec, bn * heads);
      const RopeArgs a{reinterpret_cast<const T*>(x) + b0 * in_b, reinterpret_cast<T*>(out) + b0 * out_b,
                       reinterpret_cast<const float*>(inv_freq), bn, heads, half, position_offset, in_s, in_b, in_h,
                       out_s, out_b, out_h, inverse ? -1.0f : 1.0f};
      const dim3 grid(static_cast<unsigned>(s), static_cast<unsigned>(g.groups)), block(g.tx, g.ty);
      rope_kernel<T, kVec><<<grid, block, 0, reinterpret_cast<cudaStream_t>(stream)>>>(a);
    }
  });
  check_cuda(cudaGetLastError(), "rotary_embedding launch");
}

#endif  // !SEQPAR_HOST_EMULATION

}  // namespace seqpar
