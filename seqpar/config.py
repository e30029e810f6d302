"""TransformerConfig: the hyper-parameters of a seqpar transformer layer, validated on construction."""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from .memory import RECOMPUTE_POLICIES
from .ops.registry import validate_backend

ACTIVATIONS = ("gelu", "gelu_tanh")


def _check_prob(name: str, value) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0.0 <= value < 1.0:
        raise ValueError(f"{name} must be a float in [0, 1), got {value!r}")


@dataclasses.dataclass
class TransformerConfig:
    """Hyper-parameters of a GPT layer (paper.md). Invalid values raise ValueError naming them.

    ``recompute``: "none" keeps every activation; "selective" recomputes only the attention core
    (QK^T, softmax, softmax dropout, attention over V) in backward; "full" keeps only the layer input.
    ``hidden_dropout``, ``attention_dropout``: probabilities in [0, 1); the effective probability is
    ``round(p * 256) / 256`` (:func:`seqpar.random.effective_dropout_p`: 0.1 drops 26/256), and a p with
    ``round(p * 256) = 256`` is rejected when the layer builds its dropout.
    ``overlap_comm``: under sequence parallelism, overlap the all-gather / reduce-scatter with the
    GEMMs (:func:`seqpar.ops.all_gather_matmul`), where the op judges it helps. On CPU (gloo) the
    transfers need CPU time beside the GEMMs: with more ranks than cores, turn it off (measured with
    bench/bench_overlap.py on 2 cores: 1.04-1.10x faster at t=2, 0.90-0.95x at t=4).
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
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by "
                             f"num_attention_heads {self.num_attention_heads}")
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        if not isinstance(self.ffn_hidden_size, int) or self.ffn_hidden_size <= 0:
            raise ValueError(f"ffn_hidden_size must be a positive int, got {self.ffn_hidden_size!r}")
        _check_prob("hidden_dropout", self.hidden_dropout)
        _check_prob("attention_dropout", self.attention_dropout)
        if not isinstance(self.layernorm_epsilon, (int, float)) or not self.layernorm_epsilon > 0:
            raise ValueError(f"layernorm_epsilon must be a positive float, got {self.layernorm_epsilon!r}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"unknown activation {self.activation!r}; expected one of {ACTIVATIONS}")
        if self.recompute not in RECOMPUTE_POLICIES:
            raise ValueError(f"unknown recompute {self.recompute!r}; expected one of {RECOMPUTE_POLICIES}")
        validate_backend(self.backend)
        if not isinstance(self.params_dtype, torch.dtype) or not self.params_dtype.is_floating_point:
            raise ValueError(f"params_dtype must be a floating torch.dtype, got {self.params_dtype!r}")
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
