// The one pybind11 module seqpar._C. Launchers take raw device pointers, sizes, dtype codes
// (csrc/dtypes.cuh) and the CUDA stream handle from Python, so nothing here links libtorch.
// Each kernel file declares its launchers below and adds its m.def lines in its own section.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <tuple>

#include "philox.cuh"

namespace py = pybind11;

namespace seqpar {
// Dropout is given by its byte threshold P = round(p * 256) (seqpar.random.dropout_threshold; 0: none) in
// every launcher; they scale kept values by float(256 / (256 - P)) like the other backends (csrc/philox.cuh).
// ---- dropout.cu
void dropout_rows(uintptr_t x, uintptr_t bias, uintptr_t residual, uintptr_t y, int64_t rows, int64_t cols,
                  int dtype, uint64_t seed, int64_t row_offset, int threshold, uintptr_t stream);
std::string kernel_image_error();
// ---- bias_dropout_add_layer_norm.cu
void bias_dropout_add_layer_norm_fwd(uintptr_t x, uintptr_t bias, uintptr_t residual, uintptr_t ln_weight,
                                     uintptr_t ln_bias, uintptr_t y, uintptr_t residual_out, uintptr_t mean,
                                     uintptr_t rstd, int64_t rows, int64_t h, int64_t stride_x, int64_t stride_res,
                                     int dtype, int wdtype, bool vectorized, float eps, int threshold, uint64_t seed,
                                     int64_t row_offset, uintptr_t stream);
// A launch plan (rows::PlanInfo): kind, vectors per thread, threads per row, rows per block, column chunks,
// resident blocks per SM.
using PlanInfo = std::tuple<std::string, int, int, int, int64_t, int>;
PlanInfo bias_dropout_add_layer_norm_fwd_plan(int64_t h, int dtype, bool vectorized);
int64_t bias_dropout_add_layer_norm_bwd_partials(int64_t rows, int64_t h, int dtype, bool vectorized);
void bias_dropout_add_layer_norm_bwd(uintptr_t grad_y, uintptr_t grad_residual_out, uintptr_t residual_out,
                                     uintptr_t ln_weight, uintptr_t mean, uintptr_t rstd, uintptr_t grad_x,
                                     uintptr_t grad_residual, uintptr_t partials, int64_t num_partials,
                                     uintptr_t row_sums, uintptr_t grad_ln_weight, uintptr_t grad_ln_bias,
                                     uintptr_t grad_bias, int64_t rows, int64_t h, int dtype, int wdtype,
                                     bool vectorized, int threshold, uint64_t seed, int64_t row_offset,
                                     uintptr_t stream);
// ---- softmax_dropout.cu
void attention_softmax_dropout_fwd(uintptr_t scores, uintptr_t probs, int64_t batch, int64_t heads, int64_t s_q,
                                   int64_t s_k, int dtype, bool causal, uint64_t seed, int64_t row_offset,
                                   int threshold, uintptr_t stream);
void attention_softmax_dropout_bwd(uintptr_t probs, uintptr_t grad, uintptr_t dropped, int64_t batch,
                                   int64_t heads, int64_t s_q, int64_t s_k, int dtype, bool causal, uint64_t seed,
                                   int64_t row_offset, int threshold, uintptr_t stream);
// ---- rms_norm.cu
void add_rms_norm_fwd(uintptr_t x, uintptr_t residual, uintptr_t weight, uintptr_t y, uintptr_t residual_out,
                      uintptr_t rstd, int64_t rows, int64_t h, int64_t stride_x, int64_t stride_res, int dtype,
                      int wdtype, bool vectorized, float eps, uintptr_t stream);
PlanInfo add_rms_norm_fwd_plan(int64_t h, int dtype, bool vectorized);
int64_t add_rms_norm_bwd_partials(int64_t rows, int64_t h, int dtype, bool vectorized);
void add_rms_norm_bwd(uintptr_t grad_y, uintptr_t grad_residual_out, uintptr_t residual_out, int64_t stride_ro,
                      uintptr_t weight, uintptr_t rstd, uintptr_t grad_x, uintptr_t grad_residual, uintptr_t partials,
                      int64_t num_partials, uintptr_t row_sums, uintptr_t grad_weight, int64_t rows, int64_t h,
                      int dtype, int wdtype, bool vectorized, uintptr_t stream);
// ---- rotary.cu
void rotary_embedding(uintptr_t x, uintptr_t out, uintptr_t inv_freq, int64_t s, int64_t b, int64_t heads, int64_t d,
                      int64_t in_s, int64_t in_b, int64_t in_h, int64_t out_s, int64_t out_b, int64_t out_h,
                      int64_t position_offset, bool inverse, int dtype, bool vectorized, uintptr_t stream);
// ---- swiglu.cu
void swiglu_fwd(uintptr_t gate_up, uintptr_t y, int64_t rows, int64_t n, int64_t ld, int dtype, bool vectorized,
                uintptr_t stream);
void swiglu_bwd(uintptr_t grad_y, uintptr_t gate_up, uintptr_t grad_gate_up, int64_t rows, int64_t n, int64_t ld,
                int dtype, bool vectorized, uintptr_t stream);

// ---- host builds of csrc/philox.cuh (the CPU bitwise tests)
std::tuple<uint32_t, uint32_t, uint32_t, uint32_t> philox4x32_host(uint64_t key, uint32_t c0, uint32_t c1, uint32_t c2,
                                                                    uint32_t c3, int rounds) {
  MaskWords m;
  if (rounds == 7) {
    m = philox4x32<7>(key, c0, c1, c2, c3);
  } else if (rounds == 10) {
    m = philox4x32<10>(key, c0, c1, c2, c3);
  } else {
    throw std::invalid_argument("philox4x32_host: rounds must be 7 or 10, got " + std::to_string(rounds));
  }
  return {m.w[0], m.w[1], m.w[2], m.w[3]};
}

// The keep bits (bit i: column col0 + i) of a run of n = 4, 8 or 16 columns from col0 (col0 % n == 0), drawn
// as the kernels draw them: mask_words, mask_run, keep_column.
uint32_t keep_run_host(uint64_t seed, uint64_t row, uint64_t col0, int n, int threshold) {
  if (threshold < 0 || threshold > 255)
    throw std::invalid_argument("keep_run_host: threshold must be in [0, 256), got " + std::to_string(threshold));
  if ((n != 4 && n != 8 && n != 16) || col0 % n != 0 || col0 / kMaskGroup >= (uint64_t(1) << 32))
    throw std::invalid_argument("keep_run_host: n must be 4, 8 or 16 and divide col0 < 2**36");
  const MaskWords m = mask_words(seed, row, static_cast<uint32_t>(col0 / kMaskGroup));
  const uint32_t threshold24 = static_cast<uint32_t>(threshold) << 24;
  if (n == 4) return keep_bits<4>(mask_run<4>(m, col0), threshold24);
  if (n == 8) return keep_bits<8>(mask_run<8>(m, col0), threshold24);
  return keep_bits<16>(mask_run<16>(m, col0), threshold24);
}
}  // namespace seqpar

