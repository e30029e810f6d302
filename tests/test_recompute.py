"""seqpar.recompute.checkpoint against plain autograd (and torch.utils.checkpoint): parameter hooks, the
forward's autocast state, outputs without a gradient, tensors in containers and tensors hooks bring in."""
import pytest
import torch

import seqpar
from seqpar.recompute import checkpoint


def _linear():
    torch.manual_seed(0)
    return torch.nn.Linear(8, 8)


def _layer_grad(recompute, hook=None):
    """mlp.dense_4h_to_h.weight's gradient of one forward and backward (the same weights, input and
    dropout masks for every policy), with ``hook`` registered on that weight."""
    seqpar.manual_seed(0)
    layer = seqpar.TransformerLayer(seqpar.TransformerConfig(hidden_size=16, num_attention_heads=2,
                                                             recompute=recompute, backend="torch"))
    weight = layer.mlp.dense_4h_to_h.weight
    if hook is not None:
        weight.register_hook(hook)
    layer(torch.randn(4, 1, 16, generator=torch.Generator().manual_seed(1))).sum().backward()
    return weight.grad


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_a_hook_on_a_parameter_runs_once(recompute):
    """The re-run's autograd.grad with respect to the parameters themselves ran their tensor hooks, and
    the returned gradient ran them again: a hook that doubles a gradient quadrupled it under full
    recompute. Also for checkpoint() called directly."""
    calls = []
    grad = _layer_grad(recompute, lambda g: calls.append(1) or g * 2)
    assert calls == [1]
    torch.testing.assert_close(grad, 2 * _layer_grad("none"), rtol=0, atol=0)

    lin, plain, calls = _linear(), _linear(), []
    lin.weight.register_hook(lambda g: calls.append(1) or g * 2)
    x = torch.randn(3, 8)
    checkpoint(lin, x).sum().backward()
    plain(x).sum().backward()
    assert calls == [1]
    torch.testing.assert_close(lin.weight.grad, 2 * plain.weight.grad, rtol=0, atol=0)


def _noisy_layer(recompute):
    """A layer whose fc1 output gets noise from torch's generator in a forward hook (noise injection)."""
    seqpar.manual_seed(0)
    layer = seqpar.TransformerLayer(seqpar.TransformerConfig(hidden_size=16, num_attention_heads=2,
                                                             recompute=recompute, backend="torch"))
    layer.mlp.dense_h_to_4h.register_forward_hook(lambda mod, args, out: out + torch.randn_like(out))
    return layer


def test_the_re_run_draws_what_the_forward_drew_from_torch_rng():
    """Full recompute re-ran a hook that draws from torch's generator with the generator moved on: the
    backward differentiated another forward (fc2's weight gradient off by more than its own size).
    torch.utils.checkpoint restores the forward's generator state for its re-run; so does this one,
    and the backward's own draws after it are as without recompute."""
    got = {}
    for recompute in ("none", "full"):
        layer = _noisy_layer(recompute)
        x = torch.randn(4, 1, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)
        torch.manual_seed(123)
        layer(x).pow(2).sum().backward()
        got[recompute] = (x.grad, layer.mlp.dense_4h_to_h.weight.grad, torch.rand(3))
    for plain, recomputed in zip(got["none"], got["full"]):
        torch.testing.assert_close(recomputed, plain, rtol=0, atol=0)


def test_gradient_watching_modes_run_through_the_re_run():
    """FlopCounterMode (MFU) and ModuleTracker register gradient hooks on module inputs; under full
    recompute they failed in backward ("A leaf node was passed to _will_engine_execute_node but we are
    currently running autograd.grad()"). The count is the forward's, twice, plus the backward's."""
    from torch.utils.flop_counter import FlopCounterMode
    from torch.utils.module_tracker import ModuleTracker

    x = torch.randn(4, 1, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)
    flops = {}
    for recompute in ("none", "full"):
        layer = seqpar.TransformerLayer(seqpar.TransformerConfig(hidden_size=16, num_attention_heads=2,
                                                                 recompute=recompute, backend="torch"))
        with FlopCounterMode(display=False) as forward_only:
            y = layer(x)
        with FlopCounterMode(display=False) as backward, ModuleTracker():
            y.sum().backward()
        flops[recompute] = (forward_only.get_total_flops(), backward.get_total_flops())
    (fwd, bwd), (fwd_full, bwd_full) = flops["none"], flops["full"]
    assert fwd > 0 and fwd_full == fwd and bwd_full == bwd + fwd


