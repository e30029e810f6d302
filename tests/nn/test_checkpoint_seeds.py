"""Dropout seeds under any recomputation (one device, t = 1): torch.utils.checkpoint (reentrant or
not), checkpoint_wrapper and HF-style checkpointing around TransformerLayer / GPTModel's layers replay
the forward's masks; train()/eval() between forward and backward changes nothing; manual_seed
reproduces runs; double backward raises; sequence_parallel with no group is t = 1."""
import functools

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (CheckpointImpl,
                                                                         apply_activation_checkpointing,
                                                                         checkpoint_wrapper)
from torch.utils.checkpoint import checkpoint

import seqpar
from seqpar.ops import all_gather_matmul, attention_core, bias_dropout_add_layer_norm, matmul_reduce_scatter
from seqpar.ops.dropout import DropoutSpec, dropout

H, A, S, B = 48, 4, 13, 2
RECOMPUTE = ("none", "selective", "full")


def _cfg(**kw):
    return seqpar.TransformerConfig(**{**dict(hidden_size=H, num_attention_heads=A, hidden_dropout=0.2,
                                              attention_dropout=0.2, backend="torch"), **kw})


# Ways of re-running a layer's forward in backward, each as call(layer, x).
WRAPPERS = {
    "torch-checkpoint": lambda layer, x: checkpoint(layer, x, use_reentrant=False),
    "torch-checkpoint-reentrant": lambda layer, x: checkpoint(layer, x, use_reentrant=True),
    "checkpoint_wrapper": lambda layer, x: checkpoint_wrapper(layer)(x),
    "checkpoint_wrapper-reentrant": lambda layer, x: checkpoint_wrapper(
        layer, checkpoint_impl=CheckpointImpl.REENTRANT)(x),
    # transformers' gradient_checkpointing_enable(): partial(checkpoint, **kwargs) around layer.__call__
    "hf-style": lambda layer, x: functools.partial(checkpoint, use_reentrant=True)(layer.__call__, x),
}


def _layer_grads(layer, x, call=None, seed=5, between=None):
    """Forward from ``seed`` (optionally wrapped), ``between()`` after it, backward: (y, x.grad, grads)."""
    seqpar.manual_seed(seed)
    x = x.detach().clone().requires_grad_()
    y = layer(x) if call is None else call(layer, x)
    if between is not None:
        between()
    y.backward(torch.linspace(-1, 1, y.numel()).view_as(y))
    grads = {k: p.grad.clone() for k, p in layer.named_parameters()}
    layer.zero_grad(set_to_none=True)
    return y.detach(), x.grad, grads


def _assert_bitwise(got, ref, case):
    assert torch.equal(got[0], ref[0]), f"{case}: output"
    assert torch.equal(got[1], ref[1]), f"{case}: input gradient"
    for key in ref[2]:
        assert torch.equal(got[2][key], ref[2][key]), f"{case}: {key} gradient"


@pytest.mark.parametrize("sp", [False, True], ids=["no-sp", "sp-t1"])
@pytest.mark.parametrize("recompute", RECOMPUTE)
def test_external_checkpoint_replays_layer_masks(recompute, sp):
    seqpar.manual_seed(0)
    layer = seqpar.TransformerLayer(_cfg(recompute=recompute, sequence_parallel=sp))
    x = torch.randn(S, B, H)
    ref = _layer_grads(layer, x)
    assert not torch.equal(ref[0], _layer_grads(layer, x, seed=6)[0]), "dropout must be active"
    for name, call in WRAPPERS.items():
        _assert_bitwise(_layer_grads(layer, x, call), ref, f"{name} recompute={recompute}")


@pytest.mark.parametrize("recompute", RECOMPUTE)
@pytest.mark.parametrize("toggle", ["eval-before-backward", "train-before-backward"])
def test_mode_toggled_between_forward_and_backward(recompute, toggle):
    """The forward's mode (training or not) decides the masks, whatever the module's mode in backward."""
    seqpar.manual_seed(0)
    layer = seqpar.TransformerLayer(_cfg(recompute=recompute))
    x = torch.randn(S, B, H)
    start_training = toggle == "eval-before-backward"
    layer.train(start_training)
    ref = _layer_grads(layer, x)
    layer.train(start_training)
    got = _layer_grads(layer, x, between=lambda: layer.train(not start_training))
    _assert_bitwise(got, ref, f"{toggle} recompute={recompute}")


