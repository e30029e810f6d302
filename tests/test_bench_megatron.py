"""bench/bench_megatron_layer.py builds Megatron-Core's layer in one precision, and that layer runs a forward
and backward at a tiny shape on CPU (skipped where megatron-core is not installed).

The first GPU run died in the first forward: "expected scalar type BFloat16 but found Float" from the
local spec's LayerNorm, which ignores ``params_dtype`` and stays fp32 beside bf16 linear layers. CPU's
layer_norm accepts that mix, so running the layer here cannot show the bug: the parameters' dtypes are
checked instead, for every experiment.

Megatron's layer is written for CUDA in three places a CPU run reaches: its attention's score buffer
(``GlobalMemoryBuffer.get_tensor`` allocates on ``torch.cuda.current_device()``), its default causal mask
(``device="cuda"``) and its RNG states (``tensor_parallel.random``: dropout under
``get_cuda_rng_tracker().fork()``, and every recompute checkpoint saves and restores the CUDA generator).
The ``megatron_on_cpu`` fixture points those three at the CPU for the test's duration; the layer's own
code is unchanged."""
import argparse
import socket

import pytest
import torch

pytest.importorskip("megatron.core")

from bench import bench_megatron_layer as bench  # noqa: E402
from seqpar.bench.layer_bench import EXPERIMENTS  # noqa: E402

S, B, H, HEADS = 16, 2, 64, 4


def _args(dtype="bf16", dropout=0.1):
    return argparse.Namespace(seq_len=S, batch=B, hidden=H, heads=HEADS, dtype=dtype, dropout=dropout,
                              dry_run=True)


@pytest.fixture(scope="module")
def megatron_world():
    """World size 1 over gloo, TP = PP = 1, as the script sets it up on CPU; torn down afterwards."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    started_here = not dist.is_initialized()
    with socket.socket() as sock:  # a free port: xdist workers run side by side
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MASTER_ADDR", "127.0.0.1")
        mp.setenv("MASTER_PORT", str(port))
        bench.init_megatron("cpu")
        yield
    parallel_state.destroy_model_parallel()
    if started_here:
        dist.destroy_process_group()


@pytest.fixture
def megatron_on_cpu(megatron_world, monkeypatch):
    from megatron.core.fusions import fused_softmax
    from megatron.core.tensor_parallel import random as mrandom

    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    monkeypatch.setattr(fused_softmax, "get_default_causal_mask",
                        lambda sq: torch.ones(sq, sq, dtype=torch.bool).triu(1))
    monkeypatch.setattr(mrandom, "_get_cuda_rng_state", lambda *a, **k: torch.get_rng_state())
    monkeypatch.setattr(mrandom, "_set_cuda_rng_state", lambda state, *a, **k: torch.set_rng_state(state))
    tracker = mrandom.get_cuda_rng_tracker()
    tracker.reset()
    tracker.states_[mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME] = torch.Generator().manual_seed(1234).get_state()
    yield
    tracker.reset()


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_every_experiment_builds_in_one_dtype(megatron_world, dtype):
    for experiment, sp, recompute in EXPERIMENTS:
        if sp:   # Megatron-Core refuses SP at t = 1: the script records these as not applicable
            with pytest.raises(ValueError, match="sequence parallelism without tensor parallelism"):
                bench.megatron_config(_args(dtype), sp, recompute)
            continue
        block = bench.build_block(bench.megatron_config(_args(dtype), sp, recompute))
        assert bench.parameter_dtypes(block) == {bench.DTYPES[dtype]}, experiment
        norms = [m for m in block.modules() if isinstance(m, torch.nn.LayerNorm)]
        assert len(norms) == 2 and all(m.weight.dtype == bench.DTYPES[dtype] for m in norms), experiment


def test_forward_backward_runs_in_bf16_for_every_recompute_variant(megatron_on_cpu):
    x = torch.randn(S, B, H, dtype=torch.bfloat16, requires_grad=True)
    grad_y = torch.randn_like(x)
    for experiment, sp, recompute in EXPERIMENTS:
        if sp:
            continue
        block = bench.build_block(bench.megatron_config(_args(), sp, recompute))
        block.train()
        y = bench.block_forward(block, x)
        assert (y.shape, y.dtype) == (x.shape, torch.bfloat16), experiment
        x.grad = None
        y.backward(grad_y)
        assert x.grad.dtype == torch.bfloat16 and torch.isfinite(x.grad).all(), experiment
        for name, p in block.named_parameters():
            assert p.grad is not None and p.grad.dtype == torch.bfloat16, (experiment, name)


def test_recompute_variants_compute_the_same_layer(megatron_on_cpu):
    """Without dropout, full and selective recompute give no recompute's output and gradients (same
    weights): the three configurations differ only in what they keep for the backward."""
    x = torch.randn(S, B, H, requires_grad=True)
    grad_y = torch.randn_like(x)
    results, state = {}, None
    for experiment, sp, recompute in EXPERIMENTS:
        if sp:
            continue
        block = bench.build_block(bench.megatron_config(_args("fp32", dropout=0.0), sp, recompute))
        if state is None:
            state = block.state_dict()
        block.load_state_dict(state)
        x.grad = None
        y = bench.block_forward(block, x)
        y.backward(grad_y)
        results[experiment] = (y.detach(), x.grad.clone())
    reference = results.pop("no recompute")
    for experiment, (y, grad_x) in results.items():
        torch.testing.assert_close(y, reference[0], msg=experiment)
        torch.testing.assert_close(grad_x, reference[1], msg=experiment)


def test_measure_runs_each_experiment_and_recompute_keeps_less(megatron_on_cpu):
    """The script's per-experiment measurement (all but the CUDA peak-memory counters) on CPU: every
    metric is positive, and what the layer keeps for the backward shrinks from no recompute to selective
    (the core attention is recomputed) to full (only the block's input is kept)."""
    timing = argparse.Namespace(warmup=1, iters=2)
    kept = {}
    for experiment, sp, recompute in EXPERIMENTS:
        if sp:
            continue
        block = bench.build_block(bench.megatron_config(_args(), sp, recompute))
        block.train()
        x = torch.randn(S, B, H, dtype=torch.bfloat16, requires_grad=True)
        metrics = bench.measure(block, x, torch.randn_like(x), timing)
        assert set(metrics) == {"forward_ms", "backward_ms", "combined_ms", "activation_bytes"}, experiment
        assert metrics["forward_ms"] > 0 and metrics["combined_ms"] > metrics["forward_ms"], experiment
        kept[experiment] = metrics["activation_bytes"]
    assert kept["full recompute"] < kept["selective recompute"] < kept["no recompute"], kept
    assert kept["full recompute"] >= S * B * H * 2        # at least the block's bf16 input
