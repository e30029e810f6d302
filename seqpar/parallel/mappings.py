"""The conjugate operators of the paper as autograd functions over a process group.

================================  ====================  =====================  ==========
function                          forward               backward               paper
================================  ====================  =====================  ==========
copy_to_tensor_region             identity              all-reduce             f
reduce_from_tensor_region         all-reduce            identity               f-bar
gather_from_sequence_region       all-gather (dim 0)    reduce-scatter         g
reduce_scatter_to_sequence_region reduce-scatter        all-gather             g-bar
scatter_to_sequence_region        keep own shard        all-gather             (entry)
gather_to_replicated_region       all-gather (dim 0)    keep own shard         (exit)
================================  ====================  =====================  ==========

The exit leaves the sequence-parallel region for a tail every rank computes alike (a replicated head or
loss): each rank's backward then starts from the same full gradient, of which it keeps its shard. g's
reduce-scatter there would sum t equal gradients (every gradient before it t times too large); g is for
a tensor-parallel consumer whose ranks compute different partial results (a column-parallel linear).

``group`` is the tensor-parallel process group, the same group object on every rank of it (ranks passing
different groups wait in the collective until the process group's timeout); ``None`` means one rank (no
parallelism), not torch.distributed's default WORLD. Every function is the identity (returns its input)
when the group has one rank, and under no_grad runs its forward alone, without an autograd Function
(inference, compiled too). The sequence functions
(g, g-bar, the entry and the exit) split dim 0 into t equal shards: a length t does not divide, or a
tensor without dimensions, is a ValueError; so is an argument that is not a tensor.
``copy_to_tensor_region`` is also how replicated parameters that only see a sequence shard (LayerNorm
weights, the row-parallel output bias under SP) get their gradient summed over the group;
``copy_to_tensor_region_coalesced`` does it for several tensors with one all-reduce.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence, Tuple

import torch

from .._custom_op import once_differentiable
from .state import ProcessGroup, all_gather_seq, all_reduce, group_size, reduce_scatter_seq, sequence_shard


class _CopyToTensorRegion(torch.autograd.Function):
    """f over one or more tensors: identity forward; backward sums all their gradients over the group
    in one all-reduce of the concatenated gradients (one latency, not one per tensor)."""

    @staticmethod
    def forward(ctx, group, *xs):
        ctx.group = group
        ctx.shapes = [x.shape for x in xs]
        # An output nobody differentiated gets None, not zeros: the parameters of a norm whose y is unused
        # (only residual_out read) got a zero gradient under SP and None at t = 1, so AdamW's weight decay
        # and momentum moved them at t > 1 only.
        ctx.set_materialize_grads(False)
        outs = tuple(x.view_as(x) for x in xs)
        # A frozen tensor's copy stays frozen: what reads it computes no gradient for it (a norm's frozen
        # weight: no column sum); its zeros keep the all-reduce one size on every rank.
        ctx.mark_non_differentiable(*(out for i, out in enumerate(outs) if not ctx.needs_input_grad[1 + i]))
        return outs

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        if all(g is None for g in grads):   # as on every rank: the ranks run one program on their shards
            return (None,) * (len(grads) + 1)
        some = next(g for g in grads if g is not None)
        # the concatenation is a fresh contiguous buffer, so the in-place all-reduce touches no grad; an
        # undifferentiated output's zeros keep every rank's buffer the same size
        flat = all_reduce(torch.cat([some.new_zeros(shape.numel()) if g is None else g.reshape(-1)
                                     for g, shape in zip(grads, ctx.shapes)]), ctx.group)
        parts = flat.split([shape.numel() for shape in ctx.shapes])
        return (None,) + tuple(None if g is None else part.view(shape)
                               for part, g, shape in zip(parts, grads, ctx.shapes))


def _all_reduce_copy(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    return all_reduce(x.clone(memory_format=torch.contiguous_format), group)


def _own_shard(x_full: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    return sequence_shard(x_full, group).clone()


def _mapping(name: str, forward: Callable, backward: Callable) -> type:
    """An autograd Function over ``(x, group)``: ``forward(x, group)``, and ``backward(grad, group)`` for
    the gradient (the group kept on ctx); ``forward`` alone is its ``values`` (what :func:`_mapped` runs
    under no_grad)."""

    def fwd(ctx, x, group):
        ctx.group = group
        return forward(x, group)

    def bwd(ctx, grad):
        return backward(grad, ctx.group), None

    fwd.__qualname__, bwd.__qualname__ = f"{name}.forward", f"{name}.backward"   # as errors name them
    return type(name, (torch.autograd.Function,), {"forward": staticmethod(fwd), "values": staticmethod(forward),
                                                   "backward": staticmethod(once_differentiable(bwd))})


def _identity(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    return x


_ReduceFromTensorRegion = _mapping("_ReduceFromTensorRegion", _all_reduce_copy, _identity)
_GatherFromSequenceRegion = _mapping("_GatherFromSequenceRegion", all_gather_seq, reduce_scatter_seq)
_ReduceScatterToSequenceRegion = _mapping("_ReduceScatterToSequenceRegion", reduce_scatter_seq, all_gather_seq)
_GatherToReplicatedRegion = _mapping("_GatherToReplicatedRegion", all_gather_seq, _own_shard)
_ScatterToSequenceRegion = _mapping("_ScatterToSequenceRegion", _own_shard, all_gather_seq)


def _check_tensor(x, name: str, sequence: bool) -> None:
    if not isinstance(x, torch.Tensor) or (sequence and x.dim() == 0):
        got = "a 0-d tensor" if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{name} must be a tensor{' [s, ...] (sequence first)' if sequence else ''}, got {got}")


def _mapped(function, x: torch.Tensor, group: ProcessGroup, name: str = "x_full",
            sequence: bool = True) -> torch.Tensor:
    """``x`` itself on one rank; else ``function.apply(x, group)``, or where no gradient flows (no_grad /
    inference, or an x that doesn't require grad: a frozen embedding's output) ``function.values(x,
    group)``: the same values without the Function, which Dynamo could not trace there (it inlines the
    forward and fails storing the ProcessGroup on ctx). ``name`` / ``sequence``: the argument's name and
    whether it is split along dim 0, for the input check."""
    _check_tensor(x, name, sequence)
    if group_size(group) == 1:
        return x
    return function.apply(x, group) if _differentiated(x) else function.values(x, group)


def _differentiated(*tensors: Optional[torch.Tensor]) -> bool:
    """Whether a gradient can flow back to any of ``tensors`` (grad mode on and one requires grad; None
    entries count as not): where none can, the mappings (and the comm GEMMs) skip their Function."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def copy_to_tensor_region(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """f: identity forward, all-reduce of the gradient backward. ``x`` is any tensor (replicated over
    ``group``, the tensor-parallel group); returned as it is (no Function) with one rank or no gradient."""
    _check_tensor(x, "x", sequence=False)
    if group_size(group) == 1 or not _differentiated(x):   # the forward is the identity (see _mapped)
        return x
    return _CopyToTensorRegion.apply(group, x)[0]


def copy_to_tensor_region_coalesced(xs: Sequence[torch.Tensor], group: ProcessGroup) -> Tuple[torch.Tensor, ...]:
    """f on each of ``xs`` (same dtype and device), their gradients summed over ``group`` in ONE all-reduce.

    For tensors whose gradients are ready together (a LayerNorm's weight and bias): one collective's
    latency instead of one per tensor. The copies of those that don't require grad (frozen) don't either,
    so nothing computes their gradients (a frozen weight's column sum); with none requiring grad (a norm
    frozen whole) the tensors are returned as they are, with no Function for Dynamo to fail on (see
    _mapped). Every rank must freeze the same ones (the layers' and GPTModel's per-forward rank check
    compares which parameters require grad): otherwise the sums are partial, or a rank that froze them all
    leaves the others' all-reduce waiting.
    """
    xs = tuple(xs)
    if not xs or any(not isinstance(x, torch.Tensor) for x in xs):
        raise ValueError(f"xs must be a non-empty sequence of tensors, got {[type(x).__name__ for x in xs]}")
    if len({(x.dtype, x.device) for x in xs}) > 1:
        raise ValueError(f"xs must share dtype and device, got {[(x.dtype, str(x.device)) for x in xs]}")
    if group_size(group) == 1 or not _differentiated(*xs):   # the identity (see _mapped)
        return xs
    return _CopyToTensorRegion.apply(group, *xs)


def reduce_from_tensor_region(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """f-bar: all-reduce forward, identity backward. ``x``: this rank's partial result (any shape), summed
    over ``group`` into a copy (x itself is not modified)."""
    return _mapped(_ReduceFromTensorRegion, x, group, "x", sequence=False)


def gather_from_sequence_region(x_shard: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """g: all-gather ``x_shard`` [s/t, ...] -> [s, ...] over ``group`` (rank order along dim 0) forward,
    reduce-scatter of the gradient backward: before a tensor-parallel consumer (a column-parallel linear). Before a
    tail every rank computes alike (a loss, a replicated head) use :func:`gather_to_replicated_region` (the module
    docstring says why)."""
    return _mapped(_GatherFromSequenceRegion, x_shard, group, "x_shard")


def reduce_scatter_to_sequence_region(x_full: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """g-bar: reduce-scatter [s, ...] -> [s/t, ...] forward, all-gather of the gradient backward.
    ``x_full`` is this rank's partial sum of the full sequence; the result is the sum over ``group`` of
    its dim-0 shard r (r: this rank's index in the group)."""
    return _mapped(_ReduceScatterToSequenceRegion, x_full, group)


def scatter_to_sequence_region(x_full: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Enter the sequence-parallel region: keep this rank's shard forward, all-gather backward.
    ``x_full`` [s, ...] is the same on every rank of ``group``; the result is a copy of its dim-0 shard r
    [s/t, ...] (r: this rank's index in the group)."""
    return _mapped(_ScatterToSequenceRegion, x_full, group)


def gather_to_replicated_region(x_shard: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Leave the sequence-parallel region: all-gather ``x_shard`` [s/t, ...] -> [s, ...] over ``group`` forward,
    keep this rank's shard of the gradient backward (Megatron's gather with ``tensor_parallel_output_grad=False``).
    For a tail every rank computes alike from the full tensor (a loss, a replicated head): each rank's backward then
    holds the same full gradient, and summing them (g's reduce-scatter) would count it t times."""
    return _mapped(_GatherToReplicatedRegion, x_shard, group, "x_shard")