@pytest.mark.parametrize("backward_in_autocast", [False, True], ids=["backward-outside", "backward-inside"])
def test_the_re_run_uses_the_forwards_autocast(backward_in_autocast):
    """The re-run ran under whatever autocast was active during backward: after a bf16 forward, a
    backward outside autocast recomputed in fp32, and the gradients differed from plain autograd's."""
    lin = _linear()
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(2))

    def fn(t):
        return lin(lin(t).float().tanh())

    grads = []
    for call in (fn, lambda t: checkpoint(fn, t, module=lin)):
        lin.zero_grad(set_to_none=True)
        xx = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = call(xx)
            if backward_in_autocast:
                y.float().square().sum().backward()
        if not backward_in_autocast:
            y.float().square().sum().backward()
        assert y.dtype == torch.bfloat16
        grads.append((xx.grad, lin.weight.grad, lin.bias.grad))
    for plain, recomputed in zip(*grads):
        torch.testing.assert_close(recomputed, plain, rtol=0, atol=0)


def test_outputs_without_a_gradient_give_none():
    """fn whose outputs do not depend differentiably on the inputs: backward raised a bare StopIteration."""
    x = torch.randn(5, requires_grad=True)
    y = checkpoint(lambda t: (t > 0).float(), x)
    (y * x).sum().backward()
    torch.testing.assert_close(x.grad, (x > 0).float().detach())


def test_module_defaults_to_fn_when_fn_is_a_module():
    """checkpoint(lin, x) without module= left lin.weight.grad None."""
    lin, plain = _linear(), _linear()
    x = torch.randn(3, 8)
    checkpoint(lin, x).sum().backward()
    checkpoint(lin.forward, x).sum().backward()      # a bound method of the module: the same
    plain(x).sum().backward()
    torch.testing.assert_close(lin.weight.grad, 2 * plain.weight.grad)


@pytest.mark.parametrize("case", ["list_arg", "dict_arg", "list_out", "dict_out", "nested_out"])
def test_tensors_in_containers_get_their_gradients(case):
    """Tensors in a list or dict argument, or returned in a list, a dict or a nested tuple: the
    autograd.Function checkpoint before torch's non-reentrant one tracked only flat tensors (and refused
    the rest with a ValueError); now they get the gradients plain autograd gives."""
    a, b = torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True)
    calls = {
        "list_arg": lambda: checkpoint(lambda ab: ab[0] * ab[1], [a, b]),
        "dict_arg": lambda: checkpoint(lambda ab: ab["a"] * ab["b"], {"a": a, "b": b}),
        "list_out": lambda: checkpoint(lambda x, y: [x * y], a, b)[0],
        "dict_out": lambda: checkpoint(lambda x, y: {"p": x * y}, a, b)["p"],
        "nested_out": lambda: checkpoint(lambda x, y: (x, (x * y,)), a, b)[1][0],
    }
    calls[case]().sum().backward()
    torch.testing.assert_close(a.grad, b.detach(), rtol=0, atol=0)
    torch.testing.assert_close(b.grad, a.detach(), rtol=0, atol=0)


