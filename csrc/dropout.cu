// y = keep ? x * scale : 0 over a [rows, cols] row-major matrix, with the dropout mask of seqpar.random
// (csrc/philox.cuh) for global rows row_offset + row: the CUDA twin of seqpar.ops.dropout.apply_keep_mask.
// With an optional bias [cols] and residual [rows, cols]: y = residual + (keep ? (x + bias) * scale : 0), the
// forward of seqpar.ops.bias_dropout_add in one pass (each step rounded to T as the torch reference rounds it).
//
// A thread owns whole 16-column groups of a row (one Philox call each) and the block is TX x TY threads:
// TX threads share a row (TX = its group count rounded up to a warp, at most 256) and TY = 256 / TX rows
// share the block, so short rows still fill the block.
#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "dtypes.cuh"
#include "philox.cuh"

namespace seqpar {

// kBias / kResidual (compile-time: plain dropout compiles as without them): y = residual + keep ? (x + bias)
// * scale : 0, rounded to T where the torch reference's separate ops round (x + bias, the dropped value, the
// sum). The adds are __fadd_rn (PTX add.rn, which is never contracted into an FMA): in fp32, residual +
// a * scale is not one FMA's single rounding, so the result is bitwise the other backends' there as well.
template <typename T, bool kBias, bool kResidual>
__global__ void __launch_bounds__(256) dropout_rows_kernel(const T* __restrict__ x, const T* __restrict__ bias,
                                                           const T* __restrict__ residual, T* __restrict__ y,
                                                           int64_t rows, int64_t cols, uint64_t seed,
                                                           int64_t row_offset, uint32_t threshold24, float scale,
                                                           bool vectorized) {
  constexpr int kVec = 16 / sizeof(T);  // elements of one 16-byte access
  constexpr int kRuns = kMaskGroup / kVec;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  if (row >= rows) return;
  const T* x_row = x + row * cols;
  T* y_row = y + row * cols;
  const uint64_t mask_row = static_cast<uint64_t>(row_offset + row);
  for (int64_t g = threadIdx.x; g * kMaskGroup < cols; g += blockDim.x) {
    const int64_t c0 = g * kMaskGroup;
    const bool vector = vectorized && c0 + kMaskGroup <= cols;
    // The group's loads first, then its Philox call: computed first, its ~100 dependent instructions ran
    // before any load was issued (the SASS kept that order), a thread's only 32 bytes of a row waiting
    // behind them (3000 GB/s on an H200, where the Triton kernel moved 3800-4000).
    Pack<T, kVec> in[kRuns];
#pragma unroll
    for (int v = 0; v < kRuns; ++v) in[v] = load_run<T, kVec>(x_row, c0 + v * kVec, cols, vector);
    Pack<T, kVec> bias_in[kBias ? kRuns : 1], residual_in[kResidual ? kRuns : 1];
    if constexpr (kBias) {
#pragma unroll
      for (int v = 0; v < kRuns; ++v) bias_in[v] = load_run<T, kVec>(bias, c0 + v * kVec, cols, vector);
    }
    if constexpr (kResidual) {
#pragma unroll
      for (int v = 0; v < kRuns; ++v)
        residual_in[v] = load_run<T, kVec>(residual + row * cols, c0 + v * kVec, cols, vector);
    }
    const MaskWords m = mask_words(seed, mask_row, static_cast<uint32_t>(g));
#pragma unroll
    for (int v = 0; v < kRuns; ++v) {
      Pack<T, kVec> out;
#pragma unroll
      for (int i = 0; i < kVec; ++i) {
        const bool keep = keep_column(m, v * kVec + i, threshold24);
        if constexpr (kBias) {
          const float a = to_float(from_float<T>(__fadd_rn(to_float(in[v].v[i]), to_float(bias_in[v].v[i]))));
          out.v[i] = from_float<T>(keep ? a * scale : 0.0f);
        } else {  // the conversion inside the select, as the plain kernel always had it (the same code)
          out.v[i] = from_float<T>(keep ? to_float(in[v].v[i]) * scale : 0.0f);
        }
        if constexpr (kResidual) out.v[i] = from_float<T>(__fadd_rn(to_float(residual_in[v].v[i]), to_float(out.v[i])));
      }
      store_run<T, kVec>(y_row, c0 + v * kVec, cols, vector, out);
    }
  }
}

// The block: TX threads share a row (its 16-column groups rounded up to a warp, at most 256), TY = 256 / TX
// rows share the block.
inline dim3 dropout_block(int64_t cols) {
  const int64_t groups = (cols + kMaskGroup - 1) / kMaskGroup;
  const int tx = static_cast<int>(std::min<int64_t>(256, (groups + 31) / 32 * 32));
  return dim3(tx, 256 / tx);
}

// The entry point launches with <<<>>>, which needs nvcc: host emulation (tests/cuda_emulation, g++) stops here.
#if !defined(SEQPAR_HOST_EMULATION)
// threshold: the byte threshold P = round(p * 256) in [1, 256) (seqpar.random.dropout_threshold). bias ([cols])
// and residual ([rows, cols], row-major like x) may be 0: none.
void dropout_rows(uintptr_t x, uintptr_t bias, uintptr_t residual, uintptr_t y, int64_t rows, int64_t cols,
                  int dtype, uint64_t seed, int64_t row_offset, int threshold, uintptr_t stream) {
  if (threshold < 1 || threshold > 255)
    throw std::invalid_argument("dropout_rows: dropout threshold P must be in [1, 256), got " +
                                std::to_string(threshold));
  if (rows < 0 || cols < 0 || row_offset < 0) throw std::invalid_argument("dropout_rows: negative size or offset");
  if (rows == 0 || cols == 0) return;
  // Groups are 32-bit Philox counters; gridDim.x is at most 2**31 - 1 blocks.
  if (cols >= (int64_t(1) << 35) || rows >= (int64_t(1) << 31))
    throw std::invalid_argument("dropout_rows: rows must be < 2**31 and cols < 2**35");
  const dim3 block = dropout_block(cols);
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    constexpr int kVec = 16 / sizeof(T);
    const bool vectorized = cols % kVec == 0 && x % 16 == 0 && y % 16 == 0 && bias % 16 == 0 && residual % 16 == 0;
    const dim3 grid(static_cast<unsigned>((rows + block.y - 1) / block.y));
    const auto launch = [&](auto kernel) {
      kernel<<<grid, block, 0, reinterpret_cast<cudaStream_t>(stream)>>>(
          reinterpret_cast<const T*>(x), reinterpret_cast<const T*>(bias), reinterpret_cast<const T*>(residual),
          reinterpret_cast<T*>(y), rows, cols, seed, row_offset, static_cast<uint32_t>(threshold) << 24,
          dropout_scale(threshold), vectorized);
    };
    if (bias != 0 && residual != 0) {
      launch(dropout_rows_kernel<T, true, true>);
    } else if (bias != 0) {
      launch(dropout_rows_kernel<T, true, false>);
    } else if (residual != 0) {
      launch(dropout_rows_kernel<T, false, true>);
    } else {
      launch(dropout_rows_kernel<T, false, false>);
    }
  });
  check_cuda(cudaGetLastError(), "dropout_rows launch");
}

// Why this build's kernels can't run on the current device ("" when they can): the CUDA runtime finds no
// image of them for its architecture (a GPU older than the architectures built, SEQPAR_CUDA_ARCHS). Any
// kernel answers for all: they are built for the same architectures.
std::string kernel_image_error() {
  cudaFuncAttributes attributes;
  const cudaError_t error = cudaFuncGetAttributes(&attributes, dropout_rows_kernel<float, false, false>);
  if (error == cudaSuccess) return "";
  cudaGetLastError();  // clear it: the next launch must not report it
  return cudaGetErrorString(error);
}

#endif  // !SEQPAR_HOST_EMULATION

}  // namespace seqpar
