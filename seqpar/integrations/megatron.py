"""Megatron-LM / Megatron-Core state dicts <-> seqpar's unsharded (``full_state_dict``) layout.

seqpar's keys are the names of Megatron-LM's legacy GPT layer (before its norms became ``input_norm`` /
``post_attention_norm`` / ``final_norm``), and every tensor but one has Megatron's layout; the exception
is the fused QKV projection's rows. With a heads, g k/v groups and head dim d::

    seqpar     [Q_0 .. Q_{a-1}, K_0 .. K_{g-1}, V_0 .. V_{g-1}]                 (each block d rows)
    Megatron   [Q_0 .. Q_{a/g-1}, K_0, V_0,  Q_{a/g} .. Q_{2a/g-1}, K_1, V_1,  ...]   (per k/v group)

Megatron-LM (``query_key_value``) and Megatron-Core (``linear_qkv``) both keep the grouped order, so a
Megatron checkpoint loaded into seqpar as is loads without an error and computes another layer.
:func:`qkv_from_megatron` / :func:`qkv_to_megatron` convert the weight ([rows, h]) or the bias ([rows]).

:func:`from_megatron_state_dict` converts a whole unsharded layer or model state dict, with either naming
(checked once against Megatron-Core 0.16.1's local-spec ``TransformerLayer`` on CPU, which is not a test
dependency: multi-head, grouped-query and the Llama block, the same outputs to 3e-6 in fp32)::

    Megatron-Core / Megatron-LM          seqpar
    decoder.layers.{i}.                  layers.{i}.
    input_norm / post_attention_norm     input_layernorm / post_attention_layernorm (Megatron-LM's newer names)
    final_norm                           final_layernorm
    self_attention.linear_qkv            self_attention.query_key_value   (rows reordered)
    self_attention.linear_proj           self_attention.dense
    pre_mlp_layernorm                    post_attention_layernorm
    mlp.linear_fc1 / linear_fc2          mlp.dense_h_to_4h / dense_4h_to_h (SwiGLU: [gate; up] in both)
    decoder.final_layernorm              final_layernorm
    linear_qkv.layer_norm_weight / _bias input_layernorm.weight / .bias  (TransformerEngine's fused norm)
    linear_fc1.layer_norm_weight / _bias post_attention_layernorm.weight / .bias
    *._extra_state                       dropped (TransformerEngine's FP8 metadata)

Megatron-LM's legacy ``encoder.`` / ``language_model.`` prefixes are not mapped. The result loads with
``load_full_state_dict`` (a layer's or a GPTModel's). Importing this module never imports Megatron.
"""
from __future__ import annotations

from typing import Dict, Mapping, Optional

import torch

__all__ = ["qkv_from_megatron", "qkv_to_megatron", "from_megatron_state_dict"]

# Megatron name -> seqpar name, matched where a dotted component starts (Megatron-Core's names, and the
# norm names Megatron-LM's legacy model took when it added RMSNorm).
_CORE_NAMES = (
    ("decoder.layers.", "layers."),
    ("decoder.final_layernorm.", "final_layernorm."),
    ("input_norm.", "input_layernorm."),
    ("post_attention_norm.", "post_attention_layernorm."),
    ("final_norm.", "final_layernorm."),
    ("self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight"),
    ("self_attention.linear_qkv.layer_norm_bias", "input_layernorm.bias"),
    ("mlp.linear_fc1.layer_norm_weight", "post_attention_layernorm.weight"),
    ("mlp.linear_fc1.layer_norm_bias", "post_attention_layernorm.bias"),
    ("self_attention.linear_qkv.", "self_attention.query_key_value."),
    ("self_attention.linear_proj.", "self_attention.dense."),
    ("pre_mlp_layernorm.", "post_attention_layernorm."),
    ("mlp.linear_fc1.", "mlp.dense_h_to_4h."),
    ("mlp.linear_fc2.", "mlp.dense_4h_to_h."),
)


