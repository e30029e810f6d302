// The CUDA bias-dropout-add + LayerNorm forward kernels (csrc/bias_dropout_add_layer_norm.cu) run under host
// emulation (shim.h), launched as bias_dropout_add_layer_norm_fwd launches them, with every plan its launch
// chooses from (fwd_candidates): residual_out bitwise equal to the same float operations done here (the
// backends' contract), mean / rstd and y against float64. Every kind of kernel: warp per row, block per row
// (1, 2 and 4 runs a thread), column-chunked rows (h > 16384), with 16-byte and scalar runs, strided input
// rows, dropout on and off; rows of one repeated value, exact. And the launch's choice among those plans
// (rows::resident_plan) on an occupancy model.
#include "shim.h"
#include "check.h"
#include "bias_dropout_add_layer_norm.cu"

#include <cstdio>
#include <cstring>
#include <random>

using namespace seqpar;
using namespace seqpar::bdaln;

template <typename T, int VEC>
const char* launch_forward(const Plan& plan, const FwdArgs& a, int64_t rows) {
  dispatch_plan<true, T, VEC>(plan, [&](auto vpt, auto kind) {
    launch({static_cast<unsigned>(cdiv(rows, plan.rpb)), 1, 1},
           {static_cast<unsigned>(plan.tpr), static_cast<unsigned>(plan.rpb), 1},
           [&] { fwd_kernel<T, VEC, decltype(vpt)::value, decltype(kind)::value>(a, plan.chunks); });
  });
  return plan.kind == RowKind::kWarp ? "warp" : plan.kind == RowKind::kBlock ? "block" : "chunk";
}

template <typename T, int VEC>
int check_plan(const Plan& plan, int64_t rows, int64_t h, int64_t stride, int threshold, bool bias) {
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
  const char* kind = launch_forward<T, VEC>(plan, a, rows);
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
  printf("%s %-5s VEC=%-2d VPT=%d rows=%ld h=%ld stride=%ld P=%d bias=%d: worst relative error %.2g, %d bad\n",
         sizeof(T) == 2 ? "16-bit" : "fp32  ", kind, VEC, plan.vpt, long(rows), long(h), long(stride), threshold,
         bias, tally.worst, tally.bad);
  return tally.bad;
}

// The fp32 forward of every plan (fwd_candidates) on rows x + residual (x, residual [rows, stride], no bias
// or dropout), y first filled with a finite value that no check accepts (a row left unwritten counts):
// the sum over plans of count(y, mean), each plan's printed after ``what``.
template <int VEC, typename Count>
int count_over_fp32_plans(int64_t rows, int64_t h, int64_t stride, float eps, const std::vector<float>& x,
                          const std::vector<float>& res, const std::vector<float>& w, const std::vector<float>& b,
                          const char* what, Count count) {
  std::vector<float> y(rows * h), ro(rows * h), mean(rows), rstd(rows);
  int bad = 0;
  for (const Plan& plan : fwd_candidates(h, VEC, kVectorRun<float, VEC>)) {
    std::fill(y.begin(), y.end(), 4321.0f);
    const FwdArgs a{x.data(), nullptr, res.data(), w.data(), b.data(), y.data(), ro.data(), mean.data(),
                    rstd.data(), kFloat32, rows, h, stride, stride, eps, 1.0f, 0u, 1ULL, 0};
    const char* kind = launch_forward<float, VEC>(plan, a, rows);
    const int plan_bad = count(y, mean);
    printf("fp32   %-5s VEC=%-2d VPT=%d h=%ld %s: %d\n", kind, VEC, plan.vpt, long(h), what, plan_bad);
    bad += plan_bad;
  }
  return bad;
}

// Rows of one repeated fp32 value at eps = 1e-12 (x = 0, no dropout): the corrected two-pass statistics give
// the value itself as the mean and y = b exactly; the plain mean is a few ulps (delta) off, which made
// x_hat = delta / sqrt(delta^2 + eps) = +-1.
template <int VEC>
int check_constant_rows(int64_t h, int64_t stride) {
  const float values[] = {1000.1f, -3.7f, 0.1f, 1e-3f, 777.77f, 12345.678f};
  const int64_t rows = sizeof(values) / sizeof(values[0]);
  std::vector<float> x(rows * stride, 0.0f), res(rows * stride), w(h), b(h);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < stride; ++c) res[r * stride + c] = values[r];
  for (int64_t c = 0; c < h; ++c) {
    w[c] = 1.0f + 0.01f * static_cast<float>(c % 7);
    b[c] = 0.1f * static_cast<float>(c % 5) - 0.2f;
  }
  return count_over_fp32_plans<VEC>(rows, h, stride, 1e-12f, x, res, w, b, "constant rows, eps 1e-12: values not exact",
                                    [&](const std::vector<float>& y, const std::vector<float>& mean) {
    int not_exact = 0;
    for (int64_t r = 0; r < rows; ++r) {
      not_exact += mean[r] != values[r];
      for (int64_t c = 0; c < h; ++c) not_exact += y[r * h + c] != b[c];
    }
    return not_exact;
  });
}

