"""Graph capture helpers: custom ops (the fused ops' kernel launches, the dropout mask) and functions
that run outside torch.compile (the dropout seed draws).

A module of its own, below both ``seqpar.random`` and ``seqpar.ops`` (which imports seqpar.random), so
either can register an op without an import cycle.
"""
from __future__ import annotations

import contextlib
import functools
import sys
from typing import Callable, Iterable, Iterator, Optional

import torch


def tracing() -> bool:
    """True while anything above the dispatcher watches the ops: torch.compile / torch.export (Dynamo folds
    ``torch.compiler.is_compiling()`` to True in the frames it traces), any Python dispatch mode
    (FakeTensorMode, make_fx's proxy mode, FlopCounterMode, ...) or ``torch.jit.trace``. What
    :func:`kernel_op` asks (a mode sees a kernel launch only as the custom op); code that takes another
    path for a graph asks :func:`capturing_graph`, which real-tensor modes don't count."""
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


def assume_constant_result(fn: Callable) -> Callable:
    """``torch.compiler.assume_constant_result`` without importing torch._dynamo (0.6 s of seqpar's import,
    sympy and triton with it): that decorator only sets this attribute, which Dynamo reads when it traces
    a call (tests/test_import_time.py checks that the two still agree)."""
    fn._dynamo_marked_constant = True
    return fn


@assume_constant_result
def exporting() -> bool:
    """Whether torch.export is capturing: its flag, read as a constant. Not torch.compiler.is_exporting(),
    which Dynamo folded to True while torch.compile traced (before torch 2.14: every compiled recompute
    layer then ran without its checkpoint) and which torch 2.4 / 2.5 lack."""
    return bool(getattr(torch.compiler, "_is_exporting_flag", False))


@contextlib.contextmanager
def outside_dispatch_modes() -> Iterator[None]:
    """Host bookkeeping on real tensors, unseen by any Python dispatch mode: the ranks' agreement exchange
    and the RNG state it compares. Under FakeTensorMode (a memory estimate of a step) the RNG state's bytes
    were refused ("convert all Tensors to FakeTensors") and the exchanged ints were fake, unreadable; a
    proxy mode would trace them into the graph, a FLOP or comm counter count them as the model's. Torch
    function modes are off too: non-strict torch.export's turned the exchange into a functional collective
    that never completed (both ranks hung until the group's timeout)."""
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes(), torch._C.DisableTorchFunction():
        yield


def once_differentiable(backward: Callable) -> Callable:
    """For every seqpar autograd.Function's backward: first derivatives only. A backward with
    ``create_graph=True`` (grad mode on inside it) through the Function raises RuntimeError ("trying to
    differentiate twice ...", naming the Function) instead of returning gradients without their second
    derivatives. Without ``create_graph`` (the common case) the backward runs as is.

    Why refuse the first-order backward too: torch's ``once_differentiable`` hangs its error node off
    detached results and only where an incoming gradient requires grad, so ``torch.autograd.grad(penalty,
    params)`` pruned it (the first-order terms came back alone), and a constant upstream gradient
    (``loss.sum()``) gave zero second derivatives. Tying the results to the Function's inputs instead
    would need them saved, and most of seqpar's Functions save tensors computed in their forward (the
    memory they exist to save), not their inputs."""

    @functools.wraps(backward)
    def call(ctx, *grads):
        if torch.is_grad_enabled():
            raise RuntimeError(
                f"trying to differentiate twice a function that was marked with @once_differentiable "
                f"({backward.__qualname__}): seqpar's fused ops, parallel mappings and vocab-parallel loss have "
                "first derivatives only, so a backward with create_graph=True through them is refused (a "
                "gradient penalty or a Hessian-vector product would come out without their second-order "
                "terms; README, 'Gradients: first order')")
        return backward(ctx, *grads)

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

    The ops are not an API: like the launchers, they take the operands the functions in ``seqpar.ops``
    checked and laid out (2-D, unit column stride, matching shapes) and do not check them again.
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
    break, and under ``fullgraph=True`` an error that gives ``reason``.

    ``torch.compiler.disable`` itself imports torch._dynamo (0.6 s, most of seqpar's import), so the
    wrapper is built here and disables Dynamo only once Dynamo is loaded: before that no compiled code
    can be running (only Dynamo installs the frame hook), so the plain call is what the disabled one
    does. The wrapper carries the attributes Dynamo reads on a disabled function (the graph break and its
    reason, the function under it; tests/test_import_time.py checks them against torch's), and its own
    frame is skipped by Dynamo as torch's wrapper's is (it lies in a file Dynamo skips): else Dynamo
    compiled the wrapper's frame on every call from compiled code, an extra frame per call."""
    def wrap(fn: Callable) -> Callable:
        disabled = None

        @functools.wraps(fn)
        def call(*args, **kwargs):
            nonlocal disabled
            if disabled is None:
                if "torch._dynamo" not in sys.modules:
                    return fn(*args, **kwargs)
                # torch.compiler.disable's own; not wrapped in fn's name (call is), as functools' frames
                # would run under Dynamo's frame hook here (two frames more in its counts)
                try:
                    disabled = torch._dynamo.disable(fn, reason=reason, wrapping=False)
                except TypeError:   # a torch without wrapping= (the same disabling, two frames more)
                    disabled = torch._dynamo.disable(fn, reason=reason)
            return disabled(*args, **kwargs)

        call._torchdynamo_disable = call._torchdynamo_disable_recursive = True
        call._torchdynamo_disable_msg, call._torchdynamo_orig_callable = reason, fn
        call._torchdynamo_wrapper_id = id(call)
        _skip_frame(call.__code__)
        return call
    return wrap


def _skip_frame(code) -> None:
    """``torch._dynamo.skip_code(code)`` through its C binding: Dynamo's frame hook runs ``code``'s frames
    as they are, without importing torch._dynamo."""
    try:
        from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy, set_code_exec_strategy
    except ImportError:   # a torch without this binding: Dynamo traces the wrapper's frame (a cost, not an error)
        return
    set_code_exec_strategy(code, _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.DEFAULT))
