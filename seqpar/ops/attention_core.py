"""The attention core: ``o = dropout_p(softmax(q k^T * scale + causal_mask)) v`` per (batch, head).

==========  =====================  ==========================================
tensor      shape                  notes
==========  =====================  ==========================================
q           [b, heads, s_q, d]     layout of F.scaled_dot_product_attention
k, v        [b, heads, s_k, d]     any strides (views of a fused QKV are fine)
o           [b, heads, s_q, d]     dtype of q
==========  =====================  ==========================================

``causal`` masks key j > query i (top-left aligned, like SDPA's ``is_causal``). ``scale`` defaults to
``1/sqrt(d)``. The dropout mask element (batch, head, i, j) is
``philox(seed + row_offset + (head * b + batch) * s_q + i, j) >= p`` (:mod:`seqpar.random`): rows are
head-major so that a tensor-parallel rank owning heads ``r*H_local ..`` passes
``row_offset = r * H_local * b * s_q`` and draws the same masks as one device.

Backend interface (:func:`seqpar.ops.registry.register`)::

    forward(q, k, v, causal, scale, spec) -> (o, saved)          # saved: tuple of tensors
    backward(grad_o, q, k, v, saved, causal, scale, spec) -> (grad_q, grad_k, grad_v)

The torch reference saves the softmax output and the dropped probabilities (the paper's 4as^2b
bytes of 2-byte activations; the mask itself is regenerated); fused backends save much less.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from . import registry
from .dropout import DropoutSpec, make_dropout_spec
from ..random import dropout_keep_mask

OP = "attention_core"
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def attention_keep_mask(spec: DropoutSpec, b: int, heads: int, s_q: int, s_k: int, device) -> torch.Tensor:
    """Bool keep-mask [b, heads, s_q, s_k] of the attention dropout (head-major rows, see module doc)."""
    batch = torch.arange(b, device=device).view(b, 1, 1, 1)
    head = torch.arange(heads, device=device).view(1, heads, 1, 1)
    query = torch.arange(s_q, device=device).view(1, 1, s_q, 1)
    rows = (head * b + batch) * s_q + query + spec.row_offset
    cols = torch.arange(s_k, device=device).view(1, 1, 1, s_k)
    return dropout_keep_mask(spec.seed, rows, cols, spec.p)


def causal_mask(s_q: int, s_k: int, device) -> torch.Tensor:
    """Bool [s_q, s_k], True where key j > query i (masked out)."""
    return torch.ones(s_q, s_k, dtype=torch.bool, device=device).triu(1)


# ----------------------------------------------------------------------------- torch reference
def _torch_forward(q, k, v, causal: bool, scale: float, spec: DropoutSpec):
    scores = torch.matmul(q.float(), k.float().transpose(-2, -1)) * scale
    if causal:
        scores.masked_fill_(causal_mask(q.shape[2], k.shape[2], q.device), float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    dropped = probs
    if spec.active:
        keep = attention_keep_mask(spec, q.shape[0], q.shape[1], q.shape[2], k.shape[2], q.device)
        dropped = (probs.float() * keep * spec.scale).to(q.dtype)
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


def attention_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
                   dropout_p: float = 0.0, scale: Optional[float] = None, seed: Optional[int] = None,
                   training: bool = True, backend: str = "auto", row_offset: int = 0) -> torch.Tensor:
    """``dropout_p(softmax(q k^T * scale + causal_mask)) v`` over [b, heads, s, d] tensors.

    Args:
        causal: mask keys after the query (top-left aligned).
        dropout_p: attention-probability dropout in [0, 1) (ignored when ``training`` is False).
        scale: softmax scale, default ``1/sqrt(d)``.
        seed: dropout stream seed; None draws one from :func:`seqpar.manual_seed`'s generator.
        backend: "auto" | "torch" | "triton" | "cuda".
        row_offset: global index of this call's first dropout row (module doc; TP head offset).
    """
    _check_inputs(q, k, v)
    d = q.shape[-1]
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not scale > 0:
        raise ValueError(f"scale must be a positive float, got {scale!r}")
    spec = make_dropout_spec(dropout_p, training, seed, row_offset)
    impl = registry.select(OP, backend, q.device, q=q, k=k, v=v, causal=bool(causal))
    return _AttentionCore.apply(q, k, v, bool(causal), float(scale), spec, impl)
