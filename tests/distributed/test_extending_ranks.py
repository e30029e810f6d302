"""Extended layers at t = 2: a subclass's own parallel linear is gathered by its layout, and a replicated
parameter that drifted apart between the ranks is refused by the unsharded state dict, not returned as
one rank's copy."""
import pytest
import torch
import torch.distributed as dist
from torch import nn

import seqpar
from launcher import run_ranks
from seqpar.nn import ColumnParallelLinear, TransformerLayer
from seqpar.parallel.mappings import copy_to_tensor_region

H = 16


class ProjectedLayer(TransformerLayer):
    """A layer with a column-parallel side projection (split over the ranks) and a replicated gate."""

    def __init__(self, config, tp_group=None):
        super().__init__(config, tp_group)
        self.side = ColumnParallelLinear(H, 2 * H, tp_group=tp_group, sequence_parallel=True)
        self.gate = nn.Parameter(torch.full((H,), 0.5))
        self.synced = True

    def forward(self, x):
        gate = copy_to_tensor_region(self.gate, self.tp_group) if self.synced else self.gate
        return x + gate * (super().forward(x) - x)


def _worker(rank, world_size):
    seqpar.manual_seed(0)
    cfg = seqpar.TransformerConfig(hidden_size=H, num_attention_heads=2, sequence_parallel=True)
    layer = ProjectedLayer(cfg, dist.group.WORLD)
    with torch.no_grad():
        layer.side.weight.copy_(torch.arange(2 * H * H, dtype=torch.float32).view(2 * H, H)[rank * H:(rank + 1) * H])
    side = layer.full_state_dict()["side.weight"]
    steps = {}
    for synced in (True, False):
        layer.synced = synced
        x = torch.randn(4, 2, H, generator=torch.Generator().manual_seed(rank))   # each rank its shard
        layer(x).square().sum().backward()
        with torch.no_grad():
            layer.gate -= layer.gate.grad
        layer.zero_grad()
        try:
            steps[synced] = layer.full_state_dict()["gate"]
        except ValueError as exc:
            steps[synced] = str(exc)
    return side, steps


@pytest.mark.timeout(120)
def test_a_subclass_s_parallel_linear_is_gathered_and_a_drifted_gate_refused():
    for side, steps in run_ranks(_worker, 2, timeout_s=100):
        torch.testing.assert_close(side, torch.arange(2 * H * H, dtype=torch.float32).view(2 * H, H), rtol=0, atol=0)
        assert isinstance(steps[True], torch.Tensor) and not torch.equal(steps[True], torch.full((H,), 0.5))
        assert "full_state_dict: the replicated parameters" in steps[False] and "gate" in steps[False], steps[False]
        assert "copy_to_tensor_region" in steps[False]
