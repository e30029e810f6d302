"""Gradient clipping and loss scaling that see the whole tensor-parallel model, not one rank's shards.

``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` on a tensor-parallel rank sees only that
rank's shards: each rank computes another norm and clips by another factor, so replicated parameters
(norms, row-parallel biases) silently drift apart across the ranks, and no rank clips by the model's
true norm. :func:`clip_grad_norm_` sums the split parameters' shares over their group and counts each
replicated parameter once (every rank holds the same gradient), so every rank gets the norm of the
unsharded model, the one a single-device run computes, and the same factor.

``torch.amp.GradScaler`` looks for inf / nan in a rank's own gradients: an overflow in one rank's shard
makes that rank skip the step and lower its scale while the others step, and the ranks' weights and
scales part for good. :class:`TensorParallelGradScaler` makes every rank see any rank's overflow.
"""
from __future__ import annotations

import math
import numbers
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from ..parallel.state import ProcessGroup, SharesProcessGroup, group_size, nccl_device
from .state_dict import local_rows, prepare_parameters


@torch.no_grad()
def clip_grad_norm_(module: nn.Module, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False, foreach: Optional[bool] = None, *,
                    pipeline_group: ProcessGroup = None) -> torch.Tensor:
    """Scale the gradients of ``module``'s parameters in place so that the norm of the unsharded
    gradients is at most ``max_norm``; returns that norm before clipping (an fp32 0-d tensor, fp64 when a
    parameter is fp64, with a gradient or not: the ranks reduce in one dtype; the same on every rank). A
    drop-in for ``torch.nn.utils.clip_grad_norm_(module.parameters(), ...)`` under tensor parallelism (see
    the module docstring); at t = 1 it computes what torch's does, bit for bit with fp32 gradients (bf16 /
    fp16 ones: their norms in fp32, where torch's round to the gradients' dtype).

    The ``norm_type``-norm (a positive float, or ``inf`` / ``"inf"``) of every gradient together, in
    fp32 (fp64 with fp64 gradients): split parameters' shares summed (max for inf) over their
    tensor-parallel group (one all-reduce per group; call it on every rank), replicated parameters once;
    the factor ``max_norm / (norm + 1e-6)``, at most 1, is applied without a host sync. Parameters
    without a gradient add nothing (the ranks may differ in which ones have one). With
    data parallelism call it after the data-parallel gradient reduction (DDP's or FSDP2's backward), as
    torch's. Under FSDP2 (``fully_shard``, HSDP too) each gradient's share is also summed over its
    FSDP2 shard group, so the norm is still the unsharded model's. A NaN gradient makes the norm NaN on
    every rank, the inf-norm included, and an inf gradient inf (a replicated parameter's too, where one
    rank's copy alone holds it). ValueError unless ``module`` is an ``nn.Module`` (not its parameters)
    and ``max_norm`` a positive number (a Python, numpy or 0-d tensor scalar, as torch's); with
    ``error_if_nonfinite`` a RuntimeError when the norm is nan or inf (as torch's). ``foreach`` is
    accepted for torch's signature and ignored: the norms and the scaling always use the foreach kernels.

    ``pipeline_group``: with pipeline parallelism, the group of the ranks that hold this rank's
    tensor-parallel position on every stage (one rank per stage); ``module`` is this stage's part. The
    stages' totals are summed (max for inf) over it, so every stage clips by the whole model's norm (each
    stage alone clipped by its own). A parameter held on two stages (a word embedding tied to the head
    on the last one) counts on both: keep it on one stage's ``module`` (e.g. give the last stage a
    wrapper without it), as Megatron counts a shared embedding on the first stage only.
    """
    if not isinstance(module, nn.Module):
        raise ValueError(f"clip_grad_norm_ takes the module (it needs to know which parameters are split), "
                         f"got {type(module).__name__}: pass the model, not model.parameters()")
    if isinstance(norm_type, str) and norm_type.lower() == "inf":   # torch's clip accepts the string too
        norm_type = math.inf
    given = max_norm, norm_type
    max_norm, norm_type = _real(max_norm), _real(norm_type)
    if max_norm is None or not max_norm > 0:
        raise ValueError(f"max_norm must be a positive number, got {given[0]!r}")
    if norm_type is None or not norm_type > 0:
        raise ValueError(f"norm_type must be a positive number or inf, got {given[1]!r}")
    # A gradient's share of the norm is summed (max for inf) over the ranks that hold other parts of it:
    # its tensor-parallel group if split, its FSDP2 shard group if a DTensor. One share per pair of them.
    # A parameter without a gradient adds nothing, but its groups are reduced all the same: the ranks run
    # the same collectives whichever gradients each one holds (one that skipped them left the others'
    # all-reduce waiting, or matched with its next collective).
    shares: Dict[Tuple[object, object], List[torch.Tensor]] = {}
    grads: List[torch.Tensor] = []
    device, wide = None, False
    for name, param, split in prepare_parameters(module, "clip_grad_norm_").entries:
        tp_group = split.group if split.layout is not None and group_size(split.group) > 1 else None
        local, chunks = local_rows(param if param.grad is None else param.grad, name)
        device, wide = device or local.device, wide or local.dtype == torch.float64
        share = shares.setdefault((tp_group, chunks.group), [])
        if param.grad is not None:
            share.append(local)
            grads.append(local)
    pipelined = pipeline_group is not None and group_size(pipeline_group) > 1
    if list(shares) in ([], [(None, None)]) and not grads and not pipelined:
        return torch.zeros(())
    if device is None:   # a stage without parameters still joins the pipeline group's reduction
        device = _group_device(pipeline_group)
    # fp32 sums (bf16 / fp16 gradients' norms would round), fp64 where a gradient (or a parameter without
    # one: the reductions' dtype must not depend on which gradients a rank holds) is fp64
    acc = torch.float64 if wide else torch.float32

    def tensor_norms(tensors: List[torch.Tensor]) -> torch.Tensor:
        """Each one's norm in ``acc`` (fp64 gradients' in fp64: _foreach_norm can't narrow them), a 1-D
        tensor (empty for none: an empty FSDP2 chunk adds nothing; torch has no inf norm of an empty
        tensor)."""
        tensors = [g for g in tensors if g.numel()]
        if not tensors:
            return torch.zeros((0,), device=device, dtype=acc)
        by_dtype: Dict[torch.dtype, List[torch.Tensor]] = {}
        for g in tensors:
            by_dtype.setdefault(torch.float64 if g.dtype == torch.float64 else torch.float32, []).append(g)
        return torch.stack([n.to(device, acc) for dtype, part in by_dtype.items()
                            for n in torch._foreach_norm(part, norm_type, dtype=dtype)])

    if list(shares) == [(None, None)] and not pipelined:
        # Nothing split or sharded (t = 1, no FSDP2): torch's own reduction of the norms, the same bits
        norm = torch.linalg.vector_norm(tensor_norms(grads), norm_type)
    else:
        total = torch.zeros((), device=device, dtype=acc)
        # The shares not split over the tensor-parallel group first (replicated parameters, reduced over
        # their FSDP2 group if any): every tensor-parallel rank holds those gradients alike, so they are not
        # summed over it; but one rank's NaN / inf there (a kernel fault, a replicated parameter the user
        # did not route through copy_to_tensor_region) gave only some ranks a non-finite norm
        # (error_if_nonfinite raised there alone, leaving the others in their next collective). Their
        # non-finite values (0 where finite: a finite share that overflows stays inf, not inf - inf) ride
        # along in the first share reduced over a tensor-parallel group: no extra collective.
        replicated_nonfinite = None
        for groups, tensors in sorted(shares.items(), key=lambda item: item[0][0] is not None):
            norms = tensor_norms(tensors)
            # the share: sum of |g|^p, or max |g| for inf (0 for none)
            part = (norms.max() if norms.numel() else total.new_zeros(())) if math.isinf(norm_type) \
                else norms.pow(norm_type).sum()
            if groups[0] is not None and replicated_nonfinite is not None:
                part, replicated_nonfinite = part + replicated_nonfinite, None
            for group in groups:
                if group is not None:
                    part = _all_reduce_max(part, group) if math.isinf(norm_type) else _all_reduce_sum(part, group)
            if groups[0] is None:
                nonfinite = torch.where(torch.isfinite(part), 0.0, part)
                replicated_nonfinite = nonfinite if replicated_nonfinite is None else replicated_nonfinite + nonfinite
            total = torch.maximum(total, part) if math.isinf(norm_type) else total + part
        if pipelined:   # in fp64 on every stage: a stage's own dtype (fp64 parameters, or none) may differ
            wide_total = total.to(torch.float64)
            wide_total = _all_reduce_max(wide_total, pipeline_group) if math.isinf(norm_type) \
                else _all_reduce_sum(wide_total, pipeline_group)
            total = wide_total.to(acc)
        norm = total if math.isinf(norm_type) else total.pow(1.0 / norm_type)
    if error_if_nonfinite and not torch.isfinite(norm):
        raise RuntimeError(f"the total norm of order {norm_type} of the gradients is {norm.item()}: "
                           "non-finite, so they can't be clipped (error_if_nonfinite=False clips anyway)")
    factor = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    by_kind: Dict[Tuple[torch.device, torch.dtype], List[torch.Tensor]] = {}
    for grad in grads:
        by_kind.setdefault((grad.device, grad.dtype), []).append(grad)
    for (grad_device, dtype), group_grads in by_kind.items():
        torch._foreach_mul_(group_grads, factor.to(grad_device, dtype))
    return norm


