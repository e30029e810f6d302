"""Where each rank's shard of a parameter lies in the unsharded tensor, and the state dicts built on it.

* :class:`ShardLayout` is the one description of a tensor-parallel split: every loader of unsharded
  weights (``load_full``), every gather of them (``full``) and the sharded state dicts for
  torch.distributed.checkpoint (DCP) read it, so they cannot disagree.
* FSDP2 (``fully_shard`` over the data-parallel ranks) cuts each tensor-parallel shard once more, into
  row chunks (DTensor ``Shard(0)``; HSDP replicates them): :func:`scatter_full`, :func:`gather_full`,
  the sharded state dicts and :func:`seqpar.nn.clip_grad_norm_` take a parameter's pieces in this
  rank's chunk (:func:`local_rows`), so they work with and without it. Each entry first calls
  :func:`prepare_parameters` (FSDP2 resharded, the TP ranks' FSDP2 groups checked to form a grid).
* :func:`sharded_state_dict` / :func:`sharded_optimizer_state_dict`: this rank's parameters and optimizer
  state, keyed like ``full_state_dict()`` (but a module or parameter at two places once, at its first:
  the optimizer holds it once), each split tensor a ShardedTensor whose pieces say where they
  lie in the unsharded tensor. DCP saves every piece once and loads a checkpoint at any tensor-parallel
  (and FSDP2) size, in place.
* :func:`check_shapes` / :func:`check_loadable`: the one check every unsharded-weights loader runs
  before it copies anything.
"""
from __future__ import annotations

import dataclasses
import sys
import weakref
from typing import Callable, Dict, Iterable, Iterator, List, Mapping, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from .._custom_op import outside_dispatch_modes
from ..ops.registry import is_dtensor
from ..parallel.state import ProcessGroup, all_gather_objects, check_ranks_agree, group_rank, group_size, run_agreed

# (local_start, full_start, length) along a layout's dim: the shard's indices local_start .. +length are
# the unsharded tensor's full_start .. +length.
Piece = Tuple[int, int, int]
# One block of the unsharded tensor that a rank holds: ((dim, start, length): where it lies in the rank's
# local tensor, a narrow of it; its offsets in the unsharded tensor, every dim; its sizes, every dim).
Box = Tuple[Tuple[int, int, int], List[int], List[int]]


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


def boxes(layout: Optional[ShardLayout], shard_shape: Sequence[int], first_row: int, rows: int) -> List[Box]:
    """The blocks of the unsharded tensor in rows ``first_row .. first_row + rows - 1`` of a
    tensor-parallel shard of shape ``shard_shape`` laid out by ``layout`` (None: a replicated tensor,
    the shard is the unsharded tensor). Those rows are the rank's local tensor: the whole shard, or its
    FSDP2 chunk. Each block: where it lies in the local tensor, its offsets and sizes in the unsharded
    tensor (:data:`Box`); none for rows of padding only."""
    shard_shape = list(shard_shape)
    if layout is None:
        return [((0, 0, rows), [first_row] + [0] * (len(shard_shape) - 1), [rows] + shard_shape[1:])] if rows else []
    out: List[Box] = []
    for local_start, full_start, length in layout.pieces:
        offsets, sizes = [0] * len(shard_shape), list(layout.full_shape)
        if layout.dim == 0:    # the piece's rows that fall in the chunk
            start, end = max(local_start, first_row), min(local_start + length, first_row + rows)
            if start < end:
                offsets[0], sizes[0] = full_start + start - local_start, end - start
                out.append(((0, start - first_row, end - start), offsets, sizes))
        elif rows:             # a piece of columns: the chunk's rows of it
            offsets[0], sizes[0] = first_row, rows
            offsets[layout.dim], sizes[layout.dim] = full_start, length
            out.append(((layout.dim, local_start, length), offsets, sizes))
    return out


@dataclasses.dataclass(frozen=True)
class RowChunks:
    """How FSDP2 cuts a tensor (a tensor-parallel shard, or a replicated tensor) over its data-parallel
    shard group: ``rows[j] = (global rank, first row, row count)`` for member j, ``index`` this rank's j,
    ``group`` the group (None, one member holding every row, for a plain tensor)."""

    rows: Tuple[Tuple[int, int, int], ...]
    index: int
    group: Optional[ProcessGroup]


def fsdp_mesh_dim(tensor: torch.Tensor, name: Optional[str] = None) -> int:
    """The mesh dim a DTensor is ``Shard(0)`` on, ``Replicate()`` on any others (FSDP2's, HSDP's
    placements); ValueError for other placements (naming ``name``, the tensor's key, when given)."""
    placements = tuple(tensor.placements)
    sharded = [i for i, p in enumerate(placements) if p.is_shard()]
    if len(sharded) != 1 or not placements[sharded[0]].is_shard(0) or not all(
            p.is_replicate() for i, p in enumerate(placements) if i != sharded[0]):
        raise ValueError(f"{name + ': ' if name else ''}a DTensor with placements {placements}: seqpar takes FSDP2's "
                         "(Shard(0) on one mesh dim, Replicate() on the others, as fully_shard makes them); torch's "
                         "tensor-parallel styles (parallelize_module) make others, and their parameters are not "
                         "seqpar's to gather, save or clip")
    return sharded[0]


