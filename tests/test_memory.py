"""seqpar.memory: the paper's Table 2 and whole-model formulas and the ActivationMeter's accounting."""
import contextlib
import gc
import weakref

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

import seqpar

from seqpar.memory import (ActivationMeter, architecture_kwargs, layer_activation_bytes, layer_activation_terms,
                           model_activation_bytes, saved_as)

S, B, H, A = 2048, 4, 6144, 64  # 22B model layer (the paper's Table 3)


@pytest.mark.parametrize("t", [1, 2, 8])
def test_table2_rows(t):
    sbh, x = S * B * H, 5 * A * S / H
    assert layer_activation_bytes(S, B, H, A) == pytest.approx(sbh * (34 + x))
    assert layer_activation_bytes(S, B, H, A, tp=t) == pytest.approx(sbh * (10 + 24 / t + x / t))
    assert layer_activation_bytes(S, B, H, A, tp=t, sequence_parallel=True) == pytest.approx(sbh / t * (34 + x))
    assert layer_activation_bytes(S, B, H, A, tp=t, recompute="selective") == pytest.approx(sbh * (10 + 24 / t))
    assert layer_activation_bytes(S, B, H, A, tp=t, sequence_parallel=True, recompute="selective") == \
        pytest.approx(34 * sbh / t)
    assert layer_activation_bytes(S, B, H, A, tp=t, recompute="full") == pytest.approx(2 * sbh)
    assert layer_activation_bytes(S, B, H, A, tp=t, sequence_parallel=True, recompute="full") == \
        pytest.approx(2 * sbh / t)


def test_generalised_elements_and_ffn():
    # Section 4.1: attention block 5E sbh + M sbh + (2E + M) as^2b, MLP (2f/h + 1) E sbh + M sbh, LNs 2E sbh.
    s, b, h, a, f, e, m = 128, 2, 64, 4, 96, 4, 0.5
    sbh, as2b = s * b * h, a * s * s * b
    direct = (5 * e + m) * sbh + (2 * e + m) * as2b + ((2 * f / h + 1) * e + m) * sbh + 2 * e * sbh
    assert layer_activation_bytes(s, b, h, a, ffn_hidden=f, bytes_per_element=e, bytes_per_mask=m) == \
        pytest.approx(direct)
    # f = 4h reduces to the paper's 16 sbh E + 2 sbh M + 2 as^2b E + as^2b M
    assert layer_activation_bytes(s, b, h, a, bytes_per_element=e, bytes_per_mask=m) == \
        pytest.approx(16 * sbh * e + 2 * sbh * m + 2 * as2b * e + as2b * m)


def test_paper_selective_saving():
    # 5as/h = 80 for GPT-3 (a=96, h=12288, s=2048): selective drops 80/(34+80) = 70% of the memory.
    full = layer_activation_bytes(2048, 1, 12288, 96)
    sel = layer_activation_bytes(2048, 1, 12288, 96, recompute="selective")
    assert 1 - sel / full == pytest.approx(0.70, abs=0.01)


@pytest.mark.parametrize("kwargs, match", [
    (dict(seq_len=0), "seq_len"), (dict(tp=1.5), "tp"), (dict(recompute="some"), "recompute")])
def test_formula_rejects(kwargs, match):
    args = dict(seq_len=8, micro_batch=1, hidden=8, heads=2)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        layer_activation_bytes(**args)


def test_meter_counts_storages_once_and_skips_parameters():
    w = torch.nn.Parameter(torch.randn(16, 16))
    x = torch.randn(8, 16, requires_grad=True)
    with ActivationMeter() as meter:
        with saved_as("matmul input"):
            y = x @ w            # saves x (64 floats) and w (a parameter: excluded)
        z = (y * y[:, :8].repeat(1, 2)).sum()  # saves y and a repeat copy
    assert meter.by_label()["matmul input"] == x.numel() * 4
    assert meter.bytes == (8 * 16 + 8 * 16 + 8 * 16) * 4
    z.backward()
    x_ref = x.detach().requires_grad_()
    y_ref = x_ref @ w.detach()
    (y_ref * y_ref[:, :8].repeat(1, 2)).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad)  # the hooks do not change what backward computes


