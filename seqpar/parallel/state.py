"""Process-group queries and the collectives along the sequence dimension (dim 0).

``group=None`` (or torch.distributed not initialised) means "no parallelism": size 1, rank 0.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

ProcessGroup = Optional["dist.ProcessGroup"]

# torch 2.13 renamed the tensor collectives (the old names warn); older releases only have the old ones.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def group_size(group: ProcessGroup) -> int:
    """Number of ranks in ``group`` (1 for ``None``)."""
    if group is None or not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def group_rank(group: ProcessGroup) -> int:
    """This process's rank inside ``group`` (0 for ``None``)."""
    if group is None or not dist.is_available() or not dist.is_initialized():
        return 0
    return dist.get_rank(group)


def sequence_shard(full: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """This rank's contiguous sequence shard of ``full`` [s, ...] -> [s/t, ...] (a view)."""
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
    out = torch.empty((x_full.shape[0] // t,) + tuple(x_full.shape[1:]),
                      dtype=x_full.dtype, device=x_full.device)
    work = _reduce_scatter_single(out, x_full, group=group, async_op=async_op)
    return (out, work) if async_op else out


def all_reduce(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """In-place sum over the group (no-op for one rank); returns ``x``."""
    if group_size(group) > 1:
        dist.all_reduce(x, group=group)
    return x