def _gpt(recompute, sp=False, layers=2):
    seqpar.manual_seed(0)
    return seqpar.GPTModel(_cfg(recompute=recompute, sequence_parallel=sp), num_layers=layers, vocab_size=40,
                           max_seq_len=16)


def _gpt_grads(model, tokens, seed=9):
    seqpar.manual_seed(seed)
    loss = model(tokens, tokens.roll(-1, 1)).mean()
    loss.backward()
    grads = {k.replace("._checkpoint_wrapped_module", ""): p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


@pytest.mark.parametrize("recompute", RECOMPUTE)
def test_gpt_with_every_layer_checkpointed_matches_unwrapped(recompute):
    tokens = torch.randint(0, 40, (B, 11), generator=torch.Generator().manual_seed(1))
    model = _gpt(recompute)
    ref_loss, ref = _gpt_grads(model, tokens)
    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, seqpar.TransformerLayer))
    assert all(type(layer).__name__ == "CheckpointWrapper" for layer in model.layers)
    loss, grads = _gpt_grads(model, tokens)
    assert torch.equal(loss, ref_loss)
    assert grads.keys() == ref.keys()
    for key in ref:
        assert torch.equal(grads[key], ref[key]), key
    # the reentrant flavour, replacing model.layers[i]
    model = _gpt(recompute)
    for i, layer in enumerate(model.layers):
        model.layers[i] = checkpoint_wrapper(layer, checkpoint_impl=CheckpointImpl.REENTRANT)
    loss, grads = _gpt_grads(model, tokens)
    assert torch.equal(loss, ref_loss)
    for key in ref:
        assert torch.equal(grads[key], ref[key]), key


@pytest.mark.parametrize("impl", [CheckpointImpl.NO_REENTRANT, CheckpointImpl.REENTRANT], ids=["non-reentrant",
                                                                                             "reentrant"])
def test_gpt_with_checkpointed_layers_under_autocast_matches_unwrapped(impl):
    """The model handed its dtype to its layers by an attribute that was gone by backward: a checkpoint
    wrapper's recompute (which restores the autocast state it saw, off) re-ran the layer in fp32 on its
    bf16 input, a ValueError ('x dtype torch.bfloat16 != params_dtype')."""
    tokens = torch.randint(0, 40, (B, 11), generator=torch.Generator().manual_seed(1))

    def loss_and_grads(model):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return _gpt_grads(model, tokens)

    ref_loss, ref = loss_and_grads(_gpt("selective"))
    model = _gpt("selective")
    for i, layer in enumerate(model.layers):
        model.layers[i] = checkpoint_wrapper(layer, checkpoint_impl=impl)
    loss, grads = loss_and_grads(model)
    assert torch.equal(loss, ref_loss) and ref_loss.dtype == torch.float32
    for key in ref:
        assert torch.equal(grads[key], ref[key]), key


def test_gpt_calls_each_layer_through_call():
    """Hooks on model.layers[i] fire in order, each layer's input is the previous layer's output, and
    each output is what calling the layer gives."""
    model = _gpt("none", layers=3)
    model.eval()
    tokens = torch.randint(0, 40, (B, 9), generator=torch.Generator().manual_seed(2))
    seen = []
    hooks = [layer.register_forward_hook(lambda mod, args, out, i=i: seen.append((i, args[0].detach(), out.detach())))
             for i, layer in enumerate(model.layers)]
    model(tokens)
    for hook in hooks:
        hook.remove()
    assert [i for i, _, _ in seen] == [0, 1, 2]
    for (i, x, y), (_, x_next, _) in zip(seen, seen[1:] + [(None, None, None)]):
        if x_next is not None:
            assert torch.equal(x_next, y), f"layer {i + 1} input is not layer {i}'s output"
    with torch.no_grad():
        for i, x, y in seen:
            assert torch.equal(model.layers[i](x), y), i


def test_manual_seed_build_and_run_twice_is_bitwise_equal():
    tokens = torch.randint(0, 40, (B, 11), generator=torch.Generator().manual_seed(3))
    runs = []
    for _ in range(2):
        seqpar.manual_seed(42)
        model = seqpar.GPTModel(_cfg(recompute="selective"), num_layers=2, vocab_size=40, max_seq_len=16)
        losses = []
        for _step in range(2):  # consecutive steps draw fresh masks, reproducibly
            loss = model(tokens, tokens.roll(-1, 1)).mean()
            loss.backward()
            losses.append(loss.detach())
        runs.append((losses, {k: p.grad.clone() for k, p in model.named_parameters()}))
    (losses_a, grads_a), (losses_b, grads_b) = runs
    assert not torch.equal(losses_a[0], losses_a[1])
    assert all(torch.equal(a, b) for a, b in zip(losses_a, losses_b))
    assert all(torch.equal(grads_a[k], grads_b[k]) for k in grads_a)


