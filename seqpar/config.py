"""TransformerConfig: the hyper-parameters of a seqpar transformer layer, validated on construction."""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch

from .memory import RECOMPUTE_POLICIES
from .ops.registry import validate_backend
from .random import dropout_threshold

ACTIVATIONS = ("gelu", "gelu_tanh")
#: What the fused kernels and the layer compute in (fp64 and others are rejected when the config is built).
PARAMS_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check_prob(name: str, value) -> None:
    dropout_threshold(value, name)  # [0, 1) with round(p * 256) < 256: the mask's byte threshold


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """Hyper-parameters of a GPT layer (the paper's notation: h hidden size, a heads, ffn 4h by default).

    Frozen: every field is validated once, when the config is built; invalid values raise ValueError
    naming them. Derive variants with ``dataclasses.replace(cfg, field=value)`` (validated again).

    ``recompute``: "none" keeps every activation; "selective" recomputes only the attention core
    (QK^T, softmax, softmax dropout, attention over V) in backward; "full" keeps only the layer input.
    ``hidden_dropout``, ``attention_dropout``: probabilities in [0, 1); the effective probability is
    ``round(p * 256) / 256`` (:func:`seqpar.random.effective_dropout_p`: 0.1 drops 26/256), and a p with
    ``round(p * 256) = 256`` is rejected when the layer builds its dropout.
    ``overlap_comm``: under sequence parallelism, overlap the all-gather / reduce-scatter with the
    GEMMs (:func:`seqpar.ops.all_gather_matmul`), where the op judges it helps. On CPU (gloo) the
    transfers need CPU time beside the GEMMs: with more ranks than cores, turn it off (measured with
    bench/bench_overlap.py on 2 cores: 1.04-1.10x faster at t=2, 0.90-0.95x at t=4).
    ``sequence_parallel`` with no tensor parallelism (``tp_group=None`` or a one-rank group, t = 1)
    is accepted and computes exactly what ``sequence_parallel=False`` does: each rank's shard is the
    whole sequence and g / g-bar are the identity (``python -m seqpar bench`` runs it at t = 1).
    ``params_dtype``: torch.float32, torch.float16 or torch.bfloat16.
    """

    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: Optional[int] = None
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    layernorm_epsilon: float = 1e-5
    activation: str = "gelu"
    sequence_parallel: bool = False
    recompute: str = "none"
    backend: str = "auto"
    params_dtype: torch.dtype = torch.float32
    overlap_comm: bool = True

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_attention_heads"):
            value = getattr(self, name)
            if not _is_int(value) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by "
                             f"num_attention_heads {self.num_attention_heads}")
        if self.ffn_hidden_size is None:
            object.__setattr__(self, "ffn_hidden_size", 4 * self.hidden_size)  # frozen: set once, here
        if not _is_int(self.ffn_hidden_size) or self.ffn_hidden_size <= 0:
            raise ValueError(f"ffn_hidden_size must be a positive int, got {self.ffn_hidden_size!r}")
        _check_prob("hidden_dropout", self.hidden_dropout)
        _check_prob("attention_dropout", self.attention_dropout)
        eps = self.layernorm_epsilon
        if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not (math.isfinite(eps) and eps > 0):
            raise ValueError(f"layernorm_epsilon must be a finite positive float, got {eps!r}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"unknown activation {self.activation!r}; expected one of {ACTIVATIONS}")
        if self.recompute not in RECOMPUTE_POLICIES:
            raise ValueError(f"unknown recompute {self.recompute!r}; expected one of {RECOMPUTE_POLICIES}")
        validate_backend(self.backend)
        if self.params_dtype not in PARAMS_DTYPES:
            raise ValueError(f"params_dtype must be one of {', '.join(map(str, PARAMS_DTYPES))}, "
                             f"got {self.params_dtype!r}")
        for name in ("sequence_parallel", "overlap_comm"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")

    @property
    def head_dim(self) -> int:
        """d = h / a."""
        return self.hidden_size // self.num_attention_heads

    def check_tensor_parallel(self, tp_size: int) -> None:
        """Raise ValueError unless heads and ffn_hidden_size split evenly over ``tp_size`` ranks."""
        if self.num_attention_heads % tp_size:
            raise ValueError(f"num_attention_heads {self.num_attention_heads} is not divisible by the "
                             f"tensor-parallel size {tp_size}")
        if self.ffn_hidden_size % tp_size:
            raise ValueError(f"ffn_hidden_size {self.ffn_hidden_size} is not divisible by the "
                             f"tensor-parallel size {tp_size}")
