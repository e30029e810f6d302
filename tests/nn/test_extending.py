"""Extending seqpar's modules: a subclass that adds parameters, a part replaced by a module of the user's.
The unsharded state dicts carry every parameter the module holds (seqpar's parts by their layouts, the
rest as they are); the input checks read no particular part."""
import pytest
import torch
from torch import nn

import seqpar
from seqpar.nn import TransformerLayer

H = 16


def _cfg(**kw):
    return seqpar.TransformerConfig(hidden_size=H, num_attention_heads=2, **kw)


class GatedLayer(TransformerLayer):
    """A learned residual gate on top of the layer."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.gate = nn.Parameter(torch.full((H,), 0.5))

    def forward(self, x):
        return x + self.gate * (super().forward(x) - x)


class PlainMLP(nn.Module):
    """A replacement MLP of the user's: other parameter names, ParallelMLP's (out, bias) return."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(H, 4 * H), nn.Linear(4 * H, H, bias=False)
        self.out_bias = nn.Parameter(torch.zeros(H))

    def forward(self, a2):
        return self.fc2(torch.relu(self.fc1(a2))), self.out_bias


def _model(**cfg):
    seqpar.manual_seed(0)
    model = seqpar.GPTModel(_cfg(**cfg), num_layers=2, vocab_size=50, max_seq_len=8)
    model.layers[1] = GatedLayer(_cfg(**cfg), layer_number=1)
    model.layers[0].mlp = PlainMLP()
    return model


def test_a_subclass_s_and_a_replacement_s_parameters_round_trip_through_the_unsharded_state_dict():
    """The gate of a TransformerLayer subclass was left out of full_state_dict, and a strict
    load_full_state_dict of that dict reported nothing missing (the gate kept its init); a replaced MLP
    raised AttributeError."""
    model = _model()
    with torch.no_grad():
        model.layers[1].gate.fill_(0.123)
        model.layers[0].mlp.out_bias.fill_(0.25)
    full = model.full_state_dict()
    assert set(full) == set(model.state_dict()) and set(model.full_shapes()) == set(full)
    assert torch.equal(full["layers.1.gate"], torch.full((H,), 0.123))
    assert model.full_shapes()["layers.0.mlp.fc1.weight"] == (4 * H, H)
    assert "layers.0.mlp.dense_h_to_4h.weight" not in full

    other = _model()
    assert other.load_full_state_dict(full) == ([], [])
    for key, value in other.full_state_dict().items():
        assert torch.equal(value, full[key]), key
    tokens = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(other(tokens, tokens), model(tokens, tokens), rtol=0, atol=0)

    missing = dict(full)
    del missing["layers.1.gate"]
    with pytest.raises(ValueError, match="layers.1.gate"):
        other.load_full_state_dict(missing)
    assert other.load_full_state_dict(missing, strict=False).missing_keys == ["layers.1.gate"]
    # The layer alone keys them as its own; its reset draws seqpar's parts and leaves the user's.
    layer = model.layers[1]
    assert torch.equal(layer.full_state_dict()["gate"], full["layers.1.gate"])
    layer.reset_parameters()
    assert torch.equal(layer.gate, torch.full((H,), 0.123))
    seqpar.manual_seed(0)
    assert torch.equal(layer.self_attention.dense.weight, GatedLayer(_cfg(), layer_number=1).self_attention.dense.weight)


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_the_unsharded_keys_are_the_config_s(family):
    """full_shapes() now lists the parameters the model holds: for seqpar's own model, exactly the keys and
    shapes its config names (the vocabulary table's real rows, no position table with RoPE, an output
    layer only when untied)."""
    kw = dict(normalization="rmsnorm", activation="swiglu", position_embedding="rope", num_query_groups=1,
              add_bias_linear=False) if family == "llama" else {}
    seqpar.manual_seed(0)
    model = seqpar.GPTModel(_cfg(**kw), num_layers=2, vocab_size=50, max_seq_len=8,
                            share_embeddings_and_output_weights=family != "llama")
    expected = {key: shape for key, shape in model._config_shapes().items()
                if not (key.startswith("embedding.position") and family == "llama")
                and not (key.startswith("output_layer") and family != "llama")}
    assert model.full_shapes() == expected
    assert {key: tuple(value.shape) for key, value in model.full_state_dict().items()} == expected
    assert model.layers[0].full_shapes() == model.layers[0]._config_shapes()


def test_a_replaced_part_does_not_break_the_input_checks():
    """The input checks read input_layernorm.weight / final_layernorm.weight and the MLP's fc2 by name:
    a part replaced by nn.Identity or a module of other names raised AttributeError in forward."""
    seqpar.manual_seed(0)
    layer = TransformerLayer(_cfg())
    layer.input_layernorm = nn.Identity()
    layer.mlp = PlainMLP()
    x = torch.randn(8, 2, H)
    assert layer(x).shape == x.shape
    assert "input_layernorm.weight" not in layer.full_state_dict()
    model = seqpar.GPTModel(_cfg(), num_layers=1, vocab_size=50, max_seq_len=8)
    model.final_layernorm = nn.Identity()
    tokens = torch.randint(0, 50, (2, 8))
    assert model(tokens).shape == (8, 2, 50)
    with pytest.raises(ValueError, match="tokens are on meta but the model's parameters are on cpu"):
        model(tokens.to("meta"))
