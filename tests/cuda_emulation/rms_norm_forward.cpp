// The CUDA residual add + RMSNorm forward kernels (csrc/rms_norm.cu) run under host emulation (shim.h),
// launched as add_rms_norm_fwd launches them, with every plan its launch chooses from (fwd_candidates):
// residual_out bitwise equal to the same float addition done here, rstd and y (HF LlamaRMSNorm's rounding:
// normalise, round, scale) against float64. Every kind of kernel: warp per row, block per row (1, 2 and 4
// vectors a thread), chunked rows, with and without a residual, 16-byte and scalar (VEC = 1) accesses,
// strided input rows.
#include "shim.h"
#include "check.h"
#include "rms_norm.cu"

#include <cstdio>
#include <cstring>
#include <random>

using namespace seqpar;
using namespace seqpar::rmsnorm;

template <typename T, int VEC>
const char* launch_forward(const Plan& plan, const FwdArgs& a, int64_t rows) {
  dispatch_plan<true, VEC>(plan, [&](auto vpt, auto kind) {
    launch({static_cast<unsigned>(cdiv(rows, plan.rpb)), 1, 1},
           {static_cast<unsigned>(plan.tpr), static_cast<unsigned>(plan.rpb), 1},
           [&] { fwd_kernel<T, VEC, decltype(vpt)::value, decltype(kind)::value>(a, plan.chunks); });
  });
  return plan.kind == RowKind::kWarp ? "warp" : plan.kind == RowKind::kBlock ? "block" : "chunk";
}

template <typename T, int VEC>
int check_plan(const Plan& plan, int64_t rows, int64_t h, int64_t stride, bool has_res) {
  std::mt19937 gen(static_cast<unsigned>(23 + h + rows));
  std::normal_distribution<float> normal;
  std::vector<T> x(rows * stride), res(rows * stride);
  std::vector<T> y(rows * h, from_float<T>(NAN)), ro(rows * h, from_float<T>(NAN));
  std::vector<float> w(h), rstd(rows, NAN);
  for (auto* t : {&x, &res})
    for (auto& v : *t) v = from_float<T>(normal(gen));
  for (auto& v : w) v = 1.0f + 0.1f * normal(gen);
  const FwdArgs a{x.data(), has_res ? res.data() : nullptr, w.data(), y.data(), has_res ? ro.data() : nullptr,
                  rstd.data(), kFloat32, rows, h, stride, stride, 1e-6f};
  const char* kind = launch_forward<T, VEC>(plan, a, rows);
  Tally tally;
  for (int64_t r = 0; r < rows; ++r) {
    std::vector<T> want_ro(h);
    double ss = 0;
    for (int64_t c = 0; c < h; ++c) {
      want_ro[c] = has_res ? from_float<T>(to_float(x[r * stride + c]) + to_float(res[r * stride + c]))
                           : x[r * stride + c];
      ss += double(to_float(want_ro[c])) * to_float(want_ro[c]);
      if (has_res && std::memcmp(&want_ro[c], &ro[r * h + c], sizeof(T)) != 0 && tally.count())
        printf("  row %ld col %ld: residual_out %g (want %g, bitwise)\n", long(r), long(c), to_float(ro[r * h + c]),
               to_float(want_ro[c]));
    }
    const double inv = 1.0 / std::sqrt(ss / h + 1e-6);
    if (tally.off(rstd[r] / inv, 1.0, 1e-5))
      printf("  row %ld: rstd %g (want %g)\n", long(r), rstd[r], inv);
    for (int64_t c = 0; c < h; ++c) {
      const double n = to_float(from_float<T>(static_cast<float>(to_float(want_ro[c]) * inv)));  // HF: round first
      const double want = n * w[c];
      if (tally.off(to_float(y[r * h + c]), want, output_tolerance<T>()))
        printf("  row %ld col %ld: y %g (want %g)\n", long(r), long(c), to_float(y[r * h + c]), want);
    }
  }
  printf("%s %-5s VEC=%d VPT=%d rows=%ld h=%ld stride=%ld residual=%d: worst relative error %.2g, %d bad\n",
         sizeof(T) == 2 ? "16-bit" : "fp32  ", kind, VEC, plan.vpt, long(rows), long(h), long(stride), has_res,
         tally.worst, tally.bad);
  return tally.bad;
}

// Every plan the launch chooses from (fwd_candidates: a block per row with 1, 2, 4 vectors a thread).
template <typename T, int VEC>
int check(int64_t rows, int64_t h, int64_t stride, bool has_res) {
  int bad = 0;
  for (const Plan& plan : fwd_candidates(h, VEC)) bad += check_plan<T, VEC>(plan, rows, h, stride, has_res);
  return bad;
}

int main() {
  int bad = 0;
  bad += check<__nv_bfloat16, 8>(9, 1024, 1032, true);     // warp per row, 4 rows per block
  bad += check<float, 4>(6, 200, 200, false);              // warp per row, no residual
  bad += check<__nv_bfloat16, 8>(3, 4096, 4096, true);     // block per row
  bad += check<__half, 8>(2, 16384, 16392, true);          // block per row, 2 vectors a thread
  bad += check<__nv_bfloat16, 8>(2, 10000, 10000, true);   // 1250 vectors: the last threads' past the row
  bad += check<__nv_bfloat16, 1>(3, 1001, 1003, true);     // scalar (VEC = 1)
  bad += check<__nv_bfloat16, 8>(2, 40000, 40000, true);   // chunked rows
  bad += check<float, 1>(2, 5003, 5007, false);            // scalar, chunked, no residual
  printf(bad ? "FAILED\n" : "ALL OK\n");
  return bad != 0;
}
