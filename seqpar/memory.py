"""Activation memory: the paper's per-layer formulas and a meter of what autograd really keeps.

:func:`layer_activation_bytes` is paper.md's Table 2, generalised to any bytes per activation element
(E), per mask element (M) and ffn size f. Per layer, with s sequence, b micro-batch, h hidden, a heads,
t tensor-parallel size::

    replicated by TP (split by SP):   4 sbh E + 2 sbh M          LN inputs x2, QKV input, fc1 input, 2 masks
    split by TP:                      (4 + 2f/h) sbh E            Q, K, V, projection input, GeLU in, fc2 in
    attention core (split by TP):     a s^2 b (2E + M)            softmax out, dropout out, dropout mask

selective recompute drops the attention-core term; full recompute keeps only the layer input
(sbh E, or sbh E / t with SP). E=2, M=1, f=4h give sbh(34 + 5as/h), sbh(10 + 24/t + 5as/(ht)), ...

:class:`ActivationMeter` counts the bytes of distinct storages saved for backward (parameters and
views of parameters excluded; each storage once), through ``torch.autograd.graph.saved_tensors_hooks``.
Code that saves tensors names them, so :meth:`ActivationMeter.report` says which saved tensor is which
paper term: :func:`saved_as` labels everything saved inside a block, :func:`name_storage` one tensor's
storage (e.g. the fused QKV output that several ops save views of).
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Dict, Iterator, List, Optional

import torch
from torch import nn


__all__ = ["layer_activation_bytes", "ActivationMeter", "SavedTensorRecord", "saved_as", "name_storage"]

#: What a layer keeps for backward: everything, all but the attention core, or only its input.
RECOMPUTE_POLICIES = ("none", "selective", "full")

_label: contextvars.ContextVar = contextvars.ContextVar("seqpar_saved_label", default="unlabelled")
# Storage names given by name_storage(), kept only while a meter is active (so normal runs pay nothing).
_storage_names: Dict[tuple, str] = {}
_active_meters = 0


def layer_activation_bytes(seq_len: int, micro_batch: int, hidden: int, heads: int, tp: int = 1,
                           sequence_parallel: bool = False, recompute: str = "none",
                           ffn_hidden: Optional[int] = None, bytes_per_element: float = 2,
                           bytes_per_mask: float = 1) -> float:
    """Activation bytes one transformer layer keeps for backward, per tensor-parallel rank (paper Table 2).

    ``bytes_per_mask=0`` gives the figure for implementations that regenerate dropout masks.
    """
    for name, value in (("seq_len", seq_len), ("micro_batch", micro_batch), ("hidden", hidden),
                        ("heads", heads), ("tp", tp)):
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if recompute not in RECOMPUTE_POLICIES:
        raise ValueError(f"unknown recompute {recompute!r}; expected one of {RECOMPUTE_POLICIES}")
    f = 4 * hidden if ffn_hidden is None else ffn_hidden
    s, b, h, a, t = seq_len, micro_batch, hidden, heads, tp
    e, m = bytes_per_element, bytes_per_mask
    sbh = s * b * h
    if recompute == "full":
        return sbh * e / (t if sequence_parallel else 1)
    replicated = sbh * (4 * e + 2 * m)
    split = sbh * (4 + 2 * f / h) * e
    attention = a * s * s * b * (2 * e + m)
    total = replicated / (t if sequence_parallel else 1) + split / t
    if recompute == "none":
        total += attention / t
    return total


@contextlib.contextmanager
def saved_as(label: str) -> Iterator[None]:
    """Name the tensors saved for backward inside this block (for :meth:`ActivationMeter.report`)."""
    token = _label.set(label)
    try:
        yield
    finally:
        _label.reset(token)


def _storage_key(t: torch.Tensor) -> tuple:
    return (t.device, t.untyped_storage().data_ptr())


def name_storage(tensor: torch.Tensor, label: str) -> torch.Tensor:
    """Name ``tensor``'s storage for active meters (it wins over :func:`saved_as`); returns ``tensor``."""
    if _active_meters:
        _storage_names[_storage_key(tensor)] = label
    return tensor


@dataclasses.dataclass
class SavedTensorRecord:
    """One distinct storage saved for backward."""

    label: str
    shape: tuple
    dtype: torch.dtype
    bytes: int


def _is_parameter(t: torch.Tensor) -> bool:
    return isinstance(t, nn.Parameter) or isinstance(getattr(t, "_base", None), nn.Parameter)


class ActivationMeter:
    """Context manager measuring the bytes saved for backward inside it (params excluded, storages once).

    Example::

        with seqpar.memory.ActivationMeter() as meter:
            y = layer(x)
        meter.bytes, print(meter.report())
    """

    def __init__(self) -> None:
        self.records: List[SavedTensorRecord] = []
        self._seen: set = set()
        self._hooks = None

    @property
    def bytes(self) -> int:
        """Total bytes of the distinct storages saved so far."""
        return sum(r.bytes for r in self.records)

    def by_label(self) -> Dict[str, int]:
        """Bytes per label, in first-saved order."""
        out: Dict[str, int] = {}
        for r in self.records:
            out[r.label] = out.get(r.label, 0) + r.bytes
        return out

    def report(self, unit_bytes: Optional[float] = None, unit_name: str = "sbh") -> str:
        """A table of the saved storages (label, shape, dtype, bytes, and ``bytes / unit_bytes`` when
        given), then the bytes per label and the total."""
        unit = (lambda n: f" {n / unit_bytes:>10.3f}") if unit_bytes else (lambda n: "")
        head = f"{'saved tensor':<30} {'shape':<22} {'dtype':<15} {'bytes':>13}" + (f" {unit_name:>10}" if unit_bytes else "")
        lines = [head]
        for r in self.records:
            lines.append(f"{r.label:<30} {str(list(r.shape)):<22} {str(r.dtype):<15} {r.bytes:>13,}" + unit(r.bytes))
        lines.append("per label:")
        for label, n in list(self.by_label().items()) + [("total", self.bytes)]:
            lines.append(f"  {label:<28} {'':<22} {'':<15} {n:>13,}" + unit(n))
        return "\n".join(lines)

    def _pack(self, t: torch.Tensor):
        if not _is_parameter(t):
            key = _storage_key(t)
            if key not in self._seen:
                self._seen.add(key)
                label = _storage_names.get(key, _label.get())
                self.records.append(SavedTensorRecord(label, tuple(t.shape), t.dtype, t.untyped_storage().nbytes()))
        return t

    @staticmethod
    def _unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    def __enter__(self) -> "ActivationMeter":
        global _active_meters
        _active_meters += 1
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        global _active_meters
        self._hooks.__exit__(*exc)
        self._hooks = None
        _active_meters -= 1
        if not _active_meters:
            _storage_names.clear()
