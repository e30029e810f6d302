"""Backend registry: each fused op has a torch reference and optional triton / cuda backends.

Selection order: the explicit ``backend=`` argument, then the ``SEQPAR_BACKEND``
environment variable, then "auto" = the first of cuda, triton, torch (or the op's own order, see
:func:`set_auto_order`) that is available and supports the inputs. An explicitly requested backend that
can't run raises ``ValueError`` with the reason. Auto falls back without raising, and every fallback is
visible: ``python -m seqpar info`` prints, per op and device, the backend auto picks, why each one before
it is skipped and the input limits of each backend (:func:`auto_report`), and :func:`record_selections`
collects the backends that actually ran (the bench rows record them).

Kernel launches go through :func:`kernel_op`: a ``torch.library`` custom op (what torch.compile traces, with
a fake implementation) that eager calls skip, calling the launcher directly.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import sys
from typing import Callable, Dict, Iterator, List, Optional, Set, Tuple

import torch

from .. import _custom_op, _ext

#: Backend names, in auto's default order (an op may set its own: :func:`set_auto_order`).
BACKENDS: Tuple[str, ...] = ("cuda", "triton", "torch")
#: What ``backend=`` and ``SEQPAR_BACKEND`` take.
BACKEND_CHOICES: Tuple[str, ...] = ("auto",) + BACKENDS


def _TAKES_EVERYTHING(**inputs) -> Optional[str]:
    return None


@dataclasses.dataclass(frozen=True)
class Backend:
    """One backend of one op.

    ``check(**inputs)`` returns why this backend can't run these inputs (None when it can), beyond the
    device-level availability the registry checks itself. ``forward`` / ``backward`` follow the op's
    own signature (documented in the op's module). ``recompute_free`` marks a backend that already
    saves nothing that selective recomputation would avoid (e.g. a flash-style attention core keeping
    no s^2-sized tensor), so the layer does not wrap it in a checkpoint. ``limits`` says in words which
    inputs ``check`` turns away (shown by ``python -m seqpar info``; empty: none). ``auto_skip(**inputs)``
    returns why "auto" passes over inputs this backend can run but runs far slower than the next backend
    (None: it doesn't); an explicit ``backend=`` still runs them.
    """

    op: str
    name: str
    forward: Callable
    backward: Callable
    check: Callable[..., Optional[str]] = _TAKES_EVERYTHING
    recompute_free: bool = False
    limits: str = ""
    auto_skip: Callable[..., Optional[str]] = _TAKES_EVERYTHING


_REGISTRY: Dict[str, Dict[str, Backend]] = {}
_AUTO_ORDER: Dict[str, Tuple[str, ...]] = {}
_RECORDERS: List[Dict[str, Set[str]]] = []


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
    """Why backend ``name`` of ``op`` can't run on ``device`` with ``inputs`` (None when it can); with
    ``auto``, also why auto passes over it (``Backend.auto_skip``)."""
    impl = _REGISTRY.get(op, {}).get(name)
    if impl is None:
        return f"op {op!r} has no {name} backend yet"
    if not inputs:   # a device-level question (the reports): a check may need its inputs
        return environment_reason(name, device, auto)
    return (environment_reason(name, device, auto) or impl.check(**inputs)
            or (impl.auto_skip(**inputs) if auto else None))


@_custom_op.assume_constant_result
def environment_reason(name: str, device: torch.device, auto: bool = False) -> Optional[str]:
    """Why backend ``name`` can't run on ``device`` here, whatever the inputs: Triton or the CUDA extension
    missing, a device it doesn't serve (None when it can). A constant to torch.compile, which can't trace
    the import probes behind it; the inputs' checks (shapes, dtypes) stay traceable."""
    if name == "triton":
        return _ext.triton_unavailable_reason(device, auto=auto)
    if name == "cuda":
        return _ext.cuda_unavailable_reason(device)
    return None


def requested_backend_problem(backend: Optional[str], device: torch.device,
                              dtype: Optional[torch.dtype] = None) -> Optional[str]:
    """Why the requested ``backend`` (the argument, else SEQPAR_BACKEND) can't run on ``device`` (or, given
    ``dtype``, in that dtype: float64 is the torch backend's only) whatever the other inputs (None for
    "auto" or when it can): what a module checks before it draws its dropout seeds, so that a backend which
    can't run leaves torch's generator as it was (the next, fixed call draws the masks a first call would)."""
    name = requested_backend(backend)
    if name == "auto":
        return None
    reason = environment_reason(name, device)
    if reason is not None:
        return f"backend {name!r}{_backend_source(backend)} can't run on {device}: {reason}"
    reason = None if name == "torch" else kernel_dtype_check(dtype)
    if reason is not None:
        return f"backend {name!r}{_backend_source(backend)} can't compute in {dtype}: {reason}"
    return None


def _backend_source(backend: Optional[str]) -> str:
    return "" if backend not in (None, "auto") else " (from SEQPAR_BACKEND)"


def auto_order(op: str) -> Tuple[str, ...]:
    """The order "auto" tries the backends of ``op`` in."""
    return _AUTO_ORDER.get(op, BACKENDS)


def select(op: str, backend: Optional[str], device: torch.device, **inputs) -> Backend:
    """The backend of ``op`` that runs these inputs, per the selection order."""
    name = requested_backend(backend)
    if name != "auto":
        reason = unavailable_reason(op, name, device, **inputs)
        if reason:
            raise ValueError(f"backend {name!r}{_backend_source(backend)} can't run {op}: {reason}")
        return _selected(op, name)
    reasons = []
    for candidate in auto_order(op):
        reason = unavailable_reason(op, candidate, device, auto=True, **inputs)
        if reason is None:
            return _selected(op, candidate)
        reasons.append(f"{candidate}: {reason}")
    # seqpar's torch references run everything; a backend registered in their place may not
    raise ValueError(f"no backend can run {op} on {device} with these inputs ({'; '.join(reasons)})")


def _selected(op: str, name: str) -> Backend:
    for seen in _RECORDERS:
        seen.setdefault(op, set()).add(name)
    return get(op, name)


@contextlib.contextmanager
def record_selections() -> Iterator[Dict[str, Set[str]]]:
    """Collects ``{op: {backend names}}`` of every backend :func:`select` picks inside the block (the bench
    rows record which backends actually ran, auto fallbacks included)."""
    seen: Dict[str, Set[str]] = {}
    _RECORDERS.append(seen)
    try:
        yield seen
    finally:
        # by identity: list.remove compares by ==, and an equal outer recorder (both empty, say) went first
        del _RECORDERS[next(i for i, recorder in enumerate(_RECORDERS) if recorder is seen)]


def registered_ops() -> List[str]:
    """Names of every op with at least one backend."""
    return sorted(_REGISTRY)


def backend_report(device: torch.device) -> Dict[str, Dict[str, Optional[str]]]:
    """op -> backend -> reason an explicit ``backend=`` can't run on ``device`` (None: usable)."""
    return {op: {name: unavailable_reason(op, name, device) for name in BACKENDS}
            for op in registered_ops()}


@dataclasses.dataclass(frozen=True)
class AutoChoice:
    """What "auto" does for one op on one device: the backend it picks (for inputs within every backend's
    ``limits``), why each backend tried before it is skipped, and each backend's input limits."""

    picked: str
    skipped: Dict[str, str]
    limits: Dict[str, str]


def auto_report(device: torch.device) -> Dict[str, AutoChoice]:
    """For ``python -m seqpar info``: op -> :class:`AutoChoice` on ``device`` (the ``SEQPAR_BACKEND``
    environment variable is not applied: this is what "auto" itself picks)."""
    out = {}
    for op in registered_ops():
        skipped, picked = {}, "none"
        for name in auto_order(op):
            reason = unavailable_reason(op, name, device, auto=True)
            if reason is None:
                picked = name
                break
            skipped[name] = reason
        limits = {name: describe_limits(b) for name, b in _REGISTRY[op].items() if describe_limits(b)}
        out[op] = AutoChoice(picked, skipped, limits)
    return out


#: The most rows the row kernels (LayerNorm, RMSNorm, SwiGLU, dropout; Triton and CUDA) take: the Triton
#: kernels index rows in int32, and a row block (pid * BLOCK_M + i) or a backward program's row range
#: (start + rows per program) past 2**31 wrapped negative and passed the row mask (memory before the
#: tensor read and written, or a range's rows skipped: gradient rows never written). Below 2**30 neither
#: reaches 2**31. More rows than this (2 GiB of bf16 at h = 1) run on the torch backend.
KERNEL_MAX_ROWS = 2**30


def rows_within_kernel_limit(rows=None, **_) -> Optional[str]:
    """rows < 2**30 (the row kernels index rows in int32).

    The check of the row ops' kernel backends (:data:`KERNEL_MAX_ROWS`); None when ``rows`` is not given."""
    # Symbolic rows (graph capture with a dynamic size): refused only where certainly too many, since a
    # guard on them would cap the program's sizes (torch.export: a constraint violation of a dynamic dim).
    if rows is not None and _statically_known_true(rows >= KERNEL_MAX_ROWS):
        return f"{rows} rows: the row kernels take fewer than 2**30 (int32 row indices)"
    return None


def _statically_known_true(cond) -> bool:
    """torch's ``statically_known_true``, imported only for a symbolic condition: its module imports sympy
    (0.35 s of seqpar's import), and eager sizes are plain ints."""
    if type(cond) is bool:
        return cond
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return statically_known_true(cond)


#: The dtypes every fused op takes; float64 (for gradcheck) runs on the torch backend only, which computes
#: in it throughout (:func:`acc_dtype`).
DTYPES: Tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
#: What the Triton and CUDA kernels take: the dtypes the CUDA launchers have codes for.
KERNEL_DTYPES: Tuple[torch.dtype, ...] = tuple(_ext.DTYPE_CODES)


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the torch references compute in: fp32, or fp64 for fp64 inputs (gradcheck)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def kernel_dtype_check(dtype=None, **_) -> Optional[str]:
    """fp32 / fp16 / bf16 (float64 runs on the torch backend only).

    The dtype check of every kernel backend (:data:`KERNEL_DTYPES`); None when ``dtype`` is not given."""
    if dtype is None or dtype in KERNEL_DTYPES:
        return None
    return f"{str(dtype).replace('torch.', '')} inputs run on the torch backend only (the kernels take fp32 / fp16 / bf16)"


def row_kernel_check(dtype=None, **inputs) -> Optional[str]:
    """fp32 / fp16 / bf16 (float64 runs on the torch backend only); rows < 2**30.

    The check of the row ops' kernel backends (LayerNorm, RMSNorm, SwiGLU, dropout):
    :func:`kernel_dtype_check` and :func:`rows_within_kernel_limit`."""
    return kernel_dtype_check(dtype) or rows_within_kernel_limit(**inputs)


def describe_limits(backend: Backend) -> str:
    """The inputs ``backend`` turns away, in words: its ``limits``, else the first line of its check's
    docstring, else a note that it has an undescribed check ("" when it takes every input)."""
    if backend.limits:
        return backend.limits
    if backend.check is _TAKES_EVERYTHING:
        return ""
    doc = (getattr(backend.check, "__doc__", None) or "").strip()
    return doc.splitlines()[0] if doc else "some inputs (not described; the check names them when it refuses)"


# Defined in seqpar._custom_op, below seqpar.random (whose dropout mask is a custom op too); the ops call
# them as registry.kernel_op / registry.once_differentiable.
kernel_op = _custom_op.kernel_op
once_differentiable = _custom_op.once_differentiable


def cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.to(dtype)``, without the call when t already has it: a no-op call saved per output and gradient,
    and a torch.compile bug avoided. Under torch 2.11 (fixed by 2.13), a no-op ``.to`` / ``.float()`` /
    ``.contiguous()`` (one returning its input) in an autograd.Function's forward, on a tensor the forward
    returns, lost that output's gradient in the compiled graph (zeros, no error): the torch references'
    gradients came out wrong under torch.compile for fp32 inputs."""
    return t if t.dtype == dtype else t.to(dtype)


# ----------------------------------------------------------------------------- argument checks every op shares
def check_dense(**tensors) -> None:
    """ValueError naming the first of ``tensors`` ({name: tensor or anything}) that is a tensor of another
    layout than strided (sparse, ...), or a DTensor (:func:`dtensor_problem`): the kernels and the torch
    references read dense rows, and a sparse argument failed deep inside (or came back sparse).
    Non-tensors are the callers' own checks."""
    for name, t in tensors.items():
        if isinstance(t, torch.Tensor) and t.layout != torch.strided:
            raise ValueError(f"{name} must be a dense (strided) tensor, got layout {t.layout}")
        if is_dtensor(t):
            raise ValueError(dtensor_problem(name, t))


def is_dtensor(t) -> bool:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor``."""
    # Not imported here (0.3 s of seqpar's import): a DTensor exists only once its module is imported (never
    # in a torch built without distributed).
    dtensor = sys.modules.get("torch.distributed.tensor")
    return dtensor is not None and isinstance(t, dtensor.DTensor)


def dtensor_problem(name: str, t) -> str:
    """Why a DTensor can't be a seqpar module's or op's input: they take this rank's plain local tensor
    and shard by their own ``tp_group`` (a DTensor ran with its global shape into the checks and failed
    inside, or under ``implicit_replication`` came back labelled with the wrong placements)."""
    return (f"{name} is a DTensor (placements {tuple(t.placements)}, global shape {tuple(t.shape)}): seqpar's modules "
            f"and ops take this rank's plain tensor and shard by their own tp_group; pass {name}.to_local() "
            "(under sequence parallelism: this rank's sequence shard)")


def is_finite(value) -> bool:
    """Whether ``value`` is an int or float (not a bool), finite as a float (an int too large for a float
    is not: the kernels take a float)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        # comparisons, not math.isfinite: torch.compile traces them on a float it made symbolic (a theta under
        # dynamic=True), where math.isfinite was a graph break (and under fullgraph=True an error)
        return -math.inf < float(value) < math.inf
    except OverflowError:
        return False


def is_positive_finite(value) -> bool:
    """:func:`is_finite` and > 0."""
    return is_finite(value) and value > 0


#: The smallest eps the norms take: fp32's smallest normal number. They add eps to fp32 statistics, where a
#: smaller eps is 0 or a subnormal that GPUs flush to 0, and a constant row then divides by 0.
EPS_MIN = torch.finfo(torch.float32).tiny


def check_eps(eps, name: str = "eps") -> None:
    """ValueError naming ``name`` unless ``eps`` is a finite number (int or float, not a bool) of at least
    :data:`EPS_MIN`."""
    if not is_positive_finite(eps) or eps < EPS_MIN:
        raise ValueError(f"{name} must be a finite float >= {EPS_MIN:.4g} (fp32's smallest normal number: the "
                         f"norms add it to fp32 statistics), got {eps!r}")


def check_flags(**flags) -> None:
    """ValueError naming the first of ``flags`` ({name: value}) that is not a bool (a string "False" is
    truthy: taken as a flag it would silently switch the behaviour on)."""
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be a bool, got {value!r}")


def check_sizes(**sizes) -> None:
    """ValueError naming the first of ``sizes`` ({name: value}) that is not a positive int (bools, floats
    such as 2.0, strings and None are refused: a module's parameter shapes come from them)."""
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")


#: The global offsets (dropout rows, RoPE positions) count on in int64 from an offset below this: offset +
#: count stays below 2**63.
MAX_OFFSET = 2**62


def check_offset(name: str, value) -> None:
    """ValueError naming ``name`` unless ``value`` is an int in [0, :data:`MAX_OFFSET`): a dropout row
    offset or a RoPE position offset. A ``torch.SymInt`` passes too: under graph capture with dynamic
    shapes an offset that is a product of sizes is one (torch.export's non-strict mode)."""
    if (not isinstance(value, (int, torch.SymInt)) or isinstance(value, bool) or value < 0
            or value >= MAX_OFFSET):
        raise ValueError(f"{name} must be an int in [0, 2**62), got {value!r} ({type(value).__name__})")


def check_param_dtype(dtype) -> None:
    """ValueError unless ``dtype`` is None or a floating ``torch.dtype`` (a module's parameters train)."""
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"dtype must be None or a floating dtype (a torch.dtype, e.g. torch.bfloat16), got {dtype!r}")

