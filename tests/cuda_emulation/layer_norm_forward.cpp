// The CUDA bias-dropout-add + LayerNorm forward kernels (csrc/bias_dropout_add_layer_norm.cu) run under host
// emulation (shim.h), launched as bias_dropout_add_layer_norm_fwd launches them (its plan, its kernels):
// residual_out bitwise equal to the same float operations done here (the backends' contract), mean / rstd and
// y against float64. Every kind of kernel: warp per row, block per row, column-chunked rows (h > 16384), with
// 16-byte and scalar runs, strided input rows, dropout on and off.
#include "shim.h"
#include "check.h"
#include "bias_dropout_add_layer_norm.cu"

#include <cstdio>
#include <cstring>
#include <random>

using namespace seqpar;
using namespace seqpar::bdaln;

template <typename T, int VEC>
const char* launch_forward(const FwdArgs& a, int64_t rows, int64_t h) {
  const Plan plan = fwd_plan(h, VEC, kVectorRun<T, VEC>);
  dispatch_plan<true, T, VEC>(plan, [&](auto vpt, auto kind) {
    launch({static_cast<unsigned>(cdiv(rows, plan.rpb)), 1, 1},
           {static_cast<unsigned>(plan.tpr), static_cast<unsigned>(plan.rpb), 1},
           [&] { fwd_kernel<T, VEC, decltype(vpt)::value, decltype(kind)::value>(a, plan.chunks); });
  });
  return plan.kind == RowKind::kWarp ? "warp" : plan.kind == RowKind::kBlock ? "block" : "chunk";
}

template <typename T, int VEC>
int check(int64_t rows, int64_t h, int64_t stride, int threshold, bool bias) {
  const uint64_t seed = 0x1234ABCDULL;
  const int64_t row_offset = 5;
  std::mt19937 gen(static_cast<unsigned>(17 + h + rows));
  std::normal_distribution<float> normal;
  std::vector<T> x(rows * stride), res(rows * stride), b_add(h);
  std::vector<T> y(rows * h, from_float<T>(NAN)), ro(rows * h, from_float<T>(NAN));
  std::vector<float> w(h), b(h), mean(rows, NAN), rstd(rows, NAN);
  for (auto* t : {&x, &res, &b_add})
    for (auto& v : *t) v = from_float<T>(normal(gen));
  for (auto& v : w) v = 1.0f + 0.1f * normal(gen);
  for (auto& v : b) v = 0.1f * normal(gen);
  const float scale = threshold ? dropout_scale(threshold) : 1.0f;
  const FwdArgs a{x.data(), bias ? b_add.data() : nullptr, res.data(), w.data(), b.data(), y.data(), ro.data(),
                  mean.data(), rstd.data(), kFloat32, rows, h, stride, stride, 1e-5f, scale,
                  static_cast<uint32_t>(threshold) << 24, seed, row_offset};
  const char* kind = launch_forward<T, VEC>(a, rows, h);
  Tally tally;
  for (int64_t r = 0; r < rows; ++r) {
    std::vector<T> want_ro(h);
    double s = 0;
    for (int64_t c = 0; c < h; ++c) {
      float v = to_float(x[r * stride + c]);
      if (bias) v = v + to_float(b_add[c]);
      if (threshold) {
        const MaskWords m = mask_words(seed, static_cast<uint64_t>(row_offset + r), static_cast<uint32_t>(c / 16));
        v = keep_byte(m.w[(c % 16) / 4], (c % 16) % 4, static_cast<uint32_t>(threshold) << 24) ? v * scale : 0.0f;
      }
      want_ro[c] = from_float<T>(to_float(res[r * stride + c]) + v);
      s += to_float(want_ro[c]);
      if (std::memcmp(&want_ro[c], &ro[r * h + c], sizeof(T)) != 0 && tally.count())
        printf("  row %ld col %ld: residual_out %g (want %g, bitwise)\n", long(r), long(c), to_float(ro[r * h + c]),
               to_float(want_ro[c]));
    }
    const double m = s / h;
    double ss = 0;
    for (int64_t c = 0; c < h; ++c) ss += (to_float(want_ro[c]) - m) * (to_float(want_ro[c]) - m);
    const double inv = 1.0 / std::sqrt(ss / h + 1e-5);
    const bool mean_off = tally.off(mean[r], m, 1e-5), rstd_off = tally.off(rstd[r] / inv, 1.0, 1e-5);
    if (mean_off || rstd_off)
      printf("  row %ld: mean %g rstd %g (want %g %g)\n", long(r), mean[r], rstd[r], m, inv);
    for (int64_t c = 0; c < h; ++c) {
      const double want = (to_float(want_ro[c]) - m) * inv * w[c] + b[c];
      if (tally.off(to_float(y[r * h + c]), want, output_tolerance<T>()))
        printf("  row %ld col %ld: y %g (want %g)\n", long(r), long(c), to_float(y[r * h + c]), want);
    }
  }
  printf("%s %-5s VEC=%-2d rows=%ld h=%ld stride=%ld P=%d bias=%d: worst relative error %.2g, %d bad\n",
         sizeof(T) == 2 ? "16-bit" : "fp32  ", kind, VEC, long(rows), long(h), long(stride), threshold, bias,
         tally.worst, tally.bad);
  return tally.bad;
}

int main() {
  int bad = 0;
  bad += check<__nv_bfloat16, 8>(9, 1024, 1032, 26, true);   // warp per row (4 runs a lane), rows per block 4
  bad += check<float, 4>(6, 200, 200, 0, false);             // warp per row, lanes past the row
  bad += check<__nv_bfloat16, 8>(3, 4096, 4096, 26, true);   // block per row
  bad += check<__half, 8>(2, 12288, 12296, 128, true);       // block per row, 2 runs a thread
  bad += check<__half, 16>(3, 1001, 1003, 26, false);        // scalar runs, odd h
  bad += check<__nv_bfloat16, 8>(2, 20480, 20480, 26, true); // column-chunked (2 chunks)
  bad += check<float, 16>(2, 16385, 16387, 200, true);       // scalar runs, chunked
  printf(bad ? "FAILED\n" : "ALL OK\n");
  return bad != 0;
}