def test_saved_as_labels_as_a_decorator_too_deciding_at_each_call():
    """saved_as is a context manager and a decorator (as when it was a generator context manager); the
    decorated function labels its saved tensors when a meter is active at the call, and nests."""
    w = torch.nn.Parameter(torch.randn(4, 4))

    @saved_as("outer")
    def f(x):
        with saved_as("inner"):
            y = x @ w
        return (y * y).sum()

    x = torch.randn(2, 4, requires_grad=True)
    f(x).backward()                           # no meter: nothing labelled, nothing fails
    with ActivationMeter() as meter:
        f(x)
    assert meter.by_label() == {"inner": x.numel() * 4, "outer": x.numel() * 4}


# ------------------------------------------------------------------------------- layer_activation_bytes input
@pytest.mark.parametrize("kwargs, match", [
    (dict(seq_len=True), "seq_len.*True"), (dict(heads=False), "heads.*False"), (dict(tp=True), "tp.*True"),
    (dict(sequence_parallel=1), "sequence_parallel.*1"), (dict(bytes_per_element=-2), "bytes_per_element.*-2"),
    (dict(bytes_per_element=0), "bytes_per_element.*0"), (dict(bytes_per_mask=-1), "bytes_per_mask.*-1"),
    (dict(bytes_per_mask=True), "bytes_per_mask.*True"), (dict(bytes_per_element=float("nan")), "nan"),
    (dict(tp=3), "tp 3 does not divide heads 4"), (dict(ffn_hidden=30, tp=4), "ffn_hidden 30"),
    (dict(ffn_hidden=True), "ffn_hidden.*True"), (dict(hidden=10), "hidden 10"),
    (dict(seq_len=6, tp=4, sequence_parallel=True), "seq_len 6"), (dict(recompute=["none"]), "recompute"),
    # overflow: 10**400 made math.isfinite raise OverflowError; byte counts that overflow are refused (an inf
    # layer made 0 layers x inf a NaN, which max() dropped: the model's bytes came out 0)
    pytest.param(dict(bytes_per_element=10**400), "bytes_per_element must be a positive finite number",
                 id="bytes_per_element=10**400"),
    (dict(bytes_per_mask=1e308), "one layer's activations overflows a float byte count: .*bytes_per_mask=1e\\+308"),
    pytest.param(dict(seq_len=10**200), "one layer's activations overflows a float byte count: seq_len=1000",
                 id="seq_len=10**200"),
], ids=lambda v: str(v) if not isinstance(v, dict) else "-".join(f"{k}={v[k]}" for k in v))
def test_layer_formula_rejects_bad_values_by_name(kwargs, match):
    args = dict(seq_len=8, micro_batch=1, hidden=16, heads=4)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        layer_activation_bytes(**args)


# ------------------------------------------------------------------------------- model_activation_bytes
# The paper's models (s = 2048, v = 51200): heads, hidden, layers, pipeline size, micro-batch.
PAPER_MODELS = {"22B": (64, 6144, 48, 1, 4), "175B": (96, 12288, 96, 8, 1), "530B": (128, 20480, 105, 35, 1),
                "1T": (160, 25600, 128, 64, 1)}


def _table2_row(s, b, h, a, t, sp, recompute):
    """The paper's Table 2 rows, written out (bytes, 2-byte activations, 1-byte masks)."""
    sbh, x = s * b * h, 5 * a * s / h
    if recompute == "full":
        return 2 * sbh / t if sp else 2 * sbh
    if recompute == "selective":
        return 34 * sbh / t if sp else sbh * (10 + 24 / t)
    return sbh / t * (34 + x) if sp else sbh * (10 + 24 / t + x / t)


@pytest.mark.parametrize("name", list(PAPER_MODELS))
@pytest.mark.parametrize("t", [1, 2, 8])
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp-sp"])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
@pytest.mark.parametrize("pp_of", ["table3", "pp1"])
def test_model_bytes_are_table2_rows_times_layers_plus_outside_terms(name, t, sp, recompute, pp_of):
    a, h, L, p, b = PAPER_MODELS[name]
    p = p if pp_of == "table3" else 1
    s, v = 2048, 51200
    sbh = s * b * h
    split = t if sp else 1
    expected = L * _table2_row(s, b, h, a, t, sp, recompute) + sbh * p / split     # + embedding dropout sbhp/t
    if p == 1:                                    # final LN input, output-layer input, fp32 logits
        expected += 2 * sbh / split + 2 * sbh / split + 4 * s * b * v / t
    got = model_activation_bytes(s, b, h, a, L, v, tp=t, pp=p, sequence_parallel=sp, recompute=recompute)
    assert got == pytest.approx(expected, rel=1e-12)
    # a per-layer list of the same policy is the same figure
    assert model_activation_bytes(s, b, h, a, L, v, tp=t, pp=p, sequence_parallel=sp,
                                  recompute=[recompute] * L) == pytest.approx(expected, rel=1e-12)


