"""GEMMs fused with the sequence-parallel collectives (the column- and row-parallel linears under SP).

==========================  ==================  ===============  ======================
op                          input               weight           output
==========================  ==================  ===============  ======================
all_gather_matmul           x_shard [s/t, b, k] [n_local, k]     y [s, b, n_local]
matmul_reduce_scatter       x [s, b, k_local]   [n, k_local]     y_shard [s/t, b, n]
==========================  ==================  ===============  ======================

``all_gather_matmul``: ``y = all_gather_seq(x_shard) @ weight^T + bias``. Only ``x_shard`` is saved;
backward re-gathers it asynchronously while computing the input gradient, then reduce-scatters the
input gradient asynchronously while computing the weight gradient (Megatron's order, paper.md).

``matmul_reduce_scatter``: ``y_shard = reduce_scatter_seq(x @ weight^T) + bias``; backward all-gathers
the output gradient. ``bias`` here is added after the reduce-scatter, so its gradient is this rank's
shard sum; wrap a replicated bias in :func:`seqpar.parallel.copy_to_tensor_region` to sum it over the
group (the layers do).
"""
from __future__ import annotations

from typing import Optional

import torch

from ..parallel.state import ProcessGroup, all_gather_seq, group_size, reduce_scatter_seq


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


class _AllGatherMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_shard, weight, bias, group):
        x_full = all_gather_seq(x_shard, group)
        y = torch.nn.functional.linear(x_full, weight, bias)
        ctx.save_for_backward(x_shard, weight)
        ctx.group, ctx.has_bias = group, bias is not None
        return y

    @staticmethod
    def backward(ctx, grad_y):
        x_shard, weight = ctx.saved_tensors
        grad_y = grad_y.contiguous()
        x_full, gather = all_gather_seq(x_shard, ctx.group, async_op=True)
        grad_x_full = torch.matmul(grad_y, weight)                      # overlaps the re-gather
        grad_x_shard, scatter = reduce_scatter_seq(grad_x_full, ctx.group, async_op=True)
        if gather is not None:
            gather.wait()
        grad_weight = _flat(grad_y).t().matmul(_flat(x_full))           # overlaps the reduce-scatter
        grad_bias = _flat(grad_y).sum(0) if ctx.has_bias else None
        if scatter is not None:
            scatter.wait()
        return grad_x_shard, grad_weight, grad_bias, None


class _MatmulReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, group):
        y_shard = reduce_scatter_seq(torch.matmul(x, weight.t()), group)
        if bias is not None:
            y_shard = y_shard + bias
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.has_bias = group, bias is not None
        return y_shard

    @staticmethod
    def backward(ctx, grad_y_shard):
        x, weight = ctx.saved_tensors
        grad_y_full = all_gather_seq(grad_y_shard, ctx.group)
        grad_x = torch.matmul(grad_y_full, weight)
        grad_weight = _flat(grad_y_full).t().matmul(_flat(x))
        grad_bias = _flat(grad_y_shard).sum(0) if ctx.has_bias else None
        return grad_x, grad_weight, grad_bias, None


def _check(x, weight, bias, x_name):
    if not isinstance(x, torch.Tensor) or x.dim() < 2 or not x.is_floating_point():
        raise ValueError(f"{x_name} must be a floating [s, b, k] tensor, got "
                         f"{getattr(x, 'dtype', type(x).__name__)} {tuple(getattr(x, 'shape', ()))}")
    if weight.dim() != 2 or weight.shape[1] != x.shape[-1]:
        raise ValueError(f"weight shape {tuple(weight.shape)} does not match {x_name} inner dim {x.shape[-1]}")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias shape {tuple(bias.shape)} != [{weight.shape[0]}]")


def all_gather_matmul(x_shard: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
                      group: ProcessGroup, overlap: bool = True) -> torch.Tensor:
    """``all_gather_seq(x_shard) @ weight^T + bias``: [s/t, b, k] x [n_local, k] -> [s, b, n_local]."""
    _check(x_shard, weight, bias, "x_shard")
    return _AllGatherMatmul.apply(x_shard, weight, bias, group)


def matmul_reduce_scatter(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
                          group: ProcessGroup, overlap: bool = True) -> torch.Tensor:
    """``reduce_scatter_seq(x @ weight^T) + bias``: [s, b, k_local] x [n, k_local] -> [s/t, b, n]."""
    _check(x, weight, bias, "x")
    t = group_size(group)
    if x.shape[0] % t:
        raise ValueError(f"sequence length {x.shape[0]} is not divisible by the group size {t}")
    return _MatmulReduceScatter.apply(x, weight, bias, group)
