"""Activation recomputation (checkpointing) without RNG bookkeeping for seqpar's dropout.

Dropout masks are pure functions of seeds drawn *before* the checkpointed region (seqpar.random), so
the recomputation replays the same masks from its arguments. Code inside the region that draws from
torch's own generators (a user's hook adding noise) draws the same again: the re-run starts from the
forward's CPU and CUDA generator states, as torch.utils.checkpoint's does. Mode flags (``training``) are
likewise decided before the region and passed in as arguments, never read inside it (the re-run happens
in backward, after any ``train()`` / ``eval()``). The autocast state is the forward's too: the
re-run enters the autocast the forward ran under, whatever is active during backward. The region's
tensor inputs go through ``ctx.save_for_backward`` (so :class:`seqpar.memory.ActivationMeter` sees
them); the parameters of ``module``, which the function reads, are passed through so their gradients
flow and ``torch.autograd.grad`` works. The re-run differentiates detached copies of the inputs and
parameters (swapped into ``module``, backward into their ``.grad``): hooks registered on the parameters
run once, when the returned gradients reach them, as without recompute.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch
import torch.utils.checkpoint
from torch import nn

__all__ = ["checkpoint", "swapped_parameters"]


class _Checkpoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, module, param_names, n_args, *args_and_params):
        args = args_and_params[:n_args]
        tensor_index = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        ctx.fn, ctx.args, ctx.tensor_index = fn, list(args), tensor_index
        ctx.module, ctx.param_names = module, param_names
        ctx.autocast = _autocast_state(args[i] for i in tensor_index)
        ctx.rng = _rng_state(args[i] for i in tensor_index)
        for i in tensor_index:
            ctx.args[i] = None  # held via save_for_backward only
        ctx.save_for_backward(*(args[i] for i in tensor_index), *args_and_params[n_args:])
        with torch.no_grad():
            out = fn(*args)
        ctx.tuple_out = isinstance(out, tuple)
        _check_outputs(out)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grad_outs):
        saved = ctx.saved_tensors
        n = len(ctx.tensor_index)
        # Detached copies of the inputs and parameters: a backward into the parameters themselves would
        # run their hooks here, and again when the returned gradients reach them.
        leaves = [t.detach().requires_grad_(t.requires_grad) for t in saved]
        args = list(ctx.args)
        for i, t in zip(ctx.tensor_index, leaves[:n]):
            args[i] = t
        with torch.enable_grad(), _autocast(ctx.autocast), _replayed_rng(ctx.rng), \
                _parameters(ctx.module, ctx.param_names, leaves[n:]):
            outs = ctx.fn(*args)
        outs = outs if ctx.tuple_out else (outs,)
        pairs = [(o, g) for o, g in zip(outs, grad_outs)
                 if g is not None and isinstance(o, torch.Tensor) and o.requires_grad]
        wrt = [t for t in leaves if t.requires_grad]
        if pairs and wrt:
            # backward into the leaves' .grad, not autograd.grad: module hooks that watch gradients
            # (ModuleTracker, FlopCounterMode) ask whether a leaf's accumulator will run, which
            # autograd.grad refuses to answer
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs], inputs=wrt)
        grad_inputs = [t.grad for t in leaves]
        out = [None] * len(ctx.args)
        for i, g in zip(ctx.tensor_index, grad_inputs[:n]):
            out[i] = g
        return (None, None, None, None, *out, *grad_inputs[n:])


def _parameters(module: Optional[nn.Module], names: List[str], params: List[torch.Tensor]):
    """Swap ``params`` (the detached copies of the forward's parameters) into ``module`` for the re-run,
    so it computes what the forward did (also where the module holds others by now, as after
    torch.func.functional_call) and the gradients come back for those copies."""
    if module is None:
        return contextlib.nullcontext()
    return swapped_parameters(module, dict(zip(names, params)))


@contextlib.contextmanager
def swapped_parameters(module: nn.Module, tensors: Dict[str, torch.Tensor]) -> Iterator[None]:
    """``module``'s parameters named in ``tensors`` (names as ``named_parameters()`` gives them) replaced
    by those tensors inside the block, every alias of a tied parameter included; the parameters are put
    back on leaving. What ``torch.nn.utils.stateless._reparametrize_module(..., tie_weights=True)`` does
    for parameters, in one walk over the modules (a quarter of its host time: it runs once per layer
    forward under autocast and once per full-recompute backward). ValueError for a name ``module``
    doesn't hold, and for two names of one tied parameter given different tensors (as
    ``_reparametrize_module``: one of them would silently win)."""
    slots = [(sub, leaf, param, f"{prefix}.{leaf}" if prefix else leaf)
             for prefix, sub in module.named_modules(remove_duplicate=False)
             for leaf, param in sub._parameters.items() if param is not None]
    unknown = set(tensors).difference(name for *_, name in slots)
    if unknown:
        raise ValueError(f"swapped_parameters: {type(module).__name__} has no parameters {sorted(unknown)}")
    by_param, named = {}, {}
    for _, _, param, name in slots:
        if name in tensors:
            if id(param) in by_param and by_param[id(param)] is not tensors[name]:
                raise ValueError(f"swapped_parameters: {named[id(param)]!r} and {name!r} are one tied parameter "
                                 "but were given different tensors")
            by_param[id(param)], named[id(param)] = tensors[name], name
    swapped = []
    try:
        for sub, leaf, param, _ in slots:
            if id(param) in by_param:
                sub._parameters[leaf] = by_param[id(param)]
                swapped.append((sub, leaf, param))
        yield
    finally:
        for sub, leaf, param in reversed(swapped):
            sub._parameters[leaf] = param


_AutocastState = Tuple[Tuple[str, bool, torch.dtype], ...]


def _autocast_state(tensors) -> _AutocastState:
    """(device type, enabled, dtype) of autocast for the CPU and the device types of ``tensors``."""
    devices = ["cpu"] + sorted({t.device.type for t in tensors} - {"cpu"})
    return tuple((d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in devices
                 if torch.amp.is_autocast_available(d))


def _autocast(state: _AutocastState):
    """Re-enter the autocast state of the forward (and leave autocast off where it was off)."""
    stack = contextlib.ExitStack()
    for device, enabled, dtype in state:
        stack.enter_context(torch.autocast(device, dtype=dtype, enabled=enabled))
    return stack


_RngState = Tuple[torch.Tensor, Tuple[Tuple[int, torch.Tensor], ...]]


def _rng_state(tensors) -> _RngState:
    """torch's CPU generator state and that of the CUDA devices of ``tensors`` (not while a CUDA graph is
    captured, where reading a device generator's state is not allowed): what code inside the region
    that draws from torch's generators (a user's hook adding noise) draws from."""
    devices = sorted({t.device.index for t in tensors if t.device.type == "cuda"})
    if devices and torch.cuda.is_current_stream_capturing():
        devices = []
    return torch.get_rng_state(), tuple((d, torch.cuda.get_rng_state(d)) for d in devices)


@contextlib.contextmanager
def _replayed_rng(state: _RngState) -> Iterator[None]:
    """The forward's generator states for the re-run, and the backward's own back after it (as
    torch.utils.checkpoint's preserve_rng_state does): the re-run draws what the forward drew."""
    cpu, cuda = state
    if cuda and torch.cuda.is_current_stream_capturing():   # a backward captured alone: no device states
        cuda = ()
    with torch.random.fork_rng(devices=[d for d, _ in cuda]):
        torch.set_rng_state(cpu)
        for device, device_state in cuda:
            torch.cuda.set_rng_state(device_state, device)
        yield


def _check_outputs(out) -> None:
    """``fn`` returns a tensor or a flat tuple: a list, a dict or a nested tuple would leave the tensors
    inside it detached from the graph (an autograd.Function tracks only its direct outputs)."""
    if isinstance(out, (list, dict)):
        raise ValueError(f"checkpoint: fn must return a tensor or a flat tuple, not a {type(out).__name__}: "
                         "the tensors in it would get no gradient")
    for o in out if isinstance(out, tuple) else ():
        if isinstance(o, (list, tuple, dict)):
            raise ValueError(f"checkpoint: fn must return a tensor or a flat tuple (of tensors and other values), "
                             f"not one holding a {type(o).__name__}: the tensors in it would get no gradient")


def checkpoint(fn: Callable, *args, module: Optional[nn.Module] = None):
    """Run ``fn(*args)`` without keeping its intermediates; recompute them in backward.

    Only the tensor ``args`` are kept (plus references to ``module``'s parameters, which are not
    activations, and receive their gradients). ``fn`` must compute the same thing when re-run in
    backward: everything it draws or reads from a mode (dropout seeds, ``training``) comes in through
    ``args``, and the parameters it reads are ``module``'s (those of the forward, even if the module
    holds others by backward, as after torch.func.functional_call). ``module`` defaults to ``fn`` itself
    when ``fn`` is an ``nn.Module`` (or a bound method of one).

    Gradients flow to the tensors among ``args`` and to ``module``'s parameters only: a tensor that
    requires grad inside a list, tuple or dict argument is refused (ValueError), and ``fn`` returns a
    tensor or a flat tuple (ValueError otherwise); tensors ``fn`` reads from elsewhere (a closure, a
    global) get no gradient. The re-run uses the forward's autocast state and torch's generator states
    (CPU, and the CUDA devices of the tensor ``args``; not under CUDA graph capture). Once
    differentiable: a double backward through it raises. A torch.utils.checkpoint inside ``fn`` must be
    non-reentrant (``use_reentrant=False``: the reentrant kind refuses the re-run's backward with
    ``inputs``), and torch.func transforms (grad, vmap) do not go through it.
    """
    if torch.compiler.is_compiling():
        # Dynamo cannot trace a backward that calls torch.autograd.grad (a graph break per region); torch's
        # own non-reentrant checkpoint is a higher-order op it compiles, the re-run inside the compiled
        # backward. Same contract: fn's modes and seeds come in through args.
        return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)
    if module is None and isinstance(getattr(fn, "__self__", fn), nn.Module):
        module = getattr(fn, "__self__", fn)
    for i, a in enumerate(args):
        if isinstance(a, (list, tuple, dict)) and any(
                isinstance(t, torch.Tensor) and t.requires_grad
                for t in (a.values() if isinstance(a, dict) else a)):
            raise ValueError(f"checkpoint: argument {i} is a {type(a).__name__} holding tensors that require grad; "
                             "pass them as separate arguments (a container's tensors would get no gradient)")
    named = list(module.named_parameters()) if module is not None else []
    names, params = [n for n, _ in named], [p for _, p in named]
    return _Checkpoint.apply(fn, module, names, len(args), *args, *params)