def test_pipeline_and_interleave_terms_by_hand():
    # s=4, b=1, h=8, a=2, t=2, SP, E=2, M=1: sbh = 32.
    # none: sbh/t (34 + 5as/h) = 16 * (34 + 5) = 624; selective 34 sbh / t = 544; full 2 sbh / t = 32.
    # embedding-dropout mask per micro-batch: sbh / t = 16.
    kw = dict(tp=2, sequence_parallel=True)
    assert layer_activation_bytes(4, 1, 8, 2, recompute="none", **kw) == 624
    # The output side, on the last stage per micro-batch in flight: final LN input and output-layer input
    # (2 sbh / t = 32 each) and the fp32 logits of the busiest vocabulary shard. v = 16 pads to 128 t = 256
    # rows, 128 a rank: rank 0 holds all 16 real columns, 4 sb * 16 = 256 bytes (not 4 sbv / t = 128).
    out = 32 + 32 + 256
    # p = 2, 4 layers, 1F1B: rank 0 holds layers 0-1 for 2 micro-batches and 2 embedding masks (2528); the
    # last rank layers 2-3 for one micro-batch and the output side (2 * 624 + 320 = 1568).
    assert model_activation_bytes(4, 1, 8, 2, 4, 16, pp=2, **kw) == 2 * 2 * 624 + 2 * 16
    # recomputing the first stage's layers leaves the last stage the most loaded ...
    assert model_activation_bytes(4, 1, 8, 2, 4, 16, pp=2, recompute=["full", "selective", "none", "none"],
                                  **kw) == 2 * 624 + out
    # ... until its layers are recomputed too (last: 2 * 32 + 320 = 384; first: 2 * (32 + 544) + 2 * 16)
    assert model_activation_bytes(4, 1, 8, 2, 4, 16, pp=2, recompute=["full", "selective", "full", "full"],
                                  **kw) == 2 * (32 + 544) + 2 * 16
    # p = 2, m = 2 chunks of one layer: rank 0 holds chunks 0 (layer 0) and 1 (layer 2). Schedule: warm-up
    # 2(p-1) + (m-1)p = 4 forwards (c0 mb0, c0 mb1, c1 mb0, c1 mb1), then forward/backward pairs:
    # F c0 mb2 (held: c0 x3, c1 x2), B c1 mb0, F c0 mb3 (c0 x4, c1 x1), B c1 mb1, F c1 mb2 (c0 x4, c1 x1) ...
    # peak 5 chunks = L (1 + (p-1)/(pm)) = 4 * 5/4 layers, with up to 4 chunk-0 micro-batches (embeddings).
    # Rank 1 (layers 1 and 3, the output side with its chunk 1) warms up 2(p-1-1) + (m-1)p = 2 forwards
    # (c0 x2), then F c1 (c0 x2, c1 x1): 2 * 624 + 624 + 320 = 2192 at most, below rank 0's 3184.
    assert model_activation_bytes(4, 1, 8, 2, 4, 16, pp=2, interleave=2, **kw) == 5 * 624 + 4 * 16
    # uneven chunks: layer 0 full, layer 2 none -> rank 0: max(3*32 + 2*624 + 3*16, 4*32 + 1*624 + 4*16) =
    # 1392; rank 1 (all none) is now the most loaded: 2192
    assert model_activation_bytes(4, 1, 8, 2, 4, 16, pp=2, interleave=2, recompute=["full", "none", "none", "none"],
                                  **kw) == 2 * 624 + 624 + out
    assert model_activation_bytes(4, 1, 8, 2, 4, 16, pp=2, interleave=2, recompute=["full", "full", "none", "full"],
                                  **kw) == 3 * 32 + 2 * 624 + 3 * 16
    # p = 1: one micro-batch in flight, plus the output side
    assert model_activation_bytes(4, 1, 8, 2, 4, 16, **kw) == 4 * 624 + 16 + out
    # without SP the embedding mask and the output side are not split: 2 sbh = 64, sbh = 32
    assert model_activation_bytes(4, 1, 8, 2, 4, 16, tp=2, recompute="full") == 4 * 64 + 32 + 64 + 64 + 256
    # a vocabulary filling the shards: v = 512 = 2 x 256, 4 sbv / t = 4096 for each rank
    assert model_activation_bytes(4, 1, 8, 2, 4, 512, **kw) == 4 * 624 + 16 + 32 + 32 + 4096


