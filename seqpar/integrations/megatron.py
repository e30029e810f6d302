"""Megatron-LM / Megatron-Core state dicts -> seqpar's unsharded (``full_state_dict``) layout.

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
    self_attention.q_layernorm / k_layernorm   the same names (``qk_layernorm``: per-head norms of [d])
    *._extra_state                       dropped (TransformerEngine's FP8 metadata)

The result loads with ``load_full_state_dict`` (a layer's or a GPTModel's). Importing this module never
imports Megatron. What it does not do:

- Megatron-LM's legacy ``language_model.embedding.`` / ``language_model.encoder.`` prefixes and nested
  checkpoint dicts are not mapped (strip the prefixes first; the names below them then convert).
- Megatron pads the word embedding (and an untied ``output_layer``) to a multiple of 128 t rows (GPT-2's
  50257 to 50304), and its loss's softmax runs over the padded columns too: build the GPTModel with
  ``vocab_size`` = the table's rows to compute Megatron's loss (the padded ids are never targets), or
  slice the first v rows for the unpadded vocabulary (another model where the padded rows' logits are
  not negligible).
- Tensor-parallel shards (one file per rank) must be merged first: column-parallel weights (QKV, fc1)
  along dim 0, row-parallel ones (proj, fc2) along dim 1 -- except a SwiGLU fc1, whose shard r is
  ``[gate_r; up_r]``: concatenate all the gates, then all the ups, as Megatron's unsharded fc1 is
  ``[gate; up]`` (concatenating the shards whole interleaves them and computes another MLP, silently).
- ``num_attention_heads`` / ``num_query_groups`` are the whole model's (not a tensor-parallel rank's
  a / t): a QKV shape fixes only their ratio, so counts of the right ratio and the wrong size convert
  without an error into another layer.
- Megatron-LM's default fused bias-GELU is the tanh approximation: its GPT checkpoints match
  ``TransformerConfig(activation="gelu_tanh")``. TransformerEngine's zero-centred gamma
  (``--apply-layernorm-1p``) stores weight - 1: add 1 to the norm weights first.
- There is no whole-dict export to Megatron (only :func:`qkv_to_megatron` for the QKV rows).
"""
from __future__ import annotations

from typing import Dict, Mapping, Optional

import torch

from ..random import as_int

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


def _groups(qkv: torch.Tensor, num_attention_heads: int, num_query_groups: Optional[int],
            kv_channels: Optional[int] = None):
    """(g, a / g, d) of a QKV weight or bias, validated: ValueError naming what doesn't fit. ``kv_channels``
    None: d from the rows, and a weight's columns must be a d (h = a d); else d, and any columns (h)."""
    heads = as_int(num_attention_heads)
    groups = heads if num_query_groups is None else as_int(num_query_groups)
    d_given = None if kv_channels is None else as_int(kv_channels)
    for name, value in (("num_attention_heads", heads), ("num_query_groups", groups), ("kv_channels", d_given)):
        if (value is not None or name != "kv_channels") and \
                (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if heads % groups:
        raise ValueError(f"num_query_groups {groups} does not divide num_attention_heads {heads}")
    if not isinstance(qkv, torch.Tensor) or qkv.dim() not in (1, 2):
        raise ValueError(f"qkv must be a QKV weight [rows, h] or bias [rows] tensor, got "
                         f"{type(qkv).__name__} {tuple(getattr(qkv, 'shape', ()))}")
    rows, per_group = qkv.shape[0], heads // groups + 2
    causes = ("check num_query_groups (None means g = a: multi-head attention), that the head dim is h / a "
              "(Megatron's kv_channels; pass kv_channels= for heads of another width), and that this is the "
              "unsharded tensor, not one tensor-parallel rank's shard (a / t heads)")
    if d_given is not None:
        if rows != groups * per_group * d_given:
            raise ValueError(f"a QKV tensor of {rows} rows is not (a + 2g) d = {groups * per_group * d_given} rows for "
                             f"a = {heads}, g = {groups}, d = kv_channels = {d_given}: check num_query_groups (None "
                             f"means g = a), kv_channels, and that this is the unsharded tensor, not one "
                             f"tensor-parallel rank's shard (a / t heads)")
        return groups, heads // groups, d_given
    if rows % (groups * per_group):
        raise ValueError(f"a QKV tensor of {rows} rows is not (a + 2g) d rows for a = {heads}, g = {groups}: {causes}")
    d = rows // (groups * per_group)
    if qkv.dim() == 2 and qkv.shape[1] != heads * d:
        raise ValueError(f"a QKV weight {tuple(qkv.shape)} is not [(a + 2g) d, a d] for a = {heads}, g = {groups}: "
                         f"{causes}")
    return groups, heads // groups, d


def qkv_from_megatron(qkv: torch.Tensor, num_attention_heads: int,
                      num_query_groups: Optional[int] = None, kv_channels: Optional[int] = None) -> torch.Tensor:
    """Megatron's grouped QKV rows (module docstring) -> seqpar's [all Q; all K; all V], a new tensor.
    ``qkv``: the unsharded weight [(a + 2g) d, h] or bias [(a + 2g) d]; ``num_query_groups`` g (None:
    multi-head attention, g = a); ``kv_channels`` d (None: h / a, read from the shape)."""
    groups, q_per_group, d = _groups(qkv, num_attention_heads, num_query_groups, kv_channels)
    grouped = qkv.reshape(groups, q_per_group + 2, d, *qkv.shape[1:])
    q, k, v = grouped.split([q_per_group, 1, 1], dim=1)
    return torch.cat([part.reshape(-1, *qkv.shape[1:]) for part in (q, k, v)])


def qkv_to_megatron(qkv: torch.Tensor, num_attention_heads: int,
                    num_query_groups: Optional[int] = None, kv_channels: Optional[int] = None) -> torch.Tensor:
    """The inverse of :func:`qkv_from_megatron`: seqpar's QKV rows -> Megatron's grouped order."""
    groups, q_per_group, d = _groups(qkv, num_attention_heads, num_query_groups, kv_channels)
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
                             num_query_groups: Optional[int] = None,
                             kv_channels: Optional[int] = None) -> Dict[str, torch.Tensor]:
    """An unsharded Megatron-Core or Megatron-LM layer / GPT state dict -> seqpar's keys and layouts
    (module docstring): names mapped, every QKV weight and bias reordered, ``_extra_state`` dropped.
    ``kv_channels``: the head dim, for heads not h / a wide (Megatron's ``--kv-channels``; the config's).
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
            try:
                value = qkv_from_megatron(value, num_attention_heads, num_query_groups, kv_channels)
            except ValueError as exc:
                raise ValueError(f"{key!r}: {exc}") from None
        converted[name] = value
    return converted
