// Dtype codes shared with seqpar/_ext.py (DTYPE_CODES) and the load/store helpers every kernel uses.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace seqpar {

enum DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// Calls fn(T{}) with T the C++ type of `code`; throws std::invalid_argument (-> ValueError) otherwise.
template <typename Fn> void dispatch_dtype(int code, Fn&& fn) {
  switch (code) {
    case kFloat32: fn(float{}); break;
    case kFloat16: fn(__half{}); break;
    case kBFloat16: fn(__nv_bfloat16{}); break;
    default: throw std::invalid_argument("unsupported dtype code " + std::to_string(code));
  }
}

inline void check_cuda(cudaError_t status, const char* what) {
  if (status != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(status));
}

}  // namespace seqpar
