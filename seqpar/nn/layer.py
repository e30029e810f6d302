"""The GPT transformer layer of Korthikanti et al., "Reducing Activation Recomputation in Large Transformer
Models", with tensor + sequence parallelism and selective recompute, and the Llama-family block built from
the same parts (TransformerConfig's architecture knobs).

Forward, per rank (t = TP size, H = a / t local query heads, G = g / t local k/v heads, d = h / a; shapes
without SP in brackets)::

    x          [s/t, b, h]   ([s, b, h])
    a1 = norm1(x)                                        LayerNorm or RMSNorm, sequence-sharded under SP
    qkv        [s, b, (H + 2G) d]   column-parallel (g / f before it): [its Q heads, its K, its V groups]
    q, k = rope(q, k)                                    "rope": global positions 0 .. s-1 (out of place)
    o  = attention_core(q, k, v)  [b, H, s, d]           causal, grouped-query when G < H; recomputed in
                                                         backward if "selective" (unless flash-style)
    x2, a2 = norm2 after bias-dropout-add (o W_proj^T, b_proj, x)   row-parallel (g-bar / f-bar), fused
    y  = x2 + dropout(act(a2 W_1^T + b_1) W_2^T + b_2)   column- then row-parallel MLP; act = GeLU on
                                                         [s, b, f/t], or SwiGLU on [gate | up] [s, b, 2f/t]

GPT: LayerNorm, GeLU, multi-head attention, learned positions (in GPTModel), biases, dropout. Llama:
RMSNorm, SwiGLU, grouped-query attention, RoPE, no biases, no dropout.

Dropout masks come from seqpar.random with global coordinates, so results do not depend on t or SP.
Each forward captures its mode (``training``) and draws its dropout seed once, at call time
(:class:`ForwardMode`), and passes them down: seqpar's ``recompute`` in backward replays the same masks,
whatever ``train()`` / ``eval()`` did in between. An external checkpoint (``torch.utils.checkpoint``)
re-runs ``forward`` itself, after restoring torch's CPU generator: it replays them while the mode is the
forward's; like ``nn.Dropout`` under it, a layer switched to ``eval()`` before the backward recomputes
without dropout.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Dict, Optional, Tuple

import torch
from torch import nn

from .. import random as sp_random
from .._custom_op import exporting, outside_compile
from ..config import PARAMS_DTYPES, TransformerConfig
from ..memory import name_storage, saved_as
from ..ops.attention_core import attention_core, select_backend
from ..ops.dropout import NO_DROPOUT, DropoutSpec, bias_dropout_add, dropout_active
from ..ops.registry import dtensor_problem, is_dtensor, requested_backend_problem
from ..ops.rotary import rotary_embedding
from ..ops.swiglu import swiglu
from ..parallel.state import (SAME_MODE_HINT, SEED_HINT, ProcessGroup, SharesProcessGroup, check_ranks_agree,
                              group_rank, group_size, shard_first_row)
from ..recompute import checkpoint
from .autocast import autocast_dtype, run_in_dtype
from .layernorm import LayerNorm, RMSNorm
from .linear import ColumnParallelLinear, RowParallelLinear, SeededNormal, init_normal
from .state_dict import (FSDP_UNIT, IncompatibleKeys, check_intact_parts, check_loadable, check_not_meta,
                         gather_unsharded, on_meta, prepare_parameters, reset_modules, scatter_unsharded,
                         unsharded_entries, unsharded_shapes)


@dataclasses.dataclass(frozen=True)
class ForwardMode:
    """What one forward decided from the module's mode, captured at call time and passed down (never
    re-read in a recomputed region): the dropout probabilities in effect (0 in eval mode) and the seeds
    drawn for this forward (:func:`seqpar.random.next_layer_streams`: the layer seed, then one stream
    seed per dropout site; zeros without dropout)."""

    hidden_p: float = 0.0
    attention_p: float = 0.0
    seeds: Tuple[int, int, int, int] = (0, 0, 0, 0)

    def stream(self, site: int) -> int:
        """The stream seed of dropout site ``site`` (a :class:`seqpar.random.Site`)."""
        return self.seeds[site]


@outside_compile(sp_random.DRAW_NOT_TRACEABLE)
def _draw_seeds(layer: "TransformerLayer") -> Tuple[int, int, int, int]:
    """:func:`seqpar.random.next_layer_streams` of ``layer.layer_number``, with the attribute read outside
    torch.compile as well: Dynamo treats a module's int attributes as constants, so reading it in the
    compiled forward would compile that forward once per layer, and a model deeper than Dynamo's
    recompile limit (8) would run its later layers eagerly. The seeds go to the graph as dynamic inputs
    (:func:`seqpar.random.graph_ints`)."""
    return sp_random.graph_ints(sp_random.next_layer_streams(layer.layer_number))


def build_device(device) -> torch.device:
    """The device parameters made for ``device`` are on (None: torch's default device, which a
    ``with torch.device(...)`` context or ``torch.set_default_device`` sets)."""
    return torch.get_default_device() if device is None else torch.device(device)


def builds_on_meta(device) -> bool:
    """Whether parameters made for ``device`` are on the meta device (:func:`build_device`). The ranks agree
    on it: a rank building on meta runs none of the init collectives a real one runs."""
    return build_device(device).type == "meta"


def trainable_values(module: nn.Module) -> Dict[str, object]:
    """What the ranks' per-forward check compares of ``module``'s parameters: how many require grad and
    which (a string of 0 / 1 in ``parameters()`` order, compared by hash). Ranks that froze different
    parameters (a norm's weight on one rank only) sent its gradient all-reduce partial sums, silently, or
    left it waiting for a rank that froze the norm whole."""
    pattern = "".join("1" if p.requires_grad else "0" for p in module.parameters())
    return {"parameters requiring grad (freeze the same ones on every rank)": pattern.count("1"),
            "which parameters require grad": pattern}


def agreement_values(config: TransformerConfig, **arguments) -> Dict[str, object]:
    """What every tensor-parallel rank must pass identically when building a layer or model: each
    config field, the other constructor ``arguments`` and the RNG state dropout seeds are drawn from."""
    if not isinstance(config, TransformerConfig):
        raise ValueError(f"config must be a seqpar.TransformerConfig, got {type(config).__name__}")
    values = {f"config.{f.name}": getattr(config, f.name) for f in dataclasses.fields(config)}
    values["config.num_query_groups"] = config.kv_heads   # None and num_attention_heads build the same layer
    values["config.kv_channels"] = config.head_dim        # so do None and hidden_size / num_attention_heads
    values.update(arguments)
    # Without dropout nothing is drawn from torch's generator, so its state may differ (a program that
    # never seeds it starts every process from a different state).
    fingerprint = sp_random.generator_fingerprint(
        with_torch_state=bool(config.hidden_dropout or config.attention_dropout))
    values.update(fingerprint)
    return values


def run_problem(config: TransformerConfig, tp_group: ProcessGroup, weight: torch.Tensor) -> Optional[str]:
    """Why a layer or model of ``config`` whose parameters are like ``weight`` can't run here at all (None if
    it can), checked with its inputs, before any dropout seed is drawn: a requested backend that can't run
    on their device or in their dtype (:func:`seqpar.ops.registry.requested_backend_problem`), or
    torch.export under tensor parallelism (the program it made failed when run, in the comm GEMMs' out=
    matmuls)."""
    problem = requested_backend_problem(config.backend, weight.device, weight.dtype)
    if problem is None and group_size(tp_group) > 1 and exporting():
        problem = ("torch.export of a tensor-parallel layer or model is not supported (its collectives and out= "
                   "matmuls don't export): export at t = 1 (tp_group None), or compile with torch.compile")
    return problem


# Why the per-forward rank checks run outside torch.compile (a graph break each, as their host read of a
# collective's result was anyway): traced, the values they compare, torch's generator state among them,
# became guards of the code after the break, which changed at every step with dropout on (a recompile per
# step under tensor parallelism, then that code ran eagerly past Dynamo's recompile limit).
#: The reason given for the rank checks' graph break under torch.compile.
RANK_CHECK_NOT_TRACEABLE = ("the ranks' per-forward input check reads a collective's result on the host; set "
                            "check_rank_inputs = False where the ranks' inputs are known to agree")


def reference_parameter(module: nn.Module, *parts: str) -> torch.Tensor:
    """The parameter whose dtype and device ``module`` computes in: the first one of the first of its
    submodules named ``parts`` that holds one, else its first (any part may be replaced, and a subclass's
    own parameters, which come first in ``parameters()``, may be kept in another dtype). A DTensor is
    passed over for a later part's plain tensor: inside the module's FSDP2 unit its own parameters are
    unsharded (in the mixed-precision policy's dtype), while a part that is an FSDP2 unit of its own
    (``query_key_value``, a norm) still holds its sharded fp32 parameters until its own forward."""
    first = None
    for name in parts:
        part = getattr(module, name, None)
        weight = getattr(part, "weight", None)   # a norm's: no parameter walk per forward
        found = weight if isinstance(weight, torch.Tensor) else (
            next(part.parameters(), None) if isinstance(part, nn.Module) else None)
        if found is not None and not is_dtensor(found):
            return found
        first = first if first is not None else found
    return first if first is not None else next(module.parameters())


def parameter_device(module: nn.Module) -> torch.device:
    """Where ``module``'s parameters live (:func:`reference_parameter` of its ``_REFERENCE_PARTS``)."""
    return reference_parameter(module, *module._REFERENCE_PARTS).device


#: The hint of the layer's and model's construction-time rank-agreement errors.
AGREEMENT_HINT = ("Build every rank's modules from the same arguments after seqpar.manual_seed(s) with the same s "
                  "(it also seeds torch's CPU generator, from which dropout seeds are drawn: a rank that drew "
                  "random numbers from it since then holds a different state)")


def _activation(name: str):
    if name == "gelu":
        return nn.functional.gelu
    return lambda x: nn.functional.gelu(x, approximate="tanh")


def norm_labels(config: TransformerConfig) -> Tuple[str, str]:
    """The meter labels of the two norms' saved inputs (:func:`seqpar.memory.layer_activation_terms`)."""
    return ("LN1 input", "LN2 input") if config.normalization == "layernorm" else ("RMSNorm1 input", "RMSNorm2 input")


class ParallelAttention(SharesProcessGroup, nn.Module):
    """QKV projection (column-parallel), RoPE (optional), attention core (grouped-query when
    ``num_query_groups`` < heads), output projection (row-parallel, bias skipped).

    The fused QKV weight [(a + 2g) d, h] holds all Q heads, then the g K groups, then the g V groups
    (head i: rows i*d .. (i+1)*d of its block); rank r keeps heads r*a/t .. and groups r*g/t .. of each
    block, so its output is [its Q | its K | its V] and its query heads use exactly its k/v groups. The
    projection is [h, a d] (d = ``config.head_dim``: a d = h unless ``kv_channels`` says otherwise).

    With ``qk_layernorm`` the norms ``q_layernorm`` and ``k_layernorm`` (weight [d]) normalise each head
    of q and k before RoPE (Qwen3). Each rank normalises its own heads, so their replicated weights see a
    shard of the rows, as a norm's under sequence parallelism: they enter through f, built with
    ``sequence_parallel=True`` whatever the layer's, and their gradients are summed over ``tp_group``.

    ``config`` (:class:`seqpar.TransformerConfig`) gives the sizes, bias and parallelism options;
    ``tp_group`` is the tensor-parallel group whose t ranks split the heads and groups (None: t = 1);
    ``device``: where the parameters live. ``init_method`` initialises both linears as
    :class:`ColumnParallelLinear` does (default N(0, 0.02), zero biases, from torch's CPU generator);
    TransformerLayer passes None and draws its own.
    """

    def __init__(self, config: TransformerConfig, tp_group: ProcessGroup, device=None,
                 init_method: Optional[Callable[[torch.Tensor], None]] = init_normal):
        super().__init__()
        h, d, dtype = config.hidden_size, config.head_dim, config.params_dtype
        a, g, t = config.num_attention_heads, config.kv_heads, group_size(tp_group)
        self.config, self.tp_group = config, tp_group
        self.local_heads, self.local_kv_heads = a // t, g // t
        common = dict(tp_group=tp_group, sequence_parallel=config.sequence_parallel, overlap_comm=config.overlap_comm,
                      device=device, dtype=dtype, init_method=init_method)
        self.query_key_value = ColumnParallelLinear(h, (a + 2 * g) * d, partition_blocks=(a * d, g * d, g * d),
                                                    bias=config.qkv_bias, **common)
        self.dense = RowParallelLinear(a * d, h, bias=config.add_bias_linear, skip_bias_add=True, **common)
        self.dense.check_rank_inputs = False   # its input comes from query_key_value's, which agreed on it
        if config.qk_layernorm:
            self.q_layernorm = make_norm(config, tp_group, device, hidden_size=d, rows_split=True)
            self.k_layernorm = make_norm(config, tp_group, device, hidden_size=d, rows_split=True)

    def forward(self, a1: torch.Tensor, dropout_p: float, seed: int):
        """a1 [s/t or s, b, h] -> (projection output without bias, bias or None) as RowParallelLinear gives them.

        ``dropout_p``: the attention dropout in effect (0 in eval mode), ``seed``: its stream seed;
        both decided by the caller at forward time (the core may be recomputed in backward).
        """
        cfg = self.config
        with saved_as("QKV input"):
            qkv = name_storage(self.query_key_value(a1), "Q, K, V")
        s, b = qkv.shape[0], qkv.shape[1]
        heads, kv_heads, d = self.local_heads, self.local_kv_heads, cfg.head_dim
        q, k, v = qkv.view(s, b, heads + 2 * kv_heads, d).split([heads, kv_heads, kv_heads], dim=2)
        del qkv    # with RoPE or q/k norms nothing else holds the QKV storage below: freed before the core
        if cfg.qk_layernorm:
            # Contiguous copies: the norms save their input, which as views would pin the QKV storage.
            with saved_as("Q, K norm input"):
                q, k = self.q_layernorm(q.contiguous()), self.k_layernorm(k.contiguous())
        if cfg.position_embedding == "rope":
            # qkv holds the whole sequence (under SP the column-parallel GEMM gathered it), so row i is
            # global position i. Out of place: qkv is the linear's output, which its forward hooks saw
            # and may keep (an in-place rotation changed it under them).
            q, k = rotary_embedding(q, k, position_offset=0, theta=cfg.rope_theta, rope_scaling=cfg.rope_scaling,
                                    backend=cfg.backend)
        if cfg.position_embedding == "rope" or cfg.qk_layernorm:
            # v is copied out of the QKV storage, so it is freed and the core keeps the same bytes: new
            # q, k and the copy of v.
            q, k, v = (name_storage(x, "Q, K, V") for x in (q, k, v.clone()))
        q, k, v = (x.permute(1, 2, 0, 3) for x in (q, k, v))    # [b, heads, s, d]
        # chosen with the dropout the core runs (a backend without dropout still runs an eval forward)
        impl = select_backend(q, k, v, causal=True, backend=cfg.backend, dropout=dropout_active(dropout_p, True))
        # Head-major global dropout rows over the query heads: this rank's first head is rank * H (seqpar.random).
        row_offset = group_rank(self.tp_group) * heads * b * s
        gqa = kv_heads != heads

        def core(q, k, v):
            return attention_core(q, k, v, is_causal=True, dropout_p=dropout_p, scale=cfg.attention_softmax_scale,
                                  enable_gqa=gqa, seed=seed if dropout_p else None, training=True, backend=impl.name,
                                  row_offset=row_offset)

        with saved_as("attention core"):
            if cfg.recompute == "selective" and not impl.recompute_free:
                o = checkpoint(core, q, k, v)
            else:
                o = core(q, k, v)
        context = o.permute(2, 0, 1, 3).reshape(s, b, heads * d)
        with saved_as("projection input"):
            return self.dense(context)


class ParallelMLP(nn.Module):
    """h -> ffn (column-parallel) -> activation -> h (row-parallel, bias skipped).

    SwiGLU: dense_h_to_4h is [2f, h], rows gate (f) then up (f), split as two blocks so each rank's output
    is [its gate | its up] and :func:`seqpar.ops.swiglu` pairs them locally.

    ``config``, ``tp_group`` (whose t ranks split f: fc1's output rows, fc2's input columns), ``device``
    and ``init_method`` as in :class:`ParallelAttention`.
    """

    def __init__(self, config: TransformerConfig, tp_group: ProcessGroup, device=None,
                 init_method: Optional[Callable[[torch.Tensor], None]] = init_normal):
        super().__init__()
        h, f = config.hidden_size, config.ffn_hidden_size
        common = dict(tp_group=tp_group, sequence_parallel=config.sequence_parallel, bias=config.add_bias_linear,
                      overlap_comm=config.overlap_comm, device=device, dtype=config.params_dtype,
                      init_method=init_method)
        self.config = config
        if config.activation == "swiglu":
            self.dense_h_to_4h = ColumnParallelLinear(h, 2 * f, partition_blocks=(f, f), **common)
        else:
            self.dense_h_to_4h = ColumnParallelLinear(h, f, **common)
        self.dense_4h_to_h = RowParallelLinear(f, h, skip_bias_add=True, **common)
        self.dense_4h_to_h.check_rank_inputs = False   # its input comes from dense_h_to_4h's, which agreed on it

    def forward(self, a2: torch.Tensor):
        """a2 [s, b, h] (the post-attention norm's output; [s / t, b, h] under sequence parallelism) ->
        ``(out, bias)``: out [s, b, h] (its sequence shard under SP) without fc2's bias, which comes apart
        for the fused bias-dropout-add (``RowParallelLinear(skip_bias_add=True)``; None without biases)."""
        with saved_as("fc1 input"):
            hidden = self.dense_h_to_4h(a2)
        if self.config.activation == "swiglu":
            with saved_as("SwiGLU input (gate, up)"):
                hidden = swiglu(hidden, backend=self.config.backend)
        else:
            with saved_as("GeLU input"):
                hidden = _activation(self.config.activation)(hidden)
        with saved_as("fc2 input"):
            return self.dense_4h_to_h(hidden)


def make_norm(config: TransformerConfig, tp_group: ProcessGroup, device=None, *, hidden_size: Optional[int] = None,
              rows_split: bool = False):
    """The norm ``config.normalization`` names (:class:`LayerNorm` or :class:`RMSNorm`) over
    ``hidden_size`` (None: h), with ``layernorm_epsilon``, replicated over ``tp_group``. Its input rows are
    split over the ranks under SP (a sequence shard), or always with ``rows_split`` (the q / k norms: each
    rank's heads): then the weights enter through f and their gradients are summed over ``tp_group``."""
    cls = LayerNorm if config.normalization == "layernorm" else RMSNorm
    return cls(config.hidden_size if hidden_size is None else hidden_size, config.layernorm_epsilon,
               tp_group=tp_group, sequence_parallel=config.sequence_parallel or rows_split, backend=config.backend,
               device=device, dtype=config.params_dtype)


class TransformerLayer(SharesProcessGroup, nn.Module):
    """One pre-norm transformer layer (GPT's or the Llama block, per the config) with tensor + sequence
    parallelism and activation recomputation.

    Args:
        config: :class:`seqpar.TransformerConfig`.
        tp_group: tensor-parallel process group containing this rank (None: no tensor parallelism,
            t = 1, where ``sequence_parallel`` changes nothing).
        device: where the parameters live.
        layer_number: this layer's identity in the dropout RNG (GPTModel numbers its layers), an int in
            [0, 2**63).

    ``forward(x)``: x [s_local, b, h] of the parameters' dtype (s_local = s / t with sequence
    parallelism, else s) -> y of the same shape. Causal self-attention. The parameters' dtype is
    ``config.params_dtype``, or what ``.to(dtype)`` / ``.half()`` / ``.bfloat16()`` converted them to.
    The layer computes in that dtype; under an enabled ``torch.autocast`` it runs as the layer converted
    to the autocast dtype (:func:`run_in_dtype`). Dropout is active in training mode; each training forward draws its seed from
    torch's default CPU generator (seqpar.random), so ``torch.utils.checkpoint`` /
    ``checkpoint_wrapper`` around the layer replay its masks.

    Rank checks (t > 1). Building the layer runs one small collective over ``tp_group``: every rank
    must pass the same config and layer_number and hold the same RNG state (seqpar seed and torch's CPU
    generator), else every rank raises ValueError naming the difference. Each forward with
    ``check_rank_inputs`` (default True) runs one more: the ranks' x shapes (s_local, b) and dropout
    seeds must agree, and an input one rank rejects makes every rank raise, instead of a collective
    aborting or hanging (cost: :func:`seqpar.parallel.state.check_ranks_agree`). GPTModel turns it off
    for its layers: it builds their inputs itself. The layer's own linears never agree per call (their
    ``check_rank_inputs`` is False): this check, or its opt-out, covers them.

    Parameters are initialised deterministically from ``seqpar.manual_seed``'s seed and
    ``layer_number`` on the *unsharded* tensors, so any t starts from the same model.
    """

    # where the dtype and device the layer computes in are read (reference_parameter)
    # (the linears first: norms kept in fp32 in a bf16 layer, HF's _keep_in_fp32_modules, take bf16 inputs)
    _REFERENCE_PARTS = ("self_attention", "mlp", "input_layernorm", "post_attention_layernorm")

    def __init__(self, config: TransformerConfig, tp_group: ProcessGroup = None, device=None,
                 layer_number: int = 0):
        super().__init__()
        layer_number = sp_random.as_int(layer_number)
        # First, before anything that can raise on one rank only: the ranks agree on every argument
        # (then every later check fails on all ranks alike) and on the RNG state.
        check_ranks_agree(tp_group, agreement_values(config, layer_number=layer_number,
                                                     on_meta_device=builds_on_meta(device)),
                          what=f"TransformerLayer(layer_number={layer_number!r})", hint=AGREEMENT_HINT,
                          device=build_device(device))
        # The RNG folds layer_number into 64 bits: 2**64 + i would replay layer i's init and masks.
        if not isinstance(layer_number, int) or isinstance(layer_number, bool) or not 0 <= layer_number < 2**63:
            raise ValueError(f"layer_number must be an int in [0, 2**63), got {layer_number!r}")
        config.check_tensor_parallel(group_size(tp_group))
        self.config, self.tp_group, self.layer_number = config, tp_group, layer_number
        self.check_rank_inputs = True
        self.input_layernorm = make_norm(config, tp_group, device)
        # Built without drawing (init_method=None), then each linear gets its own seeded init (SeededNormal:
        # matrix i of the layer from (seed, layer_number, i)), which reset_parameters below draws once; the
        # linear's own reset_parameters (FSDP1's deferred init calls it module by module) draws the same.
        self.self_attention = ParallelAttention(config, tp_group, device, init_method=None)
        self.post_attention_layernorm = make_norm(config, tp_group, device)
        self.mlp = ParallelMLP(config, tp_group, device, init_method=None)
        for part, name in enumerate(self._linear_names()):
            writes_residual = name in ("self_attention.dense", "mlp.dense_4h_to_h")
            std = config.output_init_std if writes_residual else config.init_method_std
            self.get_submodule(name).init_method = SeededNormal(layer_number, part, std)
        for module in self.modules():   # the layer's own input check (or its opt-out) covers its linears'
            if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                module.check_rank_inputs = False
        # this class's: a subclass's override may init parameters its __init__ makes after this one
        TransformerLayer.reset_parameters(self)

    # ------------------------------------------------------------------ forward
    def extra_repr(self) -> str:
        cfg = self.config
        return (f"layer_number={self.layer_number}, recompute={cfg.recompute!r}, tp={group_size(self.tp_group)}, "
                f"sequence_parallel={cfg.sequence_parallel}")

    def _input_problem(self, x) -> Optional[str]:
        """Why ``x`` can't be this rank's input (None if it can)."""
        h = self.config.hidden_size
        if is_dtensor(x):
            return dtensor_problem("x", x)
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[2] != h or not x.is_floating_point():
            got = f"{x.dtype} {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
            return f"x must be a floating [s_local, b, {h}] tensor, got {got}"
        if x.shape[0] == 0 or x.shape[1] == 0:
            return f"x must have a non-empty sequence and batch, got shape {tuple(x.shape)}"
        weight = reference_parameter(self, *self._REFERENCE_PARTS)
        # The parameters' dtype, not config.params_dtype: .to(dtype) / .half() convert the parameters only.
        if weight.dtype not in PARAMS_DTYPES:
            return (f"the layer's parameters are {weight.dtype} (converted with .to() / .double()?): seqpar layers "
                    f"compute in {', '.join(map(str, PARAMS_DTYPES))}")
        if x.dtype != weight.dtype:
            return f"x dtype {x.dtype} != params_dtype: the layer's parameters are {weight.dtype}"
        device = weight.device
        if x.device != device:
            return f"x is on {x.device} but the layer's parameters are on {device}"
        problem = run_problem(self.config, self.tp_group, weight)
        if problem is not None:
            return problem
        if self.config.add_bias_linear and FSDP_UNIT:
            attention, mlp = self.self_attention, self.mlp
            for name, block in (("self_attention", attention), ("mlp", mlp),
                                ("self_attention.dense", getattr(attention, "dense", None)),
                                ("mlp.dense_4h_to_h", getattr(mlp, "dense_4h_to_h", None))):
                if isinstance(block, FSDP_UNIT):
                    return (f"{name} is its own FSDP2 unit (fully_shard): it returns its output bias, a parameter, "
                            "to the layer's fused bias-dropout-add, and FSDP2 frees that parameter when the unit "
                            "reshards after its forward. fully_shard each whole layer, then the model")
        return None

    @outside_compile(RANK_CHECK_NOT_TRACEABLE)
    def _check_ranks(self, x, problem: Optional[str]) -> None:
        """Every rank's input shape, dtype, mode, grad mode, which parameters require grad and the RNG state its
        dropout seeds will be drawn from agree and no rank rejected its x, else ValueError on every rank: uneven SP shards (s = 127 at
        t = 2: 64 and 63 rows) would otherwise abort the process inside gloo, or hang / corrupt NCCL, in the
        first all-gather, and a rank under torch.no_grad would leave the others' backward waiting for it.
        Nothing is drawn before it: a rejected input leaves the generator as at t = 1 (the same later
        masks whatever t is).

        Cost, every forward: one all-gather of 19 int64 per rank (and, with dropout on, hashing torch's CPU
        generator state, 5 KB) and the host reading the result. On NCCL that read synchronises the host
        with the stream once per layer: the collective's latency (~10-30 us) plus the host no longer
        queueing kernels ahead of the GPU at that point (a few tens of us before the queue refills), small
        against a layer forward of milliseconds but not free: set ``check_rank_inputs = False`` when the
        inputs are known to agree (GPTModel does, it builds them from the same tokens on every rank)."""
        shape = tuple(x.shape) if problem is None else (-1, -1)
        cfg = self.config
        dropout_on = self.training and bool(cfg.hidden_dropout or cfg.attention_dropout)
        hint = ("Under sequence parallelism every rank passes its s/t positions of the same [s, b, h] sequence "
                "(s divisible by t)" if cfg.sequence_parallel else "Without sequence parallelism every rank passes "
                "the same [s, b, h] input") + SAME_MODE_HINT + (SEED_HINT if dropout_on else "")
        check_ranks_agree(self.tp_group, {
            "x.shape[0] (s_local)" if cfg.sequence_parallel else "x.shape[0] (s)": shape[0], "x.shape[1] (b)": shape[1],
            "x dtype (under autocast its dtype)": getattr(x, "dtype", None), "training": int(self.training),
            "grad mode": int(torch.is_grad_enabled()), **trainable_values(self),
            **sp_random.generator_fingerprint(with_torch_state=dropout_on)},   # what the dropout seeds come from
            what=f"TransformerLayer(layer_number={self.layer_number}) input", error=problem, hint=hint,
            device=parameter_device(self))

    def _forward_mode(self) -> ForwardMode:
        """This call's mode: dropout in effect (training) and, if any, seeds drawn now from torch's
        default CPU generator (seqpar.random.next_layer_streams)."""
        cfg = self.config
        hidden_p = cfg.hidden_dropout if self.training else 0.0
        attention_p = cfg.attention_dropout if self.training else 0.0
        if not (hidden_p or attention_p):
            return ForwardMode(hidden_p, attention_p)
        return ForwardMode(hidden_p, attention_p, _draw_seeds(self))

    def _hidden_spec(self, mode: ForwardMode, site: int, x: torch.Tensor) -> DropoutSpec:
        if not mode.hidden_p:
            return NO_DROPOUT
        return DropoutSpec(mode.hidden_p, mode.stream(site),
                           shard_first_row(x, self.tp_group, self.config.sequence_parallel))

    def _forward_impl(self, x: torch.Tensor, mode: ForwardMode) -> torch.Tensor:
        """The layer given this forward's ``mode``; reads no module state but parameters and the frozen
        config, so the full-recompute re-run in backward computes exactly what the forward did."""
        norm1, norm2 = norm_labels(self.config)
        with saved_as(norm1):
            a1 = self.input_layernorm(x)
        projection, projection_bias = self.self_attention(a1, mode.attention_p, mode.stream(sp_random.Site.ATTENTION))
        with saved_as(norm2):
            fused = self.post_attention_layernorm(  # its __call__ (hooks fire): the fused bias-dropout-add-norm
                projection, projection_bias, x, self._hidden_spec(mode, sp_random.Site.ATTENTION_OUT, x))
        if not (isinstance(fused, tuple) and len(fused) == 2):
            # a pre-hook that keeps only the first argument (torch's SequenceParallel style) makes the norm
            # return norm(x) alone, which unpacked along s gave a wrong shape or a bare unpacking error
            raise ValueError("post_attention_layernorm returned one tensor, not (norm(residual_out), residual_out): "
                             "a hook or parallel style (torch.distributed.tensor.parallel) on it dropped the "
                             "arguments of the fused bias-dropout-add; seqpar's layers shard their norms themselves "
                             "(sequence_parallel)")
        a2, x2 = fused
        mlp_out, mlp_bias = self.mlp(a2)
        return bias_dropout_add(mlp_out, mlp_bias, x2, self._hidden_spec(mode, sp_random.Site.MLP_OUT, x),
                                backend=self.config.backend)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [s_local, b, h] (s_local = s / t under sequence parallelism, else s), of the parameters' dtype
        and device -> y [s_local, b, h]: causal self-attention and MLP, each added to its residual (the
        class docstring has dropout, recompute, autocast and the rank checks)."""
        dtype = autocast_dtype(self)
        if dtype is not None:
            return run_in_dtype(self, dtype, self._forward, x)
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        """:meth:`forward` in the parameters' dtype."""
        problem = self._input_problem(x)
        if self.check_rank_inputs and group_size(self.tp_group) > 1:
            self._check_ranks(x, problem)   # raises this rank's problem too, once every rank has checked
        elif problem is not None:
            raise ValueError(problem)
        # drawn once, after the checks (a rejected input leaves the generator as it was), outside any region
        # seqpar recomputes
        mode = self._forward_mode()
        # x is read by several ops (the first norm, the residual add, under SP the all-gather): one copy of an
        # unusual layout (a transposed [b, s, h]) here, not one in each; a no-op for the usual [s, b, h]
        x = x.contiguous()
        if self.config.recompute == "full":
            with saved_as("layer input (full recompute)"):
                return checkpoint(self._forward_impl, x, mode, module=self)
        return self._forward_impl(x, mode)

    # ------------------------------------------------------------------ unsharded weights
    @staticmethod
    def _linear_names() -> Tuple[str, ...]:
        return ("self_attention.query_key_value", "self_attention.dense", "mlp.dense_h_to_4h", "mlp.dense_4h_to_h")

    def _part_classes(self) -> Dict[str, type]:
        """{key prefix: the class the layer builds there} of its parts (what init and the part checks read)."""
        norm = LayerNorm if self.config.normalization == "layernorm" else RMSNorm
        qk_norms = {"self_attention.q_layernorm": norm, "self_attention.k_layernorm": norm} \
            if self.config.qk_layernorm else {}
        return {"input_layernorm": norm, "self_attention.query_key_value": ColumnParallelLinear,
                **qk_norms, "self_attention.dense": RowParallelLinear, "post_attention_layernorm": norm,
                "mlp.dense_h_to_4h": ColumnParallelLinear, "mlp.dense_4h_to_h": RowParallelLinear}

    def _parts(self, what: str) -> Dict[str, nn.Module]:
        """{key prefix: module} of the parts still the layer's own (:func:`check_intact_parts`: ValueError
        for a wrapped or reparametrized one; a replaced one left out)."""
        return check_intact_parts(self, self._part_classes(), what)

    def full_shapes(self) -> Dict[str, tuple]:
        """Unsharded state-dict keys and shapes of every parameter (PyTorch Linear layout, weight [out, in]):
        the layer's own parts, with ``.bias`` keys only where there are biases (``add_bias_linear``,
        ``add_qkv_bias`` for the QKV linear; LayerNorm, not RMSNorm), and any parameter a subclass or a
        replaced submodule holds (split as its module splits it if that is a seqpar parallel module, else
        replicated), in ``state_dict()``'s order. ValueError for a wrapped or reparametrized part, as
        :meth:`full_state_dict`."""
        self._parts(f"TransformerLayer(layer_number={self.layer_number}).full_shapes")
        return unsharded_shapes(unsharded_entries(self))

    @torch.no_grad()
    def load_full_state_dict(self, state_dict: Dict[str, torch.Tensor], strict: bool = True) -> IncompatibleKeys:
        """Load ``state_dict``, UNSHARDED weights keyed as :meth:`full_shapes` (the same dict on every
        rank); each rank keeps its shard. Keys and shapes are checked first (ValueError); ``strict=False``
        loads the keys the dict holds and returns the missing and unexpected ones (shapes are still
        checked), as ``nn.Module.load_state_dict``."""
        what = f"TransformerLayer(layer_number={self.layer_number}).load_full_state_dict"
        self._parts(what)
        prepared = prepare_parameters(self, what)
        entries = unsharded_entries(self)
        keys = check_loadable(state_dict, unsharded_shapes(entries), self.tp_group, device=parameter_device(self),
                              strict=strict, what=what, data_parallel_groups=prepared.data_parallel_groups())
        scatter_unsharded(entries, state_dict)
        return keys

    @torch.no_grad()
    def full_state_dict(self) -> Dict[str, torch.Tensor]:
        """The unsharded weights (a collective under tensor parallelism: call it on every rank). ValueError
        on every rank if a replicated parameter differs between the ranks (:func:`gather_unsharded`)."""
        what = f"TransformerLayer(layer_number={self.layer_number}).full_state_dict"
        self._parts(what)
        prepare_parameters(self, what)
        return gather_unsharded(unsharded_entries(self), self.tp_group, what)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Deterministic init of the unsharded weights, each part through its own ``reset_parameters``:
        each linear's ``init_method`` (built with :class:`~seqpar.nn.linear.SeededNormal`,
        N(0, config.init_method_std), the attention projection and fc2 N(0, config.output_init_std), from
        (seqpar seed, layer_number, which matrix)) and a zero bias, unit norm weights and zero norm biases;
        then each rank keeps its shard, in the parameters' dtype. Drawn on the CPU whatever the default
        device (``with torch.device("meta")`` included). A linear whose ``init_method`` you set to None
        keeps its weight and bias. A module you put in place of a part is reset by its own
        ``reset_parameters`` (or its children's); parameters a subclass adds to the layer itself are the
        subclass's to initialise (override this method, calling it first; construction runs this class's
        own, before the subclass's parameters exist, so call the override at the end of your ``__init__``).
        On a layer built on the meta device it does nothing (as torch's own inits: there is nothing to fill;
        ``to_empty(device=...)``, then call it); a ValueError if only some parameters are on meta."""
        what = f"TransformerLayer(layer_number={self.layer_number}).reset_parameters"
        self._parts(what)
        if on_meta(self):
            return
        check_not_meta(self, what)   # partly materialised: filling its meta tensors would do nothing, silently
        prepare_parameters(self, what)
        reset_modules(self.children())
