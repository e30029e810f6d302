// The CUDA SwiGLU kernels (csrc/swiglu.cu) run under host emulation (shim.h) against a float64 reference:
// y = silu(gate) * up and its backward, on strided gate_up rows, with grids smaller and larger than the
// vectors (the grid-stride loop's row / column stepping: every element written exactly once, outputs
// start as NaN). The fast exponential and division are exact here; the gpu tests bound their error.
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
  std::vector<T> gate_up(rows * ld), grad_y(rows * n);
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

int main() {
  int bad = 0;
  bad += check<__nv_bfloat16, 8>(7, 1000, 2000, 1);   // 125 vectors a row, 256 threads: the stride spans rows
  bad += check<__nv_bfloat16, 8>(5, 4096, 8200, 3);   // 512 vectors a row, a stride of 768 (row step + column)
  bad += check<__half, 8>(3, 64, 136, 2);             // a stride of several rows
  bad += check<float, 4>(9, 360, 720, 2);
  bad += check<__nv_bfloat16, 1>(4, 333, 667, 1);      // scalar (VEC = 1), odd sizes
  printf(bad ? "FAILED\n" : "ALL OK\n");
  return bad != 0;
}
