"""Process-group queries and the collectives along the sequence dimension (dim 0).

``group=None`` (or torch.distributed not initialised) means "no parallelism": size 1, rank 0. A group
this process is not a member of is a ValueError.

:func:`check_ranks_agree` is the one cross-rank consistency check: layers and models run it when they
are built (same config, same RNG state on every rank), TransformerLayer and GPTModel on every forward
under TP (same input shapes, same dropout seed), and the comm GEMMs and parallel linears on every call
(:func:`agree_on_inputs`: same input shapes, dtypes and overlap plan), so a disagreement is a ValueError
on every rank instead of a hang, an abort inside the collective library or silently different dropout
masks.
"""
from __future__ import annotations

import contextlib
import contextvars
import copy
import hashlib
import re
from typing import Callable, Iterator, List, Mapping, Optional, Sequence, TypeVar

import torch
import torch.distributed as dist

from .._custom_op import capturing_graph, outside_dispatch_modes

ProcessGroup = Optional["dist.ProcessGroup"]

# torch 2.13 renamed the tensor collectives (the old names warn); older releases only have the old ones.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
# The consistency checks' own reference: they are control traffic, not the data collectives above
# (bench/bench_overlap.py replaces those with no-ops to time compute alone; the checks must still run).
_all_gather_control = _all_gather_single


class SharesProcessGroup:
    """Mixin of the modules that hold a ``tp_group``: ``copy.deepcopy`` shares the group instead of copying
    it. A ProcessGroup can't be copied (deepcopy raised a pickling TypeError under TP), and a copy of a
    shard (an EMA or reference model) belongs to the same ranks. Pickling a module that holds a group
    still fails: save state dicts (``full_state_dict()`` or ``state_dict()``), not modules."""

    def __deepcopy__(self, memo):
        group = self.__dict__.get("tp_group")
        if group is not None:
            memo.setdefault(id(group), group)
        copied = type(self).__new__(type(self))
        memo[id(self)] = copied
        copied.__setstate__(copy.deepcopy(self.__dict__, memo))   # what deepcopy's default path does
        return copied


def _not_a_member(group) -> ValueError:
    return ValueError(f"this process (global rank {dist.get_rank()}) is not a member of the tp_group it "
                      f"was given; pass a group that contains the calling rank (or None for no tensor "
                      f"parallelism)")


def _no_parallelism(group) -> bool:
    """Whether ``group`` means one rank: None, or a ProcessGroup while torch.distributed is not
    initialised. Anything else than None or a ProcessGroup (a rank list, a backend name) is a ValueError,
    whether or not torch.distributed is initialised."""
    if group is None:
        return True
    if isinstance(group, int) and dist.is_available() and dist.is_initialized() \
            and group == dist.GroupMember.NON_GROUP_MEMBER:
        raise _not_a_member(group)  # what new_group returns on the ranks outside the group it makes
    if not (dist.is_available() and isinstance(group, dist.ProcessGroup)):
        raise ValueError(f"a process group must be a torch.distributed.ProcessGroup or None, got {group!r}")
    return not dist.is_initialized()


def group_size(group: ProcessGroup) -> int:
    """Number of ranks in ``group`` (1 for ``None``); ValueError if this process is not a member."""
    if _no_parallelism(group):
        return 1
    size = dist.get_world_size(group)
    if size < 1:  # torch answers -1 for a group this rank is not part of
        raise _not_a_member(group)
    return size


def group_rank(group: ProcessGroup) -> int:
    """This process's rank inside ``group`` (0 for ``None``); ValueError if it is not a member."""
    if _no_parallelism(group):
        return 0
    rank = dist.get_rank(group)
    if rank < 0:
        raise _not_a_member(group)
    return rank


