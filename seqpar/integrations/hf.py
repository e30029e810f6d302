"""HuggingFace ``transformers`` GPT-2 and Llama (Mistral, Qwen2, Qwen3, Phi-3) <-> :class:`seqpar.GPTModel`.

GPT-2 is the architecture of GPTModel (learned positions, pre-LayerNorm layers, tied output head), so
a ``GPT2LMHeadModel`` (or ``GPT2Model``, or either's state dict) becomes a GPTModel holding this rank's
tensor-parallel shards, trains with sequence parallelism and selective recompute, and gives its
weights back as a ``GPT2LMHeadModel`` state dict::

    model = hf.from_gpt2(gpt2, tp_group=group, sequence_parallel=True, recompute="selective")
    loss = model(input_ids, hf.shift_labels(input_ids))          # per token [s, b]
    (loss.sum() / (hf.shift_labels(input_ids) != -100).sum()).backward()   # = HF's .loss
    gpt2.load_state_dict(hf.to_gpt2_state_dict(model))           # every rank calls it (collective)

Weight mapping (GPT-2's ``Conv1D`` stores [in, out]; seqpar, like ``nn.Linear``, [out, in])::

    transformer.wte.weight [v, h]             embedding.word_embeddings.weight (lm_head.weight: tied)
    transformer.wpe.weight [n_positions, h]   embedding.position_embeddings.weight
    h.{i}.ln_1 / ln_2                         layers.{i}.input_layernorm / post_attention_layernorm
    h.{i}.attn.c_attn.weight [h, 3h]          layers.{i}.self_attention.query_key_value.weight^T
                                              (columns Q of all heads, K, V: the same order as seqpar's rows)
    h.{i}.attn.c_proj.weight [h, h]           layers.{i}.self_attention.dense.weight^T
    h.{i}.mlp.c_fc.weight [h, f]              layers.{i}.mlp.dense_h_to_4h.weight^T
    h.{i}.mlp.c_proj.weight [f, h]            layers.{i}.mlp.dense_4h_to_h.weight^T
    transformer.ln_f                          final_layernorm

Config mapping: ``n_embd``, ``n_head``, ``n_inner`` (None -> 4h), ``n_layer``, ``n_positions``
(max_seq_len), ``vocab_size`` (padded inside GPTModel, see :mod:`seqpar.nn.model`),
``layer_norm_epsilon``, ``activation_function`` (:data:`GPT2_ACTIVATIONS`: "gelu_new", "gelu_pytorch_tanh",
"gelu_fast", "gelu_accurate", "gelu_python_tanh" -> "gelu_tanh"; "gelu", "gelu_python" -> "gelu"), ``resid_pdrop`` / ``attn_pdrop`` / ``embd_pdrop`` -> hidden / attention / embedding
dropout (seqpar's counter-based masks, not torch's: with dropout on, runs differ from HF's).
``reorder_and_upcast_attn`` is accepted: seqpar always computes attention scores and softmax in fp32.
GPT-2 variants seqpar does not implement raise ValueError naming the setting.

Loss: GPTModel's labels are already shifted (position i predicts ``labels[:, i]``); HF's
``labels=input_ids`` shifts inside. :func:`shift_labels` converts, and HF's mean loss is the sum of
GPTModel's per-token losses over the labels that are not -100.

**Llama** (:func:`from_llama` / :func:`to_llama_state_dict`): a ``LlamaForCausalLM`` (or ``LlamaModel``,
or either's state dict with its ``LlamaConfig``) becomes a GPTModel with the Llama block
(``normalization="rmsnorm", activation="swiglu", num_query_groups=num_key_value_heads`` (None when it is
the head count), ``position_embedding="rope", add_bias_linear=False``, no dropout but the config's
``attention_dropout`` (and Phi-3's ``resid_pdrop``), 0 by default; with it on, seqpar's counter-based masks
are not torch's, so runs differ from HF's)::

    model.embed_tokens.weight [v, h]          embedding.word_embeddings.weight
    layers.{i}.input_layernorm / post_attention_layernorm        the same names (RMSNorm weights)
    layers.{i}.self_attn.q_proj [a d, h], k_proj [g d, h], v_proj [g d, h]
                                              layers.{i}.self_attention.query_key_value.weight, rows
                                              q, then k, then v ([(a + 2g) d, h]; HF's head-major rows and
                                              rotate-half RoPE are seqpar's, so nothing is permuted)
    layers.{i}.self_attn.o_proj [h, a d]      layers.{i}.self_attention.dense.weight
    layers.{i}.mlp.gate_proj, up_proj [f, h]  layers.{i}.mlp.dense_h_to_4h.weight, rows gate then up [2f, h]
    layers.{i}.mlp.down_proj [h, f]           layers.{i}.mlp.dense_4h_to_h.weight
    model.norm.weight                         final_layernorm.weight
    lm_head.weight [v, h]                     output_layer.weight (tie_word_embeddings=False), or the
                                              word embedding (tied: then it must equal embed_tokens)

The same block under other names (:data:`LLAMA_FAMILY`): a ``MistralForCausalLM`` without its sliding
window (``sliding_window=None``: Mistral 7B v0.2 / v0.3), a ``Qwen2ForCausalLM`` (Qwen2 / Qwen2.5),
whose q, k and v projections have biases: ``add_qkv_bias=True``, and ``q_proj.bias [a d]``,
``k_proj.bias [g d]``, ``v_proj.bias [g d]`` concatenated into ``query_key_value.bias``, and a
``Qwen3ForCausalLM`` (Qwen3 dense), whose per-head RMSNorms of q and k (before RoPE) are
``qk_layernorm=True``: ``self_attn.q_norm.weight [d]`` / ``k_norm.weight [d]`` are
``self_attention.q_layernorm.weight`` / ``k_layernorm.weight``. HF's ``head_dim`` is d, which may differ
from hidden_size / num_attention_heads (Qwen3-0.6B / 4B / 32B, Mistral Nemo): then ``kv_channels=d``. A
``Phi3ForCausalLM`` (Phi-4; Phi-3 without its sliding window) holds q / k / v fused as
``self_attn.qkv_proj.weight`` and gate / up as ``mlp.gate_up_proj.weight``, the rows of seqpar's fused
weights (taken as they are), and its ``resid_pdrop`` is ``hidden_dropout``. :func:`to_llama_state_dict` /
:func:`to_llama_config` take ``model_type`` for the family to hand back to (Phi-3's keys are its own).

Config: ``hidden_size``, ``num_attention_heads``, ``num_key_value_heads`` (None: = heads), ``head_dim``,
``intermediate_size``, ``num_hidden_layers``, ``max_position_embeddings`` (GPTModel's max_seq_len; with YaRN
at least factor x original_max_position_embeddings, the context HF runs),
``vocab_size`` (any; padded inside GPTModel), ``rms_norm_eps``, the RoPE base (``rope_parameters``,
or ``rope_theta`` in older transformers) and its type: "default", "llama3" (Llama 3.1 / 3.2 / 3.3:
``factor``, ``low_freq_factor``, ``high_freq_factor``, ``original_max_position_embeddings``, as
:class:`seqpar.ops.RopeScaling`), or "yarn" (Qwen2.5's long context: as :class:`seqpar.ops.YarnScaling`,
whose attention factor scales the attention's softmax), or "linear" (DeepSeek Coder: ``factor``, as
:class:`seqpar.ops.LinearScaling`). Unsupported settings raise ValueError naming them: another RoPE type
(dynamic, longrope ... scaling), a ``partial_rotary_factor`` other than 1,
``attention_bias`` or ``mlp_bias``, a sliding window narrower than the context, ``max_position_embeddings``
or from_llama's ``max_seq_len`` (seqpar's attention is full causal), a ``hidden_act`` other
than "silu" (or "swish", HF's other name for it).

A GPTModel seqpar built (not converted) exports with its HF config: :func:`to_llama_config` /
:func:`to_gpt2_config` give the keyword arguments of ``transformers.AutoConfig.for_model``.

This module never imports ``transformers``: it reads the config's attributes and the state dict.
"""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Dict, Mapping, NamedTuple, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from ..config import TransformerConfig
from ..nn.model import IGNORE_INDEX, GPTModel
from ..nn.state_dict import _unwrapped, check_shapes
from ..ops.registry import check_eps, is_positive_finite
from ..ops.rotary import LinearScaling, RopeScaling, YarnScaling, rope_inv_freq
from ..parallel.state import ProcessGroup, run_agreed
from ..random import as_int, is_int

__all__ = ["from_gpt2", "to_gpt2_state_dict", "to_gpt2_config", "from_llama", "to_llama_state_dict",
           "to_llama_config", "shift_labels"]

