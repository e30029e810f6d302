// The dropout mask of seqpar.random (host and device, so CI can check it bit for bit without a GPU):
//
//   (w0, w1, w2, w3) = Philox-4x32-7(key = seed, counter = (col / 16, row & 0xffffffff, row >> 32, 0))
//   keep(row, col)   = byte (col % 4) of w[(col % 16) / 4]  >=  P            P = round(p * 256)
//   kept values are scaled by float(256.0 / (256 - P))
//
// One Philox call gives the 16 decisions of a row's 16-column group: a kernel thread owns a run of 4, 8 or
// 16 contiguous columns of a group and calls mask_words once for them (mask_run picks the run's words).
// keep_byte tests one byte without extracting it: the byte moved to the top of the word compares against
// P << 24 exactly like the byte against P (the bytes below it can't change the outcome).
#pragma once
#include <cstdint>

#if defined(__CUDACC__)
#define SEQPAR_HD __host__ __device__ __forceinline__
#else
#define SEQPAR_HD inline
#endif

namespace seqpar {

constexpr int kMaskGroup = 16;  // mask columns per Philox call

struct MaskWords {
  uint32_t w[4];
};

SEQPAR_HD uint32_t mul_hi_u32(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__)
  return __umulhi(a, b);
#else
  return static_cast<uint32_t>((static_cast<uint64_t>(a) * b) >> 32);
#endif
}

// Philox-4x32 with `Rounds` rounds (Salmon et al., SC'11): multipliers 0xD2511F53 / 0xCD9E8D57, Weyl key
// increments 0x9E3779B9 / 0xBB67AE85; key = (key & 0xffffffff, key >> 32).
template <int Rounds = 7>
SEQPAR_HD MaskWords philox4x32(uint64_t key, uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3) {
  uint32_t k0 = static_cast<uint32_t>(key), k1 = static_cast<uint32_t>(key >> 32);
#pragma unroll
  for (int round = 0; round < Rounds; ++round) {
    const uint32_t hi_b = mul_hi_u32(0xCD9E8D57u, c2), lo_b = 0xCD9E8D57u * c2;
    const uint32_t hi_a = mul_hi_u32(0xD2511F53u, c0), lo_a = 0xD2511F53u * c0;
    c0 = hi_b ^ c1 ^ k0;
    c1 = lo_b;
    c2 = hi_a ^ c3 ^ k1;
    c3 = lo_a;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return {{c0, c1, c2, c3}};
}

// The 16 mask bytes of global row `row`, columns 16 * group .. 16 * group + 15.
SEQPAR_HD MaskWords mask_words(uint64_t seed, uint64_t row, uint32_t group) {
  return philox4x32<7>(seed, group, static_cast<uint32_t>(row), static_cast<uint32_t>(row >> 32), 0u);
}

// threshold24 = P << 24. Keep byte b (0..3) of `word`: (byte b) >= P.
SEQPAR_HD bool keep_byte(uint32_t word, int b, uint32_t threshold24) {
  return (word << (24 - 8 * b)) >= threshold24;
}

// The mask words of the run of N columns from col0 (N = 4, 8 or 16; col0 % N == 0) moved to the front, so that
// keep_column(run, i, ...) is column col0 + i for a constant i. `m` = mask_words(seed, row, col0 / 16).
template <int N>
SEQPAR_HD MaskWords mask_run(const MaskWords& m, uint64_t col0) {
  static_assert(N == 4 || N == 8 || N == 16, "a run is a quarter, half or whole 16-column group");
  if constexpr (N == 16) {
    return m;
  } else if constexpr (N == 8) {
    const bool upper = (col0 / 8) % 2;
    return {{upper ? m.w[2] : m.w[0], upper ? m.w[3] : m.w[1], 0u, 0u}};
  } else {
    const uint32_t quarter = (col0 / 4) % 4;
    const uint32_t low = quarter & 1 ? m.w[1] : m.w[0], high = quarter & 1 ? m.w[3] : m.w[2];
    return {{quarter & 2 ? high : low, 0u, 0u, 0u}};
  }
}

// Keep decision of the run's column i (constant i in 0 .. N - 1).
SEQPAR_HD bool keep_column(const MaskWords& run, int i, uint32_t threshold24) {
  return keep_byte(run.w[i / 4], i % 4, threshold24);
}

// The run's N decisions as bits 0 .. N - 1 (for a decision kept until a later pass).
template <int N>
SEQPAR_HD uint32_t keep_bits(const MaskWords& run, uint32_t threshold24) {
  uint32_t bits = 0;
#pragma unroll
  for (int i = 0; i < N; ++i) bits |= static_cast<uint32_t>(keep_column(run, i, threshold24)) << i;
  return bits;
}

// float(256 / (256 - P)): the quotient in double, rounded to float once (the value every backend uses).
inline float dropout_scale(int threshold) { return static_cast<float>(256.0 / (256 - threshold)); }

}  // namespace seqpar