def _group_device(group) -> torch.device:
    """The device a collective over ``group`` takes tensors on: this rank's CUDA device when the group runs
    NCCL ("nccl", or "cpu:gloo,cuda:nccl" and the like: the other stages reduce CUDA tensors), else CPU."""
    if "nccl" not in str(dist.get_backend(group)) or not torch.cuda.is_available():
        return torch.device("cpu")
    return nccl_device(group)


def _real(value) -> Optional[float]:
    """A Python, numpy or 0-d tensor real number as a float (None for anything else, bools included)."""
    if isinstance(value, torch.Tensor):
        real = value.dim() == 0 and value.dtype != torch.bool and not value.is_complex()
        return float(value) if real else None
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    return None


def _all_reduce_sum(part: torch.Tensor, group) -> torch.Tensor:
    dist.all_reduce(part, op=dist.ReduceOp.SUM, group=group)
    return part


def _all_reduce_max(part: torch.Tensor, group) -> torch.Tensor:
    """The max over ``group``, NaN if any rank's is NaN: a MAX all-reduce drops NaN (gloo's does, NCCL's
    fmax too), which made one rank's NaN gradient vanish from the inf-norm. A NaN flag rides along."""
    flagged = torch.stack([torch.where(part.isnan(), 0.0, part), part.isnan().to(part.dtype)])
    dist.all_reduce(flagged, op=dist.ReduceOp.MAX, group=group)
    return torch.where(flagged[1] > 0, math.nan, flagged[0])


