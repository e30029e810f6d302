"""The Llama-family block on one device (TransformerConfig's architecture knobs): the layer and GPTModel
against an independent fp64 plain-torch oracle (RMSNorm, grouped-query attention, RoPE, SwiGLU, no
biases, and mixes with the GPT pieces), recompute policies, dropout with RMSNorm, state-dict layouts,
the measured activation bytes term by term against seqpar.memory.layer_activation_terms, and the
flash-style (triton) core's memory."""
import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

import seqpar
from seqpar.memory import ActivationMeter, architecture_kwargs, layer_activation_terms, model_activation_bytes
from seqpar.nn.linear import ColumnParallelLinear

H, A, F_FFN = 64, 8, 40       # d = 8; ffn 40: not a power of two
LLAMA = dict(normalization="rmsnorm", activation="swiglu", position_embedding="rope", add_bias_linear=False)
BLOCKS = {  # id: architecture knobs
    "llama-gqa": dict(LLAMA, num_query_groups=2, rope_theta=500.0),
    "llama-mha": dict(LLAMA),
    "qwen2-qkv-bias": dict(LLAMA, num_query_groups=2, add_qkv_bias=True, rope_theta=1e6),
    "layernorm-swiglu-rope-bias-gqa4": dict(activation="swiglu", position_embedding="rope", num_query_groups=4),
    "rmsnorm-gelu-learned-bias-gqa1": dict(normalization="rmsnorm", activation="gelu_tanh", num_query_groups=1),
    # Qwen3's block: per-head q / k RMSNorm, heads of 12 channels: the attention is 96 wide, h 64
    "qwen3-qk-norm-kv-channels": dict(LLAMA, num_query_groups=2, kv_channels=12, qk_layernorm=True, rope_theta=1e6),
    # (with RoPE: without it a k-norm bias shifts every key alike, which softmax ignores: a zero gradient)
    "layernorm-qk-norm-kv-channels-bias-rope": dict(position_embedding="rope", kv_channels=4, qk_layernorm=True),
}

def _cfg(block, **kw):
    return seqpar.TransformerConfig(hidden_size=H, num_attention_heads=A, ffn_hidden_size=F_FFN,
                                    layernorm_epsilon=1e-6, **{**BLOCKS[block], **kw})


