// The CUDA residual add + RMSNorm backward kernels (csrc/rms_norm.cu) run under host emulation (shim.h),
// launched as add_rms_norm_bwd launches them (its plan, its kernels), against a float64 reference of the
// math: grad_x (and its copy grad_residual), with and without grad_residual_out, strided residual_out rows,
// and the weight gradient from the kernels' partial rows. Every kind of kernel: warp per row, block per row,
// and the row-sum pass + column-chunk blocks of long rows.
#include "shim.h"
#include "check.h"
#include "rms_norm.cu"

#include <cstdio>
#include <random>

using namespace seqpar;
using namespace seqpar::rmsnorm;

// Launches as add_rms_norm_bwd does (its plan, its kernels) and returns the kind it took.
template <typename T, int VEC>
const char* launch_backward(const BwdArgs& a, int64_t rows, int64_t h, int64_t num_partials) {
  const Plan plan = bwd_plan(h, VEC);
  if (plan.kind == RowKind::kChunked) {
    std::vector<float> row_sums(rows, NAN);
    launch({static_cast<unsigned>(rows), 1, 1}, {kRowSumThreads, 1, 1},
           [&] { bwd_row_sums_kernel<T, VEC>(a, row_sums.data()); });
    launch({static_cast<unsigned>(column_chunks(h, VEC)), static_cast<unsigned>(num_partials), 1},
           {kColumnThreads, 1, 1}, [&] { bwd_columns_kernel<T, VEC>(a, row_sums.data()); });
    return "long";
  }
  dispatch_plan<false, VEC>(plan, [&](auto vpt, auto kind) {
    launch({static_cast<unsigned>(num_partials), 1, 1},
           {static_cast<unsigned>(plan.tpr), static_cast<unsigned>(plan.rpb), 1},
           [&] { bwd_kernel<T, VEC, decltype(vpt)::value, decltype(kind)::value>(a); });
  });
  return plan.kind == RowKind::kWarp ? "warp" : "block";
}

template <typename T, int VEC>
int check(int64_t rows, int64_t h, int64_t stride_ro, bool has_gro, bool has_gres, int64_t num_partials,
          bool weight_sum = true) {
  std::mt19937 gen(static_cast<unsigned>(11 + h + rows));
  std::normal_distribution<float> normal;
  std::vector<T> ro(rows * stride_ro), gy(rows * h), gro(rows * h);
  std::vector<T> gx(rows * h, from_float<T>(NAN)), gres(rows * h, from_float<T>(NAN));
  std::vector<float> w(h), rstd(rows);
  for (auto* t : {&ro, &gy, &gro})
    for (auto& v : *t) v = from_float<T>(normal(gen));
  for (auto& v : w) v = 1.0f + 0.1f * normal(gen);
  for (int64_t r = 0; r < rows; ++r) {
    double ss = 0;
    for (int64_t c = 0; c < h; ++c) ss += double(to_float(ro[r * stride_ro + c])) * to_float(ro[r * stride_ro + c]);
    rstd[r] = static_cast<float>(1.0 / std::sqrt(ss / h + 1e-6));
  }
  std::vector<float> parts(num_partials * h, NAN);
  const BwdArgs a{gy.data(), has_gro ? gro.data() : nullptr, ro.data(), w.data(), rstd.data(), gx.data(),
                  has_gres ? gres.data() : nullptr, weight_sum ? parts.data() : nullptr, kFloat32, rows, h,
                  stride_ro};  // part_w nullptr: a frozen weight (a write through it would crash the run)
  const char* kind = launch_backward<T, VEC>(a, rows, h, num_partials);
  Tally tally;
  std::vector<double> dw(h, 0);
  for (int64_t r = 0; r < rows; ++r) {
    double dot = 0;
    for (int64_t c = 0; c < h; ++c)
      dot += double(to_float(gy[r * h + c])) * w[c] * to_float(ro[r * stride_ro + c]) * rstd[r];
    for (int64_t c = 0; c < h; ++c) {
      const double n = double(to_float(ro[r * stride_ro + c])) * rstd[r], dy = to_float(gy[r * h + c]);
      const double want = rstd[r] * (dy * w[c] - n * dot / h) + (has_gro ? to_float(gro[r * h + c]) : 0.0);
      dw[c] += dy * n;
      const bool res_off = has_gres && tally.off(to_float(gres[r * h + c]), want, output_tolerance<T>());
      if (tally.off(to_float(gx[r * h + c]), want, output_tolerance<T>()) || res_off)
        printf("  row %ld col %ld: grad_x %g grad_residual %g (want %g)\n", long(r), long(c), to_float(gx[r * h + c]),
               has_gres ? to_float(gres[r * h + c]) : NAN, want);
    }
  }
  for (int64_t c = 0; weight_sum && c < h; ++c) {
    double s = 0;
    for (int64_t p = 0; p < num_partials; ++p) s += parts[p * h + c];
    if (tally.off(s, dw[c], 1e-3))  // fp32 sums of differently ordered terms
      printf("  weight gradient col %ld: %g (want %g)\n", long(c), s, dw[c]);
  }
  printf("%s %-5s VEC=%d rows=%ld h=%ld stride=%ld gro=%d gres=%d dw=%d partials=%ld: worst relative error "
         "%.2g, %d bad\n", sizeof(T) == 2 ? "16-bit" : "fp32  ", kind, VEC, long(rows), long(h), long(stride_ro),
         has_gro, has_gres, weight_sum, long(num_partials), tally.worst, tally.bad);
  return tally.bad;
}

int main() {
  int bad = 0;
  bad += check<__nv_bfloat16, 8>(33, 512, 512, true, true, 2);      // warp per row
  bad += check<__half, 8>(17, 96, 104, false, true, 1);
  bad += check<float, 4>(18, 512, 520, true, false, 2);             // fp32 (1e-5 catches small slips)
  bad += check<__nv_bfloat16, 8>(5, 4096, 4104, true, true, 2);     // block per row
  bad += check<float, 4>(3, 4096, 4096, false, false, 3);
  bad += check<__nv_bfloat16, 1>(3, 2047, 2049, true, false, 2);    // scalar (VEC = 1)
  bad += check<__nv_bfloat16, 8>(6, 8192, 8192, true, false, 3);    // long: row sums + column chunks
  bad += check<float, 4>(4, 6144, 6152, true, true, 5);             // idle row blocks
  bad += check<__nv_bfloat16, 1>(3, 4099, 4101, false, true, 2);
  bad += check<__nv_bfloat16, 8>(33, 512, 512, true, true, 2, false);   // frozen weight: warp, block, long
  bad += check<__nv_bfloat16, 8>(5, 4096, 4104, true, false, 2, false);
  bad += check<__nv_bfloat16, 8>(6, 8192, 8192, false, true, 3, false);
  printf(bad ? "FAILED\n" : "ALL OK\n");
  return bad != 0;
}
