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


def _expected_shapes(model, family):
    """The unsharded keys and shapes the config names (an independent listing)."""
    h, f, v = H, 4 * H, 50
    qkv_rows = (2 + 2 * (1 if family == "llama" else 2)) * (H // 2)
    shapes = {"embedding.word_embeddings.weight": (v, h)}
    if family != "llama":
        shapes["embedding.position_embeddings.weight"] = (8, h)
    for i in range(2):
        for name, shape, bias in (("input_layernorm", (h,), family != "llama"),
                                  ("self_attention.query_key_value", (qkv_rows, h), family != "llama"),
                                  ("self_attention.dense", (h, h), family != "llama"),
                                  ("post_attention_layernorm", (h,), family != "llama"),
                                  ("mlp.dense_h_to_4h", ((2 * f if family == "llama" else f), h), family != "llama"),
                                  ("mlp.dense_4h_to_h", (h, f), family != "llama")):
            shapes[f"layers.{i}.{name}.weight"] = shape
            if bias:
                shapes[f"layers.{i}.{name}.bias"] = shape[:1]
    shapes["final_layernorm.weight"] = (h,)
    if family != "llama":
        shapes["final_layernorm.bias"] = (h,)
    else:
        shapes["output_layer.weight"] = (v, h)
    return shapes


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
    expected = _expected_shapes(model, family)
    assert model.full_shapes() == expected
    assert {key: tuple(value.shape) for key, value in model.full_state_dict().items()} == expected
    assert model.layers[0].full_shapes() == {key[len("layers.0."):]: shape for key, shape in expected.items()
                                              if key.startswith("layers.0.")}


def test_a_layer_at_two_depths_keeps_both_keys():
    """One layer object at two depths (weight sharing across depth): its keys at each, as state_dict()
    gives them (the walk dropped the repeated module, and to_gpt2_state_dict failed on the missing keys)."""
    seqpar.manual_seed(0)
    model = seqpar.GPTModel(_cfg(), num_layers=2, vocab_size=50, max_seq_len=8)
    model.layers[1] = model.layers[0]
    full = model.full_state_dict()
    assert set(full) == set(model.state_dict()) == set(_expected_shapes(model, "gpt"))
    assert model.load_full_state_dict(full) == ([], [])


def test_the_meta_recipe_resets_replaced_parts_and_blocks_of_the_user_s_own():
    """build on meta, to_empty, reset_parameters: a replaced MLP's parameters kept to_empty's garbage (NaN
    here: a NaN loss and no error), and a block of the user's own or a replaced final norm raised
    AttributeError. Each is now reset by its own reset_parameters (or its children's)."""
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.mix = nn.Linear(H, H)

        def forward(self, x):
            return x + self.mix(x)

    with torch.device("meta"):
        model = _model()
        model.layers.append(Block())
        model.final_layernorm = nn.LayerNorm(H)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for param in model.parameters():
            param.fill_(float("nan"))
    seqpar.manual_seed(0)
    model.reset_parameters()
    nan = [name for name, param in model.named_parameters() if param.isnan().any()]
    # Parameters held directly by a module without a reset_parameters of its own (PlainMLP's out_bias, the
    # subclass's gate): nothing knows their init, as with torch's modules
    assert nan == ["layers.0.mlp.out_bias", "layers.1.gate"], nan
    seqpar.manual_seed(0)
    reference = seqpar.GPTModel(_cfg(), num_layers=2, vocab_size=50, max_seq_len=8)
    for key in ("layers.0.self_attention.dense.weight", "layers.1.self_attention.query_key_value.weight",
                "embedding.word_embeddings.weight"):
        torch.testing.assert_close(model.full_state_dict()[key], reference.full_state_dict()[key], rtol=0, atol=0)


def test_replacements_of_seqpar_s_classes_or_names_are_not_taken_for_wrappers():
    """A RowParallelLinear without the config's bias, and an MLP of the user's whose expert lists reuse
    seqpar's attribute names, were refused as "wrapped or reparametrized (PEFT)"."""
    from seqpar.nn import ColumnParallelLinear, RowParallelLinear

    class Experts(nn.Module):
        def __init__(self):
            super().__init__()
            self.dense_h_to_4h = nn.ModuleList(ColumnParallelLinear(H, 2 * H) for _ in range(2))
            self.dense_4h_to_h = nn.ModuleList(RowParallelLinear(2 * H, H, skip_bias_add=True) for _ in range(2))

        def forward(self, a2):
            outs = [fc2(torch.relu(fc1(a2))) for fc1, fc2 in zip(self.dense_h_to_4h, self.dense_4h_to_h)]
            return sum(out for out, _ in outs) / 2, None

    seqpar.manual_seed(0)
    layer = TransformerLayer(_cfg())
    layer.self_attention.dense = RowParallelLinear(H, H, bias=False, skip_bias_add=True)
    layer.mlp = Experts()
    full = layer.full_state_dict()
    assert "self_attention.dense.bias" not in full and full["mlp.dense_h_to_4h.1.weight"].shape == (2 * H, H)
    assert layer.load_full_state_dict(full) == ([], [])
    assert layer(torch.randn(4, 2, H)).shape == (4, 2, H)


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


class ScaledLayer(TransformerLayer):
    """A learned scalar kept in fp32 beside bf16 parts, initialised by an overridden reset_parameters."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.scale = nn.Parameter(torch.empty((), device=kwargs.get("device")))
        self.reset_parameters()

    def reset_parameters(self):
        super().reset_parameters()
        with torch.no_grad():
            self.scale.fill_(0.5)

    def forward(self, x):
        return x + (self.scale * (super().forward(x) - x).float()).to(x.dtype)


def test_a_scalar_parameter_a_subclass_dtype_and_its_reset_override():
    """A 0-dim parameter failed the load (narrow() of a 0-dim tensor) after part of the model had loaded;
    an fp32 parameter of the subclass (first in parameters()) became the dtype bf16 inputs were refused
    against; the documented reset_parameters override failed at construction (the base __init__ called
    it before the subclass made its parameter)."""
    cfg = _cfg(params_dtype=torch.bfloat16)
    seqpar.manual_seed(0)
    model = seqpar.GPTModel(cfg, num_layers=2, vocab_size=50, max_seq_len=8)
    model.layers[1] = ScaledLayer(cfg, layer_number=1)
    assert model.layers[1].scale.item() == 0.5
    with torch.no_grad():
        model.layers[1].scale.fill_(0.25)
    tokens = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(1))
    loss = model(tokens, tokens)
    full = model.full_state_dict()
    assert full["layers.1.scale"].shape == () and full["layers.1.scale"].item() == 0.25
    model.reset_parameters()
    assert model.layers[1].scale.item() == 0.5
    model.load_full_state_dict(full)
    assert model.layers[1].scale.item() == 0.25
    torch.testing.assert_close(model(tokens, tokens), loss, rtol=0, atol=0)


def test_the_documented_reset_override_builds_on_meta():
    """A subclass following reset_parameters' recipe (override calling the base first, called at the end of
    its __init__) could not be built on meta: the base raised for the subclass's meta parameter. Now it
    builds, and to_empty + reset_parameters() gives the eager build."""
    cfg = _cfg()
    seqpar.manual_seed(0)
    eager = ScaledLayer(cfg, layer_number=1)
    for build in (lambda: ScaledLayer(cfg, layer_number=1, device="meta"), lambda: _on_meta(ScaledLayer, cfg)):
        layer = build()
        assert all(p.is_meta for p in layer.parameters())
        layer.to_empty(device="cpu")
        seqpar.manual_seed(0)
        layer.reset_parameters()
        for (name, p), q in zip(layer.named_parameters(), eager.parameters()):
            assert torch.equal(p, q), name


def _on_meta(cls, cfg):
    with torch.device("meta"):
        return cls(cfg, layer_number=1)


def test_a_part_split_into_seqpar_linears_or_checkpoint_wrapped_is_not_a_wrapper():
    """An unfused QKV of three ColumnParallelLinears in the fused one's place, and checkpoint_wrapper around
    a norm, were refused as "wrapped or reparametrized (PEFT)"; a partly materialised model's
    reset_parameters, which would fill nothing of its meta parameters, raises as the loads do (on a model
    all on meta it does nothing, as torch's inits: tests/nn/test_init.py)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from seqpar.nn import ColumnParallelLinear

    class SplitQKV(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v = (ColumnParallelLinear(H, H) for _ in range(3))

        def forward(self, x):
            return torch.cat([self.q(x), self.k(x), self.v(x)], dim=-1)

    seqpar.manual_seed(0)
    layer = TransformerLayer(_cfg())
    layer.self_attention.query_key_value = SplitQKV()
    layer.post_attention_layernorm = checkpoint_wrapper(layer.post_attention_layernorm)
    full = layer.full_state_dict()
    assert "self_attention.query_key_value.q.weight" in full and "post_attention_layernorm.weight" in full
    layer.reset_parameters()
    assert layer.load_full_state_dict(full) == ([], [])
    with torch.device("meta"):
        meta = seqpar.GPTModel(_cfg(), num_layers=1, vocab_size=50, max_seq_len=8)
    meta.reset_parameters()
    meta.layers[0].to_empty(device="cpu")
    with pytest.raises(ValueError, match="GPTModel.reset_parameters: parameter .* is on the meta device"):
        meta.reset_parameters()
