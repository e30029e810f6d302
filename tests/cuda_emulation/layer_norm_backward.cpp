// The CUDA bias-dropout-add + LayerNorm backward kernels (csrc/bias_dropout_add_layer_norm.cu) run under host
// emulation (shim.h), launched as bias_dropout_add_layer_norm_bwd launches them (its plan, its kernels),
// against a float64 reference of the math: grad_residual, grad_x (the dropout mask drawn per column from
// mask_words), and the three column sums from the kernels' partial rows. Every kind of kernel: warp per row,
// block per row, and the row-sum pass + column-chunk blocks of wide rows. A frozen norm weight or bias
// (w_sum / b_sum false: part_w / part_b nullptr) must leave grad_x / grad_residual as they are and write only
// the other sums' partial rows (a write through a null sum pointer would crash the run).
#include "shim.h"
#include "check.h"
#include "bias_dropout_add_layer_norm.cu"

#include <cstdio>
#include <random>

using namespace seqpar;
using namespace seqpar::bdaln;

// Launches as bias_dropout_add_layer_norm_bwd does (its plan, its kernels) and returns the kind it took.
template <typename T, int VEC>
const char* launch_backward(const BwdArgs& a, int64_t rows, int64_t h, int64_t num_partials) {
  if (columns_bwd(h)) {
    std::vector<float> row_sums(2 * rows, NAN);
    launch({static_cast<unsigned>(rows), 1, 1}, {kRowSumThreads, 1, 1},
           [&] { bwd_row_sums_kernel<T, VEC>(a, row_sums.data()); });
    launch({static_cast<unsigned>(column_chunks(h, VEC)), static_cast<unsigned>(num_partials), 1},
           {kColumnThreads, 1, 1}, [&] { bwd_columns_kernel<T, VEC>(a, row_sums.data()); });
    return "wide";
  }
  const Plan plan = bwd_plan(h, VEC, kVectorRun<T, VEC>);
  dispatch_plan<false, T, VEC>(plan, [&](auto vpt, auto kind) {
    launch({static_cast<unsigned>(num_partials), 1, 1},
           {static_cast<unsigned>(plan.tpr), static_cast<unsigned>(plan.rpb), 1},
           [&] { bwd_kernel<T, VEC, decltype(vpt)::value, decltype(kind)::value>(a); });
  });
  return plan.kind == RowKind::kWarp ? "warp" : "block";
}

