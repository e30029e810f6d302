"""GEMMs fused with the sequence-parallel collectives (the column- and row-parallel linears under SP).

==========================  ==================  ===============  ======================
op                          input               weight           output
==========================  ==================  ===============  ======================
all_gather_matmul           x_shard [s/t, b, k] [n_local, k]     y [s, b, n_local]
matmul_reduce_scatter       x [s, b, k_local]   [n, k_local]     y_shard [s/t, b, n]
==========================  ==================  ===============  ======================

``group``: the tensor-parallel process group, the same group object on every rank of it (made by one
``dist.new_group`` call or one DeviceMesh dimension; ranks passing different groups wait in the first
collective until the process group's timeout). ``None`` means one rank (no parallelism), not
torch.distributed's default WORLD: pass ``dist.group.WORLD`` for that.

``all_gather_matmul``: ``y = all_gather_seq(x_shard) @ weight^T + bias``. Only ``x_shard`` is saved;
backward re-gathers it while computing the input gradient, then reduce-scatters the input gradient
while computing the weight gradient (Megatron-LM's order; the paper's Section 4.2.2).

``matmul_reduce_scatter``: ``y_shard = reduce_scatter_seq(x @ weight^T) + bias``; backward all-gathers
the output gradient. ``bias`` here is added after the reduce-scatter, so its gradient is this rank's
shard sum; wrap a replicated bias in :func:`seqpar.parallel.copy_to_tensor_region` to sum it over the
group (the layers do).

Overlap (``overlap=``, resolved by :meth:`seqpar.parallel.overlap.ChunkPlan.choose`). With one chunk
the ops run the plain path above. With one chunk per rank, the passes whose GEMM would otherwise wait
for (or be waited on by) a bulk collective split that GEMM by sequence shard (``[i]`` = the rows of
rank i's shard, rows ``i*s/t*b .. (i+1)*s/t*b`` of the flattened [s*b, .] tensors) and move shards
point to point (:class:`seqpar.parallel.overlap.PeerExchange`: transfer j sends to ``r + j + 1`` and
receives from ``r - j - 1``), each transfer running beside a GEMM (``||``):

==========================  =========================================================================
pass                        chunked schedule, step j = 0 .. t-1
==========================  =========================================================================
all_gather_matmul fwd       y[r - j] = x[r - j] W^T + b  ||  transfers bringing x[r - j - 1 ..]
                            (``prefetch`` of them in flight; x_shard goes to every other rank)
matmul_reduce_scatter fwd   P_j = x[r + j + 1] W^T (j = t-1: this rank's own rows)  ||  earlier
                            partials in flight; then P_j -> rank r + j + 1 while rank r - j - 1's
                            partial for this rank arrives; y_shard = sum of the t partials + b
matmul_reduce_scatter bwd   grad_x[r - j] = g[r - j] W  ||  transfers bringing g[r - j - 1 ..];
                            then one weight-gradient GEMM grad_y_full^T x
all_gather_matmul bwd       (unless bulk_ag_backward, below) re-gather of x, all t-1 transfers
                            issued first  ||  P_j = g[r + j + 1] W, the grad_x partial of rank
                            r + j + 1, sent as in matmul_reduce_scatter fwd; then the weight-gradient
                            GEMM grad_y^T x  ||  the last partials in flight
==========================  =========================================================================

The plain backward of all_gather_matmul (async re-gather of x || input-gradient GEMM, then async
reduce-scatter of grad_x || weight-gradient GEMM) already hides both of its collectives where they
run beside the GEMMs for free (NCCL, on its own stream), so ``ChunkPlan.bulk_ag_backward`` keeps it
there (the CUDA plan); chunking it would only add the partials sum. On gloo the bulk collectives
cost far more CPU than point-to-point shards (2 ranks, 4 MiB shards: reduce-scatter 12.3 ms,
all-gather 7.6 ms, one pairwise exchange 3.7 ms), CPU the GEMMs beside them need, so the CPU plan
chunks this backward too.

Each rank sends t-1 shard-sized messages per chunked gather or scatter: the bytes of a ring
all-gather or reduce-scatter. Weight gradients stay one GEMM over the gathered tensor (splitting their
reduction dimension would re-read and re-write the [n, k] output once per chunk), so they equal the
plain path's bit for bit; the reduce-scatter sums the t partials in one reduction (one rounding).
Chunk outputs are written straight into their rows of the output (``out=`` views). The saved tensors
are the plain path's: ``x_shard`` and ``weight`` (all_gather_matmul), ``x`` and ``weight``
(matmul_reduce_scatter). Results equal the plain path up to summation order.
"""
from __future__ import annotations

