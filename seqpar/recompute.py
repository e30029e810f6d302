"""Activation recomputation (checkpointing) without RNG bookkeeping.

Dropout masks are pure functions of seeds drawn *before* the checkpointed region (seqpar.random), so
the recomputation replays the same masks with no RNG state saved; mode flags (``training``) are
likewise decided before the region and passed in as arguments, never read inside it (the re-run happens
in backward, after any ``train()`` / ``eval()``). The region's tensor inputs go through
``ctx.save_for_backward`` (so :class:`seqpar.memory.ActivationMeter` sees them); the parameters of
``module``, which the function reads, are passed through so their gradients flow and
``torch.autograd.grad`` works.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Optional

import torch
import torch.utils.checkpoint
from torch import nn
from torch.nn.utils.stateless import _reparametrize_module


class _Checkpoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, module, param_names, n_args, *args_and_params):
        args = args_and_params[:n_args]
        tensor_index = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        ctx.fn, ctx.args, ctx.tensor_index = fn, list(args), tensor_index
        ctx.module, ctx.param_names = module, param_names
        for i in tensor_index:
            ctx.args[i] = None  # held via save_for_backward only
        ctx.save_for_backward(*(args[i] for i in tensor_index), *args_and_params[n_args:])
        with torch.no_grad():
            out = fn(*args)
        ctx.tuple_out = isinstance(out, tuple)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grad_outs):
        saved = ctx.saved_tensors
        n = len(ctx.tensor_index)
        inputs, params = saved[:n], saved[n:]
        args = list(ctx.args)
        detached = []
        for i, t in zip(ctx.tensor_index, inputs):
            args[i] = t.detach().requires_grad_(t.requires_grad)
            detached.append(args[i])
        with torch.enable_grad(), _parameters_of_forward(ctx.module, ctx.param_names, params):
            outs = ctx.fn(*args)
        outs = outs if ctx.tuple_out else (outs,)
        pairs = [(o, g) for o, g in zip(outs, grad_outs) if g is not None and o.requires_grad]
        wrt = [t for t in detached + list(params) if t.requires_grad]
        grads = iter(torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True)
                     if pairs and wrt else [])
        grad_inputs = [next(grads) if t.requires_grad else None for t in detached + list(params)]
        out = [None] * len(ctx.args)
        for i, g in zip(ctx.tensor_index, grad_inputs[:n]):
            out[i] = g
        return (None, None, None, None, *out, *grad_inputs[n:])


def _parameters_of_forward(module: Optional[nn.Module], names, params):
    """The re-run's parameters are the forward's: where the module holds others now (the forward ran
    under torch.func.functional_call, which puts the module's own back on return), they are swapped in
    for the re-run, so it computes what the forward did and the gradients reach the tensors it used."""
    current = dict(module.named_parameters()) if module is not None else {}
    if all(current.get(name) is p for name, p in zip(names, params)):
        return contextlib.nullcontext()
    return _reparametrize_module(module, dict(zip(names, params)))


def checkpoint(fn: Callable, *args, module: Optional[nn.Module] = None):
    """Run ``fn(*args)`` without keeping its intermediates; recompute them in backward.

    Only the tensor ``args`` are kept (plus references to ``module``'s parameters, which are not
    activations, and receive their gradients). ``fn`` must compute the same thing when re-run in
    backward: everything it draws or reads from a mode (dropout seeds, ``training``) comes in through
    ``args``, and the parameters it reads are ``module``'s (those of the forward, even if the module
    holds others by backward, as after torch.func.functional_call). Once differentiable: a double
    backward through it raises.
    """
    if torch.compiler.is_compiling():
        # Dynamo cannot trace a backward that calls torch.autograd.grad (a graph break per region); torch's
        # own non-reentrant checkpoint is a higher-order op it compiles, the re-run inside the compiled
        # backward. Same contract: fn's modes and seeds come in through args.
        return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)
    named = list(module.named_parameters()) if module is not None else []
    names, params = [n for n, _ in named], [p for _, p in named]
    return _Checkpoint.apply(fn, module, names, len(args), *args, *params)
