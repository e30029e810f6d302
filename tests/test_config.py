"""TransformerConfig validation (frozen, every field checked once) and the seed state behind
seqpar.manual_seed (bounded to 64 bits, one per process, seeds torch's CPU generator)."""
import dataclasses
import math
import threading

import numpy as np
import pytest
import torch

import seqpar

BASE = dict(hidden_size=48, num_attention_heads=4)


@pytest.mark.parametrize("kwargs, match", [
    (dict(layernorm_epsilon=float("inf")), "layernorm_epsilon"),
    (dict(layernorm_epsilon=float("nan")), "layernorm_epsilon"),
    (dict(layernorm_epsilon=True), "layernorm_epsilon"),
    (dict(layernorm_epsilon=0.0), "layernorm_epsilon"),
    (dict(layernorm_epsilon=1e-320), "layernorm_epsilon must be a finite float >= 1.175e-38"),
    (dict(layernorm_epsilon=2**2000), "layernorm_epsilon must be a finite float"),
    (dict(hidden_size=True, num_attention_heads=1), "hidden_size"),
    (dict(num_attention_heads=True), "num_attention_heads"),
    (dict(ffn_hidden_size=True), "ffn_hidden_size"),
    (dict(ffn_hidden_size=96.0), "ffn_hidden_size"),
    (dict(hidden_dropout=True), "hidden_dropout"),
    (dict(attention_dropout=False), "attention_dropout"),
    (dict(hidden_dropout=float("nan")), "hidden_dropout"),
    (dict(sequence_parallel=1), "sequence_parallel"),
    (dict(params_dtype=torch.int32), r"params_dtype must be one of torch.float32, torch.float16, torch.bfloat16, "
                                     r"torch.float64, got torch.int32"),
    (dict(params_dtype="bf16"), "params_dtype"),
], ids=["eps-inf", "eps-nan", "eps-bool", "eps-zero", "eps-0-in-fp32", "eps-huge-int", "hidden-bool", "heads-bool", "ffn-bool", "ffn-float",
        "hidden-dropout-bool", "attention-dropout-bool", "dropout-nan", "sp-int", "int32", "dtype-str"])
def test_config_rejects(kwargs, match):
    with pytest.raises(ValueError, match=match):
        seqpar.TransformerConfig(**{**BASE, **kwargs})


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_config_accepts_supported_dtypes(dtype):
    assert seqpar.TransformerConfig(**BASE, params_dtype=dtype).params_dtype is dtype


def test_config_is_frozen_and_replace_revalidates():
    cfg = seqpar.TransformerConfig(**BASE)
    assert cfg.ffn_hidden_size == 4 * 48
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.hidden_dropout = 1.5
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.layernorm_epsilon = float("inf")
    assert cfg.hidden_dropout == 0.0
    assert dataclasses.replace(cfg, hidden_dropout=0.25).hidden_dropout == 0.25
    with pytest.raises(ValueError, match="hidden_dropout"):
        dataclasses.replace(cfg, hidden_dropout=1.5)


