// The CUDA causal-mask + softmax + dropout kernels of the non-flash attention core (csrc/softmax_dropout.cu)
// run under host emulation (shim.h) with the entry points' thread counts (dispatch_threads), against float64:
// probabilities, dropped probabilities (the head-major dropout rows, mask drawn here per column), and the
// backward's score gradient; causal and not, dropout on and off, rows with +inf / -inf scores (read as
// +-FLT_MAX: the +inf entries share the row's mass), 16-byte and scalar accesses.
#include "shim.h"
#include "check.h"
#include "softmax_dropout.cu"

#include <cfloat>
#include <cstdio>
#include <random>

using namespace seqpar;

template <typename T>
int check(int64_t batch, int64_t heads, int64_t s_q, int64_t s_k, bool causal, int threshold) {
  const uint64_t seed = 0x5EEDULL, row_offset = 11;
  const int64_t rows = batch * heads * s_q;
  std::mt19937 gen(static_cast<unsigned>(37 + rows * s_k));
  std::normal_distribution<float> normal;
  std::vector<T> scores(rows * s_k), probs(rows * s_k, from_float<T>(NAN)), grad(rows * s_k),
      regenerated(rows * s_k, from_float<T>(NAN));
  for (auto& v : scores) v = from_float<T>(3.0f * normal(gen));
  scores[0] = from_float<T>(INFINITY);                                   // row 0: column 0 takes the mass...
  if (!causal && rows > 1)
    for (int64_t j = 0; j < s_k; ++j) scores[s_k + j] = from_float<T>(-INFINITY);  // row 1: uniform
  for (auto& v : grad) v = from_float<T>(normal(gen));
  const std::vector<T> x = scores, grad_in = grad;
  const bool dropout = threshold > 0;
  // 16-byte accesses where the entry points would take them
  const bool vectorized = rows_aligned<T>(s_k, {reinterpret_cast<uintptr_t>(scores.data()),
                                                reinterpret_cast<uintptr_t>(probs.data()),
                                                reinterpret_cast<uintptr_t>(grad.data()),
                                                reinterpret_cast<uintptr_t>(regenerated.data())});
  const float scale = dropout ? dropout_scale(threshold) : 1.0f;
  const uint32_t threshold24 = static_cast<uint32_t>(threshold) << 24;
  dispatch_threads(s_k, [&](auto threads) {
    constexpr int kThreads = decltype(threads)::value;
    launch({static_cast<unsigned>(rows), 1, 1}, {kThreads, 1, 1}, [&] {
      softmax_dropout_fwd_kernel<T, kThreads>(scores.data(), probs.data(), batch, heads, s_q, s_k, causal, seed,
                                              row_offset, threshold24, scale, vectorized);
    });
    launch({static_cast<unsigned>(rows), 1, 1}, {kThreads, 1, 1}, [&] {
      softmax_dropout_bwd_kernel<T, kThreads>(probs.data(), grad.data(), dropout ? regenerated.data() : nullptr,
                                              batch, heads, s_q, s_k, causal, seed, row_offset, threshold24, scale,
                                              vectorized);
    });
  });
  const double tol = output_tolerance<T>();
  Tally tally;
  for (int64_t row = 0; row < rows; ++row) {
    const int64_t i = row % s_q, bh = row / s_q, b_idx = bh / heads, h_idx = bh % heads;
    const int64_t valid = causal ? std::min(i + 1, s_k) : s_k;
    const uint64_t drop_row = row_offset + (h_idx * batch + b_idx) * s_q + i;  // head-major
    double m = -INFINITY;
    std::vector<double> xs(s_k);
    for (int64_t j = 0; j < valid; ++j) {
      const float v = to_float(x[row * s_k + j]);
      xs[j] = std::isinf(v) ? std::copysign(double(FLT_MAX), v) : v;
      m = std::max(m, xs[j]);
    }
    double l = 0;
    for (int64_t j = 0; j < valid; ++j) l += std::exp(xs[j] - m);
    double dot = 0;
    std::vector<double> keep_scale(s_k, 0.0);
    for (int64_t j = 0; j < valid; ++j) {
      bool keep = true;
      if (dropout) {
        const MaskWords mw = mask_words(seed, drop_row, static_cast<uint32_t>(j / 16));
        keep = keep_byte(mw.w[(j % 16) / 4], (j % 16) % 4, threshold24);
      }
      keep_scale[j] = keep ? scale : 0.0;
      dot += to_float(grad_in[row * s_k + j]) * keep_scale[j] * to_float(probs[row * s_k + j]);
    }
    for (int64_t j = 0; j < s_k; ++j) {
      const double p = j < valid ? std::exp(xs[j] - m) / l : 0.0;
      const double prob = to_float(probs[row * s_k + j]);  // the rounded probability the kernels pass on
      const double want_grad = j < valid ? prob * (to_float(grad_in[row * s_k + j]) * keep_scale[j] - dot) : 0.0;
      if (tally.off(prob, p, tol))
        printf("  row %ld col %ld: P %g (want %g)\n", long(row), long(j), prob, p);
      const bool dropped_off = dropout && tally.off(to_float(scores[row * s_k + j]), prob * keep_scale[j], tol);
      if (dropout && (tally.off(to_float(regenerated[row * s_k + j]), prob * keep_scale[j], tol) || dropped_off))
        printf("  row %ld col %ld: dropped %g, regenerated %g (want %g)\n", long(row), long(j),
               to_float(scores[row * s_k + j]), to_float(regenerated[row * s_k + j]), prob * keep_scale[j]);
      if (tally.off(to_float(grad[row * s_k + j]), want_grad, tol))
        printf("  row %ld col %ld: dL/dx %g (want %g)\n", long(row), long(j), to_float(grad[row * s_k + j]),
               want_grad);
    }
  }
  printf("%s b=%ld H=%ld s_q=%ld s_k=%ld causal=%d P=%d vectorized=%d: worst relative error %.2g, %d bad\n",
         sizeof(T) == 2 ? "16-bit" : "fp32  ", long(batch), long(heads), long(s_q), long(s_k), causal, threshold,
         vectorized, tally.worst, tally.bad);
  return tally.bad;
}

