"""``copy.deepcopy`` of tensor-parallel modules (an EMA or reference model): the copy shares the process
group (a ProcessGroup can't be copied: deepcopy raised a pickling TypeError at t > 1), owns its parameters
and computes what the original does."""
import copy

import pytest
import torch
import torch.distributed as dist

import seqpar
from launcher import run_ranks


def _deepcopy_worker(rank, world_size):
    cfg = seqpar.TransformerConfig(hidden_size=32, num_attention_heads=4, sequence_parallel=True,
                                   backend="torch")
    seqpar.manual_seed(0)
    model = seqpar.GPTModel(cfg, 2, 50, 16, tp_group=dist.group.WORLD, share_embeddings_and_output_weights=False)
    twin = copy.deepcopy(model)
    tokens = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(1))
    same_output = torch.equal(twin(tokens), model(tokens))
    with torch.no_grad():
        next(twin.parameters()).add_(1.0)
    return {"same output": same_output,
            "group shared": twin.tp_group is model.tp_group and twin.layers[1].mlp.dense_4h_to_h.tp_group
            is model.tp_group,
            "own parameters": not torch.equal(next(twin.parameters()), next(model.parameters()))}


@pytest.mark.timeout(120)
def test_deepcopy_under_tp_shares_the_group():
    for rank, result in enumerate(run_ranks(_deepcopy_worker, 2, timeout_s=90)):
        assert all(result.values()), (rank, result)
