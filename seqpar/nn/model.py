"""A small GPT on top of TransformerLayer: vocab-parallel embedding, N layers, final LayerNorm, tied
output head and a vocab-parallel cross-entropy (the logits are never gathered: each rank holds v/t).

Shapes: ``tokens`` [b, s] (int64, the full sequence on every rank) -> loss per token [s, b] (fp32),
or logits [s, b, v/t] when no labels are given. Under sequence parallelism the embedding output is
scattered to [s/t, b, h] shards before the layers and gathered (g) before the output head.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from .. import random as sp_random
from ..config import TransformerConfig
from ..ops.dropout import DropoutSpec, dropout
from ..parallel.mappings import (copy_to_tensor_region, gather_from_sequence_region, reduce_from_tensor_region,
                                 scatter_to_sequence_region)
from ..parallel.state import ProcessGroup, agreement_checked, check_ranks_agree, group_rank, group_size
from .layer import AGREEMENT_HINT, TransformerLayer, agreement_values
from .layernorm import LayerNorm

EMBEDDING_RNG_LAYER = 2**31 - 1  # the embedding dropout's "layer number" in the RNG


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy over logits split along the vocabulary: [s, b, v/t] + labels [s, b] -> loss [s, b]."""

    @staticmethod
    def forward(ctx, logits_local, labels, vocab_start, group):
        logits = logits_local.float()
        logits_max = logits.max(dim=-1).values
        if group_size(group) > 1:
            dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - logits_max.unsqueeze(-1)
        v_local = logits.shape[-1]
        local_labels = labels - vocab_start
        in_shard = (local_labels >= 0) & (local_labels < v_local)
        safe = local_labels.clamp(0, v_local - 1)
        target = torch.gather(shifted, -1, safe.unsqueeze(-1)).squeeze(-1) * in_shard
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        if group_size(group) > 1:
            dist.all_reduce(target, group=group)
            dist.all_reduce(sum_exp, group=group)
        softmax = exp / sum_exp.unsqueeze(-1)
        ctx.save_for_backward(softmax, safe, in_shard)
        ctx.dtype = logits_local.dtype
        return sum_exp.log() - target

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss):
        softmax, safe, in_shard = ctx.saved_tensors
        grad = softmax.clone()
        grad.scatter_add_(-1, safe.unsqueeze(-1), -in_shard.unsqueeze(-1).to(grad.dtype))
        return (grad * grad_loss.unsqueeze(-1)).to(ctx.dtype), None, None, None


