// Philox-4x32-10 uniforms exactly as triton.language.rand computes them for 32-bit offsets, and
// therefore exactly as seqpar.random.philox_uniform does (see that module for the mask scheme:
// keep = philox_uniform(stream_seed + row, col) >= p). Host and device, so CI can check it without a GPU.
#pragma once
#include <cstdint>

#if defined(__CUDACC__)
#define SEQPAR_HD __host__ __device__ __forceinline__
#else
#define SEQPAR_HD inline
#endif

namespace seqpar {

SEQPAR_HD uint32_t mul_hi_u32(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__)
  return __umulhi(a, b);
#else
  return static_cast<uint32_t>((static_cast<uint64_t>(a) * b) >> 32);
#endif
}

// Uniform float in [0, 1) for key `seed` (64-bit: lo word, hi word) and counter (offset, 0, 0, 0).
SEQPAR_HD float philox_uniform(uint64_t seed, uint32_t offset) {
  uint32_t c0 = offset, c1 = 0, c2 = 0, c3 = 0;
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
#pragma unroll
  for (int round = 0; round < 10; ++round) {
    const uint32_t hi_b = mul_hi_u32(0xCD9E8D57u, c2), lo_b = 0xCD9E8D57u * c2;
    const uint32_t hi_a = mul_hi_u32(0xD2511F53u, c0), lo_a = 0xD2511F53u * c0;
    c0 = hi_b ^ c1 ^ k0;
    c1 = lo_b;
    c2 = hi_a ^ c3 ^ k1;
    c3 = lo_a;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  int32_t x = static_cast<int32_t>(c0);
  if (x < 0) x = ~x;  // fold negatives like uint_to_uniform_float
  return static_cast<float>(x) * 4.6566127342e-10f;
}

}  // namespace seqpar
