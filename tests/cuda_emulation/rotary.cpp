// The CUDA rotary-embedding kernel (csrc/rotary.cu) run under host emulation (shim.h) with the entry point's
// launch geometry (rope_grid): forward and inverse rotation of a strided [s, b, H, d] view against float64
// ("rotate half"), in place and out of place, 16-byte and scalar accesses, more heads than one block's group.
#include "shim.h"
#include "check.h"
#include "rotary.cu"

#include <cstdio>
#include <cstring>
#include <random>

using namespace seqpar;
using namespace seqpar::rotary;

template <typename T, int VEC>
int check(int64_t s, int64_t b, int64_t heads, int64_t d, int64_t pad, bool inverse, bool in_place) {
  const int64_t half = d / 2, position_offset = 7;
  // x: [s, b, heads, d + pad] storage, the view's head stride d + pad; out contiguous unless in place
  const int64_t in_h = d + pad, in_b = heads * in_h, in_s = b * in_b;
  std::mt19937 gen(static_cast<unsigned>(29 + s * d + heads));
  std::normal_distribution<float> normal;
  std::vector<T> x(s * in_s), original;
  for (auto& v : x) v = from_float<T>(normal(gen));
  original = x;
  std::vector<float> inv_freq(half);
  for (int64_t j = 0; j < half; ++j) inv_freq[j] = static_cast<float>(1.0 / std::pow(10000.0, 2.0 * j / d));
  std::vector<T> out_buf(in_place ? 0 : s * b * heads * d, from_float<T>(NAN));
  T* out = in_place ? x.data() : out_buf.data();
  const int64_t out_h = in_place ? in_h : d, out_b = in_place ? in_b : heads * d;
  const int64_t out_s = in_place ? in_s : b * heads * d;
  const RopeArgs a{x.data(), out, inv_freq.data(), b, heads, half, position_offset, in_s, in_b, in_h,
                   out_s, out_b, out_h, inverse ? -1.0f : 1.0f};
  const RopeGrid g = rope_grid(half, VEC, b * heads);
  launch({static_cast<unsigned>(s), static_cast<unsigned>(g.groups), 1},
         {static_cast<unsigned>(g.tx), static_cast<unsigned>(g.ty), 1}, [&] { rope_kernel<T, VEC>(a); });
  Tally tally;
  for (int64_t i = 0; i < s; ++i)
    for (int64_t bi = 0; bi < b; ++bi)
      for (int64_t hi = 0; hi < heads; ++hi)
        for (int64_t j = 0; j < half; ++j) {
          const double angle = double(static_cast<float>(position_offset + i) * inv_freq[j]);
          const double cs = std::cos(angle), sn = (inverse ? -1 : 1) * std::sin(angle);
          const int64_t src = i * in_s + bi * in_b + hi * in_h + j, dst = i * out_s + bi * out_b + hi * out_h + j;
          const double x1 = to_float(original[src]), x2 = to_float(original[src + half]);
          const double want[2] = {x1 * cs - x2 * sn, x2 * cs + x1 * sn};
          const double got[2] = {to_float(out[dst]), to_float(out[dst + half])};
          for (int k = 0; k < 2; ++k)
            if (tally.off(got[k], want[k], output_tolerance<T>()))
              printf("  s %ld b %ld head %ld col %ld: %g (want %g)\n", long(i), long(bi), long(hi),
                     long(j + k * half), got[k], want[k]);
        }
  if (in_place)  // the padding between heads is untouched
    for (int64_t e = 0; e < s * in_s; ++e)
      if (e % in_h >= d && std::memcmp(&x[e], &original[e], sizeof(T)) != 0 && tally.count())
        printf("  padding element %ld written\n", long(e));
  printf("%s VEC=%d s=%ld b=%ld heads=%ld d=%ld pad=%ld inverse=%d in_place=%d (grid %ld x %ld, block %d x %d): "
         "worst relative error %.2g, %d bad\n", sizeof(T) == 2 ? "16-bit" : "fp32  ", VEC, long(s), long(b),
         long(heads), long(d), long(pad), inverse, in_place, long(s), long(g.groups), g.tx, g.ty, tally.worst,
         tally.bad);
  return tally.bad;
}

// The entry point's launches over b: every launch's row groups fit gridDim.y (<= 65535), the batch count
// per launch as large as that allows, and one launch while it fits (s = 1, b = 65536, H = 32, d = 64 on the
// scalar path is 2,097,152 rows: 65,536 groups of 32, one past the limit).
int check_batches_per_launch() {
  int bad = 0;
  struct Case { int64_t half; int vec; int64_t b, heads; };
  for (const Case c : {Case{32, 1, 65536, 32}, Case{32, 8, 65536, 32}, Case{64, 1, 1 << 20, 8}, Case{256, 8, 65536, 64},
                       Case{32, 1, 4, 32}, Case{32, 1, 1, 1}}) {
    const int64_t step = rope_batches_per_launch(c.half, c.vec, c.b, c.heads);
    const bool fits = rope_grid(c.half, c.vec, c.b * c.heads).groups <= 65535;
    const int64_t groups = rope_grid(c.half, c.vec, std::min(step, c.b) * c.heads).groups;
    const int64_t one_more = rope_grid(c.half, c.vec, (step + 1) * c.heads).groups;
    const bool ok = step >= 1 && groups <= 65535 && (fits ? step == c.b : one_more > 65535);
    if (!ok) {
      printf("  half=%ld vec=%d b=%ld heads=%ld: %ld batches a launch, %ld groups\n", long(c.half), c.vec, long(c.b),
             long(c.heads), long(step), long(groups));
      ++bad;
    }
  }
  printf("batches per launch: %d bad\n", bad);
  return bad;
}

int main() {
  int bad = check_batches_per_launch();
  bad += check<__nv_bfloat16, 8>(2, 3, 100, 128, 0, false, false); // 300 heads: 3 groups of 128, the last ragged
  bad += check<__nv_bfloat16, 8>(2, 3, 5, 64, 16, true, true);     // inverse, in place, strided heads
  bad += check<float, 4>(4, 1, 3, 128, 0, false, true);
  bad += check<__half, 1>(2, 2, 3, 34, 2, false, false);           // scalar (VEC = 1), half = 17
  printf(bad ? "FAILED\n" : "ALL OK\n");
  return bad != 0;
}