import functools
import math
from typing import List, Optional, Union

import torch

from . import registry
from ..parallel.overlap import ChunkPlan, PeerExchange, note
from ..parallel.mappings import _differentiated
from ..parallel.state import (ProcessGroup, agree_on_inputs, all_gather_seq, all_reduce, group_size,
                              reduce_scatter_seq)

_TAG_GATHER, _TAG_SCATTER = 11, 12   # gloo tags per pattern (NCCL ignores tags, matches in order)


# Sizes written out, never -1: a rank's output columns may be none (an empty vocabulary shard), and
# reshape can't infer a dimension beside a 0.
def _flat(t: torch.Tensor) -> torch.Tensor:
    """[..., n] -> [rows, n]."""
    return t.reshape(math.prod(t.shape[:-1]), t.shape[-1])


def _by_rank(t: torch.Tensor, ranks: int) -> torch.Tensor:
    """[s, ..., n] (s a multiple of ``ranks``) -> [ranks, rows per rank, n], a view."""
    return t.view(ranks, math.prod(t.shape[:-1]) // ranks, t.shape[-1])


# ---- chunked passes: no autograd; [rows, features] 2-D views and [t, rows, features] per-rank slots ----

def _wait_all(pending) -> None:
    """Wait for every transfer in ``pending`` still in flight (None: already waited)."""
    for transfer in pending:
        if transfer is not None:
            transfer.wait()


def _drained(pending: List[Optional[object]], run) -> None:
    """``run()``, and should it raise (a GEMM's OOM, a KeyboardInterrupt) the transfers it issued into
    ``pending`` are waited before the exception goes on: left pending, they made gloo's next collective
    on the group hang on every rank."""
    try:
        run()
    except BaseException:
        _wait_all(pending)
        raise


def _gather_chunks(ex: PeerExchange, shard2, slots3, plan: ChunkPlan, name: str, gemm):
    """Pairwise all-gather of ``shard2`` [rows, m] into ``slots3`` [t, rows, m] (slot i: rank i's shard;
    this rank's slot is left untouched), calling ``gemm(src, chunk)`` for every rank's chunk as it
    arrives (own shard first), with up to ``plan.prefetch`` transfers in flight ahead of it."""
    t = ex.t
    pending: List[Optional[object]] = [None] * (t - 1)

    def run():
        issued = 0
        for j in range(t):
            while issued < min(j + plan.prefetch, t - 1):   # transfer i brings the chunk of step i + 1
                pending[issued] = ex.exchange(shard2, slots3[ex.source(issued + 1)], step=issued, name=name,
                                              tag=_TAG_GATHER)
                issued += 1
            if j > 0:
                pending[j - 1].wait()
                pending[j - 1] = None
            src = ex.source(j)
            gemm(src, shard2 if j == 0 else slots3[src])
            note("gemm", name, j)

    _drained(pending, run)


def _reduce_scatter_chunks(ex: PeerExchange, a3, b, plan: ChunkPlan, name: str, beside=None, out=None):
    """This rank's rows of sum_ranks(a3 [t, rows, m] @ b [m, n]) -> [rows, n] (into ``out`` if given),
    partials sent pairwise right after their GEMM, up to ``plan.prefetch`` in flight, summed once at the
    end. ``beside()``, if given, runs after the last GEMM while the last partials are still in flight."""
    t, r = ex.t, ex.rank
    rows, n = a3.shape[1], b.shape[1]
    partials = torch.empty((t, rows, n), dtype=a3.dtype, device=a3.device)   # [i]: rank i's, for me
    nbuf = min(plan.prefetch + 1, t - 1)     # a buffer is rewritten only after its transfer was waited
    sendbufs = torch.empty((nbuf, rows, n), dtype=a3.dtype, device=a3.device)
    pending: List[Optional[object]] = [None] * (t - 1)

    def run():
        for j in range(t):
            last = j == t - 1
            target = partials[r] if last else sendbufs[j % nbuf]
            torch.mm(a3[ex.dest(j)], b, out=target)   # beside the partials still in flight
            note("gemm", name, j)
            if last:
                break
            if j >= plan.prefetch:
                pending[j - plan.prefetch].wait()
                pending[j - plan.prefetch] = None
            pending[j] = ex.exchange(target, partials[ex.source(j + 1)], step=j, name=name, tag=_TAG_SCATTER)
        if beside is not None:
            beside()

    _drained(pending, run)
    _wait_all(pending)
    return torch.sum(partials, 0, out=out)


def _chunked_all_gather_matmul_fwd(x_shard2, weight, bias, group, plan: ChunkPlan, out3):
    """out3 [t, rows, n] (rank i's rows at out3[i]) = gather(x_shard2) @ weight^T + bias."""
    ex = PeerExchange(group)
    slots = torch.empty((ex.t,) + tuple(x_shard2.shape), dtype=x_shard2.dtype, device=x_shard2.device)

    def gemm(src, chunk):
        if bias is None:
            torch.mm(chunk, weight.t(), out=out3[src])
        else:
            torch.addmm(bias, chunk, weight.t(), out=out3[src])

    _gather_chunks(ex, x_shard2, slots, plan, "ag_fwd", gemm)


def _chunked_matmul_reduce_scatter_bwd(grad_y_shard2, x3, weight, group, plan: ChunkPlan, need_x, need_w):
    """grad_y_shard2 [rows, n] -> (grad_x [t, rows, k] or None, grad_weight [n, k] or None)."""
    ex = PeerExchange(group)
    grad_y3 = torch.empty((ex.t,) + tuple(grad_y_shard2.shape), dtype=grad_y_shard2.dtype,
                          device=grad_y_shard2.device)
    grad_y3[ex.rank].copy_(grad_y_shard2)
    grad_x3 = torch.empty_like(x3) if need_x else None

    def gemm(src, chunk):
        if need_x:
            torch.mm(chunk, weight, out=grad_x3[src])

    _gather_chunks(ex, grad_y_shard2, grad_y3, plan, "ag_grad_bwd", gemm)
    grad_weight = _flat(grad_y3).t().matmul(_flat(x3)) if need_w else None
    return grad_x3, grad_weight


def _chunked_all_gather_matmul_bwd(x_shard2, grad_y3, weight, group, plan: ChunkPlan, need_x, need_w):
    """x_shard2 [rows, k], grad_y3 [t, rows, n_local] (rank i's rows at [i]) -> (grad_x_shard [rows, k]
    or None, grad_weight [n_local, k] or None).

    The re-gather of x is issued first, all t-1 transfers at once (nothing needs it before the weight
    gradient); the input-gradient GEMM runs by destination rank with each partial sent as soon as it is
    computed (the pairwise reduce-scatter); the weight-gradient GEMM runs beside the last partials.
    """
    ex = PeerExchange(group)
    grad_weight, grad_x_shard = None, None
    regather: List[Optional[object]] = []
    if need_w:
        x3 = torch.empty((ex.t,) + tuple(x_shard2.shape), dtype=x_shard2.dtype, device=x_shard2.device)
        x3[ex.rank].copy_(x_shard2)

    def weight_gradient():
        nonlocal grad_weight
        for j, transfer in enumerate(regather):
            transfer.wait()
            regather[j] = None
        grad_weight = _flat(grad_y3).t().matmul(_flat(x3))
        note("gemm", "wgrad", 0)

    def run():
        nonlocal grad_x_shard
        for j in range(ex.t - 1 if need_w else 0):   # issued in here: drained if a later issue raises
            regather.append(ex.exchange(x_shard2, x3[ex.source(j + 1)], step=j, name="ag_bwd_x", tag=_TAG_GATHER))
        if need_x:
            grad_x_shard = _reduce_scatter_chunks(ex, grad_y3, weight, plan, "ag_bwd_dgrad",
                                                  beside=weight_gradient if need_w else None)
        elif need_w:
            weight_gradient()

    _drained(regather, run)
    return grad_x_shard, grad_weight


# ---- autograd functions ----------------------------------------------------------------------------

def _in_operands_dtype(fn):
    """An autograd Function's forward / backward (its first tensor argument after ctx gives the device) with
    torch.autocast off: it computes in its operands' dtype, as seqpar's other ops do. Under autocast the
    plain path's matmuls were cast to bf16 while the chunked path's out= GEMMs were not, so a plan picked by
    the GEMM's size decided the dtype, and a backward run outside the autocast block then failed on a bf16
    output's fp32 weight."""
    @functools.wraps(fn)
    def run(ctx, first, *args):
        device_type = first.device.type
        if not (torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type)):
            return fn(ctx, first, *args)   # the common case: no context to enter
        with torch.autocast(device_type, enabled=False):
            return fn(ctx, first, *args)
    return run


