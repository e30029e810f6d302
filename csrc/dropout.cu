// y = x * keep / (1 - p) over a [rows, cols] row-major matrix, keep = philox(seed + row_offset + row, col) >= p.
// The first kernel of seqpar._C: the CUDA twin of seqpar.ops.dropout.apply_keep_mask.
#include <cuda_runtime.h>

#include "dtypes.cuh"
#include "philox.cuh"

namespace seqpar {

template <typename T>
__global__ void dropout_rows_kernel(const T* __restrict__ x, T* __restrict__ y, int64_t rows, int64_t cols,
                                    uint64_t seed, int64_t row_offset, float p, float scale) {
  const int64_t row = blockIdx.x;
  const uint64_t row_seed = seed + static_cast<uint64_t>(row_offset + row);
  const T* x_row = x + row * cols;
  T* y_row = y + row * cols;
  for (int64_t col = threadIdx.x; col < cols; col += blockDim.x) {
    const bool keep = philox_uniform(row_seed, static_cast<uint32_t>(col)) >= p;
    y_row[col] = from_float<T>(keep ? to_float(x_row[col]) * scale : 0.0f);
  }
}

// p is a double (the Python float, unrounded) so that scale = float(1 / (1 - p)) rounds exactly like the
// torch reference's `x * keep * (1 / (1 - p))` (fp32 tensor times a Python scalar); 1.0f / (1.0f - float(p))
// differs from it by an ulp for many p (0.15, 0.025, ...). The keep test uses float(p), as torch does.
void dropout_rows(uintptr_t x, uintptr_t y, int64_t rows, int64_t cols, int dtype, uint64_t seed,
                  int64_t row_offset, double p, uintptr_t stream) {
  if (rows == 0 || cols == 0) return;
  // gridDim.x is at most 2**31 - 1 and Philox offsets (columns) are 32-bit (Triton's int32 offsets).
  if (rows >= (int64_t(1) << 31) || cols >= (int64_t(1) << 31))
    throw std::invalid_argument("dropout_rows: rows and cols must be < 2**31");
  const float pf = static_cast<float>(p);
  const float scale = static_cast<float>(1.0 / (1.0 - p));
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    dropout_rows_kernel<T><<<static_cast<unsigned>(rows), 256, 0, reinterpret_cast<cudaStream_t>(stream)>>>(
        reinterpret_cast<const T*>(x), reinterpret_cast<T*>(y), rows, cols, seed, row_offset, pf, scale);
  });
  check_cuda(cudaGetLastError(), "dropout_rows launch");
}

}  // namespace seqpar