def _groups(qkv: torch.Tensor, num_attention_heads: int, num_query_groups: Optional[int]):
    """(g, a / g, d) of a QKV weight or bias, validated: ValueError naming what doesn't fit."""
    heads = num_attention_heads
    groups = heads if num_query_groups is None else num_query_groups
    for name, value in (("num_attention_heads", heads), ("num_query_groups", groups)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if heads % groups:
        raise ValueError(f"num_query_groups {groups} does not divide num_attention_heads {heads}")
    if not isinstance(qkv, torch.Tensor) or qkv.dim() not in (1, 2):
        raise ValueError(f"qkv must be a QKV weight [rows, h] or bias [rows] tensor, got "
                         f"{type(qkv).__name__} {tuple(getattr(qkv, 'shape', ()))}")
    rows, per_group = qkv.shape[0], heads // groups + 2
    if rows % (groups * per_group):
        raise ValueError(f"a QKV tensor of {rows} rows is not (a + 2g) d rows for a = {heads}, g = {groups}")
    d = rows // (groups * per_group)
    if qkv.dim() == 2 and qkv.shape[1] != heads * d:
        # a tensor-parallel shard (Megatron-LM saves one file per rank) would be read with the wrong d
        raise ValueError(f"a QKV weight {tuple(qkv.shape)} is not [(a + 2g) d, a d] for a = {heads}, g = {groups}: "
                         "convert the unsharded weight (a tensor-parallel shard holds a / t heads)")
    return groups, heads // groups, d


def qkv_from_megatron(qkv: torch.Tensor, num_attention_heads: int,
                      num_query_groups: Optional[int] = None) -> torch.Tensor:
    """Megatron's grouped QKV rows (module docstring) -> seqpar's [all Q; all K; all V], a new tensor.
    ``qkv``: the unsharded weight [(a + 2g) d, h] or bias [(a + 2g) d]; ``num_query_groups`` g (None:
    multi-head attention, g = a)."""
    groups, q_per_group, d = _groups(qkv, num_attention_heads, num_query_groups)
    grouped = qkv.reshape(groups, q_per_group + 2, d, *qkv.shape[1:])
    q, k, v = grouped.split([q_per_group, 1, 1], dim=1)
    return torch.cat([part.reshape(-1, *qkv.shape[1:]) for part in (q, k, v)])


def qkv_to_megatron(qkv: torch.Tensor, num_attention_heads: int,
                    num_query_groups: Optional[int] = None) -> torch.Tensor:
    """The inverse of :func:`qkv_from_megatron`: seqpar's QKV rows -> Megatron's grouped order."""
    groups, q_per_group, d = _groups(qkv, num_attention_heads, num_query_groups)
    rest = qkv.shape[1:]
    q, k, v = qkv.split([groups * q_per_group * d, groups * d, groups * d])
    grouped = torch.cat([q.reshape(groups, q_per_group, d, *rest), k.reshape(groups, 1, d, *rest),
                         v.reshape(groups, 1, d, *rest)], dim=1)
    return grouped.reshape(qkv.shape)


def _seqpar_name(key: str) -> str:
    for core, ours in _CORE_NAMES:
        at = key.find(core)
        if at != -1 and (at == 0 or key[at - 1] == "."):
            key = key[:at] + ours + key[at + len(core):]
    return key


def from_megatron_state_dict(state_dict: Mapping[str, torch.Tensor], num_attention_heads: int,
                             num_query_groups: Optional[int] = None) -> Dict[str, torch.Tensor]:
    """An unsharded Megatron-Core or Megatron-LM layer / GPT state dict -> seqpar's keys and layouts
    (module docstring): names mapped, every QKV weight and bias reordered, ``_extra_state`` dropped.
    Load the result with ``load_full_state_dict``; keys seqpar doesn't know are left for it to name.
    ValueError when two keys map to one name (e.g. both a fused and a separate input norm)."""
    converted: Dict[str, torch.Tensor] = {}
    for key, value in state_dict.items():
        if key.endswith("_extra_state"):
            continue
        name = _seqpar_name(key)
        if name in converted:
            raise ValueError(f"{key!r} and another key both map to {name!r}")
        if name.endswith("self_attention.query_key_value.weight") or \
                name.endswith("self_attention.query_key_value.bias"):
            value = qkv_from_megatron(value, num_attention_heads, num_query_groups)
        converted[name] = value
    return converted