def shard_first_row(x_shard: torch.Tensor, group: ProcessGroup, sequence_parallel: bool) -> int:
    """The global row of ``x_shard``'s first row, its rows being [s_local, ...] flattened sequence-major
    over the last dim (a dropout mask's rows, :mod:`seqpar.random`): ``rank * rows`` under sequence
    parallelism, where each rank holds the contiguous shard at sequence position ``rank * s_local``; else
    0 (every rank holds the whole sequence)."""
    if not sequence_parallel:
        return 0
    h = x_shard.shape[-1]
    return group_rank(group) * (x_shard.numel() // h if h else 0)


def sequence_shard(full: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """This rank's contiguous sequence shard of ``full`` [s, ...] -> [s/t, ...] (a view). ValueError when t
    does not divide s (or this rank is not in ``group``)."""
    t = group_size(group)
    if full.shape[0] % t:
        raise ValueError(f"sequence length {full.shape[0]} is not divisible by the group size {t}")
    s_local = full.shape[0] // t
    r = group_rank(group)
    return full[r * s_local:(r + 1) * s_local]


def all_gather_seq(x_shard: torch.Tensor, group: ProcessGroup, async_op: bool = False):
    """All-gather [s/t, ...] shards into [s, ...] along dim 0 (rank order).

    Returns the output tensor, or ``(output, work)`` with ``async_op=True``.
    """
    t = group_size(group)
    x_shard = x_shard.contiguous()
    if t == 1:  # nothing to gather: the shard is the whole tensor (returned as is, not copied)
        return (x_shard, None) if async_op else x_shard
    # While a graph is captured, a functional collective: one node of the graph, not a graph break. Not under
    # every dispatch mode (tracing()): one that runs real tensors (FlopCounterMode, selective checkpointing)
    # left a functional collective whose output nobody read unwaited in torch's work registry, holding its
    # buffer (a checkpoint's re-run stops after the last saved tensor: fc2's reduce-scatter), one per layer
    # and step.
    if capturing_graph():
        funcol = _functional()   # all_gather_tensor is all_gather_single under its pre-2.13 name (deprecated)
        out = getattr(funcol, "all_gather_single", funcol.all_gather_tensor)(x_shard, 0, group)
        return (out, None) if async_op else out
    out = torch.empty((x_shard.shape[0] * t,) + tuple(x_shard.shape[1:]),
                      dtype=x_shard.dtype, device=x_shard.device)
    work = _all_gather_single(out, x_shard, group=group, async_op=async_op)
    return (out, work) if async_op else out


def reduce_scatter_seq(x_full: torch.Tensor, group: ProcessGroup, async_op: bool = False):
    """Sum [s, ...] over the group and keep this rank's [s/t, ...] shard along dim 0.

    Returns the output tensor, or ``(output, work)`` with ``async_op=True``.
    """
    t = group_size(group)
    if x_full.shape[0] % t:
        raise ValueError(f"sequence length {x_full.shape[0]} is not divisible by the group size {t}")
    x_full = x_full.contiguous()
    if t == 1:  # nothing to reduce: returned as is, not copied
        return (x_full, None) if async_op else x_full
    if capturing_graph():   # as all_gather_seq
        funcol = _functional()
        out = getattr(funcol, "reduce_scatter_single", funcol.reduce_scatter_tensor)(x_full, "sum", 0, group)
        return (out, None) if async_op else out
    out = torch.empty((x_full.shape[0] // t,) + tuple(x_full.shape[1:]),
                      dtype=x_full.dtype, device=x_full.device)
    work = _reduce_scatter_single(out, x_full, group=group, async_op=async_op)
    return (out, work) if async_op else out


def all_reduce(x: torch.Tensor, group: ProcessGroup, async_op: bool = False):
    """In-place sum over the group (no-op for one rank); returns ``x``, or ``(x, work)`` with
    ``async_op=True`` (work None where nothing is in flight: one rank, or a captured graph)."""
    work = None
    if group_size(group) > 1:
        if capturing_graph():   # as all_gather_seq
            x.copy_(_functional().all_reduce(x, "sum", group))
        else:
            work = dist.all_reduce(x, group=group, async_op=async_op)
    return (x, work) if async_op else x


def _functional():
    """``torch.distributed._functional_collectives``, which the collectives above use while a graph is
    captured: Dynamo and AOT autograd trace them into the graph, where the c10d calls (``async_op``
    work objects) are a graph break each (13 graphs per sequence-parallel layer forward)."""
    import torch.distributed._functional_collectives as funcol
    return funcol


# ---- cross-rank consistency ----------------------------------------------------------------------

_SKIP_AGREEMENT = contextvars.ContextVar("seqpar_skip_agreement", default=False)


@contextlib.contextmanager
def agreement_checked() -> Iterator[None]:
    """Inside, :func:`check_ranks_agree` only raises local errors (no collective): for a caller that has
    already checked everything its parts would check (GPTModel building its layers; code calling the
    comm GEMMs on inputs known to agree). Every rank must enter it alike."""
    token = _SKIP_AGREEMENT.set(True)
    try:
        yield
    finally:
        _SKIP_AGREEMENT.reset(token)


#: Hints of the layer's and model's rank checks. A rank in another grad mode than the others runs no
#: backward (theirs waits for it until the timeout); one in eval mode draws no dropout seeds.
SAME_MODE_HINT = " in the same mode (training or eval, under torch.no_grad or not)"
#: Appended to the layer's and model's per-forward rank-check hint when dropout is on.
SEED_HINT = ("; dropout seeds differ when torch's CPU generator diverged after seqpar.manual_seed (one rank drew "
             "random numbers the others did not)")


def _plain_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and -2**63 <= value < 2**63


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _portable_repr(value) -> str:
    """``repr(value)``, without the memory addresses default reprs hold (every process has its own, so the
    same function in a config subclass's field differed on every rank): a function or class by its module
    and qualified name, another object with an address in its repr by that repr without it and its
    attributes. (Two objects that differ in nothing of these now agree, where they never could.)"""
    if isinstance(value, str):
        return repr(value)
    text = repr(value)
    if not _ADDRESS.search(text):
        return text
    if hasattr(value, "__qualname__"):
        return f"{getattr(value, '__module__', '')}.{value.__qualname__}"
    return _ADDRESS.sub("", text) + repr(sorted(getattr(value, "__dict__", {}).items()))


def _digest(value) -> int:
    """A non-bool int in int64 range as itself (reported per rank); anything else as a 64-bit hash
    of its bytes (``bytes``) or :func:`_portable_repr` (exact for floats, dtypes, strings)."""
    if _plain_int(value):
        return value
    data = value if isinstance(value, bytes) else _portable_repr(value).encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little", signed=True)


def nccl_device(group: ProcessGroup, preferred: Optional[torch.device] = None) -> torch.device:
    """This rank's CUDA device for a collective over the NCCL group ``group``: ``preferred`` when it is a
    CUDA device with an index (that of the tensors the collective is about), else the group's bound device
    (``init_process_group(device_id=...)``, DeviceMesh groups), else the current CUDA device. The current
    device alone was cuda:0 on every rank of a process that bound its device without
    ``torch.cuda.set_device``: NCCL refused the tensor ("backend constrained to cuda:1") or found every rank
    on one GPU ("Duplicate GPU detected")."""
    if preferred is not None and preferred.type == "cuda" and preferred.index is not None:
        return preferred
    bound = getattr(group, "bound_device_id", None)
    return bound if bound is not None else torch.device("cuda", torch.cuda.current_device())


def _control_device(group: ProcessGroup, preferred: Optional[torch.device] = None) -> torch.device:
    """Where the agreement's small int64 tensors live for ``group``: the CPU wherever one of its backends
    takes CPU tensors (gloo, "cpu:gloo,cuda:nccl": no device work, no stream sync), else (an NCCL-only
    group: "nccl", "cuda:nccl") :func:`nccl_device`."""
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and "cpu:" not in backend:
        return nccl_device(group, preferred)
    return torch.device("cpu")


def all_gather_objects(obj: object, group: ProcessGroup, device=None) -> List[object]:
    """``dist.all_gather_object`` of ``obj`` over ``group`` (every rank's, in rank order), run on the device
    :func:`_control_device` picks for ``device`` (where the objects' subject lives): torch stages the pickles
    on the *current* CUDA device of an NCCL-only group, which is cuda:0 on every rank of a process that bound
    its device with ``init_process_group(device_id=...)`` only (NCCL refused the tensors on rank 1 and rank 0
    waited in the gather until the timeout) or never chose one (a context and a communicator on GPU 0 from
    every rank)."""
    gathered: List[object] = [None] * group_size(group)
    where = _control_device(group, None if device is None else torch.device(device))
    with torch.cuda.device(where) if where.type == "cuda" else contextlib.nullcontext():
        dist.all_gather_object(gathered, obj, group=group)
    return gathered


def check_ranks_agree(group: ProcessGroup, values: Mapping[str, object], *, what: str,
                      error: Optional[str] = None, hint: str = "", device=None) -> None:
    """Raise ValueError on EVERY rank of ``group`` unless all ranks passed equal ``values`` and no
    rank passed an ``error``.

    ``values``: name -> value, the same names in the same order on every rank (ints are compared and
    reported as themselves, anything else by a 64-bit hash of its ``repr`` / bytes). ``error``: this
    rank's own validation failure (or None); checking it here, not raising it at once, is what keeps
    the other ranks from waiting in a collective the failing rank never enters. The message names
    ``what`` was checked, each differing value and which ranks hold what, then ``hint``.

    ``device``: where the checked tensors live (None: unknown, or not materialised). The exchange runs on
    the CPU where ``group`` has a CPU backend, else (NCCL only) on ``device`` if it is a CUDA device, else on
    the group's bound device or the current one (:func:`nccl_device`).

    Cost: one all-gather of ``2 len(values) + 1`` int64 per rank (tens of bytes) and, for the answer,
    a copy of the gathered [t, n] tensor to the host. On an NCCL-only group that copy synchronises the host
    with the current stream: the host stops queueing kernels until everything queued before has run (the
    ~10-30 us collective plus draining the launch queue). With ``group`` of one rank (or None) nothing
    is communicated and only ``error`` is raised.
    """
    if group_size(group) == 1 or _SKIP_AGREEMENT.get():
        if error is not None:
            raise ValueError(error)
        return
    names = list(values)
    # per value: its digest, then whether it is a plain int (reported as itself only if it is one on
    # every rank: a float 4.0 on one rank and 4 on another printed the float's hash as a value)
    local = ([_digest(values[name]) for name in names] + [int(_plain_int(values[name])) for name in names]
             + [int(error is not None)])
    device = _control_device(group, None if device is None else torch.device(device))
    with outside_dispatch_modes():   # real ints, under FakeTensorMode (a memory estimate) too
        mine = torch.tensor(local, dtype=torch.int64, device=device)
        gathered = torch.empty(group_size(group) * mine.numel(), dtype=torch.int64, device=device)
        _all_gather_control(gathered, mine, group=group)
        rows = gathered.view(-1, mine.numel()).tolist()
    rank = group_rank(group)
    if error is not None:
        raise ValueError(error)
    failed = [r for r, row in enumerate(rows) if row[-1]]
    if failed:
        raise ValueError(f"{what}: tensor-parallel {_ranks_named(group, failed, 'rank(s)')} rejected their "
                         f"arguments (see their ValueError); {_rank_named(group, rank)} raises too instead of "
                         "waiting for them")
    problems = []
    for i, name in enumerate(names):
        column = [row[i] for row in rows]
        if len(set(column)) == 1:
            continue
        value = values[name]
        if all(row[len(names) + i] for row in rows):   # ints on every rank, compared as themselves
            held = ", ".join(f"{_rank_named(group, r)}: {v}" for r, v in enumerate(column))
        else:
            by_value = {}
            for r, v in enumerate(column):
                by_value.setdefault(v, []).append(r)
            held = " vs ".join(_ranks_named(group, rs) for rs in by_value.values())
            if not isinstance(value, bytes):
                held += f"; {_rank_named(group, rank)} has {value!r}"
        problems.append(f"{name} differs ({held})")
    if problems:
        raise ValueError(f"{what}: the tensor-parallel ranks disagree: " + "; ".join(problems)
                         + (f". {hint}" if hint else ""))


def _ranks_named(group: ProcessGroup, ranks: Sequence[int], word: str = "ranks") -> str:
    """"ranks [1, 3]" of ``group``, with their global ranks where they differ (a subgroup such as {0, 2})."""
    global_ranks = [dist.get_global_rank(group, r) for r in ranks]
    return f"{word} {list(ranks)}" + (f" (global {global_ranks})" if global_ranks != list(ranks) else "")


def _rank_named(group: ProcessGroup, rank: int) -> str:
    """"rank r" of ``group``, with its global rank where the two differ (a subgroup such as {0, 2})."""
    global_rank = dist.get_global_rank(group, rank)
    return f"rank {rank}" if global_rank == rank else f"rank {rank} (global rank {global_rank})"


_Result = TypeVar("_Result")


def run_agreed(fn: Callable[[], _Result], groups: Sequence[ProcessGroup], *, what: str,
               values: Optional[Callable[[Optional[_Result]], Mapping[str, object]]] = None,
               hint: str = "", device=None) -> _Result:
    """``fn()`` on this rank, its failure agreed over each of ``groups`` in turn (every rank takes part in
    every agreement: :func:`check_ranks_agree`): any exception on any rank is a ValueError on every rank
    (chained from this rank's own exception), not one rank raising while the others wait in the next
    collective. A non-ValueError is reported as "``what``: its type: its message". ``values(result)``
    (``result`` None where ``fn`` failed; the same names on every rank) must agree too, with ``hint``
    after a difference. ``device``: as :func:`check_ranks_agree`'s."""
    problem, cause, result = None, None, None
    try:
        result = fn()
    except Exception as exc:   # any failure, not only the checks' ValueErrors: the other ranks must not wait
        problem, cause = (str(exc) if isinstance(exc, ValueError) else f"{what}: {type(exc).__name__}: {exc}"), exc
    agreed = {} if values is None else values(None if problem is not None else result)
    for group in groups:
        try:
            check_ranks_agree(group, agreed, what=what, error=problem, hint=hint, device=device)
        except ValueError as exc:
            problem = str(exc)
    if problem is not None:
        raise ValueError(problem) from cause
    return result


def agree_on_inputs(group: ProcessGroup, check: Callable[[], _Result],
                    values: Callable[[Optional[_Result]], Mapping[str, object]], *, what: str,
                    hint: str = "", device=None) -> _Result:
    """A building block's per-call agreement: :func:`run_agreed` of ``check`` (this rank's input checks,
    returning what the call will do, e.g. its overlap plan) over ``group``, with ``values`` agreed too.
    On one rank, and while a graph is captured (:func:`seqpar._custom_op.capturing_graph`, or a CUDA
    graph capture: no value can be read back on the host there), only ``check()`` runs. ``device``: the
    inputs' (:func:`check_ranks_agree`)."""
    if group_size(group) == 1 or capturing_graph() or (
            torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()):
        return check()
    return run_agreed(check, (group,), what=what, values=values, hint=hint, device=device)