@pytest.mark.parametrize("p, m", [(2, 2), (3, 2), (4, 3), (8, 4), (35, 3)])
def test_interleaved_schedule_holds_paper_factor(p, m):
    s, b, h, a = 64, 1, 32, 4
    L = p * m * 2
    layer = layer_activation_bytes(s, b, h, a, tp=2, sequence_parallel=True, bytes_per_mask=0)
    got = model_activation_bytes(s, b, h, a, L, 64, tp=2, pp=p, sequence_parallel=True, interleave=m,
                                 bytes_per_mask=0)  # no embedding-dropout mask: layers only
    assert got == pytest.approx(L * (1 + (p - 1) / (p * m)) * layer, rel=1e-12)


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_layers=6, pp=4), "num_layers 6"), (dict(interleave=2), "interleave 2"), (dict(pp=True), "pp.*True"),
    (dict(vocab=0), "vocab.*0"), (dict(recompute=["none"] * 3), "3 per-layer policies for 8 layers"),
    (dict(recompute=["none"] * 7 + ["some"]), r"recompute\[7\].*some"), (dict(recompute=None), "None"),
    (dict(tp=3), "tp 3 does not divide heads 4"), (dict(bytes_per_mask=-1), "-1"),
    (dict(bytes_per_element=1e304), "the model's activations overflows a float byte count"),  # was 0.0
    pytest.param(dict(num_layers=10**25), "num_layers 10000000000000000000000000 is more than 65536",   # an OverflowError building the list
                 id="num_layers=10**25"),
])
def test_model_formula_rejects_bad_values_by_name(kwargs, match):
    args = dict(seq_len=8, micro_batch=1, hidden=16, heads=4, num_layers=8, vocab=32)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        model_activation_bytes(**args)


# ------------------------------------------------------------------------------- ActivationMeter
def test_nested_meters_both_count():
    x = torch.randn(8, 16, requires_grad=True)
    with ActivationMeter() as outer:
        a = x.exp()                       # saves its output (8 x 16 floats)
        with ActivationMeter() as inner:
            b = a.sin()                   # saves a (already counted by the outer meter)
            c = b.tanh()                  # saves c
        d = c.exp()                       # saves d
    assert inner.bytes == 2 * 8 * 16 * 4
    assert outer.bytes == 3 * 8 * 16 * 4, outer.report()
    d.sum().backward()
    torch.testing.assert_close(x.grad, (x.exp().sin().tanh().exp() * (1 - x.exp().sin().tanh() ** 2)
                                        * x.exp().cos() * x.exp()).detach())


def test_saved_view_counts_whole_storage_and_report_says_so():
    full = torch.randn(64, 16, requires_grad=True)
    with ActivationMeter() as meter:
        y = full * 2                      # (a product by a number saves nothing)
        shard = y[16:32]                  # a sequence shard: a view of y's storage
        z = shard.sin()                   # saves its input, the view: y's whole storage stays alive
    assert len(meter.records) == 1 and meter.bytes == 64 * 16 * 4
    record = meter.records[0]
    assert record.bytes == 64 * 16 * 4 and record.view_bytes == 16 * 16 * 4 and record.pins_larger_storage
    assert "pins its whole storage of 4,096 bytes" in meter.report()
    z.sum().backward()


def test_meter_keeps_nothing_alive():
    # The saved output of exp() must die with the graph (no pack-hook reference cycle waiting for gc).
    x = torch.randn(256, requires_grad=True)
    gc.disable()
    try:
        with ActivationMeter():
            y = x.exp()
        ref = weakref.ref(y)
        del y
        assert ref() is None
    finally:
        gc.enable()


def test_meter_counts_a_new_storage_at_a_reused_address():
    # Gradient accumulation inside one meter: each micro-batch's saved output is freed by its backward
    # and the allocator hands the address to the next one, which is a new storage all the same.
    x = torch.randn(256, requires_grad=True)
    addresses = []
    with ActivationMeter() as meter:
        for _ in range(4):
            y = x.exp()                   # saves its output, a new storage of 256 floats
            addresses.append(y.data_ptr())
            y.sum().backward()
            del y
    if len(set(addresses)) == len(addresses):
        pytest.skip("the allocator reused no address: nothing to check")
    assert meter.bytes == 4 * 256 * 4 and len(meter.records) == 4, meter.report()


