// The CUDA dropout kernel (csrc/dropout.cu) run under host emulation (shim.h) with the entry point's block
// (dropout_block): y = keep ? x * scale : 0 against the mask drawn here per column (mask_words / keep_byte),
// bitwise, for short and long rows, 16-byte and scalar accesses, rows past 2**32 (the counter's high word);
// and with the optional bias and residual (bias_dropout_add's forward in one pass):
// y = round(residual + round(keep ? round(x + bias) * scale : 0)), each sum and product computed exactly in
// fp64 and rounded as the torch reference rounds it (to its fp32 result, then to T), dropped inf and NaN
// adding exactly 0.
#include "shim.h"
#include "check.h"
#include "dropout.cu"

#include <cstdio>
#include <cstring>
#include <random>
#include <type_traits>

using namespace seqpar;

// The torch reference's rounding of an exact (fp64) sum or product of T values and the fp32 scale: its fp32 op
// rounds it to float, the store to T (a second rounding for fp16 / bf16).
template <typename T>
T round_to(double v) {
  return from_float<T>(static_cast<float>(v));
}

template <typename T, bool kBias, bool kResidual>
int check(int64_t rows, int64_t cols, int threshold, int64_t row_offset, bool vectorized, bool specials = false) {
  const uint64_t seed = (uint64_t(1) << 40) + 99;
  std::mt19937 gen(static_cast<unsigned>(31 + rows * cols));
  std::normal_distribution<float> normal;
  std::vector<T> x(rows * cols), y(rows * cols, from_float<T>(NAN)), bias(cols), residual(rows * cols);
  for (auto& v : x) v = from_float<T>(normal(gen));
  for (auto& v : bias) v = from_float<T>(normal(gen));
  for (auto& v : residual) v = from_float<T>(4.0f * normal(gen));
  if (specials)  // inf, -inf and NaN in x: dropped ones add exactly 0, kept ones pass through
    for (int64_t i = 0; i < rows * cols; i += 5) x[i] = from_float<T>(i % 3 == 0 ? INFINITY : i % 3 == 1 ? -INFINITY : NAN);
  const float scale = dropout_scale(threshold);
  const dim3 block = dropout_block(cols);
  launch({static_cast<unsigned>((rows + block.y - 1) / block.y), 1, 1}, {block.x, block.y, 1}, [&] {
    dropout_rows_kernel<T, kBias, kResidual>(x.data(), kBias ? bias.data() : nullptr,
                                             kResidual ? residual.data() : nullptr, y.data(), rows, cols, seed,
                                             row_offset, static_cast<uint32_t>(threshold) << 24, scale, vectorized);
  });
  Tally tally;
  int64_t kept = 0;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      const MaskWords m = mask_words(seed, static_cast<uint64_t>(row_offset + r), static_cast<uint32_t>(c / 16));
      const bool keep = keep_byte(m.w[(c % 16) / 4], (c % 16) % 4, static_cast<uint32_t>(threshold) << 24);
      kept += keep;
      double a = to_float(x[r * cols + c]);
      if (kBias) a = to_float(round_to<T>(a + double(to_float(bias[c]))));
      T want = round_to<T>(keep ? a * double(scale) : 0.0);
      if (kResidual) want = round_to<T>(double(to_float(residual[r * cols + c])) + double(to_float(want)));
      const float got = to_float(y[r * cols + c]);
      const bool same = std::isnan(to_float(want)) ? std::isnan(got) : std::memcmp(&want, &y[r * cols + c], sizeof(T)) == 0;
      if (!same && tally.count())
        printf("  row %ld col %ld: %g (want %g, bitwise)\n", long(r), long(c), got, to_float(want));
    }
  const double kept_fraction = double(kept) / double(rows * cols), want_fraction = (256.0 - threshold) / 256.0;
  if (std::fabs(kept_fraction - want_fraction) > 0.05 && tally.count())
    printf("  kept %.3f of the elements (want about %.3f)\n", kept_fraction, want_fraction);
  printf("%s rows=%ld cols=%ld P=%d row_offset=%ld vectorized=%d bias=%d residual=%d specials=%d (block %u x %u): "
         "kept %.3f, %d bad\n", sizeof(T) == 4 ? "fp32" : std::is_same_v<T, __half> ? "fp16" : "bf16", long(rows),
         long(cols), threshold, long(row_offset), vectorized, kBias, kResidual, specials, block.x, block.y,
         kept_fraction, tally.bad);
  return tally.bad;
}

int main() {
  int bad = 0;
  bad += check<__nv_bfloat16, false, false>(37, 48, 26, 0, true);                // 3 groups a row: 8 rows a block
  bad += check<float, false, false>(5, 5000, 128, (int64_t(1) << 32) - 2, true); // rows across 2**32; 313 groups
  bad += check<__half, false, false>(7, 1001, 77, 3, false);                     // scalar accesses, a ragged group
  // bias and residual, each alone and together, in every dtype; 16-byte and scalar accesses, ragged rows
  bad += check<__nv_bfloat16, true, true>(37, 48, 26, 0, true);
  bad += check<__half, true, true>(9, 200, 77, 5, true);
  bad += check<float, true, true>(5, 1003, 128, (int64_t(1) << 32) - 2, false);
  bad += check<__nv_bfloat16, true, false>(7, 1001, 26, 3, false);
  bad += check<float, false, true>(11, 40, 200, 0, true);
  bad += check<__half, true, false>(6, 64, 128, 0, true, true);                  // inf / NaN in x
  bad += check<__nv_bfloat16, true, true>(6, 72, 128, 1, false, true);
  bad += check<float, true, true>(6, 64, 128, 2, true, true);
  printf(bad ? "FAILED\n" : "ALL OK\n");
  return bad != 0;
}