def local_rows(tensor: torch.Tensor, name: Optional[str] = None) -> Tuple[torch.Tensor, RowChunks]:
    """(this rank's local data of ``tensor``, :class:`RowChunks`). A plain tensor is all local; a DTensor
    (FSDP2's parameters, their gradients and optimizer state) must be ``Shard(0)`` over one mesh dim and
    ``Replicate()`` over any others (FSDP2, HSDP): its local data are its ``torch.chunk`` rows on that
    dim. ValueError for other placements (naming ``name``, the tensor's key, when given)."""
    if not is_dtensor(tensor):
        whole = tensor.shape[0] if tensor.dim() else 1
        return tensor, RowChunks(((dist.get_rank() if dist.is_initialized() else 0, 0, whole),), 0, None)
    mesh_dim = fsdp_mesh_dim(tensor, name)
    with torch.no_grad():    # the local tensor itself (in-place writes reach the DTensor), not a graph node
        local = tensor.to_local()
    group = tensor.device_mesh.get_group(mesh_dim)
    ranks, index = dist.get_process_group_ranks(group), tensor.device_mesh.get_local_rank(mesh_dim)
    total = tensor.shape[0]
    per = -(-total // len(ranks))     # torch.chunk's rows per member: the last ones get fewer or none
    rows = tuple((rank, min(j * per, total), max(0, min(per, total - j * per))) for j, rank in enumerate(ranks))
    if local.shape[0] != rows[index][2]:
        raise ValueError(f"a DTensor holding {local.shape[0]} of {total} rows on shard {index} of {len(ranks)}: "
                         f"seqpar takes torch.chunk's split of Shard(0) ({rows[index][2]} rows there)")
    return local, RowChunks(rows, index, group)


@torch.no_grad()
def scatter_full(full: torch.Tensor, shard: torch.Tensor, layout: Optional[ShardLayout] = None) -> None:
    """Copy this rank's blocks of the unsharded ``full`` into ``shard``, a tensor-parallel shard laid out
    by ``layout`` (None: replicated, all of ``full``), plain or FSDP2's DTensor. Rows of padding (in no
    piece: a vocabulary table's rows past its real ones) become zero: never read, but defined. (Blocks
    are copied first: ``full`` may share memory with the shard, e.g. the model's own state dict.) A 0-dim
    tensor (a learned scalar) is copied whole."""
    if shard.dim() == 0 and not is_dtensor(shard):
        shard.copy_(full)
        return
    local, chunks = local_rows(shard)
    _, first_row, rows = chunks.rows[chunks.index]
    copied_rows = []
    for (dim, start, length), offsets, sizes in boxes(layout, shard.shape, first_row, rows):
        block = full
        for d, (offset, size) in enumerate(zip(offsets, sizes)):
            block = block.narrow(d, offset, size)
        local.narrow(dim, start, length).copy_(block)
        copied_rows.append((start, start + length) if dim == 0 else (0, rows))
    end = 0
    for start, stop in sorted(copied_rows) + [(rows, rows)]:
        if start > end:
            local.narrow(0, end, start - end).zero_()
        end = max(end, stop)


@torch.no_grad()
def gather_full(shard: torch.Tensor, layout_of_rank: Optional[Callable[[int], ShardLayout]] = None,
                group: ProcessGroup = None) -> torch.Tensor:
    """The unsharded tensor, a new one, from every rank's ``shard`` (equal shapes on every rank; a
    collective under TP and under FSDP2: call it on every rank), each placed by ``layout_of_rank(r)``
    (None: a replicated tensor). An FSDP2 DTensor is first gathered over its data-parallel ranks."""
    if is_dtensor(shard):
        local_rows(shard)                  # ValueError for placements other than FSDP2's
        shard = shard.full_tensor()
    if layout_of_rank is None:
        return shard.detach().clone()
    t = group_size(group)
    shards = [shard]
    if t > 1:
        shards = [torch.empty_like(shard) for _ in range(t)]
        dist.all_gather(shards, shard.contiguous(), group=group)
    full = shard.new_empty(layout_of_rank(0).full_shape)
    for r, part in enumerate(shards):
        layout = layout_of_rank(r)
        for piece in layout.pieces:
            layout.full_view(full, piece).copy_(layout.local_view(part, piece))
    return full


@torch.no_grad()
def load_full_parameters(module: nn.Module, full: Mapping[str, torch.Tensor]) -> None:
    """Keep this rank's part of each unsharded tensor in ``full`` (parameter name of ``module`` -> value):
    its shard of a split parameter (:class:`ShardedParameters`), all of a replicated one; plain or
    FSDP2 parameters alike (:func:`scatter_full`). ValueError, before anything is copied, for a value
    that is not a real floating tensor of the parameter's unsharded shape (a larger one was cut to fit; an
    integer or bool one was cast silently, as check_shapes refuses for whole state dicts)."""
    require_own_parameters(module, full, f"{type(module).__name__}: loading unsharded parameters")
    layouts = module.shard_layouts(group_rank(module.tp_group)) if isinstance(module, ShardedParameters) else {}
    for name, value in full.items():
        expected = tuple(layouts[name].full_shape) if name in layouts else tuple(getattr(module, name).shape)
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != expected or not value.is_floating_point():
            got = f"{value.dtype} {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(f"{type(module).__name__}.{name} must be an unsharded floating tensor of shape "
                             f"{expected}, got {got}")
    for name, value in full.items():
        scatter_full(value, getattr(module, name), layouts.get(name))


_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


def check_intact_parts(root: nn.Module, part_classes: Mapping[str, type], what: str) -> Dict[str, nn.Module]:
    """The parts seqpar built in ``root`` that are still its own: {key prefix: module} of ``part_classes``
    ({key prefix: the class seqpar built there}) whose module is still of that class. A part the user
    removed, or replaced by another kind of module (an MoE MLP, another norm, nn.Identity), is left out: the
    unsharded state dicts carry the replacement's parameters as they are (:func:`unsharded_entries`).
    checkpoint_wrapper and torch.compile around a part are seen through (the keys leave them out too).
    ValueError (``what``: the operation) for a part wrapped after seqpar built it (a module, not a
    container, with one instance of the class among its children: an adapter library such as PEFT) or
    reparametrized (its weight or bias not its own parameter: ``torch.nn.utils.parametrize`` /
    ``weight_norm`` / ``prune``), where a load copied into a computed tensor (silently dropped) and a read
    renamed the key (:func:`require_own_parameters`)."""
    parts = {}
    for prefix, cls in part_classes.items():
        module = root
        for attr in prefix.split("."):
            module = _without_wrappers(getattr(module, attr, None))
        if not isinstance(module, nn.Module):
            continue
        if not isinstance(module, cls):
            wrapped = [child for child in module.children() if isinstance(child, cls)]
            if len(wrapped) == 1 and not isinstance(module, _CONTAINERS):
                require_own_parameters(module, ["weight"], what, prefix)   # the wrapper doesn't hold it: raises
            continue
        require_own_parameters(module, [name for name in ("weight", "bias") if getattr(module, name, None) is not None],
                               what, prefix)
        parts[prefix] = module
    return parts


