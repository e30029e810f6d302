"""The one check every unsharded-weights loader runs before it copies anything."""
from __future__ import annotations

from typing import Mapping, Optional, Tuple

import torch

from ..parallel.state import check_ranks_agree


def check_shapes(state_dict: Mapping[str, object], shapes: Mapping[str, Tuple[int, ...]], *,
                 what: str = "state dict", config: str = "") -> None:
    """ValueError unless ``state_dict`` has exactly the keys of ``shapes`` (the shapes the model's config
    implies), each a real-floating tensor with data (not bool, integer, complex or meta) of that shape.
    Any floating dtype passes: loaders cast it to the parameters' dtype.

    ``what`` names the dict in the messages ("GPT-2 state dict"); ``config`` names the setting that
    decides the keys ("n_layer=2") in the key-mismatch message; shape and dtype messages name the key,
    the expected and the given shape or dtype.
    """
    missing, unexpected = sorted(set(shapes) - set(state_dict)), sorted(set(state_dict) - set(shapes))
    if missing or unexpected:
        against = f" the config ({config})" if config else " the model"
        raise ValueError(f"{what} keys do not match{against}: missing {missing}, unexpected {unexpected}")
    for key, shape in shapes.items():
        value = state_dict[key]
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(shape):
            got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(f"{what} {key} must have shape {tuple(shape)} for this config, got {got}")
        # Checked here, before any copy: copy_ would cast a bool / int silently, drop a complex value's
        # imaginary part with a warning, and fail on a meta tensor after earlier keys were overwritten.
        if not value.is_floating_point() or value.is_meta:
            got = "a meta tensor (no data)" if value.is_meta else str(value.dtype)
            raise ValueError(f"{what} {key} must be a floating-point tensor with data, got {got}")


def check_loadable(state_dict: Mapping[str, object], shapes: Mapping[str, Tuple[int, ...]], group, *,
                   what: str, device: Optional[torch.device] = None) -> None:
    """:func:`check_shapes` on every rank of the tensor-parallel ``group``, a failure on any rank a
    ValueError on every rank (:func:`seqpar.parallel.state.check_ranks_agree`, one tiny all-gather):
    a rank whose dict is wrong must not leave the others loading theirs and then waiting for it in the
    next collective. (That every rank passes the same values is the caller's contract, not checked:
    comparing them would hash every weight.) ``device``, where the target's parameters live (None: not
    checked), must not be meta: copying into meta parameters does nothing, and nothing would say so."""
    problem = None
    try:
        if device is not None and device.type == "meta":
            raise ValueError(f"{what}: the parameters are on the meta device, where loading copies nothing: "
                             "call module.to_empty(device=...) first")
        check_shapes(state_dict, shapes)
    except ValueError as exc:
        problem = str(exc)
    check_ranks_agree(group, {}, what=what, error=problem)


__all__ = ["check_shapes", "check_loadable"]
