"""TransformerConfig: the hyper-parameters of a seqpar transformer layer, validated on construction."""
from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Optional

import torch

from .memory import RECOMPUTE_POLICIES
from .ops.registry import DTYPES, check_eps, check_flags, validate_backend
from .ops.rotary import LinearScaling, RopeScaling, YarnScaling, check_rope_scaling, check_theta
from .random import as_int, dropout_threshold, is_int

#: ``TransformerConfig.activation`` values: the MLP's GeLU (erf or tanh) or SwiGLU (gate and up).
ACTIVATIONS = ("gelu", "gelu_tanh", "swiglu")
#: ``TransformerConfig.normalization`` values.
NORMALIZATIONS = ("layernorm", "rmsnorm")
#: ``TransformerConfig.position_embedding`` values: a learned [max_seq_len, h] table, or rotary (no table).
POSITION_EMBEDDINGS = ("learned", "rope")
#: ``TransformerConfig.rope_theta``'s default, the RoPE base (HF Llama's ``rope_theta`` default).
DEFAULT_ROPE_THETA = 10000.0
#: What a layer computes in: fp32 / fp16 / bf16 on every backend, fp64 (for gradcheck) on the torch backend
#: (the fused ops' dtypes, :data:`seqpar.ops.registry.DTYPES`); others are rejected when the config is built.
PARAMS_DTYPES = DTYPES


