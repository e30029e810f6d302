"""Regenerated-mask dropout: torch reference semantics and the CUDA kernel of csrc/dropout.cu."""
import pytest
import torch

from seqpar.ops.dropout import DropoutSpec, apply_keep_mask, bias_dropout_add, dropout, make_dropout_spec
from seqpar.random import philox_uniform


def test_mask_matches_definition_and_backward_regenerates():
    spec = DropoutSpec(0.25, 1234, 40)
    x = torch.randn(5, 7, 33, requires_grad=True)
    y = dropout(x, spec)
    u = philox_uniform(torch.arange(35).view(35, 1) + 40 + 1234, torch.arange(33).view(1, 33)).view(5, 7, 33)
    keep = u >= 0.25
    torch.testing.assert_close(y, x * keep * (1 / 0.75), rtol=0, atol=0)
    g = torch.randn_like(y)
    y.backward(g)
    torch.testing.assert_close(x.grad, g * keep * (1 / 0.75), rtol=0, atol=0)


def test_row_offset_shards_compose():
    spec = DropoutSpec(0.5, 9, 0)
    x = torch.randn(12, 16)
    full = apply_keep_mask(x, spec)
    top = apply_keep_mask(x[:5], spec)
    bottom = apply_keep_mask(x[5:], DropoutSpec(0.5, 9, 5))
    assert torch.equal(torch.cat([top, bottom]), full)


def test_bias_dropout_add_and_validation():
    x, bias, res = torch.randn(4, 8), torch.randn(8), torch.randn(4, 8)
    spec = DropoutSpec(0.3, 5, 0)
    torch.testing.assert_close(bias_dropout_add(x, bias, res, spec), res + apply_keep_mask(x + bias, spec))
    assert not make_dropout_spec(0.3, False, None).active
    for bad in (1.0, -0.1, "0.1"):
        with pytest.raises(ValueError, match="dropout probability"):
            make_dropout_spec(bad, True, 1)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cuda_kernel_matches_reference(dtype):
    from seqpar import _ext

    if _ext.cuda_extension_error():
        pytest.skip(_ext.cuda_extension_error())
    spec = DropoutSpec(0.1, 2**40 + 3, 77)
    x = torch.randn(300, 1000, device="cuda", dtype=dtype)
    got = apply_keep_mask(x, spec)
    keep = spec.keep_mask_2d(300, 1000, "cpu")
    expected = (x.float().cpu() * keep * spec.scale).to(dtype)
    torch.testing.assert_close(got.cpu().float(), expected.float(), atol=1e-2 if dtype == torch.bfloat16 else 1e-6,
                               rtol=1e-2 if dtype == torch.bfloat16 else 1e-6)
    assert torch.equal(got.cpu() != 0, keep & (x.cpu() != 0))
