"""Data parallelism and tensor parallelism together, the loop a user writes: 4 gloo ranks, TP groups
[0, 1] and [2, 3], DDP or FSDP2 over the data-parallel groups [0, 2] and [1, 3], each replica its own
micro-batch, seqpar.nn.clip_grad_norm_ before each SGD step. Against one process (t = 1, no DDP) on the
concatenated batch: the clipped norm of every step and the weights after the steps.

Under FSDP2 each rank holds half the rows of its tensor-parallel shards (9 position rows: 5 and 4; the
vocabulary's 50 real rows all in rank 0's half, ranks 1-3 hold padding only), so the norm needs both
groups' sums and the unsharded weights both gathers."""
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
    return seqpar.GPTModel(cfg, 2, VOCAB, S + 1, tp_group=group)


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


def _worker(rank, world_size, data_parallel):
    replica = rank // TP
    if data_parallel == "ddp":
        tp_groups = [dist.new_group(list(range(first, first + TP))) for first in range(0, world_size, TP)]
        dp_groups = [dist.new_group(list(range(r, world_size, TP))) for r in range(TP)]
        tp_group = tp_groups[replica]
        model = _model(tp_group)
        wrapped = torch.nn.parallel.DistributedDataParallel(model, process_group=dp_groups[rank % TP])
    else:   # the README's recipe: a 2-D mesh, TP over its "tp" dim, FSDP2 over "dp" (the same groups)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (world_size // TP, TP), mesh_dim_names=("dp", "tp"))
        tp_group = mesh["tp"].get_group()
        model = _model(tp_group)
        for layer in model.layers:
            fully_shard(layer, mesh=mesh["dp"])
        wrapped = fully_shard(model, mesh=mesh["dp"])
    norms = _train(model, wrapped, lambda batch: batch[replica * B:(replica + 1) * B], STEPS)
    max_grad = float(clip_grad_norm_(model, 1e9, "inf"))      # the last step's gradients, clipped by then
    reference = _model(None)
    expected = _train(reference, reference, lambda batch: batch, STEPS)
    expected_max = float(clip_grad_norm_(reference, 1e9, "inf"))
    ours, theirs = model.full_state_dict(), reference.full_state_dict()
    worst = max(float((ours[k] - theirs[k]).abs().max()) for k in theirs)
    return norms, expected, max_grad, expected_max, worst, (
        _overflow_skipped(model, wrapped, rank, tp_group) if data_parallel == "fsdp2" else None)


def _overflow_skipped(model, wrapped, rank, tp_group):
    """An inf in the gradient chunk that FSDP2's reduce-scatter left on rank 3 alone (injected after the
    reduction; under DDP the all-reduce spreads an overflow to every replica): (scale after the step,
    whether the weights stayed). Every rank must skip: DTensor's own inf check reduces over the FSDP2
    group, TensorParallelGradScaler over TP."""
    from seqpar.nn import TensorParallelGradScaler
    scaler = TensorParallelGradScaler("cpu", tp_group=tp_group, init_scale=256.0)
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.5)
    tokens = _batch(STEPS, 2)[rank // TP * B:(rank // TP + 1) * B]
    optimizer.zero_grad()
    scaler.scale(wrapped(tokens[:, :-1], tokens[:, 1:]).mean()).backward()
    if rank == 3:
        model.layers[0].mlp.dense_h_to_4h.weight.grad.to_local()[0, 0] = float("inf")
    before = model.full_state_dict()
    scaler.step(optimizer)
    scaler.update()
    return float(scaler.get_scale()), all(torch.equal(v, before[k]) for k, v in model.full_state_dict().items())


@pytest.mark.timeout(180)
@pytest.mark.parametrize("data_parallel", ["ddp", "fsdp2"])
def test_data_parallel_over_tensor_parallel_replicas_matches_one_process_on_the_whole_batch(data_parallel):
    for rank, (norms, expected, max_grad, expected_max, worst, skipped) in enumerate(
            run_ranks(_worker, 4, data_parallel, timeout_s=150)):
        assert all(abs(a - b) <= 1e-5 * b for a, b in zip(norms, expected)) and min(norms) > 0.05, (rank, norms)
        assert abs(max_grad - expected_max) <= 1e-6 * expected_max, (rank, max_grad, expected_max)
        assert worst < 1e-6, (rank, worst)
        assert data_parallel == "ddp" or skipped == (128.0, True), (rank, skipped)


def _deferred_init_worker(rank, world_size):
    """TP 2 x FSDP2 2, sharded on the meta device, to_empty, every parameter NaN: reset_parameters()
    gives the weights of the model built on the CPU directly, load_full_state_dict gives the weights it
    loads, and the loaded model's loss is the plain model's."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    tp_group = [dist.new_group(list(range(first, first + TP))) for first in range(0, world_size, TP)][rank // TP]
    mesh = DeviceMesh.from_group([dist.new_group(list(range(r, world_size, TP))) for r in range(TP)][rank % TP], "cpu")
    plain = _model(tp_group)
    expected = plain.full_state_dict()
    tokens = _batch(0, 2)[rank // TP * B:(rank // TP + 1) * B]
    results = []
    for load in (lambda model: model.reset_parameters(), lambda model: model.load_full_state_dict(expected)):
        with torch.device("meta"):
            model = _model(tp_group)
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.to_empty(device="cpu")
        with torch.no_grad():
            for param in model.parameters():
                param.fill_(float("nan"))
        load(model)
        got = model.full_state_dict()
        results.append(all(torch.equal(got[k], v) for k, v in expected.items()))
    loss, plain_loss = (m.eval()(tokens[:, :-1], tokens[:, 1:]).mean().item() for m in (model, plain))   # no dropout
    return results, loss, plain_loss


@pytest.mark.timeout(120)
def test_fsdp2_model_built_on_meta_is_initialised_and_loaded_in_place():
    for rank, (results, loss, plain_loss) in enumerate(run_ranks(_deferred_init_worker, 4, timeout_s=90)):
        assert results == [True, True] and abs(loss - plain_loss) <= 1e-6 * abs(plain_loss), (rank, results, loss)