def reset_modules(modules: Iterable[nn.Module]) -> None:
    """``reset_parameters()`` of each of ``modules`` that has one, else of its children, recursively:
    seqpar's parts draw their seeded init, a module of the user's its own (torch's as nn.Linear's)."""
    for module in modules:
        reset = getattr(module, "reset_parameters", None)
        if callable(reset):
            reset()
        else:
            reset_modules(module.children())


def require_own_parameters(module: nn.Module, names: Iterable[str], what: str, prefix: str = "",
                           instead: str = ", or save with state_dict()") -> None:
    """ValueError (``what``: the operation; ``instead``: what else the user can do, ending the message)
    unless each of ``names`` is a parameter of ``module`` itself (``prefix``: the module's name in the
    message). The unsharded reads and writes go through a module's own parameters: a module wrapped after
    seqpar built it (an adapter library such as PEFT) or reparametrized (``torch.nn.utils.parametrize``,
    ``weight_norm``, ``prune``) holds them elsewhere, where a load copied into a computed tensor (silently
    dropped) and a read missed the key."""
    own = dict(module.named_parameters(recurse=False))
    for name in names:
        if name not in own:
            key, where = (f"{prefix}.{name}", f"{prefix} ({type(module).__name__})") if prefix else \
                (name, type(module).__name__)
            raise ValueError(f"{what}: {key} is not a parameter of {where} itself: the module was wrapped or "
                             "reparametrized after seqpar built it (an adapter library such as PEFT, "
                             "torch.nn.utils.parametrize / weight_norm / prune). Merge or remove that first (PEFT: "
                             f"merge_and_unload(); parametrize.remove_parametrizations; prune.remove){instead}")


def unsharded_entries(module: nn.Module) -> List[Tuple[str, nn.Parameter, "_Split"]]:
    """(key, parameter, how it is split) of every parameter of ``module``, keyed as ``state_dict()`` keys
    them without wrapper names (checkpoint_wrapper, torch.compile): seqpar's parts and any a subclass or a
    replaced module added (split by their module's layouts if it is a seqpar parallel module, else
    replicated). A module or parameter at two places (one layer at two depths) is keyed at each."""
    return list(_parameters_with_layouts(module, remove_duplicate=False))


def unsharded_shapes(entries: Sequence[Tuple[str, nn.Parameter, "_Split"]]) -> Dict[str, Tuple[int, ...]]:
    """{key: unsharded shape} of ``entries`` (:func:`unsharded_entries`): a split parameter's whole tensor's
    (a vocabulary table's real rows), a replicated one's own (under FSDP2 its global shape)."""
    return {key: tuple(split.layout.full_shape) if split.layout is not None else tuple(param.shape)
            for key, param, split in entries}


@torch.no_grad()
def gather_unsharded(entries: Sequence[Tuple[str, nn.Parameter, "_Split"]], group: ProcessGroup, what: str
                     ) -> Dict[str, torch.Tensor]:
    """{key: the unsharded value, a new tensor} of ``entries`` (:func:`gather_full`: a collective under TP
    and FSDP2, call it on every rank). The replicated ones must be equal on every rank of the
    tensor-parallel ``group``, else ValueError on every rank naming them (each hashed on the host, then
    one small all-gather of the hashes): a parameter of the user's outside seqpar's modules is replicated, and under sequence
    parallelism each rank's gradient covers its shard of the sequence only, so it drifts apart unless
    the forward passes it through ``copy_to_tensor_region`` as seqpar's norms do; one rank's copy was
    returned silently."""
    full = {key: gather_full(param, split.layout_of_rank, split.group) for key, param, split in entries}
    if group_size(group) > 1:
        replicated = {key: full[key].reshape(-1).view(torch.uint8).cpu().numpy().tobytes()
                      for key, _, split in entries if split.layout is None}
        check_ranks_agree(group, replicated, what=f"{what}: the replicated parameters",
                          device=entries[0][1].device if entries else None,
                          hint="A parameter outside seqpar's parallel modules (a subclass's, a replaced part's) is "
                               "replicated over the tensor-parallel ranks and must stay equal on every rank: under "
                               "sequence parallelism pass it through seqpar.parallel.mappings.copy_to_tensor_region("
                               "param, tp_group) in the forward (its gradient is then summed over the ranks), as "
                               "seqpar's norms do")
    return full


@torch.no_grad()
def scatter_unsharded(entries: Sequence[Tuple[str, nn.Parameter, "_Split"]],
                      state_dict: Mapping[str, torch.Tensor]) -> None:
    """Each of ``entries`` whose key ``state_dict`` holds keeps this rank's part of that unsharded value
    (:func:`scatter_full`; other floating dtypes and devices are copied in). Checked first by the caller
    (:func:`check_loadable` against :func:`unsharded_shapes`)."""
    for key, param, split in entries:
        if key in state_dict:
            scatter_full(state_dict[key], param, split.layout)


@torch.no_grad()
def full_parameters(module: nn.Module) -> Dict[str, torch.Tensor]:
    """{name: the unsharded value, a new tensor} of each parameter of ``module`` itself (not its
    submodules'); a collective under TP and FSDP2 (:func:`gather_full`): call it on every rank."""
    split = isinstance(module, ShardedParameters)
    return {name: gather_full(param, module.layout_of_rank(name) if split else None, getattr(module, "tp_group", None))
            for name, param in module.named_parameters(recurse=False)}


