"""Activation recomputation (checkpointing) without RNG bookkeeping for seqpar's dropout.

:func:`checkpoint` is ``torch.utils.checkpoint``'s non-reentrant mode (``use_reentrant=False``) with
a few additions. Dropout masks are pure functions of seeds drawn *before* the checkpointed region
(seqpar.random), so the recomputation replays the same masks from its arguments; mode flags
(``training``) are likewise decided before the region and passed in as arguments, never read inside it
(the re-run happens in backward, after any ``train()`` / ``eval()``). Torch's checkpoint already re-runs
with the forward's CPU and CUDA generator states (a user's hook that draws noise draws the same again)
and the forward's autocast state. What it adds:

- the parameters of ``module``, which the function reads, are those of the forward in the re-run too
  (swapped back in if the module holds others by backward, as after ``torch.func.functional_call``),
  and one modified in place since the forward (an optimizer step before this backward) raises, as
  autograd does for the tensors it saves;
- what the re-run keeps alive until backward counts in an :class:`seqpar.memory.ActivationMeter`: the
  region's tensor inputs (the activations full recompute keeps) and, under autocast, the casts of the
  parameters.

The forward runs with autograd on, as without checkpointing, and the re-run only refills the tensors
autograd saved: gradients reach everything the region reads (its inputs, ``module``'s parameters, a
hook's adapter weights held outside the module), activations that hooks capture keep their graph, and
hooks on parameters run once.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Dict, Iterator, Optional

import torch
import torch.utils.checkpoint
from torch import nn
from torch.utils._pytree import tree_leaves

from ._custom_op import exporting
from .memory import count_as_saved, not_counted

__all__ = ["checkpoint", "swapped_parameters"]


@contextlib.contextmanager
def swapped_parameters(module: nn.Module, tensors: Dict[str, torch.Tensor]) -> Iterator[None]:
    """``module``'s parameters named in ``tensors`` (names as ``named_parameters()`` gives them) replaced
    by those tensors inside the block, every alias of a tied parameter included; the parameters are put
    back on leaving. What ``torch.nn.utils.stateless._reparametrize_module(..., tie_weights=True)`` does
    for parameters, in one walk over the modules (a quarter of its host time: it runs once per layer
    forward under autocast and once per full-recompute backward). ValueError for a name ``module``
    doesn't hold, and for two names of one tied parameter given different tensors (as
    ``_reparametrize_module``: one of them would silently win)."""
    if torch.compiler.is_compiling():
        # Dynamo traces torch's own reparametrization; the walk over ``_parameters`` below saw no parameter
        # in a traced module (every name "unknown": a graph break, and fullgraph=True raised).
        with torch.nn.utils.stateless._reparametrize_module(module, tensors, tie_weights=True):
            yield
        return
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


def _check_unmodified(parameters: Dict[str, torch.Tensor], versions: Dict[str, int]) -> None:
    """RuntimeError, as autograd's for a saved tensor, when a parameter the forward read was modified in
    place before the re-run (an optimizer step between this forward and its backward): the re-run would
    differentiate another forward without a word."""
    for name, p in parameters.items():
        if p._version != versions[name]:
            raise RuntimeError(
                f"one of the variables needed for gradient computation has been modified by an inplace "
                f"operation: parameter {name!r} of a recomputed region is at version {p._version}; expected "
                f"version {versions[name]} (the forward's). Was it updated (an optimizer step) between the "
                f"forward and this backward?")


def checkpoint(fn: Callable, *args, module: Optional[nn.Module] = None):
    """Run ``fn(*args)`` without keeping its intermediates; recompute them in backward.

    ``torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)`` (the forward's generator and
    autocast states in the re-run, gradients to everything ``fn`` reads, any nesting of outputs), plus:
    the re-run reads the parameters of ``module`` the forward read (``module`` defaults to ``fn`` itself
    when ``fn`` is an ``nn.Module`` or a bound method of one; one modified in place since the forward
    raises RuntimeError in backward, as autograd's saved tensors do), and what the re-run keeps alive until
    backward counts in active :class:`seqpar.memory.ActivationMeter` s when anything is kept (an output
    requires grad): the tensors in ``args`` and the parameters read that are not ``nn.Parameter`` s
    (autocast's casts of them). ``fn`` must compute the same thing when re-run in backward: everything it
    draws or reads from a mode (dropout seeds, ``training``) comes in through ``args``. The re-run is
    whole (``early_stop=False``): a region that runs collectives stops at the same point on every rank,
    never with one in flight. Under ``torch.no_grad`` nothing is saved for backward, and ``fn(*args)``
    just runs.
    """
    if not torch.is_grad_enabled():
        return fn(*args)
    if exporting():
        # torch.export captures the forward's ops: nothing there is kept for a backward, and torch's
        # checkpoint leaves grad-mode regions whose nodes the exported program's verifier refuses when
        # torch.export.load reads it back.
        return fn(*args)
    if torch.compiler.is_compiling():
        # Dynamo compiles torch's non-reentrant checkpoint as a higher-order op (the re-run inside the
        # compiled backward); the parameter swap below is module mutation it would break the graph on.
        return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)
    if module is None and isinstance(getattr(fn, "__self__", fn), nn.Module):
        module = getattr(fn, "__self__", fn)
    # The forward's parameters, kept by the closure for the re-run (not passed as checkpoint arguments:
    # torch's checkpoint reads a device generator's state once per tensor argument).
    forward_parameters: Dict[str, torch.Tensor] = {}
    forward_versions: Dict[str, int] = {}
    forward_done = []

    def run(*run_args):
        # The forward reads the parameters the module holds; the re-run those the forward read.
        if not forward_done:
            forward_done.append(True)
            out = fn(*run_args)
            if module is not None:
                # Read after fn, not before: a submodule that is its own FSDP2 unit registers its unsharded
                # parameters in its pre-forward hook, inside fn (and with reshard_after_forward=False keeps
                # them registered: its hook then does not run again in the re-run).
                forward_parameters.update(module.named_parameters())
                forward_versions.update((name, p._version) for name, p in forward_parameters.items())
            return out
        if not forward_parameters:
            return fn(*run_args)
        _check_unmodified(forward_parameters, forward_versions)
        with swapped_parameters(module, forward_parameters):
            return fn(*run_args)

    # Reading a device generator's state is not allowed while a CUDA graph is captured.
    capturing = torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()
    # torch's checkpoint saves the flat tensor args for its own bookkeeping whether or not anything will
    # need them: a meter would count them even where nothing requires grad and they are freed at once.
    with not_counted():
        out = torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=False, early_stop=False,
                                                preserve_rng_state=not capturing)
    if any(isinstance(t, torch.Tensor) and t.requires_grad for t in tree_leaves(out)):
        # The graph holds the re-run's closure: the tensors in args and the forward's parameters (under
        # autocast their casts, which are activations; Parameters themselves are not counted).
        count_as_saved(*(t for t in tree_leaves(args) if isinstance(t, torch.Tensor)), *forward_parameters.values())
    return out
