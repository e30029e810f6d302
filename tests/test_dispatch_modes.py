"""seqpar under PyTorch's Python dispatch modes in one process: a mode that runs real tensors
(FlopCounterMode) takes none of the graph-capture paths (which are for torch.compile / export / fake
tensors), and a memory estimate builds and steps models under a plain FakeTensorMode. (Two ranks:
tests/distributed/test_dispatch_modes_ranks.py.)"""
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import seqpar
from seqpar.ops import DropoutSpec, dropout, rotary_embedding


def test_a_float64_dropout_is_bitwise_the_same_under_a_real_tensor_mode():
    """DropoutSpec.scale returned torch.compile's unrounded double 256 / (256 - P) under any dispatch
    mode: fp64 outputs and gradients changed (by 5e-8) when a FLOP counter was on."""
    x = torch.randn(6, 8, dtype=torch.float64, requires_grad=True)
    spec = DropoutSpec(0.1, 5, 0)
    y = dropout(x, spec, backend="torch")
    (grad,) = torch.autograd.grad(y.sum(), x)
    with FlopCounterMode(display=False):
        y_mode = dropout(x, spec, backend="torch")
        (grad_mode,) = torch.autograd.grad(y_mode.sum(), x)
    assert torch.equal(y, y_mode) and torch.equal(grad, grad_mode)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_in_place_rope_refuses_overlapping_q_and_k_under_a_real_tensor_mode(backend):
    """The overlap checks were skipped under any dispatch mode (as if the tensors were fake): q and k
    sharing a head of one buffer were rotated twice, silently (errors up to 2.8)."""
    buffer = torch.randn(4, 1, 2, 8)
    q, k = buffer, buffer[:, :, 1:]
    with FlopCounterMode(display=False), pytest.raises(ValueError, match="q and k not to share elements"):
        rotary_embedding(q, k, inplace=True, backend=backend)


def test_a_bad_token_id_is_named_under_a_real_tensor_mode():
    """GPTModel's id check became an in-graph assertion under any dispatch mode: a bare RuntimeError
    (on CUDA a device-side assert) instead of the ValueError naming the id and where it is."""
    cfg = seqpar.TransformerConfig(hidden_size=16, num_attention_heads=2, backend="torch")
    model = seqpar.GPTModel(cfg, 1, 50, 8)
    tokens = torch.zeros(2, 8, dtype=torch.long)
    tokens[0, 3] = 50
    with FlopCounterMode(display=False), pytest.raises(ValueError, match=r"token id 50 at \[0, 3\]"):
        model(tokens)


@pytest.mark.parametrize("what", ["layer", "gpt"])
def test_build_and_step_with_dropout_under_a_plain_fake_tensor_mode(what):
    """The memory-estimation recipe (build and run a step under FakeTensorMode): with dropout on, the
    build's rank-agreement values read torch's generator state as bytes, which a plain FakeTensorMode
    refused ("Please convert all Tensors to FakeTensors"); under allow_non_fake_inputs it read a fake
    tensor's data pointer instead of the state."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    cfg = seqpar.TransformerConfig(hidden_size=16, num_attention_heads=2, hidden_dropout=0.1, attention_dropout=0.1,
                                   backend="torch")
    state = torch.get_rng_state()
    with FakeTensorMode():
        if what == "layer":
            module, x = seqpar.TransformerLayer(cfg), torch.randn(8, 2, 16)
        else:
            module, x = seqpar.GPTModel(cfg, 2, 50, 8), torch.randint(0, 50, (2, 8))
        y = module(x)
        y.float().sum().backward()
    assert y.shape == ((8, 2, 16) if what == "layer" else (8, 2, 50))
    assert all(p.grad is not None for p in module.parameters())
    assert torch.equal(torch.get_rng_state(), state)
