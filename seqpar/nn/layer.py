"""The GPT transformer layer of paper.md with tensor + sequence parallelism and selective recompute.

Forward, per rank (t = TP size, H = a / t local heads, d = h / a; shapes without SP in brackets)::

    x          [s/t, b, h]   ([s, b, h])
    a1 = LN1(x)                                          LayerNorm, sequence-sharded under SP
    qkv        [s, b, 3Hd]   column-parallel (g / f before it)
    o  = attention_core(q, k, v)  [b, H, s, d]           causal; recomputed in backward if "selective"
    x2, a2 = bias_dropout_add_layer_norm(o W_proj^T, b_proj, x)   row-parallel (g-bar / f-bar), fused
    y  = x2 + dropout(gelu(a2 W_1^T + b_1) W_2^T + b_2)  column- then row-parallel MLP
    y          [s/t, b, h]   ([s, b, h])

Dropout masks come from seqpar.random with global coordinates, so results do not depend on t or SP.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Tuple

import torch
from torch import nn

from .. import random as sp_random
from ..config import TransformerConfig
from ..memory import name_storage, saved_as
from ..ops.attention_core import attention_core, select_backend
from ..ops.dropout import DropoutSpec, bias_dropout_add
from ..parallel.state import ProcessGroup, group_rank, group_size
from ..recompute import checkpoint
from .layernorm import LayerNorm
from .linear import ColumnParallelLinear, RowParallelLinear


@dataclasses.dataclass
class PendingResidual:
    """A layer's final bias-dropout-add, not yet applied: ``residual + dropout(x + bias)``.

    Returned by :meth:`TransformerLayer.forward_after_input_layernorm` so that the next LayerNorm
    (the next layer's input LayerNorm, or GPTModel's final one) can fuse with it.
    """

    x: torch.Tensor
    bias: Optional[torch.Tensor]
    residual: torch.Tensor
    spec: DropoutSpec

    def apply(self) -> torch.Tensor:
        """The layer output ``residual + dropout(x + bias)``."""
        return bias_dropout_add(self.x, self.bias, self.residual, self.spec)

    def apply_with_layer_norm(self, norm: LayerNorm) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(norm(output), output)`` in one fused op."""
        return norm.after_bias_dropout_add(self.x, self.bias, self.residual, self.spec)


def _activation(name: str):
    if name == "gelu":
        return nn.functional.gelu
    return lambda x: nn.functional.gelu(x, approximate="tanh")


class ParallelAttention(nn.Module):
    """QKV projection (column-parallel), attention core, output projection (row-parallel, bias skipped)."""

    def __init__(self, config: TransformerConfig, tp_group: ProcessGroup, device=None):
        super().__init__()
        h, dtype = config.hidden_size, config.params_dtype
        self.config, self.tp_group = config, tp_group
        self.local_heads = config.num_attention_heads // group_size(tp_group)
        common = dict(tp_group=tp_group, sequence_parallel=config.sequence_parallel,
                      overlap_comm=config.overlap_comm, device=device, dtype=dtype)
        self.query_key_value = ColumnParallelLinear(h, 3 * h, partition_blocks=3, **common)
        self.dense = RowParallelLinear(h, h, skip_bias_add=True, **common)

    def forward(self, a1: torch.Tensor, attention_seed: int):
        """a1 [s/t or s, b, h] -> (projection output without bias, bias) as RowParallelLinear gives them."""
        cfg = self.config
        with saved_as("QKV input"):
            qkv = name_storage(self.query_key_value(a1), "Q, K, V")
        s, b = qkv.shape[0], qkv.shape[1]
        heads, d = self.local_heads, cfg.head_dim
        # Views of the one QKV storage: [s, b, 3, H, d] -> 3 x [b, H, s, d]; nothing is copied.
        q, k, v = qkv.view(s, b, 3, heads, d).permute(2, 1, 3, 0, 4).unbind(0)
        impl = select_backend(q, k, v, causal=True, backend=cfg.backend)
        p = cfg.attention_dropout if self.training else 0.0
        # Head-major global dropout rows: this rank's first head is rank * H (seqpar.random).
        row_offset = group_rank(self.tp_group) * heads * b * s

        def core(q, k, v):
            return attention_core(q, k, v, causal=True, dropout_p=p, seed=attention_seed if p else None,
                                  training=self.training, backend=impl.name, row_offset=row_offset)

        with saved_as("attention core"):
            if cfg.recompute == "selective" and not impl.recompute_free:
                o = checkpoint(core, q, k, v)
            else:
                o = core(q, k, v)
        context = o.permute(2, 0, 1, 3).reshape(s, b, heads * d)
        with saved_as("projection input"):
            return self.dense(context)


