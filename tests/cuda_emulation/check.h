// What the emulated kernel tests share: the tolerance of an output and the tally of one case's mismatches.
#pragma once
#include <algorithm>
#include <cmath>

// Relative error allowed in an output of type T against float64: 2.5 ulps of a 16-bit type, 1e-5 in fp32.
template <typename T>
constexpr double output_tolerance() {
  return sizeof(T) == 2 ? 1e-2 : 1e-5;
}

// Mismatches of one case: how many, and the worst relative error seen.
struct Tally {
  int bad = 0;
  double worst = 0;
  // Counts got as a mismatch when it is off want by tol or more relative to 1 + |want| (NaN included);
  // true for the first few mismatches, which the caller prints.
  bool off(double got, double want, double tol) {
    const double err = std::fabs(got - want) / (1 + std::fabs(want));
    worst = std::max(worst, err);
    return err < tol ? false : ++bad <= 5;
  }
  // Counts a mismatch found otherwise (a bitwise comparison); true for the first few.
  bool count() { return ++bad <= 5; }
};