def test_equal_configs_give_the_ranks_the_same_values_to_agree_on():
    """The ranks' agreement check hashes each field's repr: 10000 vs 10000.0 as rope_theta, 0 vs 0.0 or
    np.float64(0.1) vs 0.1 as a dropout, num_query_groups None vs num_attention_heads (the same layer; so
    kv_channels None vs hidden_size / num_attention_heads) were refused as a disagreement. Floats are held as
    floats, and the check compares the k/v heads and the head dim."""
    from seqpar.nn.layer import agreement_values
    from seqpar.parallel.state import _digest

    base = dict(hidden_size=32, num_attention_heads=4, position_embedding="rope")
    pairs = [(dict(rope_theta=10000), dict(rope_theta=10000.0)),
             (dict(hidden_dropout=0, layernorm_epsilon=1), dict(hidden_dropout=0.0, layernorm_epsilon=1.0)),
             (dict(attention_dropout=np.float64(0.1)), dict(attention_dropout=0.1)),
             (dict(num_query_groups=None), dict(num_query_groups=4)),
             (dict(kv_channels=None), dict(kv_channels=8))]
    for one, other in pairs:
        a, b = seqpar.TransformerConfig(**base, **one), seqpar.TransformerConfig(**base, **other)
        values_a, values_b = agreement_values(a), agreement_values(b)
        assert {k: _digest(v) for k, v in values_a.items()} == {k: _digest(v) for k, v in values_b.items()}, one
    cfg = seqpar.TransformerConfig(**base, hidden_dropout=0, attention_dropout=np.float64(0.1))
    assert [type(getattr(cfg, name)) for name in ("hidden_dropout", "attention_dropout", "layernorm_epsilon",
                                                   "rope_theta")] == [float] * 4
    assert seqpar.TransformerConfig(**base, num_query_groups=2).num_query_groups == 2   # kept as given


@pytest.mark.parametrize("bad", [-1, 2**64, 2**70, 1.5, "3", True, None], ids=repr)
def test_manual_seed_rejects(bad):
    with pytest.raises(ValueError, match=r"seed must be an int in \[0, 2\*\*64\)"):
        seqpar.manual_seed(bad)


@pytest.mark.parametrize("seed", [0, 1, 2**63, 2**64 - 1], ids=lambda s: f"seed{s:x}")
def test_manual_seed_accepts_64_bits_and_seeds_torch_cpu_generator(seed):
    seqpar.manual_seed(seed)
    assert seqpar.random.initial_seed() == seed
    first = torch.rand(4)
    torch.default_generator.manual_seed(seed)
    assert torch.equal(torch.rand(4), first)  # documented side effect: torch's CPU generator is seeded too


def test_seed_state_is_process_wide():
    """A model built and run in a worker thread uses the seed the main thread set."""
    cfg = seqpar.TransformerConfig(**BASE, hidden_dropout=0.2, attention_dropout=0.2)
    x = torch.randn(8, 2, 48)

    def build_and_run(out):
        layer = seqpar.TransformerLayer(cfg)
        out.append((layer.full_state_dict()["mlp.dense_h_to_4h.weight"], layer(x)))

    results = []
    for in_thread in (False, True):
        seqpar.manual_seed(1234)
        out = []
        if in_thread:
            worker = threading.Thread(target=build_and_run, args=(out,))
            worker.start()
            worker.join()
        else:
            build_and_run(out)
        results.append(out[0])
    (w_main, y_main), (w_thread, y_thread) = results
    assert torch.equal(w_main, w_thread)
    assert torch.equal(y_main, y_thread)
    # and a seed set in a thread is the process's seed afterwards
    worker = threading.Thread(target=seqpar.manual_seed, args=(77,))
    worker.start()
    worker.join()
    assert seqpar.random.initial_seed() == 77


# ------------------------------------------------------------------------------- architecture knobs (Llama)
LLAMA = dict(hidden_size=64, num_attention_heads=8, num_query_groups=2, normalization="rmsnorm", activation="swiglu",
             position_embedding="rope", rope_theta=500000.0, add_bias_linear=False)