def test_meter_counts_a_live_storage_saved_by_two_graphs_once():
    x = torch.randn(256, requires_grad=True)
    with ActivationMeter() as meter:
        a = x.exp()                       # saves a
        a.sum().backward()                # frees the first graph; a itself lives on
        b = a.detach().requires_grad_()[:128].sin()   # a new graph saves a view of a's storage
    assert meter.bytes == 256 * 4 and len(meter.records) == 1, meter.report()
    b.sum().backward()


# ------------------------------------------------------------------------------- other blocks (Llama)
LLAMA_KW = dict(normalization="rmsnorm", activation="swiglu", hidden_dropout=False, attention_dropout=False)


@pytest.mark.parametrize("t", [1, 2, 8])
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp-sp"])
def test_llama_block_by_hand(t, sp):
    """Llama 3 8B's layer (h 4096, a 32, g 8, f 14336), 2-byte activations, s 8192, b 1, written out:
    (4 sbh E + 8sb)/R + (2 + 2g/a + 3f/h) sbh E/t + a s^2 b E/t, flash-style 4asb/t instead of the last."""
    s, b, h, a, g, f, e = 8192, 1, 4096, 32, 8, 14336, 2
    sbh, R = s * b * h, t if sp else 1
    kw = dict(tp=t, sequence_parallel=sp, ffn_hidden=f, num_query_groups=g, **LLAMA_KW)
    outside_core = (4 * sbh * e + 8 * s * b) / R + (2 + 2 * g / a + 3 * f / h) * sbh * e / t
    assert layer_activation_bytes(s, b, h, a, **kw) == pytest.approx(outside_core + a * s * s * b * e / t, rel=1e-12)
    assert layer_activation_bytes(s, b, h, a, recompute="selective", **kw) == pytest.approx(outside_core, rel=1e-12)
    for recompute in ("none", "selective"):   # flash-style: the same with or without selective recompute
        assert layer_activation_bytes(s, b, h, a, recompute=recompute, flash_attention=True, **kw) == \
            pytest.approx(outside_core + 4 * a * s * b / t, rel=1e-12)
    assert layer_activation_bytes(s, b, h, a, recompute="full", **kw) == sbh * e / R
    # bytes_per_mask changes nothing without dropout; the terms add up to the figure
    assert layer_activation_bytes(s, b, h, a, bytes_per_mask=0, **kw) == layer_activation_bytes(s, b, h, a, **kw)
    terms = layer_activation_terms(s, b, h, a, **kw)
    assert sum(terms.values()) == pytest.approx(layer_activation_bytes(s, b, h, a, **kw), rel=1e-15)
    assert terms["Q, K, V"] == pytest.approx(sbh * e * 1.5 / t) and terms["SwiGLU input (gate, up)"] == 2 * f * s * b * e / t
    assert "dropout output" not in terms and not any("mask" in label for label in terms)


def test_gpt_block_terms_are_table2():
    s, b, h, a = 128, 2, 64, 4
    terms = layer_activation_terms(s, b, h, a, tp=2, sequence_parallel=True)
    assert sum(terms.values()) == layer_activation_bytes(s, b, h, a, tp=2, sequence_parallel=True)
    assert list(terms) == ["LN1 input", "QKV input", "Q, K, V", "softmax output", "dropout output",
                           "attention dropout mask", "projection input", "attention-out dropout mask", "LN2 input",
                           "fc1 input", "GeLU input", "fc2 input", "MLP-out dropout mask"]
    # dropout given as probabilities: 0 is none, as for GPTModel's defaults
    assert layer_activation_bytes(s, b, h, a, hidden_dropout=0.0, attention_dropout=0.0) == \
        layer_activation_bytes(s, b, h, a) - 2 * s * b * h - a * s * s * b * 3


def test_model_llama_terms():
    s, b, h, a, L, v, t = 64, 2, 32, 4, 4, 100, 2
    kw = dict(tp=t, sequence_parallel=True, **LLAMA_KW)
    layer = layer_activation_bytes(s, b, h, a, **kw)
    sbh = s * b * h
    # no embedding mask (no dropout); final RMSNorm input with its rstd, output-layer input, fp32 logits
    # (v = 100 pads to 256, 128 rows a rank: rank 0 holds all 100 real columns)
    expected = L * layer + (sbh * 2 + 4 * s * b) / t + sbh * 2 / t + 4 * s * b * v
    assert model_activation_bytes(s, b, h, a, L, v, **kw) == pytest.approx(expected, rel=1e-12)
    assert model_activation_bytes(s, b, h, a, L, v, embedding_dropout=0.1, **kw) == \
        pytest.approx(expected + sbh / t, rel=1e-12)
    assert model_activation_bytes(s, b, h, a, L, v, tp=t, sequence_parallel=True, embedding_dropout=0.0) == \
        pytest.approx(model_activation_bytes(s, b, h, a, L, v, tp=t, sequence_parallel=True) - sbh / t, rel=1e-12)


