"""Print a fingerprint of everything `pip install -e .` builds from (used by tools/setup_env.sh).

The editable install picks up Python changes by itself; only a change here needs a re-install, which
rebuilds seqpar._C: the CUDA sources (csrc/), the build files, the CUDA build settings and the interpreter.
"""
from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

BUILD_FILES = ("setup.py", "pyproject.toml", "CMakeLists.txt")
BUILD_ENV = ("SEQPAR_BUILD_CUDA", "SEQPAR_CUDA_ARCHS")


def install_stamp(root: Path) -> str:
    """sha256 over the build files, every file under csrc/ (by relative path), the build env and python."""
    digest = hashlib.sha256()
    paths = [root / name for name in BUILD_FILES] + sorted(p for p in (root / "csrc").rglob("*") if p.is_file())
    for path in paths:
        digest.update(str(path.relative_to(root)).encode() + b"\0")
        digest.update(path.read_bytes() if path.exists() else b"<missing>")
    for name in BUILD_ENV:
        digest.update(f"{name}={os.environ.get(name, '')}\0".encode())
    digest.update(sys.executable.encode())
    return digest.hexdigest()


if __name__ == "__main__":
    print(install_stamp(Path(__file__).resolve().parent.parent))