def test_architecture_defaults_are_the_gpt_layer():
    cfg = seqpar.TransformerConfig(**BASE)
    assert (cfg.normalization, cfg.activation, cfg.num_query_groups, cfg.kv_heads, cfg.position_embedding,
            cfg.rope_theta, cfg.add_bias_linear) == ("layernorm", "gelu", None, 4, "learned", 10000.0, True)
    llama = seqpar.TransformerConfig(**LLAMA)
    assert llama.kv_heads == 2 and llama.head_dim == 8 and not llama.add_qkv_bias and not llama.qkv_bias
    assert seqpar.TransformerConfig(**LLAMA, add_qkv_bias=True).qkv_bias and cfg.qkv_bias
    assert llama.attention_softmax_scale is None and \
        seqpar.TransformerConfig(**LLAMA, rope_scaling=seqpar.ops.RopeScaling()).attention_softmax_scale is None
    yarn = seqpar.TransformerConfig(**LLAMA, rope_scaling=seqpar.ops.YarnScaling(4.0, 32768))   # Qwen2.5's
    assert yarn.attention_softmax_scale == (0.1 * math.log(4.0) + 1) ** 2 / math.sqrt(8)
    assert (llama.kv_channels, llama.qk_layernorm) == (None, False)
    # Qwen3-4B's heads: 32 of 128 channels with h = 2560 (any h then, even one the heads don't divide)
    qwen3 = seqpar.TransformerConfig(**{**LLAMA, "hidden_size": 2560, "num_attention_heads": 32, "num_query_groups": 8},
                                     kv_channels=128, qk_layernorm=True)
    assert qwen3.head_dim == 128 and qwen3.qk_layernorm
    assert seqpar.TransformerConfig(**{**LLAMA, "hidden_size": 60}, kv_channels=8).head_dim == 8
    assert seqpar.TransformerConfig(**LLAMA, kv_channels=np.int64(16)).kv_channels == 16


@pytest.mark.parametrize("kwargs, match", [
    (dict(normalization="batchnorm"), "unknown normalization 'batchnorm'"),
    (dict(normalization=None), "unknown normalization None"),
    (dict(activation="relu"), "unknown activation 'relu'"),
    (dict(num_query_groups=3), "num_query_groups 3 does not divide num_attention_heads 8"),
    (dict(num_query_groups=0), "num_query_groups must be None or a positive int, got 0"),
    (dict(num_query_groups=True), "num_query_groups must be None or a positive int, got True"),
    (dict(num_query_groups=2.0), "num_query_groups must be None or a positive int, got 2.0"),
    (dict(position_embedding="alibi"), "unknown position_embedding 'alibi'"),
    (dict(rope_theta=0.0), "rope_theta must be a finite positive float, got 0.0"),
    (dict(rope_theta=float("inf")), "rope_theta must be a finite positive float"),
    (dict(rope_theta=True), "rope_theta must be a finite positive float, got True"),
    (dict(rope_theta=1e39), r"rope_theta must be within fp32's range .* got 1e\+39"),
    (dict(add_bias_linear=0), "add_bias_linear must be a bool, got 0"),
    (dict(add_qkv_bias=1), "add_qkv_bias must be a bool, got 1"),
    (dict(hidden_size=72, num_attention_heads=24, num_query_groups=None),
     r"position_embedding='rope' needs an even head dim, got hidden_size 72 / num_attention_heads 24 = 3"),
    (dict(position_embedding="learned"), r"rope_theta=500000.0 with position_embedding='learned'"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}), "rope_scaling must be a seqpar.ops.LinearScaling, RopeScaling, YarnScaling or None"),
    (dict(rope_theta=1.0, rope_scaling=seqpar.ops.YarnScaling(4.0, 64)), "YaRN's scaling needs a rope_theta other than 1"),
    (dict(position_embedding="learned", rope_theta=10000.0, rope_scaling=seqpar.ops.RopeScaling()),
     r"rope_scaling=RopeScaling\(factor=8.0, .*\) with position_embedding='learned'"),
    (dict(kv_channels=0), "kv_channels must be None or a positive int, got 0"),
    (dict(kv_channels=16.0), "kv_channels must be None or a positive int, got 16.0"),
    (dict(kv_channels=True), "kv_channels must be None or a positive int, got True"),
    (dict(kv_channels=7), r"position_embedding='rope' needs an even head dim, got kv_channels = 7"),
    (dict(hidden_size=60), r"hidden_size 60 is not divisible by num_attention_heads 8 \(set kv_channels"),
    (dict(qk_layernorm=1), "qk_layernorm must be a bool, got 1"),
], ids=["norm", "norm-none", "activation", "groups-divide", "groups-zero", "groups-bool", "groups-float", "position",
        "theta-zero", "theta-inf", "theta-bool", "theta-past-fp32", "bias-int", "qkv-bias-int", "rope-odd-head-dim",
        "theta-with-learned", "scaling-dict", "yarn-theta-1", "scaling-with-learned", "kv-channels-zero",
        "kv-channels-float", "kv-channels-bool", "kv-channels-odd-with-rope", "hidden-not-divisible", "qk-norm-int"])