def test_architecture_kwargs_of_a_config():
    import seqpar
    cfg = seqpar.TransformerConfig(hidden_size=64, num_attention_heads=8, num_query_groups=2, ffn_hidden_size=40,
                                   normalization="rmsnorm", activation="swiglu", attention_dropout=0.1)
    assert architecture_kwargs(cfg) == dict(ffn_hidden=40, normalization="rmsnorm", activation="swiglu",
                                            num_query_groups=2, hidden_dropout=0.0, attention_dropout=0.1,
                                            kv_channels=None, qk_layernorm=False)
    qwen3 = seqpar.TransformerConfig(hidden_size=64, num_attention_heads=8, kv_channels=16, qk_layernorm=True)
    assert architecture_kwargs(qwen3)["kv_channels"] == 16 and architecture_kwargs(qwen3)["qk_layernorm"]


@pytest.mark.parametrize("kwargs, match", [
    (dict(normalization="batchnorm"), "unknown normalization 'batchnorm'"),
    (dict(activation="relu"), "unknown activation 'relu'"),
    (dict(num_query_groups=3), "num_query_groups 3 does not divide heads 4"),
    (dict(num_query_groups=2, tp=4), "tp 4 does not divide num_query_groups 2"),
    (dict(num_query_groups=0), "num_query_groups must be a positive int, got 0"),
    (dict(hidden_dropout=1.5), "hidden_dropout must be in \\[0, 1\\)"),
    (dict(attention_dropout="yes"), "attention_dropout must be in"),
    (dict(flash_attention=1), "flash_attention must be a bool, got 1"),
    (dict(kv_channels=0), "kv_channels must be a positive int, got 0"),
    (dict(qk_layernorm="yes"), "qk_layernorm must be a bool, got 'yes'"),
    (dict(hidden=18), "heads 4 does not divide hidden 18"),
], ids=["norm", "activation", "groups", "tp-groups", "groups-zero", "hidden-dropout", "attention-dropout", "flash",
        "kv-channels-zero", "qk-norm-str", "heads-not-dividing-hidden"])
def test_block_keywords_reject_bad_values_by_name(kwargs, match):
    args = dict(seq_len=8, micro_batch=1, hidden=16, heads=4)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        layer_activation_bytes(**args)
    with pytest.raises(ValueError, match=match):
        model_activation_bytes(**args, num_layers=2, vocab=10)


def _metered_layer_forward(recompute, *, autocast=False, trainable=True):
    """(the ActivationMeter, the bytes of the bf16 parameter casts alive after the forward) of one h 32 layer's
    forward."""
    import seqpar
    import seqpar.nn.autocast as layer_autocast

    seqpar.manual_seed(0)
    layer = seqpar.TransformerLayer(seqpar.TransformerConfig(hidden_size=32, num_attention_heads=4,
                                                             recompute=recompute, backend="torch"))
    layer.requires_grad_(trainable)
    x = torch.randn(16, 2, 32, requires_grad=trainable)
    casts = []
    swap = layer_autocast.swapped_parameters

    def spy(module, tensors):   # weak references to the storages of the casts run_in_dtype swaps in (the
        # storages: autograd keeps a saved tensor's storage alive after its Python object is gone)
        casts.extend((StorageWeakRef(t.untyped_storage()), t.untyped_storage().nbytes()) for t in tensors.values())
        return swap(module, tensors)

    layer_autocast.swapped_parameters = spy
    try:
        with ActivationMeter() as meter, torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y = layer(x)
    finally:
        layer_autocast.swapped_parameters = swap
    gc.collect()
    alive = sum(nbytes for ref, nbytes in casts if not ref.expired())
    del y
    return meter, alive


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_parameter_casts_under_autocast_have_their_own_label(recompute):
    """The bf16 copies autocast-style casting keeps for backward were counted under the paper's terms
    ("QKV input" held the [96, 32] QKV weight's copy): they now have their own label, and it holds
    exactly the casts alive after the forward."""
    meter, casts_alive = _metered_layer_forward(recompute, autocast=True)
    by_label = meter.by_label()
    assert casts_alive > 0 and by_label["parameter cast (autocast)"] == casts_alive, by_label


