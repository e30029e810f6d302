"""Building blocks for overlapping the sequence-parallel collectives with GEMMs.

* :class:`ChunkPlan` -- how one GEMM + collective is split: ``chunks == 1`` is the plain path (one
  bulk all-gather / reduce-scatter and one GEMM); ``chunks == t`` splits the GEMM by sequence shard
  (one chunk per rank) and moves the shards point to point, so that the transfer of one chunk runs
  while the GEMM of another computes. :meth:`ChunkPlan.choose` is the "overlap where it helps"
  heuristic.
* :class:`PeerExchange` -- the transfers: at step j every rank sends one tensor to rank r + j + 1 and
  receives one from rank r - j - 1 (group ranks, mod t; a permutation, so no link or rank is
  oversubscribed on a switched network), asynchronously (``batch_isend_irecv``).
* :func:`record_schedule` -- test / debugging instrumentation: the order in which the overlapped
  loops issue transfers, finish GEMMs and wait on transfers.

Streams and ordering (GPU). Each transfer is an async work handle of the NCCL process group: it runs
on the group's own communication stream, which at issue waits (an event) for the work already issued
on the current stream, i.e. for the transfer's inputs; ``Work.wait()`` makes the current (compute)
stream wait for its completion event, without blocking the host. Issue order therefore sets every
dependency, and the loops issue each transfer as early as its data allows: a gather's transfers all
at once before the first GEMM (``prefetch = t - 1``, the GPU default; NCCL runs them back to back
beside the GEMMs), a reduce-scatter's partial right after the GEMM that produced it. Nothing relies on
``CUDA_DEVICE_MAX_CONNECTIONS``. For the transfer kernels to get SMs while a GEMM fills the GPU, give
the tensor-parallel NCCL group a high-priority stream (``ProcessGroupNCCL.Options(
is_high_priority_stream=True)``). CPU (gloo): transfers progress on gloo's threads while the calling
thread runs the GEMM; ``prefetch = 1`` (one transfer in flight, so the next chunk gets the whole
loopback bandwidth).
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterator, List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from .._custom_op import capturing_graph
from .state import ProcessGroup, group_rank, group_size

#: Smallest per-chunk GEMM (2 * rows * k * n FLOPs) for which ``overlap=True`` chunks, per device type.
#: Below it the per-transfer latency (a few microseconds with NCCL on NVLink, ~0.1-1 ms with gloo
#: over TCP loopback) and the thinner GEMMs cost more than the hidden transfer saves. GPU: a 2 GFLOP
#: chunk is a few microseconds on an H100 at bf16, about one transfer latency; the paper's per-GPU
#: shards at t = 8 are 5-50 GFLOP per chunk. CPU: 0.1 GFLOP is a few ms on one core, several times a
#: gloo transfer's latency (bench/bench_overlap.py's gloo part measures both).
MIN_CHUNK_FLOPS = {"cuda": 2e9, "cpu": 1e8}
#: Fewer rows per chunk than this also keeps the plain path (GEMM efficiency collapses on thin chunks).
MIN_CHUNK_ROWS = 64


@dataclasses.dataclass(frozen=True)
class ChunkPlan:
    """How an all-gather / reduce-scatter GEMM is split.

    ``chunks``: 1 = the plain path (bulk collectives); t = one chunk per rank, transfers overlapped.
    ``prefetch``: how many transfers are kept in flight ahead of the GEMMs (>= 1). Gathers issue up to
    ``prefetch`` transfers ahead of the GEMM consuming them; reduce-scatters keep up to ``prefetch``
    partials in flight (and as many send buffers + 1). ``t - 1`` issues everything at once.
    ``bulk_ag_backward``: with chunks = t, all_gather_matmul's backward keeps the plain path's async
    bulk collectives (re-gather || input-gradient GEMM, reduce-scatter || weight-gradient GEMM), which
    already hide both collectives where they run beside the GEMMs for free (NCCL, on its own stream);
    False chunks it like the other passes (pairwise transfers, far cheaper in CPU than gloo's bulk
    collectives). Ignored with chunks = 1.

    Pass an instance as ``overlap=`` to force a plan (tests, benchmarks); ``overlap=True`` asks
    :meth:`choose`. ValueError for chunks or prefetch that are not positive ints.
    """

    chunks: int = 1
    prefetch: int = 1
    bulk_ag_backward: bool = False

    def __post_init__(self):
        for name in ("chunks", "prefetch"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ChunkPlan.{name} must be a positive int, got {value!r}")
        if not isinstance(self.bulk_ag_backward, bool):
            raise ValueError(f"ChunkPlan.bulk_ag_backward must be a bool, got {self.bulk_ag_backward!r}")

    @property
    def overlapped(self) -> bool:
        """Whether the GEMM runs in chunks with their transfers overlapped (``chunks > 1``)."""
        return self.chunks > 1

    def validate(self, t: int) -> "ChunkPlan":
        """Raise ValueError unless this plan fits a group of ``t`` ranks (chunks must be 1 or t)."""
        if self.chunks not in (1, t):
            raise ValueError(f"ChunkPlan.chunks={self.chunks} must be 1 (plain) or the group size {t} "
                             f"(one chunk per rank)")
        return self

    @staticmethod
    def choose(overlap: Union[bool, "ChunkPlan"], *, t: int, chunk_rows: int, k: int, n: int,
               device: torch.device) -> "ChunkPlan":
        """Resolve the ``overlap`` argument of the fused ops into a plan.

        ``False`` or one rank -> plain. A ``ChunkPlan`` -> itself (validated). While a graph is captured
        (torch.compile / export) -> plain, whatever ``overlap`` says: the graph schedules its collectives
        itself, and Dynamo does not trace the chunks' point-to-point transfers (an explicit plan raised
        torch's "P2P compilation disabled" under fullgraph=True). ``True`` -> one chunk per
        rank when the per-chunk GEMM (``chunk_rows`` x ``k`` by ``k`` x ``n``) is at least
        ``MIN_CHUNK_FLOPS[device.type]`` FLOPs and ``MIN_CHUNK_ROWS`` rows, else plain. On CUDA:
        prefetch t - 1 (NCCL serialises the transfers on its stream anyway) and bulk collectives in
        all_gather_matmul's backward (chunking it only adds a partials sum there: bench_overlap.py's
        projection); elsewhere (gloo): prefetch 1 and that backward chunked too. The CPU plan
        assumes a core per rank (the transfers run on gloo's threads beside the GEMM); it cannot see
        oversubscription (t=4 ranks on 2 cores: the overlapped layer is 0.90-0.95x the plain one).
        """
        if isinstance(overlap, ChunkPlan):
            overlap.validate(t)
            return ChunkPlan(1) if capturing_graph() else overlap
        if not isinstance(overlap, bool):
            raise ValueError(f"overlap must be a bool or a ChunkPlan, got {overlap!r}")
        if not overlap or t == 1 or capturing_graph():
            return ChunkPlan(1)
        flops = 2.0 * chunk_rows * k * n
        threshold = MIN_CHUNK_FLOPS.get(device.type, MIN_CHUNK_FLOPS["cuda"])
        if flops < threshold or chunk_rows < MIN_CHUNK_ROWS:
            return ChunkPlan(1)
        if device.type == "cuda":
            return ChunkPlan(t, prefetch=t - 1, bulk_ag_backward=True)
        return ChunkPlan(t, prefetch=1)


# ---- schedule recording (tests) ------------------------------------------------------------------

_RECORDER: Optional[List[Tuple]] = None


@contextlib.contextmanager
def record_schedule() -> Iterator[List[Tuple]]:
    """Collect the overlapped loops' events, in issue order, into the yielded list.

    Events: ``("exchange", name, step, bytes_sent)`` when a point-to-point transfer is issued,
    ``("collective", name, 0, bytes_in)`` when an async bulk collective is issued, ``("gemm", name,
    step)`` after a GEMM returned (on CPU: completed), ``("wait", name, step)`` when the loop waits
    for that transfer or collective.
    """
    global _RECORDER
    previous, _RECORDER = _RECORDER, []
    try:
        yield _RECORDER
    finally:
        _RECORDER = previous


def note(*event) -> None:
    """Append ``event`` to the active :func:`record_schedule` list (no-op when none is active)."""
    if _RECORDER is not None:
        _RECORDER.append(event)


# ---- point-to-point transfers --------------------------------------------------------------------

class Pending:
    """An in-flight transfer; keeps its tensors alive until :meth:`wait`."""

    def __init__(self, works, name: str, step: int, tensors):
        self._works, self._name, self._step, self._tensors = works, name, step, tensors

    def wait(self) -> None:
        note("wait", self._name, self._step)
        for w in self._works:
            w.wait()
        self._works, self._tensors = [], None


class PeerExchange:
    """Pairwise transfers on ``group`` (t > 1 ranks): step j sends to r + j + 1, receives from r - j - 1.

    Gathers: the chunk computed at step j is the shard of rank :meth:`source` ``(j)`` = r - j (step 0:
    this rank's own shard); transfer j (j = 0 .. t-2) delivers the shard of ``source(j + 1)`` while
    sending this rank's shard to :meth:`dest` ``(j)``. Reduce-scatters: step j computes the partial
    destined for ``dest(j)`` = r + j + 1 (the last step, j = t-1, is this rank's own) and transfer j
    sends it there while receiving, from ``source(j + 1)``, that rank's partial for this rank. No
    transfer forwards data received by another, so transfers can be issued in any number ahead.
    ``tag`` keeps different patterns apart on gloo (NCCL matches messages in issue order, which is
    the same on every rank).
    """

    def __init__(self, group: ProcessGroup):
        self.group = group
        self.t, self.rank = group_size(group), group_rank(group)
        if self.t < 2:
            raise ValueError(f"point-to-point overlap needs at least 2 ranks, the group has {self.t}")
        # P2POp takes global ranks on every torch release (``group_peer=`` is recent)
        world = group is None or group is dist.group.WORLD
        self._global = [r if world else dist.get_global_rank(group, r) for r in range(self.t)]

    def source(self, step: int) -> int:
        return (self.rank - step) % self.t

    def dest(self, step: int) -> int:
        return (self.rank + step + 1) % self.t

    def exchange(self, send: torch.Tensor, recv: torch.Tensor, *, step: int, name: str, tag: int) -> Pending:
        """Start transfer ``step``: ``send -> dest(step)`` and ``source(step + 1) -> recv``."""
        ops = [dist.P2POp(dist.isend, send, self._global[self.dest(step)], self.group, tag),
               dist.P2POp(dist.irecv, recv, self._global[self.source(step + 1)], self.group, tag)]
        works = dist.batch_isend_irecv(ops)
        note("exchange", name, step, send.numel() * send.element_size())
        return Pending(works, name, step, (send, recv))
