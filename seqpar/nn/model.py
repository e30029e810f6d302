"""A small GPT on top of TransformerLayer: vocab-parallel embedding, N layers, final norm, an output
head (tied to the word embedding, or its own vocab-parallel ``output_layer`` as Llama's ``lm_head``) and
a vocab-parallel cross-entropy (the logits are never gathered: each rank holds a vocabulary shard).
With ``position_embedding="rope"`` (the Llama block) there is no position table: the layers rotate q
and k.

Shapes: ``tokens`` [b, s] (int64, the full sequence on every rank) -> loss per token [s, b] (fp32),
or logits [s, b, vocab_end - vocab_start] when no labels are given. Under sequence parallelism the
embedding output is scattered to [s/t, b, h] shards before the layers and gathered (g) before the
output head.

Vocabulary padding (Megatron's make-vocab-size-divisible-by): the word-embedding table (and an untied
output layer) has ``padded_vocab_size`` = v rounded up to a multiple of ``t * 128`` rows, split evenly
over the t ranks, so every rank holds a [padded_vocab_size / t, h] shard whatever v is (v = 50257 for
GPT-2). Rank r holds the rows of global ids ``r * padded_vocab_size / t`` onwards; the real ones among
them are ``[vocab_start, vocab_end)`` with ``vocab_start = r * padded_vocab_size / t`` and
``vocab_end = max(vocab_start, min(v, (r + 1) * padded_vocab_size / t))`` (an empty shard, ``vocab_end == vocab_start``,
on the last ranks when v is small). The padded rows are rows no op reads (zero after building,
``reset_parameters`` or ``load_full_state_dict``; after ``to_empty`` and a DCP load, whatever memory
``to_empty`` left, as DCP loads the real rows only): the output head
multiplies by the real rows only, so padded logits do not exist, never enter the softmax and never
get a gradient; unsharded state dicts hold the v real rows.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, Dict, Mapping, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import nn

from .. import random as sp_random
from ..config import TransformerConfig
from ..ops import registry
from ..ops.comm_matmul import _all_gather_matmul, copy_matmul
from ..ops.dropout import DropoutSpec, dropout
from ..parallel.overlap import ChunkPlan
from ..parallel.mappings import reduce_from_tensor_region, scatter_to_sequence_region
from .._custom_op import capturing_graph, once_differentiable, outside_compile
from ..parallel.state import (SAME_MODE_HINT, SEED_HINT, ProcessGroup, SharesProcessGroup, agreement_checked,
                              check_ranks_agree, group_rank, group_size, shard_first_row)
from ..memory import recompute_policies, saved_as
from .autocast import autocast_dtype, call_self_casting, in_run_dtype, run_in_dtype
from .layer import (AGREEMENT_HINT, RANK_CHECK_NOT_TRACEABLE, TransformerLayer, agreement_values, build_device,
                    builds_on_meta, make_norm, parameter_device, reference_parameter, run_problem, trainable_values)
from .layernorm import LayerNorm, RMSNorm
from .linear import SeededNormal
from .state_dict import (IncompatibleKeys, ShardedParameters, ShardLayout, check_intact_parts, check_loadable,
                         check_not_meta, full_parameters, gather_unsharded, on_meta, prepare_parameters, reset_modules,
                         scatter_full, scatter_unsharded, unsharded_entries, unsharded_shapes)

#: The embedding dropout's "layer number" in the RNG (its site: ``Site.EMBEDDING``).
EMBEDDING_RNG_LAYER = 2**31 - 1
#: The padded vocabulary is a multiple of this times t.
VOCAB_PAD_MULTIPLE = 128
#: A label equal to it gives no loss and no gradient (torch's default).
IGNORE_INDEX = -100


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy over logits split along the vocabulary, never gathered.

    ``loss[i] = log(sum_j exp(z[i, j])) - z[i, labels[i]]`` for logits z [s, b, v_local] (this rank's
    columns are the global ids ``vocab_start .. vocab_start + v_local - 1``; v_local may be 0) and
    labels [s, b] -> loss [s, b] in fp32 (fp64 for fp64 logits). The max, the target logit and the exp-sum
    are reduced over the group. A label equal to ``ignore_index`` gives loss 0 and no gradient, as in
    :func:`torch.nn.functional.cross_entropy` with ``reduction="none"``.
    """

    @staticmethod
    def forward(ctx, logits_local, labels, vocab_start, ignore_index, group):
        # One fp32 [s, b, v_local] buffer of our own (a copy even of fp32 logits: the caller's stay as they
        # are), shifted, exponentiated and normalised in place into the softmax backward keeps: with a new
        # tensor per step the loss held four fp32 copies of the logits at once (4.5x the fp32 logits' bytes
        # with bf16 logits, the step's peak at large vocabularies: it comes after every layer's forward).
        probs = logits_local.to(registry.acc_dtype(logits_local.dtype), copy=True)   # (fp64 logits: fp64)
        v_local = probs.shape[-1]
        if v_local:
            logits_max = probs.amax(dim=-1)
        else:  # this rank's shard holds only padded rows: it adds nothing to the sums
            logits_max = probs.new_full(labels.shape, float("-inf"))
        if group_size(group) > 1:
            dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        probs.sub_(logits_max.unsqueeze(-1))                                  # the shifted logits
        valid = labels != ignore_index
        local_labels = labels - vocab_start
        in_shard = valid & (local_labels >= 0) & (local_labels < v_local)
        safe = local_labels.clamp(0, max(v_local - 1, 0))
        if v_local:
            # masked_fill, not a product with in_shard: the clamped column of a label outside this shard may
            # hold -inf (an fp16 logit that overflowed), and -inf * 0 is NaN, which the sum spreads. (Not
            # torch.where either: its output takes the layout of labels, which may be a transposed view,
            # and the all-reduce below needs a contiguous tensor: gloo summed the wrong elements.)
            target = torch.gather(probs, -1, safe.unsqueeze(-1)).squeeze(-1).masked_fill(~in_shard, 0.0)
        else:
            target = torch.zeros_like(logits_max)
        sum_exp = probs.exp_().sum(dim=-1)
        if group_size(group) > 1:
            dist.all_reduce(target, group=group)
            dist.all_reduce(sum_exp, group=group)
        probs.div_(sum_exp.unsqueeze(-1))                                     # the softmax
        ctx.save_for_backward(probs, safe, in_shard, valid)
        ctx.dtype = logits_local.dtype
        return torch.where(valid, sum_exp.log() - target, 0.0)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss):
        softmax, safe, in_shard, valid = ctx.saved_tensors
        # (softmax - onehot(label)) * grad_loss, computed in fp32 and rounded once into the one new tensor,
        # in the logits' dtype (an fp32 gradient and its cast were two: 1.5x a bf16 gradient's bytes more at
        # the loss backward's peak). The saved softmax stays as it is: a retain_graph backward reads it again.
        grad_loss = torch.where(valid, grad_loss, 0.0).unsqueeze(-1)   # ignored positions get no gradient
        grad = torch.mul(softmax, grad_loss, out=torch.empty(softmax.shape, dtype=ctx.dtype, device=softmax.device))
        if grad.shape[-1]:   # the label's column: (p - 1) * grad_loss (p - 0, as written, outside the shard)
            index = safe.unsqueeze(-1)
            at_label = (softmax.gather(-1, index) - in_shard.unsqueeze(-1).to(softmax.dtype)) * grad_loss
            grad.scatter_(-1, index, at_label.to(ctx.dtype))
        return grad, None, None, None, None


