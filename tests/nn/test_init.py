"""Initialisation of the modules used on their own: the tensor-parallel linears draw their unsharded
weight (not torch.empty's leftovers), and the deferred-init recipe (meta device, to_empty,
reset_parameters) rebuilds exactly what building on a real device draws."""
import dataclasses

import numpy as np
import pytest
import torch

import seqpar
from seqpar.memory import ActivationMeter
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


def _config(arch: str) -> seqpar.TransformerConfig:
    kw = dict(hidden_size=32, num_attention_heads=4, backend="torch")
    if arch == "llama":
        kw.update(normalization="rmsnorm", activation="swiglu", position_embedding="rope", add_bias_linear=False,
                  num_query_groups=2)
    return seqpar.TransformerConfig(**kw)


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_meta_then_to_empty_then_reset_parameters_is_the_eager_build(arch):
    cfg = _config(arch)
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


@pytest.mark.parametrize("default_dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_the_init_does_not_depend_on_torch_s_default_dtype(arch, default_dtype):
    """The unsharded tables are drawn in fp32 whatever torch's default dtype: under float64 the draws were
    another stream (every weight differed, by up to 0.1), under bfloat16 the fp32 weights came out rounded
    to bf16."""
    cfg = _config(arch)
    seqpar.manual_seed(4)
    want = seqpar.GPTModel(cfg, 2, 50, 16).state_dict()
    previous = torch.get_default_dtype()
    torch.set_default_dtype(default_dtype)
    try:
        seqpar.manual_seed(4)
        got = seqpar.GPTModel(cfg, 2, 50, 16).state_dict()
    finally:
        torch.set_default_dtype(previous)
    assert got.keys() == want.keys()
    for name, tensor in got.items():
        assert tensor.dtype == want[name].dtype and torch.equal(tensor, want[name]), name


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


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_a_model_on_meta_runs_its_forward_for_shapes_and_memory(arch):
    """A GPTModel built on meta (the deferred-init build, metered before it is materialised) runs forward
    on meta ids, as a layer on meta does: its vocabulary check read the ids' values on the host
    ("Tensor.item() cannot be called on meta tensors") from model(tokens), the loss, embed and head."""
    seqpar.manual_seed(0)
    model = seqpar.GPTModel(_config(arch), 2, 50, 16, device="meta")
    tokens = torch.zeros(2, 8, dtype=torch.long, device="meta")
    with ActivationMeter() as meter:
        logits = model(tokens)
    assert logits.is_meta and logits.shape == (8, 2, 50) and meter.bytes > 0
    loss = model(tokens, tokens)
    assert loss.is_meta and loss.shape == (8, 2)
    hidden = model.embed(tokens)
    assert hidden.is_meta and model.head(hidden, tokens).shape == (8, 2)


def test_rng_state_and_rope_under_a_meta_default_device():
    """Under a default device (torch.set_default_device / a torch.device context; here meta, as a stand-in
    for "cuda"): seqpar.random.get_rng_state and fork_rng built their seed bytes there and failed to join
    torch's CPU state; RoPE computed its frequencies there, so a CPU Llama layer's first forward inside the
    context failed ("Cannot copy out of meta tensor") unless an earlier forward had cached them."""
    from seqpar.ops import rotary

    seqpar.manual_seed(3)
    layer = seqpar.TransformerLayer(_config("llama"))
    x = torch.randn(8, 2, 32)
    out = layer(x)
    want = seqpar.random.get_rng_state()
    rotary._inv_freq_on.cache_clear()
    with torch.device("meta"):
        state = seqpar.random.get_rng_state()
        with seqpar.random.fork_rng():
            seqpar.manual_seed(5)
        assert rotary.rope_inv_freq(8, 1e4).device.type == "cpu"
        torch.testing.assert_close(layer(x), out, rtol=0, atol=0)
    assert state.device.type == "cpu" and torch.equal(state, want)
    assert torch.equal(seqpar.random.get_rng_state(), want)


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


def test_a_padded_state_dict_given_as_the_full_one_is_named():
    """At t = 1 state_dict() and full_state_dict() differ only in the padded vocabulary rows, so a one-GPU
    run's state_dict() reaches load_full_state_dict when moving to t = 2: its error gave the two shapes and
    not what the extra rows are or what to pass instead."""
    seqpar.manual_seed(0)
    model = seqpar.GPTModel(_config("gpt"), 1, 301, 16)
    with pytest.raises(ValueError, match=r"embedding.word_embeddings.weight must have shape \(301, 32\) for this "
                                         r"config, got \(384, 32\): 384 rows look like a state_dict\(\) of this "
                                         r"vocabulary padded for t = 1 .*full_state_dict\(\)"):
        model.load_full_state_dict(model.state_dict())
    sd = model.full_state_dict()   # one rank's shard of a t = 2 run's table (512 rows over 2 ranks)
    sd["embedding.word_embeddings.weight"] = torch.zeros(256, 32)
    with pytest.raises(ValueError, match=r"got \(256, 32\): 256 rows look like .* padded for t = 2"):
        model.load_full_state_dict(sd)
    for wrong in ((301, 64), (300, 32), (384, 16)):   # another hidden size or vocabulary: no padding hint
        sd = model.full_state_dict()
        sd["embedding.word_embeddings.weight"] = torch.zeros(wrong)
        with pytest.raises(ValueError, match=r"must have shape \(301, 32\) for this config, got .*\d\)$"):
            model.load_full_state_dict(sd)
    sd = model.state_dict()
    sd["embedding.word_embeddings.weight"] = sd["embedding.word_embeddings.weight"][:301]
    assert model.load_full_state_dict(sd) == ([], [])


@pytest.mark.parametrize("change", ["weight_norm", "wrapper"])
def test_unsharded_state_dicts_refuse_a_wrapped_or_reparametrized_part(change):
    """weight_norm (or any parametrization) moves a linear's weight under ``parametrizations``, and an
    adapter library (PEFT) wraps the linear: full_state_dict silently left the weight out, and
    load_full_state_dict copied into a computed tensor (the load was lost) or blamed the shape."""
    seqpar.manual_seed(0)
    model = seqpar.GPTModel(seqpar.TransformerConfig(hidden_size=16, num_attention_heads=2), 1, 20, 8)
    full = model.full_state_dict()
    layer = model.layers[0]
    if change == "weight_norm":
        torch.nn.utils.parametrizations.weight_norm(layer.mlp.dense_h_to_4h)
    else:
        class Wrapper(torch.nn.Module):
            def __init__(self, base):
                super().__init__()
                self.base_layer = base

            def forward(self, x):
                return self.base_layer(x)
        layer.mlp.dense_h_to_4h = Wrapper(layer.mlp.dense_h_to_4h)
    match = r"layers.0.mlp.dense_h_to_4h.weight is not a parameter of layers.0.mlp.dense_h_to_4h \(.*\) itself"
    with pytest.raises(ValueError, match=r"GPTModel.full_state_dict: " + match):
        model.full_state_dict()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    zeros = {k: torch.zeros_like(v) for k, v in full.items()}
    with pytest.raises(ValueError, match=r"GPTModel.load_full_state_dict: " + match):
        model.load_full_state_dict(zeros)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())      # nothing loaded
    with pytest.raises(ValueError, match=r"TransformerLayer\(layer_number=0\).full_state_dict: mlp.dense_h_to_4h.weight "
                                         r"is not a parameter of mlp.dense_h_to_4h"):
        layer.full_state_dict()


