// The one pybind11 module seqpar._C. Launchers take raw device pointers, sizes, dtype codes
// (csrc/dtypes.cuh) and the CUDA stream handle from Python, so nothing here links libtorch.
// Each kernel file declares its launchers below and adds its m.def lines in its own section.
#include <pybind11/pybind11.h>

#include <cstdint>

#include "philox.cuh"

namespace py = pybind11;

namespace seqpar {
// ---- dropout.cu
void dropout_rows(uintptr_t x, uintptr_t y, int64_t rows, int64_t cols, int dtype, uint64_t seed,
                  int64_t row_offset, float p, uintptr_t stream);
}  // namespace seqpar

PYBIND11_MODULE(_C, m) {
  m.doc() = "seqpar CUDA kernels (raw-pointer launchers; see seqpar/_ext.py)";
  m.def("philox_uniform_host", &seqpar::philox_uniform, py::arg("seed"), py::arg("offset"),
        "Host build of csrc/philox.cuh, for checking it against seqpar.random without a GPU.");

  // ---- dropout.cu
  m.def("dropout_rows", &seqpar::dropout_rows, py::arg("x"), py::arg("y"), py::arg("rows"), py::arg("cols"),
        py::arg("dtype"), py::arg("seed"), py::arg("row_offset"), py::arg("p"), py::arg("stream"));
}