#: GPT-2 activation_function -> TransformerConfig.activation (the same function, not an approximation of it).
#: (HF's gelu_fast writes sqrt(2 / pi) as 0.7978845608: 1e-12 off in fp64, nothing in fp32.)
GPT2_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh",
                    "gelu_accurate": "gelu_tanh", "gelu_python_tanh": "gelu_tanh", "gelu": "gelu",
                    "gelu_python": "gelu"}
#: Llama hidden_act names of SiLU (HF's ACT2FN maps both to nn.SiLU).
LLAMA_ACTIVATIONS = ("silu", "swish")
#: The seqpar config a GPT-2 maps to, beyond its sizes, dropout and activation ("gelu" or "gelu_tanh").
GPT2_BLOCK = dict(normalization="layernorm", position_embedding="learned", add_bias_linear=True)

# (GPT-2 key under "h.{i}.", seqpar key under "layers.{i}.", is a Conv1D weight to transpose)
_LAYER_KEYS: Tuple[Tuple[str, str, bool], ...] = (
    ("ln_1.weight", "input_layernorm.weight", False),
    ("ln_1.bias", "input_layernorm.bias", False),
    ("attn.c_attn.weight", "self_attention.query_key_value.weight", True),
    ("attn.c_attn.bias", "self_attention.query_key_value.bias", False),
    ("attn.c_proj.weight", "self_attention.dense.weight", True),
    ("attn.c_proj.bias", "self_attention.dense.bias", False),
    ("ln_2.weight", "post_attention_layernorm.weight", False),
    ("ln_2.bias", "post_attention_layernorm.bias", False),
    ("mlp.c_fc.weight", "mlp.dense_h_to_4h.weight", True),
    ("mlp.c_fc.bias", "mlp.dense_h_to_4h.bias", False),
    ("mlp.c_proj.weight", "mlp.dense_4h_to_h.weight", True),
    ("mlp.c_proj.bias", "mlp.dense_4h_to_h.bias", False),
)
_TOP_KEYS: Tuple[Tuple[str, str], ...] = (
    ("wte.weight", "embedding.word_embeddings.weight"),
    ("wpe.weight", "embedding.position_embeddings.weight"),
    ("ln_f.weight", "final_layernorm.weight"),
    ("ln_f.bias", "final_layernorm.bias"),
)
_PREFIX = "transformer."
_HEAD = "lm_head.weight"
# Causal-mask buffers that transformers releases before 4.31 saved in state dicts: not weights.
_MASK_BUFFER = re.compile(r"h\.\d+\.attn\.(bias|masked_bias)$")


def _gpt2_settings(config) -> dict:
    """Read a GPT2Config into GPTModel's arguments; ValueError naming any setting seqpar can't honour."""
    def get(name, default=None):
        return getattr(config, name, default)

    if get("model_type", "gpt2") != "gpt2":
        raise ValueError(f"config.model_type {get('model_type')!r} is not 'gpt2'")
    if config is None or get("n_embd") is None:
        raise ValueError(f"config must be a transformers GPT2Config, got {type(config).__name__}")
    unsupported = {  # setting: the value seqpar implements
        "add_cross_attention": False, "scale_attn_by_inverse_layer_idx": False, "scale_attn_weights": True,
        "tie_word_embeddings": True,
    }
    for name, supported in unsupported.items():
        value = get(name, supported)
        if value != supported:
            raise ValueError(f"GPT-2 config {name}={value!r} is not supported by seqpar (it implements "
                             f"{name}={supported!r})")
    activation = get("activation_function", "gelu_new")
    if activation not in GPT2_ACTIVATIONS:
        raise ValueError(f"GPT-2 config activation_function={activation!r} is not supported by seqpar; "
                         f"supported: {sorted(GPT2_ACTIVATIONS)}")
    hidden, inner = get("n_embd"), get("n_inner")
    # a key the config lacks is GPT2Config's default (a namespace of a config.json has none)
    return dict(hidden=hidden, heads=get("n_head"), ffn=4 * hidden if inner is None else inner,
                layers=get("n_layer"), positions=get("n_positions", 1024), vocab=get("vocab_size"),
                eps=get("layer_norm_epsilon", 1e-5), activation=GPT2_ACTIVATIONS[activation],
                resid_pdrop=get("resid_pdrop", 0.1), attn_pdrop=get("attn_pdrop", 0.1),
                embd_pdrop=get("embd_pdrop", 0.1))


def _gpt2_shapes(settings: dict) -> Dict[str, tuple]:
    """GPT-2 state-dict keys (no "transformer." prefix) and their shapes, Conv1D layouts."""
    h, f, v = settings["hidden"], settings["ffn"], settings["vocab"]
    layer = {"ln_1.weight": (h,), "ln_1.bias": (h,), "attn.c_attn.weight": (h, 3 * h), "attn.c_attn.bias": (3 * h,),
             "attn.c_proj.weight": (h, h), "attn.c_proj.bias": (h,), "ln_2.weight": (h,), "ln_2.bias": (h,),
             "mlp.c_fc.weight": (h, f), "mlp.c_fc.bias": (f,), "mlp.c_proj.weight": (f, h), "mlp.c_proj.bias": (h,)}
    shapes = {"wte.weight": (v, h), "wpe.weight": (settings["positions"], h)}
    for i in range(settings["layers"]):
        shapes.update({f"h.{i}.{key}": shape for key, shape in layer.items()})
    shapes.update({"ln_f.weight": (h,), "ln_f.bias": (h,)})
    return shapes


def _checked_tensors(state_dict: Mapping[str, torch.Tensor], family: str, prefix: str, buffers: re.Pattern,
                     shapes: Dict[str, Tuple[int, ...]], layers: str) -> Tuple[Dict[str, torch.Tensor], object]:
    """(the body's tensors keyed without ``prefix``, the ``lm_head.weight`` entry or None) of an HF state
    dict whose body keys may all carry ``prefix`` or none; non-persistent ``buffers`` (keys matching
    the pattern) are dropped; every key of ``shapes`` must be there with that shape and no other
    (ValueError naming the key; ``layers`` names the config's layer count in the message)."""
    sd = dict(state_dict)
    head = sd.pop(_HEAD, None)
    if any(k.startswith(prefix) for k in sd):
        # An unprefixed body key beside prefixed ones is a mix; any other unprefixed key (a classification
        # head's score.weight) is left for check_shapes to name as unexpected.
        mixed = sorted(k for k in sd if not k.startswith(prefix) and (k in shapes or buffers.match(k)))
        if mixed:
            raise ValueError(f"state dict mixes '{prefix}'-prefixed keys with unprefixed ones: {mixed[:5]}")
        sd = {k[len(prefix):] if k.startswith(prefix) else k: v for k, v in sd.items()}
    sd = {k: v for k, v in sd.items() if not buffers.match(k)}
    check_shapes(sd, shapes, what=f"{family} state dict", config=layers)
    return sd, head


def _shapes_differ(head, table: torch.Tensor) -> str:
    """" (shape A, the table's B)" where a tied head's shape differs from its table's (a head not resized
    with the vocabulary), else ""."""
    if not isinstance(head, torch.Tensor):
        return f" (a {type(head).__name__}, not a tensor)"
    shape = tuple(head.shape)
    return "" if shape == tuple(table.shape) else f" (shape {shape}, the table's {tuple(table.shape)})"


def _transformer_state_dict(state_dict: Mapping[str, torch.Tensor], settings: dict) -> Dict[str, torch.Tensor]:
    """A GPT2LMHeadModel / GPT2Model state dict -> the transformer's tensors without the prefix, with
    keys, shapes and the tied head checked (ValueError naming the offending key)."""
    sd, head = _checked_tensors(state_dict, "GPT-2", _PREFIX, _MASK_BUFFER, _gpt2_shapes(settings),
                                f"n_layer={settings['layers']}")
    if head is not None and (not isinstance(head, torch.Tensor) or head.shape != sd["wte.weight"].shape
                             or not torch.equal(head, sd["wte.weight"])):
        raise ValueError(f"{_HEAD} is not tied to {_PREFIX}wte.weight{_shapes_differ(head, sd['wte.weight'])}: "
                         "seqpar's output head is the word embedding")
    return sd


def _to_seqpar_keys(sd: Dict[str, torch.Tensor], num_layers: int) -> Dict[str, torch.Tensor]:
    """GPT-2 keys (no prefix) and Conv1D layouts -> GPTModel's unsharded keys and [out, in] layouts."""
    out = {ours: sd[theirs] for theirs, ours in _TOP_KEYS}
    for i in range(num_layers):
        for theirs, ours, conv1d in _LAYER_KEYS:
            value = sd[f"h.{i}.{theirs}"]
            out[f"layers.{i}.{ours}"] = value.t() if conv1d else value
    return out


