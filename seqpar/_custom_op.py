"""Graph capture helpers: custom ops (the fused ops' kernel launches, the dropout mask) and functions
that run outside torch.compile (the dropout seed draws).

A module of its own, below both ``seqpar.random`` and ``seqpar.ops`` (which imports seqpar.random), so
either can register an op without an import cycle.
"""
from __future__ import annotations

import functools
from typing import Callable, Iterable, Optional

import torch


def tracing() -> bool:
    """True while a graph is being captured: torch.compile / torch.export (Dynamo folds
    ``torch.compiler.is_compiling()`` to True in the frames it traces), a Python dispatch mode
    (FakeTensorMode, make_fx's proxy mode, FlopCounterMode, ...) or ``torch.jit.trace``."""
    # Dynamo folds is_compiling() to True, so it never evaluates the two C calls after it.
    return torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0 or torch._C._is_tracing()


def capturing_graph() -> bool:
    """True while the Python-level ops are captured into a graph: torch.compile / torch.export (Dynamo),
    make_fx / AOT tracing (a fake or proxy mode) or ``torch.jit.trace``. Unlike :func:`tracing`, other
    dispatch modes (FlopCounterMode, selective activation checkpointing, CommDebugMode) run real tensors
    eagerly and don't count: code that decides which collectives run must decide alike on ranks that
    differ only in such a mode."""
    if torch.compiler.is_compiling() or torch._C._is_tracing():
        return True
    if torch._C._len_torch_dispatch_stack() == 0:
        return False
    from torch._guards import detect_fake_mode
    from torch.fx.experimental.proxy_tensor import get_proxy_mode

    return detect_fake_mode() is not None or get_proxy_mode() is not None


class _SecondDerivative(torch.autograd.Function):
    """The identity on the gradients a once-differentiable backward returned, made a function of what they
    were computed from (the incoming gradients and the saved tensors that require grad): a derivative of
    them, by ``.backward()`` or by ``torch.autograd.grad(..., inputs=...)``, reaches this node and raises."""

    @staticmethod
    def forward(ctx, name, n, *tensors):
        ctx.name = name
        return tuple(t.clone() for t in tensors[:n])   # clones: the engine may accumulate into its outputs

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(f"trying to differentiate twice a function that was marked with @once_differentiable "
                           f"({ctx.name}): seqpar's fused ops, parallel mappings and vocab-parallel loss have "
                           "first derivatives only (README, 'Gradients: first order')")


class _RecordingContext:
    """A backward's ``ctx`` that records the saved tensors the backward unpacks (unpacking them a second
    time fails under torch's checkpoint); everything else goes to the real ctx."""

    def __init__(self, ctx):
        object.__setattr__(self, "_ctx", ctx)
        object.__setattr__(self, "unpacked", ())

    @property
    def saved_tensors(self):
        tensors = self._ctx.saved_tensors
        object.__setattr__(self, "unpacked", tensors)
        return tensors

    def __getattr__(self, name):
        return getattr(self._ctx, name)

    def __setattr__(self, name, value):
        setattr(self._ctx, name, value)


def once_differentiable(backward: Callable) -> Callable:
    """For every seqpar autograd.Function's backward: first derivatives only, and a derivative of them
    raises RuntimeError ("trying to differentiate twice ...") instead of coming out wrong.

    Without ``create_graph`` (grad mode off in the backward: the common case) the backward runs as is.
    With it, the backward runs under ``no_grad`` and its gradients are tied to the incoming gradients and
    to the saved tensors it unpacked that require grad, through a node whose backward raises. torch's
    ``once_differentiable`` ties its error node to nothing and adds it only when an incoming gradient
    requires grad: ``torch.autograd.grad(penalty, params)`` pruned it and returned the first-order terms
    alone, and a constant upstream gradient (``y.sum()``) gave zero second derivatives."""

    @functools.wraps(backward)
    def call(ctx, *grads):
        if not torch.is_grad_enabled():
            return backward(ctx, *grads)
        recording = _RecordingContext(ctx)
        with torch.no_grad():
            results = backward(recording, *grads)
        single = not isinstance(results, tuple)
        results = [results] if single else list(results)
        anchors = [t for t in (*grads, *recording.unpacked) if isinstance(t, torch.Tensor) and t.requires_grad]
        where = [i for i, r in enumerate(results) if isinstance(r, torch.Tensor)]
        if anchors and where:
            tied = _SecondDerivative.apply(backward.__qualname__, len(where), *(results[i] for i in where), *anchors)
            for i, t in zip(where, tied):
                results[i] = t
        return results[0] if single else tuple(results)

    return call


def kernel_op(name: str, launcher: Optional[Callable] = None, *, mutates_args: Iterable[str] = ()):
    """Register ``launcher`` as the ``torch.library`` custom op ``name`` and return a callable that runs
    the custom op while :func:`tracing` and ``launcher`` itself otherwise. Usable as a decorator, like
    ``torch.library.custom_op``; the result has ``register_fake`` (of the op), ``op`` (the
    ``CustomOpDef``, also ``torch.ops.<name>``) and ``launcher``.

    Why: the custom op exists for graph capture, where the kernel launch must be one opaque node with a
    fake (shape-only) implementation. In eager mode its dispatcher path (the autograd kernel torch
    registers for every custom op, a redispatch below autograd, the output-aliasing checks, a
    Dynamo-disable wrapper) adds tens of microseconds per call and nothing else: the gradients come from
    seqpar's own autograd.Functions, whose forward and backward already run with grad mode off, and a
    mutated argument's version counter is bumped by ``ctx.mark_dirty``. Both paths run the same launcher
    on the same arguments, so results are identical. Under the torch profiler the direct launch is a
    ``record_function`` range named ``name``, so profiles still attribute the kernels to the op.
    """
    if launcher is None:
        return functools.partial(kernel_op, name, mutates_args=mutates_args)
    op = torch.library.custom_op(name, launcher, mutates_args=mutates_args)

    def call(*args):
        if tracing():
            return op(*args)
        if torch.autograd._profiler_enabled():
            # profiles and traces name the launch after the op, as the custom op's own dispatch did
            with torch.profiler.record_function(name):
                return launcher(*args)
        return launcher(*args)

    call.__name__ = call.__qualname__ = getattr(launcher, "__name__", "kernel_op")
    call.__doc__ = launcher.__doc__
    call.op, call.launcher, call.register_fake = op, launcher, op.register_fake
    return call


def outside_compile(reason: str) -> Callable[[Callable], Callable]:
    """Decorator: the function runs eagerly, outside torch.compile (``torch.compiler.disable``): a graph
    break, and under ``fullgraph=True`` an error that gives ``reason``."""
    def wrap(fn: Callable) -> Callable:
        try:
            return torch.compiler.disable(fn, reason=reason)
        except TypeError:  # torch < 2.7: no reason= (the graph break is the same, its message bare)
            return torch.compiler.disable(fn)
    return wrap
