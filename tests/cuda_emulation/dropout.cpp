// The CUDA dropout kernel (csrc/dropout.cu) run under host emulation (shim.h) with the entry point's block
// (dropout_block): y = keep ? x * scale : 0 against the mask drawn here per column (mask_words / keep_byte),
// bitwise, for short and long rows, 16-byte and scalar accesses, rows past 2**32 (the counter's high word).
#include "shim.h"
#include "check.h"
#include "dropout.cu"

#include <cstdio>
#include <cstring>
#include <random>

using namespace seqpar;

template <typename T>
int check(int64_t rows, int64_t cols, int threshold, int64_t row_offset, bool vectorized) {
  const uint64_t seed = (uint64_t(1) << 40) + 99;
  std::mt19937 gen(static_cast<unsigned>(31 + rows * cols));
  std::normal_distribution<float> normal;
  std::vector<T> x(rows * cols), y(rows * cols, from_float<T>(NAN));
  for (auto& v : x) v = from_float<T>(normal(gen));
  const float scale = dropout_scale(threshold);
  const dim3 block = dropout_block(cols);
  launch({static_cast<unsigned>((rows + block.y - 1) / block.y), 1, 1}, {block.x, block.y, 1}, [&] {
    dropout_rows_kernel<T>(x.data(), y.data(), rows, cols, seed, row_offset, static_cast<uint32_t>(threshold) << 24,
                           scale, vectorized);
  });
  Tally tally;
  int64_t kept = 0;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      const MaskWords m = mask_words(seed, static_cast<uint64_t>(row_offset + r), static_cast<uint32_t>(c / 16));
      const bool keep = keep_byte(m.w[(c % 16) / 4], (c % 16) % 4, static_cast<uint32_t>(threshold) << 24);
      kept += keep;
      const T want = from_float<T>(keep ? to_float(x[r * cols + c]) * scale : 0.0f);
      if (std::memcmp(&want, &y[r * cols + c], sizeof(T)) != 0 && tally.count())
        printf("  row %ld col %ld: %g (want %g, bitwise)\n", long(r), long(c), to_float(y[r * cols + c]),
               to_float(want));
    }
  const double kept_fraction = double(kept) / double(rows * cols), want_fraction = (256.0 - threshold) / 256.0;
  if (std::fabs(kept_fraction - want_fraction) > 0.05 && tally.count())
    printf("  kept %.3f of the elements (want about %.3f)\n", kept_fraction, want_fraction);
  printf("%s rows=%ld cols=%ld P=%d row_offset=%ld vectorized=%d (block %u x %u): kept %.3f, %d bad\n",
         sizeof(T) == 2 ? "16-bit" : "fp32  ", long(rows), long(cols), threshold, long(row_offset), vectorized,
         block.x, block.y, kept_fraction, tally.bad);
  return tally.bad;
}

int main() {
  int bad = 0;
  bad += check<__nv_bfloat16>(37, 48, 26, 0, true);                      // 3 groups a row: 8 rows a block
  bad += check<float>(5, 5000, 128, (int64_t(1) << 32) - 2, true);       // rows across 2**32; 313 groups
  bad += check<__half>(7, 1001, 77, 3, false);                           // scalar accesses, a ragged group
  printf(bad ? "FAILED\n" : "ALL OK\n");
  return bad != 0;
}
