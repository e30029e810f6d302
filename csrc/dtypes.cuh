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

// N values of T held together; up to 16 bytes load / store as one access (the pointer must be aligned
// to the pack's size, at most 16 bytes), larger packs as several 16-byte accesses.
template <typename T, int N>
struct alignas(sizeof(T) * N > 16 ? 16 : sizeof(T) * N) Pack {
  T v[N];
};

template <typename T, int N>
__device__ __forceinline__ Pack<T, N> load_pack(const T* p) {
  return *reinterpret_cast<const Pack<T, N>*>(p);
}

template <typename T, int N>
__device__ __forceinline__ void store_pack(T* p, const Pack<T, N>& v) {
  *reinterpret_cast<Pack<T, N>*>(p) = v;
}

// N values from column c0 of a row of n columns: one pack access when `vector` (c0 + N <= n and the address
// aligned), else scalar accesses of the columns below n (zeros past it).
template <typename T, int N>
__device__ __forceinline__ Pack<T, N> load_run(const T* row, int64_t c0, int64_t n, bool vector) {
  if (vector) return load_pack<T, N>(row + c0);
  Pack<T, N> out;
#pragma unroll
  for (int i = 0; i < N; ++i) out.v[i] = c0 + i < n ? row[c0 + i] : from_float<T>(0.0f);
  return out;
}

template <typename T, int N>
__device__ __forceinline__ void store_run(T* row, int64_t c0, int64_t n, bool vector, const Pack<T, N>& v) {
  if (vector) {
    store_pack<T, N>(row + c0, v);
    return;
  }
#pragma unroll
  for (int i = 0; i < N; ++i)
    if (c0 + i < n) row[c0 + i] = v.v[i];
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