def test_architecture_knobs_reject(kwargs, match):
    with pytest.raises(ValueError, match=match):
        seqpar.TransformerConfig(**{**LLAMA, **kwargs})


@pytest.mark.parametrize("t, match", [(4, None), (2, None), (8, "num_query_groups 4 is not divisible by the tensor-parallel size 8"),
                                      (3, "num_attention_heads 8 is not divisible")])
def test_tensor_parallel_must_divide_query_groups(t, match):
    cfg = seqpar.TransformerConfig(**{**LLAMA, "num_query_groups": 4, "ffn_hidden_size": 24})
    if match is None:
        cfg.check_tensor_parallel(t)
    else:
        with pytest.raises(ValueError, match=match):
            cfg.check_tensor_parallel(t)
    with pytest.raises(ValueError, match="num_query_groups 2 is not divisible by the tensor-parallel size 4"):
        dataclasses.replace(cfg, num_query_groups=2).check_tensor_parallel(4)


def test_a_function_in_a_config_subclass_field_agrees_across_processes():
    """The agreement digest hashed repr(value), and a function's repr holds its address (every process has
    its own): a config subclass carrying an activation function was refused at t = 2 as "ranks disagree"
    when every rank passed the same one. Addresses are left out; the names still count."""
    import subprocess
    import sys

    from seqpar.parallel.state import _digest

    code = ("import numpy, seqpar.parallel.state as s; print(s._digest(numpy.asarray), s._digest(numpy.argmax), "
            "s._digest(object()))")
    digests = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
               for _ in range(2)]
    assert digests[0] == digests[1] and len(set(digests[0])) == 3
    assert _digest(np.asarray) == int(digests[0][0])

    class Act:   # an object with the default repr: its attributes tell instances apart
        def __init__(self, slope):
            self.slope = slope
    assert _digest(Act(0.1)) == _digest(Act(0.1)) != _digest(Act(0.2))
    assert _digest("f at 0x1") != _digest("f at 0x2")     # strings as they are


def test_numpy_integers_are_taken_as_ints():
    """np.int64 sizes (a sweep over a numpy array) and seeds were refused as "must be a positive int";
    the config holds them as Python ints, so its repr, equality and the ranks' digests are the same."""
    cfg = seqpar.TransformerConfig(hidden_size=np.int64(64), num_attention_heads=np.int32(4),
                                   ffn_hidden_size=np.int64(128), num_query_groups=np.int16(2))
    assert cfg == seqpar.TransformerConfig(hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
                                           num_query_groups=2)
    assert [type(getattr(cfg, name)) for name in ("hidden_size", "num_attention_heads", "ffn_hidden_size",
                                                   "num_query_groups")] == [int] * 4
    seqpar.manual_seed(np.uint64(2**64 - 1))
    assert seqpar.random.initial_seed() == 2**64 - 1
    model = seqpar.GPTModel(cfg, num_layers=np.int64(1), vocab_size=np.int32(20), max_seq_len=np.int64(8),
                            padding_idx=np.int64(0))
    assert [type(v) for v in (model.vocab_size, model.max_seq_len, model.layers[0].layer_number)] == [int] * 3
    assert seqpar.TransformerLayer(cfg, layer_number=np.int64(3)).layer_number == 3
    with pytest.raises(ValueError, match="hidden_size must be a positive int"):
        seqpar.TransformerConfig(hidden_size=np.float64(64), num_attention_heads=4)