// Rows of finite values near 1e30 (a diverged residual stream): d * d overflows, the variance is inf - inf
// = NaN, and y must be NaN (as F.layer_norm and the torch reference give): fmaxf(var, 0) made it 0, rstd
// 1/sqrt(eps), and y a finite ~1e33 that no NaN check saw.
template <int VEC>
int check_overflowing_rows(int64_t h) {
  const int64_t rows = 2;
  std::vector<float> x(rows * h), res(rows * h, 0.0f), w(h, 1.0f), b(h, 0.0f);
  std::mt19937 gen(5);
  std::normal_distribution<float> normal;
  for (auto& v : x) v = normal(gen) * 1e30f;
  return count_over_fp32_plans<VEC>(rows, h, h, 1e-5f, x, res, w, b, "rows of ~1e30: finite y (want 0: NaN variance)",
                                    [](const std::vector<float>& y, const std::vector<float>&) {
    int finite = 0;
    for (float v : y) finite += std::isfinite(v);
    return finite;
  });
}

// Every plan the launch chooses from (fwd_candidates: a block per row with 1, 2, 4 vectors a thread).
template <typename T, int VEC>
int check(int64_t rows, int64_t h, int64_t stride, int threshold, bool bias) {
  int bad = 0;
  for (const Plan& plan : fwd_candidates(h, VEC, kVectorRun<T, VEC>))
    bad += check_plan<T, VEC>(plan, rows, h, stride, threshold, bias);
  return bad;
}

// rows::resident_plan with an occupancy model of an H100 / H200 SM (65536 registers allocated per warp in
// units of 256, 2048 threads) and ptxas's register counts of the 2-byte forward kernels (VPT 1, 2, 4: 36,
// 50, 68): the most threads per row that leave two blocks resident, else the most blocks.
int check_resident_plan() {
  const auto blocks_per_sm = [](const Plan& p) {
    const int regs = p.vpt == 1 ? 36 : p.vpt == 2 ? 50 : 68, warps = p.tpr * p.rpb / kWarp;
    const int per_warp = (regs * kWarp + 255) / 256 * 256;
    return std::min(65536 / (per_warp * warps), 2048 / (p.tpr * p.rpb));
  };
  int bad = 0;
  const struct { int64_t h; int vpt, tpr; } want[] = {
      {4096, 1, 512},    // 3 blocks of 512 x 1
      {8192, 2, 512},    // 1024 x 1: one block; 512 x 2: two
      {12288, 4, 384},   // 768 x 2: one block; 384 x 4: two
      {16384, 2, 1024},  // one block either way: the most threads
  };
  for (const auto& w : want) {
    const Plan plan = resident_plan(fwd_plan(w.h, 8, true), cdiv(w.h, 8), fwd_block_max_vpt(8), blocks_per_sm);
    const bool ok = plan.kind == RowKind::kBlock && plan.vpt == w.vpt && plan.tpr == w.tpr;
    printf("resident_plan h=%ld: %d threads x %d runs (want %d x %d)%s\n", long(w.h), plan.tpr, plan.vpt, w.tpr,
           w.vpt, ok ? "" : "  WRONG");
    bad += !ok;
  }
  return bad;
}

int main() {
  int bad = check_resident_plan();
  bad += check<__nv_bfloat16, 8>(9, 1024, 1032, 26, true);   // warp per row (4 runs a lane), rows per block 4
  bad += check<float, 4>(6, 200, 200, 0, false);             // warp per row, lanes past the row
  bad += check<__nv_bfloat16, 8>(3, 4096, 4096, 26, true);   // block per row
  bad += check<__half, 8>(2, 12288, 12296, 128, true);       // block per row, 2 runs a thread
  bad += check<__nv_bfloat16, 8>(2, 10000, 10008, 26, false); // 1250 runs: the last threads' runs past the row
  bad += check<__half, 16>(3, 1001, 1003, 26, false);        // scalar runs, odd h
  bad += check<__nv_bfloat16, 8>(2, 20480, 20480, 26, true); // column-chunked (2 chunks)
  bad += check<float, 16>(2, 16385, 16387, 200, true);       // scalar runs, chunked
  bad += check_constant_rows<4>(200, 200);                   // warp per row
  bad += check_constant_rows<4>(1000, 1000);                 // block per row
  bad += check_constant_rows<16>(1001, 1003);                // scalar runs
  bad += check_constant_rows<16>(16385, 16387);              // column-chunked
  bad += check_overflowing_rows<4>(200);                     // warp per row
  bad += check_overflowing_rows<4>(4096);                    // block per row
  bad += check_overflowing_rows<4>(20480);                   // column-chunked
  printf(bad ? "FAILED\n" : "ALL OK\n");
  return bad != 0;
}
