"""seqpar.nn.LayerNorm and RMSNorm as standalone modules: torch.nn.LayerNorm / torch.nn.RMSNorm's values,
and a ValueError naming the shape for an input that is not [..., hidden_size]."""
import pytest
import torch

import seqpar


@pytest.mark.parametrize("kind", ["LayerNorm", "RMSNorm"])
def test_standalone_norm_matches_torch(kind):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, 2, 24, generator=gen)
    ours = getattr(seqpar.nn, kind)(24, eps=1e-5)
    theirs = getattr(torch.nn, kind)(24, eps=1e-5)
    with torch.no_grad():
        for p_ours, p_theirs in zip(ours.parameters(), theirs.parameters()):
            p_ours.copy_(torch.randn(p_ours.shape, generator=gen))
            p_theirs.copy_(p_ours)
    torch.testing.assert_close(ours(x), theirs(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("x,got", [(torch.tensor(1.0), r"shape \(\)"), (torch.randn(3, 7), r"shape \(3, 7\)"),
                                   ([1.0] * 8, "list")], ids=["0-d", "last-dim", "not-a-tensor"])
def test_an_input_that_is_not_hidden_sized_is_a_value_error(kind, x, got):
    """A 0-d x raised IndexError from LayerNorm (the check skipped 0-d, then x.shape[-1] failed)."""
    norm = getattr(seqpar.nn, kind)(8)
    with pytest.raises(ValueError, match=r"x must be a \[\.\.\., hidden_size=8\] tensor, got " + got):
        norm(x)


@pytest.mark.parametrize("kind", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("kwargs, match", [
    (dict(eps=float("nan")), "eps must be a finite float >= 1.175e-38"),
    (dict(eps=float("inf")), "eps must be a finite float"),
    (dict(eps=1e-320), "eps must be a finite float"),          # 0 in fp32: a constant row would give NaN
    (dict(eps=2**2000), "eps must be a finite float"),         # past float's range (was an OverflowError)
    (dict(sequence_parallel="False"), "sequence_parallel must be a bool, got 'False'"),
    (dict(dtype="bfloat16"), "dtype must be None or a floating dtype"),
    (dict(dtype=torch.int64), "dtype must be None or a floating dtype"),
], ids=["eps-nan", "eps-inf", "eps-0-in-fp32", "eps-huge-int", "sp-string", "dtype-string", "dtype-int"])
def test_constructor_arguments_are_checked(kind, kwargs, match):
    """LayerNorm took eps nan (every output NaN) and inf (every output 0); a string flag "False" was
    truthy (under SP the weight gradient came out t times too large); a string dtype raised
    AttributeError."""
    with pytest.raises(ValueError, match=match):
        getattr(seqpar.nn, kind)(8, **kwargs)


def test_norms_have_torchs_shape_attributes():
    """normalized_shape / elementwise_affine, which code written for torch.nn.LayerNorm / RMSNorm reads."""
    for norm, ref in ((seqpar.nn.LayerNorm(16), torch.nn.LayerNorm(16)), (seqpar.nn.RMSNorm(16), torch.nn.RMSNorm(16))):
        assert norm.normalized_shape == ref.normalized_shape == (16,)
        assert norm.elementwise_affine is ref.elementwise_affine is True