def test_repr_shows_each_layer_s_policy_and_the_vocabulary_shard():
    """Layers with different recompute policies printed identically; the vocabulary shard printed nothing."""
    model = seqpar.GPTModel(seqpar.TransformerConfig(hidden_size=16, num_attention_heads=2), 2, 20, 8,
                            recompute=["none", "full"])
    text = repr(model)
    assert "layer_number=0, recompute='none', tp=1, sequence_parallel=False" in text
    assert "layer_number=1, recompute='full', tp=1" in text
    assert "VocabParallelEmbedding(vocab_size=20, padded_vocab_size=128, hidden_size=16, tp=1, rows=[0, 20))" in text


def test_building_a_model_draws_nothing_from_torch_s_generator():
    """The learned position table was a default nn.Embedding, whose init drew from torch's CPU generator
    (then overwritten): every later dropout seed moved with max_seq_len or with another model built after
    the first, and a model built on meta (to_empty + reset_parameters) trained with other masks than one
    built directly (losses 5.4174 vs 5.4284, the same weights)."""
    cfg = seqpar.TransformerConfig(hidden_size=16, num_attention_heads=2, hidden_dropout=0.1, attention_dropout=0.1)
    tokens = torch.randint(0, 20, (2, 9), generator=torch.Generator().manual_seed(1))

    def loss(build_on_meta: bool) -> torch.Tensor:
        seqpar.manual_seed(0)
        state = torch.get_rng_state()
        model = seqpar.GPTModel(cfg, 1, 20, 16, device="meta" if build_on_meta else None)
        assert torch.equal(torch.get_rng_state(), state)
        if build_on_meta:
            model.to_empty(device="cpu")
            model.reset_parameters()
        return model(tokens[:, :-1], tokens[:, 1:]).mean()

    assert torch.equal(loss(build_on_meta=False), loss(build_on_meta=True))