def test_functional_ops_with_seed_none_replay_under_checkpoint():
    """seed=None draws from torch's CPU generator, so a checkpointed op replays its own mask."""
    gen = torch.Generator().manual_seed(4)
    x, res = torch.randn(2, 7, H, generator=gen), torch.randn(2, 7, H, generator=gen)
    w, b, bias = torch.rand(H, generator=gen) + 0.5, torch.randn(H, generator=gen), torch.randn(H, generator=gen)
    q, k, v = (torch.randn(2, 3, 9, 8, generator=gen) for _ in range(3))
    ops = {
        "bias_dropout_add_layer_norm": (lambda x, r: bias_dropout_add_layer_norm(
            x, bias, r, w, b, p=0.3, backend="torch")[0], (x, res)),
        "attention_core": (lambda q, k, v: attention_core(q, k, v, causal=True, dropout_p=0.3, backend="torch"),
                           (q, k, v)),
    }
    for name, (fn, args) in ops.items():
        results = []
        for wrap in (None, False, True):
            seqpar.manual_seed(11)
            leaves = [a.clone().requires_grad_() for a in args]
            y = fn(*leaves) if wrap is None else checkpoint(fn, *leaves, use_reentrant=wrap)
            y.backward(torch.cos(torch.arange(y.numel(), dtype=y.dtype)).view_as(y))
            results.append([y.detach()] + [leaf.grad for leaf in leaves])
        for got in results[1:]:
            assert all(torch.equal(a, b) for a, b in zip(got, results[0])), name


def _double_backward(fn, *inputs, leaves=None):
    """An HVP-style double backward through ``fn`` (w.r.t. ``leaves``, default copies of ``inputs``)."""
    if leaves is None:
        inputs = leaves = [t.detach().clone().requires_grad_() for t in inputs]
    y = fn(*inputs)
    y = y[0] if isinstance(y, tuple) else y
    grads = torch.autograd.grad((y.float() ** 2).sum(), leaves, create_graph=True)
    sum(g.sum() for g in grads).backward()