class ShardedParameters:
    """Mixin of the modules whose parameters are split over their ``tp_group``. :meth:`shard_layouts`
    names each split parameter's :class:`ShardLayout` on a rank; the parameters it doesn't name are
    replicated (the same on every rank). Loading and gathering unsharded weights and the sharded state
    dicts all read these layouts."""

    tp_group: ProcessGroup

    def shard_layouts(self, rank: int) -> Dict[str, ShardLayout]:
        """{parameter name: its layout on ``rank`` of ``tp_group``}, split parameters only."""
        raise NotImplementedError

    def layout_of_rank(self, name: str) -> Optional[Callable[[int], ShardLayout]]:
        """``rank -> layout of parameter name on that rank``; None for a replicated parameter. (Layouts
        follow from the module's shapes and group, fixed at construction: kept once made, since every
        clip_grad_norm_ step reads them.)"""
        cache = self.__dict__.setdefault("_shard_layouts_by_rank", {})

        def layouts(rank: int) -> Dict[str, ShardLayout]:
            if rank not in cache:
                cache[rank] = self.shard_layouts(rank)
            return cache[rank]
        if name not in layouts(0):
            return None
        return lambda rank: layouts(rank)[name]

    @torch.no_grad()
    def _load_full_parameters(self, full: Mapping[str, Optional[torch.Tensor]]) -> None:
        """Keep this rank's shard of each unsharded tensor in ``full`` (by parameter name; None: no such
        parameter); replicated parameters take the whole tensor."""
        for name, value in full.items():
            param = getattr(self, name)
            if param is None or value is None:
                if param is not value:
                    raise ValueError(f"{type(self).__name__} {'has no' if param is None else 'needs a'} {name}, "
                                     f"got {'one' if param is None else 'None'}")
        load_full_parameters(self, {name: value for name, value in full.items() if value is not None})


def _unwrapped(module: nn.Module) -> nn.Module:
    """``module`` without the outer wrappers whose parameters are their inner module's: DDP (``.module``)
    and torch.compile's OptimizedModule (``._orig_mod``), in any order (compile(DDP(model)) included)."""
    while True:
        inner = (module.module if isinstance(module, nn.parallel.DistributedDataParallel)
                 else getattr(module, "_orig_mod", None))
        if not isinstance(inner, nn.Module):
            return module
        module = inner


# Wrappers that add a name to the path but no parameters: activation checkpointing's checkpoint_wrapper
# and torch.compile's OptimizedModule. Keys leave them out, as full_state_dict() does (wrapped or not, a
# model saves and loads the same keys).
_WRAPPER_NAMES = ("_checkpoint_wrapped_module", "_orig_mod")


def _without_wrappers(module):
    """``module`` inside any checkpoint_wrapper / torch.compile wrappers (anything else as it is)."""
    while isinstance(module, nn.Module):
        inner = next((module._modules[name] for name in _WRAPPER_NAMES if name in module._modules), None)
        if inner is None:
            return module
        module = inner
    return module


@dataclasses.dataclass(frozen=True)
class _Split:
    """How a parameter is split over tensor parallelism: its ``group`` and ``layout_of_rank`` (None for a
    replicated parameter, or a split one at t = 1: then every rank holds the whole of it)."""

    group: ProcessGroup
    layout_of_rank: Optional[Callable[[int], ShardLayout]]
    layout: Optional[ShardLayout]      # this rank's


def _parameters_with_layouts(module: nn.Module, remove_duplicate: bool = True
                             ) -> Iterator[Tuple[str, nn.Parameter, _Split]]:
    """(key, parameter, its :class:`_Split`) for every parameter of ``module``, keyed as
    ``named_parameters()`` without the wrappers' names (a parameter shared by two modules once, unless
    ``remove_duplicate`` is False: then at each of its keys)."""
    seen = set()
    for prefix, sub in _unwrapped(module).named_modules(remove_duplicate=remove_duplicate):
        for name, param in sub.named_parameters(recurse=False, remove_duplicate=remove_duplicate):
            if remove_duplicate and id(param) in seen:
                continue
            seen.add(id(param))
            key = ".".join(part for part in f"{prefix}.{name}".split(".") if part and part not in _WRAPPER_NAMES)
            layout_of_rank = sub.layout_of_rank(name) if isinstance(sub, ShardedParameters) else None
            group = sub.tp_group if layout_of_rank is not None else None
            layout = layout_of_rank(group_rank(group)) if layout_of_rank is not None else None
            yield key, param, _Split(group, layout_of_rank, layout)


def on_meta(module: nn.Module) -> bool:
    """True when every parameter of ``module`` is on the meta device (and it has some): built on meta, not
    materialised yet."""
    flags = [p.is_meta for p in module.parameters()]
    return bool(flags) and all(flags)


def check_not_meta(module: nn.Module, what: str) -> None:
    """ValueError naming the first parameter of ``module`` on the meta device (``what``: the operation)."""
    meta = next((key for key, p in module.named_parameters() if p.is_meta), None)
    if meta is not None:
        raise ValueError(f"{what}: parameter {meta} is on the meta device (no data to save or load into): "
                         "call module.to_empty(device=...) first")


# {tensor-parallel group: {this rank's FSDP2 shard ranks (() without FSDP2): those of each TP rank}}
PeerShardRanks = Dict[object, Dict[Tuple[int, ...], List[Tuple[int, ...]]]]
_CHECKED_LAYOUTS: "weakref.WeakKeyDictionary[nn.Module, tuple]" = weakref.WeakKeyDictionary()


class _FSDPUnitMeta(type):
    # Without importing FSDP2 (0.6 s of seqpar's import, DTensor and sympy with it): a module is an FSDP2
    # unit only once fully_shard made it one, which imported torch.distributed.fsdp.
    def __instancecheck__(cls, obj) -> bool:
        fsdp = sys.modules.get("torch.distributed.fsdp")
        return fsdp is not None and isinstance(obj, fsdp.FSDPModule)

    def __subclasscheck__(cls, sub) -> bool:   # what torch.compile asks of a module's isinstance
        fsdp = sys.modules.get("torch.distributed.fsdp")
        return fsdp is not None and issubclass(sub, fsdp.FSDPModule)


class FSDPUnit(metaclass=_FSDPUnitMeta):
    """For isinstance only: torch's ``FSDPModule`` (``fully_shard`` makes a module an instance)."""


