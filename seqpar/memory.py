"""Activation memory: the paper's formulas per layer and per model, a recompute planner, and a meter of
what autograd really keeps.

Symbols: s sequence length, b micro-batch, h hidden size, a attention heads, f ffn size (4h by default),
t tensor-parallel size, p pipeline-parallel size, m interleaved model chunks per pipeline rank, L layers,
v vocabulary; E bytes per activation element, M bytes per dropout-mask element.

**One layer** (:func:`layer_activation_bytes`, the paper's Table 2 generalised to any E, M and f), per
tensor-parallel rank::

    replicated by TP (split by SP):   4 sbh E + 2 sbh M          LN inputs x2, QKV input, fc1 input, 2 masks
    split by TP:                      (4 + 2f/h) sbh E            Q, K, V, projection input, GeLU in, fc2 in
    attention core (split by TP):     a s^2 b (2E + M)            softmax out, dropout out, dropout mask

selective recompute drops the attention-core term; full recompute keeps only the layer input
(sbh E, or sbh E / t with SP). E=2, M=1, f=4h give sbh(34 + 5as/h), sbh(10 + 24/t + 5as/(ht)), ...

**Other blocks** (keyword arguments ``normalization``, ``activation``, ``num_query_groups``,
``hidden_dropout``, ``attention_dropout``, ``flash_attention``, ``kv_channels``, ``qk_layernorm``; the Llama
block is RMSNorm, SwiGLU, g k/v groups, no dropout): :func:`layer_activation_terms` lists every saved
tensor by the label seqpar's layer gives it (:func:`saved_as`), per rank (R = t with SP, else 1). With
``kv_channels`` d != h / a, the attention's width a d takes h's place in Q, K, V, the projection input and
the core's o (``sbh`` there reads ``s b a d``)::

    LN1 / LN2 input                 sbh E / R           LayerNorm saves its input (Table 2; its two fp32
                                                        per-token statistics are not counted)
    RMSNorm1 / RMSNorm2 input       (sbh E + 4sb) / R   RMSNorm saves its input (the residual sum) and
                                                        the fp32 rstd per token
    QKV input, fc1 input            sbh E / R           column-parallel GEMM inputs (the shard under SP,
                                                        re-gathered in backward)
    Q, K, V                         sbh E (1 + 2g/a)/t  one QKV storage; g < a shrinks K and V (RoPE or
                                                        q / k norms: new q, k and a copy of v instead)
    Q, K norm input                 (sb(a+g)d E         qk_layernorm only: copies of q and k, and with
                                     + 4sb(a+g)) / t    RMSNorm per (token, head) the fp32 rstd (LayerNorm:
                                                        its statistics not counted, as LN1's)
    softmax output                  a s^2 b E / t       the softmax core's probabilities
    dropout output, mask            a s^2 b (E + M)/t   only with attention dropout
    attention core (flash-style)    (sbh E + 4asb) / t  o (the projection input's storage) and the
                                                        fp32 log-sum-exp per query row: no s^2 term
    projection input, fc2 input     sbh E / t, sbh E f/(ht)
    GeLU input                      sbh E f/(ht)        the fc1 output
    SwiGLU input (gate, up)         2 sbh E f/(ht)      SwiGLU saves only its input and recomputes silu
    two dropout masks               2 sbh M / R         only with hidden dropout

The Llama block keeps ``(4 sbh E + 8 sb) / R + (2 + 2g/a + 3f/h) sbh E / t + a s^2 b E / t`` without
recompute (the last term ``4asb/t`` flash-style, and 0 with selective recompute).

**The most loaded pipeline stage** (:func:`model_activation_bytes`, the paper's Section 4.3): under
the 1F1B schedule the first stage keeps p micro-batches of its L/p layers, L layers' worth whatever p is,
plus the embedding dropout's mask for each of those micro-batches (sbh M p, / t with SP). With the
interleaved schedule (m > 1 chunks per rank) it keeps L (1 + (p-1)/(pm)) layers' worth, and up to 2p
embedding masks (its first chunk's micro-batches in flight, from simulating the schedule). The last stage
keeps one micro-batch of its layers (m = 1) plus the output side: final LayerNorm input and output-layer
input (sbh E each, / t with SP) and the fp32 logits for the cross-entropy (4 sbv / t, v the busiest
rank's padded vocabulary shard; 8 sbv / t for an fp64 model, E = 8). For the paper's models the first stage is the most loaded; with few
layers per stage, full recompute and a large vocabulary the last one can be (Llama-3-8B sizes at t = 8,
p = 4, full recompute: 584 MiB against the first stage's 256 MiB). The figure is the largest stage's,
each stage's from simulating its schedule; with p = 1 the one stage holds both.

**Recompute cost** (:func:`plan_recompute`; the forward FLOPs of the paper's FLOPs appendix): a layer's
forward is 24 bsh^2 + 4 bs^2h (8 bsh^2 + 4 bshf + 4 bs^2h for general f; with g k/v groups the QKV GEMM
is 2bsh^2 (1 + 2g/a), with SwiGLU the MLP 6bshf), split over t ranks. Selective recompute reruns the
attention core's QK^T and attention over V, 4 bs^2h / t (nothing with a flash-style core, which the
layer never wraps); full recompute reruns the whole forward.

:class:`ActivationMeter` counts the bytes of distinct storages saved for backward (parameters and
views of parameters excluded; each storage once, whole: a saved view keeps its whole storage alive),
through ``torch.autograd.graph.saved_tensors_hooks``; nested meters all count.
Code that saves tensors names them, so :meth:`ActivationMeter.report` says which saved tensor is which
paper term: :func:`saved_as` labels everything saved inside a block, :func:`name_storage` one tensor's
storage (e.g. the fused QKV output that several ops save views of).
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math
import threading
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from .random import as_int


__all__ = ["layer_activation_bytes", "layer_activation_terms", "architecture_kwargs", "model_activation_bytes", "plan_recompute", "evaluate_recompute",
           "RecomputePlan", "first_stage_parameters", "MODEL_STATE_BYTES_PER_PARAMETER", "ActivationMeter",
           "SavedTensorRecord", "saved_as", "name_storage", "count_as_saved",
           "not_counted"]

#: What a layer keeps for backward: everything, all but the attention core, or only its input.
RECOMPUTE_POLICIES = ("none", "selective", "full")
#: The most layers the functions take: policies are listed per layer (1e9 from a typo would fill memory,
#: not fail).
MAX_LAYERS = 2**16

#: Bytes of model state per parameter in mixed-precision Adam training (Megatron-LM's layout without a
#: distributed optimizer): bf16/fp16 weight 2 + fp32 gradient 4 + fp32 master weight 4 + Adam's first
#: and second moments 4 + 4.
MODEL_STATE_BYTES_PER_PARAMETER = 18

#: The output layer's logits are kept in fp32 for the cross-entropy (Section 4.3: 4sbv/t); an fp64
#: model's in fp64 (:meth:`_Model.logits_bytes`).
LOGITS_BYTES = 4

_label: contextvars.ContextVar = contextvars.ContextVar("seqpar_saved_label", default="unlabelled")
# Storage names given by name_storage(), kept only while a meter is active (so normal runs pay nothing):
# storage key -> (label, weak reference to the named storage, see _storage_id).
_storage_names: Dict[tuple, Tuple[str, StorageWeakRef]] = {}
_active_meters = 0


# ---------------------------------------------------------------------------------------------- formulas
def _python_ints(fn):
    """``fn`` taking numpy (or other ``numbers.Integral``) integers as the Python ints they are
    (:func:`seqpar.random.as_int`), as TransformerConfig and GPTModel do: sizes from a sweep over a numpy array
    pass the int checks, and the bytes and FLOPs multiplied out of them can't wrap at int64."""
    @functools.wraps(fn)
    def taking_python_ints(*args, **kwargs):
        return fn(*map(as_int, args), **{name: as_int(value) for name, value in kwargs.items()})
    return taking_python_ints