def test_double_backward_raises():
    """Every seqpar autograd.Function is once-differentiable: create_graph through it raises instead of
    returning wrong second derivatives (the f / g mappings: tests/distributed/test_rng_agreement.py)."""
    gen = torch.Generator().manual_seed(5)
    x3 = torch.randn(6, 2, H, generator=gen)
    w, b = torch.randn(H, generator=gen), torch.randn(H, generator=gen)
    q = torch.randn(1, 2, 6, 8, generator=gen)
    spec = DropoutSpec(0.3, 123, 0)
    gpt = _gpt("none", layers=1)
    tokens = torch.randint(0, 40, (2, 6), generator=gen)
    cases = {
        "bias_dropout_add_layer_norm": (lambda x, r: bias_dropout_add_layer_norm(x, b, r, w, b, p=0.2, seed=3,
                                                                                backend="torch"), (x3, x3)),
        "attention_core": (lambda q, k, v: attention_core(q, k, v, causal=True, backend="torch"), (q, q, q)),
        "dropout": (lambda x: dropout(x, spec), (x3,)),
        "all_gather_matmul": (lambda x, wt: all_gather_matmul(x, wt, group=None), (x3, torch.randn(5, H))),
        "matmul_reduce_scatter": (lambda x, wt: matmul_reduce_scatter(x, wt, group=None), (x3, torch.randn(5, H))),
    }
    for name, (fn, inputs) in cases.items():
        with pytest.raises(RuntimeError, match="differentiate twice"):
            _double_backward(fn, *inputs)
            pytest.fail(f"{name}: double backward did not raise")
    # GPTModel's loss (vocab-parallel cross-entropy) w.r.t. the tied word embedding
    with pytest.raises(RuntimeError, match="differentiate twice"):
        _double_backward(lambda t: gpt(t, t.roll(-1, 1)), tokens, leaves=list(gpt.parameters()))


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_create_graph_backward_raises_whatever_the_upstream_gradient(recompute):
    """A gradient penalty by ``torch.autograd.grad(penalty, params)`` returned the first-order terms alone
    (torch's once_differentiable hung its error node off detached results: 0.99 relative error for the
    LayerNorm weight), and a constant upstream gradient (``y.sum()``) gave zero second derivatives; the
    vocab-parallel loss and the ops on 3-D inputs too. Now the create_graph backward itself raises."""
    layer = seqpar.TransformerLayer(seqpar.TransformerConfig(hidden_size=H, num_attention_heads=4,
                                                             recompute=recompute))
    x = torch.randn(6, 2, H, generator=torch.Generator().manual_seed(7), requires_grad=True)
    for loss in (lambda y: y.square().sum(), lambda y: y.sum()):
        with pytest.raises(RuntimeError, match="differentiate twice"):
            torch.autograd.grad(loss(layer(x)), x, create_graph=True)
    q = torch.randn(1, 2, 6, 8, generator=torch.Generator().manual_seed(8), requires_grad=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        torch.autograd.grad(attention_core(q, q, q, causal=True, backend="torch").sum(), q, create_graph=True)
    gpt = _gpt("none", layers=1)
    tokens = torch.randint(0, 40, (2, 6), generator=torch.Generator().manual_seed(9))
    with pytest.raises(RuntimeError, match=r"differentiate twice .*_VocabParallelCrossEntropy"):
        torch.autograd.grad(gpt(tokens, tokens.roll(-1, 1)).sum(), gpt.final_layernorm.weight, create_graph=True)
    (gx,) = torch.autograd.grad(layer(x).square().sum(), x)      # first order as usual
    assert not gx.requires_grad and torch.isfinite(gx).all()


def test_checkpoint_itself_is_twice_differentiable():
    """seqpar.recompute.checkpoint is torch's non-reentrant checkpoint: a double backward through a region
    of plain torch ops gives plain autograd's second derivatives (only the fused ops above refuse)."""
    x = torch.randn(6, 2, H, generator=torch.Generator().manual_seed(6))
    got = []
    for fn in (lambda t: t.sin() * t, lambda t: seqpar.recompute.checkpoint(lambda u: u.sin() * u, t)):
        leaf = x.clone().requires_grad_()
        _double_backward(fn, leaf, leaves=[leaf])
        got.append(leaf.grad)
    torch.testing.assert_close(got[1], got[0], rtol=0, atol=0)


@pytest.mark.parametrize("recompute", RECOMPUTE)
def test_non_contiguous_input(recompute):
    layer = seqpar.TransformerLayer(_cfg(recompute=recompute))
    x = torch.randn(H, S, B).permute(1, 2, 0)   # [s, b, h] view whose last dimension has stride s * b
    assert x.stride(-1) != 1
    got = _layer_grads(layer, x)
    ref = _layer_grads(layer, x.contiguous())
    _assert_bitwise(got, ref, "transposed input")


def test_sequence_parallel_without_group_is_t1():
    """tp_group=None is t = 1: sequence_parallel=True computes bitwise what sequence_parallel=False does,
    in every module that takes the flag."""
    x = torch.randn(S, B, H)
    for recompute in RECOMPUTE:
        results = []
        for sp in (False, True):
            seqpar.manual_seed(0)
            layer = seqpar.TransformerLayer(_cfg(recompute=recompute, sequence_parallel=sp), tp_group=None)
            results.append(_layer_grads(layer, x))
        _assert_bitwise(results[1], results[0], f"TransformerLayer recompute={recompute}")
    tokens = torch.randint(0, 40, (B, 12), generator=torch.Generator().manual_seed(6))
    (loss_a, grads_a), (loss_b, grads_b) = (_gpt_grads(_gpt("none", sp=sp), tokens) for sp in (False, True))
    assert torch.equal(loss_a, loss_b) and all(torch.equal(grads_a[k], grads_b[k]) for k in grads_a)
    modules = {
        "LayerNorm": lambda sp: seqpar.nn.LayerNorm(H, sequence_parallel=sp, tp_group=None),
        "ColumnParallelLinear": lambda sp: seqpar.nn.ColumnParallelLinear(H, 20, sequence_parallel=sp, tp_group=None),
        "RowParallelLinear": lambda sp: seqpar.nn.RowParallelLinear(H, 20, sequence_parallel=sp, tp_group=None),
    }
    for name, make in modules.items():
        outs = []
        for sp in (False, True):
            module = make(sp)
            with torch.no_grad():
                for i, p in enumerate(module.parameters()):
                    p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(i)))
            xi = x.clone().requires_grad_()
            y = module(xi)
            y.backward(torch.ones_like(y))
            outs.append([y.detach(), xi.grad] + [p.grad for p in module.parameters()])
        assert all(torch.equal(a, b) for a, b in zip(*outs)), name