#: The classes of FSDP2 units, for isinstance: () in a torch built without distributed.
FSDP_UNIT: tuple = (FSDPUnit,) if dist.is_available() else ()


def _reshard_fsdp(module: nn.Module) -> None:
    """Reshard every FSDP2 module in ``module``: a forward without a backward leaves the root's parameters
    unsharded, plain tensors that are FSDP2's temporary copies (not the optimizer's parameters); torch's
    own state_dict() reshards first through a hook, and so does every seqpar entry that reads or writes
    parameters. A no-op where nothing is unsharded."""
    for sub in module.modules():
        if isinstance(sub, FSDP_UNIT):
            sub.reshard()


class PreparedParameters(NamedTuple):
    """:func:`prepare_parameters`' result: ``entries``, (key, parameter, :class:`_Split`) for every
    parameter of the module (:func:`_parameters_with_layouts`, after resharding), and ``peers``, the TP
    ranks' FSDP2 shard groups (:data:`PeerShardRanks`)."""

    entries: List[Tuple[str, nn.Parameter, "_Split"]]
    peers: PeerShardRanks

    def data_parallel_groups(self) -> List[ProcessGroup]:
        """The distinct FSDP2 shard groups of the parameters, in their order (none without FSDP2)."""
        groups = (local_rows(param)[1].group for _, param, _ in self.entries)
        return list(dict.fromkeys(group for group in groups if group is not None))


def prepare_parameters(module: nn.Module, what: str) -> PreparedParameters:
    """Ready ``module``'s parameters for a seqpar read or write of their shards: FSDP2 modules resharded
    (:func:`_reshard_fsdp`), and, under tensor parallelism, every TP rank's FSDP2 shard group of every
    split parameter, checked to form a grid: FSDP2 on all TP ranks of a parameter or none, over groups
    of one size that share no rank (a FSDP2 mesh that spans TP ranks cuts different shards as one
    tensor). One small all-gather per TP group (call it on every rank), then cached while this rank's
    groups stay the same. ValueError, on every rank, naming the first parameter that breaks the grid."""
    _reshard_fsdp(module)
    _require_split_parameters_own(module, what)
    entries = list(_parameters_with_layouts(module))
    mine: Dict[object, List[Tuple[str, Tuple[int, ...]]]] = {}
    for key, param, split in entries:
        if is_dtensor(param):
            fsdp_mesh_dim(param, key)               # a ValueError naming a parameter of other placements
        if split.layout is not None and group_size(split.group) > 1:
            _, chunks = local_rows(param)
            mine.setdefault(split.group, []).append(
                (key, tuple(rank for rank, _, _ in chunks.rows) if chunks.group is not None else ()))
    signature = tuple((id(group), tuple(ranks for _, ranks in split_keys)) for group, split_keys in mine.items())
    cached = _CHECKED_LAYOUTS.get(module)
    if cached is not None and cached[0] == signature:
        return PreparedParameters(entries, cached[1])
    peers: PeerShardRanks = {}
    for group, split_keys in mine.items():
        distinct = list(dict.fromkeys(ranks for _, ranks in split_keys))
        with outside_dispatch_modes():   # pickled into real tensors, under FakeTensorMode too
            gathered = all_gather_objects((distinct, [distinct.index(ranks) for _, ranks in split_keys]), group,
                                          device=entries[0][1].device)
        per_rank = [[groups[index] for index in indices] for groups, indices in gathered]   # [tp rank][param]
        problem = _grid_problem([key for key, _ in split_keys], per_rank)
        if problem:
            raise ValueError(f"{what}: {problem}")
        peers[group] = {ranks: [theirs[i] for theirs in per_rank] for i, (_, ranks) in enumerate(split_keys)}
    _CHECKED_LAYOUTS[module] = (signature, peers)
    return PreparedParameters(entries, peers)


def _require_split_parameters_own(module: nn.Module, what: str) -> None:
    """ValueError (``what``: the operation) for a split parameter under tensor parallelism that is not its
    module's own (:func:`require_own_parameters`). Reparametrized (parametrize, weight_norm, prune), its
    shard lives under another name (``parametrizations.weight.original``, ``weight_g`` / ``weight_v``,
    ``weight_orig``) that has no layout, so it was taken as replicated: clip_grad_norm_ gave every rank
    another norm, and sharded_state_dict saved one rank's shard for all. At t = 1 nothing is split."""
    for prefix, sub in _unwrapped(module).named_modules():
        if isinstance(sub, ShardedParameters) and group_size(sub.tp_group) > 1:
            key = ".".join(part for part in prefix.split(".") if part not in _WRAPPER_NAMES)
            require_own_parameters(sub, sub.shard_layouts(0), what, key, instead="")


def _grid_problem(keys: List[str], per_rank: List[List[Tuple[int, ...]]]) -> Optional[str]:
    """What keeps the TP ranks' FSDP2 shard groups (``per_rank[tp rank][parameter]``) from a grid, or None."""
    if len({len(groups) for groups in per_rank}) != 1:
        return (f"the tensor-parallel ranks hold different numbers of split parameters "
                f"({[len(groups) for groups in per_rank]}): build the same model on every rank")
    for i, key in enumerate(keys):
        groups = [theirs[i] for theirs in per_rank]
        sharded = [r for r, ranks in enumerate(groups) if ranks]
        if sharded and len(sharded) != len(groups):
            return (f"{key} is sharded by FSDP2 on tensor-parallel ranks {sharded} only: apply fully_shard alike "
                    "on every rank")
        if len({len(ranks) for ranks in groups}) != 1:
            return (f"{key}'s FSDP2 shard groups differ in size across the tensor-parallel ranks "
                    f"({[list(ranks) for ranks in groups]}): use one data-parallel mesh shape on every rank")
        members = [rank for ranks in groups for rank in ranks]
        if len(members) != len(set(members)):
            return (f"{key}'s FSDP2 shard groups overlap across the tensor-parallel ranks "
                    f"({[list(ranks) for ranks in groups]}): FSDP2 must shard over data-parallel ranks only "
                    "(a mesh dim holding no two ranks of one tensor-parallel group), or it cuts different "
                    "shards as one tensor")
    return None