class ParallelMLP(nn.Module):
    """h -> ffn (column-parallel) -> activation -> h (row-parallel, bias skipped)."""

    def __init__(self, config: TransformerConfig, tp_group: ProcessGroup, device=None):
        super().__init__()
        h, f = config.hidden_size, config.ffn_hidden_size
        common = dict(tp_group=tp_group, sequence_parallel=config.sequence_parallel,
                      overlap_comm=config.overlap_comm, device=device, dtype=config.params_dtype)
        self.dense_h_to_4h = ColumnParallelLinear(h, f, **common)
        self.dense_4h_to_h = RowParallelLinear(f, h, skip_bias_add=True, **common)
        self.activation = _activation(config.activation)

    def forward(self, a2: torch.Tensor):
        with saved_as("fc1 input"):
            hidden = self.dense_h_to_4h(a2)
        with saved_as("GeLU input"):
            hidden = self.activation(hidden)
        with saved_as("fc2 input"):
            return self.dense_4h_to_h(hidden)


class TransformerLayer(nn.Module):
    """One pre-LayerNorm GPT layer with tensor + sequence parallelism and activation recomputation.

    Args:
        config: :class:`seqpar.TransformerConfig`.
        tp_group: tensor-parallel process group (None: no tensor parallelism).
        device: where the parameters live.
        layer_number: this layer's identity in the dropout RNG (GPTModel numbers its layers).

    ``forward(x)``: x [s_local, b, h] of ``config.params_dtype`` (s_local = s / t with sequence
    parallelism, else s) -> y of the same shape. Causal self-attention.

    Parameters are initialised deterministically from ``seqpar.manual_seed``'s seed and
    ``layer_number`` on the *unsharded* tensors, so any t starts from the same model.
    """

    def __init__(self, config: TransformerConfig, tp_group: ProcessGroup = None, device=None,
                 layer_number: int = 0):
        super().__init__()
        if not isinstance(config, TransformerConfig):
            raise ValueError(f"config must be a seqpar.TransformerConfig, got {type(config).__name__}")
        if not isinstance(layer_number, int) or layer_number < 0:
            raise ValueError(f"layer_number must be a non-negative int, got {layer_number!r}")
        config.check_tensor_parallel(group_size(tp_group))
        self.config, self.tp_group, self.layer_number = config, tp_group, layer_number
        norm = dict(tp_group=tp_group, sequence_parallel=config.sequence_parallel, backend=config.backend,
                    device=device, dtype=config.params_dtype)
        self.input_layernorm = LayerNorm(config.hidden_size, config.layernorm_epsilon, **norm)
        self.self_attention = ParallelAttention(config, tp_group, device)
        self.post_attention_layernorm = LayerNorm(config.hidden_size, config.layernorm_epsilon, **norm)
        self.mlp = ParallelMLP(config, tp_group, device)
        self.reset_parameters()

    # ------------------------------------------------------------------ forward
    def _check_input(self, x) -> None:
        h = self.config.hidden_size
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[2] != h or not x.is_floating_point():
            got = f"{x.dtype} {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"x must be a floating [s_local, b, {h}] tensor, got {got}")
        if x.shape[0] == 0 or x.shape[1] == 0:
            raise ValueError(f"x must have a non-empty sequence and batch, got shape {tuple(x.shape)}")
        if x.dtype != self.config.params_dtype:
            raise ValueError(f"x dtype {x.dtype} != params_dtype {self.config.params_dtype}")
        device = self.input_layernorm.weight.device
        if x.device != device:
            raise ValueError(f"x is on {x.device} but the layer's parameters are on {device}")

    def _hidden_spec(self, layer_seed: int, site: int, x: torch.Tensor) -> DropoutSpec:
        p = self.config.hidden_dropout if self.training else 0.0
        if not p:
            return DropoutSpec()
        s_local, b = x.shape[0], x.shape[1]
        # Global token rows: this rank's shard starts at sequence position rank * s_local under SP.
        first_row = group_rank(self.tp_group) * s_local * b if self.config.sequence_parallel else 0
        return DropoutSpec(p, sp_random.stream_seed(layer_seed, self.layer_number, site), first_row)

    def draw_dropout_seed(self) -> int:
        """The seed of this forward's dropout masks (0 when no dropout is active); draw once per forward."""
        cfg = self.config
        uses_dropout = self.training and (cfg.hidden_dropout > 0 or cfg.attention_dropout > 0)
        return sp_random.next_layer_seed(self.layer_number) if uses_dropout else 0

    def forward_after_input_layernorm(self, x: torch.Tensor, a1: torch.Tensor, layer_seed: int) -> PendingResidual:
        """The layer from its input ``x`` and ``a1 = input_layernorm(x)`` on, leaving the final
        bias-dropout-add unapplied (see :class:`PendingResidual`). GPTModel uses it to fuse that
        bias-dropout-add with the next LayerNorm."""
        projection, projection_bias = self.self_attention(
            a1, sp_random.stream_seed(layer_seed, self.layer_number, sp_random.Site.ATTENTION))
        with saved_as("LN2 input"):
            a2, x2 = self.post_attention_layernorm.after_bias_dropout_add(
                projection, projection_bias, x, self._hidden_spec(layer_seed, sp_random.Site.ATTENTION_OUT, x))
        mlp_out, mlp_bias = self.mlp(a2)
        return PendingResidual(mlp_out, mlp_bias, x2, self._hidden_spec(layer_seed, sp_random.Site.MLP_OUT, x))

    def _forward_impl(self, x: torch.Tensor, layer_seed: int) -> torch.Tensor:
        with saved_as("LN1 input"):
            a1 = self.input_layernorm(x)
        return self.forward_after_input_layernorm(x, a1, layer_seed).apply()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input(x)
        # Drawn once, outside any recomputed region: recomputation replays the same masks.
        layer_seed = self.draw_dropout_seed()
        if self.config.recompute == "full":
            with saved_as("layer input (full recompute)"):
                return checkpoint(self._forward_impl, x, layer_seed, params=list(self.parameters()))
        return self._forward_impl(x, layer_seed)

    # ------------------------------------------------------------------ unsharded weights
    def _parts(self):
        return {"input_layernorm": self.input_layernorm, "post_attention_layernorm": self.post_attention_layernorm,
                "self_attention.query_key_value": self.self_attention.query_key_value,
                "self_attention.dense": self.self_attention.dense,
                "mlp.dense_h_to_4h": self.mlp.dense_h_to_4h, "mlp.dense_4h_to_h": self.mlp.dense_4h_to_h}

    def full_shapes(self) -> Dict[str, tuple]:
        """Unsharded state-dict keys and shapes (design.md section 2)."""
        h, f = self.config.hidden_size, self.config.ffn_hidden_size
        return {"input_layernorm.weight": (h,), "input_layernorm.bias": (h,),
                "self_attention.query_key_value.weight": (3 * h, h), "self_attention.query_key_value.bias": (3 * h,),
                "self_attention.dense.weight": (h, h), "self_attention.dense.bias": (h,),
                "post_attention_layernorm.weight": (h,), "post_attention_layernorm.bias": (h,),
                "mlp.dense_h_to_4h.weight": (f, h), "mlp.dense_h_to_4h.bias": (f,),
                "mlp.dense_4h_to_h.weight": (h, f), "mlp.dense_4h_to_h.bias": (h,)}

    @torch.no_grad()
    def load_full_state_dict(self, state_dict: Dict[str, torch.Tensor]) -> None:
        """Load UNSHARDED weights (the same dict on every rank); each rank keeps its shard."""
        shapes = self.full_shapes()
        missing, unexpected = sorted(set(shapes) - set(state_dict)), sorted(set(state_dict) - set(shapes))
        if missing or unexpected:
            raise ValueError(f"state dict keys mismatch: missing {missing}, unexpected {unexpected}")
        for key, shape in shapes.items():
            value = state_dict[key]
            if not isinstance(value, torch.Tensor) or tuple(value.shape) != shape:
                got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                raise ValueError(f"{key} must have shape {shape}, got {got}")
        device = self.input_layernorm.weight.device
        for name, part in self._parts().items():
            weight = state_dict[f"{name}.weight"].to(device)
            bias = state_dict[f"{name}.bias"].to(device)
            if isinstance(part, LayerNorm):
                part.weight.copy_(weight)
                part.bias.copy_(bias)
            else:
                part.load_full(weight, bias)

    @torch.no_grad()
    def full_state_dict(self) -> Dict[str, torch.Tensor]:
        """The unsharded weights (a collective under tensor parallelism: call it on every rank)."""
        out = {}
        for name, part in self._parts().items():
            if isinstance(part, LayerNorm):
                weight, bias = part.weight.detach().clone(), part.bias.detach().clone()
            else:
                weight, bias = part.full()
            out[f"{name}.weight"], out[f"{name}.bias"] = weight, bias
        return out

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Deterministic init of the unsharded weights from (seqpar seed, layer_number): normal(0, 0.02)
        matrices, zero biases, unit LayerNorm weights; then keep this rank's shard."""
        gen = torch.Generator().manual_seed(
            sp_random.stream_seed(sp_random.initial_seed(), self.layer_number, 1000) & (2**63 - 1))
        full = {}
        for key, shape in self.full_shapes().items():
            if key.endswith("layernorm.weight"):
                full[key] = torch.ones(shape)
            elif len(shape) == 2:
                full[key] = torch.randn(shape, generator=gen) * 0.02
            else:
                full[key] = torch.zeros(shape)
        self.load_full_state_dict({k: v.to(self.config.params_dtype) for k, v in full.items()})