def test_full_recompute_under_autocast_counts_the_parameter_casts_it_keeps():
    """The re-run keeps the forward's bf16 parameter casts (activations: cast per call) until backward;
    the meter counted only the layer input (2048 of 27456 bytes alive)."""
    meter, casts_alive = _metered_layer_forward("full", autocast=True)
    assert casts_alive == 2 * (3 * 32 * 32 + 3 * 32 + 32 * 32 + 32 + 2 * 32 * 128 + 128 + 32 + 4 * 32)
    assert meter.bytes == casts_alive + 16 * 2 * 32 * 2   # plus the bf16 layer input


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_nothing_is_counted_when_nothing_needs_a_gradient(recompute):
    """A frozen layer on an input without grad (grad mode on) keeps nothing for backward; the meter
    counted full recompute's input (4096 bytes) and selective's Q, K, V (12288)."""
    meter, casts_alive = _metered_layer_forward(recompute, trainable=False)
    assert (meter.bytes, casts_alive) == (0, 0)


def test_the_meter_keeps_autograd_s_in_place_check():
    """Saved-tensor hooks turn off autograd's version check: under the meter an in-place change of a saved
    tensor gave a silently wrong gradient (norm 9.63 for 6.47) instead of autograd's error."""
    lin = torch.nn.Linear(4, 4)
    x = torch.randn(3, 4)
    with ActivationMeter():
        y = torch.sigmoid(lin(x))      # sigmoid saves its output
    y.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_the_meter_leaves_an_outer_torch_checkpoint_alone():
    """A selective-recompute layer inside torch's non-reentrant checkpoint (checkpoint_wrapper): with a
    meter open, seqpar's own checkpoint shadowed the outer one's hooks in the forward only, and its
    re-run saw one tensor more (CheckpointError "Recomputed values ... have different metadata")."""
    import seqpar
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    seqpar.manual_seed(0)
    cfg = seqpar.TransformerConfig(hidden_size=32, num_attention_heads=4, recompute="selective", backend="torch")
    layer = checkpoint_wrapper(seqpar.TransformerLayer(cfg))
    x = torch.randn(8, 2, 32, requires_grad=True)
    grads = []
    for metered in (False, True):
        with ActivationMeter() if metered else contextlib.nullcontext():
            y = layer(x)
        grads.append(torch.autograd.grad(y.square().sum(), x)[0])
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=0)


def test_the_meter_counts_sparse_meta_and_fake_tensors():
    """A saved sparse tensor crashed the meter ("Cannot access storage"); on meta or fake tensors every
    storage has data address 0, and all of them collapsed into one record (4096 bytes for 36864)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    def saved_bytes(device, mode=contextlib.nullcontext()):
        with mode:
            w = torch.randn(64, 32, device=device, requires_grad=True)
            x = torch.randn(16, 64, device=device)
            with ActivationMeter() as meter:
                h = torch.tanh(x @ w)                  # saves x (4 KiB) and tanh's output (2 KiB)
                torch.sigmoid(h * 2)                   # saves the sigmoid's output (2 KiB)
        return meter.bytes, len(meter.records)

    assert saved_bytes("cpu") == saved_bytes("meta") == saved_bytes("cpu", FakeTensorMode()) == (8192, 3)
    sparse = torch.randn(8, 8).relu().to_sparse().requires_grad_()
    with ActivationMeter() as meter:
        torch.sparse.mm(sparse, torch.randn(8, 4, requires_grad=True))
    assert meter.bytes > 0


def test_one_label_instance_entered_twice_or_in_two_threads():
    """saved_as kept one token: entered inside itself it left its label set after the block (a later,
    unrelated meter still used it); shared by two threads it raised "created in a different Context"."""
    import threading

    import seqpar.memory as memory

    label = saved_as("blk")
    x = torch.randn(4, 8, requires_grad=True)
    with ActivationMeter() as meter:
        with label:
            with label:
                pass
            x.exp()
        (x * 3).sin()
    assert meter.by_label() == {"blk": 128, "unlabelled": 128} and memory._label.get() == "unlabelled"
    errors = []

    def work():
        try:
            with ActivationMeter():
                for _ in range(200):
                    with label:
                        x.exp()
        except Exception as exc:  # noqa: BLE001 - collected for the assertion
            errors.append(repr(exc))

    threads = [threading.Thread(target=work) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_hooks_entered_inside_the_meter_take_what_it_would_count(recompute):
    """save_on_cpu inside a meter packs every saved tensor itself, so the meter sees none; but the
    recompute regions' inputs (which the layer counts itself) still counted: selective reported 12 KiB of
    Q, K, V and recompute "none" 0 bytes, more for the policy that saves less."""
    import seqpar

    seqpar.manual_seed(0)
    cfg = seqpar.TransformerConfig(hidden_size=32, num_attention_heads=4, recompute=recompute, backend="torch")
    layer = seqpar.TransformerLayer(cfg)
    x = torch.randn(16, 2, 32, requires_grad=True)
    packed = []
    with ActivationMeter() as meter:
        with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
            y = layer(x)
    assert packed and meter.bytes == 0 and meter.records == []
    y.sum().backward()
    with ActivationMeter() as alone:                       # the same forward, the meter innermost
        layer(x)
    assert alone.bytes > 0


def test_a_meter_that_fails_to_enter_leaves_no_state_behind():
    """Entering raises where saved-tensor hooks are disabled (torch.func transforms); the meter was
    already counted active and on the stack, and recorded every later meter's tensors for good."""
    from seqpar import memory

    failed = memory.ActivationMeter()
    with pytest.raises(RuntimeError):
        with torch.autograd.graph.disable_saved_tensors_hooks("disabled here"):
            with failed:
                pass
    assert memory._active_meters == 0 and memory._meter_stack() == []
    x = torch.randn(4, 8, requires_grad=True)
    with memory.ActivationMeter() as later:
        x.exp().sum()
    with failed:   # and it can still be entered
        x.exp().sum()
    assert later.bytes == failed.bytes == x.numel() * 4


