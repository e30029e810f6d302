"""Tensor-parallel linear layers with optional sequence parallelism (Megatron's column/row split).

=======================  ====================  =====================  =================================
layer                    input                 weight (this rank)     output
=======================  ====================  =====================  =================================
ColumnParallelLinear     [s, b, k] (SP:        [n / t, k]             [s, b, n / t]
                         [s/t, b, k] shard)
RowParallelLinear        [s, b, k / t]         [n, k / t]             [s, b, n] (SP: [s/t, b, n] shard)
=======================  ====================  =====================  =================================

Without SP the column-parallel input passes f (identity forward, all-reduce backward) and the
row-parallel output passes f-bar (all-reduce forward). With SP they become g / g-bar, fused into the
GEMM by :func:`seqpar.ops.all_gather_matmul` (saves only the input shard, re-gathers in backward) and
:func:`seqpar.ops.matmul_reduce_scatter`. ``RowParallelLinear(skip_bias_add=True)`` returns
``(output, bias)`` so the bias can be fused into the following bias-dropout-add; under SP that bias is
replicated but sees only a sequence shard, so it passes f and its gradient is summed over the group.
With ``tp_group=None`` (or a one-rank group, t = 1) both layers are plain ``nn.Linear`` math and
``sequence_parallel`` changes nothing (g and g-bar are the identity on one rank). Under an enabled
``torch.autocast`` both run as if converted to its dtype (:mod:`seqpar.nn.autocast`), like ``nn.Linear``.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Dict, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from .. import random as sp_random
from ..ops import registry
from ..ops.comm_matmul import (SHARD_HINT, _all_gather_matmul, _matmul_reduce_scatter, agreed_gradients,
                               agreed_shape_and_dtype, all_gather_plan, copy_matmul, matmul_all_reduce,
                               reduce_scatter_plan)
from ..parallel.mappings import copy_to_tensor_region
from ..parallel.overlap import ChunkPlan
from ..parallel.state import ProcessGroup, SharesProcessGroup, agree_on_inputs, group_size
from .autocast import autocast_dtype, in_run_dtype, run_in_dtype
from .state_dict import ShardedParameters, ShardLayout, full_parameters, require_own_parameters


def block_sizes(out_features: int, partition_blocks: Union[int, Sequence[int]]) -> Tuple[int, ...]:
    """``partition_blocks`` as a tuple of block sizes summing to ``out_features``: an int n means n
    equal blocks; a sequence gives each block's rows. ValueError naming a bad value."""
    if isinstance(partition_blocks, int) and not isinstance(partition_blocks, bool):
        if partition_blocks <= 0 or out_features % partition_blocks:
            raise ValueError(f"partition_blocks {partition_blocks} must be a positive int dividing out_features "
                             f"{out_features}")
        return (out_features // partition_blocks,) * partition_blocks
    sizes = tuple(partition_blocks) if isinstance(partition_blocks, (list, tuple)) else None
    if (not sizes or any(not isinstance(n, int) or isinstance(n, bool) or n <= 0 for n in sizes)
            or sum(sizes) != out_features):
        raise ValueError(f"partition_blocks must be an int or a sequence of positive block sizes summing to "
                         f"out_features {out_features}, got {partition_blocks!r}")
    return sizes


def _check_arguments(in_features, out_features, dtype, **flags) -> None:
    """The parallel linears' constructor checks: ValueError naming a size that is not a positive int, a
    flag that is not a bool or a dtype that is not floating."""
    registry.check_sizes(in_features=in_features, out_features=out_features)
    registry.check_flags(**flags)
    registry.check_param_dtype(dtype)


def init_normal(weight: torch.Tensor) -> None:
    """The default ``init_method``: N(0, 0.02) in place (Megatron's init_method_normal(0.02)), drawn from
    torch's default CPU generator."""
    weight.normal_(0.0, 0.02)


@dataclasses.dataclass(frozen=True)
class SeededNormal:
    """The ``init_method`` of the models' own tensors: N(0, ``std``) drawn from a generator of its own,
    seeded by :func:`seqpar.manual_seed`'s seed and ``(owner, part)`` when called (``owner``: a layer
    number, -1 for GPTModel's embeddings; ``part``: which tensor of it). Every call draws the same values,
    whatever t and whatever torch's generator holds, so a module re-initialised on its own (FSDP1's
    deferred init calls each module's ``reset_parameters``) gets what the whole model's init gives it."""
    owner: int
    part: int
    std: float = 0.02

    def __call__(self, full: torch.Tensor) -> None:
        seed = sp_random.stream_seed(sp_random.initial_seed(), self.owner, 1000 + self.part) & (2**63 - 1)
        # On the CPU whatever the default device: the generator is a CPU one, and the values must not
        # depend on where the model lives.
        full.copy_(torch.randn(full.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float32,
                               device="cpu") * self.std)


#: Why a split linear's forward refuses a reparametrized weight under tensor parallelism.
REPARAMETRIZED_SHARD = (
    ". Under tensor parallelism a parametrization sees only this rank's shard of the weight: PEFT's "
    "target_parameters LoRA trains one adapter per rank (another model than at t = 1), a norm or a pruning "
    "mask is taken per shard, and clip_grad_norm_ / sharded_state_dict can't place the shard. For LoRA at "
    "t > 1 add the adapter with forward hooks and seqpar's own parallel linears (README, Recompute)")


class _TensorParallelLinear(ShardedParameters, SharesProcessGroup, nn.Module):
    """What both splits share: initialisation, loading and gathering of the unsharded weights (by
    ``shard_layouts``) and the repr."""

    in_features: int
    out_features: int
    #: Agree on the input over ``tp_group`` at every call (:meth:`_check_input`); False where the inputs are
    #: known to agree (TransformerLayer sets it on its own linears: its input check covers theirs).
    check_rank_inputs: bool = True

    def forward(self, x: torch.Tensor):
        """x -> the split's output (module table; ``RowParallelLinear(skip_bias_add=True)``: ``(y, bias)``).
        Under an enabled autocast as if converted to its dtype (:mod:`seqpar.nn.autocast`): with sequence
        parallelism the comm GEMMs' backward has no autocast of its own."""
        dtype = autocast_dtype(self)
        if dtype is not None:
            return run_in_dtype(self, dtype, self._forward, x)
        return self._forward(x)

    def _forward(self, x: torch.Tensor):
        raise NotImplementedError

    def _check_input(self, x: torch.Tensor, weight: torch.Tensor, width: int,
                     plan: Callable[[], Optional[ChunkPlan]]) -> Optional[ChunkPlan]:
        """ValueError naming the layer for an x that is not a floating [..., width] tensor of ``weight``'s
        dtype and device ([s, ..., width] under SP: at least 2-D; the forward reads ``self.weight`` once
        and passes it here: a parametrized weight, weight_norm or spectral_norm, is computed at every
        read), before any collective: torch's matmul error otherwise, or under SP a message blaming the
        weight. Returns ``plan()``: the SP GEMM's overlap plan (None without SP). With
        ``check_rank_inputs``, on every rank when any rank rejects its x, or the ranks' x differ in leading
        dims or dtype, or in which of x and the weight need a gradient (a hang in backward), or their plans
        differ (uneven sequence shards: gloo aborts the process in the first collective, NCCL hangs or reads
        past the shard):
        one all-gather of a few int64 per call and, on NCCL, a host sync
        (:func:`seqpar.parallel.state.agree_on_inputs`)."""
        name = type(self).__name__

        def check() -> Optional[ChunkPlan]:
            if group_size(self.tp_group) > 1 and self._reparametrized():
                require_own_parameters(self, ["weight"], name, instead=REPARAMETRIZED_SHARD)
            min_dim = 2 if self.sequence_parallel else 1
            if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() < min_dim or \
                    x.shape[-1] != width:
                got = f"{x.dtype} {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
                sp = " (sequence parallel: [s, b, ...])" if self.sequence_parallel else ""
                raise ValueError(f"{name}: x must be a floating [..., {width}] tensor{sp}, got {got}")
            if x.dtype != weight.dtype:
                raise ValueError(f"{name}: x dtype {x.dtype} != weight dtype {weight.dtype} "
                                 "(convert the layer, or run it under torch.autocast)")
            if x.device != weight.device:
                raise ValueError(f"{name}: x is on {x.device} but the weight on {weight.device}")
            registry.check_dense(x=x)
            return plan()

        if not self.check_rank_inputs:
            return check()
        hint = SHARD_HINT if self.sequence_parallel else "Every rank passes the same input in the same dtype"
        return agree_on_inputs(self.tp_group, check, lambda chosen: {
            **agreed_shape_and_dtype(x, "x.shape[:-1]", "x dtype", slice(0, -1)),
            **agreed_gradients(x=x, weight=weight), "overlap plan": chosen},
            what=f"{name} input", hint=hint, device=getattr(x, "device", None))

    def _reparametrized(self) -> bool:
        """Whether the weight is computed from a shard this module holds under another name: a
        ``torch.nn.utils.parametrize`` parametrization (weight_norm, PEFT's target_parameters LoRA),
        ``prune`` (``weight_orig``) or the old ``weight_norm`` (``weight_g`` / ``weight_v``). Not FSDP1's
        flat parameter (use_orig_params=False), which lends the module plain views from outside it."""
        own = self._parameters
        return "weight" not in own and (torch.nn.utils.parametrize.is_parametrized(self, "weight")
                                        or any(key.startswith("weight_") for key in own))

    def _init_weights(self, init_method: Optional[Callable[[torch.Tensor], None]]) -> None:
        self.init_method = init_method
        if init_method is not None and self.weight.device.type != "meta":  # meta: to_empty, then reset
            self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """``init_method`` on the unsharded weight [n, k] (fp32, on the CPU whatever the default device: ranks
        whose CPU generators agree draw the same matrix whatever t is), then this rank's shard of it and a
        zero bias. Nothing with ``init_method=None`` (the caller loads the weights)."""
        if self.init_method is None:
            return
        full = torch.empty(self.out_features, self.in_features, dtype=torch.float32, device="cpu")
        self.init_method(full)
        bias = None if self.bias is None else torch.zeros(self.out_features, dtype=torch.float32, device="cpu")
        self.load_full(full.to(self.weight.dtype), None if bias is None else bias.to(self.bias.dtype))

    def load_full(self, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> None:
        """Keep this rank's shard of the unsharded ``weight`` [n, k] and ``bias`` [n] (see
        :meth:`shard_layouts`; a replicated bias is copied whole)."""
        self._load_full_parameters({"weight": weight, "bias": bias})

    def full(self) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The unsharded (weight [n, k], bias [n] or None), new tensors (a collective under TP)."""
        require_own_parameters(self, [name for name in ("weight", "bias") if getattr(self, name) is not None],
                               f"{type(self).__name__}.full")
        full = full_parameters(self)
        return full["weight"], full.get("bias")

    def extra_repr(self) -> str:
        t = group_size(self.tp_group)
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"tp={t}, sequence_parallel={self.sequence_parallel}")


class ColumnParallelLinear(_TensorParallelLinear):
    """``y = x W^T + b`` with W's output rows split over the TP group (see module table).

    ``partition_blocks`` treats the output rows as stacked blocks, each split over the t ranks
    separately, so each rank's output is [its rows of block 0, its rows of block 1, ...]: an int n
    means n equal blocks (a fused QKV weight [3h, h] with ``partition_blocks=3``: each rank takes its
    heads' rows of the Q, K and V blocks), a sequence gives the block sizes (grouped-query QKV:
    ``(a d, g d, g d)``; SwiGLU's gate and up: ``(f, f)``). Every block must split evenly over t.

    Arguments (both splits):

    - ``tp_group``: the tensor-parallel process group the weight is split over, t = its size (None: one
      rank, plain ``nn.Linear`` math).
    - ``sequence_parallel``: the input (Row: the output) is this rank's sequence shard [s/t, b, .]: the
      all-gather (Row: reduce-scatter) is fused into the GEMM instead of f (Row: f-bar). See module doc.
    - ``bias``: hold a bias, this rank's [n / t] rows of it (Row: the whole [n], replicated), zeros.
    - ``overlap_comm``: under SP, the comm GEMM's ``overlap``: True splits it by rank and overlaps the
      point-to-point transfers with the GEMM chunks where :meth:`seqpar.parallel.overlap.ChunkPlan.choose`
      says it pays (large GEMMs, not while a graph is captured), False runs one bulk collective and one
      GEMM. No effect without SP.
    - ``device``, ``dtype``: of the weight and bias (as ``nn.Linear``'s; ``dtype`` floating).

    ``init_method`` (both splits): called on the unsharded fp32 weight [n, k] on the CPU at construction
    (:meth:`reset_parameters`; default :func:`init_normal`, N(0, 0.02)); None leaves the weights
    uninitialised for a caller that loads them. On the meta device nothing is drawn: ``to_empty``, then
    ``reset_parameters()``.

    ``forward(x)``: x [s, b, in_features] ([s/t, b, in_features] under SP) of the weight's dtype ->
    [s, b, out_features / t]. ValueError at construction for sizes that are not positive ints, flags
    that are not bools, a non-floating dtype, out_features (or a block) not divisible by t, or bad
    ``partition_blocks``; at the call for an x that is not a floating [..., in_features] tensor
    of the weight's dtype and, with ``check_rank_inputs`` (default True), on every rank when the ranks'
    x differ in leading dims, dtype (uneven sequence shards) or in which of x and the weight need a
    gradient, or one rank rejects its x.
    """

    def __init__(self, in_features: int, out_features: int, *, tp_group: ProcessGroup = None,
                 sequence_parallel: bool = False, bias: bool = True, partition_blocks: Union[int, Sequence[int]] = 1,
                 overlap_comm: bool = True, device=None, dtype=None,
                 init_method: Optional[Callable[[torch.Tensor], None]] = init_normal):
        super().__init__()
        _check_arguments(in_features, out_features, dtype, sequence_parallel=sequence_parallel, bias=bias,
                         overlap_comm=overlap_comm)
        t = group_size(tp_group)
        blocks = block_sizes(out_features, partition_blocks)
        uneven = [size for size in blocks if size % t]
        if uneven:
            raise ValueError(f"out_features {out_features} is not divisible by tensor-parallel size {t}"
                             + (f" in every block: blocks {list(blocks)}" if len(blocks) > 1 else ""))
        self.in_features, self.out_features = in_features, out_features
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel
        self.partition_blocks, self.overlap_comm = blocks, overlap_comm
        self.weight = nn.Parameter(torch.empty(out_features // t, in_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(out_features // t, device=device, dtype=dtype)) if bias else None
        self._init_weights(init_method)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = in_run_dtype(self, self.weight), in_run_dtype(self, self.bias)
        plan = self._check_input(x, weight, self.in_features, lambda: all_gather_plan(
            x, weight, self.tp_group, self.overlap_comm) if self.sequence_parallel else None)
        if self.sequence_parallel:
            return _all_gather_matmul(x, weight, bias, self.tp_group, plan)
        return copy_matmul(x, weight, bias, self.tp_group)

    def shard_layouts(self, rank: int) -> Dict[str, ShardLayout]:
        """Rank ``rank``'s rows of the weight [n, k] (and bias [n]): of each block, its t-th part, stacked
        in block order."""
        t = group_size(self.tp_group)
        pieces, full_start = [], 0
        for i, size in enumerate(self.partition_blocks):
            step = size // t
            pieces.append((sum(self.partition_blocks[:i]) // t, full_start + rank * step, step))
            full_start += size
        layouts = {"weight": ShardLayout((self.out_features, self.in_features), 0, tuple(pieces))}
        if self.bias is not None:
            layouts["bias"] = ShardLayout((self.out_features,), 0, tuple(pieces))
        return layouts


class RowParallelLinear(_TensorParallelLinear):
    """``y = x W^T + b`` with W's input columns split over the TP group (see module table); ``tp_group``,
    ``sequence_parallel``, ``bias``, ``overlap_comm``, ``device``, ``dtype`` and ``init_method`` as in
    :class:`ColumnParallelLinear`. ``skip_bias_add``: leave the bias out of the output and return
    ``(output, bias)`` (bias None without one; under SP through f, :meth:`output_bias`), for the caller
    to fuse into the following bias-dropout-add.

    ``forward(x)``: x [s, b, in_features / t] of the weight's dtype -> [s, b, out_features] ([s/t, b,
    out_features] under SP), or ``(output, bias)`` with ``skip_bias_add=True``. ValueError at
    construction for bad sizes, flags or dtype (as :class:`ColumnParallelLinear`) and in_features not
    divisible by t; at the call for an x that is not a floating
    [..., in_features / t] tensor of the weight's dtype, under SP for s not divisible by t and, with
    ``check_rank_inputs``, on every rank as for :class:`ColumnParallelLinear`.
    """

    def __init__(self, in_features: int, out_features: int, *, tp_group: ProcessGroup = None,
                 sequence_parallel: bool = False, bias: bool = True, skip_bias_add: bool = False,
                 overlap_comm: bool = True, device=None, dtype=None,
                 init_method: Optional[Callable[[torch.Tensor], None]] = init_normal):
        super().__init__()
        _check_arguments(in_features, out_features, dtype, sequence_parallel=sequence_parallel, bias=bias,
                         skip_bias_add=skip_bias_add, overlap_comm=overlap_comm)
        t = group_size(tp_group)
        if in_features % t:
            raise ValueError(f"in_features {in_features} is not divisible by tensor-parallel size {t}")
        self.in_features, self.out_features = in_features, out_features
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel
        self.skip_bias_add, self.overlap_comm = skip_bias_add, overlap_comm
        self.weight = nn.Parameter(torch.empty(out_features, in_features // t, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype)) if bias else None
        self._init_weights(init_method)

    def output_bias(self) -> Optional[torch.Tensor]:
        """The bias as the layer adds it: under SP through f, so its gradient is summed over the group."""
        bias = in_run_dtype(self, self.bias)
        if bias is None or not self.sequence_parallel:
            return bias
        return copy_to_tensor_region(bias, self.tp_group)

    def _forward(self, x: torch.Tensor):
        t = group_size(self.tp_group)
        weight = in_run_dtype(self, self.weight)

        def plan() -> Optional[ChunkPlan]:
            if not self.sequence_parallel:
                return None
            if x.shape[0] % t:
                raise ValueError(f"{type(self).__name__}: sequence length {x.shape[0]} is not divisible by the "
                                 f"tensor-parallel size {t} (sequence parallelism reduce-scatters it)")
            return reduce_scatter_plan(x, weight, self.tp_group, self.overlap_comm)

        plan = self._check_input(x, weight, self.in_features // t, plan)
        if t == 1 and not self.skip_bias_add:
            # nn.Linear's math: the bias inside the GEMM, one rounding (g-bar / f-bar are the identity at t = 1;
            # on more ranks the bias must follow the reduction, as in Megatron: two roundings in bf16)
            return nn.functional.linear(x, weight, in_run_dtype(self, self.bias))
        if self.sequence_parallel:
            y = _matmul_reduce_scatter(x, weight, None, self.tp_group, plan)
        else:
            y = matmul_all_reduce(x, weight, self.tp_group)
        bias = self.output_bias()
        if self.skip_bias_add:
            return y, bias
        return y if bias is None else y + bias

    def shard_layouts(self, rank: int) -> Dict[str, ShardLayout]:
        """Rank ``rank``'s columns of the weight [n, k]: the t-th part; the bias is replicated."""
        cols = self.in_features // group_size(self.tp_group)
        return {"weight": ShardLayout((self.out_features, self.in_features), 1, ((0, rank * cols, cols),))}
