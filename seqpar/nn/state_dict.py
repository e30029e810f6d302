"""Where each rank's shard of a parameter lies in the unsharded tensor, and the state dicts built on it.

* :class:`ShardLayout` is the one description of a tensor-parallel split: every loader of unsharded
  weights (``load_full``), every gather of them (``full``) and the sharded state dicts for
  torch.distributed.checkpoint (DCP) read it, so they cannot disagree.
* :func:`sharded_state_dict` / :func:`sharded_optimizer_state_dict`: this rank's parameters and optimizer
  state, keyed like ``full_state_dict()``, each split tensor a ShardedTensor whose pieces say where they
  lie in the unsharded tensor. DCP saves every piece once and loads a checkpoint at any tensor-parallel
  size, in place.
* :func:`check_shapes` / :func:`check_loadable`: the one check every unsharded-weights loader runs
  before it copies anything.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Dict, Iterator, List, Mapping, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from ..parallel.state import ProcessGroup, check_ranks_agree, group_rank, group_size

# (local_start, full_start, length) along a layout's dim: the shard's indices local_start .. +length are
# the unsharded tensor's full_start .. +length.
Piece = Tuple[int, int, int]


@dataclasses.dataclass(frozen=True)
class ShardLayout:
    """Where one rank's shard of a parameter lies in the unsharded tensor of shape ``full_shape``.

    The shard is cut along ``dim`` into ``pieces``, each ``(local_start, full_start, length)``: the
    shard's indices ``local_start .. local_start + length - 1`` along ``dim`` are the unsharded
    tensor's ``full_start .. full_start + length - 1``; the other dims are whole. Indices of the shard
    in no piece are padding (a vocabulary table's padded rows). Examples at t = 2, rank 1: a fused QKV
    weight [3h, h] has three pieces of h/2 rows, ``(0, h/2, h/2), (h/2, 3h/2, h/2), (h, 5h/2, h/2)``;
    a row-parallel weight [n, k] one piece of columns, dim 1, ``(0, k/2, k/2)``.
    """

    full_shape: Tuple[int, ...]
    dim: int
    pieces: Tuple[Piece, ...]

    def __post_init__(self):
        # Empty pieces dropped, pieces adjacent in both tensors merged: at t = 1 every layout is one piece.
        merged: List[Piece] = []
        for local_start, full_start, length in self.pieces:
            if not length:
                continue
            if merged and merged[-1][0] + merged[-1][2] == local_start and merged[-1][1] + merged[-1][2] == full_start:
                local_start, full_start, length = merged[-1][0], merged[-1][1], merged.pop()[2] + length
            merged.append((local_start, full_start, length))
        object.__setattr__(self, "full_shape", tuple(self.full_shape))
        object.__setattr__(self, "pieces", tuple(merged))

    def local_view(self, shard: torch.Tensor, piece: Piece) -> torch.Tensor:
        """The piece in this rank's ``shard`` (a view)."""
        return shard.narrow(self.dim, piece[0], piece[2])

    def full_view(self, full: torch.Tensor, piece: Piece) -> torch.Tensor:
        """The piece in the unsharded tensor ``full`` (a view)."""
        return full.narrow(self.dim, piece[1], piece[2])

    def offsets(self, piece: Piece) -> List[int]:
        """The piece's first index in the unsharded tensor, every dim."""
        return [piece[1] if i == self.dim else 0 for i in range(len(self.full_shape))]

    def sizes(self, piece: Piece) -> List[int]:
        """The piece's size, every dim."""
        return [piece[2] if i == self.dim else n for i, n in enumerate(self.full_shape)]


@torch.no_grad()
def scatter_full(full: torch.Tensor, shard: torch.Tensor, layout: ShardLayout) -> None:
    """Copy this rank's pieces of the unsharded ``full`` into ``shard`` (padding untouched)."""
    for piece in layout.pieces:
        layout.local_view(shard, piece).copy_(layout.full_view(full, piece))


@torch.no_grad()
def gather_full(shard: torch.Tensor, layout_of_rank: Callable[[int], ShardLayout], group: ProcessGroup) -> torch.Tensor:
    """The unsharded tensor from every rank's ``shard`` (equal shapes on every rank; a collective under
    TP), each placed by ``layout_of_rank(r)``; a new tensor."""
    t = group_size(group)
    shards = [shard]
    if t > 1:
        shards = [torch.empty_like(shard) for _ in range(t)]
        dist.all_gather(shards, shard.contiguous(), group=group)
    layout = layout_of_rank(0)
    full = shard.new_empty(layout.full_shape)
    for r, part in enumerate(shards):
        layout = layout_of_rank(r)
        for piece in layout.pieces:
            layout.full_view(full, piece).copy_(layout.local_view(part, piece))
    return full


class ShardedParameters:
    """Mixin of the modules whose parameters are split over their ``tp_group``. :meth:`shard_layouts`
    names each split parameter's :class:`ShardLayout` on a rank; the parameters it doesn't name are
    replicated (the same on every rank). Loading and gathering unsharded weights and the sharded state
    dicts all read these layouts."""

    tp_group: ProcessGroup

    def shard_layouts(self, rank: int) -> Dict[str, ShardLayout]:
        """{parameter name: its layout on ``rank`` of ``tp_group``}, split parameters only."""
        raise NotImplementedError

    @torch.no_grad()
    def _load_full_parameters(self, full: Mapping[str, Optional[torch.Tensor]]) -> None:
        """Keep this rank's shard of each unsharded tensor in ``full`` (by parameter name; None: no such
        parameter); replicated parameters take the whole tensor."""
        layouts = self.shard_layouts(group_rank(self.tp_group))
        for name, value in full.items():
            param = getattr(self, name)
            if param is None or value is None:
                if param is not value:
                    raise ValueError(f"{type(self).__name__} {'has no' if param is None else 'needs a'} {name}, "
                                     f"got {'one' if param is None else 'None'}")
                continue
            if name in layouts:
                scatter_full(value, param, layouts[name])
            else:
                param.copy_(value)

    @torch.no_grad()
    def _full_parameter(self, name: str) -> Optional[torch.Tensor]:
        """The unsharded parameter ``name`` (a collective if it is split), a new tensor; None if unset."""
        param = getattr(self, name)
        if param is None:
            return None
        if _is_dtensor(param):
            raise ValueError(f"{type(self).__name__}.{name} is a DTensor (FSDP2's fully_shard?): gathering the "
                             "unsharded weights takes plain tensor-parallel shards; FSDP2 is not supported here yet")
        if name not in self.shard_layouts(0):
            return param.detach().clone()
        return gather_full(param.detach(), lambda r: self.shard_layouts(r)[name], self.tp_group)


def _sharded_tensor(shard: torch.Tensor, layout: ShardLayout, group: ProcessGroup):
    """``shard``'s pieces as a ShardedTensor of the unsharded shape (pieces are views: DCP loads into
    ``shard`` in place). On one rank, the one piece as a plain tensor view."""
    if group_size(group) == 1:
        (piece,) = layout.pieces
        return layout.local_view(shard, piece)
    # torch.distributed.checkpoint takes arbitrary pieces only as ShardedTensor (DTensor's Shard splits
    # evenly: it can express neither fused QKV's three pieces per rank nor the vocabulary's real rows).
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, init_from_local_shards

    # A rank without pieces (a vocabulary shard of padding only) offers an empty one at the end of dim:
    # DCP's load drops a ShardedTensor without local shards from its key set, takes the missing key for
    # a pre-2.4 checkpoint and then fails on every other nested key ("Missing key ... param_groups").
    pieces = layout.pieces or ((0, layout.full_shape[layout.dim], 0),)
    placement = f"rank:{dist.get_rank()}/{shard.device}"     # the global rank, whatever the group
    local = [Shard(layout.local_view(shard, piece),
                   ShardMetadata(layout.offsets(piece), layout.sizes(piece), placement)) for piece in pieces]
    return init_from_local_shards(local, *layout.full_shape, process_group=group)


def _unwrapped(module: nn.Module) -> nn.Module:
    """``module`` without the outer wrappers whose parameters are their inner module's: DDP (``.module``)
    and torch.compile's OptimizedModule (``._orig_mod``), in any order (compile(DDP(model)) included)."""
    while True:
        inner = (module.module if isinstance(module, nn.parallel.DistributedDataParallel)
                 else getattr(module, "_orig_mod", None))
        if not isinstance(inner, nn.Module):
            return module
        module = inner


def _is_dtensor(tensor: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:   # torch built without distributed
        return False
    return isinstance(tensor, DTensor)


# Wrappers that add a name to the path but no parameters: activation checkpointing's checkpoint_wrapper
# and torch.compile's OptimizedModule. Keys leave them out, as full_state_dict() does (wrapped or not, a
# model saves and loads the same keys).
_WRAPPER_NAMES = ("_checkpoint_wrapped_module", "_orig_mod")


def _parameters_with_layouts(
        module: nn.Module) -> Iterator[Tuple[str, nn.Parameter, Optional[ShardLayout], ProcessGroup]]:
    """(key, parameter, this rank's layout or None if replicated, group) for every parameter of
    ``module``, keyed as ``named_parameters()`` without the wrappers' names (a parameter shared by two
    modules once)."""
    seen = set()
    for prefix, sub in _unwrapped(module).named_modules():
        layouts, group = {}, None
        if isinstance(sub, ShardedParameters):
            group = sub.tp_group
            layouts = sub.shard_layouts(group_rank(group))
        for name, param in sub.named_parameters(recurse=False):
            if id(param) in seen:
                continue
            if _is_dtensor(param):
                raise ValueError(f"parameter {prefix}.{name} is a DTensor (FSDP2's fully_shard?): seqpar's sharded "
                                 "state dicts and clip_grad_norm_ take plain tensor-parallel shards (DDP for data "
                                 "parallelism); FSDP2 over the data-parallel ranks is not supported by them yet")
            seen.add(id(param))
            key = ".".join(part for part in f"{prefix}.{name}".split(".") if part and part not in _WRAPPER_NAMES)
            yield key, param, layouts.get(name), group


def _check_not_meta(module: nn.Module, what: str) -> None:
    meta = next((key for key, p in module.named_parameters() if p.is_meta), None)
    if meta is not None:
        raise ValueError(f"{what}: parameter {meta} is on the meta device (no data to save or load into): "
                         "call module.to_empty(device=...) first")


def sharded_state_dict(module: nn.Module) -> Dict[str, torch.Tensor]:
    """This rank's parameters for torch.distributed.checkpoint, keyed as ``full_state_dict()`` (and
    ``named_parameters()`` without the names activation checkpointing's ``checkpoint_wrapper`` and
    ``torch.compile`` add), every value a view of the parameter (no copy):

    * a split parameter (tensor-parallel linear weights and column-parallel biases, the vocabulary
      tables): a ShardedTensor of the UNSHARDED shape whose local pieces are this rank's parts of it,
      each with its offset (fused QKV: its rows of the Q, K and V blocks; SwiGLU's fc1: of gate and up;
      a vocabulary table: its real rows, not the padding);
    * a replicated parameter (norms, position table, row-parallel biases): the parameter's data.

    ``dcp.save(sharded_state_dict(model), checkpoint_id=path)`` on every rank writes each piece once;
    ``dcp.load(sharded_state_dict(model), checkpoint_id=path)`` loads a checkpoint saved at any
    tensor-parallel size into the parameters in place. (Not a collective itself on one rank; under TP the
    ShardedTensors are built with a small all-gather each: call it on every rank.) On one rank every value
    is a plain tensor, the vocabulary tables their real rows. ValueError for parameters on the meta device.

    DCP's load warns that ShardedTensor is deprecated in favour of DTensor (its own code reads the
    ShardedTensor's device). DTensor can't express these pieces; the warning changes nothing.
    """
    _check_not_meta(module, "sharded_state_dict")
    out = {}
    for key, param, layout, group in _parameters_with_layouts(module):
        out[key] = param.detach() if layout is None else _sharded_tensor(param.detach(), layout, group)
    return out


@torch.no_grad()
def _created_optimizer_state(optimizer: torch.optim.Optimizer, params: List[nn.Parameter]) -> Dict[nn.Parameter, dict]:
    """The state the optimizer's own step would create for ``params`` (which have none), made by one step
    over them alone with zero gradients at learning rate 0, then taken out of the optimizer again: it
    changes no parameter, no other parameter's state, and leaves ``params`` without state. (Its values
    are placeholders for a load: some optimizers derive state from lr, e.g. Rprop's step sizes.)"""
    if not params:
        return {}
    wanted = {id(p) for p in params}
    groups, rates, grads = [], [], {p: p.grad for p in params}
    for group in optimizer.param_groups:
        groups.append(group["params"])
        rates.append(group["lr"])
        group["params"] = [p for p in group["params"] if id(p) in wanted]
        group["lr"] = torch.zeros_like(group["lr"]) if isinstance(group["lr"], torch.Tensor) else 0.0
    for param in params:
        param.grad = torch.zeros_like(param)
    try:
        optimizer.step()
    finally:
        for group, members, lr in zip(optimizer.param_groups, groups, rates):
            group["params"], group["lr"] = members, lr
        for param, grad in grads.items():
            param.grad = grad
    return {p: optimizer.state.pop(p) for p in params if p in optimizer.state}


def _optimizer_keys(module: nn.Module, optimizer: torch.optim.Optimizer, what: str):
    """{id(param): (key, layout, group)} over the module's parameters, checked to hold every parameter
    the optimizer updates."""
    info = {id(param): (key, layout, group) for key, param, layout, group in _parameters_with_layouts(module)}
    foreign = sum(id(p) not in info for group in optimizer.param_groups for p in group["params"])
    if foreign:
        raise ValueError(f"{what}: the optimizer updates {foreign} parameter(s) that are not the module's; "
                         "pass the module whose parameters it was built with")
    return info


class _OptimizerStateDict(dict):
    """What :func:`sharded_optimizer_state_dict` returns: a plain dict to DCP, which also remembers the
    state it made for parameters that had none (``created``: not in the optimizer, so saving changes
    nothing; :func:`load_sharded_optimizer_state_dict` attaches it where the checkpoint had state)."""

    created: Dict[nn.Parameter, dict]


def sharded_optimizer_state_dict(module: nn.Module, optimizer: torch.optim.Optimizer) -> Dict[str, object]:
    """This rank's optimizer state for torch.distributed.checkpoint, split like the parameters it
    belongs to, so a checkpoint saved at one tensor-parallel size resumes at another:
    ``{"state": {parameter key: {state name: tensor}}, "has_state": {parameter key: 0-d int64 tensor},
    "param_groups": [{hyperparameters, "params": [parameter keys]}]}``, keys as :func:`sharded_state_dict`'s.

    A state tensor of its parameter's shard shape (Adam's ``exp_avg`` / ``exp_avg_sq``, SGD's momentum)
    is split like the parameter (a ShardedTensor of the unsharded shape under TP); a 0-d one (``step``)
    and the state of replicated parameters are plain tensors. Every tensor is the optimizer's own (a view:
    DCP loads in place). A trainable parameter without state (a fresh optimizer before a load; a
    parameter not stepped yet) gets placeholder tensors made by the optimizer's own step over it alone
    (zero gradients, learning rate 0) but kept out of the optimizer, and ``has_state`` 0: saving changes
    nothing, and a resumed run leaves that parameter without state as the saving run had it.
    ValueError, before anything is made, for a parameter the module doesn't hold, for state that is not a
    tensor or has another shape (it could not be resharded), and for parameters on the meta device.

    Save: ``dcp.save({"model": sharded_state_dict(model), "optim": sharded_optimizer_state_dict(model,
    opt)}, checkpoint_id=path)``. Resume (any t): build the same two dicts, ``dcp.load`` them, then
    :func:`load_sharded_optimizer_state_dict` (required: it attaches the state loaded for parameters
    that had none and sets the hyperparameters).
    """
    what = "sharded_optimizer_state_dict"
    _check_not_meta(module, what)
    info = _optimizer_keys(module, optimizer, what)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for param in params:
        for name, value in optimizer.state.get(param, {}).items():
            if not isinstance(value, torch.Tensor) or (value.dim() and value.shape != param.shape):
                got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                raise ValueError(f"{what}: optimizer state {name!r} of {info[id(param)][0]} must be a tensor of "
                                 f"the parameter's shape {tuple(param.shape)} or a 0-d tensor to be resharded, "
                                 f"got {got}")
    created = _created_optimizer_state(optimizer, [p for p in params if p.requires_grad and not optimizer.state.get(p)])
    state, has_state = {}, {}
    for param in params:
        key, layout, group = info[id(param)]
        own = optimizer.state.get(param)
        state[key] = {name: _sharded_tensor(value, layout, group) if layout is not None and value.dim() else value
                      for name, value in (own or created.get(param, {})).items()}
        has_state[key] = torch.tensor(int(bool(own)))
    groups = [{**{k: v for k, v in group.items() if k != "params"}, "params": [info[id(p)][0] for p in group["params"]]}
              for group in optimizer.param_groups]
    out = _OptimizerStateDict(state=state, has_state=has_state, param_groups=groups)
    out.created = created
    return out


def load_sharded_optimizer_state_dict(module: nn.Module, optimizer: torch.optim.Optimizer,
                                      state_dict: Mapping[str, object]) -> None:
    """After ``dcp.load`` into the dict :func:`sharded_optimizer_state_dict` returned for this optimizer
    (DCP loaded its state tensors in place): give each parameter the state the checkpoint had for it
    (the loaded placeholders where the optimizer had none; none where the checkpoint had none) and set
    each param group's hyperparameters (``lr``, ``betas``, ...) to the loaded ones. ValueError, before
    anything is set, if the loaded groups do not hold the optimizer's parameters in its order or the
    dict is not one :func:`sharded_optimizer_state_dict` made."""
    what = "load_sharded_optimizer_state_dict"
    info = _optimizer_keys(module, optimizer, what)
    loaded = state_dict.get("param_groups") if isinstance(state_dict, Mapping) else None
    expected = [[info[id(p)][0] for p in group["params"]] for group in optimizer.param_groups]
    got = [list(group.get("params", ())) for group in loaded] if isinstance(loaded, (list, tuple)) else None
    if got != expected:
        if got is None:
            detail = f"got {type(loaded).__name__} as param_groups"
        elif [len(g) for g in got] != [len(g) for g in expected]:
            detail = (f"{[len(g) for g in got]} parameters per group, the optimizer has "
                      f"{[len(g) for g in expected]}")
        else:
            saved_key, own_key = next((a, b) for g, e in zip(got, expected) for a, b in zip(g, e) if a != b)
            detail = f"{saved_key!r} where the optimizer has {own_key!r}"
        raise ValueError(f"{what}: the loaded param_groups do not hold the optimizer's parameters in its "
                         f"order ({detail}): build the optimizer as the checkpoint's was")
    created, has_state = getattr(state_dict, "created", None), state_dict.get("has_state")
    if created is None or not isinstance(has_state, Mapping):
        raise ValueError(f"{what}: state_dict must be the dict sharded_optimizer_state_dict(module, optimizer) "
                         f"returned (after dcp.load into it), got a {type(state_dict).__name__}")
    for param in (p for group in optimizer.param_groups for p in group["params"]):
        if int(has_state[info[id(param)][0]]):
            if not optimizer.state.get(param) and param in created:   # (a frozen parameter has none made)
                optimizer.state[param] = created[param]
        else:
            optimizer.state.pop(param, None)
    for group, saved in zip(optimizer.param_groups, loaded):
        group.update({k: v for k, v in saved.items() if k != "params"})


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


__all__ = ["ShardLayout", "ShardedParameters", "scatter_full", "gather_full", "sharded_state_dict",
           "sharded_optimizer_state_dict", "load_sharded_optimizer_state_dict", "check_shapes", "check_loadable"]
