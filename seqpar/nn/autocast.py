"""``torch.autocast`` for seqpar's modules: under an enabled autocast a module runs as if converted to
the autocast dtype.

A module's ``forward`` asks :func:`autocast_dtype`; when it gets a dtype it hands the rest of its forward
(``body``) to :func:`run_in_dtype`, which casts the module's parameters and floating inputs once for the
call and runs ``body`` with autocast off. That is what autocast does for a plain layer's GEMM operands,
done for the whole module at once: the fused ops' autograd Functions have no per-op casts (no
``custom_fwd``), they take their operands' dtype, so the module computes as a model of that dtype would,
and the casts' backward brings the gradients back to the parameters' own dtype (fp32 master weights with
bf16 compute). Like autocast's own casts, the cast weights saved for backward count as activations in a
meter, and full recompute re-runs with the cast parameters (:func:`seqpar.recompute.checkpoint`).

``body`` is called directly, not through ``module.__call__``: the caller's hooks (forward hooks, FSDP2's
unshard) have run once already, and must not run again.
"""
from __future__ import annotations

import threading
from typing import Callable, Optional, Sequence

import torch
from torch import nn

from ..memory import name_storage
from ..recompute import swapped_parameters

_HANDED_DOWN = "_seqpar_autocast_dtype"   # the attribute run_in_dtype sets on its module for the call
# autocast_dtype's fast path asks mps and maia apart: torch._C._is_any_autocast_enabled() does not see
# their autocast (torch 2.13). Two calls, not a loop: it runs 5 times per layer forward.


def autocast_dtype(module: nn.Module) -> Optional[torch.dtype]:
    """The dtype ``module`` runs in for this call: that of the ``torch.autocast`` enabled for its
    parameters' device type, else None (also for meta parameters, which autocast knows nothing of: the
    input checks then name the device)."""
    if not torch.compiler.is_compiling() and not torch._C._is_any_autocast_enabled() \
            and not torch.is_autocast_enabled("mps") and not torch.is_autocast_enabled("maia"):
        return None   # the common case, without the walk to a parameter (5 calls per layer forward)
    device_type = next(module.parameters()).device.type
    if device_type == "meta" or not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


def run_in_dtype(module: nn.Module, dtype: torch.dtype, body: Callable, *args,
                 self_casting: Sequence[nn.Module] = ()):
    """``body(*args)`` (``module``'s forward after its autocast check) with ``module``'s parameters and the
    floating ``args`` cast to ``dtype`` for this call, autocast off inside.

    ``self_casting``: submodules that cast their own parameters when they are called; theirs are left
    alone here, and ``body`` calls them through :func:`call_self_casting`. A layer sharded with FSDP2
    holds its unsharded parameters only inside its own call, after its pre-forward hook: a cast made
    from outside would be replaced by its fp32 parameters.
    """
    device_type = next(module.parameters()).device.type
    skipped = {id(p) for child in self_casting for p in child.parameters()}
    _enter(module, dtype)
    try:
        with torch.autocast(device_type, enabled=False):
            params = {name: _cast(p, dtype) for name, p in module.named_parameters() if id(p) not in skipped}
            args = tuple(a.to(dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)
            with swapped_parameters(module, params):
                return body(*args)
    finally:
        setattr(module, _HANDED_DOWN, None)


_ENTERING = threading.Lock()


def _enter(module: nn.Module, dtype: torch.dtype) -> None:
    """Mark ``module`` as running in ``dtype``; RuntimeError if it already is (another thread's call). The
    call swaps the module's parameters for their casts (as ``torch.func.functional_call`` swaps them): a
    second thread entering meanwhile took the first one's casts for the parameters and put them back
    for good when it left (the module then held bf16 tensors, not Parameters, and trained nothing)."""
    if torch.compiler.is_compiling():   # no lock in a traced graph
        setattr(module, _HANDED_DOWN, dtype)
        return
    with _ENTERING:
        if getattr(module, _HANDED_DOWN, None) is not None:
            raise RuntimeError(f"{type(module).__name__} is already running under torch.autocast in another thread: "
                               "for the call its parameters are swapped for their casts (as torch.func.functional_call "
                               "swaps them), so one module can't run in two threads at once under autocast; give each "
                               "thread its own copy (copy.deepcopy), or convert the module with .to(dtype)")
        setattr(module, _HANDED_DOWN, dtype)


#: The meter's label of a parameter's autocast copy (kept for backward like autocast's own casts, but not
#: an activation of the paper's terms: Table 2 has no such row).
PARAMETER_CAST_LABEL = "parameter cast (autocast)"


def _cast(param: nn.Parameter, dtype: torch.dtype) -> torch.Tensor:
    """``param`` in ``dtype``; a new copy is named for the meters (:data:`PARAMETER_CAST_LABEL`)."""
    cast = param.to(dtype)
    return cast if cast is param else name_storage(cast, PARAMETER_CAST_LABEL)


def in_run_dtype(module: nn.Module, tensor: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """``tensor`` (a weight or bias ``module``'s forward reads) in the dtype :func:`run_in_dtype` runs
    ``module`` in; as it is outside run_in_dtype, or when it has that dtype already (a swapped parameter's
    cast, a parametrization computed from it at the read). What it casts is a tensor a forward pre-hook
    computed from the parameters before run_in_dtype swapped them: ``torch.nn.utils.prune`` and the old
    ``torch.nn.utils.weight_norm`` set ``module.weight`` so, in fp32, and a standalone linear under
    autocast refused its bf16 input. The cast's backward takes the gradient to the parameters."""
    dtype = getattr(module, _HANDED_DOWN, None)
    if tensor is None or dtype is None or tensor.dtype == dtype:
        return tensor
    return tensor.to(dtype)


def call_self_casting(parent: nn.Module, child: Callable, *args):
    """``child(*args)``, a ``self_casting`` submodule (or a wrapper of one) of ``parent``, under
    ``torch.autocast`` of the dtype :func:`run_in_dtype` runs ``parent`` in (plainly when it runs in none):
    the child then casts its own parameters. Autocast, not an attribute, is the signal because it is
    what torch.utils.checkpoint records and re-enters for its recompute: a checkpoint wrapper around the
    child (``apply_activation_checkpointing``) re-ran it in fp32 on its bf16 input."""
    dtype = getattr(parent, _HANDED_DOWN, None)
    if dtype is None:
        return child(*args)
    with torch.autocast(next(parent.parameters()).device.type, dtype=dtype):
        return child(*args)
