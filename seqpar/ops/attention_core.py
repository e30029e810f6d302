"""The attention core: ``o = dropout_p(softmax(q k^T * scale + causal_mask)) v`` per (batch, head).

==========  =====================  ==========================================
tensor      shape                  notes
==========  =====================  ==========================================
q           [b, heads, s_q, d]     layout of F.scaled_dot_product_attention
k, v        [b, heads, s_k, d]     any strides (views of a fused QKV are fine)
o           [b, heads, s_q, d]     dtype of q
==========  =====================  ==========================================

``causal`` masks key j > query i (top-left aligned, like SDPA's ``is_causal``). ``scale`` defaults to
``1/sqrt(d)``. The dropout mask element (batch, head, i, j) is kept iff
``mask_byte(seed, row_offset + (head * b + batch) * s_q + i, j) >= round(p * 256)`` (:mod:`seqpar.random`;
the effective probability is ``round(p * 256) / 256``): rows are head-major so that a tensor-parallel
rank owning heads ``r*H_local ..`` passes ``row_offset = r * H_local * b * s_q`` and draws the same
masks as one device.

Backend interface (:func:`seqpar.ops.registry.register`)::

    forward(q, k, v, causal, scale, spec) -> (o, saved)          # saved: tuple of tensors
    backward(grad_o, q, k, v, saved, causal, scale, spec) -> (grad_q, grad_k, grad_v)

The torch reference saves the softmax output and the dropped probabilities (the paper's 4as^2b
bytes of 2-byte activations; the mask itself is regenerated); fused backends save much less:

=======  =================================================  ==============  ===============
backend  what runs                                          saved           recompute_free
=======  =================================================  ==============  ===============
torch    fp32 reference (the test oracle)                   probs, dropped  no
triton   flash-style kernels (triton_kernels/attention.py)  o, lse (fp32)   yes
cuda     torch GEMMs + fused scale/mask/softmax/dropout     probs           no
         kernels (csrc/softmax_dropout.cu)
=======  =================================================  ==============  ===============

"auto" prefers triton, then cuda, then torch (:func:`select_backend`).
The triton backend supports head dims ``d`` in 16..128 (multiples of 8; 32, 64, 80, 96, 128 are the
common ones) and returns ``o`` (and the gradients) as [b, heads, s, d] views of contiguous
[s, b, heads, d] buffers, so a layer can reshape ``o`` to [s, b, heads * d] without a copy. Both
kernel backends are ``torch.library`` custom ops (``seqpar::attention_core_{triton,cuda}_{fwd,bwd}``)
with fake implementations, so ``torch.compile`` traces through them.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from . import registry
from .. import _ext
from .dropout import DropoutSpec, make_dropout_spec
from ..memory import name_storage
from ..random import dropout_keep_mask

OP = "attention_core"
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def attention_keep_mask(spec: DropoutSpec, b: int, heads: int, s_q: int, s_k: int, device) -> torch.Tensor:
    """Bool keep-mask [b, heads, s_q, s_k] of the attention dropout (head-major rows, see module doc)."""
    batch = torch.arange(b, device=device).view(b, 1, 1)
    head = torch.arange(heads, device=device).view(1, heads, 1)
    query = torch.arange(s_q, device=device).view(1, 1, s_q)
    rows = (head * b + batch) * s_q + query + spec.row_offset
    return dropout_keep_mask(spec.seed, rows, s_k, spec.threshold)


def causal_mask(s_q: int, s_k: int, device) -> torch.Tensor:
    """Bool [s_q, s_k], True where key j > query i (masked out)."""
    return torch.ones(s_q, s_k, dtype=torch.bool, device=device).triu(1)


# ----------------------------------------------------------------------------- torch reference
def _torch_forward(q, k, v, causal: bool, scale: float, spec: DropoutSpec):
    scores = torch.matmul(q.float(), k.float().transpose(-2, -1)) * scale
    if causal:
        scores.masked_fill_(causal_mask(q.shape[2], k.shape[2], q.device), float("-inf"))
    probs = name_storage(torch.softmax(scores, dim=-1).to(q.dtype), "softmax output")
    dropped = probs
    if spec.active:
        keep = attention_keep_mask(spec, q.shape[0], q.shape[1], q.shape[2], k.shape[2], q.device)
        dropped = name_storage((probs.float() * keep * spec.scale).to(q.dtype), "dropout output")
    o = torch.matmul(dropped.float(), v.float()).to(q.dtype)
    return o, (probs, dropped)


def _torch_backward(grad_o, q, k, v, saved, causal: bool, scale: float, spec: DropoutSpec):
    probs, dropped = (t.float() for t in saved)
    grad_o = grad_o.float()
    grad_v = torch.matmul(dropped.transpose(-2, -1), grad_o)
    grad_dropped = torch.matmul(grad_o, v.float().transpose(-2, -1))
    if spec.active:
        keep = attention_keep_mask(spec, q.shape[0], q.shape[1], q.shape[2], k.shape[2], q.device)
        grad_probs = grad_dropped * keep * spec.scale
    else:
        grad_probs = grad_dropped
    grad_scores = probs * (grad_probs - (grad_probs * probs).sum(dim=-1, keepdim=True))
    grad_q = torch.matmul(grad_scores, k.float()) * scale
    grad_k = torch.matmul(grad_scores.transpose(-2, -1), q.float()) * scale
    return grad_q, grad_k, grad_v


registry.register(registry.Backend(OP, "torch", _torch_forward, _torch_backward))


# ----------------------------------------------------------------------------- triton backend
# Custom ops: torch.compile sees one opaque call with a fake (shape-only) implementation; the Triton
# module is imported on first use only (never at seqpar import time).
def _seq_major_empty(b: int, heads: int, s: int, d: int, like: torch.Tensor) -> torch.Tensor:
    return like.new_empty((s, b, heads, d)).permute(1, 2, 0, 3)


@torch.library.custom_op("seqpar::attention_core_triton_fwd", mutates_args=())
def _triton_fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                   drop_threshold: int, seed: int, row_offset: int) -> Tuple[torch.Tensor, torch.Tensor]:
    from ..triton_kernels.attention import attention_fwd

    with _ext.on_device(q):
        return attention_fwd(q, k, v, causal, scale, drop_threshold, seed, row_offset)


@_triton_fwd_op.register_fake
def _(q, k, v, causal, scale, drop_threshold, seed, row_offset):
    b, heads, s_q, d = q.shape
    return _seq_major_empty(b, heads, s_q, d, q), q.new_empty((b, heads, s_q), dtype=torch.float32)


@torch.library.custom_op("seqpar::attention_core_triton_bwd", mutates_args=())
def _triton_bwd_op(grad_o: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                   lse: torch.Tensor, causal: bool, scale: float, drop_threshold: int, seed: int,
                   row_offset: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from ..triton_kernels.attention import attention_bwd

    with _ext.on_device(q):
        return attention_bwd(grad_o, q, k, v, o, lse, causal, scale, drop_threshold, seed, row_offset)


@_triton_bwd_op.register_fake
def _(grad_o, q, k, v, o, lse, causal, scale, drop_threshold, seed, row_offset):
    b, heads, s_q, d = q.shape
    s_k = k.shape[2]
    return (_seq_major_empty(b, heads, s_q, d, q), _seq_major_empty(b, heads, s_k, d, k),
            _seq_major_empty(b, heads, s_k, d, v))


def _triton_forward(q, k, v, causal: bool, scale: float, spec: DropoutSpec):
    o, lse = _triton_fwd_op(q, k, v, causal, scale, spec.threshold, spec.seed, spec.row_offset)
    return o, (o, lse)


def _triton_backward(grad_o, q, k, v, saved, causal: bool, scale: float, spec: DropoutSpec):
    o, lse = saved
    return _triton_bwd_op(grad_o, q, k, v, o, lse, causal, scale, spec.threshold, spec.seed, spec.row_offset)


def _triton_check(q=None, k=None, v=None, causal=True, **_) -> Optional[str]:
    if q is None:
        return None
    # Only reached once triton imports (the registry checks that first).
    from ..triton_kernels.attention import unsupported_reason

    return unsupported_reason(q.shape[-1], q.dtype, q.shape[0] * q.shape[1])


registry.register(registry.Backend(OP, "triton", _triton_forward, _triton_backward, _triton_check,
                                   recompute_free=True))


# ----------------------------------------------------------------------------- cuda backend
# Megatron's non-flash path: the two GEMMs in torch, the s^2-sized middle in one fused kernel each way
# (csrc/softmax_dropout.cu). Saves the softmax output (2 bytes x s_q x s_k per head); the dropout mask
# and the dropped probabilities are regenerated in backward.


def _cuda_launch_args(scores: torch.Tensor, causal: bool, scale: float, drop_threshold: int, seed: int,
                      row_offset: int):
    b, heads, s_q, s_k = scores.shape
    active = drop_threshold > 0
    return (b, heads, s_q, s_k, _ext.DTYPE_CODES[scores.dtype], float(scale), bool(causal),
            int(seed) if active else 0, int(row_offset) if active else 0, int(drop_threshold),
            _ext.cuda_stream(scores.device))


@torch.library.custom_op("seqpar::attention_core_cuda_fwd", mutates_args=())
def _cuda_fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                 drop_threshold: int, seed: int, row_offset: int) -> Tuple[torch.Tensor, torch.Tensor]:
    scores = torch.matmul(q, k.transpose(-2, -1)).contiguous()      # [b, H, s_q, s_k], unscaled
    probs = torch.empty_like(scores)
    # Writes softmax(scale * scores + mask) to probs and, with dropout, its dropped copy over scores.
    with _ext.on_device(q):
        _ext.cuda_extension().attention_softmax_dropout_fwd(
            scores.data_ptr(), probs.data_ptr(), *_cuda_launch_args(scores, causal, scale, drop_threshold, seed,
                                                                    row_offset))
    dropped = scores if drop_threshold > 0 else probs
    return torch.matmul(dropped, v), probs


@_cuda_fwd_op.register_fake
def _(q, k, v, causal, scale, drop_threshold, seed, row_offset):
    b, heads, s_q, d = q.shape
    return q.new_empty((b, heads, s_q, d)), q.new_empty((b, heads, s_q, k.shape[2]))


@torch.library.custom_op("seqpar::attention_core_cuda_bwd", mutates_args=())
def _cuda_bwd_op(grad_o: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, probs: torch.Tensor,
                 causal: bool, scale: float, drop_threshold: int, seed: int,
                 row_offset: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    grad_o = grad_o.to(q.dtype)
    grad = torch.matmul(grad_o, v.transpose(-2, -1)).contiguous()   # d loss / d dropped probs
    dropped = torch.empty_like(probs) if drop_threshold > 0 else probs
    # In place: grad becomes d loss / d (q k^T) (scale folded in); dropped is regenerated from probs.
    # probs is the saved forward output (contiguous); .contiguous() guards a direct call of this op.
    probs = probs.contiguous()
    with _ext.on_device(q):
        _ext.cuda_extension().attention_softmax_dropout_bwd(
            probs.data_ptr(), grad.data_ptr(), dropped.data_ptr() if drop_threshold > 0 else 0,
            *_cuda_launch_args(probs, causal, scale, drop_threshold, seed, row_offset))
    grad_v = torch.matmul(dropped.transpose(-2, -1), grad_o)
    grad_q = torch.matmul(grad, k)
    grad_k = torch.matmul(grad.transpose(-2, -1), q)
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


def _cuda_check(q=None, k=None, v=None, causal=True, **_) -> Optional[str]:
    if q is None:
        return None
    if q.dtype not in _ext.DTYPE_CODES:
        return f"dtype {q.dtype} is not supported by the cuda softmax-dropout kernel"
    if k.shape[2] >= 2**31 or q.shape[0] * q.shape[1] * q.shape[2] >= 2**31:
        return f"s_k = {k.shape[2]} or b * heads * s_q rows exceed the cuda kernel's 2**31 limit"
    return None


registry.register(registry.Backend(OP, "cuda", _cuda_forward, _cuda_backward, _cuda_check))
# Prefer the flash-style kernel (nothing s^2-sized kept) over the cuda softmax-dropout (keeps probs).
registry.set_auto_order(OP, ("triton", "cuda", "torch"))


# ----------------------------------------------------------------------------- autograd
class _AttentionCore(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale, spec, impl):
        o, saved = impl.forward(q, k, v, causal, scale, spec)
        ctx.save_for_backward(q, k, v, *saved)
        ctx.args = (causal, scale, spec)
        ctx.impl = impl
        return o

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_o):
        q, k, v, *saved = ctx.saved_tensors
        grad_q, grad_k, grad_v = ctx.impl.backward(grad_o, q, k, v, tuple(saved), *ctx.args)
        return grad_q.to(q.dtype), grad_k.to(k.dtype), grad_v.to(v.dtype), None, None, None, None


def _check_inputs(q, k, v):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4 or t.dtype not in _DTYPES:
            got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a floating [b, heads, s, d] tensor of {_DTYPES}, got {got}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if k.shape != v.shape:
        raise ValueError(f"k shape {tuple(k.shape)} != v shape {tuple(v.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[1] != k.shape[1] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q shape {tuple(q.shape)} does not match k/v shape {tuple(k.shape)} "
                         "in batch, heads or head dim")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")


def select_backend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
                   backend: Optional[str] = "auto") -> registry.Backend:
    """The backend :func:`attention_core` runs for these inputs (the layer reads ``.recompute_free``).

    Explicit ``backend`` / ``SEQPAR_BACKEND`` as in :mod:`seqpar.ops.registry`; "auto" tries triton
    (flash-style, saves nothing s^2-sized), then cuda (saves the softmax output), then torch.
    """
    return registry.select(OP, backend, q.device, q=q, k=k, v=v, causal=bool(causal))


def attention_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
                   dropout_p: float = 0.0, scale: Optional[float] = None, seed: Optional[int] = None,
                   training: bool = True, backend: str = "auto", row_offset: int = 0) -> torch.Tensor:
    """``dropout_p(softmax(q k^T * scale + causal_mask)) v`` over [b, heads, s, d] tensors.

    Args:
        causal: mask keys after the query (top-left aligned).
        dropout_p: attention-probability dropout in [0, 1) (ignored when ``training`` is False). The
            effective probability is ``round(dropout_p * 256) / 256``
            (:func:`seqpar.random.effective_dropout_p`); ``round(dropout_p * 256) >= 256`` is a ValueError.
        scale: softmax scale, default ``1/sqrt(d)``.
        seed: dropout stream seed; None draws one from :func:`seqpar.manual_seed`'s generator.
        backend: "auto" | "torch" | "triton" | "cuda" ("auto": triton, then cuda, then torch).
        row_offset: global index of this call's first dropout row (module doc; TP head offset).
    """
    _check_inputs(q, k, v)
    d = q.shape[-1]
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not scale > 0:
        raise ValueError(f"scale must be a positive float, got {scale!r}")
    spec = make_dropout_spec(dropout_p, training, seed, row_offset)
    impl = select_backend(q, k, v, causal=bool(causal), backend=backend)
    return _AttentionCore.apply(q, k, v, bool(causal), float(scale), spec, impl)