def _adapted_layer(recompute, frozen):
    """A layer with a LoRA-style adapter (A, B held outside the layer) added to its QKV output by a forward
    hook, and the MLP output captured by another hook (for an auxiliary loss)."""
    seqpar.manual_seed(0)
    layer = seqpar.TransformerLayer(seqpar.TransformerConfig(hidden_size=16, num_attention_heads=2,
                                                             recompute=recompute, backend="torch"))
    layer.requires_grad_(not frozen)
    gen = torch.Generator().manual_seed(3)
    lora_a = torch.nn.Parameter(0.1 * torch.randn(2, 16, generator=gen))
    lora_b = torch.nn.Parameter(0.1 * torch.randn(48, 2, generator=gen))
    layer.self_attention.query_key_value.register_forward_hook(
        lambda mod, args, out: out + args[0] @ lora_a.t() @ lora_b.t())
    captured = []
    layer.mlp.register_forward_hook(lambda mod, args, out: captured.append(out[0]))
    return layer, (lora_a, lora_b), captured


@pytest.mark.parametrize("frozen", [False, True], ids=["trainable", "frozen"])
def test_tensors_hooks_bring_into_a_full_recompute_layer_get_gradients(frozen):
    """Full recompute ran the layer under no_grad and differentiated only its input and parameters: a
    LoRA adapter added by a forward hook got no gradient without a word (its base layer trainable), or
    backward raised (the base layer frozen), and an activation a hook captured for an auxiliary loss had
    no graph. Now each gets what it gets without recompute."""
    x = torch.randn(4, 1, 16, generator=torch.Generator().manual_seed(1))
    got = {}
    for recompute in ("none", "full"):
        layer, adapter, captured = _adapted_layer(recompute, frozen)
        y = layer(x)
        (y.square().sum() + captured[0].abs().sum()).backward()
        got[recompute] = [t.grad for t in adapter] + [None if frozen else layer.mlp.dense_h_to_4h.weight.grad]
    for plain, recomputed in zip(got["none"], got["full"]):
        if plain is None:
            assert recomputed is None
        else:
            torch.testing.assert_close(recomputed, plain, rtol=0, atol=0)


def test_swapped_parameters_replaces_every_alias_and_puts_them_back():
    """The one parameter swap (full recompute's re-run, autocast's cast parameters): a tied weight is
    replaced under every name it has, and everything is restored on leaving, after an error too."""
    from seqpar.recompute import swapped_parameters

    model = torch.nn.Sequential(torch.nn.Embedding(5, 4), torch.nn.Linear(4, 5, bias=False))
    model[1].weight = model[0].weight                       # tied: one entry in named_parameters()
    assert [n for n, _ in model.named_parameters()] == ["0.weight"]
    original = model[0].weight
    replacement = torch.full((5, 4), 2.0)
    with pytest.raises(RuntimeError, match="inside"):
        with swapped_parameters(model, {"0.weight": replacement}):
            assert model[0].weight is replacement and model[1].weight is replacement
            raise RuntimeError("inside")
    assert model[0].weight is original and model[1].weight is original
    assert isinstance(model[1]._parameters["weight"], torch.nn.Parameter)
    with pytest.raises(ValueError, match=r"no parameters \['2.weight'\]"):
        with swapped_parameters(model, {"2.weight": replacement}):
            pass
    # functional_call(..., tie_weights=False) with two values for one tied weight, through a checkpoint:
    # one value silently went into both aliases (the other alias's gradient lost)
    with pytest.raises(ValueError, match=r"'0.weight' and '1.weight' are one tied parameter"):
        with swapped_parameters(model, {"0.weight": replacement, "1.weight": torch.zeros(5, 4)}):
            pass
    assert model[0].weight is original and model[1].weight is original


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_a_parameter_modified_before_backward_raises_as_without_recompute(recompute):
    """An in-place update of a parameter between the forward and its backward (an optimizer step too
    early): autograd raises for the tensors it saved; the full-recompute re-run read the updated weight and
    differentiated another forward without a word."""
    seqpar.manual_seed(0)
    layer = seqpar.TransformerLayer(seqpar.TransformerConfig(hidden_size=16, num_attention_heads=2,
                                                             recompute=recompute, backend="torch"))
    y = layer(torch.randn(4, 1, 16, requires_grad=True))
    with torch.no_grad():
        layer.mlp.dense_h_to_4h.weight.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()