class TensorParallelGradScaler(SharesProcessGroup, torch.amp.GradScaler):
    """``torch.amp.GradScaler`` (fp16 loss scaling) for a tensor-parallel model: the inf / nan check of
    every :meth:`unscale_` (explicit, or inside :meth:`step`) is OR-ed over ``tp_group`` (one max all-reduce
    of a scalar; every rank calls it), so every rank skips the same steps and keeps the same scale.
    ``device`` and the keyword arguments are GradScaler's (``init_scale``, ``growth_factor``,
    ``backoff_factor``, ``growth_interval``, ``enabled``). Use it as GradScaler, with
    :func:`clip_grad_norm_` between :meth:`unscale_` and :meth:`step`. With data parallelism too, DDP's
    all-reduce of the gradients has already made the replicas' checks agree; under FSDP2 each rank holds
    a chunk of the reduced gradients, and DTensor's own check reduces the flag over the FSDP2 group.
    ``copy.deepcopy`` shares ``tp_group`` (as the modules' copies do); pickling it fails on the group: save
    :meth:`state_dict` instead.
    """

    def __init__(self, device: str = "cuda", *, tp_group: ProcessGroup, **kwargs):
        super().__init__(device, **kwargs)
        group_size(tp_group)   # ValueError now if this rank is not in the group
        self.tp_group = tp_group

    def _agree(self, found_inf_per_device: Dict[torch.device, torch.Tensor]) -> None:
        """Any rank's overflow in every rank's per-device flags (in place), as 1.0 (or 0.0): torch's fused
        optimizers skip their step only for a flag of exactly 1.0 (a sum over the ranks, 2.0 when both
        overflowed, stepped them into NaN weights)."""
        if group_size(self.tp_group) == 1:
            return
        found = torch.zeros((), dtype=torch.float32, device=self._scale.device)
        for flag in found_inf_per_device.values():
            found = torch.maximum(found, (flag.to(found.device) != 0).to(found.dtype))
        dist.all_reduce(found, op=dist.ReduceOp.MAX, group=self.tp_group)
        for flag in found_inf_per_device.values():
            flag.copy_(found)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """GradScaler's (divides ``optimizer``'s gradients by the scale, in place, and checks them for inf /
        nan), then the overflow check agreed over ``tp_group``: any rank's overflow flags every rank's."""
        super().unscale_(optimizer)
        if self._enabled:
            self._agree(self._per_optimizer_states[id(optimizer)]["found_inf_per_device"])

    def _check_inf_per_device(self, optimizer: torch.optim.Optimizer):
        # The check of optimizers that unscale inside their own step (fused=True), agreed likewise.
        found_inf_per_device = super()._check_inf_per_device(optimizer)
        self._agree(found_inf_per_device)
        return found_inf_per_device


__all__ = ["clip_grad_norm_", "TensorParallelGradScaler"]