def _is_positive_real(value) -> bool:
    """A finite real number > 0, Python or numpy (np.float32 too), not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def _check_prob(name: str, value) -> None:
    dropout_threshold(value, name)  # [0, 1) with round(p * 256) < 256: the mask's byte threshold


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """Hyper-parameters of a GPT layer (the paper's notation: h hidden size, a heads, ffn 4h by default).

    Frozen: every field is validated once, when the config is built; invalid values raise ValueError
    naming them. Derive variants with ``dataclasses.replace(cfg, field=value)`` (validated again).
    ``ffn_hidden_size`` holds the resolved value (None becomes 4 * hidden_size when the config is
    built), so ``replace`` keeps it, as Megatron's TransformerConfig does: pass ``ffn_hidden_size=None``
    to derive it from a new hidden size::

        cfg = TransformerConfig(hidden_size=32, num_attention_heads=4)      # ffn_hidden_size 128
        dataclasses.replace(cfg, hidden_size=64).ffn_hidden_size                          # 128
        dataclasses.replace(cfg, hidden_size=64, ffn_hidden_size=None).ffn_hidden_size    # 256

    ``recompute``: "none" keeps every activation; "selective" recomputes only the attention core
    (QK^T, softmax, softmax dropout, attention over V) in backward; "full" keeps only the layer input.
    ``hidden_dropout``, ``attention_dropout``: probabilities in [0, 1); the effective probability is
    ``round(p * 256) / 256`` (:func:`seqpar.random.effective_dropout_p`: 0.1 drops 26/256), and a p with
    ``round(p * 256) = 256`` is rejected when the config is built.
    ``overlap_comm``: under sequence parallelism, overlap the all-gather / reduce-scatter with the
    GEMMs (:func:`seqpar.ops.all_gather_matmul`), where the op judges it helps. On CPU (gloo) the
    transfers need CPU time beside the GEMMs: with more ranks than cores, turn it off (measured with
    bench/bench_overlap.py on 2 cores: 1.04-1.10x faster at t=2, 0.90-0.95x at t=4).
    ``sequence_parallel`` with no tensor parallelism (``tp_group=None`` or a one-rank group, t = 1)
    is accepted and computes exactly what ``sequence_parallel=False`` does: each rank's shard is the
    whole sequence and g / g-bar are the identity (``python -m seqpar bench`` runs it at t = 1).
    ``params_dtype``: torch.float32, torch.float16 or torch.bfloat16; torch.float64 (for gradcheck) on the
    torch backend only.

    Architecture (the defaults are the paper's GPT layer; Llama's block is ``normalization="rmsnorm",
    activation="swiglu", num_query_groups=g, position_embedding="rope", add_bias_linear=False`` and
    dropout 0):

    ``normalization``: "layernorm" (weight and bias) or "rmsnorm" (weight only, HF LlamaRMSNorm's
    rounding; ``layernorm_epsilon`` is its eps).
    ``activation``: "gelu" (erf), "gelu_tanh", or "swiglu": ``silu(gate) * up`` where dense_h_to_4h
    projects to gate and up (2 ffn_hidden_size rows: gate, then up).
    ``num_query_groups``: grouped-query attention's number of k/v heads g (None: one per query head,
    multi-head attention); it must divide num_attention_heads, and the tensor-parallel size must divide
    it (checked when the layer is built). Query head i uses k/v head ``i // (heads / g)``.
    ``position_embedding``: "learned" (GPTModel adds a position table to the embeddings) or "rope"
    (rotary embeddings applied to q and k in every layer at their global sequence positions, with base
    ``rope_theta``; the head dim must be even). ``rope_theta`` other than 10000 with "learned" positions
    is a ValueError (it would be ignored).
    ``rope_scaling``: None (the default RoPE frequencies), or their linear scaling
    (:class:`seqpar.ops.LinearScaling`, HF ``rope_type="linear"``), or Llama 3.1's
    (:class:`seqpar.ops.RopeScaling`, HF ``"llama3"``: Llama 3.1 / 3.2 / 3.3), or YaRN's
    (:class:`seqpar.ops.YarnScaling`, HF ``"yarn"``: its attention factor scales the attention's softmax,
    :attr:`attention_softmax_scale`); "rope" positions only.
    ``add_bias_linear``: biases on the four linear layers (QKV, projection, fc1, fc2).
    ``add_qkv_bias``: a bias on the QKV linear even without ``add_bias_linear`` (Qwen2's block: q, k and v
    biases, none on the projection or the MLP; Megatron's ``add_qkv_bias``). The QKV linear has a bias
    when either is True.
    ``kv_channels``: the head dim d (Megatron's name, HF's ``head_dim``); None: hidden_size /
    num_attention_heads, which must then divide. Another d decouples the attention's width a d from h
    (Qwen3-0.6B / 4B / 32B and Mistral Nemo: d = 128 with a d != h): the QKV linear is [(a + 2g) d, h],
    the projection [h, a d].
    ``qk_layernorm``: normalise each head of q and k over its d channels before RoPE (Megatron's
    ``qk_layernorm``, Qwen3's ``q_norm`` / ``k_norm``): the ``normalization`` norm with
    ``layernorm_epsilon``, one weight [d] (and bias with LayerNorm) for q and one for k, shared by the
    heads, replicated over tensor parallelism (each rank normalises its heads; the gradients are summed).
    ``init_method_std``: the weights' init N(0, std): every matrix, and GPTModel's embedding tables and
    untied head (Megatron's ``init_method_std``, HF's ``initializer_range``; biases start at 0, norms at 1).
    ``output_layer_init_std``: the std of the two matrices that write into the residual stream (the
    attention projection and fc2). None: ``init_method_std / sqrt(2 L)`` in a GPTModel of L layers
    (Megatron's scaled output init, GPT-2's ``c_proj`` init), which it passes to its layers' configs, and
    ``init_method_std`` in a TransformerLayer built on its own (it doesn't know L).
    Dropout combines with every choice: with RMSNorm the hidden dropout runs as an unfused
    bias-dropout-add before the RMSNorm (the same regenerated masks), the attention dropout is the
    attention core's, whatever the other knobs.
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
    normalization: str = "layernorm"
    num_query_groups: Optional[int] = None
    position_embedding: str = "learned"
    rope_theta: float = DEFAULT_ROPE_THETA
    add_bias_linear: bool = True
    init_method_std: float = 0.02
    output_layer_init_std: Optional[float] = None
    rope_scaling: Optional[LinearScaling | RopeScaling | YarnScaling] = None
    add_qkv_bias: bool = False
    kv_channels: Optional[int] = None
    qk_layernorm: bool = False

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_attention_heads", "ffn_hidden_size", "num_query_groups", "kv_channels"):
            object.__setattr__(self, name, as_int(getattr(self, name)))   # numpy ints held as ints, as floats are
        for name in ("hidden_size", "num_attention_heads"):
            value = getattr(self, name)
            if not is_int(value) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.kv_channels is not None and (not is_int(self.kv_channels) or self.kv_channels <= 0):
            raise ValueError(f"kv_channels must be None or a positive int, got {self.kv_channels!r}")
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by "
                             f"num_attention_heads {self.num_attention_heads} (set kv_channels, the head dim, "
                             f"for heads of another width)")
        if self.ffn_hidden_size is None:
            object.__setattr__(self, "ffn_hidden_size", 4 * self.hidden_size)  # frozen: set once, here
        if not is_int(self.ffn_hidden_size) or self.ffn_hidden_size <= 0:
            raise ValueError(f"ffn_hidden_size must be a positive int, got {self.ffn_hidden_size!r}")
        _check_prob("hidden_dropout", self.hidden_dropout)
        _check_prob("attention_dropout", self.attention_dropout)
        check_eps(self.layernorm_epsilon, "layernorm_epsilon")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"unknown activation {self.activation!r}; expected one of {ACTIVATIONS}")
        if self.recompute not in RECOMPUTE_POLICIES:
            raise ValueError(f"unknown recompute {self.recompute!r}; expected one of {RECOMPUTE_POLICIES}")
        validate_backend(self.backend)
        if self.params_dtype not in PARAMS_DTYPES:
            raise ValueError(f"params_dtype must be one of {', '.join(map(str, PARAMS_DTYPES))}, "
                             f"got {self.params_dtype!r}")
        check_flags(sequence_parallel=self.sequence_parallel, overlap_comm=self.overlap_comm,
                    add_bias_linear=self.add_bias_linear, add_qkv_bias=self.add_qkv_bias,
                    qk_layernorm=self.qk_layernorm)
        if self.normalization not in NORMALIZATIONS:
            raise ValueError(f"unknown normalization {self.normalization!r}; expected one of {NORMALIZATIONS}")
        groups = self.num_query_groups
        if groups is not None:
            if not is_int(groups) or groups <= 0:
                raise ValueError(f"num_query_groups must be None or a positive int, got {groups!r}")
            if self.num_attention_heads % groups:
                raise ValueError(f"num_query_groups {groups} does not divide num_attention_heads "
                                 f"{self.num_attention_heads}")
        if self.position_embedding not in POSITION_EMBEDDINGS:
            raise ValueError(f"unknown position_embedding {self.position_embedding!r}; expected one of "
                             f"{POSITION_EMBEDDINGS}")
        theta = self.rope_theta
        check_theta(theta, "rope_theta")
        if self.position_embedding == "rope" and self.head_dim % 2:
            raise ValueError(f"position_embedding='rope' needs an even head dim, got {self._head_dim_source()} = "
                             f"{self.head_dim}")
        if self.position_embedding == "learned" and theta != DEFAULT_ROPE_THETA:
            raise ValueError(f"rope_theta={theta!r} with position_embedding='learned': rope_theta is only used with "
                             f"position_embedding='rope'")
        if self.rope_scaling is not None:
            check_rope_scaling(self.rope_scaling)
            if isinstance(self.rope_scaling, YarnScaling):
                self.rope_scaling.correction_range(self.head_dim, theta)   # ValueError for a theta it can't take
            if self.position_embedding != "rope":
                raise ValueError(f"rope_scaling={self.rope_scaling!r} with position_embedding="
                                 f"{self.position_embedding!r}: rope_scaling is only used with position_embedding='rope'")
        if not _is_positive_real(self.init_method_std):
            raise ValueError(f"init_method_std must be a positive finite float, got {self.init_method_std!r}")
        if self.output_layer_init_std is not None and not _is_positive_real(self.output_layer_init_std):
            raise ValueError(f"output_layer_init_std must be a positive finite float or None, got "
                             f"{self.output_layer_init_std!r}")
        # Held as plain floats: 0 and 0.0 (or np.float64(0.1) and 0.1) give one config, one repr, and the
        # same value to the ranks' agreement check.
        for name in ("hidden_dropout", "attention_dropout", "layernorm_epsilon", "rope_theta", "init_method_std"):
            object.__setattr__(self, name, float(getattr(self, name)))
        if self.output_layer_init_std is not None:
            object.__setattr__(self, "output_layer_init_std", float(self.output_layer_init_std))

    @property
    def output_init_std(self) -> float:
        """The std the attention projection and fc2 are initialised with in a layer of this config:
        ``output_layer_init_std``, or ``init_method_std`` when None (GPTModel resolves None first)."""
        return self.init_method_std if self.output_layer_init_std is None else self.output_layer_init_std

    @property
    def qkv_bias(self) -> bool:
        """Whether the QKV linear has a bias: ``add_bias_linear or add_qkv_bias``."""
        return self.add_bias_linear or self.add_qkv_bias

    @property
    def attention_softmax_scale(self) -> Optional[float]:
        """The attention's softmax scale: None (the default, 1 / sqrt(d)), or with YaRN's
        :class:`seqpar.ops.YarnScaling` ``attention_scaling**2 / sqrt(d)`` (HF scales cos and sin, so q and
        k, by it)."""
        if not isinstance(self.rope_scaling, YarnScaling):
            return None
        return self.rope_scaling.attention_scaling ** 2 / math.sqrt(self.head_dim)

    @property
    def head_dim(self) -> int:
        """d: ``kv_channels``, or h / a when None."""
        return self.hidden_size // self.num_attention_heads if self.kv_channels is None else self.kv_channels

    def _head_dim_source(self) -> str:
        if self.kv_channels is not None:
            return "kv_channels"
        return f"hidden_size {self.hidden_size} / num_attention_heads {self.num_attention_heads}"

    @property
    def kv_heads(self) -> int:
        """g, the number of k/v heads: ``num_query_groups``, or ``num_attention_heads`` when None."""
        return self.num_attention_heads if self.num_query_groups is None else self.num_query_groups

    def check_tensor_parallel(self, tp_size: int) -> None:
        """Raise ValueError unless heads, k/v groups and ffn_hidden_size split evenly over ``tp_size`` ranks."""
        if self.num_attention_heads % tp_size:
            raise ValueError(f"num_attention_heads {self.num_attention_heads} is not divisible by the "
                             f"tensor-parallel size {tp_size}")
        if self.kv_heads % tp_size:
            raise ValueError(f"num_query_groups {self.kv_heads} is not divisible by the tensor-parallel size "
                             f"{tp_size}")
        if self.ffn_hidden_size % tp_size:
            raise ValueError(f"ffn_hidden_size {self.ffn_hidden_size} is not divisible by the "
                             f"tensor-parallel size {tp_size}")