@pytest.mark.parametrize("block", ["ParallelAttention", "ParallelMLP"])
def test_blocks_built_on_their_own_are_initialised_like_the_linears(block):
    """seqpar.nn.ParallelAttention / ParallelMLP on their own: N(0, 0.02) weights and zero biases from
    torch's CPU generator, as the linears (their weights were torch.empty: NaN outputs). Inside a
    TransformerLayer they still draw nothing from it (the layer's own init from the seqpar seed)."""
    cfg = seqpar.TransformerConfig(hidden_size=64, num_attention_heads=4)
    torch.manual_seed(0)
    module = getattr(seqpar.nn, block)(cfg, None)
    for name, p in module.named_parameters():
        if name.endswith("bias"):
            assert torch.equal(p, torch.zeros_like(p)), name
        else:
            assert torch.isfinite(p).all() and abs(p.std().item() - 0.02) < 0.002, (name, p.std().item())
    state = torch.get_rng_state()
    seqpar.TransformerLayer(cfg)
    assert torch.equal(torch.get_rng_state(), state)


def _owners_of_parameters(model: torch.nn.Module):
    """The modules holding parameters of their own: those FSDP1's deferred init calls reset_parameters on."""
    return [m for m in model.modules() if list(m.parameters(recurse=False))]


@pytest.mark.parametrize("order", ["top-down", "bottom-up"])
@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_each_module_s_own_reset_parameters_gives_the_model_s_init(arch, order):
    """FSDP1's deferred init (module on meta, ``to_empty``, then ``reset_parameters()`` on every module
    owning parameters, not on the layer or the model): the layers' linears had ``init_method=None`` and
    kept to_empty's garbage (std 6e33 through real FSDP1), the vocabulary tables had no
    reset_parameters (AttributeError), and the position table, an nn.Embedding, drew N(0, 1) from torch's
    generator. Each module now draws its own part of the model's seeded init."""
    cfg = _config(arch)
    seqpar.manual_seed(5)
    eager = seqpar.GPTModel(cfg, 2, 50, 16, share_embeddings_and_output_weights=arch == "gpt")
    seqpar.manual_seed(5)
    deferred = seqpar.GPTModel(cfg, 2, 50, 16, share_embeddings_and_output_weights=arch == "gpt",
                               device="meta").to_empty(device="cpu")
    owners = _owners_of_parameters(deferred)
    assert {type(m).__name__ for m in owners} >= {"ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding"}
    state = torch.get_rng_state()
    for module in owners if order == "top-down" else owners[::-1]:
        module.reset_parameters()
    assert torch.equal(torch.get_rng_state(), state)                    # torch's generator untouched
    want = dict(eager.named_parameters())
    for name, p in deferred.named_parameters():
        assert torch.equal(p, want[name]), name
    # and the layer's own reset draws what its linears' draw
    layer = deferred.layers[1]
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    layer.mlp.dense_h_to_4h.weight.data.fill_(float("nan"))
    layer.reset_parameters()
    assert all(torch.equal(v, before[k]) for k, v in layer.state_dict().items())