class _AllGatherMatmul(torch.autograd.Function):
    @staticmethod
    @_in_operands_dtype
    def forward(ctx, x_shard, weight, bias, group, plan: ChunkPlan):
        ctx.group, ctx.has_bias, ctx.plan = group, bias is not None, plan
        ctx.save_for_backward(x_shard, weight)
        # Outputs are written into a fresh y of the final shape, never returned as a view of a tensor made
        # here: autograd refuses in-place ops on such a view (a caller's y.add_(...)), and F.linear of a 3-D
        # input with a bias is one (a reshape of its 2-D addmm).
        x_shard = x_shard.contiguous()
        if not plan.overlapped:
            return _gemm_into_new(all_gather_seq(x_shard, group), weight, bias)
        t = group_size(group)
        y = torch.empty((x_shard.shape[0] * t,) + tuple(x_shard.shape[1:-1]) + (weight.shape[0],),
                        dtype=x_shard.dtype, device=x_shard.device)
        _chunked_all_gather_matmul_fwd(_flat(x_shard), weight, bias, group, plan,
                                       _by_rank(y, t))
        return y

    @staticmethod
    @registry.once_differentiable
    @_in_operands_dtype
    def backward(ctx, grad_y):
        x_shard, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        grad_y = grad_y.contiguous()
        grad_bias = _flat(grad_y).sum(0) if (ctx.has_bias and need_b) else None
        if ctx.plan.overlapped and not ctx.plan.bulk_ag_backward:
            t = ctx.plan.chunks
            grad_x_shard2, grad_weight = _chunked_all_gather_matmul_bwd(
                _flat(x_shard.contiguous()), _by_rank(grad_y, t), weight, ctx.group,
                ctx.plan, need_x, need_w)
            grad_x_shard = grad_x_shard2.view(x_shard.shape) if need_x else None
            return grad_x_shard, grad_weight, grad_bias, None, None
        gather = scatter = x_full = grad_x_shard = grad_weight = None
        if need_w:
            x_full, gather = all_gather_seq(x_shard, ctx.group, async_op=True)
            note("collective", "ag_bwd", 0, x_shard.numel() * x_shard.element_size())
        if need_x:
            grad_x_full = torch.matmul(grad_y, weight)                      # overlaps the re-gather
            note("gemm", "dgrad", 0)
            grad_x_shard, scatter = reduce_scatter_seq(grad_x_full, ctx.group, async_op=True)
            note("collective", "rs_bwd", 0, grad_x_full.numel() * grad_x_full.element_size())
        if need_w:
            if gather is not None:
                gather.wait()
            note("wait", "ag_bwd", 0)
            grad_weight = _flat(grad_y).t().matmul(_flat(x_full))           # overlaps the reduce-scatter
            note("gemm", "wgrad", 0)
        if scatter is not None:
            scatter.wait()
        if need_x:
            note("wait", "rs_bwd", 0)
        return grad_x_shard, grad_weight, grad_bias, None, None


