"""LayerNorm and RMSNorm whose parameters know the tensor-parallel group.

Under sequence parallelism each rank normalises only its sequence shard, so the replicated weight (and
bias) see a shard of the tokens: they enter the computation through f (identity forward, all-reduce
backward; weight and bias in one all-reduce) and after backward every rank holds the full, identical
gradient, with no separate "finalize grads" step. With ``tp_group=None`` (or a one-rank group, t = 1)
``sequence_parallel`` changes nothing: the shard is the whole sequence and f is the identity.

Both norms have the same two entry points, so the transformer layer is written once for either:
``norm(x)`` and ``norm(x, bias, residual, spec) -> (norm(residual_out), residual_out)`` with
``residual_out = residual + dropout(x + bias)`` (fused; :meth:`after_bias_dropout_add`). Both go
through the module's ``__call__``, so hooks on a norm fire whichever way the layer uses it.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import nn

from ..ops.bias_dropout_add_layer_norm import bias_dropout_add_layer_norm
from ..ops.dropout import DropoutSpec, bias_dropout_add
from ..ops import registry
from ..ops.registry import validate_backend
from ..ops.rms_norm import add_rms_norm
from ..parallel.mappings import copy_to_tensor_region_coalesced
from ..parallel.state import ProcessGroup, SharesProcessGroup, group_size


class _ReplicatedNorm(SharesProcessGroup, nn.Module):
    """Shared by LayerNorm and RMSNorm: argument checks, a unit ``weight`` [h] and, if ``bias``, a zero
    ``bias`` [h], replicated over the tensor-parallel group (through f under SP).

    ``forward(x)``: x [..., h] -> [..., h]. As their torch counterparts, a bf16 / fp16 x with fp32
    parameters is normalised with fp32 statistics and returned in x's dtype. ValueError at construction
    for a hidden_size that is not a positive int, an eps :func:`seqpar.ops.registry.check_eps` refuses
    (non-finite or below fp32's smallest normal number), a flag that is not a bool, a non-floating dtype
    or a tp_group without this rank; at the call for an x whose last dim is not h."""

    def __init__(self, hidden_size: int, eps: float, *, bias: bool, tp_group: ProcessGroup,
                 sequence_parallel: bool, backend: str, device, dtype):
        super().__init__()
        registry.check_sizes(hidden_size=hidden_size)
        registry.check_eps(eps)
        registry.check_flags(bias=bias, sequence_parallel=sequence_parallel)
        registry.check_param_dtype(dtype)
        group_size(tp_group)  # ValueError now, not at the first backward, if this rank is not in tp_group
        self.hidden_size, self.eps = hidden_size, float(eps)
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel
        self.backend = validate_backend(backend)
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(hidden_size, device=device, dtype=dtype)) if bias else None

    @property
    def normalized_shape(self) -> Tuple[int]:
        """``(hidden_size,)``, as ``torch.nn.LayerNorm`` / ``RMSNorm`` name it (they take a shape; these
        modules normalise the last dimension only)."""
        return (self.hidden_size,)

    @property
    def elementwise_affine(self) -> bool:
        """Always True: the modules own a ``weight`` (torch's attribute, for code that reads it)."""
        return True

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Unit weight, zero bias (the deferred-init recipe: meta device, ``to_empty``, then this)."""
        self.weight.fill_(1.0)
        if self.bias is not None:
            self.bias.zero_()

    def forward(self, x: torch.Tensor, bias: Optional[torch.Tensor] = None, residual: Optional[torch.Tensor] = None,
                spec: Optional[DropoutSpec] = None):
        """``norm(x)`` [..., h] -> [..., h]; with ``residual`` (and optionally ``bias`` [h] and a dropout
        ``spec``) the fused :meth:`after_bias_dropout_add` -> ``(norm(residual_out), residual_out)``."""
        if residual is None:
            if bias is not None or spec is not None:
                raise ValueError("bias and spec are the fused bias-dropout-add's: pass residual with them")
            return self._norm(x)
        return self.after_bias_dropout_add(x, bias, residual, DropoutSpec() if spec is None else spec)

    def _check_hidden(self, x: torch.Tensor) -> None:
        if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.shape[-1] != self.hidden_size:
            got = f"shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"x must be a [..., hidden_size={self.hidden_size}] tensor, got {got}")

    def _replicated(self) -> Tuple[torch.Tensor, ...]:
        """The parameters as the computation uses them (through f under SP, one all-reduce for all)."""
        params = (self.weight,) if self.bias is None else (self.weight, self.bias)
        if not self.sequence_parallel:
            return params
        return copy_to_tensor_region_coalesced(params, self.tp_group)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}, backend={self.backend!r}, sequence_parallel={self.sequence_parallel}"


class LayerNorm(_ReplicatedNorm):
    """``LayerNorm(x) * weight + bias`` over the last dim h, standalone or fused after bias-dropout-add
    (:func:`seqpar.ops.bias_dropout_add_layer_norm`); ``weight`` [h] (ones), ``bias`` [h] (zeros).

    ``forward(x)``: x [..., h] -> [..., h]; a bf16 / fp16 x with fp32 parameters is normalised with fp32
    statistics and returned in x's dtype, as ``torch.nn.LayerNorm`` does. Under ``sequence_parallel`` x
    is this rank's sequence shard and the parameters' gradients are summed over ``tp_group``. ValueError
    at construction for a hidden_size that is not a positive int, an eps that is not finite or below fp32's
    smallest normal number (:func:`seqpar.ops.registry.check_eps`), a non-floating dtype or a tp_group
    without this rank; at the call for an x whose last dim is not h.

    ``backend`` selects the kernels of the fused :meth:`after_bias_dropout_add`; the standalone
    ``forward(x)`` is ``torch.nn.functional.layer_norm`` (already one kernel) on every backend.
    ``device``, ``dtype``: of the parameters (as ``torch.nn.LayerNorm``'s; default fp32).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-5, *, tp_group: ProcessGroup = None,
                 sequence_parallel: bool = False, backend: str = "auto", device=None, dtype=None):
        super().__init__(hidden_size, eps, bias=True, tp_group=tp_group, sequence_parallel=sequence_parallel,
                         backend=backend, device=device, dtype=dtype)

    def affine(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """(weight, bias) as the computation uses them (through f under SP)."""
        return self._replicated()

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        self._check_hidden(x)
        weight, bias = self.affine()
        return nn.functional.layer_norm(x, (x.shape[-1],), weight, bias, self.eps)

    def after_bias_dropout_add(self, x: torch.Tensor, bias: Optional[torch.Tensor], residual: torch.Tensor,
                               spec: DropoutSpec) -> Tuple[torch.Tensor, torch.Tensor]:
        """``residual_out = residual + dropout(x + bias)`` with the mask of ``spec``
        (:class:`seqpar.ops.DropoutSpec`); returns ``(LayerNorm(residual_out), residual_out)``."""
        self._check_hidden(x)
        weight, ln_bias = self.affine()
        return bias_dropout_add_layer_norm(x, bias, residual, weight, ln_bias, p=spec.p, eps=self.eps,
                                           training=spec.active, seed=spec.seed if spec.active else None,
                                           backend=self.backend, row_offset=spec.row_offset)


class RMSNorm(_ReplicatedNorm):
    """``x * rsqrt(mean(x**2) + eps) * weight`` over the last dim h, rounded like HF's LlamaRMSNorm
    (:func:`seqpar.ops.add_rms_norm`); ``weight`` [h], no bias.

    ``after_bias_dropout_add`` fuses the residual add into the norm (:func:`seqpar.ops.add_rms_norm`
    saves only the sum and the fp32 rstd). With a bias or active dropout the sum is first formed by
    :func:`seqpar.ops.bias_dropout_add` (its mask regenerated, nothing saved), then normalised: the
    same numbers and memory, one more pass over the activations (Llama has neither).

    ``forward(x)``: x [..., h] -> [..., h], h = ``hidden_size``; a bf16 / fp16 x with fp32 parameters is
    normalised with fp32 statistics and returned in x's dtype. Under ``sequence_parallel`` x is this rank's
    sequence shard and the weight's gradient is summed over ``tp_group`` (None: one rank). ``backend``
    ("auto" | "torch" | "triton" | "cuda", :mod:`seqpar.ops.registry`) selects the kernels of both the
    standalone ``forward(x)`` and :meth:`after_bias_dropout_add`. ``device``, ``dtype``: of ``weight``
    (default fp32). ValueError as for :class:`LayerNorm`.

    ``eps`` defaults to 1e-6, HF LlamaRMSNorm's and Liger's, not ``torch.nn.RMSNorm``'s (None: fp32's
    machine epsilon, 1.19e-7): a drop-in for the latter passes ``eps=torch.finfo(torch.float32).eps``.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, *, tp_group: ProcessGroup = None,
                 sequence_parallel: bool = False, backend: str = "auto", device=None, dtype=None):
        super().__init__(hidden_size, eps, bias=False, tp_group=tp_group, sequence_parallel=sequence_parallel,
                         backend=backend, device=device, dtype=dtype)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        self._check_hidden(x)
        (weight,) = self._replicated()
        return add_rms_norm(x, None, weight, eps=self.eps, backend=self.backend)[0]

    def after_bias_dropout_add(self, x: torch.Tensor, bias: Optional[torch.Tensor], residual: torch.Tensor,
                               spec: DropoutSpec) -> Tuple[torch.Tensor, torch.Tensor]:
        """``residual_out = residual + dropout(x + bias)`` with the mask of ``spec``
        (:class:`seqpar.ops.DropoutSpec`); returns ``(RMSNorm(residual_out), residual_out)``."""
        self._check_hidden(x)
        (weight,) = self._replicated()
        if bias is None and not spec.active:
            return add_rms_norm(x, residual, weight, eps=self.eps, backend=self.backend)
        residual_out = bias_dropout_add(x, bias, residual, spec, backend=self.backend)
        return add_rms_norm(residual_out, None, weight, eps=self.eps, backend=self.backend)[0], residual_out
