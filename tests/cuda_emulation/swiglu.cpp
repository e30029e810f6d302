// The CUDA SwiGLU kernels (csrc/swiglu.cu) run under host emulation (shim.h) against a float64 reference:
// y = silu(gate) * up and its backward, on strided gate_up rows, with grids smaller and larger than the
// vectors (the grid-stride loop's row / column stepping: every element written exactly once, outputs
// start as NaN), rows broadcast with a zero stride, and silu's far tail (g in (-88.7, -87.3], where the
// division's denominator passes 2^126). The fast exponential and div_full are exact here; the gpu tests
// bound their error; shim.h's __fdividef returns 0 in that range as div.approx does.
#include "shim.h"
#include "check.h"
#include "swiglu.cu"

#include <cstdio>
#include <random>

using namespace seqpar;
using namespace seqpar::swiglu;

template <typename T, int VEC>
int check(int64_t rows, int64_t n, int64_t ld, unsigned blocks) {
  std::mt19937 gen(static_cast<unsigned>(5 + rows * n + blocks));
  std::normal_distribution<float> normal;
  std::vector<T> gate_up((rows - 1) * ld + 2 * n), grad_y(rows * n);
  std::vector<T> y(rows * n, from_float<T>(NAN)), grad(rows * 2 * n, from_float<T>(NAN));
  for (auto& v : gate_up) v = from_float<T>(2.0f * normal(gen));
  for (auto& v : grad_y) v = from_float<T>(normal(gen));
  launch({blocks, 1, 1}, {kThreads, 1, 1}, [&] { fwd_kernel<T, VEC>(gate_up.data(), y.data(), rows, n, ld); });
  launch({blocks, 1, 1}, {kThreads, 1, 1},
         [&] { bwd_kernel<T, VEC>(grad_y.data(), gate_up.data(), grad.data(), rows, n, ld); });
  Tally tally;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < n; ++c) {
      const double g = to_float(gate_up[r * ld + c]), u = to_float(gate_up[r * ld + n + c]);
      const double dy = to_float(grad_y[r * n + c]), sig = 1.0 / (1.0 + std::exp(-g));
      const double want[3] = {g * sig * u, dy * u * sig * (1.0 + g * (1.0 - sig)), dy * g * sig};
      const double got[3] = {to_float(y[r * n + c]), to_float(grad[r * 2 * n + c]), to_float(grad[r * 2 * n + n + c])};
      for (int k = 0; k < 3; ++k)
        if (tally.off(got[k], want[k], output_tolerance<T>()))
          printf("  row %ld col %ld %s: %g (want %g)\n", long(r), long(c), k == 0 ? "y" : k == 1 ? "dgate" : "dup",
                 got[k], want[k]);
    }
  printf("%s VEC=%d rows=%ld n=%ld ld=%ld blocks=%u: worst relative error %.2g, %d bad\n",
         sizeof(T) == 2 ? "16-bit" : "fp32  ", VEC, long(rows), long(n), long(ld), blocks, tally.worst, tally.bad);
  return tally.bad;
}

// fp32 gates whose 1 + exp(-g) lies in (2^126, 2^128): y, dgate and dup ~1e-36, each within 1e-5 relative
// to float64 (the shared tally's error, relative to 1 + |want|, can't see values this small).
int check_far_tail() {
  const float gates[] = {-87.0f, -87.5f, -88.0f, -88.5f};
  constexpr int64_t n = 4;
  float gate_up[2 * n], grad_y[n], y[n], grad[2 * n];
  for (int64_t c = 0; c < n; ++c) gate_up[c] = gates[c], gate_up[n + c] = 3.0f, grad_y[c] = 2.0f;
  launch({1, 1, 1}, {kThreads, 1, 1}, [&] { fwd_kernel<float, 1>(gate_up, y, 1, n, 2 * n); });
  launch({1, 1, 1}, {kThreads, 1, 1}, [&] { bwd_kernel<float, 1>(grad_y, gate_up, grad, 1, n, 2 * n); });
  int bad = 0;
  for (int64_t c = 0; c < n; ++c) {
    const double g = gates[c], sig = 1.0 / (1.0 + std::exp(-g));
    const double want[3] = {g * sig * 3.0, 2.0 * 3.0 * sig * (1.0 + g * (1.0 - sig)), 2.0 * g * sig};
    const double got[3] = {y[c], grad[c], grad[n + c]};
    for (int k = 0; k < 3; ++k)
      if (!(std::fabs(got[k] - want[k]) <= 1e-5 * std::fabs(want[k]))) {
        printf("  far tail g=%g %s: %g (want %g)\n", g, k == 0 ? "y" : k == 1 ? "dgate" : "dup", got[k], want[k]);
        ++bad;
      }
  }
  printf("fp32   far tail of silu (g down to -88.5): %d bad\n", bad);
  return bad;
}

// The entry points' argument check: any row stride ld >= 0 (gate_up is only read).
int check_arguments() {
  int bad = 0;
  for (int64_t ld : {int64_t(0), int64_t(3), int64_t(8)}) {
    try {
      check_args(3, 4, ld);
    } catch (const std::exception& e) {
      printf("  ld=%ld refused: %s\n", long(ld), e.what());
      ++bad;
    }
  }
  try {
    check_args(3, 4, -1);
    printf("  ld=-1 accepted\n");
    ++bad;
  } catch (const std::invalid_argument&) {
  }
  printf("check_args: %d bad\n", bad);
  return bad;
}

int main() {
  int bad = check_far_tail() + check_arguments();
  bad += check<__nv_bfloat16, 8>(7, 1000, 2000, 1);   // 125 vectors a row, 256 threads: the stride spans rows
  bad += check<__nv_bfloat16, 8>(5, 4096, 8200, 3);   // 512 vectors a row, a stride of 768 (row step + column)
  bad += check<__half, 8>(3, 64, 136, 2);             // a stride of several rows
  bad += check<float, 4>(9, 360, 720, 2);
  bad += check<__nv_bfloat16, 1>(4, 333, 667, 1);      // scalar (VEC = 1), odd sizes
  bad += check<float, 4>(3, 64, 0, 2);                 // broadcast rows (ld = 0): one gate_up row read by all
  printf(bad ? "FAILED\n" : "ALL OK\n");
  return bad != 0;
}