template <typename T, int VEC>
int check(int64_t rows, int64_t h, int threshold, bool bias, int64_t num_partials, bool w_sum = true,
          bool b_sum = true) {
  const uint64_t seed = 0xABCDEF12345ULL;
  const int64_t row_offset = (int64_t(1) << 33) + 77;
  std::mt19937 gen(static_cast<unsigned>(3 + h + rows));
  std::normal_distribution<float> normal;
  std::vector<T> ro(rows * h), gy(rows * h), gro(rows * h);
  std::vector<T> gx(rows * h, from_float<T>(NAN)), gres(rows * h, from_float<T>(NAN));
  std::vector<float> w(h), mean(rows), rstd(rows);
  for (auto* t : {&ro, &gy, &gro})
    for (auto& v : *t) v = from_float<T>(normal(gen));
  for (auto& v : w) v = 1.0f + 0.1f * normal(gen);
  for (int64_t r = 0; r < rows; ++r) {
    double s = 0, ss = 0;
    for (int64_t c = 0; c < h; ++c) s += to_float(ro[r * h + c]);
    const double m = s / h;
    for (int64_t c = 0; c < h; ++c) ss += (to_float(ro[r * h + c]) - m) * (to_float(ro[r * h + c]) - m);
    mean[r] = static_cast<float>(m);
    rstd[r] = static_cast<float>(1.0 / std::sqrt(ss / h + 1e-5));
  }
  // The sums computed (dw, db, dbias) take the partial buffers in that order, as the entry point lays them out.
  const bool wanted[3] = {w_sum, b_sum, bias};
  int slot[3], count = 0;
  for (int q = 0; q < 3; ++q) slot[q] = wanted[q] ? count++ : -1;
  std::vector<float> parts(std::max(count, 1) * num_partials * h, NAN);
  const auto part = [&](int q) { return slot[q] < 0 ? nullptr : parts.data() + slot[q] * num_partials * h; };
  const float scale = threshold ? dropout_scale(threshold) : 1.0f;
  const BwdArgs a{gy.data(), gro.data(), ro.data(), w.data(), mean.data(), rstd.data(), kFloat32, gx.data(),
                  gres.data(), part(0), part(1), part(2), rows, h, scale,
                  static_cast<uint32_t>(threshold) << 24, seed, row_offset};
  const char* kind = launch_backward<T, VEC>(a, rows, h, num_partials);
  Tally tally;
  std::vector<double> dw(h, 0), db(h, 0), dbias(h, 0);
  for (int64_t r = 0; r < rows; ++r) {
    double sum_g = 0, sum_gx = 0;
    for (int64_t c = 0; c < h; ++c) {
      const double x_hat = (static_cast<double>(to_float(ro[r * h + c])) - mean[r]) * rstd[r];
      const double g = static_cast<double>(to_float(gy[r * h + c])) * w[c];
      sum_g += g;
      sum_gx += g * x_hat;
    }
    for (int64_t c = 0; c < h; ++c) {
      const double x_hat = (static_cast<double>(to_float(ro[r * h + c])) - mean[r]) * rstd[r];
      const double dy = to_float(gy[r * h + c]);
      const double dres = rstd[r] * (dy * w[c] - sum_g / h - x_hat * sum_gx / h) + to_float(gro[r * h + c]);
      bool keep = true;
      if (threshold) {
        const MaskWords m = mask_words(seed, static_cast<uint64_t>(row_offset + r), static_cast<uint32_t>(c / 16));
        keep = keep_byte(m.w[(c % 16) / 4], (c % 16) % 4, static_cast<uint32_t>(threshold) << 24);
      }
      const double dx = keep ? dres * scale : 0.0;
      dw[c] += dy * x_hat;
      db[c] += dy;
      dbias[c] += dx;
      const bool res_off = tally.off(to_float(gres[r * h + c]), dres, output_tolerance<T>());
      if (tally.off(to_float(gx[r * h + c]), dx, output_tolerance<T>()) || res_off)
        printf("  row %ld col %ld: grad_residual %g (want %g), grad_x %g (want %g)\n", long(r), long(c),
               to_float(gres[r * h + c]), dres, to_float(gx[r * h + c]), dx);
    }
  }
  for (int q = 0; q < 3; ++q)
    for (int64_t c = 0; wanted[q] && c < h; ++c) {
      double s = 0;
      for (int64_t p = 0; p < num_partials; ++p) s += parts[(slot[q] * num_partials + p) * h + c];
      const double want = q == 0 ? dw[c] : q == 1 ? db[c] : dbias[c];
      if (tally.off(s, want, 1e-3))  // fp32 sums of differently ordered terms
        printf("  column sum %d, col %ld: %g (want %g)\n", q, long(c), s, want);
    }
  printf("%s %-5s VEC=%-2d rows=%ld h=%ld P=%d bias=%d dw=%d db=%d partials=%ld: worst relative error %.2g, "
         "%d bad\n", sizeof(T) == 2 ? "16-bit" : "fp32  ", kind, VEC, long(rows), long(h), threshold, bias, w_sum,
         b_sum, long(num_partials), tally.worst, tally.bad);
  return tally.bad;
}

int main() {
  int bad = 0;
  bad += check<__nv_bfloat16, 8>(37, 512, 26, true, 2);    // warp per row (2 runs a lane), a ragged 16-row block
  bad += check<__nv_bfloat16, 8>(20, 200, 0, false, 1);    // warp per row, lanes past the row
  bad += check<float, 4>(19, 256, 26, true, 2);            // fp32 (1e-5 catches small slips)
  bad += check<__nv_bfloat16, 8>(5, 4096, 26, true, 2);    // block per row, 512 threads, several rows a block
  bad += check<__half, 8>(3, 1000, 128, false, 3);
  bad += check<float, 4>(3, 4096, 128, true, 2);           // 2 runs per thread
  bad += check<__half, 16>(4, 4095, 26, true, 3);          // scalar runs, odd h
  bad += check<__nv_bfloat16, 8>(6, 12288, 26, true, 4);   // wide: row sums + column chunks
  bad += check<__nv_bfloat16, 8>(3, 4104, 200, true, 5);   // a ragged chunk; idle row blocks
  bad += check<float, 4>(4, 5120, 26, false, 2);
  bad += check<__nv_bfloat16, 16>(3, 6145, 26, true, 2);   // scalar runs
  // A frozen norm, every kind: only the bias sum (the first buffer), or no sum at all; its weight or its
  // bias alone (BitFit: the sums asked for take the first buffers)
  bad += check<__nv_bfloat16, 8>(37, 512, 26, true, 2, false, false);
  bad += check<__nv_bfloat16, 8>(5, 4096, 26, false, 2, false, false);
  bad += check<__nv_bfloat16, 8>(6, 12288, 26, true, 4, false, false);
  bad += check<__half, 16>(4, 4095, 0, false, 3, false, false);
  bad += check<__nv_bfloat16, 8>(37, 512, 26, true, 2, false, true);
  bad += check<__nv_bfloat16, 8>(5, 4096, 26, true, 2, true, false);
  bad += check<__nv_bfloat16, 8>(6, 12288, 26, false, 4, false, true);
  printf(bad ? "FAILED\n" : "ALL OK\n");
  return bad != 0;
}