class _GatherVocabColumns(torch.autograd.Function):
    """Every rank's real logit columns side by side: this rank's [..., v_local] -> [..., vocab_size], the same
    on every rank. Each rank's block is padded to ``rows`` (= padded_vocab_size / t) columns for one
    all-gather; the blocks in rank order are the padded vocabulary, whose first ``vocab_size`` columns are
    the real ids in order. The backward keeps this rank's columns of the gradient: every rank computes the
    same loss from the gathered logits and runs its own backward, so summing the ranks' gradients
    (all_gather's usual backward) would count the loss t times."""

    @staticmethod
    def forward(ctx, logits_local, rows, vocab_size, vocab_start, group):
        ctx.columns = (vocab_start, logits_local.shape[-1])
        block = torch.nn.functional.pad(logits_local, (0, rows - logits_local.shape[-1])).contiguous()
        blocks = [torch.empty_like(block) for _ in range(group_size(group))]
        dist.all_gather(blocks, block, group=group)
        # each rank's real columns, concatenated into a new tensor (a slice of the padded whole was a view,
        # which an in-place edit under autograd refused at t > 1 and not at t = 1)
        return torch.cat([block[..., :max(0, min(rows, vocab_size - r * rows))] for r, block in enumerate(blocks)],
                         dim=-1)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_full):
        start, v_local = ctx.columns
        return grad_full[..., start:start + v_local].contiguous(), None, None, None, None


