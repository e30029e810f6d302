"""Initialisation of the modules used on their own: the tensor-parallel linears draw their unsharded
weight (not torch.empty's leftovers), and the deferred-init recipe (meta device, to_empty,
reset_parameters) rebuilds exactly what building on a real device draws."""
import pytest
import torch

import seqpar
from seqpar.nn import ColumnParallelLinear, RowParallelLinear


@pytest.mark.parametrize("cls", [ColumnParallelLinear, RowParallelLinear], ids=lambda c: c.__name__)
def test_parallel_linear_on_its_own_is_initialised(cls):
    torch.manual_seed(0)
    first = cls(64, 48)
    torch.manual_seed(0)
    second = cls(64, 48)
    w = first.weight.detach()
    assert torch.equal(w, second.weight) and torch.equal(first.bias, torch.zeros(48))
    assert 0.017 < w.std().item() < 0.023 and w.abs().max().item() < 0.2     # N(0, 0.02), 3072 draws
    ones = cls(8, 4, init_method=lambda full: full.fill_(1.0), bias=False)
    assert torch.equal(ones.weight.detach(), torch.ones(4, 8)) and ones.bias is None
    assert "in_features=64, out_features=48, bias=True, tp=1" in repr(first)
    meta = cls(64, 48, device="meta").to_empty(device="cpu")                   # nothing drawn on meta
    torch.manual_seed(0)
    meta.reset_parameters()
    assert torch.equal(meta.weight, second.weight)


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_meta_then_to_empty_then_reset_parameters_is_the_eager_build(arch):
    kw = dict(hidden_size=32, num_attention_heads=4, backend="torch")
    if arch == "llama":
        kw.update(normalization="rmsnorm", activation="swiglu", position_embedding="rope", add_bias_linear=False,
                  num_query_groups=2)
    cfg = seqpar.TransformerConfig(**kw)
    seqpar.manual_seed(4)
    eager = seqpar.GPTModel(cfg, 2, 50, 16, share_embeddings_and_output_weights=arch == "gpt")
    seqpar.manual_seed(4)
    with torch.device("meta"):
        deferred = seqpar.GPTModel(cfg, 2, 50, 16, share_embeddings_and_output_weights=arch == "gpt")
    assert all(p.is_meta for p in deferred.parameters())
    deferred.to_empty(device="cpu")
    deferred.reset_parameters()
    want = dict(eager.named_parameters())
    for name, p in deferred.named_parameters():
        assert torch.equal(p, want[name]), name
    tokens = torch.randint(0, 50, (2, 8))
    torch.testing.assert_close(deferred(tokens), eager(tokens), rtol=0, atol=0)


def test_meta_model_refuses_loads_and_inputs_instead_of_doing_nothing():
    """Loading into meta parameters copied nothing, silently, and the next forward crashed inside
    autocast's device lookup; both are now ValueErrors that name the meta device."""
    cfg = seqpar.TransformerConfig(hidden_size=32, num_attention_heads=4, backend="torch")
    seqpar.manual_seed(0)
    full = seqpar.GPTModel(cfg, 1, 50, 16).full_state_dict()
    model = seqpar.GPTModel(cfg, 1, 50, 16, device="meta")
    with pytest.raises(ValueError, match="GPTModel.load_full_state_dict: the parameters are on the meta device"):
        model.load_full_state_dict(full)
    layer_dict = {k[len("layers.0."):]: v for k, v in full.items() if k.startswith("layers.0.")}
    with pytest.raises(ValueError, match=r"load_full_state_dict: the parameters are on the meta device"):
        model.layers[0].load_full_state_dict(layer_dict)
    with pytest.raises(ValueError, match="tokens are on cpu but the model's parameters are on meta"):
        model(torch.randint(0, 50, (2, 8)))
    with pytest.raises(ValueError, match="x is on cpu but the layer's parameters are on meta"):
        model.layers[0](torch.randn(8, 2, 32))


@pytest.mark.parametrize("tied", [True, False])
def test_loading_the_models_own_tensors_changes_nothing(tied):
    """At t = 1 with v a multiple of 128 (no padded rows) the native state dict has the unsharded keys and
    shapes, so load_full_state_dict accepts it; its tensors are the model's own. The vocabulary tables were
    zeroed before their rows were copied, which zeroed the source too."""
    cfg = seqpar.TransformerConfig(hidden_size=32, num_attention_heads=4, backend="torch")
    seqpar.manual_seed(0)
    model = seqpar.GPTModel(cfg, 1, 128, 16, share_embeddings_and_output_weights=tied)
    tokens = torch.randint(0, 128, (2, 8))
    before = model(tokens)
    model.load_full_state_dict(model.state_dict())
    assert model.embedding.word_embeddings.weight.abs().sum() > 0
    torch.testing.assert_close(model(tokens), before, rtol=0, atol=0)
