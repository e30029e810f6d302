"""GPTModel(recompute=...): per-layer policies, validated."""
import pytest

import seqpar


def _cfg(**kw):
    return seqpar.TransformerConfig(hidden_size=16, num_attention_heads=2, backend="torch", **kw)


def test_per_layer_policies_reach_the_layers():
    model = seqpar.GPTModel(_cfg(recompute="selective"), 3, 32, 8, recompute=("full", "none", "selective"))
    assert [layer.config.recompute for layer in model.layers] == ["full", "none", "selective"]
    assert model.config.recompute == "selective"              # the model's config is left as given
    assert [l.config.recompute for l in seqpar.GPTModel(_cfg(recompute="selective"), 2, 32, 8).layers] == \
        ["selective"] * 2                                      # None: config.recompute for every layer
    assert [l.config.recompute for l in seqpar.GPTModel(_cfg(), 2, 32, 8, recompute="full").layers] == ["full"] * 2


@pytest.mark.parametrize("recompute, match", [
    ("partial", "partial"), (["none", "full"], "2 per-layer policies for 3 layers"),
    (["none", "full", "some"], r"recompute\[2\] 'some'"), ([None] * 3, r"recompute\[0\] None"),
    (3, "got 3"), ({"none": 3}, "got {'none': 3}"),
], ids=["unknown", "short", "bad-item", "none-item", "int", "dict"])
def test_bad_recompute_raises_naming_it(recompute, match):
    with pytest.raises(ValueError, match=match):
        seqpar.GPTModel(_cfg(), 3, 32, 8, recompute=recompute)