def padded_vocab_size(vocab_size: int, tp_size: int) -> int:
    """``vocab_size`` rounded up to a multiple of ``tp_size * 128`` (Megatron's
    make-vocab-size-divisible-by 128, times t): every rank's shard has the same number of rows."""
    multiple = VOCAB_PAD_MULTIPLE * tp_size
    return -(-vocab_size // multiple) * multiple


class _VocabShard(ShardedParameters, SharesProcessGroup, nn.Module):
    """A [v, h] table split along the padded vocabulary: ``weight`` [padded_vocab_size / t, h], this
    rank's real rows ``[vocab_start, vocab_end)`` first, padded rows (never read; zero unless ``to_empty``
    left them uninitialised) after them."""

    def __init__(self, vocab_size: int, hidden_size: int, *, tp_group: ProcessGroup = None, device=None,
                 dtype=None):
        super().__init__()
        registry.check_sizes(vocab_size=vocab_size, hidden_size=hidden_size)
        registry.check_param_dtype(dtype)
        t, r = group_size(tp_group), group_rank(tp_group)
        self.vocab_size, self.tp_group = vocab_size, tp_group
        self.padded_vocab_size = padded_vocab_size(vocab_size, t)
        rows = self.padded_vocab_size // t
        self.vocab_start = r * rows
        self.vocab_end = max(self.vocab_start, min(vocab_size, self.vocab_start + rows))
        self.weight = nn.Parameter(torch.zeros(rows, hidden_size, device=device, dtype=dtype))

    #: Called on the unsharded fp32 [vocab_size, h] table by :meth:`reset_parameters` (None: zeros);
    #: GPTModel sets a :class:`~seqpar.nn.linear.SeededNormal`.
    init_method: Optional[Callable[[torch.Tensor], None]] = None

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """``init_method`` on the unsharded [vocab_size, h] table (fp32, on the CPU), the ``padding_idx``
        row (if any) then zero, as nn.Embedding and HF start it (its lookups never update it); then this
        rank's shard of it, padded rows zero."""
        full = torch.zeros(self.vocab_size, self.weight.shape[1], dtype=torch.float32, device="cpu")
        if self.init_method is not None:
            self.init_method(full)
        padding_idx = getattr(self, "padding_idx", None)
        if padding_idx is not None:
            full[padding_idx] = 0.0
        self.load_full(full)

    def extra_repr(self) -> str:
        return (f"vocab_size={self.vocab_size}, padded_vocab_size={self.padded_vocab_size}, "
                f"hidden_size={self.weight.shape[1]}, tp={group_size(self.tp_group)}, "
                f"rows=[{self.vocab_start}, {self.vocab_end})")

    @property
    def real_weight(self) -> torch.Tensor:
        """The rows of real token ids ``[vocab_start, vocab_end)``: [vocab_end - vocab_start, h] (a view; the
        weight itself where this shard has no padded rows: a slice's backward writes its gradient into a
        new zero-filled [rows, h] tensor)."""
        n = self.vocab_end - self.vocab_start
        return self.weight if n == self.weight.shape[0] else self.weight[:n]

    def logits(self, hidden: torch.Tensor, *, sequence_parallel: bool, overlap_comm: bool) -> torch.Tensor:
        """This rank's logits [s, b, v_local] = hidden @ real_weight^T (v_local = vocab_end - vocab_start,
        may be 0), from ``hidden`` [s, b, h], or under sequence parallelism its sequence shard [s/t, b, h]
        (gathered inside the GEMM: g). Its callers agreed on ``hidden`` (GPTModel's token check)."""
        # as autocast casts it: prune / the old weight_norm set ``weight`` from fp32 parameters in a forward
        # pre-hook, before run_in_dtype swaps in the casts
        weight = in_run_dtype(self, self.real_weight)
        if not sequence_parallel:
            return copy_matmul(hidden, weight, None, self.tp_group)
        # As the layers' column-parallel GEMMs: on flattened rows, saving only this rank's sequence shard
        # for backward (re-gathered there), not the gathered [s, b, h] (t times the bytes). The overlap plan
        # is sized by the padded shard's rows, which every rank shares: the real rows differ on the last
        # ranks, and plans chosen from them could differ (ranks waiting in different collectives).
        rows = hidden.reshape(-1, hidden.shape[-1])
        t = group_size(self.tp_group)
        plan = ChunkPlan.choose(overlap_comm, t=t, chunk_rows=rows.shape[0], k=rows.shape[1],
                                n=self.weight.shape[0], device=rows.device)
        logits = _all_gather_matmul(rows, weight, None, self.tp_group, plan)
        # Sizes written out: a rank's vocabulary shard may be empty (v_local = 0).
        return logits.view(hidden.shape[0] * t, hidden.shape[1], weight.shape[0])

    def shard_layouts(self, rank: int) -> Dict[str, ShardLayout]:
        """Rank ``rank``'s real rows of the [vocab_size, h] table: its first ``vocab_end - vocab_start``
        rows are rows ``vocab_start ..`` (its padded rows are in no piece)."""
        rows = self.padded_vocab_size // group_size(self.tp_group)
        start = rank * rows
        real = max(0, min(self.vocab_size, start + rows) - start)
        return {"weight": ShardLayout((self.vocab_size, self.weight.shape[1]), 0, ((0, start, real),))}

    @torch.no_grad()
    def load_full(self, weight: torch.Tensor) -> None:
        """Keep this rank's rows of the unsharded ``weight`` [vocab_size, h]; padded rows become zero.
        (Real rows first: ``weight`` may share memory with this table, e.g. the model's own state dict.)"""
        self._load_full_parameters({"weight": weight})

    def full(self) -> torch.Tensor:
        """The unsharded [vocab_size, h] table, a new tensor (a collective under TP)."""
        return full_parameters(self)["weight"]


class VocabParallelEmbedding(_VocabShard):
    """Word embeddings split along the padded vocabulary: ``weight`` [padded_vocab_size / t, h].

    ``forward(tokens)``: int64 ids in [0, vocab_size) of shape [...] -> [..., h]; each rank looks up the
    ids of its shard ``[vocab_start, vocab_end)`` (zero elsewhere) and the group sums the results
    (f-bar). The padded rows (local rows ``vocab_end - vocab_start`` onwards) are never read (zero after
    building, a reset or a full load). ``padding_idx`` (a global id, or None) is ``nn.Embedding``'s: its
    row's lookups add nothing to its gradient (HF Llama's ``pad_token_id``).
    """

    def __init__(self, vocab_size: int, hidden_size: int, *, tp_group: ProcessGroup = None, device=None,
                 dtype=None, padding_idx: Optional[int] = None):
        super().__init__(vocab_size, hidden_size, tp_group=tp_group, device=device, dtype=dtype)
        if padding_idx is not None and (not isinstance(padding_idx, int) or isinstance(padding_idx, bool)
                                        or not 0 <= padding_idx < vocab_size):
            raise ValueError(f"padding_idx must be None or a token id in [0, {vocab_size}), got {padding_idx!r}")
        self.padding_idx = padding_idx

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """``tokens`` int64 [...] -> [..., h]: this rank's shard's lookups, zero for ids outside it, summed over
        the group (f-bar; class docstring). Call the module, as any :class:`torch.nn.Module`, so hooks run."""
        n_real = self.vocab_end - self.vocab_start
        local_ids = tokens - self.vocab_start
        in_shard = (local_ids >= 0) & (local_ids < n_real)
        local_pad = (self.padding_idx - self.vocab_start
                     if self.padding_idx is not None and self.vocab_start <= self.padding_idx < self.vocab_end
                     else None)
        word = nn.functional.embedding(local_ids.clamp(0, max(n_real - 1, 0)), self.weight, padding_idx=local_pad)
        # masked_fill, not a product with the mask: a shard without real rows looks up padded row 0, which
        # holds whatever to_empty left there until something fills it (NaN * 0 is NaN).
        return reduce_from_tensor_region(word.masked_fill(~in_shard.unsqueeze(-1), 0.0), self.tp_group)


class VocabParallelOutputLayer(_VocabShard):
    """An untied output head (Llama's ``lm_head``) split along the padded vocabulary like the embedding:
    ``weight`` [padded_vocab_size / t, h]; ``forward(hidden)``: [s, b, h], or under
    ``sequence_parallel`` this rank's shard [s/t, b, h] -> this rank's logits [s, b, vocab_end -
    vocab_start] (real rows only: :meth:`logits`)."""

    def __init__(self, vocab_size: int, hidden_size: int, *, tp_group: ProcessGroup = None, device=None,
                 dtype=None, sequence_parallel: bool = False, overlap_comm: bool = True):
        super().__init__(vocab_size, hidden_size, tp_group=tp_group, device=device, dtype=dtype)
        self.sequence_parallel, self.overlap_comm = sequence_parallel, overlap_comm

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """:meth:`logits` of ``hidden`` with the module's ``sequence_parallel`` and ``overlap_comm``. Call the
        module, as any :class:`torch.nn.Module`, so hooks run. Under an enabled ``torch.autocast`` as if
        converted to its dtype, as the parallel linears (the GEMM under tensor parallelism is a Function
        that computes in its operands' dtype: autocast does not cast them for it)."""
        dtype = autocast_dtype(self)
        if dtype is not None:
            return run_in_dtype(self, dtype, self._forward, hidden)
        return self._forward(hidden)

    def _forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.logits(hidden, sequence_parallel=self.sequence_parallel, overlap_comm=self.overlap_comm)


class _PositionEmbedding(nn.Embedding):
    """``nn.Embedding`` [max_seq_len, h], replicated on every rank, built as zeros and filled by
    :meth:`reset_parameters` from ``init_method`` (GPTModel sets a seeded one): nn.Embedding's own init
    drew N(0, 1) from torch's CPU generator, shifting every later dropout seed."""

    def __init__(self, max_seq_len: int, hidden_size: int, *, device=None, dtype=None):
        super().__init__(max_seq_len, hidden_size, _weight=torch.zeros(max_seq_len, hidden_size, device=device,
                                                                       dtype=dtype))
        self.init_method: Optional[Callable[[torch.Tensor], None]] = None

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """``init_method`` on the fp32 [max_seq_len, h] table on the CPU (None: zeros), copied in."""
        full = torch.zeros(self.num_embeddings, self.embedding_dim, dtype=torch.float32, device="cpu")
        if getattr(self, "init_method", None) is not None:
            self.init_method(full)
        scatter_full(full, self.weight)


class GPTEmbedding(nn.Module):
    """Word (vocab-parallel) + learned position embeddings: tokens [b, s] -> [s, b, h], the full sequence.

    Submodules: ``word_embeddings`` (:class:`VocabParallelEmbedding`) and, with ``learned_positions``,
    ``position_embeddings`` (``nn.Embedding`` [max_seq_len, h], replicated on every rank).
    """

    def __init__(self, vocab_size: int, max_seq_len: int, hidden_size: int, *, tp_group: ProcessGroup = None,
                 device=None, dtype=None, learned_positions: bool = True, padding_idx: Optional[int] = None):
        super().__init__()
        self.word_embeddings = VocabParallelEmbedding(vocab_size, hidden_size, tp_group=tp_group,
                                                      device=device, dtype=dtype, padding_idx=padding_idx)
        self.position_embeddings = (_PositionEmbedding(max_seq_len, hidden_size, device=device, dtype=dtype)
                                    if learned_positions else None)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """``tokens`` int64 [b, s] -> [s, b, h] (contiguous): word embeddings plus, with learned positions,
        the rows 0 .. s-1 of the position table. Call the module, as any :class:`torch.nn.Module`, so hooks
        run."""
        word = self.word_embeddings(tokens)                                                  # [b, s, h]
        if self.position_embeddings is not None:   # through its __call__: hooks on it fire
            word = word + self.position_embeddings(torch.arange(tokens.shape[1], device=tokens.device))
        return word.transpose(0, 1).contiguous()


class GPTModel(SharesProcessGroup, nn.Module):
    """GPT: embeddings (word: vocab-parallel, position: replicated) -> ``num_layers`` TransformerLayers
    (numbered 0..L-1 in the dropout RNG) -> final norm -> logits with the tied word embedding (or an
    untied ``output_layer``). The config's architecture knobs make it a Llama: RMSNorm (also the final
    norm), SwiGLU, grouped-query attention, RoPE (no position table), no biases; with
    ``share_embeddings_and_output_weights=False`` for Llama's untied ``lm_head``.

    Args:
        config: :class:`seqpar.TransformerConfig` of every layer.
        num_layers: positive int.
        vocab_size: any positive int v; the table is padded to ``padded_vocab_size``, a multiple of
            ``t * 128`` rows (see the module docstring).
        max_seq_len: rows of learned positions (the longest sequence).
        tp_group: tensor-parallel process group (None: no tensor parallelism).
        device: where the parameters live.
        recompute: None, one policy, or one policy per layer (below).
        embedding_dropout: dropout probability after the embeddings, in [0, 1) with
            ``round(p * 256) < 256`` like the config's; None -> ``config.hidden_dropout``. (HF GPT-2's
            ``embd_pdrop`` may differ from its ``resid_pdrop``.)
        share_embeddings_and_output_weights: True: the logits use the word embedding (GPT-2); False: a
            separate ``output_layer`` [v, h], padded and sharded over the vocabulary like the embedding
            (Llama's ``lm_head``).
        padding_idx: None, or a token id whose embedding row starts at zero and gets no gradient from its
            lookups (``nn.Embedding``'s padding_idx; HF Llama's ``pad_token_id``, which ``from_llama`` passes).

    Every layer runs through its ``__call__`` (``hidden = layer(hidden)``), so hooks and wrappers on
    ``model.layers[i]`` apply: ``checkpoint_wrapper`` / ``apply_activation_checkpointing``, FSDP, or
    ``torch.utils.checkpoint`` around each layer (dropout seeds are drawn from torch's CPU generator,
    which those restore, so recomputed layers replay their masks). Building the model checks once, over
    ``tp_group``, that every rank passes the same arguments and RNG state (see TransformerLayer); every
    forward under tensor parallelism checks that the ranks' tokens and labels (shapes, and values by a
    checksum read with the id range check), mode, grad mode and dropout RNG state agree and that none
    rejected its inputs (one all-gather of a few int64), so a rank's mistake is a ValueError on every
    rank instead of an abort, a hang in a collective or a loss mixed from different batches. Set
    ``check_rank_inputs = False`` to skip that check where the inputs are known to agree: it reads a
    collective's result on the host, which under ``torch.compile`` breaks the graph twice (a compiled
    sequence-parallel model is then one graph instead of three). Each rank still checks its own inputs.
    ``load_full_state_dict`` likewise raises on every rank when one rank's dict fails its checks.
    Like TransformerLayer, the model computes in its parameters' dtype (``config.params_dtype``, or what
    ``.to(dtype)`` / ``.half()`` / ``.bfloat16()`` converted them to), and under an enabled
    ``torch.autocast`` runs as the model converted to the autocast dtype.

    ``forward(tokens, labels=None)``: tokens [b, s] int64 ids in [0, v) (ValueError naming a bad id).
    With labels [b, s] int64, already shifted by the caller (``labels[:, i]`` is the token that should
    follow position i): the per-token cross-entropy [s, b] in fp32; a label of -100 gives 0 and no
    gradient, like ``torch.nn.functional.cross_entropy(..., ignore_index=-100, reduction="none")``, and
    any other label outside [0, v) raises ValueError. Without labels: this rank's logits
    [s, b, vocab_end - vocab_start], column j being global token id ``vocab_start + j``. There is no
    attention mask: every sequence is causal from its first position, so pad a batch on the right and
    give the padded positions the label -100 (left padding would shift the positions and let the tokens
    attend to the pads).

    HF's ``GPT2LMHeadModel(input_ids, labels=input_ids).loss`` (which shifts inside and averages over
    the predicted tokens) is ``model(input_ids, labels).sum() / (labels != -100).sum()`` with
    ``labels = seqpar.integrations.hf.shift_labels(input_ids)``.

    ``recompute``: None (``config.recompute`` for every layer), one policy for every layer, or one of
    "none" | "selective" | "full" per layer, e.g. ``seqpar.memory.plan_recompute(...).policies``; layer
    i runs with ``dataclasses.replace(config, recompute=recompute[i])`` (``self.layers[i].config``), and
    with ``output_layer_init_std`` resolved (None: ``config.init_method_std / sqrt(2 * num_layers)``,
    Megatron's and GPT-2's scaled init of the attention projection and fc2).

    Unsharded state dict (:meth:`full_state_dict` / :meth:`load_full_state_dict`, PyTorch layouts):
    ``embedding.word_embeddings.weight`` [v, h], ``embedding.position_embeddings.weight``
    [max_seq_len, h] (learned positions only), ``layers.{i}.<TransformerLayer keys>``,
    ``final_layernorm.weight`` [h] and ``.bias`` [h] (LayerNorm only), ``output_layer.weight`` [v, h]
    (untied head only); and the parameters a subclass or a replaced part holds, under their
    ``named_parameters()`` keys (:meth:`full_shapes`).
    """

    # where the dtype and device the model computes in are read (seqpar.nn.layer.reference_parameter)
    _REFERENCE_PARTS = ("embedding", "layers", "final_layernorm")   # a norm may be kept in fp32

    def __init__(self, config: TransformerConfig, num_layers: int, vocab_size: int, max_seq_len: int,
                 tp_group: ProcessGroup = None, device=None,
                 recompute: Union[None, str, Sequence[str]] = None, embedding_dropout: Optional[float] = None,
                 share_embeddings_and_output_weights: bool = True, padding_idx: Optional[int] = None):
        super().__init__()
        num_layers, vocab_size, max_seq_len, padding_idx = map(sp_random.as_int, (num_layers, vocab_size, max_seq_len,
                                                                                 padding_idx))
        check_ranks_agree(tp_group, agreement_values(config, num_layers=num_layers, vocab_size=vocab_size,
                                                     max_seq_len=max_seq_len, recompute=recompute,
                                                     embedding_dropout=embedding_dropout,
                                                     share_embeddings_and_output_weights=share_embeddings_and_output_weights,
                                                     padding_idx=padding_idx, on_meta_device=builds_on_meta(device)),
                          what="GPTModel", hint=AGREEMENT_HINT, device=build_device(device))
        if not isinstance(share_embeddings_and_output_weights, bool):
            raise ValueError(f"share_embeddings_and_output_weights must be a bool, got "
                             f"{share_embeddings_and_output_weights!r}")
        for name, value in (("num_layers", num_layers), ("vocab_size", vocab_size), ("max_seq_len", max_seq_len)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if embedding_dropout is None:
            embedding_dropout = config.hidden_dropout
        sp_random.dropout_threshold(embedding_dropout, "embedding_dropout")  # [0, 1), round(p * 256) < 256
        self.config, self.tp_group, self.vocab_size, self.max_seq_len = config, tp_group, vocab_size, max_seq_len
        self.embedding_dropout = float(embedding_dropout)
        h, dtype = config.hidden_size, config.params_dtype
        self.embedding = GPTEmbedding(vocab_size, max_seq_len, h, tp_group=tp_group, device=device, dtype=dtype,
                                      learned_positions=config.position_embedding == "learned",
                                      padding_idx=padding_idx)
        policies = recompute_policies(config.recompute if recompute is None else recompute, num_layers)
        # Megatron's scaled init of the matrices writing into the residual stream, unless the config sets one
        output_std = config.output_layer_init_std
        if output_std is None:
            output_std = config.init_method_std / math.sqrt(2 * num_layers)
        with agreement_checked():  # the check above covers every layer's
            self.layers = nn.ModuleList(
                TransformerLayer(dataclasses.replace(config, recompute=policy, output_layer_init_std=output_std),
                                 tp_group, device, layer_number=i)
                for i, policy in enumerate(policies))
        self.check_rank_inputs = True
        for layer in self.layers:
            layer.check_rank_inputs = False  # the model builds their inputs (tokens checked in forward)
        self.final_layernorm = make_norm(config, tp_group, device)
        self.output_layer = (None if share_embeddings_and_output_weights else
                             VocabParallelOutputLayer(vocab_size, h, tp_group=tp_group, device=device, dtype=dtype,
                                                      sequence_parallel=config.sequence_parallel,
                                                      overlap_comm=config.overlap_comm))
        for part, table in enumerate((self.embedding.word_embeddings, self.embedding.position_embeddings,
                                      self.output_layer)):
            if table is not None:
                table.init_method = SeededNormal(-1, part, config.init_method_std)
        if self.final_layernorm.weight.device.type != "meta":  # on meta: to_empty, then reset_parameters()
            self._reset_embeddings()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Every weight to its deterministic init (what building the model on a real device draws): the
        layers' (:meth:`TransformerLayer.reset_parameters`), the embeddings', a unit final norm; a module you
        put in place of a part (a block of your own in ``layers``) by its own ``reset_parameters`` (or its
        children's). The deferred-init recipe: build with ``device="meta"``, ``to_empty(device=...)``, then
        this. On a model still all on meta it does nothing (as torch's own inits); a ValueError if only some
        parameters are on meta."""
        what = "GPTModel.reset_parameters"
        self._parts(what)
        if on_meta(self):
            return
        check_not_meta(self, what)   # partly materialised: filling its meta tensors would do nothing, silently
        prepare_parameters(self, what)
        reset_modules(self.children())

    @property
    def padded_vocab_size(self) -> int:
        """Rows of the padded word-embedding table over all ranks (a multiple of t * 128)."""
        return self.embedding.word_embeddings.padded_vocab_size

    @property
    def vocab_start(self) -> int:
        """First global token id of this rank's vocabulary shard (``rank * padded_vocab_size / t``)."""
        return self.embedding.word_embeddings.vocab_start

    @property
    def vocab_end(self) -> int:
        """One past the last real token id of this rank's shard (``vocab_start`` when it holds none)."""
        return self.embedding.word_embeddings.vocab_end

    def gather_logits(self, logits_local: torch.Tensor) -> torch.Tensor:
        """The full logits [s, b, vocab_size], the same on every rank, from this rank's
        ``logits_local`` [s, b, vocab_end - vocab_start] (``model(tokens)`` without labels), for a loss of
        your own (label smoothing, a z-loss, distillation). Compute that loss the same way on every rank and
        call backward on each: the gradient keeps this rank's columns. (``torch.distributed.nn``'s
        all_gather sums the ranks' gradients instead, which makes them t times too large here.) At t = 1
        the logits themselves. Gathering holds s * b * vocab_size logits on every rank; the labels path of
        :meth:`forward` never gathers them. ValueError unless ``logits_local`` is [..., vocab_end -
        vocab_start] floating point; with ``check_rank_inputs`` (t > 1), on every rank unless every rank
        passes the same leading shape and dtype (one small all-gather, outside torch.compile)."""
        v_local = self.vocab_end - self.vocab_start
        if not isinstance(logits_local, torch.Tensor) or logits_local.dim() < 1 \
                or logits_local.shape[-1] != v_local or not logits_local.is_floating_point():
            got = (f"{logits_local.dtype} {tuple(logits_local.shape)}" if isinstance(logits_local, torch.Tensor)
                   else type(logits_local).__name__)
            problem = (f"logits_local must be this rank's floating [..., {v_local}] logits "
                       f"(vocab_end - vocab_start), got {got}")
        else:
            problem = None
        t = group_size(self.tp_group)
        if t > 1 and self.check_rank_inputs:
            self._check_gather_ranks(logits_local, problem)   # raises this rank's problem too, on every rank
        elif problem is not None:
            raise ValueError(problem)
        if t == 1:
            return logits_local
        return _GatherVocabColumns.apply(logits_local, self.padded_vocab_size // t, self.vocab_size,
                                         self.vocab_start, self.tp_group)

    @outside_compile(RANK_CHECK_NOT_TRACEABLE)
    def _check_gather_ranks(self, logits_local, problem: Optional[str]) -> None:
        """Every rank gathers logits of the same leading shape and dtype and none rejected its own, else
        ValueError on every rank (a rank gathering only the last position aborted gloo's all-gather)."""
        check_ranks_agree(self.tp_group, {
            "logits_local.shape[:-1]": tuple(logits_local.shape[:-1]) if problem is None else None,
            "logits_local dtype": getattr(logits_local, "dtype", None)},
            what="GPTModel.gather_logits", error=problem, device=parameter_device(self),
            hint="Every rank gathers the same positions (its own vocabulary columns of them)")

    @torch.no_grad()
    def _reset_embeddings(self) -> None:
        """Deterministic init of the unsharded embeddings from the seqpar seed: each table's own
        ``reset_parameters`` with its :class:`~seqpar.nn.linear.SeededNormal` (N(0, init_method_std); the word table
        over its v real rows, the ``padding_idx`` row then zero), so any t starts from the same model and
        a table reset on its own (FSDP1's deferred init) gets the same values."""
        self.embedding.word_embeddings.reset_parameters()
        if self.embedding.position_embeddings is not None:
            self.embedding.position_embeddings.reset_parameters()
        if self.output_layer is not None:
            self.output_layer.reset_parameters()

    def _check_ids(self, tokens: Optional[torch.Tensor], labels: Optional[torch.Tensor],
                   with_checksum: bool) -> Optional[int]:
        """ValueError naming the first token or label id outside [0, vocab_size) (-100 allowed in labels),
        from one host read of those given (a device sync on CUDA). With ``with_checksum`` returns, from the
        same read, a checksum of the ids' values and positions for the ranks' check (None without it, on
        meta tensors, and while a graph is captured: no host read)."""
        checks = [(name, ids, allow_ignore) for name, ids, allow_ignore in
                  (("token", tokens, False), ("label", labels, True)) if ids is not None]
        first = checks[0][1]
        if first.is_meta:   # no values to check (a shape or memory estimate of a model built on meta)
            return None
        bad = []
        for _, ids, allow_ignore in checks:
            outside = (ids < 0) | (ids >= self.vocab_size)
            bad.append(outside & (ids != IGNORE_INDEX) if allow_ignore else outside)

        def allowed(allow_ignore: bool) -> str:
            return f"[0, {self.vocab_size})" + (f" or {IGNORE_INDEX} (ignored)" if allow_ignore else "")

        if capturing_graph() or (first.is_cuda and torch.cuda.is_current_stream_capturing()):
            # No host read while a graph is captured (torch.compile: a graph break, fullgraph=True fails;
            # a CUDA graph: not allowed): an assertion inside the graph, which raises without naming the id.
            for (name, _, allow_ignore), outside in zip(checks, bad):
                torch._assert_async(~outside.any(), f"{name} ids outside {allowed(allow_ignore)}")
            return None
        any_bad = functools.reduce(torch.logical_or, (outside.any() for outside in bad))
        checksum = None
        if with_checksum:   # only the ranks' check reads it (a dozen small ops: none at t = 1)
            # Each id times an odd weight of its position (int64, wrapping): ranks given different batches,
            # or the same ids in another order, differ. Read with any_bad: one host read for both.
            weights = torch.arange(1, 2 * first.numel(), 2, device=first.device).view(first.shape)
            checksum = functools.reduce(torch.add, ((ids * (weights + i)).sum() for i, (_, ids, _) in enumerate(checks)))
            any_bad, checksum = torch.stack([any_bad.long(), checksum]).tolist()
        else:
            any_bad = bool(any_bad)
        if not any_bad:
            return checksum
        for (name, ids, allow_ignore), outside in zip(checks, bad):
            if outside.any():
                i, j = (int(k) for k in outside.nonzero()[0])
                raise ValueError(f"{name} id {int(ids[i, j])} at [{i}, {j}] is outside the vocabulary: "
                                 f"expected {allowed(allow_ignore)}")

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.embedding(tokens)                                                      # [s, b, h]
        if self.config.sequence_parallel:
            hidden = scatter_to_sequence_region(hidden, self.tp_group)
        p = self.embedding_dropout if self.training else 0.0
        if p:
            first_row = shard_first_row(hidden, self.tp_group, self.config.sequence_parallel)
            _, stream = sp_random.draw_for_graph(sp_random.next_layer_streams, EMBEDDING_RNG_LAYER,
                                                 (sp_random.Site.EMBEDDING,))
            hidden = dropout(hidden, DropoutSpec(p, stream, first_row), backend=self.config.backend)
        return hidden

    def _layers(self, hidden: torch.Tensor) -> torch.Tensor:
        """Embedding output -> the last layer's output; each layer through its ``__call__``."""
        for layer in self.layers:
            hidden = call_self_casting(self, layer, hidden)
        return hidden

    def _check_inputs(self, tokens, labels, with_checksum: bool) -> Optional[int]:
        """ValueError naming the first problem of this rank's ``tokens`` / ``labels``; else their checksum
        when ``with_checksum`` (:meth:`_check_ids`)."""
        for name, ids in (("tokens", tokens), ("labels", labels)):
            if registry.is_dtensor(ids):
                raise ValueError(registry.dtensor_problem(name, ids))
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2 or tokens.dtype != torch.int64 \
                or not tokens.numel():
            raise ValueError(f"tokens must be a non-empty int64 [b, s] tensor, got "
                             f"{getattr(tokens, 'dtype', type(tokens).__name__)} {tuple(getattr(tokens, 'shape', ()))}")
        s, t = tokens.shape[1], group_size(self.tp_group)
        if s > self.max_seq_len:
            raise ValueError(f"sequence length {s} exceeds max_seq_len {self.max_seq_len}" + (
                " (with RoPE no table is sized by it: it is the declared context length; build the model with "
                "a larger max_seq_len, or for from_llama raise config.max_position_embeddings before converting, "
                "to run longer sequences)"
                if self.config.position_embedding == "rope" else ""))
        if self.config.sequence_parallel and s % t:
            raise ValueError(f"sequence length {s} is not divisible by the tensor-parallel size {t} (sequence "
                             "parallelism splits it): pad the tokens on the right to a multiple of t and read the "
                             "positions before the pads (causal: the pads change nothing before them)")
        if labels is not None and (not isinstance(labels, torch.Tensor) or labels.dtype != torch.int64
                                   or labels.shape != tokens.shape):
            raise ValueError(f"labels must be an int64 tensor of the tokens' shape {tuple(tokens.shape)}, got "
                             f"{getattr(labels, 'dtype', type(labels).__name__)} {tuple(getattr(labels, 'shape', ()))}")
        weight = reference_parameter(self, *self._REFERENCE_PARTS)
        device = weight.device
        for name, ids in (("tokens", tokens), ("labels", labels)):
            if ids is not None and ids.device != device:
                raise ValueError(f"{name} are on {ids.device} but the model's parameters are on {device}" + (
                    " (build on meta, then to_empty(device=...) and reset_parameters() or load_full_state_dict)"
                    if device.type == "meta" else ""))
        problem = run_problem(self.config, self.tp_group, weight)
        if problem is not None:
            raise ValueError(problem)
        return self._check_ids(tokens, labels, with_checksum)

    @outside_compile(RANK_CHECK_NOT_TRACEABLE)
    def _check_ranks(self, tokens, labels, checksum: Optional[int], problem: Optional[str]) -> None:
        """Every rank's tokens and labels (shapes, labels or not, the values' ``checksum``), mode, grad
        mode, which parameters require grad and dropout RNG state agree and no rank rejected its inputs, else ValueError on every rank.
        The layers skip their own per-forward check (the model builds their inputs), so this one is what
        keeps a rank's mistake from aborting or hanging the others in a collective, or from silently
        mixing dropout masks or batches (a data loader sharding over the whole world instead of the
        data-parallel ranks). Cost: one all-gather of 23 int64 per rank and forward, a walk over the
        parameters, and hashing torch's CPU generator state (5 KB) when dropout is on."""
        cfg = self.config
        dropout_on = self.training and bool(self.embedding_dropout or cfg.hidden_dropout or cfg.attention_dropout)
        shape = tuple(tokens.shape) if problem is None else (-1, -1)
        check_ranks_agree(self.tp_group, {
            "tokens.shape[0] (b)": shape[0], "tokens.shape[1] (s)": shape[1], "labels given": int(labels is not None),
            "token and label values (checksum)": checksum, "training": int(self.training),
            "grad mode": int(torch.is_grad_enabled()), **trainable_values(self),
            "compute dtype (under autocast its dtype)": reference_parameter(self, *self._REFERENCE_PARTS).dtype,
            **sp_random.generator_fingerprint(with_torch_state=dropout_on),   # what the dropout seeds come from
        }, what="GPTModel input", error=problem, device=parameter_device(self),
            hint="Every rank passes the same tokens (and labels, or none)" + SAME_MODE_HINT
                 + (SEED_HINT if dropout_on else ""))

    def forward(self, tokens: torch.Tensor, labels: Optional[torch.Tensor] = None) -> torch.Tensor:
        """tokens [b, s] int64 ids in [0, v) -> with ``labels`` [b, s] (already shifted; -100 ignored) the
        per-token cross-entropy [s, b] in fp32, without them this rank's logits [s, b, vocab_end -
        vocab_start] (the class docstring has the details)."""
        return self._in_compute_dtype(self._forward, tokens, labels)

    def _in_compute_dtype(self, body, *args):
        """``body(*args)`` in the parameters' dtype, or under an enabled autocast as if the model were
        converted to its dtype (the layers cast their own parameters: under FSDP2 they hold them only in
        their call)."""
        dtype = autocast_dtype(self)
        if dtype is None:
            return body(*args)
        layers = [module for module in self.modules() if isinstance(module, TransformerLayer)]
        return run_in_dtype(self, dtype, body, *args, self_casting=layers)

    def _forward(self, tokens: torch.Tensor, labels: Optional[torch.Tensor]) -> torch.Tensor:
        """:meth:`forward` in the parameters' dtype."""
        problem = checksum = None
        check_ranks = self.check_rank_inputs and group_size(self.tp_group) > 1
        try:
            checksum = self._check_inputs(tokens, labels, with_checksum=check_ranks)
        except ValueError as exc:
            problem = str(exc)
        if check_ranks:
            self._check_ranks(tokens, labels, checksum, problem)
        elif problem is not None:
            raise ValueError(problem)
        return self._head(self._layers(self._embed(tokens)), labels)

    # ------------------------------------------------------------------ pipeline stages
    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """A first pipeline stage's input side: tokens [b, s] int64 -> the first layer's input, [s, b, h]
        or under sequence parallelism this rank's shard [s/t, b, h], embedding dropout applied in
        training (what :meth:`forward` feeds ``layers[0]``). Checks this rank's tokens (ValueError naming
        a bad id), not that the ranks agree. ``model.embedding(tokens)`` alone is the unsharded sum of the
        tables, without the scatter or the dropout. Like :meth:`forward` (and :meth:`head`), under an
        enabled ``torch.autocast`` as if the model were converted to its dtype. :meth:`forward` checks its
        inputs once and does not call this method or :meth:`head`: a subclass that changes the model's input
        or output side overrides ``forward`` (``head(layers(embed(tokens)), labels)`` in the stage pieces)."""
        self._check_inputs(tokens, None, with_checksum=False)
        return self._in_compute_dtype(self._embed, tokens)

    def head(self, hidden: torch.Tensor, labels: Optional[torch.Tensor] = None) -> torch.Tensor:
        """A last pipeline stage's output side: ``hidden``, the last layer's output [s_local, b, h] (as
        ``layers[-1]`` returns it; s_local = s / t under sequence parallelism, else s) -> final norm -> with
        ``labels`` [b, s] the per-token vocab-parallel cross-entropy [s, b] (fp32; -100 ignored), else this rank's
        logits, as :meth:`forward` returns them. A stage in between runs its ``model.layers[i]`` in order. With the
        word embedding tied to the head, the first and the last stage each hold it: sum its gradient over the two
        (Megatron's embedding group) before stepping."""
        if labels is not None:
            shards = group_size(self.tp_group) if self.config.sequence_parallel else 1   # hidden: s / shards rows
            shape = tuple(getattr(hidden, "shape", ()))
            expected = (shape[1], shape[0] * shards) if len(shape) == 3 else None
            if not isinstance(labels, torch.Tensor) or labels.dtype != torch.int64 or tuple(labels.shape) != expected:
                raise ValueError(f"labels must be an int64 [b, s] = {expected} tensor for hidden "
                                 f"{shape}, got {getattr(labels, 'dtype', type(labels).__name__)} "
                                 f"{tuple(getattr(labels, 'shape', ()))}")
            self._check_ids(None, labels, with_checksum=False)
        return self._in_compute_dtype(self._head, hidden, labels)

    def _head(self, hidden: torch.Tensor, labels: Optional[torch.Tensor]) -> torch.Tensor:
        """The last layer's output -> final norm -> logits, or the loss given labels."""
        with saved_as("final norm input"):
            hidden = self.final_layernorm(hidden)
        # The real rows only: padded logits are never computed, so they can't enter the softmax.
        with saved_as("output layer input"):
            if self.output_layer is not None:   # through its __call__: hooks on it fire
                logits_local = self.output_layer(hidden)                                      # [s, b, v_local]
            else:
                logits_local = self.embedding.word_embeddings.logits(
                    hidden, sequence_parallel=self.config.sequence_parallel, overlap_comm=self.config.overlap_comm)
        if labels is None:
            return logits_local
        with saved_as("cross-entropy (fp32 softmax, label ids)"):
            # labels [s, b] contiguous: the loss takes its layout (a transposed view was a loss that
            # .view(-1) refuses)
            return _VocabParallelCrossEntropy.apply(logits_local, labels.t().contiguous(), self.vocab_start,
                                                    IGNORE_INDEX, self.tp_group)

    # ------------------------------------------------------------------ unsharded weights
    def full_shapes(self) -> Dict[str, tuple]:
        """Unsharded state-dict keys and shapes of every parameter (see the class docstring), those a
        subclass or a replaced module holds included (:meth:`TransformerLayer.full_shapes`)."""
        self._parts("GPTModel.full_shapes")
        return unsharded_shapes(unsharded_entries(self))

    def _parts(self, what: str) -> Dict[str, nn.Module]:
        """{key prefix: module} of the parts still the model's own, the layers' included
        (:func:`check_intact_parts`: ValueError for a wrapped or reparametrized one; a replaced or absent one
        (the position table with RoPE, the output layer when tied) left out)."""
        norm = LayerNorm if self.config.normalization == "layernorm" else RMSNorm
        classes = {"embedding.word_embeddings": VocabParallelEmbedding,
                   "embedding.position_embeddings": _PositionEmbedding,
                   "final_layernorm": norm, "output_layer": VocabParallelOutputLayer}
        for i, layer in enumerate(self.layers):
            part_classes = getattr(layer, "_part_classes", None)   # None: a block of the user's own
            if part_classes is not None:
                classes.update({f"layers.{i}.{prefix}": cls for prefix, cls in part_classes().items()})
        return check_intact_parts(self, classes, what)

    def _padded_table_hints(self, state_dict) -> Dict[str, str]:
        """For a vocabulary table whose rows are this vocabulary padded for some tensor-parallel size t'
        (all of them, or one rank's shard: a per-rank ``state_dict()`` passed as the full one), what they
        look like and what to pass instead."""
        if not isinstance(state_dict, Mapping):
            return {}
        v = self.vocab_size
        padded = {rows: t for t in range(64, 0, -1)   # rows -> the smallest t padding v to them
                  for rows in (padded_vocab_size(v, t), padded_vocab_size(v, t) // t)}
        padded.pop(v, None)
        hints = {}
        for key in ("embedding.word_embeddings.weight", "output_layer.weight"):
            value = state_dict.get(key)
            if isinstance(value, torch.Tensor) and value.dim() == 2 and value.shape[1] == self.config.hidden_size \
                    and value.shape[0] in padded:
                hints[key] = (f"{value.shape[0]} rows look like a state_dict() of this vocabulary padded for t = "
                              f"{padded[value.shape[0]]} (its padded table, or one rank's shard of it): pass "
                              f"full_state_dict(), or the first {v} rows of a t = 1 state_dict()")
        return hints

    @torch.no_grad()
    def load_full_state_dict(self, state_dict: Dict[str, torch.Tensor], strict: bool = True) -> IncompatibleKeys:
        """Load ``state_dict``, UNSHARDED weights keyed as :meth:`full_shapes` (the same dict on every rank, v real
        vocabulary rows); each rank keeps its shard. Every key, shape and value kind (floating point, not meta) is
        checked before anything is loaded (ValueError naming it); other floating dtypes are cast to the parameters'.
        ``strict=False`` loads the keys the dict holds and returns the missing and unexpected ones (shapes are still
        checked), as ``nn.Module.load_state_dict`` does."""
        what = "GPTModel.load_full_state_dict"
        self._parts(what)   # before any load
        prepared = prepare_parameters(self, what)
        entries = unsharded_entries(self)
        keys = check_loadable(state_dict, unsharded_shapes(entries), self.tp_group, what=what,
                              device=parameter_device(self), strict=strict,
                              data_parallel_groups=prepared.data_parallel_groups(),
                              shape_hints=self._padded_table_hints(state_dict))
        scatter_unsharded(entries, state_dict)
        return keys

    @torch.no_grad()
    def full_state_dict(self) -> Dict[str, torch.Tensor]:
        """The unsharded weights, the same on every rank (a collective under TP: call it on every rank;
        ValueError on every rank if a replicated parameter differs between them: :func:`gather_unsharded`)."""
        what = "GPTModel.full_state_dict"
        self._parts(what)
        prepare_parameters(self, what)
        return gather_unsharded(unsharded_entries(self), self.tp_group, what)
