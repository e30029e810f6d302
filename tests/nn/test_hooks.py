"""Every module that holds parameters runs through its ``__call__`` in a GPTModel forward, so forward
hooks on it fire (activation capture, FSDP's per-module hooks, wrappers). The post-attention norm (called
as its fused bias-dropout-add-norm), the untied output layer and the position table were used through
their methods or weights, and hooks on them silently never fired."""
import pytest
import torch

import seqpar

CONFIGS = {
    "gpt": (dict(hidden_size=32, num_attention_heads=4, hidden_dropout=0.1), True),
    "llama": (dict(hidden_size=32, num_attention_heads=4, num_query_groups=2, normalization="rmsnorm",
                   activation="swiglu", add_bias_linear=False, position_embedding="rope"), False),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_forward_hooks_fire_on_every_module_with_parameters(name):
    kwargs, tied = CONFIGS[name]
    model = seqpar.GPTModel(seqpar.TransformerConfig(backend="torch", **kwargs), 2, 50, 16,
                            share_embeddings_and_output_weights=tied)
    owners = {key: module for key, module in model.named_modules() if list(module.parameters(recurse=False))}
    fired = []
    for key, module in owners.items():
        module.register_forward_hook(lambda mod, args, out, key=key: fired.append(key))
    tokens = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(0))
    model(tokens, tokens).sum().backward()
    assert sorted(set(fired)) == sorted(owners)
    assert ("output_layer" in owners) != tied and ("embedding.position_embeddings" in owners) == (name == "gpt")


def test_post_attention_norm_called_as_the_fused_op_returns_what_the_method_does():
    cfg = seqpar.TransformerConfig(hidden_size=32, num_attention_heads=4, backend="torch")
    layer = seqpar.TransformerLayer(cfg)
    seen = []
    layer.post_attention_layernorm.register_forward_hook(lambda mod, args, out: seen.append((args, out)))
    layer(torch.randn(8, 2, 32))
    (x, bias, residual, spec), (y, residual_out) = seen[0]
    assert torch.equal(residual_out, residual + x + bias)           # no dropout in this config
    torch.testing.assert_close(y, torch.nn.functional.layer_norm(
        residual_out, (32,), layer.post_attention_layernorm.weight, layer.post_attention_layernorm.bias))
    with pytest.raises(ValueError, match="pass residual"):
        layer.post_attention_layernorm(x, bias)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_a_hooked_output_is_not_changed_after_its_hook(name):
    """RoPE rotated q and k in place inside the QKV linear's output: a forward hook that kept it saw it
    change afterwards, and an auxiliary loss built from it failed in backward (modified in place)."""
    layer = seqpar.TransformerLayer(seqpar.TransformerConfig(backend="torch", **CONFIGS[name][0])).eval()
    kept = []
    layer.self_attention.query_key_value.register_forward_hook(
        lambda mod, args, out: kept.append((out, out.detach().clone())))
    x = torch.randn(8, 2, 32, requires_grad=True)
    y = layer(x)
    out, copy = kept[0]
    assert torch.equal(out, copy)
    aux = out.float().pow(2).mean()          # an activation penalty on the hooked output
    (y.sum() + aux).backward()
    grad_with_aux = x.grad.clone()
    x.grad = None
    layer(x).sum().backward()
    layer(x)                                 # the penalty's own gradient, through the first norm only
    x_aux = torch.autograd.grad(kept[-1][0].float().pow(2).mean(), x)[0]
    torch.testing.assert_close(grad_with_aux, x.grad + x_aux)


def test_with_rope_the_qkv_output_is_freed_before_the_attention_core(monkeypatch):
    """RoPE rotates out of place and v is copied: nothing may hold the QKV output afterwards, or the
    layer's forward peaks a QKV-sized buffer higher than the in-place rotation did."""
    import weakref

    import seqpar.nn.layer as layer_module

    layer = seqpar.TransformerLayer(seqpar.TransformerConfig(backend="torch", **CONFIGS["llama"][0]))
    qkv_out, alive_in_core = [], []
    layer.self_attention.query_key_value.register_forward_hook(
        lambda mod, args, out: qkv_out.append(weakref.ref(out)))
    real_core = layer_module.attention_core

    def core(*args, **kwargs):
        alive_in_core.append(qkv_out[-1]() is not None)
        return real_core(*args, **kwargs)

    monkeypatch.setattr(layer_module, "attention_core", core)
    layer(torch.randn(8, 2, 32, requires_grad=True)).sum().backward()
    assert alive_in_core == [False]
