"""seqpar.integrations.megatron: Megatron's grouped QKV row order against rows built head by head, and a
Megatron-Core-named GPT state dict (TransformerEngine's fused norm keys included) loaded into a fresh
GPTModel computing what the model it came from computes."""
import numpy as np
import pytest
import torch

import seqpar
from seqpar.integrations.megatron import from_megatron_state_dict, qkv_from_megatron, qkv_to_megatron


def _tagged_qkv(heads, groups, d, h):
    """seqpar's rows [Q_0..Q_{a-1}, K_0..K_{g-1}, V_0..V_{g-1}], each row tagged by its block, and the
    same rows in Megatron's order, built block by block: per group its a/g Q heads, its K, its V."""
    block = {}
    for kind, count in (("q", heads), ("k", groups), ("v", groups)):
        for i in range(count):
            block[kind, i] = torch.randn(d, h) if h else torch.randn(d)
    ours = torch.cat([block["q", i] for i in range(heads)] + [block["k", i] for i in range(groups)]
                     + [block["v", i] for i in range(groups)])
    per = heads // groups
    theirs = torch.cat([part for grp in range(groups) for part in
                        [block["q", grp * per + j] for j in range(per)] + [block["k", grp], block["v", grp]]])
    return ours, theirs


@pytest.mark.parametrize("heads,groups", [(4, None), (8, 2), (6, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("weight", [True, False], ids=["weight", "bias"])
def test_qkv_rows_follow_megatrons_groups(heads, groups, weight):
    ours, theirs = _tagged_qkv(heads, groups or heads, 3, 3 * heads if weight else 0)
    assert torch.equal(qkv_to_megatron(ours, heads, groups), theirs)
    assert torch.equal(qkv_from_megatron(theirs, heads, groups), ours)
    assert torch.equal(ours, theirs) == (groups == 1)   # one k/v group: the two orders coincide


def test_megatron_lms_newer_norm_names_map_to_seqpars():
    state = {"layers.0.input_norm.weight": 1, "layers.0.post_attention_norm.bias": 2, "final_norm.weight": 3,
             "layers.0.input_layernorm.bias": 4}
    assert from_megatron_state_dict(state, 1) == {
        "layers.0.input_layernorm.weight": 1, "layers.0.post_attention_layernorm.bias": 2,
        "final_layernorm.weight": 3, "layers.0.input_layernorm.bias": 4}


def test_bad_qkv_arguments_are_named():
    # a tensor-parallel shard (t = 2 of a = g = 4, d = 8: 48 rows of h = 32) read as d = 4 heads was scrambled
    with pytest.raises(ValueError, match=r"QKV weight \(48, 32\) is not \[\(a \+ 2g\) d, a d\] .* tensor-parallel rank's shard"):
        qkv_from_megatron(torch.zeros(48, 32), 4)
    with pytest.raises(ValueError, match="not \\(a \\+ 2g\\) d rows for a = 4, g = 4"):
        qkv_from_megatron(torch.zeros(25, 8), 4)
    with pytest.raises(ValueError, match="num_query_groups 3 does not divide num_attention_heads 4"):
        qkv_from_megatron(torch.zeros(24, 8), 4, 3)
    with pytest.raises(ValueError, match="num_attention_heads must be a positive int"):
        qkv_to_megatron(torch.zeros(24, 8), 0)
    with pytest.raises(ValueError, match="QKV weight"):
        qkv_to_megatron(torch.zeros(2, 3, 4), 1)
    # numpy head counts, as TransformerConfig takes them
    assert torch.equal(qkv_from_megatron(torch.arange(24.0), np.int64(4), np.int64(2)),
                       qkv_from_megatron(torch.arange(24.0), 4, 2))


def test_a_bad_qkv_tensor_in_a_state_dict_names_its_key_and_the_likely_causes():
    """The error named neither the key nor any cause but a tensor-parallel shard: a grouped-query model
    converted with num_query_groups left None, or another head dim, gave the shard hint."""
    sd = {"decoder.layers.0.self_attention.linear_qkv.weight": torch.zeros(64, 32),   # a = 4, g = 2, d = 8
          "decoder.layers.1.self_attention.linear_qkv.weight": torch.zeros(48, 32)}
    with pytest.raises(ValueError, match=r"^'decoder.layers.0.self_attention.linear_qkv.weight': a QKV tensor of 64 "
                                         r"rows .* check num_query_groups \(None means g = a"):
        from_megatron_state_dict(sd, 4)
    with pytest.raises(ValueError, match=r"^'decoder.layers.1.self_attention.linear_qkv.weight': a QKV weight "
                                         r"\(48, 32\) .*kv_channels.*tensor-parallel rank's shard"):
        from_megatron_state_dict(sd, 4, 2)


def _core_names(state, heads, groups, kv_channels=None):
    """seqpar's GPTModel keys -> Megatron-Core's (TransformerEngine spec: the norms fused into the next
    linear), written out name by name."""
    core = {}
    for key, value in state.items():
        name = key.replace("layers.", "decoder.layers.").replace("final_layernorm", "decoder.final_layernorm")
        name = (name.replace("input_layernorm.", "self_attention.linear_qkv.layer_norm_")
                .replace("post_attention_layernorm.", "mlp.linear_fc1.layer_norm_")
                .replace("query_key_value", "linear_qkv").replace("self_attention.dense", "self_attention.linear_proj")
                .replace("dense_h_to_4h", "linear_fc1").replace("dense_4h_to_h", "linear_fc2"))
        core[name] = qkv_to_megatron(value, heads, groups, kv_channels) if "linear_qkv.weight" in name or \
            "linear_qkv.bias" in name else value
    core["decoder.layers.0.self_attention.linear_qkv._extra_state"] = None
    return core


@pytest.mark.parametrize("groups", [None, 2], ids=["mha", "gqa"])
def test_a_megatron_core_state_dict_loads_into_the_same_model(groups):
    heads = 4
    cfg = seqpar.TransformerConfig(hidden_size=32, num_attention_heads=heads, num_query_groups=groups,
                                   backend="torch")
    seqpar.manual_seed(0)
    source = seqpar.GPTModel(cfg, 2, 40, 8)
    core = _core_names(source.full_state_dict(), heads, groups)
    assert "decoder.layers.1.self_attention.linear_qkv.layer_norm_weight" in core
    seqpar.manual_seed(1)
    target = seqpar.GPTModel(cfg, 2, 40, 8)
    target.load_full_state_dict(from_megatron_state_dict(core, heads, groups))
    tokens = torch.randint(0, 40, (2, 8), generator=torch.Generator().manual_seed(0))
    assert torch.equal(target(tokens), source(tokens))
    unordered = dict(from_megatron_state_dict(core, heads, groups))
    for key in [k for k in unordered if "query_key_value" in k]:
        unordered[key] = core[key.replace("layers.", "decoder.layers.").replace("query_key_value", "linear_qkv")]
    target.load_full_state_dict(unordered)   # loads without an error, as a Megatron checkpoint did ...
    assert not torch.allclose(target(tokens), source(tokens))   # ... and computes another model


def test_heads_of_another_width_and_qk_norms_convert():
    """kv_channels: heads of d = 12 with h = 32 (Qwen3's, Mistral Nemo's: a d != h). The QKV rows follow
    Megatron's groups with the given d (read from the shape, d would be wrong or refused); the q / k norms
    keep their names."""
    heads, groups, d = 4, 2, 12
    ours, theirs = _tagged_qkv(heads, groups, d, 32)
    assert torch.equal(qkv_from_megatron(theirs, heads, groups, kv_channels=d), ours)
    assert torch.equal(qkv_to_megatron(ours, heads, groups, kv_channels=d), theirs)
    with pytest.raises(ValueError, match=r"QKV weight \(96, 32\) is not \[\(a \+ 2g\) d, a d\].*pass kv_channels="):
        qkv_from_megatron(theirs, heads, groups)
    with pytest.raises(ValueError, match=r"96 rows is not \(a \+ 2g\) d = 64 rows for a = 4, g = 2, d = kv_channels = 8"):
        qkv_from_megatron(theirs, heads, groups, kv_channels=8)
    with pytest.raises(ValueError, match="kv_channels must be a positive int, got 0"):
        qkv_from_megatron(theirs, heads, groups, kv_channels=0)
    cfg = seqpar.TransformerConfig(hidden_size=32, num_attention_heads=heads, num_query_groups=groups, kv_channels=d,
                                   qk_layernorm=True, normalization="rmsnorm", activation="swiglu",
                                   position_embedding="rope", add_bias_linear=False, backend="torch")
    seqpar.manual_seed(0)
    source = seqpar.GPTModel(cfg, 2, 40, 8)
    with torch.no_grad():
        source.layers[1].self_attention.k_layernorm.weight.mul_(1.5)   # off its init: its mapping counts
    core = _core_names(source.full_state_dict(), heads, groups, kv_channels=d)
    assert "decoder.layers.1.self_attention.k_layernorm.weight" in core
    seqpar.manual_seed(1)
    target = seqpar.GPTModel(cfg, 2, 40, 8)
    target.load_full_state_dict(from_megatron_state_dict(core, heads, groups, kv_channels=d))
    tokens = torch.randint(0, 40, (2, 8), generator=torch.Generator().manual_seed(0))
    assert torch.equal(target(tokens), source(tokens))


def test_two_keys_for_one_name_are_refused():
    state = {"layers.0.input_layernorm.weight": torch.ones(4),
             "layers.0.self_attention.linear_qkv.layer_norm_weight": torch.ones(4)}
    with pytest.raises(ValueError, match="both map to 'layers.0.input_layernorm.weight'"):
        from_megatron_state_dict(state, 1)
