"""Backend registry: each fused op has a torch reference and optional triton / cuda backends.

Selection order: the explicit ``backend=`` argument, then the ``SEQPAR_BACKEND``
environment variable, then "auto" = the first of cuda, triton, torch (or the op's own order, see
:func:`set_auto_order`) that is available and supports the inputs. An explicitly requested backend that can't run raises ``ValueError`` with the reason; auto
falls back silently (``python -m seqpar info`` shows why a backend is skipped).
"""
from __future__ import annotations

import dataclasses
import os
from typing import Callable, Dict, List, Optional, Tuple

import torch

from .. import _ext

BACKENDS: Tuple[str, ...] = ("cuda", "triton", "torch")
BACKEND_CHOICES: Tuple[str, ...] = ("auto",) + BACKENDS


@dataclasses.dataclass(frozen=True)
class Backend:
    """One backend of one op.

    ``check(**inputs)`` returns why this backend can't run these inputs (None when it can), beyond the
    device-level availability the registry checks itself. ``forward`` / ``backward`` follow the op's
    own signature (documented in the op's module). ``recompute_free`` marks a backend that already
    saves nothing that selective recomputation would avoid (e.g. a flash-style attention core keeping
    no s^2-sized tensor), so the layer does not wrap it in a checkpoint.
    """

    op: str
    name: str
    forward: Callable
    backward: Callable
    check: Callable[..., Optional[str]] = lambda **inputs: None
    recompute_free: bool = False


_REGISTRY: Dict[str, Dict[str, Backend]] = {}
_AUTO_ORDER: Dict[str, Tuple[str, ...]] = {}


def set_auto_order(op: str, order: Tuple[str, ...]) -> None:
    """Override the order "auto" tries for ``op`` (default: cuda, triton, torch), e.g. to prefer a
    backend that saves less memory."""
    if sorted(order) != sorted(BACKENDS):
        raise ValueError(f"auto order {order!r} must be a permutation of {BACKENDS}")
    _AUTO_ORDER[op] = tuple(order)


def register(backend: Backend) -> Backend:
    """Add (or replace) a backend of ``backend.op``."""
    if backend.name not in BACKENDS:
        raise ValueError(f"unknown backend name {backend.name!r}; expected one of {BACKENDS}")
    _REGISTRY.setdefault(backend.op, {})[backend.name] = backend
    return backend


def get(op: str, name: str) -> Backend:
    """The registered backend ``name`` of ``op`` (KeyError if none)."""
    return _REGISTRY[op][name]


def validate_backend(backend: str) -> str:
    """Return ``backend`` if it is a known choice, else raise ValueError naming it."""
    if backend not in BACKEND_CHOICES:
        raise ValueError(f"unknown backend {backend!r}; expected one of {BACKEND_CHOICES}")
    return backend


def requested_backend(backend: Optional[str]) -> str:
    """Apply the selection order's first two steps: explicit argument, then SEQPAR_BACKEND."""
    if backend is None or backend == "auto":
        env = os.environ.get("SEQPAR_BACKEND", "auto") or "auto"
        if env not in BACKEND_CHOICES:
            raise ValueError(f"SEQPAR_BACKEND={env!r} is not one of {BACKEND_CHOICES}")
        return env
    return validate_backend(backend)


def unavailable_reason(op: str, name: str, device: torch.device, auto: bool = False,
                       **inputs) -> Optional[str]:
    """Why backend ``name`` of ``op`` can't run on ``device`` with ``inputs`` (None when it can)."""
    impl = _REGISTRY.get(op, {}).get(name)
    if impl is None:
        return f"op {op!r} has no {name} backend yet"
    if name == "triton":
        reason = _ext.triton_unavailable_reason(device, auto=auto)
    elif name == "cuda":
        reason = _ext.cuda_unavailable_reason(device)
    else:
        reason = None
    return reason or impl.check(**inputs)


def select(op: str, backend: Optional[str], device: torch.device, **inputs) -> Backend:
    """The backend of ``op`` that runs these inputs, per the selection order."""
    name = requested_backend(backend)
    if name != "auto":
        reason = unavailable_reason(op, name, device, **inputs)
        if reason:
            raise ValueError(f"backend {name!r} can't run {op}: {reason}")
        return get(op, name)
    for candidate in _AUTO_ORDER.get(op, BACKENDS):
        if unavailable_reason(op, candidate, device, auto=True, **inputs) is None:
            return get(op, candidate)
    raise ValueError(f"no backend can run {op} on {device}")  # torch always can; defensive


def registered_ops() -> List[str]:
    """Names of every op with at least one backend."""
    return sorted(_REGISTRY)


def backend_report(device: torch.device) -> Dict[str, Dict[str, Optional[str]]]:
    """For ``python -m seqpar info``: op -> backend -> reason it is unusable on ``device`` (None: usable)."""
    return {op: {name: unavailable_reason(op, name, device) for name in BACKENDS}
            for op in registered_ops()}