def _every_layer(recompute) -> object:
    """The config's policy: ``recompute`` itself when it is one policy (TransformerConfig checks it), else
    "none" (a per-layer list goes to GPTModel: :func:`_per_layer`)."""
    return "none" if isinstance(recompute, (list, tuple)) else recompute


def _per_layer(recompute) -> Optional[Sequence[str]]:
    """GPTModel's per-layer ``recompute``: a list or tuple (GPTModel checks its length and names), else None."""
    return recompute if isinstance(recompute, (list, tuple)) else None


def _check_device(device, what: str) -> None:
    """ValueError for ``device="meta"``: a converter copies the HF weights into the model it builds, and
    meta tensors hold no values (the load was refused with advice for a module the caller never held)."""
    if device is not None and torch.device(device).type == "meta":
        raise ValueError(f"seqpar.integrations.hf.{what}: device='meta' holds no values, and converting copies the "
                         "HF weights into the model: pass a real device (for a deferred init, build seqpar.GPTModel "
                         "on meta yourself, then to_empty() and reset_parameters() or load_full_state_dict())")


def from_gpt2(source, *, config=None, tp_group: ProcessGroup = None, sequence_parallel: bool = False,
              recompute: Union[str, Sequence[str]] = "none", backend: str = "auto", device=None,
              params_dtype: Optional[torch.dtype] = None, dropout: Optional[float] = None) -> GPTModel:
    """A :class:`seqpar.GPTModel` holding this rank's shards of a HuggingFace GPT-2.

    Args:
        source: a ``transformers`` ``GPT2LMHeadModel`` or ``GPT2Model``, or a state dict of either
            (keys with or without the "transformer." prefix; ``lm_head.weight``, if present, must equal
            ``wte.weight``) together with ``config=``.
        config: the ``GPT2Config`` of a state-dict ``source`` (a model brings its own: leave None).
        tp_group: tensor-parallel process group (None: no tensor parallelism). Every rank passes the
            same source.
        sequence_parallel, backend: as in :class:`seqpar.TransformerConfig`.
        recompute: one policy, "none" | "selective" | "full", for every layer, or one per layer as
            :class:`seqpar.GPTModel` takes them (``plan_recompute(...).policies``).
        device: where the parameters go; None keeps the source's device.
        params_dtype: the parameters' dtype; None keeps the source's.
        dropout: one probability for the residual, attention and embedding dropout; None keeps the
            config's ``resid_pdrop``, ``attn_pdrop`` and ``embd_pdrop``.

    Returns the GPTModel, in training mode when ``source`` is a state dict and in ``source``'s mode
    when it is a model. Raises ValueError naming a GPT-2 setting seqpar does not implement, or a
    missing, unexpected or misshapen weight.
    """
    _check_device(device, "from_gpt2")

    def read():
        state_dict, settings_config, training = _source_state_dict(source, config, "GPT2")
        settings = _gpt2_settings(settings_config)
        if isinstance(source, nn.Module):   # HF reads the eps when it builds the norms, as from_llama's
            settings["eps"] = _norms_eps(source, settings["eps"])
        check_eps(settings["eps"], "GPT-2 config layer_norm_epsilon")
        return settings, _transformer_state_dict(state_dict, settings), training

    settings, sd, training = _read_on_every_rank(read, tp_group, "seqpar.integrations.hf.from_gpt2", device)
    wte = sd["wte.weight"]
    if dropout is None:
        hidden_p, attention_p, embedding_p = settings["resid_pdrop"], settings["attn_pdrop"], settings["embd_pdrop"]
    elif isinstance(dropout, (int, float)) and not isinstance(dropout, bool) and 0.0 <= dropout < 1.0:
        hidden_p = attention_p = embedding_p = dropout
    else:
        raise ValueError(f"dropout must be None or a float in [0, 1), got {dropout!r}")
    cfg = TransformerConfig(
        hidden_size=settings["hidden"], num_attention_heads=settings["heads"], ffn_hidden_size=settings["ffn"],
        hidden_dropout=hidden_p, attention_dropout=attention_p, layernorm_epsilon=settings["eps"],
        activation=settings["activation"], sequence_parallel=sequence_parallel, recompute=_every_layer(recompute),
        backend=backend, params_dtype=wte.dtype if params_dtype is None else params_dtype)
    model = GPTModel(cfg, settings["layers"], settings["vocab"], settings["positions"], tp_group=tp_group,
                     device=wte.device if device is None else device, embedding_dropout=embedding_p,
                     recompute=_per_layer(recompute))
    model.load_full_state_dict(_to_seqpar_keys(sd, settings["layers"]))
    return model.train(training)


def _gpt_model(model: nn.Module) -> GPTModel:
    """``model`` without the DDP and torch.compile wrappers (as :func:`seqpar.nn.sharded_state_dict` takes
    them); ValueError unless that is a GPTModel."""
    inner = _unwrapped(model) if isinstance(model, nn.Module) else model
    if not isinstance(inner, GPTModel):
        raise ValueError(f"model must be a seqpar.GPTModel (or one wrapped by DDP / torch.compile), got "
                         f"{type(inner).__name__}")
    return inner


class _Reads(dict):
    """A full_state_dict() that records which keys a hand-back read: one it didn't read has no slot in the
    HF model (an adapter's factors held as submodules of a linear), so the hand-back would drop it."""

    def __init__(self, *args):
        super().__init__(*args)
        self.read = set()

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)

    def get(self, key, default=None):
        self.read.add(key)
        return super().get(key, default)

    def check_all_read(self, family: str) -> None:
        unread = sorted(set(self) - self.read)
        if unread:
            raise ValueError(f"the model holds parameters a {family} state dict has no slot for: {unread} (an "
                             "adapter's factors? fold them into the base weights first): handing back without "
                             "them would give another model")


def _gpt2_model(model: nn.Module) -> GPTModel:
    """:func:`_gpt_model`, ValueError naming the setting unless it is a GPT-2."""
    model = _gpt_model(model)
    cfg = model.config
    different = {k: getattr(cfg, k) for k, v in GPT2_BLOCK.items() if getattr(cfg, k) != v}
    if cfg.activation not in GPT2_ACTIVATIONS.values():
        different["activation"] = cfg.activation
    if cfg.kv_heads != cfg.num_attention_heads:
        different["num_query_groups"] = cfg.num_query_groups
    if model.output_layer is not None:
        different["share_embeddings_and_output_weights"] = False
    if different:
        raise ValueError(f"model is not a GPT-2: it has {different} (a GPT-2 has {GPT2_BLOCK}, activation 'gelu' or "
                         f"'gelu_tanh', num_query_groups None (= heads) and share_embeddings_and_output_weights=True)")
    return model


def to_gpt2_config(model: GPTModel) -> Dict[str, object]:
    """The ``GPT2Config`` of ``model``, as keyword arguments (``model_type`` included): with
    :func:`to_gpt2_state_dict` it exports a GPTModel trained with seqpar (from scratch too) to HF::

        config = transformers.AutoConfig.for_model(**hf.to_gpt2_config(model))
        gpt2 = transformers.GPT2LMHeadModel(config)
        gpt2.load_state_dict(hf.to_gpt2_state_dict(model))      # every rank calls it (a collective)

    Sizes, ``n_positions`` = max_seq_len, the real vocabulary, the eps, the activation ("gelu_new" for
    "gelu_tanh"), the three dropouts (``resid_pdrop`` hidden, ``attn_pdrop`` attention, ``embd_pdrop`` the
    embedding's), ``initializer_range``, the parameters' dtype, and no bos / eos token ids (seqpar knows no
    tokenizer: set them from yours; HF's default 50256 would end generations there). GPT-2 has no padding row:
    a GPTModel's ``padding_idx`` is not in the config. Not a collective. ValueError as
    :func:`to_gpt2_state_dict`.
    """
    model = _gpt2_model(model)
    cfg = model.config
    return dict(model_type="gpt2", vocab_size=model.vocab_size, n_positions=model.max_seq_len,
                n_embd=cfg.hidden_size, n_layer=len(model.layers), n_head=cfg.num_attention_heads,
                n_inner=None if cfg.ffn_hidden_size == 4 * cfg.hidden_size else cfg.ffn_hidden_size,
                activation_function="gelu_new" if cfg.activation == "gelu_tanh" else "gelu",
                resid_pdrop=cfg.hidden_dropout, attn_pdrop=cfg.attention_dropout, embd_pdrop=model.embedding_dropout,
                layer_norm_epsilon=cfg.layernorm_epsilon, initializer_range=cfg.init_method_std,
                tie_word_embeddings=True, **_hf_common(cfg))


