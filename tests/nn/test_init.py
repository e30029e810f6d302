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
