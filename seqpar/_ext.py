"""Lazy discovery of the optional compiled pieces: Triton and the CUDA extension ``seqpar._C``.

Nothing here touches a CUDA device at import time.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import json
import os
from typing import Optional, Tuple

import torch

#: dtype codes of the seqpar._C launchers (csrc/dtypes.cuh).
DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def triton_interpreter_enabled() -> bool:
    """True when ``TRITON_INTERPRET=1``: Triton kernels then run on CPU tensors (slowly)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.lru_cache(maxsize=None)
def _triton_import_error() -> Optional[str]:
    try:
        importlib.import_module("triton")
        importlib.import_module("triton.language")
    except Exception as exc:  # pragma: no cover - depends on the install
        return f"triton is not importable ({type(exc).__name__}: {exc})"
    return None


def build_status() -> Optional[str]:
    """What the install said about ``seqpar._C`` ("built" or "not built: <why>"), None if unrecorded.

    setup.py writes it to ``seqpar/_build_status.json`` (pip hides build output unless run with -v).
    """
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_build_status.json")
    try:
        with open(path) as f:
            return str(json.load(f)["cuda_extension"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


@functools.lru_cache(maxsize=None)
def _cuda_extension():
    """(module, None) when ``seqpar._C`` imports, else (None, reason)."""
    try:
        return importlib.import_module("seqpar._C"), None
    except ImportError as exc:
        status = build_status()
        if status and status != "built":
            return None, (f"the CUDA extension seqpar._C was {status}; reinstall with nvcc and cmake on "
                          "PATH and SEQPAR_BUILD_CUDA unset or 1")
        return None, (f"the CUDA extension seqpar._C is not importable ({exc}); reinstall with nvcc on PATH "
                      "and SEQPAR_BUILD_CUDA unset or 1")


def cuda_extension():
    """The ``seqpar._C`` module; raises RuntimeError with the reason when it is not built."""
    module, reason = _cuda_extension()
    if module is None:
        raise RuntimeError(reason)
    return module


def cuda_extension_error() -> Optional[str]:
    """Why ``seqpar._C`` can't be imported, or None when it can."""
    return _cuda_extension()[1]


def triton_unavailable_reason(device: torch.device, auto: bool = False) -> Optional[str]:
    """Why the Triton backend can't run on tensors of ``device`` (None when it can).

    ``auto`` selection never picks the CPU interpreter: it is a testing tool, far slower than torch.
    """
    reason = _triton_import_error()
    if reason:
        return reason
    if device.type == "cuda":
        return None
    if device.type == "cpu" and triton_interpreter_enabled():
        if auto:
            return "auto selection does not use the Triton CPU interpreter"
        return _interpreter_set_late()
    return f"triton needs CUDA tensors (got {device.type}; set TRITON_INTERPRET=1 for CPU tensors)"


def _interpreter_set_late() -> Optional[str]:
    """Why the interpreter asked for by ``TRITON_INTERPRET=1`` can't run, None when it can. Triton reads
    the variable when it defines its jit functions: set after ``import triton`` (which ``import seqpar``
    does, through torch._dynamo), ``triton.language``'s own helpers stay compiled for the GPU, and a
    kernel calling one failed with "Cannot call @triton.jit'd outside of the scope of a kernel"."""
    from triton.runtime.jit import JITFunction

    if isinstance(getattr(importlib.import_module("triton.language"), "cdiv", None), JITFunction):
        return ("TRITON_INTERPRET=1 was set after triton was imported (import seqpar imports it), so "
                "triton's own functions are not interpreted: set it before importing seqpar or triton")
    return None


def cuda_capability(device: torch.device) -> Tuple[int, int]:
    """(major, minor) compute capability of CUDA ``device`` (the current one when it has no index)."""
    return _capability(torch.cuda.current_device() if device.index is None else device.index)


@functools.lru_cache(maxsize=None)
def _capability(device_index: int) -> Tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


def cuda_unavailable_reason(device: torch.device) -> Optional[str]:
    """Why the CUDA backend can't run on tensors of ``device`` (None when it can)."""
    reason = cuda_extension_error()
    if reason:
        return reason
    if device.type != "cuda":
        return f"the cuda backend needs CUDA tensors (got {device.type})"
    return _kernel_image_error(torch.cuda.current_device() if device.index is None else device.index)


@functools.lru_cache(maxsize=None)
def _kernel_image_error(device_index: int) -> Optional[str]:
    """Why seqpar._C's kernels can't run on GPU ``device_index`` (None when they can): it was built for newer
    architectures than the GPU's (the default build is sm_80 and sm_90: A100, H100/H200), so its first launch
    would fail ("no kernel image"), or the driver is older than its toolkit; "auto" then takes the next
    backend. Asked once per device."""
    with torch.cuda.device(device_index):
        error = cuda_extension().kernel_image_error()
    if not error:
        return None
    major, minor = torch.cuda.get_device_capability(device_index)
    if "no kernel image" in error or "invalid device function" in error:
        return (f"seqpar._C has no kernels for this GPU (sm_{major}{minor}: {error}); rebuild it for the GPU with "
                f"SEQPAR_CUDA_ARCHS={major}{minor} pip install -e . (CUDA 13 builds sm_75 and newer)")
    # Anything else is not about the architecture (rebuilding for it would not help): say what it is.
    hint = ""
    if "driver" in error.lower() or "ptx" in error.lower():   # an old driver, or its JIT rejecting newer PTX
        hint = (" (the NVIDIA driver is older than the CUDA toolkit seqpar._C was built with: update the driver, "
                "or build with a toolkit the driver supports" +
                (f", or build native code for the GPU with SEQPAR_CUDA_ARCHS={major}{minor})"
                 if "ptx" in error.lower() else ")"))
    return f"seqpar._C's kernels can't run on this GPU (sm_{major}{minor}): {error}{hint}"


def cuda_stream(device: torch.device) -> int:
    """Raw handle of the current CUDA stream of ``device`` (passed to seqpar._C launchers)."""
    return torch.cuda.current_stream(device).cuda_stream


def on_device(tensor: torch.Tensor):
    """Context making ``tensor``'s CUDA device current for a kernel launch (Triton and seqpar._C launch on
    the current device; launching with another device's tensors or stream fails). No-op off CUDA."""
    return torch.cuda.device(tensor.device) if tensor.is_cuda else contextlib.nullcontext()
