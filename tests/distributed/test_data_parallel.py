"""Data parallelism and tensor parallelism together, the loop a user writes: 4 gloo ranks, TP groups
[0, 1] and [2, 3], DDP over the data-parallel groups [0, 2] and [1, 3], each replica its own
micro-batch, seqpar.nn.clip_grad_norm_ before each SGD step. Against one process (t = 1, no DDP) on the
concatenated batch: the clipped norm of every step and the weights after the steps."""
import pytest
import torch
import torch.distributed as dist

import seqpar
from seqpar.nn import clip_grad_norm_

from launcher import run_ranks

VOCAB, S, B, TP, STEPS = 50, 8, 2, 2, 2


def _model(group):
    seqpar.manual_seed(0)
    cfg = seqpar.TransformerConfig(hidden_size=32, num_attention_heads=4, sequence_parallel=group is not None,
                                   recompute="selective", backend="torch")
    return seqpar.GPTModel(cfg, 2, VOCAB, S, tp_group=group)


def _batch(step, replicas):
    """[replicas * B, S + 1] tokens; replica r takes rows r * B .. (r + 1) * B - 1."""
    return torch.randint(0, VOCAB, (replicas * B, S + 1), generator=torch.Generator().manual_seed(step))


def _train(model, wrapped, rows, steps):
    """SGD steps (lr 0.5) on ``rows(step)`` of each step's batch, clipped at 0.05; the norms."""
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.5)
    norms = []
    for step in range(steps):
        tokens = rows(_batch(step, 2))
        optimizer.zero_grad()
        wrapped(tokens[:, :-1], tokens[:, 1:]).mean().backward()
        norms.append(float(clip_grad_norm_(model, 0.05)))
        optimizer.step()
    return norms


def _worker(rank, world_size):
    tp_groups = [dist.new_group(list(range(first, first + TP))) for first in range(0, world_size, TP)]
    dp_groups = [dist.new_group(list(range(r, world_size, TP))) for r in range(TP)]
    replica = rank // TP
    model = _model(tp_groups[replica])
    ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=dp_groups[rank % TP])
    norms = _train(model, ddp, lambda batch: batch[replica * B:(replica + 1) * B], STEPS)
    reference = _model(None)
    expected = _train(reference, reference, lambda batch: batch, STEPS)
    ours, theirs = model.full_state_dict(), reference.full_state_dict()
    return norms, expected, max(float((ours[k] - theirs[k]).abs().max()) for k in theirs)


@pytest.mark.timeout(180)
def test_ddp_over_tensor_parallel_replicas_matches_one_process_on_the_whole_batch():
    for rank, (norms, expected, worst) in enumerate(run_ranks(_worker, 4, timeout_s=150)):
        assert all(abs(a - b) <= 1e-5 * b for a, b in zip(norms, expected)) and min(norms) > 0.05, (rank, norms)
        assert worst < 1e-6, (rank, worst)