def test_a_used_meter_copies_and_pickles_without_freeing_its_weak_references_twice():
    """deepcopy / pickle of a meter that had measured copied its StorageWeakRefs' C++ handles, which each
    copy freed again: a segfault or a heap-corruption abort at gc or exit (5 runs in 6). Run in a child
    process: the failure kills the interpreter."""
    import subprocess
    import sys

    code = """
import copy, gc, pickle, torch, seqpar
from seqpar.memory import ActivationMeter
layer = seqpar.TransformerLayer(seqpar.TransformerConfig(hidden_size=64, num_attention_heads=4))
with ActivationMeter() as meter:
    try:
        copy.deepcopy(meter)
    except TypeError as exc:
        print("active:", exc)
    y = layer(torch.randn(8, 1, 64))
del y
copies = [copy.deepcopy(meter) for _ in range(3)] + [pickle.loads(pickle.dumps(meter)) for _ in range(3)]
shallow = copy.copy(meter)
with shallow:
    layer(torch.randn(8, 1, 64))
assert shallow.bytes == 2 * meter.bytes, (shallow.bytes, meter.bytes)   # the copy's records are its own
print("bytes", meter.bytes, sorted({c.bytes for c in copies}), copies[0].report() == meter.report())
del copies; gc.collect()
with meter:
    layer(torch.randn(8, 1, 64))
del meter; gc.collect()
print("done")
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, (result.returncode, result.stderr[-2000:])
    lines = result.stdout.splitlines()
    assert lines[0].startswith("active: an active ActivationMeter can't be copied"), lines
    _, total, copied, same_report = lines[1].split(" ", 3)
    assert int(total) > 0 and copied == f"[{total}]" and same_report == "True", lines
    assert lines[-1] == "done"


def test_an_fp64_model_s_logits_are_planned_in_fp64():
    """An fp64 GPTModel's loss keeps fp64 logits (8 sbv bytes): the planner counted them as fp32 (4 sbv),
    so the metered forward exceeded its figure with masks (231648 > 1.05 x 218112 bytes here)."""
    S, B, H, A, V = 16, 2, 32, 4, 256
    seqpar.manual_seed(0)
    cfg = seqpar.TransformerConfig(hidden_size=H, num_attention_heads=A, backend="torch", params_dtype=torch.float64)
    model = seqpar.GPTModel(cfg, 1, V, S)
    ids = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(0))
    with ActivationMeter() as meter:
        model(ids, ids)
    sizes = dict(seq_len=S, micro_batch=B, hidden=H, heads=A, num_layers=1, vocab=V, bytes_per_element=8)
    assert meter.by_label()["cross-entropy (fp32 softmax, label ids)"] >= 8 * S * B * V
    assert 0.9 * model_activation_bytes(**sizes, bytes_per_mask=0) <= meter.bytes \
        <= 1.05 * model_activation_bytes(**sizes, bytes_per_mask=1), meter.report()