def _check_positive_int(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _check_choice(name: str, value, choices: Sequence[str]) -> None:
    if value not in choices:
        raise ValueError(f"unknown {name} {value!r}; expected one of {tuple(choices)}")


def _check_divides(divisor_name: str, divisor: int, name: str, value: int, why: str = "") -> None:
    if value % divisor:
        raise ValueError(f"{divisor_name} {divisor} does not divide {name} {value}{why}")


def _finite(value) -> bool:
    """Whether a number is a finite float (an int too large for a float is not: math.isfinite raises)."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _check_finite_bytes(what: str, compute, sizes: str) -> None:
    """ValueError unless ``compute()`` (a byte count of these sizes) is a finite float: a count that
    overflowed to inf made 0 layers x inf a NaN, which max() dropped (a model of 0 bytes)."""
    try:
        value = compute()
    except OverflowError:
        value = math.inf
    if not _finite(value):
        raise ValueError(f"{what} overflows a float byte count: {sizes}")


def _check_bytes(name: str, value, allow_zero: bool) -> None:
    ok = (isinstance(value, (int, float)) and not isinstance(value, bool) and _finite(value)
          and (value > 0 or (allow_zero and value == 0)))
    if not ok:
        raise ValueError(f"{name} must be a {'non-negative' if allow_zero else 'positive'} finite number, "
                         f"got {value!r}")


def _has_dropout(name: str, value) -> bool:
    """A dropout knob of the formulas: a bool, or a probability (validated; effective p > 0 means True)."""
    if isinstance(value, bool):
        return value
    from .random import dropout_threshold

    return dropout_threshold(value, name) > 0


@dataclasses.dataclass(frozen=True)
class _Block:
    """What a layer is built of, as far as its saved tensors go (validated)."""

    normalization: str = "layernorm"
    activation: str = "gelu"
    g: Optional[int] = None          # k/v heads; None: one per query head
    hidden_dropout: bool = True
    attention_dropout: bool = True
    flash: bool = False
    d: Optional[int] = None          # head dim (kv_channels); None: h / a
    qk_norm: bool = False

    @classmethod
    def validated(cls, normalization, activation, num_query_groups, hidden_dropout, attention_dropout,
                  flash_attention, kv_channels=None, qk_layernorm=False) -> "_Block":
        from .config import ACTIVATIONS, NORMALIZATIONS  # config imports this module

        _check_choice("normalization", normalization, NORMALIZATIONS)
        _check_choice("activation", activation, ACTIVATIONS)
        for name, value in (("num_query_groups", num_query_groups), ("kv_channels", kv_channels)):
            if value is not None:
                _check_positive_int(name, value)
        for name, value in (("flash_attention", flash_attention), ("qk_layernorm", qk_layernorm)):
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be a bool, got {value!r}")
        return cls(normalization, activation, num_query_groups, _has_dropout("hidden_dropout", hidden_dropout),
                   _has_dropout("attention_dropout", attention_dropout), flash_attention, kv_channels, qk_layernorm)


def architecture_kwargs(config) -> Dict[str, object]:
    """The block keywords of :func:`layer_activation_bytes` / :func:`model_activation_bytes` /
    :func:`plan_recompute` for ``config``, a :class:`seqpar.TransformerConfig` (``ffn_hidden`` included;
    pass ``flash_attention=True`` yourself when the attention core is flash-style, e.g. the triton
    backend)."""
    return dict(ffn_hidden=config.ffn_hidden_size, normalization=config.normalization,
                activation=config.activation, num_query_groups=config.num_query_groups,
                hidden_dropout=config.hidden_dropout, attention_dropout=config.attention_dropout,
                kv_channels=config.kv_channels, qk_layernorm=config.qk_layernorm)


@dataclasses.dataclass(frozen=True)
class _Layer:
    """One layer's sizes (validated): the per-layer bytes and FLOPs of one tensor-parallel rank."""

    s: int
    b: int
    h: int
    a: int
    t: int
    sp: bool
    f: int
    e: float
    m: float
    block: _Block = _Block()

    @classmethod
    def validated(cls, seq_len, micro_batch, hidden, heads, tp, sequence_parallel, ffn_hidden,
                  bytes_per_element, bytes_per_mask, block: _Block = _Block()) -> "_Layer":
        for name, value in (("seq_len", seq_len), ("micro_batch", micro_batch), ("hidden", hidden),
                            ("heads", heads), ("tp", tp)):
            _check_positive_int(name, value)
        f = 4 * hidden if ffn_hidden is None else ffn_hidden
        _check_positive_int("ffn_hidden", f)
        if not isinstance(sequence_parallel, bool):
            raise ValueError(f"sequence_parallel must be a bool, got {sequence_parallel!r}")
        _check_bytes("bytes_per_element", bytes_per_element, allow_zero=False)
        _check_bytes("bytes_per_mask", bytes_per_mask, allow_zero=True)
        if block.d is None:
            _check_divides("heads", heads, "hidden", hidden)
        _check_divides("tp", tp, "heads", heads)
        _check_divides("tp", tp, "ffn_hidden", f)
        if block.g is not None:
            _check_divides("num_query_groups", block.g, "heads", heads)
            _check_divides("tp", tp, "num_query_groups", block.g)
        if sequence_parallel:
            _check_divides("tp", tp, "seq_len", seq_len, " (sequence parallelism splits it)")
        layer = cls(seq_len, micro_batch, hidden, heads, tp, sequence_parallel, f, bytes_per_element,
                    bytes_per_mask, block)
        _check_finite_bytes("one layer's activations", lambda: layer.bytes("none"),   # "none" keeps the most
                            f"seq_len={seq_len}, micro_batch={micro_batch}, hidden={hidden}, heads={heads}, "
                            f"ffn_hidden={f}, bytes_per_element={bytes_per_element}, bytes_per_mask={bytes_per_mask}")
        return layer

    @property
    def sbh(self) -> int:
        return self.s * self.b * self.h

    @property
    def g(self) -> int:
        """k/v heads."""
        return self.a if self.block.g is None else self.block.g

    @property
    def d(self) -> int:
        """The head dim: kv_channels, or h / a."""
        return self.h // self.a if self.block.d is None else self.block.d

    @property
    def sbw(self) -> int:
        """s b a d: the attention's width a d in place of h (they differ with kv_channels)."""
        return self.s * self.b * self.a * self.d

    @property
    def replicated_split(self) -> int:
        """What tensor parallelism alone leaves replicated is split t ways by sequence parallelism."""
        return self.t if self.sp else 1

    def norm_input(self) -> float:
        """One norm's saved input, unsplit: LayerNorm sbh E (Table 2), RMSNorm sbh E + 4sb (fp32 rstd)."""
        extra = 4 * self.s * self.b if self.block.normalization == "rmsnorm" else 0
        return self.sbh * self.e + extra

    def terms(self, recompute: str) -> Dict[str, float]:
        """Bytes per saved tensor of one layer on one rank, keyed by the layer's meter labels (Table 2
        generalised; see the module docstring)."""
        R, t, sbh, e, m, blk = self.replicated_split, self.t, self.sbh, self.e, self.m, self.block
        if recompute == "full":
            return {"layer input (full recompute)": sbh * e / R}
        norm1, norm2 = ("LN1 input", "LN2 input") if blk.normalization == "layernorm" else \
            ("RMSNorm1 input", "RMSNorm2 input")
        ffn = self.f / self.h
        as2b = self.a * self.s * self.s * self.b
        sbw = self.sbw
        terms = {norm1: self.norm_input() / R, "QKV input": sbh * e / R}
        if blk.qk_norm:    # copies of q and k (and, as the layer's norms, RMSNorm's fp32 rstd per row)
            rows = self.s * self.b * (self.a + self.g)
            terms["Q, K norm input"] = (rows * self.d * e + (4 * rows if blk.normalization == "rmsnorm" else 0)) / t
        terms["Q, K, V"] = sbw * e * (1 + 2 * self.g / self.a) / t
        if blk.flash:      # o is the projection input's storage; the fp32 LSE per (head, query row)
            terms["attention core"] = (sbw * e + 4 * self.a * self.s * self.b) / t
        else:
            if recompute == "none":
                terms["softmax output"] = as2b * e / t
                if blk.attention_dropout:
                    terms["dropout output"] = as2b * e / t
                    terms["attention dropout mask"] = as2b * m / t
            terms["projection input"] = sbw * e / t
        if blk.hidden_dropout:
            terms["attention-out dropout mask"] = sbh * m / R
        terms[norm2] = self.norm_input() / R
        terms["fc1 input"] = sbh * e / R
        if blk.activation == "swiglu":
            terms["SwiGLU input (gate, up)"] = 2 * ffn * sbh * e / t
        else:
            terms["GeLU input"] = ffn * sbh * e / t
        terms["fc2 input"] = ffn * sbh * e / t
        if blk.hidden_dropout:
            terms["MLP-out dropout mask"] = sbh * m / R
        return terms

    def bytes(self, recompute: str) -> float:
        """Activation bytes of one layer on one rank (Table 2, generalised)."""
        return sum(self.terms(recompute).values())

    def rebuilt_bytes(self, recompute: str) -> float:
        """What a layer under ``recompute`` rebuilds beyond what it keeps, held while its backward runs
        (and while its forward makes it): selective the attention core's s^2 tensors, full the whole
        layer's; 0 without recompute."""
        return self.bytes("none") - self.bytes(recompute)

    def forward_flops_all_ranks(self) -> int:
        """Forward FLOPs of one layer summed over its t ranks, with w = a d the attention's width (h unless
        kv_channels says otherwise): QKV 2bshw (1 + 2g/a), QK^T 2bs^2w, attention over V 2bs^2w, projection
        2bshw, MLP 4bshf (SwiGLU 6bshf); 8bsh^2 + 4bshf + 4bs^2h for the paper's layer."""
        s, b, h, f, w = self.s, self.b, self.h, self.f, self.a * self.d
        qkv = 2 * b * s * h * (self.a + 2 * self.g) * self.d
        mlp = (6 if self.block.activation == "swiglu" else 4) * b * s * h * f
        return qkv + 2 * b * s * h * w + mlp + 4 * b * s * s * w

    def extra_flops_all_ranks(self, recompute: str) -> int:
        """Forward FLOPs a recompute policy adds per layer, summed over the t ranks (exact integer)."""
        if recompute == "full":
            return self.forward_flops_all_ranks()
        if recompute == "selective" and not self.block.flash:
            return 4 * self.b * self.s * self.s * self.a * self.d
        return 0


@_python_ints
def layer_activation_terms(seq_len: int, micro_batch: int, hidden: int, heads: int, tp: int = 1,
                           sequence_parallel: bool = False, recompute: str = "none",
                           ffn_hidden: Optional[int] = None, bytes_per_element: float = 2,
                           bytes_per_mask: float = 1, *, normalization: str = "layernorm",
                           activation: str = "gelu", num_query_groups: Optional[int] = None,
                           hidden_dropout=True, attention_dropout=True,
                           flash_attention: bool = False, kv_channels: Optional[int] = None,
                           qk_layernorm: bool = False) -> Dict[str, float]:
    """:func:`layer_activation_bytes` term by term: {meter label: bytes} per tensor-parallel rank, the
    labels :class:`ActivationMeter` gives the tensors seqpar's layer saves (module docstring). The
    arguments (``seq_len``, ``micro_batch``, ``hidden``, ``heads``, ``tp``, ``sequence_parallel``,
    ``recompute``, ``ffn_hidden``, ``bytes_per_element``, ``bytes_per_mask`` and the block keywords
    ``normalization``, ``activation``, ``num_query_groups``, ``hidden_dropout``, ``attention_dropout``,
    ``flash_attention``, ``kv_channels``, ``qk_layernorm``) and the ValueErrors as in
    :func:`layer_activation_bytes`."""
    _check_policy("recompute", recompute)
    block = _Block.validated(normalization, activation, num_query_groups, hidden_dropout, attention_dropout,
                             flash_attention, kv_channels, qk_layernorm)
    layer = _Layer.validated(seq_len, micro_batch, hidden, heads, tp, sequence_parallel, ffn_hidden,
                             bytes_per_element, bytes_per_mask, block)
    return layer.terms(recompute)


@_python_ints
def layer_activation_bytes(seq_len: int, micro_batch: int, hidden: int, heads: int, tp: int = 1,
                           sequence_parallel: bool = False, recompute: str = "none",
                           ffn_hidden: Optional[int] = None, bytes_per_element: float = 2,
                           bytes_per_mask: float = 1, *, normalization: str = "layernorm",
                           activation: str = "gelu", num_query_groups: Optional[int] = None,
                           hidden_dropout=True, attention_dropout=True, flash_attention: bool = False,
                           kv_channels: Optional[int] = None, qk_layernorm: bool = False) -> float:
    """Activation bytes one transformer layer keeps for backward, per tensor-parallel rank (paper Table 2).

    Sizes (the module docstring's symbols): ``seq_len`` s, ``micro_batch`` b, ``hidden`` h, ``heads`` a,
    ``tp`` t, ``ffn_hidden`` f (None: 4h); ``sequence_parallel`` splits the replicated terms over t too
    (R = t); ``recompute`` "none" | "selective" | "full" (:data:`RECOMPUTE_POLICIES`);
    ``bytes_per_element`` E of an activation (2 for fp16 / bf16) and ``bytes_per_mask`` M of a dropout
    mask element (1: a byte mask). ``bytes_per_mask=0`` gives the figure for implementations that
    regenerate dropout masks (seqpar). Invalid sizes (non-positive, bools, ``tp`` not dividing ``heads``
    or ``ffn_hidden``, or ``seq_len`` under sequence parallelism) and negative bytes raise ValueError
    naming the value.

    The keywords describe other blocks (the defaults are the paper's GPT layer, Table 2 exactly):
    ``normalization`` "layernorm" | "rmsnorm"; ``activation`` "gelu" | "gelu_tanh" | "swiglu";
    ``num_query_groups`` the k/v heads g (None: a); ``hidden_dropout`` / ``attention_dropout`` whether
    the layer has them (a bool or the probability: the Llama block has neither, so no masks and no
    dropout output); ``flash_attention`` a flash-style core (seqpar's triton backend) that keeps only o
    and the fp32 log-sum-exp, with or without selective recompute; ``kv_channels`` the head dim d (None:
    h / a, which must divide): Q, K, V, the projection input and the core's o are a d wide, not h;
    ``qk_layernorm`` per-head q and k norms (Qwen3), which keep copies of q and k and with RMSNorm per
    (token, head) the fp32 rstd: ``(sb (a + g) d E + 4 sb (a + g)) / t`` (LayerNorm's statistics are not
    counted, as for LN1 and LN2). :func:`architecture_kwargs` reads them from a config;
    :func:`layer_activation_terms` gives the figure term by term.
    """
    return sum(layer_activation_terms(seq_len, micro_batch, hidden, heads, tp, sequence_parallel, recompute,
                                      ffn_hidden, bytes_per_element, bytes_per_mask, normalization=normalization,
                                      activation=activation, num_query_groups=num_query_groups,
                                      hidden_dropout=hidden_dropout, attention_dropout=attention_dropout,
                                      flash_attention=flash_attention, kv_channels=kv_channels,
                                      qk_layernorm=qk_layernorm).values())


def _check_policy(name: str, policy) -> None:
    if not isinstance(policy, str) or policy not in RECOMPUTE_POLICIES:
        raise ValueError(f"unknown {name} {policy!r}; expected one of {RECOMPUTE_POLICIES}")


@_python_ints
def recompute_policies(recompute, num_layers: int, layers: str = "layers") -> Tuple[str, ...]:
    """``recompute`` as one policy per layer: a policy name (every layer) or a sequence of
    ``num_layers`` names. ValueError naming the offending value otherwise (``layers`` names what the
    list covers in it: "layers", or "layers per pipeline stage")."""
    if isinstance(num_layers, int) and num_layers > MAX_LAYERS:   # its type is checked with the model's sizes
        raise ValueError(f"num_layers {num_layers} is more than {MAX_LAYERS}, the most seqpar.memory takes (policies are "
                         f"listed per layer)")
    if isinstance(recompute, str):
        _check_policy("recompute", recompute)
        return (recompute,) * num_layers
    if not isinstance(recompute, (list, tuple)):
        raise ValueError(f"recompute must be one of {RECOMPUTE_POLICIES} or a list of them per layer, "
                         f"got {recompute!r}")
    if len(recompute) != num_layers:
        raise ValueError(f"recompute has {len(recompute)} per-layer policies for {num_layers} {layers}")
    for i, policy in enumerate(recompute):
        _check_policy(f"recompute[{i}]", policy)
    return tuple(recompute)


def _count(policies: Sequence[str]) -> Tuple[int, int, int]:
    """(n_none, n_selective, n_full)."""
    return tuple(sum(1 for p in policies if p == name) for name in RECOMPUTE_POLICIES)


def _rank_peak(pp: int, interleave: int, rank: int, chunk_bytes: Sequence[float]) -> float:
    """Peak bytes pipeline rank ``rank`` holds under Megatron-LM's 1F1B schedule (``interleave`` = 1) or
    its interleaved schedule (Narayanan et al.; ``interleave`` = m > 1 model chunks per rank).

    The rank runs ``warm-up`` forwards (p - 1 - rank; interleaved 2(p - 1 - rank) + (m - 1)p), then
    alternates one forward and one backward. Forward i runs chunk (i mod pm) // p, backward i the chunks
    in reverse order. Micro-batch k of chunk c holds ``chunk_bytes[c]`` until its backward. Enough
    micro-batches to fill the pipeline are assumed. With uniform chunks rank 0's peak is p chunks' worth
    (m = 1) or pm + p - 1 (m > 1): L layers' worth times 1 + (p - 1)/(pm) (Section 4.3); the last rank's
    is one chunk's worth (m = 1).
    """
    p, m = pp, interleave
    if m == 1:   # warm-up + 1 forwards, then one backward per forward: the steady state holds p - rank
        return (p - rank) * chunk_bytes[0]   # (closed form: the walk below is O(p) per rank, O(p^2) a model)
    group = p * m
    warmup = 2 * (p - 1 - rank) + (m - 1) * p
    total = 4 * p * m          # forwards of 4p micro-batches: the steady state repeats every pm forwards
    held = [0] * m
    peak = 0.0
    n_forward = n_backward = 0
    while n_forward < total:
        held[(n_forward % group) // p] += 1
        n_forward += 1
        peak = max(peak, sum(n * c for n, c in zip(held, chunk_bytes)))
        if n_forward > warmup:
            held[m - 1 - (n_backward % group) // p] -= 1
            n_backward += 1
    return peak


@dataclasses.dataclass(frozen=True)
class _Model:
    """A model's sizes (validated), its most loaded pipeline stage's bytes and its first stage's FLOPs
    per rank."""

    layer: _Layer
    num_layers: int
    vocab: int
    pp: int
    interleave: int
    embedding_dropout: bool = True

    @classmethod
    def validated(cls, seq_len, micro_batch, hidden, heads, num_layers, vocab, tp, pp, sequence_parallel,
                  ffn_hidden, bytes_per_element, bytes_per_mask, interleave, block: Dict[str, object]) -> "_Model":
        """``block``: the architecture keywords (those of :func:`layer_activation_bytes` and
        ``embedding_dropout``: None follows ``hidden_dropout``, like GPTModel's default)."""
        block = dict(block)
        embedding_dropout = block.pop("embedding_dropout")
        layer = _Layer.validated(seq_len, micro_batch, hidden, heads, tp, sequence_parallel, ffn_hidden,
                                 bytes_per_element, bytes_per_mask, _Block.validated(**block))
        embedding_dropout = (layer.block.hidden_dropout if embedding_dropout is None
                             else _has_dropout("embedding_dropout", embedding_dropout))
        for name, value in (("num_layers", num_layers), ("vocab", vocab), ("pp", pp), ("interleave", interleave)):
            _check_positive_int(name, value)
        if num_layers > MAX_LAYERS:   # the planner loops over the layer counts: a typo would run for hours
            raise ValueError(f"num_layers {num_layers} is more than {MAX_LAYERS}, the most seqpar.memory takes")
        if interleave > 1 and pp == 1:
            raise ValueError(f"interleave {interleave} needs pipeline parallelism (pp > 1), got pp=1")
        _check_divides("pp" if interleave == 1 else "pp * interleave =", pp * interleave, "num_layers", num_layers)
        model = cls(layer, num_layers, vocab, pp, interleave, embedding_dropout)
        # a rank's peak is at most twice all layers' bytes plus the output side (interleaved: 1 + (p-1)/(pm))
        _check_finite_bytes("the model's activations", lambda: 2 * (layer.bytes("none") * num_layers
                                                                    + model.output_side_bytes()),
                            f"num_layers={num_layers}, vocab={vocab} with one layer's {layer.bytes('none'):.4g} bytes")
        return model

    @property
    def chunk_layers(self) -> int:
        """Layers per model chunk: L / p per stage (L / (pm) per chunk when interleaved)."""
        return self.num_layers // (self.pp * self.interleave)

    def rank_layers(self, policies: Sequence[str], rank: int) -> List[Sequence[str]]:
        """The policies of pipeline rank ``rank``'s chunks: chunk k is virtual stage k * p + rank."""
        c = self.chunk_layers
        return [policies[(k * self.pp + rank) * c:(k * self.pp + rank + 1) * c] for k in range(self.interleave)]

    def output_side_bytes(self) -> float:
        """What the last stage keeps per micro-batch beyond its layers: the final norm's input, the
        output layer's input (sbh E each, / t with SP) and the fp32 logits of the busiest rank's
        vocabulary shard (GPTModel pads v to a multiple of 128 t: min(v, padded v / t) columns)."""
        lay = self.layer
        final_layernorm_input = lay.norm_input() / lay.replicated_split
        output_layer_input = lay.sbh * lay.e / lay.replicated_split
        return final_layernorm_input + output_layer_input + self.logits_bytes() * lay.s * lay.b * self.vocab_shard()

    def logits_bytes(self) -> float:
        """Bytes per element of the logits the loss keeps: fp32 (:data:`LOGITS_BYTES`), or the compute
        dtype's where wider (an fp64 model's loss runs in fp64)."""
        return max(LOGITS_BYTES, self.layer.e)

    def vocab_shard(self) -> int:
        """Logit columns of the busiest rank: GPTModel pads v to a multiple of 128 t, min(v, padded v / t)."""
        from .nn.model import padded_vocab_size  # nn.model imports this module

        return min(self.vocab, padded_vocab_size(self.vocab, self.layer.t) // self.layer.t)

    def loss_working_bytes(self) -> float:
        """What the vocabulary loss's backward builds beside the fp32 softmax it saved, on the last stage:
        the gradient of the logits shard in the compute dtype (E sbv / t; computed in fp32 and rounded into
        it, no fp32 copy). It runs before any layer's backward, every layer's activations held. (Its
        forward's transient, the logits in the compute dtype beside the fp32 buffer that becomes the
        softmax, is no larger.)"""
        lay = self.layer
        return lay.e * lay.s * lay.b * self.vocab_shard()

    def activation_bytes(self, counts_by_rank: Sequence[Sequence[Tuple[int, int, int]]]) -> float:
        """Bytes of the most loaded pipeline rank, from each rank's chunks' (n_none, n_selective, n_full)
        (``counts_by_rank[r][k]``: rank r's chunk k). Rank 0 holds the most micro-batches and the embedding
        dropout's mask with its first chunk; the last rank holds the output side with its last chunk."""
        return max(self.rank_activation_bytes(counts_by_rank))

    def rank_activation_bytes(self, counts_by_rank: Sequence[Sequence[Tuple[int, int, int]]]) -> List[float]:
        """:meth:`activation_bytes` of every pipeline rank, in rank order."""
        lay = self.layer
        per_layer = [lay.bytes(p) for p in RECOMPUTE_POLICIES]
        embedding_dropout = lay.sbh * lay.m / lay.replicated_split if self.embedding_dropout else 0
        peaks = []
        for rank, chunk_counts in enumerate(counts_by_rank):
            chunk_bytes = [sum(n * x for n, x in zip(counts, per_layer)) for counts in chunk_counts]
            if rank == 0:
                chunk_bytes[0] += embedding_dropout
            if rank == self.pp - 1:
                chunk_bytes[-1] += self.output_side_bytes()
            peaks.append(_rank_peak(self.pp, self.interleave, rank, chunk_bytes))
        return peaks

    def working_bytes(self, counts: Tuple[int, int, int]) -> float:
        """The largest :meth:`_Layer.rebuilt_bytes` among the policies in use (one layer's backward runs
        at a time on a rank)."""
        return max([self.layer.rebuilt_bytes(p) for n, p in zip(counts, RECOMPUTE_POLICIES) if n], default=0.0)

    def plan(self, stage_policies: Tuple[str, ...]) -> "RecomputePlan":
        """The RecomputePlan of one stage's per-layer policies (the same on every stage; 1F1B)."""
        counts = _count(stage_policies)
        extra = self.extra_flops_all_ranks(counts)
        ranks = self.rank_activation_bytes([[counts]] * self.pp)
        return RecomputePlan(tuple(stage_policies), max(ranks), extra / self.layer.t,
                             extra / self.stage_flops_all_ranks(), self.working_bytes(counts),
                             self.loss_working_bytes(), ranks[-1])

    def extra_flops_all_ranks(self, counts: Tuple[int, int, int]) -> int:
        return sum(n * self.layer.extra_flops_all_ranks(p) for n, p in zip(counts, RECOMPUTE_POLICIES))

    def stage_flops_all_ranks(self) -> int:
        """Model FLOPs (forward + backward = 3x forward) of one micro-batch through the first stage, summed
        over its t ranks; with p = 1 including the logits (2bshv forward). For the whole model with p = 1
        this is the paper's 72 BLsh^2 (1 + s/(6h) + v/(12hL)) (at f = 4h)."""
        lay = self.layer
        forward = (self.num_layers // self.pp) * lay.forward_flops_all_ranks()
        if self.pp == 1:
            forward += 2 * lay.b * lay.s * lay.h * self.vocab
        return 3 * forward


@_python_ints
def model_activation_bytes(seq_len: int, micro_batch: int, hidden: int, heads: int, num_layers: int,
                           vocab: int, *, tp: int = 1, pp: int = 1, sequence_parallel: bool = False,
                           recompute: Union[str, Sequence[str]] = "none", ffn_hidden: Optional[int] = None,
                           bytes_per_element: float = 2, bytes_per_mask: float = 1,
                           interleave: int = 1, normalization: str = "layernorm", activation: str = "gelu",
                           num_query_groups: Optional[int] = None, hidden_dropout=True, attention_dropout=True,
                           flash_attention: bool = False, embedding_dropout=None, kv_channels: Optional[int] = None,
                           qk_layernorm: bool = False) -> float:
    """Activation bytes of the most loaded pipeline stage, per tensor-parallel rank (the first stage
    for the paper's models).

    The paper's Section 4.3: under 1F1B the first stage holds p micro-batches of its L/p layers, i.e.
    L layers' worth (Table 2 per layer), times 1 + (p-1)/(pm) with the interleaved schedule of
    ``interleave`` = m chunks per rank; plus the embedding dropout's mask per micro-batch in flight
    (sbh M p / t with SP: ``sbhp/t``). The last stage holds the output side per micro-batch in flight:
    the final LayerNorm input and the output-layer input (sbh E each, / t with SP) and the fp32 logits
    (4 sb v' with v' = min(v, padded v / t), the busiest rank's vocabulary shard). Each stage's peak
    comes from simulating its schedule (``_rank_peak``); the result is the largest (with p = 1 the one
    stage holds everything).

    Arguments: ``seq_len``, ``micro_batch``, ``hidden``, ``heads``, ``tp``, ``sequence_parallel``,
    ``ffn_hidden``, ``bytes_per_element``, ``bytes_per_mask`` as in :func:`layer_activation_bytes`;
    ``num_layers`` L, ``vocab`` v (unpadded; the logits take the busiest rank's padded shard), ``pp`` p
    and ``interleave`` m (model chunks per pipeline rank, m > 1 needs p > 1).

    ``recompute``: one policy for every layer, or a list of ``num_layers`` per-layer policies (stage r
    runs layers r L/p .. (r + 1) L/p - 1, or its chunks when interleaved). Apply a
    :class:`RecomputePlan` to every stage with ``list(plan.policies) * pp``.

    Other blocks: the keywords of :func:`layer_activation_bytes` (``normalization``, ``activation``,
    ``num_query_groups``, ``hidden_dropout``, ``attention_dropout``, ``flash_attention``, ``kv_channels``,
    ``qk_layernorm``) and ``embedding_dropout`` (None: as ``hidden_dropout``, GPTModel's default): without it
    there is no embedding mask; with RMSNorm the final norm's input also keeps its fp32 rstd (4sb / t with SP).

    ValueError (naming the value) for sizes that are not positive ints (``num_layers`` at most 2**16), t
    not dividing the heads (or the query groups, ffn, and s under SP), pp * interleave not dividing
    num_layers, a per-layer list of another length or an unknown policy, an unknown normalization or
    activation, ``num_query_groups`` not dividing heads, and byte sizes that are negative or overflow a
    float.
    """
    model = _Model.validated(seq_len, micro_batch, hidden, heads, num_layers, vocab, tp, pp, sequence_parallel,
                             ffn_hidden, bytes_per_element, bytes_per_mask, interleave,
                             dict(normalization=normalization, activation=activation,
                                  num_query_groups=num_query_groups, hidden_dropout=hidden_dropout,
                                  attention_dropout=attention_dropout, flash_attention=flash_attention,
                                  embedding_dropout=embedding_dropout, kv_channels=kv_channels,
                                  qk_layernorm=qk_layernorm))
    policies = recompute_policies(recompute, num_layers)
    return model.activation_bytes([[_count(chunk) for chunk in model.rank_layers(policies, rank)]
                                   for rank in range(pp)])


@_python_ints
def first_stage_parameters(hidden: int, num_layers: int, vocab: int, max_seq_len: int, *, tp: int = 1,
                           pp: int = 1, ffn_hidden: Optional[int] = None, heads: Optional[int] = None,
                           num_query_groups: Optional[int] = None, normalization: str = "layernorm",
                           activation: str = "gelu", add_bias_linear: bool = True,
                           position_embedding: str = "learned",
                           share_embeddings_and_output_weights: bool = True, add_qkv_bias: bool = False,
                           kv_channels: Optional[int] = None, qk_layernorm: bool = False) -> int:
    """Parameters one tensor-parallel rank of the first pipeline stage holds (the GPTModel that
    :class:`seqpar.TransformerConfig`'s knobs of the same names build).

    Sizes: ``hidden`` h, ``num_layers`` L, ``vocab`` v (unpadded), ``max_seq_len`` (the learned position
    table's rows), ``tp`` t, ``pp`` p, ``ffn_hidden`` f (None: 4h), ``heads`` a, ``num_query_groups`` g
    (None: a); ``normalization``, ``activation``, ``add_bias_linear``, ``position_embedding`` ("learned" |
    "rope": no table), ``share_embeddings_and_output_weights``, ``add_qkv_bias``, ``kv_channels`` (the head
    dim d; needs ``heads``) and ``qk_layernorm`` as the config's fields. With ``kv_channels`` the QKV rows are
    (a + 2g) d and the projection h a d; ``qk_layernorm`` adds two replicated norms of d per layer.

    Per layer, with q = (1 + 2g/a) h the QKV rows (3h without grouped-query attention) and f' = 2f with
    SwiGLU (gate and up), else f: the QKV (q h), fc1 (f' h), projection (h^2) and fc2 (f h) weights split
    over the t ranks, with ``add_bias_linear`` also the QKV and fc1 biases (q + f', split) and the
    projection and fc2 biases (2h, replicated), with ``add_qkv_bias`` alone the QKV bias (q, split), and
    the two norms (4h for LayerNorm's weight and bias, 2h for RMSNorm) replicated: 12h^2 + 13h at the GPT
    defaults and t = 1. Plus the word embedding (v rows padded to a multiple of 128 t as GPTModel does,
    split t ways) and with learned positions the position
    table (max_seq_len x h); with pp = 1 also the final norm and, untied
    (``share_embeddings_and_output_weights=False``), the output layer (another padded v/t x h).
    ``heads`` is needed only with ``num_query_groups`` (checked whenever given). ValueError for sizes that are not positive ints,
    t not dividing h / ffn / the heads or groups, pp not dividing num_layers, ``num_query_groups``
    without ``heads``, and unknown normalization / activation / position-embedding names.
    """
    from .config import ACTIVATIONS, NORMALIZATIONS, POSITION_EMBEDDINGS  # config imports this module
    from .nn.model import padded_vocab_size

    for name, value in (("hidden", hidden), ("num_layers", num_layers), ("vocab", vocab),
                        ("max_seq_len", max_seq_len), ("tp", tp), ("pp", pp)):
        _check_positive_int(name, value)
    _check_choice("normalization", normalization, NORMALIZATIONS)
    _check_choice("activation", activation, ACTIVATIONS)
    _check_choice("position_embedding", position_embedding, POSITION_EMBEDDINGS)
    for name, value in (("add_bias_linear", add_bias_linear), ("add_qkv_bias", add_qkv_bias),
                        ("qk_layernorm", qk_layernorm),
                        ("share_embeddings_and_output_weights", share_embeddings_and_output_weights)):
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be a bool, got {value!r}")
    h, t = hidden, tp
    f = 4 * h if ffn_hidden is None else ffn_hidden
    _check_positive_int("ffn_hidden", f)
    _check_divides("tp", t, "ffn_hidden", f)
    _check_divides("pp", pp, "num_layers", num_layers)
    for name, given in (("kv_channels", kv_channels is not None), ("num_query_groups", num_query_groups is not None),
                        ("qk_layernorm", qk_layernorm)):
        if given and heads is None:
            raise ValueError(f"{name} needs heads (the query heads a) to size the attention")
    width = h                                  # a d, the attention's width
    if heads is None:
        _check_divides("tp", t, "hidden", h)
    else:
        _check_positive_int("heads", heads)
        if kv_channels is None:
            _check_divides("heads", heads, "hidden", h)
        else:
            _check_positive_int("kv_channels", kv_channels)
            width = heads * kv_channels
        _check_divides("tp", t, "heads", heads)
    qkv_rows = 3 * width
    if num_query_groups is not None:
        _check_positive_int("num_query_groups", num_query_groups)
        _check_divides("num_query_groups", num_query_groups, "heads", heads)
        _check_divides("tp", t, "num_query_groups", num_query_groups)
        qkv_rows = width + 2 * num_query_groups * (width // heads)
    fc1_rows = 2 * f if activation == "swiglu" else f
    norm = 2 * h if normalization == "layernorm" else h
    qk_norms = 2 * (norm // h) * (width // heads) if qk_layernorm else 0   # q and k: [d] each (and biases)
    biases = (qkv_rows if add_bias_linear or add_qkv_bias else 0) + (fc1_rows if add_bias_linear else 0)
    split = qkv_rows * h + fc1_rows * h + width * h + f * h + biases
    per_layer = split // t + (2 * h if add_bias_linear else 0) + 2 * norm + qk_norms
    vocab_shard = padded_vocab_size(vocab, t) // t * h
    embeddings = vocab_shard + (max_seq_len * h if position_embedding == "learned" else 0)
    last_stage = norm + (0 if share_embeddings_and_output_weights else vocab_shard)
    return (num_layers // pp) * per_layer + embeddings + (last_stage if pp == 1 else 0)


@dataclasses.dataclass(frozen=True)
class RecomputePlan:
    """Per-layer recompute policies for a pipeline stage and what they cost
    (:func:`plan_recompute`: the cheapest that fits a budget; :func:`evaluate_recompute`: any list).

    ``policies``: one of "none" | "selective" | "full" per layer of a pipeline stage (L/p of them; every
    stage uses the same list). ``activation_bytes``: :func:`model_activation_bytes` with these policies
    on every stage (the most loaded stage's). ``extra_flops``: forward FLOPs the recompute adds
    per micro-batch and tensor-parallel rank on that stage. ``extra_fraction``: ``extra_flops`` over the
    stage's model FLOPs per micro-batch and rank (forward + backward; with pp = 1 including the logits).
    ``recompute_working_bytes``: what one recomputed layer rebuilds while its backward runs (its forward
    makes it too), on top of ``activation_bytes``: the attention core's s^2 tensors for selective
    recompute, a whole layer's activations for full (the largest among the policies in use; 0 without
    recompute). ``loss_working_bytes``: what the vocabulary loss's backward builds on the last stage
    beside the softmax it saved (the gradient of the busiest rank's logits shard in the compute dtype,
    computed in fp32 and rounded once), every layer's activations still held. ``last_stage_activation_bytes``: the last
    stage's activation bytes (None: ``activation_bytes``, as with one stage).
    """

    policies: Tuple[str, ...]
    activation_bytes: float
    extra_flops: float
    extra_fraction: float
    recompute_working_bytes: float = 0.0
    loss_working_bytes: float = 0.0
    last_stage_activation_bytes: Optional[float] = None

    @property
    def peak_bytes(self) -> float:
        """The stages' activations at their peak: each stage's activation bytes plus the larger of the
        working sets it runs (the loss's on the last stage only; the two never overlap), the largest.
        Not counted: the backward kernels' own transient buffers (the attention core's s^2 ones in a
        non-flash backward; see the README's planning section)."""
        last = self.activation_bytes if self.last_stage_activation_bytes is None else self.last_stage_activation_bytes
        return max(self.activation_bytes + self.recompute_working_bytes,
                   last + max(self.recompute_working_bytes, self.loss_working_bytes))

    @property
    def counts(self) -> Dict[str, int]:
        """Layers per policy."""
        return dict(zip(RECOMPUTE_POLICIES, _count(self.policies)))


@_python_ints
def evaluate_recompute(policies: Sequence[str], seq_len: int, micro_batch: int, hidden: int, heads: int,
                       num_layers: int, vocab: int, *, tp: int = 1, pp: int = 1, sequence_parallel: bool = True,
                       ffn_hidden: Optional[int] = None, bytes_per_element: float = 2,
                       bytes_per_mask: float = 1, normalization: str = "layernorm", activation: str = "gelu",
                       num_query_groups: Optional[int] = None, hidden_dropout=True, attention_dropout=True,
                       flash_attention: bool = False, embedding_dropout=None, kv_channels: Optional[int] = None,
                       qk_layernorm: bool = False) -> RecomputePlan:
    """The :class:`RecomputePlan` of given per-layer ``policies`` for a stage's L/p layers (every stage
    running the same list), whether or not it is the cheapest: its activation bytes and extra FLOPs.
    The other arguments (``seq_len``, ``micro_batch``, ``hidden``, ``heads``, ``num_layers``, ``vocab``,
    ``tp``, ``pp``, ``sequence_parallel``, ``ffn_hidden``, ``bytes_per_element``, ``bytes_per_mask``,
    ``normalization``, ``activation``, ``num_query_groups``, ``hidden_dropout``, ``attention_dropout``,
    ``flash_attention``, ``embedding_dropout``, ``kv_channels``, ``qk_layernorm``) as in
    :func:`model_activation_bytes`, at
    ``interleave=1``. Note ``sequence_parallel`` defaults to True here and in :func:`plan_recompute`
    (the planner's use), but to False in :func:`model_activation_bytes` and
    :func:`layer_activation_bytes` (Table 2's first rows): pass it explicitly when comparing their
    figures. ValueError as :func:`model_activation_bytes`, and for a
    ``policies`` list whose length is not the stage's L/p layers."""
    model = _Model.validated(seq_len, micro_batch, hidden, heads, num_layers, vocab, tp, pp, sequence_parallel,
                             ffn_hidden, bytes_per_element, bytes_per_mask, 1,
                             dict(normalization=normalization, activation=activation,
                                  num_query_groups=num_query_groups, hidden_dropout=hidden_dropout,
                                  attention_dropout=attention_dropout, flash_attention=flash_attention,
                                  embedding_dropout=embedding_dropout, kv_channels=kv_channels,
                                  qk_layernorm=qk_layernorm))
    return model.plan(recompute_policies(policies, model.chunk_layers,
                                         "layers per pipeline stage (num_layers / pp; every stage runs the list)"))


@_python_ints
def plan_recompute(seq_len: int, micro_batch: int, hidden: int, heads: int, num_layers: int, vocab: int, *,
                   budget_bytes: float, tp: int = 1, pp: int = 1, sequence_parallel: bool = True,
                   ffn_hidden: Optional[int] = None, bytes_per_element: float = 2,
                   bytes_per_mask: float = 1, normalization: str = "layernorm", activation: str = "gelu",
                   num_query_groups: Optional[int] = None, hidden_dropout=True, attention_dropout=True,
                   flash_attention: bool = False, embedding_dropout=None, kv_channels: Optional[int] = None,
                   qk_layernorm: bool = False, include_working_set: bool = False) -> RecomputePlan:
    """The per-layer recompute mix, the same on every stage, with the least extra forward FLOPs whose
    activation bytes (:func:`model_activation_bytes`, 1F1B: the most loaded stage) fit ``budget_bytes``.
    ``sequence_parallel`` defaults to True here (unlike :func:`model_activation_bytes`).

    ``include_working_set``: fit ``peak_bytes`` instead, the activation bytes plus what one recomputed
    layer rebuilds during its backward (:attr:`RecomputePlan.recompute_working_bytes`) or, on the last
    stage, what the loss's backward builds (:attr:`RecomputePlan.loss_working_bytes`), whichever is
    larger. Without it, a plan that needs selective layers is typically within one layer's s^2 bytes of
    the budget and goes over it in the first recomputed backward (``python -m seqpar plan`` plans with
    it).

    Extra forward FLOPs per layer and rank: selective recompute 4bs^2h/t (the attention core's QK^T and
    attention over V), full recompute the whole layer forward (24bsh^2 + 4bs^2h)/t. Under 1F1B every
    layer of a stage is held for the same number of micro-batches, so only how many layers take each
    policy matters, not which ones. Memory falls and cost rises with each layer moved from "none" to
    "selective" to "full" (selective keeps at least the layer input that full keeps). So for each
    number of full layers n_full = 0 .. L/p, the cheapest fit takes the fewest selective layers that
    fit (binary search on the monotone memory); the plan is the cheapest of those L/p + 1 candidates
    (ties: the least memory). That is the optimum over all (n_none, n_selective, n_full) mixes.
    Full-recompute layers come first in ``policies``, then selective, then none.

    The other arguments (``seq_len``, ``micro_batch``, ``hidden``, ``heads``, ``num_layers``, ``vocab``,
    ``tp``, ``pp``, ``sequence_parallel``, ``ffn_hidden``, ``bytes_per_element``, ``bytes_per_mask``, and
    the block keywords ``normalization``, ``activation``, ``num_query_groups``, ``hidden_dropout``,
    ``attention_dropout``, ``flash_attention``, ``embedding_dropout``, ``kv_channels``, ``qk_layernorm``) as in
    :func:`model_activation_bytes`, at ``interleave=1``. With ``flash_attention`` selective recompute
    saves nothing and costs nothing (the layer never wraps a flash-style core), so plans use none / full.

    Raises ValueError if even full recompute of every layer does not fit.
    """
    model = _Model.validated(seq_len, micro_batch, hidden, heads, num_layers, vocab, tp, pp, sequence_parallel,
                             ffn_hidden, bytes_per_element, bytes_per_mask, 1,
                             dict(normalization=normalization, activation=activation,
                                  num_query_groups=num_query_groups, hidden_dropout=hidden_dropout,
                                  attention_dropout=attention_dropout, flash_attention=flash_attention,
                                  embedding_dropout=embedding_dropout, kv_channels=kv_channels,
                                  qk_layernorm=qk_layernorm))
    _check_bytes("budget_bytes", budget_bytes, allow_zero=False)
    if not isinstance(include_working_set, bool):
        raise ValueError(f"include_working_set must be a bool, got {include_working_set!r}")
    n = model.chunk_layers

    def memory(n_selective: int, n_full: int) -> float:
        # Non-increasing in n_selective at fixed n_full (the binary search below relies on it): each
        # selective layer saves rebuilt_bytes("selective"), the working set a selective layer adds once.
        plan = model.plan(("full",) * n_full + ("selective",) * n_selective + ("none",) * (n - n_selective - n_full))
        return plan.peak_bytes if include_working_set else plan.activation_bytes

    floor = memory(0, n)
    if floor > budget_bytes:
        what = "peak activation bytes" if include_working_set else "activation bytes"
        raise ValueError(f"budget_bytes {budget_bytes:.6g} is below {floor:.6g}, the {what} of the most "
                         f"loaded stage even with full recompute of every layer")
    best = None  # (extra flops, bytes, n_selective, n_full)
    for n_full in range(n + 1):
        rest = n - n_full
        if memory(rest, n_full) > budget_bytes:
            continue
        # memory(k, n_full) is non-increasing in k and memory(rest, n_full) fits: the fewest selective
        # layers that fit (binary search) are the cheapest mix with n_full full layers.
        lo, hi = 0, rest
        while lo < hi:
            mid = (lo + hi) // 2
            if memory(mid, n_full) <= budget_bytes:
                hi = mid
            else:
                lo = mid + 1
        n_selective = lo
        counts = (rest - n_selective, n_selective, n_full)
        candidate = (model.extra_flops_all_ranks(counts), memory(n_selective, n_full), n_selective, n_full)
        if best is None or candidate[:2] < best[:2]:
            best = candidate
    _, _, n_selective, n_full = best
    return model.plan(("full",) * n_full + ("selective",) * n_selective + ("none",) * (n - n_full - n_selective))


# ---------------------------------------------------------------------------------------------- meter
class saved_as(contextlib.ContextDecorator):
    """Name the tensors saved for backward inside this block (for :meth:`ActivationMeter.report`); also
    a decorator, deciding at each call.

    Nothing happens while no meter is active (a meter entered inside the block sees its tensors
    unlabelled): the label is a ContextVar, which torch.compile cannot trace, so an unconditional set
    would break every compiled layer into pieces at each label. (A small class, not a generator context
    manager: 8 labels per layer forward, each a generator's few microseconds.)
    """

    __slots__ = ("label", "_tokens")

    def __init__(self, label: str) -> None:
        self.label, self._tokens = label, None

    def _recreate_cm(self) -> "saved_as":
        return saved_as(self.label)

    def __enter__(self) -> None:
        if _active_meters:
            # One instance may be entered again inside itself, or by several threads (a module-level
            # label): a stack of the ContextVar's tokens per thread, each reset where it was set.
            if self._tokens is None:
                self._tokens = {}
            self._tokens.setdefault(threading.get_ident(), []).append(_label.set(self.label))
        elif self._tokens is not None:
            self._tokens.setdefault(threading.get_ident(), []).append(None)

    def __exit__(self, *exc) -> None:
        if self._tokens is not None:
            stack = self._tokens.get(threading.get_ident())
            token = stack.pop() if stack else None
            if token is not None:
                _label.reset(token)


def _storage_id(t: torch.Tensor) -> Optional[Tuple[tuple, StorageWeakRef]]:
    """(key, weak reference) of ``t``'s storage; None for a tensor without one (sparse, nested, a wrapper
    subclass such as DTensor). The key is the C++ storage object's address (``untyped_storage()`` is a
    new Python object each call; the storage it wraps is not), not its data's: every meta or fake storage
    has data address 0. It is unique among live storages only: a freed storage's address is handed to
    the next one. So whatever is kept per key also keeps a weak reference to the storage itself: while
    it has not ``expired()``, the storage at that address is still the one recorded. It keeps no memory
    alive."""
    try:
        ref = StorageWeakRef(t.untyped_storage())
    except (NotImplementedError, RuntimeError):   # no storage of its own ("Cannot access storage of ...")
        return None
    return (t.device, ref.cdata), ref


def name_storage(tensor: torch.Tensor, label: str) -> torch.Tensor:
    """Name ``tensor``'s storage ``label`` for active meters (it wins over :func:`saved_as`); returns
    ``tensor``."""
    if _active_meters:
        ident = _storage_id(tensor)
        if ident is not None:
            _storage_names[ident[0]] = (label, ident[1])
    return tensor


def _storage_name(key: tuple) -> Optional[str]:
    label, ref = _storage_names.get(key, (None, None))
    return label if ref is not None and not ref.expired() else None


@dataclasses.dataclass
class SavedTensorRecord:
    """One distinct storage saved for backward.

    ``label``: the meter's name for it (:func:`name_storage`, else :func:`saved_as`); ``shape``, ``dtype``:
    of the first saved tensor seen on it. ``bytes`` is the whole storage (what stays alive); ``view_bytes``
    the bytes of the distinct saved tensors that view it (at most ``bytes``). ``view_bytes < bytes`` means a
    saved view (e.g. a sequence shard sliced out of a full tensor) pins a larger storage.
    """

    label: str
    shape: tuple
    dtype: torch.dtype
    bytes: int
    view_bytes: int = 0

    @property
    def pins_larger_storage(self) -> bool:
        """``view_bytes < bytes``: the saved tensors view only part of the storage, yet keep all of it alive."""
        return self.view_bytes < self.bytes


def _is_parameter(t: torch.Tensor) -> bool:
    return isinstance(t, nn.Parameter) or isinstance(getattr(t, "_base", None), nn.Parameter)


# The meters entered in this thread, innermost last. saved_tensors_hooks only run the innermost pair
# (and, like autograd's hook stack, per thread), so the innermost meter records for all of them.
_thread = threading.local()


def _meter_stack() -> List["ActivationMeter"]:
    if not hasattr(_thread, "meters"):
        _thread.meters = []
    return _thread.meters


def _pack_checked(t: torch.Tensor) -> Tuple[torch.Tensor, int]:
    # detach: a packed value referring to the tensor itself would form a reference cycle (the saved
    # output -> its grad_fn -> the saved output) and keep activations alive until gc runs. The version:
    # with saved-tensor hooks set autograd skips its own check that a saved tensor was not modified in
    # place, so the hooks check it (a measuring tool must not turn that error into a wrong gradient).
    return t.detach(), t._version


def _unpack_checked(packed: Tuple[torch.Tensor, int]) -> torch.Tensor:
    t, version = packed
    if t._version != version:
        raise RuntimeError(f"one of the variables needed for gradient computation has been modified by an "
                           f"inplace operation: [{t.dtype} {list(t.shape)}] is at version {t._version}; expected "
                           f"version {version} instead (checked by seqpar.memory's saved-tensor hooks, as autograd "
                           f"checks it without them)")
    return t


def _dense_bytes(t: torch.Tensor) -> int:
    """Bytes of a tensor without a storage to measure: its values, as if dense (sparse: nnz values and indices)."""
    if t.layout in (torch.sparse_coo,):
        return t._values().numel() * t.element_size() + t._indices().numel() * t._indices().element_size()
    try:
        return t.numel() * t.element_size()
    except RuntimeError:
        return 0


_top_saved_tensors_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)


def _meter_hooks_on_top() -> bool:
    """Whether the innermost saved-tensor hooks of this thread are a meter's (without torch's query, older
    torch: whether any meter is active)."""
    if _top_saved_tensors_hooks is None:
        return bool(_active_meters)
    top = _top_saved_tensors_hooks(False)
    return top is not None and top[0] is ActivationMeter._pack


def not_counted():
    """A block whose saved tensors the active meters do not count, for code that counts what it keeps
    itself (:func:`count_as_saved`); nothing changes where a meter's hooks are not the innermost of this
    thread. Such a block inside another tool's hooks (torch's checkpoint around a recomputed layer) must
    leave them alone: that tool's re-run in backward, with no meter, would otherwise see saves its
    forward did not (torch's CheckpointError), and a meter under them sees nothing anyway."""
    if not _active_meters or not _meter_hooks_on_top():
        return contextlib.nullcontext()
    return torch.autograd.graph.saved_tensors_hooks(_pack_checked, _unpack_checked)


def count_as_saved(*tensors: torch.Tensor) -> None:
    """Count ``tensors`` in the active meters as saved for backward, where something other than autograd's
    saved tensors keeps them alive until backward (a checkpoint region's inputs, which its re-run reads),
    as the meters' hooks count saved tensors: each storage once, parameters excluded. Nothing where a
    meter's hooks are not the innermost of this thread: other hooks entered inside the meter
    (``save_on_cpu``) take those tensors, and the meter counts none of what they take."""
    if _meter_hooks_on_top():
        for t in tensors:
            ActivationMeter._pack(t)


class ActivationMeter:
    """Context manager measuring the bytes saved for backward inside it (params excluded, storages once).

    Each saved storage counts whole: a saved view keeps all of its storage alive (:meth:`report` says
    when a view pins a larger storage). A storage counts once however often it is saved (views of it,
    later graphs saving it again while it lives); a new storage counts even where a freed one's address
    is reused (a loop of forward / backward inside one meter counts every micro-batch's storages). The
    meter keeps only weak references: it keeps nothing alive. Meters nest: an inner meter's tensors
    count in every enclosing meter too. Like any ``saved_tensors_hooks``, the innermost hooks take the
    saved tensors: a meter shadows hooks entered before it (e.g. ``torch.utils.checkpoint``'s
    non-reentrant mode: enter meters outside such regions; ``save_on_cpu``: that forward offloads
    nothing), and hooks entered inside a meter (``save_on_cpu`` again) take the tensors from it: the
    meter counts none of them.

    Example::

        with seqpar.memory.ActivationMeter() as meter:
            y = layer(x)
        meter.bytes, print(meter.report())
    """

    def __init__(self) -> None:
        self.records: List[SavedTensorRecord] = []
        # storage key -> (weak reference to the storage recorded there, its record, its distinct views)
        self._by_storage: Dict[tuple, Tuple[StorageWeakRef, SavedTensorRecord, set]] = {}
        self._hooks = None

    def __getstate__(self) -> dict:
        """``copy.copy`` / ``deepcopy`` / pickle keep the records (what was measured), not the weak references
        to the storages (a copied ``StorageWeakRef`` shares its C++ handle: each copy freed it again, a heap
        corruption at exit) nor the hooks; a copy measures anew when entered. TypeError inside the block."""
        if self._hooks is not None:
            raise TypeError("an active ActivationMeter can't be copied or pickled: copy it after its block")
        return {"records": list(self.records), "_by_storage": {}, "_hooks": None}

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
        given, in a column headed ``unit_name``), then the bytes per label and the total; storages pinned
        by a smaller saved view are marked ``*`` and listed at the end."""
        unit = (lambda n: f" {n / unit_bytes:>10.3f}") if unit_bytes else (lambda n: "")
        head = f"{'saved tensor':<30} {'shape':<22} {'dtype':<15} {'bytes':>13}" + (f" {unit_name:>10}" if unit_bytes else "")
        lines = [head]
        for r in self.records:
            mark = " *" if r.pins_larger_storage else ""
            lines.append(f"{r.label:<30} {str(list(r.shape)):<22} {str(r.dtype):<15} {r.bytes:>13,}" + unit(r.bytes)
                         + mark)
        lines.append("per label:")
        for label, n in list(self.by_label().items()) + [("total", self.bytes)]:
            lines.append(f"  {label:<28} {'':<22} {'':<15} {n:>13,}" + unit(n))
        for r in self.records:
            if r.pins_larger_storage:
                lines.append(f"* {r.label}: a saved view of {r.view_bytes:,} bytes pins its whole storage of "
                             f"{r.bytes:,} bytes (counted whole: autograd keeps it alive)")
        return "\n".join(lines)

    def _record(self, t: torch.Tensor) -> None:
        if is_traceable_wrapper_subclass(t):   # DTensor, ...: the tensors it holds
            for name in t.__tensor_flatten__()[0]:
                inner = getattr(t, name)
                if isinstance(inner, torch.Tensor):
                    self._record(inner)
            return
        if t._is_zerotensor():   # forward AD's efficient zero tangent: no memory
            return
        ident = _storage_id(t)
        if ident is None:        # sparse, nested: its bytes, this once (no storage to dedup by)
            self.records.append(SavedTensorRecord(_label.get(), tuple(t.shape), t.dtype, _dense_bytes(t),
                                                  _dense_bytes(t)))
            return
        key, ref = ident
        seen = self._by_storage.get(key)
        if seen is None or seen[0].expired():  # never seen, or a freed storage's address reused: new
            label = _storage_name(key) or _label.get()
            seen = (ref, SavedTensorRecord(label, tuple(t.shape), t.dtype, t.untyped_storage().nbytes()), set())
            self._by_storage[key] = seen
            self.records.append(seen[1])
        _, record, views = seen
        view = (t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
        if view not in views:
            views.add(view)
            record.view_bytes = min(record.bytes, record.view_bytes + t.numel() * t.element_size())

    @staticmethod
    def _pack(t: torch.Tensor) -> Tuple[torch.Tensor, int]:
        if not _is_parameter(t):
            for meter in _meter_stack():
                meter._record(t)
        return _pack_checked(t)

    _unpack = staticmethod(_unpack_checked)

    def __enter__(self) -> "ActivationMeter":
        global _active_meters
        if self._hooks is not None:
            raise RuntimeError("this ActivationMeter is already active")
        hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        # First, before any global changes: entering raises where saved-tensor hooks are disabled
        # (torch.func transforms), and a meter counted active then recorded every later meter's tensors.
        hooks.__enter__()
        self._hooks = hooks
        _active_meters += 1
        _meter_stack().append(self)
        return self

    def __exit__(self, *exc) -> None:
        global _active_meters
        self._hooks.__exit__(*exc)
        self._hooks = None
        stack = _meter_stack()
        stack.remove(self)
        _active_meters -= 1
        if not _active_meters:
            _storage_names.clear()
