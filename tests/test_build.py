"""The install machinery: a skipped CUDA build can't leave a stale seqpar._C behind, the build outcome is
recorded for `python -m seqpar info`, and tools/setup_env.sh re-installs only when a build input changed."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
from install_stamp import install_stamp  # noqa: E402


def test_skipped_cuda_build_removes_stale_extension_and_records_why(tmp_path):
    lib = tmp_path / "lib"
    (lib / "seqpar").mkdir(parents=True)
    stale = lib / "seqpar" / "_C.cpython-311-x86_64-linux-gnu.so"
    stale.write_bytes(b"an old build")
    keep = lib / "seqpar" / "other.so"
    keep.write_bytes(b"not ours")
    env = dict(os.environ, SEQPAR_BUILD_CUDA="0")
    out = subprocess.run([sys.executable, "setup.py", "build_ext", "--build-lib", str(lib),
                          "--build-temp", str(tmp_path / "temp")],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert not stale.exists() and keep.exists()
    status = json.loads((lib / "seqpar" / "_build_status.json").read_text())
    assert status == {"cuda_extension": "not built: SEQPAR_BUILD_CUDA=0"}
    assert "seqpar._C is not built: SEQPAR_BUILD_CUDA=0" in out.stdout


def test_extension_error_quotes_the_recorded_build_status(monkeypatch, tmp_path):
    from seqpar import _ext

    status_file = Path(_ext.__file__).parent / "_build_status.json"
    backup = status_file.read_bytes() if status_file.exists() else None
    try:
        status_file.write_text(json.dumps({"cuda_extension": "not built: nvcc not found"}))
        assert _ext.build_status() == "not built: nvcc not found"
        monkeypatch.setattr(_ext.importlib, "import_module", _raise_import_error)
        _ext._cuda_extension.cache_clear()
        assert "seqpar._C was not built: nvcc not found" in _ext.cuda_extension_error()
    finally:
        _ext._cuda_extension.cache_clear()
        if backup is None:
            status_file.unlink()
        else:
            status_file.write_bytes(backup)


def _raise_import_error(name):
    raise ImportError(f"No module named {name!r}")


def test_install_stamp_changes_only_with_build_inputs(tmp_path, monkeypatch):
    for name in ("setup.py", "pyproject.toml", "CMakeLists.txt"):
        shutil.copy(ROOT / name, tmp_path / name)
    shutil.copytree(ROOT / "csrc", tmp_path / "csrc")
    (tmp_path / "seqpar").mkdir()
    (tmp_path / "seqpar" / "layer.py").write_text("x = 1\n")
    monkeypatch.delenv("SEQPAR_BUILD_CUDA", raising=False)
    first = install_stamp(tmp_path)
    (tmp_path / "seqpar" / "layer.py").write_text("x = 2\n")   # Python: the editable install sees it
    assert install_stamp(tmp_path) == first
    kernel = sorted((tmp_path / "csrc").glob("*.cu"))[0]
    kernel.write_text(kernel.read_text() + "\n// changed\n")
    changed = install_stamp(tmp_path)
    assert changed != first
    monkeypatch.setenv("SEQPAR_BUILD_CUDA", "0")
    assert install_stamp(tmp_path) != changed


def test_setup_env_does_not_reinstall_when_nothing_changed():
    """tools/run_tests.sh and run_bench.sh source setup_env.sh; a second run must not rebuild seqpar._C."""
    venv_python = ROOT / ".venv" / "bin" / "python"
    stamp_file = ROOT / ".venv" / ".seqpar_install_stamp"
    if not stamp_file.exists():
        pytest.skip("the .venv of tools/setup_env.sh is not set up here (CI sets it up)")
    current = subprocess.run([str(venv_python), str(ROOT / "tools" / "install_stamp.py")], capture_output=True,
                             text=True, env=_setup_env_environ(), timeout=60).stdout.strip()
    if stamp_file.read_text().strip() != current:
        pytest.skip("the .venv install is out of date here; setup_env.sh would (rightly) re-install")
    out = subprocess.run(["bash", "-c", "source tools/setup_env.sh"], cwd=ROOT, capture_output=True, text=True,
                         env=_setup_env_environ(), timeout=120)
    assert out.returncode == 0, out.stderr
    assert "not re-installing" in out.stdout and "installing seqpar" not in out.stdout, out.stdout


def _setup_env_environ():
    """The environment tools/setup_env.sh computes its stamp in (it exports SEQPAR_BUILD_CUDA=1 with nvcc)."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV",)}
    if shutil.which("nvcc") and not env.get("SEQPAR_BUILD_CUDA"):
        env["SEQPAR_BUILD_CUDA"] = "1"
    env["PATH"] = f"{ROOT / '.venv' / 'bin'}:{env['PATH']}"
    return env


def test_the_sdist_manifest_carries_the_cuda_sources_and_the_tests():
    """Without MANIFEST.in the sdist lacked csrc/ and CMakeLists.txt (a wheel built from it never had
    seqpar._C; with SEQPAR_BUILD_CUDA=1 the build failed) and 40 of the 57 test files, conftest.py among
    them. setuptools' own template reader over the tracked files, as `setup.py sdist` applies it."""
    from setuptools._distutils.filelist import FileList

    try:
        listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    except FileNotFoundError:
        pytest.skip("no git")
    tracked = listed.stdout.split() if listed.returncode == 0 else []
    if not tracked:
        pytest.skip("not a git checkout (an unpacked sdist)")
    files = FileList()
    files.allfiles = tracked
    for line in (ROOT / "MANIFEST.in").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            files.process_template_line(line)
    needed = [f for f in tracked if f.startswith(("csrc/", "tests/", "tools/", "examples/")) or f == "CMakeLists.txt"]
    assert needed and sorted(set(needed) - set(files.files)) == []


@pytest.mark.parametrize("flag", ["false", "off", "yes"])
def test_a_build_flag_other_than_0_or_1_is_refused_by_name(tmp_path, flag):
    """SEQPAR_BUILD_CUDA=false (off, ...) read as unset: the CUDA build ran and its failure was not an
    error. Now setup.py stops with the variable's name and values."""
    env = dict(os.environ, SEQPAR_BUILD_CUDA=flag)
    out = subprocess.run([sys.executable, "setup.py", "build_ext", "--build-lib", str(tmp_path / "lib"),
                          "--build-temp", str(tmp_path / "temp")],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "SEQPAR_BUILD_CUDA must be unset, 0 (skip the CUDA extension) or 1" in out.stderr
    assert repr(flag) in out.stderr
