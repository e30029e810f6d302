"""The attention core: ``o = dropout_p(softmax(q k^T * scale + causal_mask)) v`` per (batch, head).

A drop-in for ``torch.nn.functional.scaled_dot_product_attention`` (SDPA): the same layout, keyword
names and defaults (``is_causal=False``, ``dropout_p=0.0``, ``scale=None``, ``enable_gqa=False``;
``attn_mask`` must be None), plus seqpar's counter-based dropout (``seed``) and ``backend``.

==========  ======================  ==========================================================
tensor      shape                   notes
==========  ======================  ==========================================================
q           [b, Hq, s_q, d]         layout of SDPA
k, v        [b, Hk, s_k, d]         Hk = Hq, or with ``enable_gqa`` any Hk dividing Hq; any
                                    strides (views of a fused QKV are fine)
o           [b, Hq, s_q, d]         dtype of q (fp32 / fp16 / bf16, or fp64 on the torch
                                    backend only, for gradcheck)
==========  ======================  ==========================================================

Grouped-query attention (``enable_gqa=True``, as SDPA): q head ``i`` attends with kv head
``i // (Hq / Hk)``; no backend materialises k or v repeated to Hq heads, and the gradient of a kv head
is the sum over its group of q heads.

``is_causal`` masks key j > query i (top-left aligned, like SDPA). ``scale`` defaults to
``1/sqrt(d)``. The dropout mask element (batch, head, i, j), ``head`` the *q* head, is kept iff
``mask_byte(seed, row_offset + (head * b + batch) * s_q + i, j) >= round(p * 256)`` (:mod:`seqpar.random`;
the effective probability is ``round(p * 256) / 256``): rows are head-major over the q heads so that a
tensor-parallel rank owning q heads ``r*Hq_local ..`` passes ``row_offset = r * Hq_local * b * s_q`` and
draws the same masks as one device, with or without GQA.

Backend interface (:func:`seqpar.ops.registry.register`); k, v may have fewer heads than q::

    forward(q, k, v, causal, scale, spec) -> (o, saved)          # saved: tuple of tensors
    backward(grad_o, q, k, v, saved, causal, scale, spec) -> (grad_q, grad_k, grad_v)

The torch reference saves the softmax output and the dropped probabilities (the paper's 4as^2b
bytes of 2-byte activations; the mask itself is regenerated); fused backends save much less. Every
backend also keeps q, k, v (k, v at their Hk heads):

=======  =================================================  ==============  ===============
backend  what runs                                          saved           recompute_free
=======  =================================================  ==============  ===============
torch    fp32 reference (fp64 for fp64; the test oracle)    probs, dropped  no
triton   flash-style kernels (triton_kernels/attention.py)  o, lse (fp32)   yes
cuda     torch GEMMs + fused mask/softmax/dropout kernels   probs           no
         (csrc/softmax_dropout.cu)
=======  =================================================  ==============  ===============

How each does GQA: torch and cuda fold a kv head's group of q heads into the rows of one GEMM
(q [b, Hq, s_q, d] viewed as [b, Hk, G * s_q, d], G = Hq / Hk), so k and v broadcast over the group
and the dk / dv GEMMs sum over it; the Triton kernels read kv head ``head // G`` in the forward and dq
programs, and a dk / dv program loops over the G q heads of its kv head (no atomics).

"auto" (:func:`select_backend`) runs the first of triton, cuda, torch that is available on q's device and
accepts the inputs (the limits below), except that it passes over triton when q is fp32: the kernels run
fp32 with IEEE FMA dots (a testing mode), far slower than cuBLAS. So fp32 runs cuda or torch, and fp64
(which no kernel takes) torch.
The triton backend supports head dims ``d`` in 16..128 (multiples of 8; 32, 64, 80, 96, 128 are the
common ones) and returns ``o`` (and the gradients) as [b, heads, s, d] views of contiguous
[s, b, heads, d] buffers, so a layer can reshape ``o`` to [s, b, heads * d] without a copy. Both
kernel backends are ``torch.library`` custom ops (``seqpar::attention_core_{triton,cuda}_{fwd,bwd}``)
with fake implementations, so ``torch.compile`` traces through them (eager calls run their launchers
directly: :func:`seqpar.ops.registry.kernel_op`).
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import torch.utils.flop_counter

from . import registry
from .. import _ext
from .dropout import DropoutSpec, dropout_active, make_dropout_spec
from ..memory import name_storage
from ..random import dropout_keep_mask

#: The op's name in :mod:`seqpar.ops.registry`.
OP = "attention_core"


def attention_keep_mask(spec: DropoutSpec, b: int, heads: int, s_q: int, s_k: int, device,
                        kv_heads: Optional[int] = None) -> torch.Tensor:
    """Bool keep-mask [b, heads, s_q, s_k] on ``device`` of the attention dropout ``spec`` (head-major rows
    over the q heads, see module doc). With ``kv_heads``: the same mask in :func:`group_rows`' layout, [b, kv_heads,
    (heads / kv_heads) * s_q, s_k] (row g * s_q + i of kv head h is q head h * G + g's row i)."""
    batch = torch.arange(b, device=device).view(b, 1, 1)
    if kv_heads is None:
        head, query = torch.arange(heads, device=device).view(1, heads, 1), torch.arange(s_q, device=device)
    else:
        group = heads // kv_heads
        grouped_row = torch.arange(group * s_q, device=device)
        head = torch.arange(kv_heads, device=device).view(1, kv_heads, 1) * group + grouped_row // s_q
        query = grouped_row % s_q
    rows = (head * b + batch) * s_q + query + spec.row_offset
    return dropout_keep_mask(spec.seed, rows, s_k, spec.threshold)


def causal_mask(s_q: int, s_k: int, device) -> torch.Tensor:
    """Bool [s_q, s_k] on ``device``, True where key j > query i (masked out)."""
    return torch.ones(s_q, s_k, dtype=torch.bool, device=device).triu(1)


def group_rows(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[b, Hq, s, n] -> [b, Hk, (Hq / Hk) * s, n], Hk = ``kv_heads``: the q heads of one kv head's group
    stacked along the rows (q head i is in group i // (Hq / Hk)), so one GEMM per kv head covers its group.
    A view when the head and row strides allow it (contiguous [b, Hq, s, n]), else a copy of x (never of k
    or v)."""
    return x.unflatten(1, (kv_heads, -1)).flatten(2, 3)     # not one reshape: see ungroup_rows


def ungroup_rows(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[b, Hk, (Hq / Hk) * s, n] -> [b, Hq, s, n], Hq = ``heads``, the inverse of :func:`group_rows` (a view of a
    contiguous x). Unflatten then flatten, not one reshape: torch.export with a dynamic s can't prove
    the stride guards of one reshape between G * s rows and (G, s) (Min(s, G s^2) == s)."""
    return x.unflatten(2, (heads // x.shape[1], -1)).flatten(1, 2)


# ----------------------------------------------------------------------------- torch reference
# Every [s_q, s_k] tensor (scores, probabilities, masks, their gradients) stays in group_rows' layout
# [b, Hk, G * s_q, s_k], made there: regrouping one (a view between G * s_q rows and (G, s_q) of a matrix
# whose other dim is s_k too) makes stride guards torch.export can't prove for a dynamic s.
def _torch_forward(q, k, v, causal: bool, scale: float, spec: DropoutSpec):
    b, heads, s_q, d = q.shape
    kv_heads, s_k = k.shape[1], k.shape[2]
    acc = registry.acc_dtype(q.dtype)
    scores = torch.matmul(group_rows(q.to(acc), kv_heads), k.to(acc).transpose(-2, -1)) * scale
    if causal:
        scores.masked_fill_(causal_mask(s_q, s_k, q.device).repeat(heads // kv_heads, 1), float("-inf"))
    probs = name_storage(torch.softmax(scores, dim=-1).to(q.dtype), "softmax output")
    dropped = probs
    if spec.active:
        keep = attention_keep_mask(spec, b, heads, s_q, s_k, q.device, kv_heads)
        dropped = name_storage((probs.to(acc) * keep * spec.scale).to(q.dtype), "dropout output")
    o = torch.matmul(dropped.to(acc), v.to(acc))
    return registry.cast(ungroup_rows(o, heads), q.dtype), (probs, dropped)


def _torch_backward(grad_o, q, k, v, saved, causal: bool, scale: float, spec: DropoutSpec):
    b, heads, s_q, d = q.shape
    kv_heads, s_k = k.shape[1], k.shape[2]
    acc = registry.acc_dtype(q.dtype)
    probs, dropped = (t.to(acc) for t in saved)                 # [b, Hk, G * s_q, s_k]
    # group_rows / ungroup_rows as one reshape each: vmap over this backward (batched gradients:
    # jacobian(vectorize=True), autograd.grad(is_grads_batched=True)) has no batching rule for their
    # unflatten, and the export concern behind it is a forward one (a backward is never exported).
    grad_o = grad_o.to(acc).reshape(b, kv_heads, -1, d)
    grad_v = torch.matmul(dropped.transpose(-2, -1), grad_o)    # sums over the group
    grad_dropped = torch.matmul(grad_o, v.to(acc).transpose(-2, -1))
    if spec.active:
        grad_probs = grad_dropped * attention_keep_mask(spec, b, heads, s_q, s_k, q.device, kv_heads) * spec.scale
    else:
        grad_probs = grad_dropped
    grad_scores = probs * (grad_probs - (grad_probs * probs).sum(dim=-1, keepdim=True))
    grad_q = (torch.matmul(grad_scores, k.to(acc)) * scale).reshape(b, heads, s_q, d)
    grad_k = torch.matmul(grad_scores.transpose(-2, -1), q.to(acc).reshape(b, kv_heads, -1, d)) * scale
    return grad_q, grad_k, grad_v


registry.register(registry.Backend(OP, "torch", _torch_forward, _torch_backward))


# ----------------------------------------------------------------------------- triton backend
# Custom ops: torch.compile sees one opaque call with a fake (shape-only) implementation; the Triton
# module is imported on first use only (never at seqpar import time).
def _seq_major_empty(b: int, heads: int, s: int, d: int, like: torch.Tensor) -> torch.Tensor:
    return like.new_empty((s, b, heads, d)).permute(1, 2, 0, 3)


@registry.kernel_op("seqpar::attention_core_triton_fwd")
def _triton_fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                   drop_threshold: int, seed: int, row_offset: int) -> Tuple[torch.Tensor, torch.Tensor]:
    from ..triton_kernels.attention import attention_fwd

    with _ext.on_device(q):
        return attention_fwd(q, k, v, causal, scale, drop_threshold, seed, row_offset)


@_triton_fwd_op.register_fake
def _(q, k, v, causal, scale, drop_threshold, seed, row_offset):
    b, heads, s_q, d = q.shape
    return _seq_major_empty(b, heads, s_q, d, q), q.new_empty((b, heads, s_q), dtype=torch.float32)


@registry.kernel_op("seqpar::attention_core_triton_bwd")
def _triton_bwd_op(grad_o: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                   lse: torch.Tensor, causal: bool, scale: float, drop_threshold: int, seed: int,
                   row_offset: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from ..triton_kernels.attention import attention_bwd

    with _ext.on_device(q):
        return attention_bwd(grad_o, q, k, v, o, lse, causal, scale, drop_threshold, seed, row_offset)


@_triton_bwd_op.register_fake
def _(grad_o, q, k, v, o, lse, causal, scale, drop_threshold, seed, row_offset):
    b, heads, s_q, d = q.shape
    kv_heads, s_k = k.shape[1], k.shape[2]
    return (_seq_major_empty(b, heads, s_q, d, q), _seq_major_empty(b, kv_heads, s_k, d, k),
            _seq_major_empty(b, kv_heads, s_k, d, v))


def _triton_forward(q, k, v, causal: bool, scale: float, spec: DropoutSpec):
    o, lse = _triton_fwd_op(q, k, v, causal, scale, spec.threshold, spec.seed, spec.row_offset)
    return o, (o, lse)


def _triton_backward(grad_o, q, k, v, saved, causal: bool, scale: float, spec: DropoutSpec):
    o, lse = saved
    return _triton_bwd_op(grad_o, q, k, v, o, lse, causal, scale, spec.threshold, spec.seed, spec.row_offset)


def _triton_check(q=None, k=None, v=None, causal=True, dropout=True, **_) -> Optional[str]:
    if q is None:
        return None
    if q.is_cuda and _ext.cuda_capability(q.device) < (8, 0):
        major, minor = _ext.cuda_capability(q.device)
        return (f"the triton attention kernel needs sm_80 or newer (its tiles need more shared memory than "
                f"older GPUs have a block), got sm_{major}{minor}")
    # Only reached once triton imports (the registry checks that first).
    from ..triton_kernels.attention import unsupported_reason

    return unsupported_reason(q.shape[-1], q.dtype, q.shape[0] * q.shape[1], (q.stride(2), k.stride(2), v.stride(2)),
                              dropout)


def _triton_auto_skip(q=None, **_) -> Optional[str]:
    # fp32 runs the kernels with IEEE dots, i.e. FMA loops without tensor cores, and tiles that spill (a
    # testing mode): the cuda backend's cuBLAS GEMMs or torch are far faster on a GPU.
    if q is not None and q.dtype == torch.float32:
        return "auto skips fp32 in the triton attention kernel (IEEE FMA dots, for testing; pass backend='triton')"
    return None


registry.register(registry.Backend(
    OP, "triton", _triton_forward, _triton_backward, _triton_check, recompute_free=True,
    limits="sm_80 or newer; head dim d a multiple of 8 in [16, 128]; b * Hq <= 65535; sequence strides of q, k, v "
           "< 2**31 / 128; dropout needs triton >= 3.3; auto skips fp32",
    auto_skip=_triton_auto_skip))


# ----------------------------------------------------------------------------- cuda backend
# Megatron's non-flash path: the GEMMs in torch, the s^2-sized middle in one fused kernel each way
# (csrc/softmax_dropout.cu). Saves the softmax output (2 bytes x s_q x s_k per q head); the dropout mask
# and the dropped probabilities are regenerated in backward. The softmax scale c rides in the GEMMs' alpha,
# applied to the fp32 accumulator before the result is rounded: q k^T never exists unscaled in fp16 (where
# |q k^T| > 65504 overflows long before c q k^T does), and the kernels see the scaled scores. The backward
# likewise rounds c dP = c dO v^T (and the kernel, linear in it, c dS), not dP, which is 1 / c times larger
# (sqrt(d) at the default scale) and overflowed fp16 where dq, dk are representable; dq = (c dS) k then.
# Not covered: scaled scores beyond fp16's range (|c q.k| > 65504) round to +-inf, and the softmax kernel
# splits a row's probability among its +inf entries (the torch backend keeps fp32 scores).


def scaled_matmul(a: torch.Tensor, b: torch.Tensor, alpha: float) -> torch.Tensor:
    """``alpha * (a @ b)`` over [B, H, m, k] x [B, H, k, n] -> contiguous [B, H, m, n], with alpha applied
    inside the GEMM (baddbmm with beta = 0: cuBLAS scales the fp32 accumulator before rounding)."""
    B, H, m, _ = a.shape
    n = b.shape[-1]
    out = a.new_empty((B * H, m, n))
    out.baddbmm_(a.reshape(B * H, m, a.shape[-1]), b.reshape(B * H, b.shape[-2], n), beta=0.0, alpha=alpha)
    return out.view(B, H, m, n)


def _cuda_launch_args(probs_shape, dtype: torch.dtype, causal: bool, drop_threshold: int, seed: int,
                      row_offset: int, device: torch.device):
    b, heads, s_q, s_k = probs_shape
    active = drop_threshold > 0
    return (b, heads, s_q, s_k, _ext.DTYPE_CODES[dtype], bool(causal), int(seed) if active else 0,
            int(row_offset) if active else 0, int(drop_threshold), _ext.cuda_stream(device))


@registry.kernel_op("seqpar::attention_core_cuda_fwd")
def _cuda_fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                 drop_threshold: int, seed: int, row_offset: int) -> Tuple[torch.Tensor, torch.Tensor]:
    b, heads, s_q, d = q.shape
    kv_heads, s_k = k.shape[1], k.shape[2]
    # [b, Hk, G * s_q, s_k] = [b, Hq, s_q, s_k] in memory: one GEMM per kv head over its group's q rows.
    scores = scaled_matmul(group_rows(q, kv_heads), k.transpose(-2, -1), scale)
    probs = torch.empty((b, heads, s_q, s_k), dtype=q.dtype, device=q.device)
    # Writes softmax(scores + mask) to probs and, with dropout, its dropped copy over scores.
    with _ext.on_device(q):
        _ext.cuda_extension().attention_softmax_dropout_fwd(
            scores.data_ptr(), probs.data_ptr(),
            *_cuda_launch_args(probs.shape, q.dtype, causal, drop_threshold, seed, row_offset, q.device))
    dropped = scores if drop_threshold > 0 else probs.view(scores.shape)
    return ungroup_rows(torch.matmul(dropped, v), heads), probs


@_cuda_fwd_op.register_fake
def _(q, k, v, causal, scale, drop_threshold, seed, row_offset):
    b, heads, s_q, d = q.shape
    return q.new_empty((b, heads, s_q, d)), q.new_empty((b, heads, s_q, k.shape[2]))


@registry.kernel_op("seqpar::attention_core_cuda_bwd")
def _cuda_bwd_op(grad_o: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, probs: torch.Tensor,
                 causal: bool, scale: float, drop_threshold: int, seed: int,
                 row_offset: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    b, heads, s_q, d = q.shape
    kv_heads = k.shape[1]
    grad_o = group_rows(grad_o.to(q.dtype), kv_heads)
    # c times d loss / d dropped probs, [b, Hk, G * s_q, s_k] (c dP: see the comment above scaled_matmul)
    grad = scaled_matmul(grad_o, v.transpose(-2, -1), scale)
    # probs is the saved forward output (contiguous); .contiguous() guards a direct call of this op.
    probs = probs.contiguous()
    dropped = torch.empty_like(grad) if drop_threshold > 0 else probs.view(grad.shape)
    # In place: grad becomes c d loss / d (c q k^T) = d loss / d (q k^T); dropped is regenerated from probs.
    with _ext.on_device(q):
        _ext.cuda_extension().attention_softmax_dropout_bwd(
            probs.data_ptr(), grad.data_ptr(), dropped.data_ptr() if drop_threshold > 0 else 0,
            *_cuda_launch_args(probs.shape, q.dtype, causal, drop_threshold, seed, row_offset, q.device))
    grad_v = torch.matmul(dropped.transpose(-2, -1), grad_o)                       # sums over the group
    grad_q = ungroup_rows(torch.matmul(grad, k), heads)
    grad_k = torch.matmul(grad.transpose(-2, -1), group_rows(q, kv_heads))          # sums over the group
    return grad_q, grad_k, grad_v


@_cuda_bwd_op.register_fake
def _(grad_o, q, k, v, probs, causal, scale, drop_threshold, seed, row_offset):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _cuda_forward(q, k, v, causal: bool, scale: float, spec: DropoutSpec):
    o, probs = _cuda_fwd_op(q, k, v, causal, scale, spec.threshold, spec.seed, spec.row_offset)
    return o, (probs,)


def _cuda_backward(grad_o, q, k, v, saved, causal: bool, scale: float, spec: DropoutSpec):
    (probs,) = saved
    return _cuda_bwd_op(grad_o, q, k, v, probs, causal, scale, spec.threshold, spec.seed, spec.row_offset)


# The backward keeps a row's keep bits in shared memory (2 bytes per 16 keys, within 47 KiB) with dropout.
_CUDA_MAX_KEYS_DROPOUT = 47 * 1024 // 2 * 16


def _cuda_check(q=None, k=None, v=None, causal=True, dropout=True, **_) -> Optional[str]:
    if q is None:
        return None
    dtype_problem = registry.kernel_dtype_check(q.dtype)
    if dtype_problem:
        return dtype_problem
    if k.shape[2] >= 2**31 or q.shape[0] * q.shape[1] * q.shape[2] >= 2**31:
        return f"s_k = {k.shape[2]} or b * heads * s_q rows exceed the cuda kernel's 2**31 limit"
    if dropout and k.shape[2] > _CUDA_MAX_KEYS_DROPOUT:
        return f"s_k = {k.shape[2]} > {_CUDA_MAX_KEYS_DROPOUT}: too long for the cuda backward's keep bitmask"
    return None


registry.register(registry.Backend(
    OP, "cuda", _cuda_forward, _cuda_backward, _cuda_check,
    limits=(f"b * Hq * s_q < 2**31; s_k < 2**31, with dropout s_k <= {_CUDA_MAX_KEYS_DROPOUT}; "
            "fp16 scaled scores |scale * q.k| <= 65504")))
# Prefer the flash-style kernel (nothing s^2-sized kept) over the cuda softmax-dropout (keeps probs).
registry.set_auto_order(OP, ("triton", "cuda", "torch"))


# ----------------------------------------------------------------------------- FLOP counts
def _attention_flops(q_shape, k_shape, backward: bool) -> int:
    """SDPA's count (torch.utils.flop_counter): the GEMMs per query head, q k^T and p v forward (4 b Hq s_q
    s_k d), dV, dP, dQ, dK backward (twice that; a flash-style backward's recompute of q k^T not counted),
    as the planner counts the attention core (seqpar.memory). Registered for the kernel backends' custom
    ops, which FlopCounterMode sees as opaque calls: it counted nothing for them (the torch backend's
    matmuls it counts itself)."""
    b, heads, s_q, d = q_shape
    return (8 if backward else 4) * b * heads * s_q * k_shape[2] * d


@torch.utils.flop_counter.register_flop_formula([torch.ops.seqpar.attention_core_triton_fwd,
                                                 torch.ops.seqpar.attention_core_cuda_fwd])
def _(q_shape, k_shape, *args, **kwargs) -> int:
    return _attention_flops(q_shape, k_shape, backward=False)


@torch.utils.flop_counter.register_flop_formula([torch.ops.seqpar.attention_core_triton_bwd,
                                                 torch.ops.seqpar.attention_core_cuda_bwd])
def _(grad_o_shape, q_shape, k_shape, *args, **kwargs) -> int:
    return _attention_flops(q_shape, k_shape, backward=True)


# ----------------------------------------------------------------------------- autograd
class _AttentionCore(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale, spec, impl):
        o, saved = impl.forward(q, k, v, causal, scale, spec)
        ctx.save_for_backward(q, k, v, *saved)
        ctx.args = (causal, scale, spec)
        ctx.impl = impl
        # Detached: the backends return a view ([b, Hq, s, d] of a grouped or sequence-major buffer), and a
        # view made inside a custom Function can't be modified in place by the caller (SDPA's output can).
        # It shares the buffer's version counter, so an in-place change of a saved output still raises.
        return o.detach()

    @staticmethod
    @registry.once_differentiable
    def backward(ctx, grad_o):
        q, k, v, *saved = ctx.saved_tensors
        grad_q, grad_k, grad_v = ctx.impl.backward(grad_o, q, k, v, tuple(saved), *ctx.args)
        return (registry.cast(grad_q, q.dtype), registry.cast(grad_k, k.dtype), registry.cast(grad_v, v.dtype),
                None, None, None, None)


def _check_inputs(q, k, v, enable_gqa: bool) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4 or t.dtype not in registry.DTYPES:
            got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a floating [b, heads, s, d] tensor of {registry.DTYPES}, got {got}")
    registry.check_dense(q=q, k=k, v=v)
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if k.shape != v.shape:
        raise ValueError(f"k shape {tuple(k.shape)} != v shape {tuple(v.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q shape {tuple(q.shape)} does not match k/v shape {tuple(k.shape)} "
                         "in batch or head dim")
    if q.shape[3] == 0:
        raise ValueError(f"q, k, v need a head dim d of at least 1, got q shape {tuple(q.shape)}")
    heads, kv_heads = q.shape[1], k.shape[1]
    if heads == 0 or kv_heads == 0:
        raise ValueError(f"q and k/v need at least one head, got {heads} q heads and {kv_heads} k/v heads")
    if heads != kv_heads:
        if not enable_gqa:
            raise ValueError(f"q has {heads} heads but k/v have {kv_heads}: pass enable_gqa=True for "
                             "grouped-query attention (or give k/v q's head count)")
        if heads % kv_heads:
            raise ValueError(f"enable_gqa=True needs k/v heads dividing q heads, got {heads} q heads and "
                             f"{kv_heads} k/v heads")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")


def select_backend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
                   backend: Optional[str] = "auto", dropout: bool = True) -> registry.Backend:
    """The backend :func:`attention_core` runs for these inputs (the layer reads ``.recompute_free``).

    ``q``, ``k``, ``v`` as :func:`attention_core` takes them. Explicit ``backend`` / ``SEQPAR_BACKEND`` as
    in :mod:`seqpar.ops.registry`; "auto" takes the first that can run these inputs of triton
    (flash-style, saves nothing s^2-sized; passed over for fp32 q), cuda (saves the softmax output) and
    torch. ``dropout``: whether dropout may be active (True: choose a backend that can run it).
    ``causal``: whether the mask is causal. It defaults to True (the decoder layer's attention), where
    :func:`attention_core`'s ``is_causal`` defaults to False (SDPA's); no backend's check depends on it
    today, so either value selects the same backend. ValueError with the reason for an explicit backend
    that can't run these inputs here (auto falls back instead).
    """
    return registry.select(OP, backend, q.device, q=q, k=k, v=v, causal=bool(causal), dropout=bool(dropout))


class _FalseDefault(int):
    """``is_causal``'s default: equal to False (SDPA's default) yet told apart from an explicit False, so
    the ``causal=`` alias can reject a conflicting ``is_causal``."""

    def __repr__(self) -> str:
        return "False"


_IS_CAUSAL_DEFAULT = _FalseDefault(0)


def _resolve_causal(is_causal, causal) -> bool:
    for name, value in (("is_causal", is_causal), ("causal", causal)):
        if value is not None and value is not _IS_CAUSAL_DEFAULT and not isinstance(value, bool):
            raise ValueError(f"{name} must be a bool, got {value!r}")
    if causal is None:
        return bool(is_causal)
    if is_causal is not _IS_CAUSAL_DEFAULT and bool(is_causal) != causal:
        raise ValueError(f"is_causal={is_causal!r} and its alias causal={causal!r} disagree: pass one of them")
    return causal


def attention_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, attn_mask: Optional[torch.Tensor] = None,
                   is_causal: bool = _IS_CAUSAL_DEFAULT, dropout_p: float = 0.0, scale: Optional[float] = None,
                   enable_gqa: bool = False, seed: Optional[int] = None, training: bool = True,
                   backend: str = "auto", causal: Optional[bool] = None, row_offset: int = 0) -> torch.Tensor:
    """``dropout_p(softmax(q k^T * scale + causal_mask)) v`` over [b, heads, s, d] tensors: SDPA's
    ``scaled_dot_product_attention(q, k, v, is_causal=..., dropout_p=..., scale=..., enable_gqa=...)``
    with seqpar's regenerated dropout mask.

    Args:
        attn_mask: must be None (only the causal mask is supported: ``is_causal=True``).
        is_causal: mask keys after the query (top-left aligned, as SDPA). ``causal`` is an alias; giving
            both with different values is a ValueError.
        dropout_p: attention-probability dropout in [0, 1) (ignored when ``training`` is False). The
            effective probability is ``round(dropout_p * 256) / 256``
            (:func:`seqpar.random.effective_dropout_p`): p <= 1/512 drops nothing (a warning), and
            ``round(dropout_p * 256) >= 256`` is a ValueError.
        scale: softmax scale, default ``1/sqrt(d)``; any finite float, as SDPA's.
        enable_gqa: allow k, v with Hk heads dividing q's Hq (q head i uses kv head i // (Hq / Hk)).
            Without it, differing head counts are a ValueError.
        seed: dropout stream seed; None draws one from :func:`seqpar.manual_seed`'s generator.
        training: False turns dropout off whatever ``dropout_p`` (no seed drawn; a given one is still
            validated).
        backend: "auto" | "torch" | "triton" | "cuda" ("auto": the first of triton, cuda, torch that can run
            these inputs, triton passed over for fp32 q; module doc).
        row_offset: global index of this call's first dropout row (module doc; TP head offset).
    """
    if attn_mask is not None:
        got = f"a {type(attn_mask).__name__}" + (f" of shape {tuple(attn_mask.shape)}"
                                                   if isinstance(attn_mask, torch.Tensor) else "")
        raise ValueError(f"attn_mask: only None is supported (use is_causal=True for a causal mask), got {got}")
    causal = _resolve_causal(is_causal, causal)
    if not isinstance(enable_gqa, bool):
        raise ValueError(f"enable_gqa must be a bool, got {enable_gqa!r}")
    _check_inputs(q, k, v, enable_gqa)
    d = q.shape[-1]
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    # Any finite scale, as SDPA's (0: uniform weights over the allowed keys; < 0: the scores' sign flips)
    if not registry.is_finite(scale):
        raise ValueError(f"scale must be a finite float, got {scale!r}")
    impl = select_backend(q, k, v, causal=causal, backend=backend, dropout=dropout_active(dropout_p, training))
    spec = make_dropout_spec(dropout_p, training, seed, row_offset)   # draws a seed only for an accepted call
    return _AttentionCore.apply(q, k, v, causal, float(scale), spec, impl)