# ------------------------------------------------------------------------------- the independent oracle
def rope(x, theta):
    """HF Llama's rotate-half RoPE of x [s, b, heads, d] at positions 0 .. s-1, in x's dtype (fp64 here)."""
    s, d = x.shape[0], x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=x.dtype) / d)
    angle = torch.arange(s, dtype=x.dtype)[:, None] * inv_freq[None, :]
    cos, sin = (torch.cat([f(angle)] * 2, dim=-1)[:, None, None, :] for f in (torch.cos, torch.sin))
    rotated = torch.cat([-x[..., d // 2:], x[..., :d // 2]], dim=-1)
    return x * cos + rotated * sin


def plain_norm(x, sd, prefix, cfg):
    if cfg.normalization == "rmsnorm":
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.layernorm_epsilon) * sd[prefix + ".weight"]
    return F.layer_norm(x, (x.shape[-1],), sd[prefix + ".weight"], sd[prefix + ".bias"], cfg.layernorm_epsilon)


def plain_linear(x, sd, prefix):
    y = x @ sd[prefix + ".weight"].t()
    return y + sd[prefix + ".bias"] if prefix + ".bias" in sd else y


def plain_block(x, sd, cfg):
    """One layer written directly with torch ops (no dropout) from the unsharded state dict."""
    s, b, h = x.shape
    a, g, d = cfg.num_attention_heads, cfg.kv_heads, cfg.head_dim
    qkv = plain_linear(plain_norm(x, sd, "input_layernorm", cfg), sd, "self_attention.query_key_value")
    q, k, v = (t.reshape(s, b, -1, d) for t in qkv.split([a * d, g * d, g * d], dim=-1))
    if cfg.qk_layernorm:
        q = plain_norm(q, sd, "self_attention.q_layernorm", cfg)
        k = plain_norm(k, sd, "self_attention.k_layernorm", cfg)
    if cfg.position_embedding == "rope":
        q, k = rope(q, cfg.rope_theta), rope(k, cfg.rope_theta)
    q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    k, v = k.repeat_interleave(a // g, dim=1), v.repeat_interleave(a // g, dim=1)   # query head i: group i // (a/g)
    scores = (q @ k.transpose(-1, -2) / math.sqrt(d)).masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1),
                                                                  float("-inf"))
    o = (scores.softmax(-1) @ v).permute(2, 0, 1, 3).reshape(s, b, a * d)
    x2 = x + plain_linear(o, sd, "self_attention.dense")
    hidden = plain_linear(plain_norm(x2, sd, "post_attention_layernorm", cfg), sd, "mlp.dense_h_to_4h")
    if cfg.activation == "swiglu":
        gate, up = hidden.chunk(2, dim=-1)                       # rows of dense_h_to_4h: gate, then up
        hidden = F.silu(gate) * up
    else:
        hidden = F.gelu(hidden, approximate="tanh" if cfg.activation == "gelu_tanh" else "none")
    return x2 + plain_linear(hidden, sd, "mlp.dense_4h_to_h")


def assert_close_to_scale(got, reference, name, rel=1e-5):
    """fp32 vs the fp64 oracle: the largest error within ``rel`` of the reference's largest magnitude
    (gradients reach hundreds here; an element-wise rtol would test the rounding of near-zero ones)."""
    error = (got.double() - reference).abs().max().item()
    scale = reference.abs().max().item()
    assert error <= rel * scale + 1e-6, f"{name}: max error {error:.3e} vs scale {scale:.3e}"


def random_state_dict(shapes, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return {k: torch.randn(shape, generator=gen, dtype=torch.float64) * (0.3 if len(shape) == 2 else 0.1)
            + (1.0 if k.endswith("layernorm.weight") else 0.0) for k, shape in shapes.items()}


# ------------------------------------------------------------------------------- layer math
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
@pytest.mark.parametrize("block", list(BLOCKS))
def test_layer_matches_plain_torch(block, recompute):
    cfg = _cfg(block, recompute=recompute)
    layer = seqpar.TransformerLayer(cfg)
    sd = random_state_dict(layer.full_shapes())
    layer.load_full_state_dict({k: v.float() for k, v in sd.items()})
    x = torch.randn(13, 3, H, requires_grad=True)
    y = layer(x)
    grad_y = torch.randn_like(y)
    y.backward(grad_y)
    x64 = x.detach().double().requires_grad_()
    sd64 = {k: v.clone().requires_grad_() for k, v in sd.items()}
    y64 = plain_block(x64, sd64, cfg)
    y64.backward(grad_y.double())
    assert_close_to_scale(y, y64, "y")
    assert_close_to_scale(x.grad, x64.grad, "x.grad")
    grads = dict(layer.named_parameters())
    assert set(grads) == set(sd64)
    for key, ref in sd64.items():
        assert_close_to_scale(grads[key].grad, ref.grad, key)


def test_state_dict_layouts_of_the_llama_block():
    """No bias keys without biases, no norm bias with RMSNorm; QKV rows (a + 2g) d, SwiGLU fc1 rows 2f."""
    layer = seqpar.TransformerLayer(_cfg("llama-gqa"))
    assert layer.full_shapes() == {
        "input_layernorm.weight": (H,), "self_attention.query_key_value.weight": ((A + 2 * 2) * 8, H),
        "self_attention.dense.weight": (H, H), "post_attention_layernorm.weight": (H,),
        "mlp.dense_h_to_4h.weight": (2 * F_FFN, H), "mlp.dense_4h_to_h.weight": (H, F_FFN)}
    sd = layer.full_state_dict()
    assert {k: tuple(v.shape) for k, v in sd.items()} == layer.full_shapes()
    assert all(p.bias is None for p in (layer.input_layernorm, layer.post_attention_layernorm))
    bad = dict(sd, **{"mlp.dense_h_to_4h.bias": torch.zeros(2 * F_FFN)})
    with pytest.raises(ValueError, match=r"unexpected \['mlp.dense_h_to_4h.bias'\]"):
        layer.load_full_state_dict(bad)
    qwen2 = seqpar.TransformerLayer(_cfg("qwen2-qkv-bias"))      # add_qkv_bias: the QKV bias alone
    assert qwen2.full_shapes() == {**layer.full_shapes(), "self_attention.query_key_value.bias": ((A + 2 * 2) * 8,)}
    assert [k for k in qwen2.full_shapes() if k.endswith(".bias")] == ["self_attention.query_key_value.bias"]
    qwen3 = seqpar.TransformerLayer(_cfg("qwen3-qk-norm-kv-channels"))   # d = 12: the attention 96 wide, h 64
    assert qwen3.full_shapes() == {
        "input_layernorm.weight": (H,), "self_attention.query_key_value.weight": ((A + 2 * 2) * 12, H),
        "self_attention.dense.weight": (H, A * 12), "self_attention.q_layernorm.weight": (12,),
        "self_attention.k_layernorm.weight": (12,), "post_attention_layernorm.weight": (H,),
        "mlp.dense_h_to_4h.weight": (2 * F_FFN, H), "mlp.dense_4h_to_h.weight": (H, F_FFN)}
    mixed = seqpar.TransformerLayer(_cfg("layernorm-swiglu-rope-bias-gqa4"))
    assert mixed.full_shapes()["self_attention.query_key_value.bias"] == ((A + 2 * 4) * 8,)
    assert mixed.full_shapes()["input_layernorm.bias"] == (H,)


def test_dropout_with_rmsnorm_is_seeded_and_replayed_by_every_recompute_policy():
    """RMSNorm with biases and hidden / attention dropout: the unfused bias-dropout-add path."""
    x = torch.randn(16, 2, H)
    results = {}
    for recompute in ("none", "selective", "full"):
        seqpar.manual_seed(0)
        layer = seqpar.TransformerLayer(_cfg("rmsnorm-gelu-learned-bias-gqa1", recompute=recompute,
                                             hidden_dropout=0.2, attention_dropout=0.3))
        seqpar.manual_seed(3)
        xr = x.clone().requires_grad_()
        y = layer(xr)
        y.backward(torch.linspace(-1, 1, y.numel()).view_as(y))
        results[recompute] = (y.detach(), xr.grad, [p.grad for p in layer.parameters()])
    for recompute in ("selective", "full"):
        assert torch.equal(results[recompute][0], results["none"][0]), recompute
        assert torch.equal(results[recompute][1], results["none"][1]), recompute
        assert all(torch.equal(a, b) for a, b in zip(results[recompute][2], results["none"][2])), recompute
    layer.eval()
    with torch.no_grad():
        assert not torch.allclose(layer(x), results["none"][0])     # dropout was on in training


def test_column_parallel_block_sizes():
    layer = ColumnParallelLinear(8, 12, partition_blocks=(8, 2, 2), bias=False)
    assert layer.partition_blocks == (8, 2, 2) and layer.bias is None
    assert ColumnParallelLinear(8, 12, partition_blocks=3).partition_blocks == (4, 4, 4)
    for blocks, match in (((8, 2, 3), r"summing to out_features 12, got \(8, 2, 3\)"), ((12, 0), "summing"),
                          ((6, True, 5), "summing"), (5, "partition_blocks 5 must be a positive int dividing"),
                          ("qkv", "partition_blocks must be an int or a sequence")):
        with pytest.raises(ValueError, match=match):
            ColumnParallelLinear(8, 12, partition_blocks=blocks)


# ------------------------------------------------------------------------------- memory, term by term
def _measure(cfg, s, b):
    layer = seqpar.TransformerLayer(cfg)
    x = torch.randn(s, b, cfg.hidden_size, dtype=cfg.params_dtype, requires_grad=True)
    with ActivationMeter() as meter:
        y = layer(x)
    y.float().sum().backward()   # the graph the meter saw is usable
    return meter


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
@pytest.mark.parametrize("block", ["llama-gqa", "llama-mha", "rmsnorm-gelu-learned-bias-gqa1",
                                   "qwen3-qk-norm-kv-channels"])
def test_memory_terms_match_the_meter_label_by_label(block, recompute):
    s, b = 64, 2
    dropout = 0.1 if block.startswith("rmsnorm-gelu") else 0.0
    cfg = _cfg(block, recompute=recompute, hidden_dropout=dropout, attention_dropout=dropout,
               params_dtype=torch.bfloat16, backend="torch")
    meter = _measure(cfg, s, b)
    terms = layer_activation_terms(s, b, H, A, recompute=recompute, bytes_per_mask=0, **architecture_kwargs(cfg))
    expected = {label: n for label, n in terms.items() if n}     # seqpar regenerates masks: 0 bytes, no record
    assert meter.by_label() == expected, meter.report(s * b * H * 2)


@pytest.mark.parametrize("recompute", ["none", "selective"])
def test_flash_core_memory_is_o_and_lse(recompute):
    """backend="triton" (the interpreter on CPU): the flash-style core keeps o (the projection input's
    storage) and the fp32 LSE, nothing s^2-sized, and selective recompute changes nothing; the numbers
    are the torch backend's."""
    pytest.importorskip("triton")
    if not torch.cuda.is_available() and not seqpar._ext.triton_interpreter_enabled():
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    s, b, h, a = 48, 2, 64, 2
    cfg = seqpar.TransformerConfig(hidden_size=h, num_attention_heads=a, ffn_hidden_size=72, recompute=recompute,
                                   params_dtype=torch.bfloat16, backend="triton", **LLAMA)
    layer = seqpar.TransformerLayer(cfg, device=device)
    x = torch.randn(s, b, h, dtype=torch.bfloat16, device=device, requires_grad=True)
    with ActivationMeter() as meter:
        y = layer(x)
    terms = layer_activation_terms(s, b, h, a, recompute=recompute, **architecture_kwargs(cfg), flash_attention=True)
    assert meter.by_label() == terms, meter.report(s * b * h * 2)
    y.float().sum().backward()
    reference = seqpar.TransformerLayer(dataclasses.replace(cfg, backend="torch"), device=device)
    reference.load_full_state_dict(layer.full_state_dict())
    x_ref = x.detach().clone().requires_grad_()
    y_ref = reference(x_ref)
    y_ref.float().sum().backward()
    torch.testing.assert_close(y.float(), y_ref.float(), atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(x.grad.float(), x_ref.grad.float(), atol=5e-2, rtol=5e-2)


# ------------------------------------------------------------------------------- GPTModel with the Llama block
def plain_model(tokens, sd, cfg, num_layers, tied):
    hidden = sd["embedding.word_embeddings.weight"][tokens].transpose(0, 1)                # [s, b, h]
    if "embedding.position_embeddings.weight" in sd:
        hidden = hidden + sd["embedding.position_embeddings.weight"][:tokens.shape[1], None]
    for i in range(num_layers):
        hidden = plain_block(hidden, {k[len(f"layers.{i}."):]: v for k, v in sd.items()
                                      if k.startswith(f"layers.{i}.")}, cfg)
    hidden = plain_norm(hidden, sd, "final_layernorm", cfg)
    return hidden @ sd["embedding.word_embeddings.weight" if tied else "output_layer.weight"].t()


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_llama_gpt_model_matches_plain_torch(tied):
    cfg = _cfg("llama-gqa")
    vocab, layers = 300, 2
    model = seqpar.GPTModel(cfg, layers, vocab, max_seq_len=32, share_embeddings_and_output_weights=tied)
    shapes = model.full_shapes()
    assert "embedding.position_embeddings.weight" not in shapes and "final_layernorm.bias" not in shapes
    assert ("output_layer.weight" in shapes) == (not tied)
    if not tied:
        assert shapes["output_layer.weight"] == (vocab, H) and model.output_layer.weight.shape == (384, H)
    sd = random_state_dict(shapes, seed=4)
    model.load_full_state_dict({k: v.float() for k, v in sd.items()})
    assert all(torch.equal(v, sd[k].float()) for k, v in model.full_state_dict().items())
    tokens = torch.randint(0, vocab, (2, 11), generator=torch.Generator().manual_seed(1))
    labels = tokens.roll(-1, 1)
    labels[:, -1] = -100
    loss = model(tokens, labels)
    loss.sum().backward()
    sd64 = {k: v.clone().requires_grad_() for k, v in sd.items()}
    logits64 = plain_model(tokens, sd64, cfg, layers, tied)
    loss64 = F.cross_entropy(logits64.reshape(-1, vocab), labels.t().reshape(-1), reduction="none").view(11, 2)
    loss64.sum().backward()
    assert_close_to_scale(loss, loss64, "loss")
    grads = dict(model.named_parameters())
    for key, ref in sd64.items():
        grad = grads[key].grad
        assert_close_to_scale(grad[:vocab] if key.startswith(("embedding", "output")) else grad, ref.grad, key)
    head = "embedding.word_embeddings.weight" if tied else "output_layer.weight"
    assert torch.count_nonzero(grads[head].grad[vocab:]) == 0          # padded rows: no gradient


def test_llama_gpt_model_memory_within_the_formula():
    """The whole Llama model's measured bytes (t = 1) vs model_activation_bytes with the block's keywords."""
    s, b, vocab, layers = 32, 2, 256, 3
    for recompute in ("none", "selective", "full"):
        cfg = _cfg("llama-mha", recompute=recompute, backend="torch")
        model = seqpar.GPTModel(cfg, layers, vocab, max_seq_len=s, share_embeddings_and_output_weights=False)
        tokens = torch.randint(0, vocab, (b, s), generator=torch.Generator().manual_seed(2))
        with ActivationMeter() as meter:
            loss = model(tokens, tokens.roll(-1, 1))
        loss.sum().backward()
        expected = model_activation_bytes(s, b, H, A, layers, vocab, recompute=recompute, bytes_per_element=4,
                                          **architecture_kwargs(cfg))
        assert 0.95 * expected <= meter.bytes <= 1.05 * expected, (recompute, meter.bytes, expected, meter.report())