class GPTModel(nn.Module):
    """GPT: embeddings (word: vocab-parallel, position: replicated) -> ``num_layers`` TransformerLayers
    (numbered 0..L-1 in the dropout RNG) -> final LayerNorm -> logits with the tied word embedding.

    Every layer runs through its ``__call__`` (``hidden = layer(hidden)``), so hooks and wrappers on
    ``model.layers[i]`` apply: ``checkpoint_wrapper`` / ``apply_activation_checkpointing``, FSDP, or
    ``torch.utils.checkpoint`` around each layer (dropout seeds are drawn from torch's CPU generator,
    which those restore, so recomputed layers replay their masks). Building the model checks once, over
    ``tp_group``, that every rank passes the same arguments and RNG state (see TransformerLayer).

    ``forward(tokens, labels=None)``: tokens [b, s] -> per-token loss [s, b] with labels, else the
    local logits [s, b, v/t].
    """

    def __init__(self, config: TransformerConfig, num_layers: int, vocab_size: int, max_seq_len: int,
                 tp_group: ProcessGroup = None, device=None):
        super().__init__()
        check_ranks_agree(tp_group, agreement_values(config, num_layers=num_layers, vocab_size=vocab_size,
                                                     max_seq_len=max_seq_len), what="GPTModel", hint=AGREEMENT_HINT)
        t = group_size(tp_group)
        for name, value in (("num_layers", num_layers), ("vocab_size", vocab_size), ("max_seq_len", max_seq_len)):
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if vocab_size % t:
            raise ValueError(f"vocab_size {vocab_size} is not divisible by the tensor-parallel size {t}")
        self.config, self.tp_group, self.vocab_size, self.max_seq_len = config, tp_group, vocab_size, max_seq_len
        h, dtype = config.hidden_size, config.params_dtype
        self.vocab_start = group_rank(tp_group) * (vocab_size // t)
        gen = torch.Generator().manual_seed(sp_random.stream_seed(sp_random.initial_seed(), -1, 1000) & (2**63 - 1))
        word = torch.randn(vocab_size, h, generator=gen) * 0.02
        self.word_embeddings = nn.Parameter(
            word[self.vocab_start:self.vocab_start + vocab_size // t].to(device=device, dtype=dtype).clone())
        self.position_embeddings = nn.Parameter(
            (torch.randn(max_seq_len, h, generator=gen) * 0.02).to(device=device, dtype=dtype))
        with agreement_checked():  # the check above covers every layer's
            self.layers = nn.ModuleList(TransformerLayer(config, tp_group, device, layer_number=i)
                                        for i in range(num_layers))
        for layer in self.layers:
            layer.check_rank_inputs = False  # the model builds their inputs (tokens checked in forward)
        self.final_layernorm = LayerNorm(h, config.layernorm_epsilon, tp_group=tp_group,
                                         sequence_parallel=config.sequence_parallel, backend=config.backend,
                                         device=device, dtype=dtype)

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        b, s = tokens.shape
        local_ids = tokens - self.vocab_start
        in_shard = (local_ids >= 0) & (local_ids < self.word_embeddings.shape[0])
        word = nn.functional.embedding(local_ids.clamp(0, self.word_embeddings.shape[0] - 1), self.word_embeddings)
        word = reduce_from_tensor_region(word * in_shard.unsqueeze(-1), self.tp_group)        # [b, s, h]
        hidden = (word + self.position_embeddings[:s]).transpose(0, 1).contiguous()          # [s, b, h]
        if self.config.sequence_parallel:
            hidden = scatter_to_sequence_region(hidden, self.tp_group)
        p = self.config.hidden_dropout if self.training else 0.0
        if p:
            first_row = group_rank(self.tp_group) * hidden.shape[0] * b if self.config.sequence_parallel else 0
            seed = sp_random.next_layer_seed(EMBEDDING_RNG_LAYER)
            hidden = dropout(hidden, DropoutSpec(p, seed, first_row))
        return hidden

    def _layers(self, hidden: torch.Tensor) -> torch.Tensor:
        """Embedding output -> final LayerNorm output; each layer through its ``__call__``."""
        for layer in self.layers:
            hidden = layer(hidden)
        return self.final_layernorm(hidden)

    def forward(self, tokens: torch.Tensor, labels: Optional[torch.Tensor] = None) -> torch.Tensor:
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2 or tokens.dtype != torch.int64:
            raise ValueError(f"tokens must be an int64 [b, s] tensor, got "
                             f"{getattr(tokens, 'dtype', type(tokens).__name__)} {tuple(getattr(tokens, 'shape', ()))}")
        s, t = tokens.shape[1], group_size(self.tp_group)
        if s > self.max_seq_len:
            raise ValueError(f"sequence length {s} exceeds max_seq_len {self.max_seq_len}")
        if self.config.sequence_parallel and s % t:
            raise ValueError(f"sequence length {s} is not divisible by the tensor-parallel size {t}")
        if labels is not None and labels.shape != tokens.shape:
            raise ValueError(f"labels shape {tuple(labels.shape)} != tokens shape {tuple(tokens.shape)}")
        hidden = self._layers(self._embed(tokens))
        if self.config.sequence_parallel:
            hidden = gather_from_sequence_region(hidden, self.tp_group)
        else:
            hidden = copy_to_tensor_region(hidden, self.tp_group)
        logits_local = torch.matmul(hidden, self.word_embeddings.t())                        # [s, b, v/t]
        if labels is None:
            return logits_local
        return _VocabParallelCrossEntropy.apply(logits_local, labels.t(), self.vocab_start, self.tp_group)