class _ShardedTensors:
    """Makes the values of one sharded state dict. A tensor split over tensor parallelism or FSDP2
    becomes a ShardedTensor of the unsharded shape: its local shards are views of this rank's blocks,
    its metadata lists every rank's blocks (one copy of each: a data-parallel replica's own copies are
    its own ShardedTensor's), so DCP saves each block once and loads in place.

    Every rank's blocks are computed here, from every tensor-parallel rank's layout and FSDP2's row
    chunks (``peers``: :func:`prepare_parameters`), so no ShardedTensor needs a collective of its own
    (torch's public ``init_from_local_shards`` all-gathers the blocks of every tensor, and over one
    process group, which tensor parallelism x FSDP2 blocks are not).
    """

    def __init__(self, peers: PeerShardRanks):
        self._peer_ranks = peers

    def __call__(self, tensor: torch.Tensor, split: _Split):
        """``tensor`` (a parameter, or optimizer state of its shape) as a state-dict value: a plain tensor
        when this rank holds all of it (replicated, or t = 1 without FSDP2: the one piece, a view), else a
        ShardedTensor."""
        local, chunks = local_rows(tensor)
        split_over_tp = split.layout is not None and group_size(split.group) > 1
        if chunks.group is None and not split_over_tp:
            if split.layout is None:
                return tensor
            ((where, _, _),) = boxes(split.layout, tensor.shape, 0, tensor.shape[0])
            return local.narrow(*where)
        # DTensor's Shard splits evenly: it can express neither fused QKV's three pieces per rank nor the
        # vocabulary's real rows, so DCP takes these pieces as a ShardedTensor.
        from torch.distributed._shard.metadata import ShardMetadata
        from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
        from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties

        full_shape = split.layout.full_shape if split.layout is not None else tuple(tensor.shape)
        my_shard_ranks = tuple(rank for rank, _, _ in chunks.rows)
        if split_over_tp:      # every tensor-parallel rank's layout and FSDP2 shard group
            t = group_size(split.group)
            ranks_of = (self._peer_ranks[split.group][my_shard_ranks] if chunks.group is not None
                        else [(dist.get_global_rank(split.group, r),) for r in range(t)])
            holders = [(split.layout_of_rank(r), ranks_of[r]) for r in range(t)]
        else:                  # replicated over tensor parallelism: this rank's FSDP2 shard group
            holders = [(split.layout, my_shard_ranks)]
        me, metadata, local_shards = dist.get_rank(), [], []
        for layout, ranks in holders:
            for rank, (_, first_row, rows) in zip(ranks, chunks.rows):
                # A rank without blocks (a vocabulary shard of padding only) offers an empty one at the end
                # of dim 0: DCP's load drops a ShardedTensor without local shards from its key set, takes
                # the missing key for a pre-2.4 checkpoint and then fails on every other nested key.
                held = boxes(layout, tensor.shape, first_row, rows) or [
                    ((0, 0, 0), [full_shape[0]] + [0] * (len(full_shape) - 1), [0] + list(full_shape[1:]))]
                for where, offsets, sizes in held:
                    # The global rank, whatever the group; another rank's device index isn't known here.
                    placement = f"rank:{rank}/{local.device if rank == me else local.device.type}"
                    shard_metadata = ShardMetadata(offsets, sizes, placement)
                    metadata.append(shard_metadata)
                    if rank == me:
                        local_shards.append(Shard(local.narrow(*where), shard_metadata))
        properties = TensorProperties(dtype=tensor.dtype, requires_grad=False)
        return ShardedTensor._init_from_local_shards_and_global_metadata(
            local_shards, ShardedTensorMetadata(metadata, torch.Size(full_shape), properties),
            process_group=dist.group.WORLD)


def sharded_state_dict(module: nn.Module) -> Dict[str, torch.Tensor]:
    """This rank's parameters of ``module`` (the model, or a layer) for torch.distributed.checkpoint,
    keyed as ``full_state_dict()`` (and ``named_parameters()`` without the names activation
    checkpointing's ``checkpoint_wrapper`` and ``torch.compile`` add), every value a view of the
    parameter (no copy):

    * a split parameter (tensor-parallel linear weights and column-parallel biases, the vocabulary
      tables): a ShardedTensor of the UNSHARDED shape whose local pieces are this rank's parts of it,
      each with its offset (fused QKV: its rows of the Q, K and V blocks; SwiGLU's fc1: of gate and up;
      a vocabulary table: its real rows, not the padding);
    * a replicated parameter (norms, position table, row-parallel biases): the parameter's data.

    ``dcp.save(sharded_state_dict(model), checkpoint_id=path)`` on every rank writes each piece once;
    ``dcp.load(sharded_state_dict(model), checkpoint_id=path)`` loads a checkpoint saved at any
    tensor-parallel size into the parameters in place. On one rank every value is a plain tensor, the
    vocabulary tables their real rows. ValueError for parameters on the meta device.

    Under FSDP2 (``fully_shard`` over the data-parallel ranks; HSDP too) every parameter is a ShardedTensor
    of this rank's blocks in its row chunk (replicated ones too), so a checkpoint moves between any
    tensor-parallel and FSDP2 sizes, or none. No collective per tensor; under TP, the first call for a
    model (or after its FSDP2 groups change) makes one small all-gather per tensor-parallel group
    (:func:`prepare_parameters`): call it on every rank.

    DCP's load warns that ShardedTensor is deprecated in favour of DTensor (its own code reads the
    ShardedTensor's device). DTensor can't express these pieces; the warning changes nothing. Save with
    ``dcp.save``: ``dcp.async_save``'s staging copy reads ``data_ptr()``, which a ShardedTensor refuses (a
    RuntimeError under TP / FSDP2, before anything is written).
    """
    check_not_meta(module, "sharded_state_dict")
    entries, peers = prepare_parameters(module, "sharded_state_dict")
    sharded = _ShardedTensors(peers)
    return {key: sharded(param.detach(), split) for key, param, split in entries}