// One row with a NaN score at column 1: every probability is NaN, as torch's softmax gives, whichever thread
// holds the NaN. The block reduction dropped a thread whose only valid columns were NaN (its max stayed
// -inf, which the combine read as an empty thread): at s_k = 4 the row came out [1/3, NaN, 1/3, 1/3].
template <typename T>
int check_nan_row(int64_t s_k, bool causal) {
  std::vector<T> scores(s_k, from_float<T>(0.5f)), probs(s_k, from_float<T>(-1.0f));
  scores[1] = from_float<T>(NAN);
  dispatch_threads(s_k, [&](auto threads) {
    constexpr int kThreads = decltype(threads)::value;
    launch({1, 1, 1}, {kThreads, 1, 1}, [&] {
      softmax_dropout_fwd_kernel<T, kThreads>(scores.data(), probs.data(), 1, 1, causal ? s_k : 1, s_k, causal,
                                              5, 0, 0, 1.0f, false);
    });
  });
  // causal with s_q = s_k: the launch covers row 0 only, whose one valid column (0) holds no NaN
  int bad = 0;
  for (int64_t j = 0; j < s_k; ++j) {
    const float p = to_float(probs[j]);
    const bool want_nan = !causal;
    const bool ok = want_nan ? std::isnan(p) : (j == 0 ? p == 1.0f : p == 0.0f);
    if (!ok) {
      printf("  NaN row s_k=%ld causal=%d col %ld: P %g (want %s)\n", long(s_k), causal, long(j), p,
             want_nan ? "NaN" : (j == 0 ? "1" : "0"));
      ++bad;
    }
  }
  printf("NaN score at column 1, s_k=%ld causal=%d: %d bad\n", long(s_k), causal, bad);
  return bad;
}

int main() {
  int bad = 0;
  for (int64_t s_k : {4, 40, 300}) bad += check_nan_row<float>(s_k, false);
  bad += check_nan_row<__nv_bfloat16>(33, false);
  bad += check_nan_row<float>(4, true);
  bad += check<__half>(2, 3, 5, 40, true, 26);          // 32 threads, a ragged group, head-major drop rows
  bad += check<float>(1, 2, 3, 300, false, 128);        // 128 threads; rows of -inf
  bad += check<__nv_bfloat16>(1, 1, 4, 37, true, 0);    // dropout off, scalar accesses (rows not 16-byte aligned)
  bad += check<__nv_bfloat16>(1, 1, 2, 2104, true, 77); // 256 threads
  bad += check<__half>(1, 1, 2, 2100, false, 77);       // 256 threads, scalar accesses
  printf(bad ? "FAILED\n" : "ALL OK\n");
  return bad != 0;
}
