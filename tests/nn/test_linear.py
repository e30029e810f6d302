"""ColumnParallelLinear / RowParallelLinear on one rank (t = 1, where SP changes nothing): the input
checks and load_full's shape check (the multi-rank math is in tests/distributed)."""
import pytest
import torch

from seqpar.nn import ColumnParallelLinear, RowParallelLinear
from seqpar.ops import all_gather_matmul

LAYERS = [ColumnParallelLinear, RowParallelLinear]


@pytest.mark.parametrize("layer_cls", LAYERS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("sp", [False, True], ids=["plain", "sp"])
@pytest.mark.parametrize("x, match", [
    (torch.randn(2, 3, 5), r"x must be a floating \[\.\.\., 4\] tensor.*got torch.float32 \(2, 3, 5\)"),
    (torch.zeros(2, 3, 4, dtype=torch.int64), r"x must be a floating .*got torch.int64"),
    (torch.randn(2, 3, 4, dtype=torch.float64), "x dtype torch.float64 != weight dtype torch.float32"),
], ids=["width", "int", "dtype"])
def test_bad_input_is_a_value_error_naming_the_layer(layer_cls, sp, x, match):
    """Without SP torch's matmul error ('mat1 and mat2 must have the same dtype'); with SP a message
    blaming the weight ('weight must be a [n, 5] tensor') about the flattened input."""
    layer = layer_cls(4, 6, sequence_parallel=sp)
    with pytest.raises(ValueError, match=f"{layer_cls.__name__}: {match}"):
        layer(x)


@pytest.mark.parametrize("x_shape, y_shape", [((2, 0, 4), (2, 0, 6)), ((4,), (6,))], ids=["empty-batch", "1-D"])
def test_sequence_parallel_at_t1_changes_nothing(x_shape, y_shape):
    """At t = 1 SP failed on an empty batch (a reshape with -1) and gave a 1-D input a [1, 6] output."""
    plain, sp = ColumnParallelLinear(4, 6), ColumnParallelLinear(4, 6, sequence_parallel=True)
    sp.load_state_dict(plain.state_dict())
    x = torch.randn(x_shape)
    assert plain(x).shape == y_shape
    if len(x_shape) < 2:                                   # SP needs a sequence dim: refused, not reshaped
        with pytest.raises(ValueError, match=r"sequence parallel: \[s, b, \.\.\.\]"):
            sp(x)
    else:
        torch.testing.assert_close(sp(x), plain(x))


@pytest.mark.parametrize("layer_cls", LAYERS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("shape, dtype", [((7, 5), torch.float32), ((6, 3), torch.float32), ((6, 4), torch.int64)],
                         ids=["larger", "smaller", "integer"])
def test_load_full_refuses_another_shape_or_a_non_floating_tensor(layer_cls, shape, dtype):
    """A larger weight was cut to fit without a word; a smaller one failed in torch's narrow; an integer one
    was cast (load_full_state_dict refuses it)."""
    layer = layer_cls(4, 6)
    before = layer.weight.detach().clone()
    with pytest.raises(ValueError, match=rf"{layer_cls.__name__}.weight must be an unsharded floating tensor of "
                                         rf"shape \(6, 4\), got {dtype} \({shape[0]}, {shape[1]}\)"):
        layer.load_full(torch.ones(shape, dtype=dtype), torch.zeros(6))
    assert torch.equal(layer.weight, before)


def test_all_gather_matmul_output_takes_in_place_ops():
    """A 3-D input with a bias on the plain path returned F.linear's view of its 2-D result: in-place ops
    on it raised (views made inside an autograd Function)."""
    x, w, b = torch.randn(3, 2, 4, requires_grad=True), torch.randn(6, 4, requires_grad=True), torch.randn(6)
    y = all_gather_matmul(x, w, b, group=None, overlap=False)
    expected = torch.nn.functional.linear(x, w, b).detach() * 2
    y.mul_(2)
    y.sum().backward()
    torch.testing.assert_close(y.detach(), expected)
    torch.testing.assert_close(x.grad, 2 * w.detach().sum(0).expand(3, 2, 4))


@pytest.mark.parametrize("layer_cls", LAYERS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("args, kwargs, match", [
    ((8, -1), {}, "out_features must be a positive int, got -1"),
    ((8, 2.0), {}, "out_features must be a positive int, got 2.0"),
    ((True, 8), {}, "in_features must be a positive int, got True"),
    ((8, "4"), {}, "out_features must be a positive int, got '4'"),
    ((8, 8), dict(sequence_parallel="False"), "sequence_parallel must be a bool, got 'False'"),
    ((8, 8), dict(bias="no"), "bias must be a bool, got 'no'"),
    ((8, 8), dict(dtype=torch.int64), "dtype must be None or a floating dtype"),
], ids=["negative", "float", "bool", "string", "sp-string", "bias-string", "int-dtype"])
def test_constructor_arguments_are_checked(layer_cls, args, kwargs, match):
    """Sizes failed in torch.empty (RuntimeError / TypeError), blamed partition_blocks, or (a bool) built a
    [8, 1] weight; a flag "False" was truthy: SP on, the output [8, 2, 4] instead of [4, 2, 4] at t = 2."""
    with pytest.raises(ValueError, match=match):
        layer_cls(*args, **kwargs)


@pytest.mark.parametrize("sp", [False, True], ids=["plain", "sp"])
def test_row_parallel_at_t1_is_nn_linear_bit_for_bit_in_bf16(sp):
    """The module docstring says t = 1 is plain nn.Linear math; RowParallelLinear matmul'ed, rounded to bf16,
    then added the bias (a second rounding): 268 of 1024 bf16 outputs differed from nn.Linear's."""
    gen = torch.Generator().manual_seed(0)
    layer = RowParallelLinear(64, 32, sequence_parallel=sp, dtype=torch.bfloat16)
    reference = torch.nn.Linear(64, 32, dtype=torch.bfloat16)
    with torch.no_grad():
        layer.bias.copy_(torch.randn(32, generator=gen))
        reference.load_state_dict(layer.state_dict())
    x = torch.randn(8, 4, 64, generator=gen).bfloat16()
    assert torch.equal(layer(x), reference(x))


@pytest.mark.parametrize("rewrite", ["prune", "weight_norm"])
@pytest.mark.parametrize("layer_cls", [ColumnParallelLinear, RowParallelLinear])
def test_a_standalone_linear_rewritten_by_a_forward_pre_hook_runs_under_autocast(layer_cls, rewrite):
    """torch.nn.utils.prune and the old torch.nn.utils.weight_norm set ``weight`` in a forward pre-hook,
    from the fp32 parameters, before the linear's forward casts its parameters for autocast: a standalone
    parallel linear refused its bf16 input ("x dtype torch.bfloat16 != weight dtype torch.float32 (...
    run it under torch.autocast)", under autocast). Now it computes as nn.Linear does under autocast, and
    the gradients reach the hook's fp32 parameters alike."""
    import warnings
    from torch.nn.utils import prune

    def rewritten(module):
        if rewrite == "prune":
            prune.l1_unstructured(module, "weight", amount=0.3)
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)   # the old weight_norm is deprecated
                torch.nn.utils.weight_norm(module)
        return module

    ours, theirs = layer_cls(8, 12), torch.nn.Linear(8, 12)
    theirs.load_state_dict(ours.state_dict())
    ours, theirs = rewritten(ours), rewritten(theirs)   # the same weights: the same mask, g and v
    x = torch.randn(4, 2, 8)
    outputs = []
    for module in (ours, theirs):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = module(x)
        y.float().square().sum().backward()
        outputs.append((y, [p.grad for p in module.parameters()]))
    assert outputs[0][0].dtype == torch.bfloat16
    assert all(g.dtype == torch.float32 for g in outputs[0][1])
    torch.testing.assert_close(outputs[0], outputs[1], rtol=0, atol=0)
