// SwiGLU, forward and backward: the CUDA twin of triton_kernels/swiglu.py (math and shapes in
// seqpar/ops/swiglu.py). On rows of gate_up = [gate | up] (2n columns):
//
//   y       = silu(gate) * up,  silu(g) = g / (1 + exp(-g))                  fp32, rounded once
//   backward: sig = 1 / (1 + exp(-g));  dgate = dy * up * sig * (1 + g * (1 - sig));  dup = dy * silu(g)
//
// silu is recomputed in backward from the saved gate_up (nothing else is stored). A flat grid-stride loop
// over VEC-element vectors of the [rows, n] output (16-byte accesses when sizes, strides and pointers
// allow, else VEC = 1); gate_up rows may be strided (row stride ld >= 2n), y and the gradients are
// contiguous.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "dtypes.cuh"
#include "row_reduce.cuh"

namespace seqpar {
namespace swiglu {

using namespace rows;

constexpr int kThreads = 256;
constexpr int kBlocksPerSm = 16;  // grid of the grid-stride loop: enough resident warps to cover latency

// The flat grid-stride loop over the [rows, nvec] vectors of the output, as (row, vector column) pairs:
// the stride's row and column steps are divided out once per thread, so that an iteration adds instead
// of dividing 64-bit integers (a ~70-instruction subroutine per 8 elements, in the SASS of the first
// build). fn(r, c) gets the row and the first element's column.
template <typename Fn>
__device__ __forceinline__ void for_each_vector(int64_t rows, int64_t nvec, int vec, Fn&& fn) {
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t stride_r = stride / nvec, stride_c = stride - stride_r * nvec;
  int64_t r = first / nvec, c = first - r * nvec;
  while (r < rows) {
    fn(r, c * vec);
    r += stride_r;
    c += stride_c;
    if (c >= nvec) {
      c -= nvec;
      ++r;
    }
  }
}

// 1 + exp(-g) with the fast exponential, divided by div_full: the Triton kernels' formulas and
// instructions (tl.exp and fp32 '/' are ex2.approx and div.full there). The IEEE expf and divisions
// took ~30 instructions per element, in-line slow paths included, more than the element's memory time.
__device__ __forceinline__ float sigmoid_denom(float g) { return 1.0f + __expf(-g); }

// a / b as div.full.f32 (about 2 ulp over the whole range). Not __fdividef: its div.approx.f32 returns 0
// for 2^126 < |b| < 2^128, where 1 + exp(-g) lands for g in (-88.7, -87.3] (silu ~1e-36 came out 0).
__device__ __forceinline__ float div_full(float a, float b) {
#if defined(__CUDA_ARCH__)
  float q;
  asm("div.full.f32 %0, %1, %2;" : "=f"(q) : "f"(a), "f"(b));
  return q;
#else
  return a / b;  // host emulation (tests/cuda_emulation)
#endif
}

// y[r, c] = silu(gate_up[r, c]) * gate_up[r, n + c]
template <typename T, int VEC>
__global__ void __launch_bounds__(kThreads) fwd_kernel(const T* __restrict__ gate_up, T* __restrict__ y, int64_t rows,
                                                     int64_t n, int64_t ld) {
  for_each_vector(rows, n / VEC, VEC, [&](int64_t r, int64_t c) {
    const T* row = gate_up + r * ld;
    const Pack<T, VEC> g = load_pack<T, VEC>(row + c), u = load_pack<T, VEC>(row + n + c);
    Pack<T, VEC> out;
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      const float gv = to_float(g.v[e]);
      out.v[e] = from_float<T>(div_full(gv, sigmoid_denom(gv)) * to_float(u.v[e]));
    }
    store_pack<T, VEC>(y + r * n + c, out);
  });
}

// grad[r, c] = dgate, grad[r, n + c] = dup (grad is [rows, 2n] contiguous)
template <typename T, int VEC>
__global__ void __launch_bounds__(kThreads) bwd_kernel(const T* __restrict__ grad_y, const T* __restrict__ gate_up,
                                                     T* __restrict__ grad, int64_t rows, int64_t n, int64_t ld) {
  for_each_vector(rows, n / VEC, VEC, [&](int64_t r, int64_t c) {
    const T* row = gate_up + r * ld;
    const Pack<T, VEC> g = load_pack<T, VEC>(row + c), u = load_pack<T, VEC>(row + n + c);
    const Pack<T, VEC> dy = load_pack<T, VEC>(grad_y + r * n + c);
    Pack<T, VEC> dg, du;
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      const float gv = to_float(g.v[e]), uv = to_float(u.v[e]), dyv = to_float(dy.v[e]);
      const float denom = sigmoid_denom(gv), sig = div_full(1.0f, denom);
      dg.v[e] = from_float<T>(dyv * uv * sig * (1.0f + gv * (1.0f - sig)));
      du.v[e] = from_float<T>(dyv * div_full(gv, denom));
    }
    T* out = grad + r * 2 * n;
    store_pack<T, VEC>(out + c, dg);
    store_pack<T, VEC>(out + n + c, du);
  });
}