class _MatmulReduceScatter(torch.autograd.Function):
    @staticmethod
    @_in_operands_dtype
    def forward(ctx, x, weight, bias, group, plan: ChunkPlan):
        ctx.group, ctx.has_bias, ctx.plan = group, bias is not None, plan
        ctx.save_for_backward(x, weight)
        if not plan.overlapped:
            y_shard = reduce_scatter_seq(torch.matmul(x, weight.t()), group)
        else:
            t = plan.chunks
            y_shard = torch.empty((x.shape[0] // t,) + tuple(x.shape[1:-1]) + (weight.shape[0],),
                                  dtype=x.dtype, device=x.device)   # not a view (see _AllGatherMatmul)
            _reduce_scatter_chunks(PeerExchange(group), _by_rank(x.contiguous(), t), weight.t(), plan, "rs_fwd",
                                   out=_flat(y_shard))
        if bias is not None:
            y_shard = y_shard + bias
        return y_shard

    @staticmethod
    @registry.once_differentiable
    @_in_operands_dtype
    def backward(ctx, grad_y_shard):
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        grad_bias = _flat(grad_y_shard).sum(0) if (ctx.has_bias and need_b) else None
        if ctx.plan.overlapped:
            t = ctx.plan.chunks
            grad_x3, grad_weight = _chunked_matmul_reduce_scatter_bwd(
                _flat(grad_y_shard.contiguous()), _by_rank(x.contiguous(), t), weight,
                ctx.group, ctx.plan, need_x, need_w)
            return (grad_x3.view(x.shape) if need_x else None), grad_weight, grad_bias, None, None
        grad_y_full = all_gather_seq(grad_y_shard, ctx.group)
        grad_x = torch.matmul(grad_y_full, weight) if need_x else None
        grad_weight = _flat(grad_y_full).t().matmul(_flat(x)) if need_w else None
        return grad_x, grad_weight, grad_bias, None, None


def _gemm_into_new(x, weight, bias) -> torch.Tensor:
    """``x @ weight^T + bias`` [..., n] written into a fresh tensor (not a view of a 2-D result: see
    :class:`_AllGatherMatmul`), so it can be returned from a Function (and all-reduced in place)."""
    y = torch.empty(tuple(x.shape[:-1]) + (weight.shape[0],), dtype=x.dtype, device=x.device)
    x2 = _flat(x.contiguous())
    if bias is None:
        torch.mm(x2, weight.t(), out=_flat(y))
    else:
        torch.addmm(bias, x2, weight.t(), out=_flat(y))
    return y


class _CopyMatmul(torch.autograd.Function):
    """f, then the column-parallel GEMM (tensor parallelism without SP): ``y = x W^T + b``; backward, the
    input's gradient ``g W`` is all-reduced over the group in place while the weight's ``g^T x`` runs
    (Megatron's asynchronous tensor-parallel all-reduce). f as its own Function copied that gradient
    into a new buffer before its all-reduce and issued it only after the weight gradient."""

    @staticmethod
    @_in_operands_dtype
    def forward(ctx, x, weight, bias, group):
        ctx.group, ctx.has_bias = group, bias is not None
        ctx.save_for_backward(x, weight)
        return _gemm_into_new(x, weight, bias)

    @staticmethod
    @registry.once_differentiable
    @_in_operands_dtype
    def backward(ctx, grad_y):
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        grad_y = grad_y.contiguous()
        grad_x = reduction = None
        if need_x:
            grad_x, reduction = all_reduce(torch.matmul(grad_y, weight), ctx.group, async_op=True)
        try:   # beside the all-reduce
            grad_weight = _flat(grad_y).t().matmul(_flat(x.contiguous())) if need_w else None
            grad_bias = _flat(grad_y).sum(0) if (ctx.has_bias and need_b) else None
        finally:   # waited for even when a GEMM raises (left in flight, gloo's next collective hung)
            if reduction is not None:
                reduction.wait()
        return grad_x, grad_weight, grad_bias, None


class _MatmulAllReduce(torch.autograd.Function):
    """The row-parallel GEMM, then f-bar (tensor parallelism without SP): ``y = x W^T`` summed over the
    group, in place in the GEMM's fresh output (f-bar as its own Function copied it first); backward
    ``g W`` and ``g^T x`` (f-bar's backward is the identity)."""

    @staticmethod
    @_in_operands_dtype
    def forward(ctx, x, weight, group):
        ctx.save_for_backward(x, weight)
        return all_reduce(_gemm_into_new(x, weight, None), group)

    @staticmethod
    @registry.once_differentiable
    @_in_operands_dtype
    def backward(ctx, grad_y):
        x, weight = ctx.saved_tensors
        need_x, need_w = ctx.needs_input_grad[:2]
        grad_y = grad_y.contiguous()
        grad_x = torch.matmul(grad_y, weight) if need_x else None
        grad_weight = _flat(grad_y).t().matmul(_flat(x.contiguous())) if need_w else None
        return grad_x, grad_weight, None


def copy_matmul(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                group: ProcessGroup) -> torch.Tensor:
    """``f(x) @ weight^T + bias`` [..., n_local] for a column-parallel GEMM without sequence parallelism
    (:class:`_CopyMatmul`), unchecked: the callers (the parallel linears, the model's output GEMM) checked
    and agreed on their arguments. At t = 1, and where no gradient flows, plain ``F.linear`` (the
    Function, which Dynamo can't trace without a gradient, would add nothing)."""
    if group_size(group) == 1 or not _differentiated(x, weight, bias):
        return torch.nn.functional.linear(x, weight, bias)
    return _CopyMatmul.apply(x, weight, bias, group)


def matmul_all_reduce(x: torch.Tensor, weight: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """``f-bar(x @ weight^T)`` [..., n] for a row-parallel GEMM without sequence parallelism
    (:class:`_MatmulAllReduce`), unchecked (as :func:`copy_matmul`)."""
    if group_size(group) == 1:
        return torch.matmul(x, weight.t())
    if not _differentiated(x, weight):
        return all_reduce(torch.matmul(x, weight.t()), group)   # a fresh product: summed in place
    return _MatmulAllReduce.apply(x, weight, group)


def _check(x, weight, bias, x_name):
    registry.check_dense(**{x_name: x, "weight": weight, "bias": bias})
    if not isinstance(x, torch.Tensor) or x.dim() < 2 or not x.is_floating_point():
        raise ValueError(f"{x_name} must be a floating [..., k] tensor of at least 2 dims ([s, b, k] in a layer), got "
                         f"{getattr(x, 'dtype', type(x).__name__)} {tuple(getattr(x, 'shape', ()))}")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[1] != x.shape[-1]:
        raise ValueError(f"weight must be a [n, {x.shape[-1]}] tensor ({x_name}'s inner dim), got "
                         f"{tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__}")
    if bias is not None and (not isinstance(bias, torch.Tensor) or bias.shape != (weight.shape[0],)):
        got = tuple(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__
        raise ValueError(f"bias must be a [{weight.shape[0]}] tensor, got {got}")
    # bias is added to the GEMM's output, so it must match it too (a fp32 bias on bf16 GEMMs would promote y)
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and (t.dtype != x.dtype or t.device != x.device):
            raise ValueError(f"{name} is {t.dtype} on {t.device} but {x_name} is {x.dtype} on {x.device}")


# What the ranks of a call must share, beyond each rank's own checks: an all-gather or reduce-scatter of
# tensors of other sizes aborts the process inside gloo (or hangs / corrupts NCCL), and ranks whose overlap
# plans differ wait in different collectives.
#: The hint of the comm GEMMs' rank-agreement errors (and of the split linears' under sequence parallelism).
SHARD_HINT = ("Every rank passes its part of the same [s, b, ...] sequence (under sequence parallelism its s/t "
              "rows, s divisible by t) in the same dtype, with the same overlap plan (overlap=True sizes it by "
              "this rank's GEMM: pass overlap=False or one ChunkPlan where the weight shards differ)")


def agreed_shape_and_dtype(t, shape_name: str, dtype_name: str, dims: slice = slice(None)) -> dict:
    """``{shape_name: t.shape[dims], dtype_name: t.dtype}``: values for :func:`agree_on_inputs`, whatever
    ``t`` is (never raises)."""
    tensor = isinstance(t, torch.Tensor)
    return {shape_name: tuple(t.shape[dims]) if tensor else None, dtype_name: t.dtype if tensor else None}


def agreed_gradients(**tensors) -> dict:
    """``{"<name>.requires_grad (grad mode on)": bool}`` of this call (grad mode on and requires_grad), values for
    :func:`agree_on_inputs`: ranks that differ run different collectives in backward (one re-gathers x
    or reduce-scatters its gradient, another does not), which hangs."""
    grad_mode = torch.is_grad_enabled()
    return {f"{name}.requires_grad (grad mode on)": bool(grad_mode and isinstance(t, torch.Tensor) and t.requires_grad)
            for name, t in tensors.items()}


def all_gather_plan(x_shard: torch.Tensor, weight: torch.Tensor, group: ProcessGroup,
                    overlap: Union[bool, ChunkPlan]) -> ChunkPlan:
    """The :class:`ChunkPlan` of ``all_gather_matmul(x_shard, weight, group=group, overlap=overlap)``."""
    return ChunkPlan.choose(overlap, t=group_size(group), chunk_rows=math.prod(x_shard.shape[:-1]),
                            k=weight.shape[1], n=weight.shape[0], device=x_shard.device)


def reduce_scatter_plan(x: torch.Tensor, weight: torch.Tensor, group: ProcessGroup,
                        overlap: Union[bool, ChunkPlan]) -> ChunkPlan:
    """The :class:`ChunkPlan` of ``matmul_reduce_scatter(x, weight, group=group, overlap=overlap)``."""
    t = group_size(group)
    return ChunkPlan.choose(overlap, t=t, chunk_rows=math.prod(x.shape[:-1]) // t, k=weight.shape[1],
                            n=weight.shape[0], device=x.device)


def all_gather_matmul(x_shard: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
                      group: ProcessGroup, overlap: Union[bool, ChunkPlan] = True) -> torch.Tensor:
    """``all_gather_seq(x_shard) @ weight^T + bias``: [s/t, b, k] x [n_local, k] -> [s, b, n_local].

    ``group``: the tensor-parallel process group, t = its size (module doc; None: one rank).
    ``overlap``: ``True`` chunks by rank where :meth:`ChunkPlan.choose` says it pays (large GEMMs),
    ``False`` runs the plain path, a :class:`ChunkPlan` forces that plan.

    ValueError (naming the value) for an ``x_shard`` that is not a floating [s/t, b, k] tensor, a
    ``weight`` not [n_local, k], a ``bias`` not [n_local], or a weight / bias of another dtype or device.
    On every rank of ``group``, before any collective, when any rank rejects its arguments or the ranks'
    ``x_shard`` shapes, dtypes or overlap plans differ (uneven sequence shards; ``overlap=True`` sizes
    the plan by this rank's GEMM, so weight shards of different n_local can pick different plans): one
    all-gather of a few int64 per call and, on NCCL, a host sync
    (:func:`seqpar.parallel.state.check_ranks_agree`); skipped inside
    :func:`seqpar.parallel.state.agreement_checked` and while a graph is captured.
    """
    def check() -> ChunkPlan:
        _check(x_shard, weight, bias, "x_shard")
        return all_gather_plan(x_shard, weight, group, overlap)

    def agreed(plan):
        return {**agreed_shape_and_dtype(x_shard, "x_shard shape", "x_shard dtype"),
                **agreed_gradients(x_shard=x_shard, weight=weight), "overlap plan": plan}

    plan = agree_on_inputs(group, check, agreed, what="all_gather_matmul", hint=SHARD_HINT,
                           device=getattr(x_shard, "device", None))
    return _all_gather_matmul(x_shard, weight, bias, group, plan)


def _all_gather_matmul(x_shard, weight, bias, group: ProcessGroup, plan: ChunkPlan) -> torch.Tensor:
    """:func:`all_gather_matmul` on ``plan``, unchecked: for callers that checked and agreed on their
    arguments and plan themselves (the parallel linears, the model's output GEMM)."""
    return _AllGatherMatmul.apply(x_shard, weight, bias, group, plan)


def matmul_reduce_scatter(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
                          group: ProcessGroup, overlap: Union[bool, ChunkPlan] = True) -> torch.Tensor:
    """``reduce_scatter_seq(x @ weight^T) + bias``: [s, b, k_local] x [n, k_local] -> [s/t, b, n].

    ``group`` and ``overlap`` as in :func:`all_gather_matmul`. ValueError (naming the value) for an ``x``
    that is not a floating [s, b, k_local] tensor, s not divisible by t, a ``weight`` not [n, k_local], a
    ``bias`` not [n], or a weight / bias of another dtype or device; on every rank, as in
    :func:`all_gather_matmul`, when any rank rejects its arguments or the ranks' ``x`` leading dims [s, b],
    n, dtypes or overlap plans differ.
    """
    t = group_size(group)

    def check() -> ChunkPlan:
        _check(x, weight, bias, "x")
        if x.shape[0] % t:
            raise ValueError(f"sequence length {x.shape[0]} is not divisible by the group size {t}")
        return reduce_scatter_plan(x, weight, group, overlap)

    def agreed(plan):
        n = weight.shape[0] if isinstance(weight, torch.Tensor) and weight.dim() == 2 else None
        return {**agreed_shape_and_dtype(x, "x.shape[:-1]", "x dtype", slice(0, -1)), "weight.shape[0] (n)": n,
                **agreed_gradients(x=x, weight=weight), "overlap plan": plan}

    plan = agree_on_inputs(group, check, agreed, what="matmul_reduce_scatter", hint=SHARD_HINT,
                           device=getattr(x, "device", None))
    return _matmul_reduce_scatter(x, weight, bias, group, plan)


def _matmul_reduce_scatter(x, weight, bias, group: ProcessGroup, plan: ChunkPlan) -> torch.Tensor:
    """:func:`matmul_reduce_scatter` on ``plan``, unchecked (as :func:`_all_gather_matmul`)."""
    return _MatmulReduceScatter.apply(x, weight, bias, group, plan)