def test_a_linear_without_init_method_keeps_its_weights_through_the_layer_s_reset():
    """A linear whose init_method is set to None keeps its weight and bias in its own reset and in the
    layer's (the layer's zeroed its bias)."""
    seqpar.manual_seed(1)
    layer = seqpar.TransformerLayer(seqpar.TransformerConfig(hidden_size=32, num_attention_heads=4))
    fc1 = layer.mlp.dense_h_to_4h
    fc1.init_method = None
    with torch.no_grad():
        fc1.weight.fill_(0.5)
        fc1.bias.fill_(0.25)
        layer.self_attention.dense.bias.fill_(3.0)
    layer.reset_parameters()
    assert (fc1.weight == 0.5).all() and (fc1.bias == 0.25).all()
    assert (layer.self_attention.dense.bias == 0).all()                  # the others reset as ever


def test_models_build_and_reset_under_a_default_device():
    """SeededNormal drew on torch's default device: building a layer or model with device="cpu" under
    ``with torch.device("meta")`` (as under a default CUDA device), resetting one there, or converting an
    HF model there raised "Cannot copy out of meta tensor"."""
    cfg = seqpar.TransformerConfig(hidden_size=32, num_attention_heads=4, backend="torch")
    seqpar.manual_seed(6)
    want = seqpar.GPTModel(cfg, 1, 50, 16).state_dict()
    seqpar.manual_seed(6)
    with torch.device("meta"):
        model = seqpar.GPTModel(cfg, 1, 50, 16, device="cpu")
        got = {k: v.clone() for k, v in model.state_dict().items()}
        model.reset_parameters()
        model.layers[0].reset_parameters()
        model.layers[0].mlp.dense_h_to_4h.reset_parameters()
    for key, value in want.items():
        assert torch.equal(got[key], value) and torch.equal(model.state_dict()[key], value), key


def test_reset_parameters_rounds_into_the_parameters_dtype_not_params_dtype():
    """A layer built in bf16 and converted with .float() re-initialised with bf16-rounded values (its reset
    cast to config.params_dtype); it now draws in fp32 as a layer built in fp32 does."""
    seqpar.manual_seed(2)
    fp32 = seqpar.TransformerLayer(seqpar.TransformerConfig(hidden_size=32, num_attention_heads=4))
    seqpar.manual_seed(2)
    converted = seqpar.TransformerLayer(seqpar.TransformerConfig(hidden_size=32, num_attention_heads=4,
                                                                 params_dtype=torch.bfloat16)).float()
    converted.reset_parameters()
    for name, p in converted.named_parameters():
        assert p.dtype == torch.float32 and torch.equal(p, dict(fp32.named_parameters())[name]), name


@pytest.mark.parametrize("cls", [ColumnParallelLinear, RowParallelLinear], ids=lambda c: c.__name__)
def test_parallel_linear_draws_on_the_cpu_under_a_default_device(cls):
    """reset_parameters made its unsharded weight and bias on torch's default device: under
    ``with torch.device("meta")`` the init method got a meta tensor and the load raised "Cannot copy out
    of meta tensor"; the docstring says the CPU."""
    devices = []

    def init(full):
        devices.append(full.device)
        full.fill_(0.5)

    with torch.device("meta"):
        linear = cls(16, 24, device="cpu", init_method=init)
        linear.reset_parameters()
    assert devices == [torch.device("cpu")] * 2
    assert torch.equal(linear.weight, torch.full_like(linear.weight, 0.5))
    assert torch.equal(linear.bias, torch.zeros(24))


class _CountingScale(torch.nn.Module):
    """A parametrization counting its evaluations (weight_norm and spectral_norm compute at each read)."""
    calls = 0

    def forward(self, weight):
        type(self).calls += 1
        return 2.0 * weight


