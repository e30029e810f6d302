"""Build script: the pure-Python packages plus the optional CUDA extension seqpar._C (via CMake).

The extension is skipped, with the reason printed, when SEQPAR_BUILD_CUDA=0, when nvcc or cmake is
missing, or (unless SEQPAR_BUILD_CUDA=1 forces it) when its build fails. SEQPAR_CUDA_ARCHS overrides
the CUDA architectures (default "80;90").

pip hides a build's output unless run with ``-v``, so the outcome is also written next to the extension
as ``seqpar/_build_status.json`` ({"cuda_extension": "built"} or {"cuda_extension": "not built: <why>"});
``python -m seqpar info`` and the error of an explicit ``backend="cuda"`` quote it. A skipped build
deletes any ``_C`` library left in the output folder by an earlier build (a reused ``build/`` folder
would otherwise put a stale ``_C`` into a wheel built with SEQPAR_BUILD_CUDA=0).

CMake builds in ``build/cmake-<python tag>`` inside the source tree, so a re-install recompiles only
what changed under csrc/.
"""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


def _build_cuda_flag():
    """SEQPAR_BUILD_CUDA: "" (unset: build when nvcc and cmake are found), "0" (skip) or "1" (a failed
    build is an error). Anything else was read as unset (false, off, no: the build ran anyway)."""
    flag = os.environ.get("SEQPAR_BUILD_CUDA", "").strip()
    if flag not in ("", "0", "1"):
        raise ValueError(f"SEQPAR_BUILD_CUDA must be unset, 0 (skip the CUDA extension) or 1 (a failed "
                         f"build is an error), got {os.environ['SEQPAR_BUILD_CUDA']!r}")
    return flag


def _cuda_skip_reason():
    flag = _build_cuda_flag()
    if flag == "0":
        return "SEQPAR_BUILD_CUDA=0"
    if shutil.which("nvcc") is None and not (Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "bin/nvcc").exists():
        return "nvcc not found (install the CUDA toolkit or set CUDA_HOME)"
    if shutil.which("cmake") is None:
        return "cmake not found"
    return None


class CMakeBuild(build_ext):
    def run(self):
        reason = _cuda_skip_reason()
        if reason is None:
            try:
                super().run()
            except (subprocess.CalledProcessError, OSError) as exc:
                if _build_cuda_flag() == "1":
                    raise
                reason = f"its build failed ({exc}); set SEQPAR_BUILD_CUDA=1 to make this an error"
        if reason:
            self._remove_stale_extensions()
        status = "built" if reason is None else f"not built: {reason}"
        for out_dir in self._output_dirs():
            out_dir.mkdir(parents=True, exist_ok=True)
            (out_dir / "_build_status.json").write_text(json.dumps({"cuda_extension": status}) + "\n")
        print(f"seqpar: the CUDA extension seqpar._C is {status}", flush=True)

    def _output_dirs(self):
        return sorted({Path(self.get_ext_fullpath(ext.name)).resolve().parent for ext in self.extensions})

    def _remove_stale_extensions(self):
        for ext in self.extensions:
            stale = Path(self.get_ext_fullpath(ext.name)).resolve()
            for path in stale.parent.glob(ext.name.split(".")[-1] + ".*"):
                if path.suffix in (".so", ".pyd", ".dylib"):
                    print(f"seqpar: removing the stale extension {path}", flush=True)
                    path.unlink()

    def build_extension(self, ext):
        import pybind11

        out_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        # A fixed folder (not pip's temporary one) so that CMake rebuilds only what changed.
        build_dir = ROOT / "build" / f"cmake-{sys.implementation.cache_tag}"
        nvcc = shutil.which("nvcc") or str(Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "bin/nvcc")
        args = [f"-DSEQPAR_OUTPUT_DIR={out_dir}", f"-DPython_EXECUTABLE={sys.executable}",
                f"-Dpybind11_DIR={pybind11.get_cmake_dir()}", f"-DCMAKE_CUDA_COMPILER={nvcc}",
                "-DCMAKE_BUILD_TYPE=Release"]
        if os.environ.get("SEQPAR_CUDA_ARCHS"):
            args.append(f"-DCMAKE_CUDA_ARCHITECTURES={os.environ['SEQPAR_CUDA_ARCHS']}")
        print(f"seqpar: building seqpar._C with CMake into {out_dir}", flush=True)
        subprocess.check_call(["cmake", "-S", str(ROOT), "-B", str(build_dir)] + args)
        subprocess.check_call(["cmake", "--build", str(build_dir), "-j", str(os.cpu_count() or 2)])


setup(
    packages=["seqpar", "seqpar.parallel", "seqpar.ops", "seqpar.nn", "seqpar.bench", "seqpar.integrations",
              "seqpar.triton_kernels"],
    # The Triton kernels live in the top-level folder triton_kernels/ but install as
    # seqpar.triton_kernels, so they can't clash with Triton's own `triton_kernels` package.
    package_dir={"seqpar": "seqpar", "seqpar.triton_kernels": "triton_kernels"},
    package_data={"seqpar": ["py.typed"]},   # PEP 561: type checkers read seqpar's annotations
    ext_modules=[Extension("seqpar._C", sources=[])],
    cmdclass={"build_ext": CMakeBuild},
)