@torch.no_grad()
def _created_optimizer_state(optimizer: torch.optim.Optimizer, params: List[nn.Parameter]) -> Dict[nn.Parameter, dict]:
    """The state the optimizer's own step would create for ``params`` (which have none), made by one step
    over them alone with zero gradients at learning rate 0, then taken out of the optimizer again: it
    changes no parameter, no other parameter's state, and leaves ``params`` without state. (Its values
    are placeholders for a load: some optimizers derive state from lr, e.g. Rprop's step sizes.) The step
    is the optimizer class's own, without the step hooks torch.optim wraps around it and without an LR
    scheduler's wrapper of the instance's step: an EMA hook or a scheduler's count must not see it."""
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
    step = type(optimizer).step
    try:
        getattr(step, "__wrapped__", step)(optimizer)
    finally:
        for group, members, lr in zip(optimizer.param_groups, groups, rates):
            group["params"], group["lr"] = members, lr
        for param, grad in grads.items():
            param.grad = grad
    return {p: optimizer.state.pop(p) for p in params if p in optimizer.state}


def _optimizer_keys(prepared: PreparedParameters, optimizer: torch.optim.Optimizer, what: str):
    """{id(param): (key, split)} over the module's parameters, checked to hold every parameter the
    optimizer updates."""
    info = {id(param): (key, split) for key, param, split in prepared.entries}
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

    A state tensor of its parameter's shard shape (Adam's ``exp_avg`` / ``exp_avg_sq``, SGD's momentum) is
    split like the parameter (a ShardedTensor of the unsharded shape under TP or FSDP2); a 0-d one (``step``)
    and, without FSDP2, the state of replicated parameters are plain tensors. Every tensor is the optimizer's
    own (a view: DCP loads in place). A trainable parameter without state (a fresh optimizer before a load; a
    parameter not stepped yet) gets placeholder tensors made by the optimizer's own step over it alone (zero
    gradients, learning rate 0) but kept out of the optimizer, and ``has_state`` 0: saving changes nothing,
    and a resumed run leaves that parameter without state as the saving run had it.
    ValueError, before anything is made, for a parameter the module doesn't hold, for state that is not a
    tensor or has another shape (it could not be resharded), and for parameters on the meta device.

    Save: ``dcp.save({"model": sharded_state_dict(model), "optim": sharded_optimizer_state_dict(model,
    opt)}, checkpoint_id=path)``. Resume (any t): build the same two dicts, ``dcp.load`` them, then
    :func:`load_sharded_optimizer_state_dict` (required: it attaches the state loaded for parameters
    that had none and sets the hyperparameters).
    """
    what = "sharded_optimizer_state_dict"
    check_not_meta(module, what)
    prepared = prepare_parameters(module, what)
    info = _optimizer_keys(prepared, optimizer, what)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    created = _created_optimizer_state(optimizer, [p for p in params if p.requires_grad and not optimizer.state.get(p)])
    for param in params:   # the state made for a fresh optimizer too: Adafactor's factored moments are not
        for name, value in (optimizer.state.get(param) or created.get(param, {})).items():
            if not isinstance(value, torch.Tensor) or (value.dim() and value.shape != param.shape):
                got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                raise ValueError(f"{what}: optimizer state {name!r} of {info[id(param)][0]} must be a tensor of "
                                 f"the parameter's shape {tuple(param.shape)} or a 0-d tensor to be resharded, "
                                 f"got {got}")
    entries, has_state = [], {}
    for param in params:
        key, split = info[id(param)]
        own = optimizer.state.get(param)
        entries += [(key, name, value, split) for name, value in (own or created.get(param, {})).items()]
        has_state[key] = torch.tensor(int(bool(own)))
    # A 0-d tensor (Adam's step) is the same on every rank; the others are split like their parameter.
    sharded = _ShardedTensors(prepared.peers)
    state = {info[id(param)][0]: {} for param in params}
    for key, name, value, split in entries:
        state[key][name] = sharded(value, split) if value.dim() else value
    groups = [{**{k: v for k, v in group.items() if k != "params"}, "params": [info[id(p)][0] for p in group["params"]]}
              for group in optimizer.param_groups]
    out = _OptimizerStateDict(state=state, has_state=has_state, param_groups=groups)
    out.created = created
    return out


# Optimizer flags that choose how the step runs, not which state it keeps: they may differ on resume.
_IMPLEMENTATION_FLAGS = frozenset({"foreach", "fused", "capturable", "differentiable"})


def load_sharded_optimizer_state_dict(module: nn.Module, optimizer: torch.optim.Optimizer,
                                      state_dict: Mapping[str, object]) -> None:
    """After ``dcp.load`` into ``state_dict``, the dict ``sharded_optimizer_state_dict(module, optimizer)``
    returned (DCP loaded its state tensors in place; ``module``: the model whose parameters ``optimizer``
    steps, which names them): give each parameter the state the checkpoint had for it (the loaded
    placeholders where the optimizer had none; none where the checkpoint had none) and set each param
    group's hyperparameters (``lr``, ``betas``, ...) to the loaded ones. ValueError, before
    anything is set, if the loaded groups do not hold the optimizer's parameters in its order, an
    algorithm flag differs (``amsgrad``, ``centered``, ``nesterov``, ``maximize``, ...; not the
    implementation's ``foreach`` / ``fused`` / ``capturable`` / ``differentiable``), or the dict is not
    one :func:`sharded_optimizer_state_dict` made."""
    what = "load_sharded_optimizer_state_dict"
    info = _optimizer_keys(prepare_parameters(module, what), optimizer, what)
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
    # An algorithm flag that differs: DCP loaded only the state this optimizer has, so taking the
    # checkpoint's amsgrad left the groups asking for a max_exp_avg_sq nobody loaded (a KeyError at the
    # next step), and keeping this one would drop the checkpoint's. How the step runs may differ.
    for i, (group, saved) in enumerate(zip(optimizer.param_groups, loaded)):
        differ = sorted(k for k, v in saved.items() if isinstance(v, bool) and k not in _IMPLEMENTATION_FLAGS
                        and k in group and group[k] != v)
        if differ:
            raise ValueError(f"{what}: param group {i} has {', '.join(f'{k}={group[k]}' for k in differ)} where the "
                             f"checkpoint's had {', '.join(f'{k}={saved[k]}' for k in differ)}: build the "
                             "optimizer as the checkpoint's was")
    for param in (p for group in optimizer.param_groups for p in group["params"]):
        if int(has_state[info[id(param)][0]]):
            if not optimizer.state.get(param) and param in created:   # (a frozen parameter has none made)
                optimizer.state[param] = created[param]
        else:
            optimizer.state.pop(param, None)
    for group, saved in zip(optimizer.param_groups, loaded):
        group.update({k: v for k, v in saved.items() if k != "params"})


class IncompatibleKeys(NamedTuple):
    """What a ``load_full_state_dict`` did not load, as ``nn.Module.load_state_dict`` returns it: the
    model's keys the dict lacks, and the dict's keys the model lacks (both empty when ``strict``)."""

    missing_keys: List[str]
    unexpected_keys: List[str]


def check_shapes(state_dict: Mapping[str, object], shapes: Mapping[str, Tuple[int, ...]], *,
                 what: str = "state dict", config: str = "", strict: bool = True,
                 shape_hints: Optional[Mapping[str, str]] = None) -> IncompatibleKeys:
    """ValueError unless ``state_dict`` has exactly the keys of ``shapes`` (the shapes the model's config
    implies), each a real-floating tensor with data (not bool, integer, complex or meta) of that shape.
    Any floating dtype passes: loaders cast it to the parameters' dtype. With ``strict=False`` keys may
    be missing or unexpected (returned; the keys both hold are checked).

    ``what`` names the dict in the messages ("GPT-2 state dict"); ``config`` names the setting that
    decides the keys ("n_layer=2") in the key-mismatch message; shape and dtype messages name the key,
    the expected and the given shape or dtype, then ``shape_hints[key]`` where given.
    """
    if not isinstance(state_dict, Mapping):
        raise ValueError(f"{what} must be a mapping of names to tensors, got {type(state_dict).__name__}")
    missing, unexpected = sorted(set(shapes) - set(state_dict)), sorted(set(state_dict) - set(shapes))
    if strict and (missing or unexpected):
        against = f" the config ({config})" if config else " the model"
        raise ValueError(f"{what} keys do not match{against}: missing {missing}, unexpected {unexpected}")
    for key, shape in shapes.items():
        if key not in state_dict:
            continue
        value = state_dict[key]
        if _is_distributed_tensor(value):
            raise ValueError(f"{what} {key} is a {type(value).__name__} (a sharded tensor): pass the full tensors "
                             "(full_state_dict()), or load a sharded state dict with torch.distributed.checkpoint")
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(shape):
            got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            hint = (shape_hints or {}).get(key)
            raise ValueError(f"{what} {key} must have shape {tuple(shape)} for this config, got {got}"
                             + (f": {hint}" if hint else ""))
        # Checked here, before any copy: copy_ would cast a bool / int silently, drop a complex value's
        # imaginary part with a warning, and fail on a meta tensor after earlier keys were overwritten.
        if not value.is_floating_point() or value.is_meta:
            got = "a meta tensor (no data)" if value.is_meta else str(value.dtype)
            raise ValueError(f"{what} {key} must be a floating-point tensor with data, got {got}")
    return IncompatibleKeys(missing, unexpected)


def _is_distributed_tensor(value) -> bool:
    """A DTensor (FSDP2's state_dict values) or a ShardedTensor: its shape is the global one, its data a
    shard, so it passes a shape check and then fails (or copies one shard) in copy_."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.tensor import DTensor

    return isinstance(value, (DTensor, ShardedTensor))


def check_loadable(state_dict: Mapping[str, object], shapes: Mapping[str, Tuple[int, ...]], group, *,
                   what: str, device: Optional[torch.device] = None, strict: bool = True,
                   data_parallel_groups: Sequence[ProcessGroup] = (),
                   shape_hints: Optional[Mapping[str, str]] = None) -> IncompatibleKeys:
    """:func:`check_shapes` on every rank of the tensor-parallel ``group``, a failure on any rank a
    ValueError on every rank (:func:`seqpar.parallel.state.check_ranks_agree`, one tiny all-gather):
    a rank whose dict is wrong must not leave the others loading theirs and then waiting for it in the
    next collective. Under FSDP2 the ranks of each of ``data_parallel_groups`` (the model's FSDP2 shard
    groups: they hold other rows of the same tensors) agree too, after the TP group, so a failure
    anywhere in the TP x FSDP2 grid stops every rank of it. (That every rank passes the same values is
    the caller's contract, not checked: comparing them would hash every weight.) ``device``, where the
    target's parameters live (None: not checked), must not be meta: copying into meta parameters does
    nothing, and nothing would say so. Returns check_shapes' keys not to load (``strict=False``)."""
    def check() -> IncompatibleKeys:
        if device is not None and device.type == "meta":
            raise ValueError(f"{what}: the parameters are on the meta device, where loading copies nothing: "
                             "call module.to_empty(device=...) first")
        return check_shapes(state_dict, shapes, what=f"{what}: state dict", strict=strict, shape_hints=shape_hints)

    return run_agreed(check, (group, *data_parallel_groups), what=what, device=device)


__all__ = ["ShardLayout", "ShardedParameters", "RowChunks", "boxes", "local_rows", "scatter_full", "gather_full",
           "load_full_parameters", "full_parameters", "sharded_state_dict", "sharded_optimizer_state_dict",
           "load_sharded_optimizer_state_dict", "IncompatibleKeys", "PreparedParameters", "prepare_parameters",
           "check_shapes", "check_loadable", "check_intact_parts", "check_not_meta", "on_meta", "reset_modules",
           "unsharded_entries", "unsharded_shapes",
           "gather_unsharded", "scatter_unsharded"]
