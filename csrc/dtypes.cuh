// Dtype codes shared with seqpar/_ext.py (DTYPE_CODES) and the load/store helpers every kernel uses.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>
#include <cstring>
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

// p points to global memory (st.global takes its generic address, as CUDA's own __stwb does; shared memory
// takes shared_store_run). Packs of 8 and 16 bytes are one st.global.v2 / v4.b32 of their bits: an
// assignment of the Pack let nvcc split the store of freshly computed values into 2- and 4-byte stores,
// even with the alignment stated (__builtin_assume_aligned): the rotary kernel stored a 16-byte pack as 8
// of them and ran at 21% of the copy bandwidth on an H200; the LayerNorm and RMSNorm forwards split some
// of theirs too (tests/test_kernel_report.py reads the SASS). asm volatile with a "memory" clobber: the
// compiler keeps it in order with the kernel's other loads and stores, as it does a plain store.
template <typename T, int N>
__device__ __forceinline__ void store_pack(T* p, const Pack<T, N>& v) {
  constexpr int kBytes = sizeof(Pack<T, N>);
#if defined(SEQPAR_HOST_EMULATION)
  *reinterpret_cast<Pack<T, N>*>(p) = v;
#else
  if constexpr (kBytes % 16 == 0) {
#pragma unroll
    for (int i = 0; i < kBytes / 16; ++i) {
      uint32_t w[4];
      memcpy(w, reinterpret_cast<const char*>(&v) + 16 * i, 16);
      asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(reinterpret_cast<char*>(p) + 16 * i),
                   "r"(w[0]), "r"(w[1]), "r"(w[2]), "r"(w[3]) : "memory");
    }
  } else if constexpr (kBytes == 8) {
    uint32_t w[2];
    memcpy(w, &v, 8);
    asm volatile("st.global.v2.b32 [%0], {%1, %2};" ::"l"(p), "r"(w[0]), "r"(w[1]) : "memory");
  } else {
    *reinterpret_cast<Pack<T, N>*>(p) = v;
  }
#endif
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

// store_run's twin for shared memory (store_pack is global only): one Pack assignment when `vector`.
template <typename T, int N>
__device__ __forceinline__ void shared_store_run(T* row, int64_t c0, int64_t n, bool vector, const Pack<T, N>& v) {
  if (vector) {
    *reinterpret_cast<Pack<T, N>*>(row + c0) = v;
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