inline unsigned grid_for(int64_t total) {
  const int64_t sms = device_info().sms;
  return static_cast<unsigned>(std::max<int64_t>(1, std::min(cdiv(total, kThreads), sms * kBlocksPerSm)));
}

// Any row stride ld >= 0: gate_up is only read, so its rows may overlap (ld = 0: rows broadcast by expand).
inline void check_args(int64_t rows, int64_t n, int64_t ld) {
  if (n <= 0 || rows < 0 || ld < 0)
    throw std::invalid_argument("swiglu: need n > 0, rows >= 0 and row stride ld >= 0 (got n=" + std::to_string(n) +
                                ", rows=" + std::to_string(rows) + ", ld=" + std::to_string(ld) + ")");
}

}  // namespace swiglu

// The entry points launch with <<<>>>, which needs nvcc: host emulation (tests/cuda_emulation, g++) stops here.
#if !defined(SEQPAR_HOST_EMULATION)
void swiglu_fwd(uintptr_t gate_up, uintptr_t y, int64_t rows, int64_t n, int64_t ld, int dtype, bool vectorized,
                uintptr_t stream) {
  using namespace swiglu;
  check_args(rows, n, ld);
  check_aligned("swiglu", vectorized, n, dtype, {gate_up, y}, {ld});
  if (rows == 0) return;
  dispatch_type_vec(dtype, vectorized, [&](auto tag, auto vec) {
    using T = decltype(tag);
    constexpr int kVec = decltype(vec)::value;
    fwd_kernel<T, kVec><<<grid_for(rows * (n / kVec)), kThreads, 0, reinterpret_cast<cudaStream_t>(stream)>>>(
        reinterpret_cast<const T*>(gate_up), reinterpret_cast<T*>(y), rows, n, ld);
  });
  check_cuda(cudaGetLastError(), "swiglu_fwd launch");
}

void swiglu_bwd(uintptr_t grad_y, uintptr_t gate_up, uintptr_t grad_gate_up, int64_t rows, int64_t n, int64_t ld,
                int dtype, bool vectorized, uintptr_t stream) {
  using namespace swiglu;
  check_args(rows, n, ld);
  check_aligned("swiglu", vectorized, n, dtype, {grad_y, gate_up, grad_gate_up}, {ld});
  if (rows == 0) return;
  dispatch_type_vec(dtype, vectorized, [&](auto tag, auto vec) {
    using T = decltype(tag);
    constexpr int kVec = decltype(vec)::value;
    bwd_kernel<T, kVec><<<grid_for(rows * (n / kVec)), kThreads, 0, reinterpret_cast<cudaStream_t>(stream)>>>(
        reinterpret_cast<const T*>(grad_y), reinterpret_cast<const T*>(gate_up), reinterpret_cast<T*>(grad_gate_up),
        rows, n, ld);
  });
  check_cuda(cudaGetLastError(), "swiglu_bwd launch");
}

#endif  // !SEQPAR_HOST_EMULATION

}  // namespace seqpar
