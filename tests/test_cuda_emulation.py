"""The CUDA kernels' logic on CPU, beside the gpu-marked tests that run them on a device: every kernel of
csrc/ (LayerNorm and RMSNorm forward and backward, SwiGLU, RoPE, dropout, the attention core's softmax +
dropout). tests/cuda_emulation/*.cpp include a kernel source from csrc/, compiled by g++ under host
emulation (tests/cuda_emulation/shim.h: a std::thread per CUDA thread, barriers for __syncthreads and warp
shuffles, the <<<>>> entry points left out), launch its kernels as its entry points do (the same plans)
and check them against float64 references of the math. Skipped, with the reason, where no C++20 compiler or
no CUDA headers (cuda_bf16.h) are found."""
import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.join(ROOT, "tests", "cuda_emulation")


def _cuda_include():
    """The CUDA toolkit's include directory (cuda_bf16.h and friends), or None."""
    nvcc = shutil.which("nvcc")
    candidates = [os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "include")]
    if nvcc:
        candidates.append(os.path.join(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))), "include"))
    return next((c for c in candidates if os.path.exists(os.path.join(c, "cuda_bf16.h"))), None)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("source", ["layer_norm_forward.cpp", "layer_norm_backward.cpp", "rms_norm_forward.cpp",
                                    "rms_norm_backward.cpp", "swiglu.cpp", "rotary.cpp", "dropout.cpp",
                                    "softmax_dropout.cpp"])
def test_cuda_kernels_under_host_emulation(source, tmp_path):
    cxx = shutil.which(os.environ.get("CXX", "g++"))
    include = _cuda_include()
    if cxx is None or include is None:
        pytest.skip(f"needs a C++20 compiler and the CUDA headers (found compiler {cxx}, CUDA include {include})")
    exe = str(tmp_path / source.replace(".cpp", ""))
    # -fsanitize=alignment: a 16-byte access to a misaligned address (a case breaking the entry points'
    # alignment rules) stops the run, as it would fault on a GPU
    build = subprocess.run([cxx, "-std=c++20", "-O1", "-pthread", "-fsanitize=alignment",
                            "-fno-sanitize-recover=alignment", "-I", HERE, "-I", os.path.join(ROOT, "csrc"),
                            "-I", include, os.path.join(HERE, source), "-o", exe],
                           capture_output=True, text=True, timeout=240)
    assert build.returncode == 0, build.stderr[-4000:]
    run = subprocess.run([exe], capture_output=True, text=True, timeout=240)
    assert run.returncode == 0 and run.stdout.rstrip().endswith("ALL OK"), run.stdout[-4000:] + run.stderr[-2000:]