def _hf_common(cfg: TransformerConfig) -> Dict[str, object]:
    """The config keys every export sets: the parameters' dtype (HF builds and loads in it), and no
    bos / eos token ids: seqpar knows no tokenizer, and HF's defaults (Llama's 1 and 2, GPT-2's 50256) would
    end a generation at a token id that is not the model's end of sequence (set them from the tokenizer)."""
    return dict(dtype=str(cfg.params_dtype).removeprefix("torch."), bos_token_id=None, eos_token_id=None)


def to_gpt2_state_dict(model: GPTModel) -> Dict[str, torch.Tensor]:
    """The unsharded ``GPT2LMHeadModel`` state dict of ``model`` (HF key names, Conv1D [in, out]
    layouts, the real vocabulary rows; ``lm_head.weight`` is the same tensor as ``transformer.wte.weight``,
    as in HF's own state dict), loadable with ``load_state_dict(strict=True)``.

    A collective under tensor parallelism: call it on every rank; every rank gets the same dict. A model
    wrapped by DDP or torch.compile is read through the wrapper. ValueError naming the setting unless
    ``model`` is a GPT-2: LayerNorm, GeLU ("gelu" or "gelu_tanh"), learned positions, linear biases, one
    k/v head per head and the output head tied to the word embedding.
    """
    model = _gpt2_model(model)
    full = _Reads(model.full_state_dict())
    out = {_PREFIX + theirs: full[ours] for theirs, ours in _TOP_KEYS[:2]}
    for i in range(len(model.layers)):
        for theirs, ours, conv1d in _LAYER_KEYS:
            value = full[f"layers.{i}.{ours}"]
            out[f"{_PREFIX}h.{i}.{theirs}"] = value.t().contiguous() if conv1d else value
    out.update({_PREFIX + theirs: full[ours] for theirs, ours in _TOP_KEYS[2:]})
    full.check_all_read("GPT-2")
    out[_HEAD] = out[_PREFIX + "wte.weight"]
    return out


# ---------------------------------------------------------------------------------------------- Llama
_LLAMA_PREFIX = "model."
# HF Llama key under "layers.{i}." -> seqpar key under "layers.{i}." (the fused ones are built apart)
_LLAMA_NORMS = (("input_layernorm.weight", "input_layernorm.weight"),
                ("post_attention_layernorm.weight", "post_attention_layernorm.weight"))
_LLAMA_QKV = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")
_LLAMA_GATE_UP = ("mlp.gate_proj.weight", "mlp.up_proj.weight")
# Phi-3 stores them fused, in seqpar's row order (q, k, v; gate, up)
_PHI3_QKV, _PHI3_GATE_UP = "self_attn.qkv_proj.weight", "mlp.gate_up_proj.weight"
# RoPE inverse-frequency buffers that older transformers releases saved in state dicts: not weights.
_ROPE_BUFFER = re.compile(r"(layers\.\d+\.self_attn\.)?rotary_emb\.inv_freq$")
_LLAMA_QKV_BIASES = ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias")
# Qwen3's per-head q / k RMSNorms -> the layer's (TransformerConfig.qk_layernorm)
_LLAMA_QK_NORMS = (("self_attn.q_norm.weight", "self_attention.q_layernorm.weight"),
                   ("self_attn.k_norm.weight", "self_attention.k_layernorm.weight"))
#: The seqpar config a Llama maps to, beyond its sizes (and Qwen2's ``add_qkv_bias=True``, Qwen3's
#: ``qk_layernorm=True``).
LLAMA_BLOCK = dict(normalization="rmsnorm", activation="swiglu", position_embedding="rope", add_bias_linear=False)


#: The HF RoPE types from_llama converts: the default frequencies, and their linear, Llama 3.1 and YaRN scalings.
LLAMA_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


class LlamaFamily(NamedTuple):
    """How one HF model type differs from the Llama block: ``name`` (what errors call it), ``qkv_bias`` (q,
    k and v have biases: ``add_qkv_bias``), ``qk_norm`` (per-head q / k RMSNorms: ``qk_layernorm``),
    ``fused`` (its state dict holds q / k / v as one ``qkv_proj`` and gate / up as one ``gate_up_proj``),
    ``rope_types`` (the RoPE types of :data:`LLAMA_ROPE_TYPES` its config holds: Phi-3's only "default", its
    others being "longrope", as which Phi3Config reads "su" and "yarn")."""

    name: str
    qkv_bias: bool = False
    qk_norm: bool = False
    fused: bool = False
    rope_types: Tuple[str, ...] = LLAMA_ROPE_TYPES


#: The HF ``config.model_type`` values :func:`from_llama` converts: Mistral is Llama's block (its sliding
#: window off), Qwen2 Llama's with q / k / v biases, Qwen3 Llama's with per-head q / k RMSNorms, Phi-3
#: (Phi-3, Phi-4) Llama's with fused projections and a residual dropout (``resid_pdrop``).
LLAMA_FAMILY = {"llama": LlamaFamily("Llama"), "mistral": LlamaFamily("Mistral"),
                "qwen2": LlamaFamily("Qwen2", qkv_bias=True), "qwen3": LlamaFamily("Qwen3", qk_norm=True),
                "phi3": LlamaFamily("Phi-3", fused=True, rope_types=("default",))}

# seqpar's class of each scaling type -> HF's rope_type
_ROPE_TYPES = {type(None): "default", LinearScaling: "linear", RopeScaling: "llama3", YarnScaling: "yarn"}