@pytest.mark.parametrize("sequence_parallel", [False, True])
@pytest.mark.parametrize("cls", [ColumnParallelLinear, RowParallelLinear], ids=lambda c: c.__name__)
def test_parametrized_parallel_linear_computes_its_weight_once_and_refuses_unsharded_io(cls, sequence_parallel):
    """A parametrized weight was computed 3-4 times per forward (the input checks and the SP plan read
    ``self.weight`` too; spectral_norm ran as many power iterations), and ``load_full`` copied into the
    computed tensor (the load silently lost) while ``full()`` raised a bare KeyError."""
    from torch.nn.utils import parametrize

    torch.manual_seed(0)
    linear = cls(16, 8, sequence_parallel=sequence_parallel)
    plain = torch.nn.Linear(16, 8)
    with torch.no_grad():
        plain.weight.copy_(2.0 * linear.weight)
        plain.bias.copy_(linear.bias)
    parametrize.register_parametrization(linear, "weight", _CountingScale())
    x = torch.randn(4, 2, 16)
    _CountingScale.calls = 0
    y = linear(x)
    assert _CountingScale.calls == 1
    torch.testing.assert_close(y, plain(x))
    before = linear.parametrizations.weight.original.clone()
    with pytest.raises(ValueError, match=rf"{cls.__name__}: loading unsharded parameters: weight is not a "
                                         r"parameter of .* itself.*remove_parametrizations"):
        linear.load_full(torch.ones(8, 16), torch.zeros(8))
    assert torch.equal(linear.parametrizations.weight.original, before)
    with pytest.raises(ValueError, match=rf"{cls.__name__}.full: weight is not a parameter"):
        linear.full()


def _std(state, key):
    return float(state[key].float().std())


def test_output_projections_start_scaled_by_depth_as_megatron_and_gpt2():
    """GPTModel's attention projection and fc2 start at init_method_std / sqrt(2 L) (Megatron's scaled
    output init, GPT-2's c_proj init), the other matrices and the tables at init_method_std; a layer on
    its own (no L) at init_method_std; both knobs set by the config."""
    seqpar.manual_seed(0)
    config = seqpar.TransformerConfig(hidden_size=64, num_attention_heads=4)
    state = seqpar.GPTModel(config, 8, 500, 64).full_state_dict()
    for key, want in (("layers.3.self_attention.dense.weight", 0.005), ("layers.3.mlp.dense_4h_to_h.weight", 0.005),
                      ("layers.3.self_attention.query_key_value.weight", 0.02),
                      ("layers.3.mlp.dense_h_to_4h.weight", 0.02), ("embedding.word_embeddings.weight", 0.02),
                      ("embedding.position_embeddings.weight", 0.02)):
        assert abs(_std(state, key) / want - 1) < 0.05, (key, _std(state, key))
    layer = seqpar.TransformerLayer(config).full_state_dict()
    assert abs(_std(layer, "self_attention.dense.weight") / 0.02 - 1) < 0.05
    chosen = dataclasses.replace(config, init_method_std=0.01, output_layer_init_std=0.003)
    model = seqpar.GPTModel(chosen, 2, 500, 64, share_embeddings_and_output_weights=False)
    state = model.full_state_dict()
    for key, want in (("layers.1.mlp.dense_4h_to_h.weight", 0.003), ("layers.1.mlp.dense_h_to_4h.weight", 0.01),
                      ("output_layer.weight", 0.01), ("embedding.word_embeddings.weight", 0.01)):
        assert abs(_std(state, key) / want - 1) < 0.05, (key, _std(state, key))
    assert model.config == chosen and model.layers[1].config.output_layer_init_std == 0.003
    assert dataclasses.replace(config, init_method_std=np.float32(0.5)).init_method_std == 0.5   # numpy reals too
    dense = model.layers[1].mlp.dense_4h_to_h
    dense.reset_parameters()   # a module's own reset (FSDP1's deferred init) draws the same values
    assert torch.equal(model.full_state_dict()["layers.1.mlp.dense_4h_to_h.weight"],
                       state["layers.1.mlp.dense_4h_to_h.weight"])
    for bad in ({"init_method_std": 0.0}, {"init_method_std": None}, {"output_layer_init_std": float("inf")},
                {"output_layer_init_std": -1.0}):
        with pytest.raises(ValueError, match=f"{next(iter(bad))} must be a positive finite float"):
            dataclasses.replace(config, **bad)