PYBIND11_MODULE(_C, m) {
  m.doc() = "seqpar CUDA kernels (raw-pointer launchers; see seqpar/_ext.py)";
  m.def("philox4x32_host", &seqpar::philox4x32_host, py::arg("key"), py::arg("c0"), py::arg("c1"), py::arg("c2"),
        py::arg("c3"), py::arg("rounds") = 7,
        "Host build of csrc/philox.cuh's Philox-4x32 (7 or 10 rounds): the four output words.");
  m.def("keep_run_host", &seqpar::keep_run_host, py::arg("seed"), py::arg("row"), py::arg("col0"), py::arg("n"),
        py::arg("threshold"),
        "Host build of the kernels' mask path (csrc/philox.cuh): keep bits of columns col0 .. col0 + n - 1.");

  // ---- dropout.cu
  m.def("dropout_rows", &seqpar::dropout_rows, py::arg("x"), py::arg("bias"), py::arg("residual"), py::arg("y"),
        py::arg("rows"), py::arg("cols"), py::arg("dtype"), py::arg("seed"), py::arg("row_offset"),
        py::arg("threshold"), py::arg("stream"),
        "y = residual + dropout(x + bias) over [rows, cols] (bias [cols] / residual [rows, cols]: 0 for none).");
  m.def("kernel_image_error", &seqpar::kernel_image_error,
        "Why the kernels can't run on the current device (no image for its architecture); \"\" when they can.");

  // ---- bias_dropout_add_layer_norm.cu
  m.def("bias_dropout_add_layer_norm_fwd", &seqpar::bias_dropout_add_layer_norm_fwd, py::arg("x"), py::arg("bias"),
        py::arg("residual"), py::arg("ln_weight"), py::arg("ln_bias"), py::arg("y"), py::arg("residual_out"),
        py::arg("mean"), py::arg("rstd"), py::arg("rows"), py::arg("h"), py::arg("stride_x"), py::arg("stride_res"),
        py::arg("dtype"), py::arg("wdtype"), py::arg("vectorized"), py::arg("eps"), py::arg("threshold"), py::arg("seed"),
        py::arg("row_offset"), py::arg("stream"),
        "Fused bias + dropout + residual add + LayerNorm forward (bias = 0: none).");
  m.def("bias_dropout_add_layer_norm_fwd_plan", &seqpar::bias_dropout_add_layer_norm_fwd_plan, py::arg("h"),
        py::arg("dtype"), py::arg("vectorized"),
        "The forward's launch plan for rows of h columns on the current device: (kind, vectors per thread, "
        "threads per row, rows per block, column chunks, resident blocks per SM).");
  m.def("bias_dropout_add_layer_norm_bwd_partials", &seqpar::bias_dropout_add_layer_norm_bwd_partials,
        py::arg("rows"), py::arg("h"), py::arg("dtype"), py::arg("vectorized"),
        "Rows n of the fp32 partial buffers [count, n, h] that bias_dropout_add_layer_norm_bwd should get.");
  m.def("bias_dropout_add_layer_norm_bwd", &seqpar::bias_dropout_add_layer_norm_bwd, py::arg("grad_y"),
        py::arg("grad_residual_out"), py::arg("residual_out"), py::arg("ln_weight"), py::arg("mean"), py::arg("rstd"),
        py::arg("grad_x"), py::arg("grad_residual"), py::arg("partials"), py::arg("num_partials"),
        py::arg("row_sums"), py::arg("grad_ln_weight"), py::arg("grad_ln_bias"), py::arg("grad_bias"),
        py::arg("rows"), py::arg("h"), py::arg("dtype"), py::arg("wdtype"), py::arg("vectorized"),
        py::arg("threshold"), py::arg("seed"), py::arg("row_offset"), py::arg("stream"),
        "Backward of bias_dropout_add_layer_norm_fwd; fp32 column sums grad_ln_weight, grad_ln_bias, grad_bias "
        "(a pointer of 0: that sum is not computed); partials: [count, num_partials, h] fp32, count the sums "
        "computed, in that order. row_sums: a [2, rows] fp32 workspace, used by rows wider than 4096 (their row "
        "sums come first).");

  // ---- softmax_dropout.cu
  m.def("attention_softmax_dropout_fwd", &seqpar::attention_softmax_dropout_fwd, py::arg("scores"),
        py::arg("probs"), py::arg("batch"), py::arg("heads"), py::arg("s_q"), py::arg("s_k"), py::arg("dtype"),
        py::arg("causal"), py::arg("seed"), py::arg("row_offset"), py::arg("threshold"), py::arg("stream"),
        "probs = softmax(scores + causal mask) of already scaled scores (+-inf read as +-FLT_MAX); "
        "scores <- dropout(probs) in place when p > 0.");
  m.def("attention_softmax_dropout_bwd", &seqpar::attention_softmax_dropout_bwd, py::arg("probs"),
        py::arg("grad"), py::arg("dropped"), py::arg("batch"), py::arg("heads"), py::arg("s_q"), py::arg("s_k"),
        py::arg("dtype"), py::arg("causal"), py::arg("seed"), py::arg("row_offset"), py::arg("threshold"),
        py::arg("stream"),
        "grad (dL/d dropped) <- dL/d scores in place; dropped <- dropout(probs) when p > 0 (pointer may be 0 "
        "otherwise).");

  // ---- rms_norm.cu
  m.def("add_rms_norm_fwd", &seqpar::add_rms_norm_fwd, py::arg("x"), py::arg("residual"), py::arg("weight"),
        py::arg("y"), py::arg("residual_out"), py::arg("rstd"), py::arg("rows"), py::arg("h"), py::arg("stride_x"),
        py::arg("stride_res"), py::arg("dtype"), py::arg("wdtype"), py::arg("vectorized"), py::arg("eps"),
        py::arg("stream"),
        "Fused residual add + RMSNorm forward (residual = residual_out = 0: no residual).");
  m.def("add_rms_norm_fwd_plan", &seqpar::add_rms_norm_fwd_plan, py::arg("h"), py::arg("dtype"),
        py::arg("vectorized"),
        "The forward's launch plan for rows of h columns on the current device: (kind, vectors per thread, "
        "threads per row, rows per block, column chunks, resident blocks per SM).");
  m.def("add_rms_norm_bwd_partials", &seqpar::add_rms_norm_bwd_partials, py::arg("rows"), py::arg("h"),
        py::arg("dtype"), py::arg("vectorized"),
        "Rows of the fp32 partial buffer [n, h] that add_rms_norm_bwd should get.");
  m.def("add_rms_norm_bwd", &seqpar::add_rms_norm_bwd, py::arg("grad_y"), py::arg("grad_residual_out"),
        py::arg("residual_out"), py::arg("stride_ro"), py::arg("weight"), py::arg("rstd"), py::arg("grad_x"),
        py::arg("grad_residual"), py::arg("partials"), py::arg("num_partials"), py::arg("row_sums"),
        py::arg("grad_weight"), py::arg("rows"), py::arg("h"), py::arg("dtype"), py::arg("wdtype"),
        py::arg("vectorized"), py::arg("stream"),
        "Backward of add_rms_norm_fwd: grad_x, its copy grad_residual (0: not written) and the fp32 weight "
        "gradient (grad_weight = 0: not computed, partials unused; grad_residual_out = 0: none). row_sums: a [rows] fp32 workspace, used by rows too long "
        "for one block's registers (their row sums come first).");

  // ---- rotary.cu
  m.def("rotary_embedding", &seqpar::rotary_embedding, py::arg("x"), py::arg("out"), py::arg("inv_freq"),
        py::arg("s"), py::arg("b"), py::arg("heads"), py::arg("d"), py::arg("in_s"), py::arg("in_b"), py::arg("in_h"),
        py::arg("out_s"), py::arg("out_b"), py::arg("out_h"), py::arg("position_offset"), py::arg("inverse"),
        py::arg("dtype"), py::arg("vectorized"), py::arg("stream"),
        "Rotate-half RoPE of x [s, b, heads, d] into out (may be x); inverse: by -angle.");

  // ---- swiglu.cu
  m.def("swiglu_fwd", &seqpar::swiglu_fwd, py::arg("gate_up"), py::arg("y"), py::arg("rows"), py::arg("n"),
        py::arg("ld"), py::arg("dtype"), py::arg("vectorized"), py::arg("stream"),
        "y [rows, n] = silu(gate_up[:, :n]) * gate_up[:, n:] (row stride ld).");
  m.def("swiglu_bwd", &seqpar::swiglu_bwd, py::arg("grad_y"), py::arg("gate_up"), py::arg("grad_gate_up"),
        py::arg("rows"), py::arg("n"), py::arg("ld"), py::arg("dtype"), py::arg("vectorized"), py::arg("stream"),
        "grad_gate_up [rows, 2n] = [dgate | dup] of swiglu_fwd, silu recomputed.");
}