def _llama_rope(get, family: LlamaFamily) -> Tuple[float, Optional[Union[LinearScaling, RopeScaling, YarnScaling]]]:
    """The RoPE base of a LlamaConfig and its scaling: None for the default type, "linear" as
    :class:`seqpar.ops.LinearScaling`, "llama3" as :class:`seqpar.ops.RopeScaling`, "yarn" as
    :class:`seqpar.ops.YarnScaling` (read as transformers 5 reads it); ValueError for the other types and
    those ``family``'s config does not hold (a Phi-3's "yarn" or "su" is HF's "longrope")."""
    kind = family.name
    params = get("rope_parameters")
    if params is None:  # transformers < 5: rope_theta and rope_scaling attributes
        params = get("rope_scaling") or {}
    if not isinstance(params, Mapping):
        raise ValueError(f"{kind} config rope_parameters must be a dict, got {params!r}")
    # a top-level rope_theta beside rope_parameters without one (a config.json of both eras): transformers 5
    # folds it in
    params = dict(params)
    params.setdefault("rope_theta", get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in family.rope_types:
        raise ValueError(f"{kind} config rope type {rope_type!r} (rope_parameters / rope_scaling) is not supported by "
                         f"seqpar: it implements the RoPE types {family.rope_types} for a {kind}")
    partial = params.get("partial_rotary_factor", get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise ValueError(f"{kind} config partial_rotary_factor={partial!r} is not supported by seqpar: it rotates "
                         "whole heads")
    theta = params.get("rope_theta", 10000.0)
    if rope_type == "default":
        return theta, None
    length = params.get("original_max_position_embeddings")
    if isinstance(length, float) and length.is_integer():
        # HF warns and computes with it (8192.0 written in a config.json): the frequencies of 8192
        params["original_max_position_embeddings"] = int(length)
    try:
        if rope_type == "linear":
            return theta, LinearScaling(**_required(params, ("factor",)))
        if rope_type == "llama3":
            return theta, RopeScaling(**_required(params, ("factor", "low_freq_factor", "high_freq_factor",
                                                           "original_max_position_embeddings")))
        return theta, _yarn_scaling(params, get)
    except ValueError as exc:
        raise ValueError(f"{kind} config rope type {rope_type!r}: {exc}") from None


def _required(params: Mapping, fields: Sequence[str]) -> Dict[str, object]:
    """``fields`` of a RoPE type's parameters, every one required (as HF requires them for "linear" and
    "llama3"); ValueError naming the missing ones."""
    missing = [name for name in fields if params.get(name) is None]
    if missing:
        raise ValueError(f"without {missing} (rope_parameters / rope_scaling)")
    return {name: params[name] for name in fields}


def _yarn_scaling(params: Mapping, get) -> YarnScaling:
    """HF's "yarn" parameters as transformers 5 reads them: the original context defaults to
    max_position_embeddings, a None factor to max_position_embeddings over it, the betas to 32 and 1 (also
    for 0), ``truncate`` to True (taken by its truth: None is False), the attention factor to
    ``0.1 ln(factor) + 1``, or with ``mscale`` and ``mscale_all_dim`` (DeepSeek's) the ratio of the two such
    factors."""
    positions = get("max_position_embeddings")
    length = params.get("original_max_position_embeddings") or positions
    factor = params.get("factor")
    if factor is None and isinstance(length, int) and isinstance(positions, int) and length > 0:
        factor = positions / length
    attention_factor = params.get("attention_factor")
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if attention_factor is None and mscale and mscale_all_dim and is_positive_finite(factor):
        def get_mscale(scale, m):
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
        attention_factor = float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
    return YarnScaling(factor=factor, original_max_position_embeddings=length,
                       beta_fast=params.get("beta_fast") or 32.0, beta_slow=params.get("beta_slow") or 1.0,
                       attention_factor=attention_factor, truncate=bool(params.get("truncate", True)))


def _check_pad(settings: dict) -> None:
    """ValueError naming ``pad_token_id`` when the config's padding index is an id outside the vocabulary
    (for a state-dict source: a model's is its embedding's, whatever its config says since)."""
    pad, vocab = settings["pad"], settings["vocab"]
    if isinstance(pad, int) and isinstance(vocab, int) and not 0 <= pad < vocab:
        raise ValueError(f"{settings['kind']} config pad_token_id={pad!r} is not a token id of its vocab_size {vocab}")


def _padding_idx(pad_token_id, vocab: int):
    """HF Llama's ``embed_tokens`` padding_idx (its row gets no lookup gradient), negative ids counted from
    the end as ``nn.Embedding`` counts them."""
    if isinstance(pad_token_id, int) and not isinstance(pad_token_id, bool) and -vocab <= pad_token_id < 0:
        return pad_token_id + vocab
    return pad_token_id


def _sliding_layers(get, model_type: str) -> Tuple[object, Sequence[int]]:
    """(the sliding window, the indices of the layers HF applies it to) of a config, as HF runs it: Mistral
    and Phi-3 slide every layer whenever ``sliding_window`` is set (they have no switch); Qwen2 the layers its
    ``layer_types`` lists as "sliding_attention" (transformers >= 4.53 fixes them when the config is built,
    from ``use_sliding_window`` and ``max_window_layers``; an edit of those afterwards changes nothing), or
    in older configs without ``layer_types`` those from ``max_window_layers`` on when ``use_sliding_window``."""
    window, layers = get("sliding_window"), get("num_hidden_layers") or 0
    if model_type in ("mistral", "phi3"):
        return window, range(layers)
    if model_type in ("qwen2", "qwen3"):
        layer_types = get("layer_types")
        if layer_types is not None:
            return window, [i for i, layer_type in enumerate(layer_types) if layer_type == "sliding_attention"]
        if get("use_sliding_window"):
            return window, range(get("max_window_layers") or 0, layers)
    return None, ()


#: How to train a family's config with full attention (the advice of a sliding-window refusal).
_QWEN_FULL_ATTENTION = "build the config with use_sliding_window=False, or max_window_layers >= num_hidden_layers"
_FULL_ATTENTION_ADVICE = {"mistral": "build the model with sliding_window=None", "qwen2": _QWEN_FULL_ATTENTION,
                          "qwen3": _QWEN_FULL_ATTENTION, "phi3": "build the model with sliding_window=None"}


def _check_full_attention(get, model_type: str, kind: str, positions) -> None:
    """ValueError for a sliding-window attention that masks anything in sequences of up to ``positions``
    (max_position_embeddings, or from_llama's max_seq_len) tokens (:func:`_sliding_layers`): seqpar's
    attention is full causal. HF lets a query see the keys less than the window behind it, so a window of at
    least ``positions`` masks nothing."""
    other = sorted({layer_type for layer_type in get("layer_types") or ()
                    if layer_type not in ("full_attention", "sliding_attention")})
    if other:
        raise ValueError(f"{kind} config layer_types {other} are not supported by seqpar: its attention is full causal")
    window, sliding = _sliding_layers(get, model_type)
    if sliding and window is not None and not _masks_nothing(window, positions):
        raise ValueError(f"{kind} config sliding_window={window!r} (layers {list(sliding)}) is not supported by "
                         f"seqpar: its attention is full causal, and a window below the context {positions!r} "
                         f"(max_position_embeddings, or max_seq_len) masks keys ({_FULL_ATTENTION_ADVICE[model_type]} "
                         f"to train with full attention, or pass from_llama(max_seq_len={window!r}) or less to train "
                         "on sequences the window does not reach: HF's model computes the same there)")


def _masks_nothing(window, positions) -> bool:
    return isinstance(window, int) and isinstance(positions, int) and window >= positions


def _check_attention_modules(source: nn.Module, settings: dict) -> None:
    """ValueError for an attention module of ``source`` that slides a window narrower than the context: HF's
    Qwen2 attention keeps the ``sliding_window`` it was built with, whatever its config says since."""
    for name, module in source.named_modules():
        window = getattr(module, "sliding_window", None)
        if window is not None and not _masks_nothing(window, settings["positions"]):
            raise ValueError(f"the model's {name}.sliding_window is {window!r}, below the context "
                             f"{settings['positions']!r} (max_position_embeddings, or max_seq_len): seqpar's attention "
                             "is full causal (HF's modules keep the window they were built with: was the config "
                             f"changed since? or pass from_llama(max_seq_len={window!r}) or less)")


#: transformers' class defaults of the settings that change a Llama-family model's math, by model_type: what
#: HF's config class gives a key a config.json leaves out (a config read from elsewhere, e.g. a namespace of
#: the JSON, has no such defaults). Mistral slides a 4096 window unless the key says null.
HF_LLAMA_DEFAULTS = {
    "llama": dict(max_position_embeddings=2048, rms_norm_eps=1e-6),
    "mistral": dict(max_position_embeddings=131072, rms_norm_eps=1e-6, num_key_value_heads=8, sliding_window=4096),
    "qwen2": dict(max_position_embeddings=32768, rms_norm_eps=1e-6, num_key_value_heads=32, sliding_window=4096,
                  max_window_layers=28, use_sliding_window=False),
    "qwen3": dict(max_position_embeddings=32768, rms_norm_eps=1e-6, num_key_value_heads=32, head_dim=128,
                  sliding_window=4096, max_window_layers=28, use_sliding_window=False),
    "phi3": dict(max_position_embeddings=4096, rms_norm_eps=1e-5, pad_token_id=32000, resid_pdrop=0.0),
}


def _llama_settings(config, max_seq_len: Optional[int] = None) -> dict:
    """Read a LlamaConfig (MistralConfig, Qwen2Config, Qwen3Config, Phi3Config) into GPTModel's arguments, a
    key it lacks taken as HF's class default (:data:`HF_LLAMA_DEFAULTS`); ValueError naming any setting
    seqpar can't honour. ``max_seq_len``: the longest sequence to run (None: the config's context)."""
    model_type = getattr(config, "model_type", "llama")
    if model_type not in LLAMA_FAMILY:
        raise ValueError(f"config.model_type {model_type!r} is not one of the Llama family seqpar converts "
                         f"{tuple(LLAMA_FAMILY)}")
    defaults = HF_LLAMA_DEFAULTS[model_type]

    def get(name, default=None):
        return getattr(config, name, defaults.get(name, default))

    family = LLAMA_FAMILY[model_type]
    kind = family.name
    if config is None or get("hidden_size") is None or get("intermediate_size") is None:
        raise ValueError(f"config must be a transformers LlamaConfig, got {type(config).__name__}")
    hidden, heads = get("hidden_size"), get("num_attention_heads")
    kv_heads = get("num_key_value_heads") or heads
    for name, supported in (("attention_bias", (False,)), ("mlp_bias", (False,)), ("hidden_act", LLAMA_ACTIVATIONS)):
        value = get(name, supported[0])
        if value not in supported:
            raise ValueError(f"{kind} config {name}={value!r} is not supported by seqpar (it implements "
                             f"{name}={' or '.join(map(repr, supported))})")
    # HF's heads are head_dim wide (Qwen2's too, when its config has the key), hidden_size /
    # num_attention_heads when it is None
    head_dim = get("head_dim")
    for name, value in (("hidden_size", hidden), ("num_attention_heads", heads), ("head_dim", head_dim)):
        if not (value is None and name == "head_dim") and not (is_int(value) and value > 0):
            raise ValueError(f"{kind} config {name}={value!r} must be a positive int")
    if head_dim is None:
        if hidden % heads:
            raise ValueError(f"{kind} config hidden_size {hidden} is not divisible by num_attention_heads {heads} "
                             "and head_dim is not set")
        head_dim = hidden // heads
    theta, rope_scaling = _llama_rope(get, family)
    positions = get("max_position_embeddings")
    if isinstance(rope_scaling, YarnScaling) and isinstance(positions, int):
        # YaRN stretches the original context by its factor, which HF runs whatever max_position_embeddings
        # says (Qwen2.5 keeps 32768 there and runs 131072 tokens with factor 4): GPTModel's max_seq_len
        positions = max(positions, int(rope_scaling.factor * rope_scaling.original_max_position_embeddings))
    if max_seq_len is not None:
        positions = max_seq_len
    _check_full_attention(get, model_type, kind, positions)
    return dict(kind=kind, qkv_bias=family.qkv_bias, qk_norm=family.qk_norm, fused=family.fused, hidden=hidden,
                heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                # Phi-3's residual dropout is seqpar's hidden dropout (the other families have none)
                hidden_dropout=get("resid_pdrop", 0.0) or 0.0,
                ffn=get("intermediate_size"), layers=get("num_hidden_layers"), positions=positions,
                vocab=get("vocab_size"), eps=get("rms_norm_eps"), theta=theta, rope_scaling=rope_scaling,
                tied=bool(get("tie_word_embeddings", False)), attention_dropout=get("attention_dropout", 0.0) or 0.0,
                pad=_padding_idx(get("pad_token_id"), get("vocab_size")))


def _llama_shapes(settings: dict) -> Dict[str, tuple]:
    """LlamaModel state-dict keys (no "model." prefix) and their shapes, in HF's order (with Qwen2's q / k /
    v biases, Qwen3's q / k norms; Phi-3's fused projections)."""
    h, f, v, d = settings["hidden"], settings["ffn"], settings["vocab"], settings["head_dim"]
    q, kv = settings["heads"] * d, settings["kv_heads"] * d
    norms = {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,)}
    if settings["fused"]:
        layer = {"self_attn.o_proj.weight": (h, q), _PHI3_QKV: (q + 2 * kv, h), _PHI3_GATE_UP: (2 * f, h),
                 "mlp.down_proj.weight": (h, f), **norms}
    else:
        layer = {"self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h),
                 "self_attn.v_proj.weight": (kv, h), "self_attn.o_proj.weight": (h, q),
                 **({key: (rows,) for key, rows in zip(_LLAMA_QKV_BIASES, (q, kv, kv))}
                    if settings["qkv_bias"] else {}),
                 **({key: (d,) for key, _ in _LLAMA_QK_NORMS} if settings["qk_norm"] else {}),
                 "mlp.gate_proj.weight": (f, h), "mlp.up_proj.weight": (f, h), "mlp.down_proj.weight": (h, f), **norms}
    shapes = {"embed_tokens.weight": (v, h)}
    for i in range(settings["layers"]):
        shapes.update({f"layers.{i}.{key}": shape for key, shape in layer.items()})
    shapes["norm.weight"] = (h,)
    return shapes


def _llama_state_dict(state_dict: Mapping[str, torch.Tensor], settings: dict):
    """A LlamaForCausalLM / LlamaModel state dict -> (the model's tensors without the prefix, the untied
    head or None), keys, shapes and the head checked (ValueError naming the offending key)."""
    sd, head = _checked_tensors(state_dict, settings["kind"], _LLAMA_PREFIX, _ROPE_BUFFER, _llama_shapes(settings),
                                f"num_hidden_layers={settings['layers']}")
    embed = sd["embed_tokens.weight"]
    if settings["tied"]:
        if head is not None and (not isinstance(head, torch.Tensor) or head.shape != embed.shape
                                 or not torch.equal(head, embed)):
            raise ValueError(f"{_HEAD} differs from {_LLAMA_PREFIX}embed_tokens.weight{_shapes_differ(head, embed)} "
                             f"but the config has tie_word_embeddings=True")
        return sd, None
    if head is None:
        raise ValueError(f"the state dict has no {_HEAD} but the config has tie_word_embeddings=False (a LlamaModel "
                         f"has no output head: pass the LlamaForCausalLM)")
    check_shapes({_HEAD: head}, {_HEAD: tuple(embed.shape)}, what=f"{settings['kind']} state dict")
    return sd, head


def _llama_to_seqpar_keys(sd: Dict[str, torch.Tensor], head: Optional[torch.Tensor],
                          num_layers: int) -> Dict[str, torch.Tensor]:
    """Llama keys (no prefix) -> GPTModel's unsharded keys: q/k/v (and their biases, Qwen2's) and gate/up
    concatenated by rows (Phi-3's fused ones as they are: the same rows)."""
    out = {"embedding.word_embeddings.weight": sd["embed_tokens.weight"]}
    for i in range(num_layers):
        theirs, ours = f"layers.{i}.", f"layers.{i}."
        for their_key, our_key in _LLAMA_NORMS:
            out[ours + our_key] = sd[theirs + their_key]
        fused = theirs + _PHI3_QKV in sd          # the shapes were checked: fused (Phi-3) throughout, or not
        out[ours + "self_attention.query_key_value.weight"] = \
            sd[theirs + _PHI3_QKV] if fused else torch.cat([sd[theirs + k] for k in _LLAMA_QKV])
        if theirs + _LLAMA_QKV_BIASES[0] in sd:   # the shapes were checked: all three are there, or none
            out[ours + "self_attention.query_key_value.bias"] = torch.cat([sd[theirs + k] for k in _LLAMA_QKV_BIASES])
        for their_key, our_key in _LLAMA_QK_NORMS:
            if theirs + their_key in sd:          # checked: both, or neither
                out[ours + our_key] = sd[theirs + their_key]
        out[ours + "self_attention.dense.weight"] = sd[theirs + "self_attn.o_proj.weight"]
        out[ours + "mlp.dense_h_to_4h.weight"] = \
            sd[theirs + _PHI3_GATE_UP] if fused else torch.cat([sd[theirs + k] for k in _LLAMA_GATE_UP])
        out[ours + "mlp.dense_4h_to_h.weight"] = sd[theirs + "mlp.down_proj.weight"]
    out["final_layernorm.weight"] = sd["norm.weight"]
    if head is not None:
        out["output_layer.weight"] = head
    return out


def _read_on_every_rank(read, tp_group: ProcessGroup, what: str, device=None):
    """``read()`` (the source's settings and weights, checked on this rank alone), agreed over the TP
    group before the model's first collective: a source one rank rejects is a ValueError on every rank,
    not one rank raising while the others wait in the GPTModel constructor's collective. ``device``: the
    model's (None: the source's, not known before the read; the group's device then)."""
    return run_agreed(read, (tp_group,), what=what, device=device)


def _norms_eps(source: nn.Module, configured: float) -> float:
    """The eps ``source``'s norms compute with (``nn.LayerNorm.eps``, HF RMSNorm's ``variance_epsilon``):
    HF reads it from the config once, when it builds them, so a config changed since leaves the modules'
    value, which is what HF runs (as the padding index). ``configured`` where the source has no norms;
    ValueError for norms that differ among themselves (seqpar's layers share one eps)."""
    found = {float(m.variance_epsilon if hasattr(m, "variance_epsilon") else m.eps)
             for m in source.modules() if isinstance(m, nn.LayerNorm) or hasattr(m, "variance_epsilon")}
    if len(found) > 1:
        raise ValueError(f"the model's norms use different eps values {sorted(found)} (its config says "
                         f"{configured!r}): seqpar's layers share one eps")
    return found.pop() if found else configured


def _check_rotary_frequencies(source: nn.Module, settings: dict) -> None:
    """ValueError unless every RoPE module of ``source`` (an ``inv_freq`` buffer) computes the RoPE of
    ``settings["theta"]`` and ``settings["rope_scaling"]``, the one seqpar builds, its attention scaling (1,
    or YaRN's factor) included: HF computes the frequencies from the config once, when it builds the model,
    so a config changed since (its rope_theta, or its rope type rewritten to get past seqpar's refusal of another
    scaling) left HF running other frequencies than the config says. Compared in the buffer's dtype (a
    converted model holds them rounded) where that dtype is normal, to 16 of its ulps or 1 % whichever is
    less: HF may have computed them on another device, its pow an ulp or two apart, which the llama3 blend
    amplifies up to about 8 ulps; a 1 % edit of a scaling field moves them by about 10**4 fp32 ulps (the 1 %
    this compared to before let it through)."""
    d = settings["head_dim"]
    scaling = settings["rope_scaling"]
    expected_type = _ROPE_TYPES[type(scaling)]
    attention_scaling = scaling.attention_scaling if isinstance(scaling, YarnScaling) else 1.0
    built = rope_inv_freq(d, settings["theta"], scaling).double()
    for name, module in source.named_modules():
        freq = module._buffers.get("inv_freq")
        if freq is None or freq.is_meta:
            continue
        rope_type = getattr(module, "rope_type", "default")
        want = built.to(freq.dtype)
        normal = want.abs() >= torch.finfo(freq.dtype).tiny
        if rope_type != expected_type or \
                freq.shape != want.shape or not torch.allclose(freq.detach().cpu()[normal].double(),
                                                               want[normal].double(),
                                                               rtol=min(16 * torch.finfo(freq.dtype).eps, 1e-2),
                                                               atol=0):
            raise ValueError(f"the model's {name or 'rotary'}.inv_freq (rope_type {rope_type!r}) is not the "
                             f"{expected_type!r} RoPE of its config's rope_theta {settings['theta']!r}"
                             f"{'' if scaling is None else f' and {scaling!r}'}, which seqpar would build: HF "
                             "computes with the module's frequencies, set from the config when the model was "
                             "built (was the config changed since? or were they never set: a model built on the "
                             "meta device and materialised without init_weights()). seqpar implements the RoPE "
                             f"types {LLAMA_ROPE_TYPES}")
        module_scaling = getattr(module, "attention_scaling", 1.0)
        if not math.isclose(module_scaling, attention_scaling, rel_tol=1e-12):
            raise ValueError(f"the model's {name or 'rotary'}.attention_scaling {module_scaling!r} is not the "
                             f"{attention_scaling!r} of its config's {scaling!r}, which seqpar would apply: HF "
                             "scales cos and sin by the module's, set from the config when the model was built (was "
                             "the config changed since?)")


def _source_state_dict(source, config, kind: str):
    """(state dict, config, training) of a model or state-dict ``source`` (ValueError otherwise)."""
    if isinstance(source, nn.Module):
        if config is not None:
            raise ValueError("config= is only for a state-dict source: a model brings its own config")
        return source.state_dict(), getattr(source, "config", None), source.training
    if isinstance(source, Mapping):
        if config is None:
            raise ValueError(f"a state-dict source needs config= (its transformers {kind}Config)")
        return source, config, True
    raise ValueError(f"source must be a transformers {kind} model or a state dict, got {type(source).__name__}")


def from_llama(source, *, config=None, tp_group: ProcessGroup = None, sequence_parallel: bool = False,
               recompute: Union[str, Sequence[str]] = "none", backend: str = "auto", device=None,
               params_dtype: Optional[torch.dtype] = None, max_seq_len: Optional[int] = None) -> GPTModel:
    """A :class:`seqpar.GPTModel` with the Llama block holding this rank's shards of a HuggingFace Llama.

    Args:
        source: a ``transformers`` ``LlamaForCausalLM`` or ``LlamaModel`` (tied head only: it has no
            ``lm_head``), or a state dict of either (keys with or without the "model." prefix) together
            with ``config=``; the same of Mistral, Qwen2, Qwen3 or Phi-3 (module docstring).
        config: the ``LlamaConfig`` (``MistralConfig``, ``Qwen2Config``, ``Qwen3Config``, ``Phi3Config``) of a
            state-dict ``source`` (a model brings its own: leave None).
        tp_group: tensor-parallel process group (None: no tensor parallelism). Every rank passes the
            same source; t must divide num_attention_heads, num_key_value_heads and intermediate_size.
        sequence_parallel, backend: as in :class:`seqpar.TransformerConfig`.
        recompute: as in :func:`from_gpt2` (one policy, or one per layer).
        device: where the parameters go; None keeps the source's device.
        params_dtype: the parameters' dtype; None keeps the source's.
        max_seq_len: the model's ``max_seq_len``, the longest sequence it runs (with RoPE no table is sized by
            it); None: ``max_position_embeddings`` (with YaRN at least factor x the original context). A
            sliding window (Mistral v0.1's 4096, Phi-3-mini-4k's 2047) converts when it is at least this
            long: HF's window masks nothing in such sequences, so HF's model computes what seqpar's full
            causal attention does.

    Returns the GPTModel (``model.config`` is the Llama block, see the module docstring), in training
    mode when ``source`` is a state dict and in ``source``'s mode when it is a model. Raises
    ValueError naming a Llama setting seqpar does not implement, or a missing, unexpected or misshapen
    weight. Loss: ``model(input_ids, shift_labels(labels)).sum() / (shift_labels(labels) != -100).sum()``
    is HF's ``LlamaForCausalLM(input_ids, labels=labels).loss``.
    """
    def read():
        state_dict, settings_config, training = _source_state_dict(source, config, "Llama")
        settings = _llama_settings(settings_config, max_seq_len)
        if isinstance(source, nn.Module):
            # HF reads pad_token_id when it builds the embedding: a config changed since (the common
            # `model.config.pad_token_id = tokenizer.eos_token_id`) leaves the module's padding_idx, which
            # is what HF trains by; so for the norms' eps and the RoPE frequencies
            settings["pad"] = source.get_input_embeddings().padding_idx
            settings["eps"] = _norms_eps(source, settings["eps"])
            _check_rotary_frequencies(source, settings)
            _check_attention_modules(source, settings)
        else:
            _check_pad(settings)
        check_eps(settings["eps"], f"{settings['kind']} config rms_norm_eps")
        return settings, *_llama_state_dict(state_dict, settings), training

    _check_device(device, "from_llama")
    max_seq_len = as_int(max_seq_len)
    if max_seq_len is not None and not (is_int(max_seq_len) and max_seq_len > 0):
        raise ValueError(f"max_seq_len must be None or a positive int, got {max_seq_len!r}")
    settings, sd, head, training = _read_on_every_rank(read, tp_group, "seqpar.integrations.hf.from_llama", device)
    embed = sd["embed_tokens.weight"]
    # None for one k/v head per head, as a config built for multi-head attention says it (4 would make a
    # replace() of the head count grouped-query attention)
    groups = None if settings["kv_heads"] == settings["heads"] else settings["kv_heads"]
    cfg = TransformerConfig(
        hidden_size=settings["hidden"], num_attention_heads=settings["heads"], ffn_hidden_size=settings["ffn"],
        num_query_groups=groups, attention_dropout=settings["attention_dropout"], layernorm_epsilon=settings["eps"],
        hidden_dropout=settings["hidden_dropout"],
        rope_theta=settings["theta"], rope_scaling=settings["rope_scaling"], add_qkv_bias=settings["qkv_bias"],
        qk_layernorm=settings["qk_norm"],
        # the head dim as its own field only where it is not h / a (a config from h and a otherwise)
        kv_channels=None if settings["head_dim"] * settings["heads"] == settings["hidden"] else settings["head_dim"],
        sequence_parallel=sequence_parallel,
        recompute=_every_layer(recompute),
        backend=backend,
        params_dtype=embed.dtype if params_dtype is None else params_dtype, **LLAMA_BLOCK)
    model = GPTModel(cfg, settings["layers"], settings["vocab"], settings["positions"], tp_group=tp_group,
                     device=embed.device if device is None else device, embedding_dropout=0.0,
                     share_embeddings_and_output_weights=settings["tied"], padding_idx=settings["pad"],
                     recompute=_per_layer(recompute))
    model.load_full_state_dict(_llama_to_seqpar_keys(sd, head, settings["layers"]))
    return model.train(training)


def _llama_model(model: nn.Module, model_type: Optional[str]) -> Tuple[GPTModel, str]:
    """(:func:`_gpt_model`, its HF model_type: ``model_type``, or None for the one its block implies, "qwen2"
    with q / k / v biases, "qwen3" with q / k norms, else "llama"): ValueError naming the setting unless it
    has the Llama block of that family of :data:`LLAMA_FAMILY`."""
    model = _gpt_model(model)
    cfg = model.config
    different = {k: getattr(cfg, k) for k, v in LLAMA_BLOCK.items() if getattr(cfg, k) != v}
    if different:
        raise ValueError(f"model is not a Llama: its config has {different} (a Llama has {LLAMA_BLOCK})")
    if cfg.add_qkv_bias and cfg.qk_layernorm:
        raise ValueError("model has both add_qkv_bias and qk_layernorm: no HF Llama-family model has both (Qwen2 "
                         "has the biases, Qwen3 the norms)")
    if model_type is None:
        return model, "qwen2" if cfg.add_qkv_bias else "qwen3" if cfg.qk_layernorm else "llama"
    family = LLAMA_FAMILY.get(model_type) if isinstance(model_type, str) else None
    if family is None:
        raise ValueError(f"model_type must be None or one of {tuple(LLAMA_FAMILY)}, got {model_type!r}")
    for field, theirs, what in (("add_qkv_bias", family.qkv_bias, "q / k / v biases"),
                                ("qk_layernorm", family.qk_norm, "per-head q / k norms")):
        if getattr(cfg, field) != theirs:
            raise ValueError(f"model has {field}={getattr(cfg, field)}, but a {family.name} has "
                             f"{'' if theirs else 'no '}{what} (model_type={model_type!r})")
    if _ROPE_TYPES[type(cfg.rope_scaling)] not in family.rope_types:
        raise ValueError(f"model has rope_scaling={cfg.rope_scaling!r}, but a {family.name} config holds the RoPE "
                         f"types {family.rope_types} (model_type={model_type!r})")
    return model, model_type


def _hf_rope_scaling(scaling) -> Optional[Dict[str, object]]:
    """The HF ``rope_scaling`` dict of a seqpar scaling (None for the default RoPE)."""
    if scaling is None:
        return None
    fields = {field.name: getattr(scaling, field.name) for field in dataclasses.fields(scaling)}
    if isinstance(scaling, YarnScaling) and scaling.attention_factor is None:
        del fields["attention_factor"]            # HF's default, the same formula
    return {"rope_type": _ROPE_TYPES[type(scaling)], **fields}


def to_llama_config(model: GPTModel, model_type: Optional[str] = None) -> Dict[str, object]:
    """The ``LlamaConfig`` of ``model`` (a ``Qwen2Config`` with ``add_qkv_bias``, a ``Qwen3Config`` with
    ``qk_layernorm``; or the config of ``model_type``, one of :data:`LLAMA_FAMILY`: "mistral" without a
    sliding window, "phi3" with the hidden dropout as ``resid_pdrop``), as keyword arguments
    (``model_type`` included): with :func:`to_llama_state_dict` it exports a GPTModel with the Llama block,
    trained with seqpar (from scratch too), to HF::

        config = transformers.AutoConfig.for_model(**hf.to_llama_config(model))
        llama = transformers.AutoModelForCausalLM.from_config(config)
        llama.load_state_dict(hf.to_llama_state_dict(model))     # every rank calls it (a collective)

    Sizes (``head_dim`` too), ``max_position_embeddings`` = max_seq_len, the real vocabulary, ``rms_norm_eps``,
    ``rope_theta`` and ``rope_scaling`` ("linear", "llama3" or "yarn"), the tied head, the attention dropout,
    the padding index (``pad_token_id``), ``initializer_range``, the parameters' dtype, and no bos / eos token
    ids (seqpar knows no tokenizer: set them from yours; HF's defaults 1 and 2 would end generations at those
    ids). The hidden (but Phi-3's) and embedding dropouts have no Llama setting and are left out. Not a
    collective. ValueError as :func:`to_llama_state_dict`.
    """
    model, model_type = _llama_model(model, model_type)
    cfg = model.config
    out = dict(model_type=model_type, vocab_size=model.vocab_size,
               max_position_embeddings=model.max_seq_len, hidden_size=cfg.hidden_size,
               intermediate_size=cfg.ffn_hidden_size, num_hidden_layers=len(model.layers),
               num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.kv_heads, hidden_act="silu",
               head_dim=cfg.head_dim,   # Qwen2Config has no such field, but HF's Qwen2 reads it when set
               rms_norm_eps=cfg.layernorm_epsilon, rope_theta=cfg.rope_theta,
               rope_scaling=_hf_rope_scaling(cfg.rope_scaling), tie_word_embeddings=model.output_layer is None,
               attention_dropout=cfg.attention_dropout, initializer_range=cfg.init_method_std,
               pad_token_id=getattr(model.embedding.word_embeddings, "padding_idx", None), **_hf_common(cfg))
    if model_type in ("qwen2", "qwen3"):
        out["use_sliding_window"] = False
    if model_type in ("mistral", "phi3"):
        out["sliding_window"] = None           # MistralConfig's default slides a 4096 window
    if model_type == "phi3":
        out["resid_pdrop"] = cfg.hidden_dropout
    return out


def to_llama_state_dict(model: GPTModel, model_type: Optional[str] = None) -> Dict[str, torch.Tensor]:
    """The unsharded ``LlamaForCausalLM`` state dict of ``model`` (HF key names and order, q/k/v and
    gate/up split back out of the fused weights, the real vocabulary rows), loadable with
    ``load_state_dict(strict=True)``; with ``add_qkv_bias`` (a Qwen2) also the q / k / v biases, a
    ``Qwen2ForCausalLM`` state dict (a Mistral's is a Llama's); with ``qk_layernorm`` also the q / k norms, a
    ``Qwen3ForCausalLM`` state dict. ``model_type`` names the family (:data:`LLAMA_FAMILY`; None: the one
    the block implies, as :func:`to_llama_config`): "phi3" gives a ``Phi3ForCausalLM`` state dict, q / k / v
    and gate / up fused (``qkv_proj``, ``gate_up_proj``). ``lm_head.weight`` is the untied output
    layer, or with a tied head the same tensor as ``model.embed_tokens.weight`` (HF's own state dict holds
    both keys).

    A collective under tensor parallelism: call it on every rank; every rank gets the same dict. A model
    wrapped by DDP or torch.compile is read through the wrapper. ValueError unless ``model`` is a
    GPTModel with the Llama block (RMSNorm, SwiGLU, RoPE, no biases but Qwen2's q / k / v ones; Qwen3's q / k
    norms) of that family.
    """
    model, model_type = _llama_model(model, model_type)
    fused = LLAMA_FAMILY[model_type].fused
    cfg = model.config
    full = _Reads(model.full_state_dict())
    d, f = cfg.head_dim, cfg.ffn_hidden_size
    rows = (cfg.num_attention_heads * d, cfg.kv_heads * d, cfg.kv_heads * d)
    out = {_LLAMA_PREFIX + "embed_tokens.weight": full["embedding.word_embeddings.weight"]}
    for i in range(len(model.layers)):
        ours, theirs = f"layers.{i}.", f"{_LLAMA_PREFIX}layers.{i}."
        if fused:   # Phi-3's order: o_proj, qkv_proj, gate_up_proj, down_proj, the norms
            out.update({theirs + "self_attn.o_proj.weight": full[ours + "self_attention.dense.weight"],
                        theirs + _PHI3_QKV: full[ours + "self_attention.query_key_value.weight"],
                        theirs + _PHI3_GATE_UP: full[ours + "mlp.dense_h_to_4h.weight"],
                        theirs + "mlp.down_proj.weight": full[ours + "mlp.dense_4h_to_h.weight"]})
            out.update({theirs + their_key: full[ours + our_key] for their_key, our_key in _LLAMA_NORMS})
            continue
        weights = full[ours + "self_attention.query_key_value.weight"].split(rows)
        biases = full[ours + "self_attention.query_key_value.bias"].split(rows) if cfg.add_qkv_bias else (None,) * 3
        for weight_key, weight, bias_key, bias in zip(_LLAMA_QKV, weights, _LLAMA_QKV_BIASES, biases):
            out[theirs + weight_key] = weight.clone()      # HF's order: each projection's weight, then its bias
            if bias is not None:
                out[theirs + bias_key] = bias.clone()
        out[theirs + "self_attn.o_proj.weight"] = full[ours + "self_attention.dense.weight"]
        if cfg.qk_layernorm:
            out.update({theirs + their_key: full[ours + our_key] for their_key, our_key in _LLAMA_QK_NORMS})
        gate, up = (w.clone() for w in full[ours + "mlp.dense_h_to_4h.weight"].split(f))
        out.update({theirs + "mlp.gate_proj.weight": gate, theirs + "mlp.up_proj.weight": up,
                    theirs + "mlp.down_proj.weight": full[ours + "mlp.dense_4h_to_h.weight"]})
        for their_key, our_key in _LLAMA_NORMS:
            out[theirs + their_key] = full[ours + our_key]
    out[_LLAMA_PREFIX + "norm.weight"] = full["final_layernorm.weight"]
    out[_HEAD] = full.get("output_layer.weight", out[_LLAMA_PREFIX + "embed_tokens.weight"])
    full.check_all_read("Llama")
    return out


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """HF causal-LM labels [b, s] (``labels=input_ids``, -100 = ignore) -> GPTModel's labels [b, s].

    HF predicts ``labels[:, i + 1]`` from position i and drops the last position; GPTModel expects the
    target of position i at ``labels[:, i]``, so this shifts left by one and ignores (-100) the last
    position. ``GPTModel(input_ids, shift_labels(labels)).sum() / (shift_labels(labels) != -100).sum()``
    is HF's ``.loss``. ValueError for labels that are not an int64 [b, s] tensor.
    """
    if not isinstance(labels, torch.Tensor) or labels.dim() != 2 or labels.dtype != torch.int64:
        raise ValueError(f"labels must be an int64 [b, s] tensor, got "
                         f"{getattr(labels, 'dtype', type(labels).__name__)} {tuple(getattr(labels, 'shape', ()))}")
    b, s = labels.shape
    return torch.cat([labels[:, 1:], labels.new_full((b, min(s, 1)), IGNORE_INDEX)], dim=1)
