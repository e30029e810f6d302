"""TransformerLayer on one device: math against an independent plain-torch layer, recompute policies,
dropout determinism, memory bounds, and bad input."""
import copy
import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

import seqpar
from seqpar.memory import ActivationMeter, layer_activation_bytes

H, A = 48, 4


def _cfg(**kw):
    base = dict(hidden_size=H, num_attention_heads=A)
    base.update(kw)
    return seqpar.TransformerConfig(**base)


def plain_layer(x, sd, heads, eps=1e-5, approximate="none"):
    """The paper's layer written directly with torch ops (no dropout): the independent oracle."""
    s, b, h = x.shape
    d = h // heads
    a1 = F.layer_norm(x, (h,), sd["input_layernorm.weight"], sd["input_layernorm.bias"], eps)
    qkv = a1 @ sd["self_attention.query_key_value.weight"].t() + sd["self_attention.query_key_value.bias"]
    q, k, v = (t.reshape(s, b, heads, d).permute(1, 2, 0, 3) for t in qkv.split(h, dim=-1))
    scores = q @ k.transpose(-1, -2) / math.sqrt(d)
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    o = (scores.softmax(-1) @ v).permute(2, 0, 1, 3).reshape(s, b, h)
    x2 = x + o @ sd["self_attention.dense.weight"].t() + sd["self_attention.dense.bias"]
    a2 = F.layer_norm(x2, (h,), sd["post_attention_layernorm.weight"], sd["post_attention_layernorm.bias"], eps)
    m = F.gelu(a2 @ sd["mlp.dense_h_to_4h.weight"].t() + sd["mlp.dense_h_to_4h.bias"], approximate=approximate)
    return x2 + m @ sd["mlp.dense_4h_to_h.weight"].t() + sd["mlp.dense_4h_to_h.bias"]


def random_state_dict(layer, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return {k: torch.randn(shape, generator=gen, dtype=dtype) * (0.3 if len(shape) == 2 else 0.1)
            + (1.0 if k.endswith("layernorm.weight") else 0.0) for k, shape in layer.full_shapes().items()}


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh"])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_layer_matches_plain_torch(recompute, activation):
    layer = seqpar.TransformerLayer(_cfg(recompute=recompute, activation=activation))
    sd = random_state_dict(layer)
    layer.load_full_state_dict({k: v.float() for k, v in sd.items()})
    x = torch.randn(13, 3, H, requires_grad=True)
    y = layer(x)
    grad_y = torch.randn_like(y)
    y.backward(grad_y)
    x64 = x.detach().double().requires_grad_()
    sd64 = {k: v.clone().requires_grad_() for k, v in sd.items()}
    y64 = plain_layer(x64, sd64, A, approximate="tanh" if activation == "gelu_tanh" else "none")
    y64.backward(grad_y.double())
    torch.testing.assert_close(y.double(), y64, atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(x.grad.double(), x64.grad, atol=2e-4, rtol=1e-4)
    grads = dict(layer.named_parameters())
    for key, ref in sd64.items():
        torch.testing.assert_close(grads[key].grad.double(), ref.grad, atol=2e-4, rtol=1e-4, msg=key)


def _run(layer, x, seed=3):
    seqpar.manual_seed(seed)
    x = x.detach().clone().requires_grad_()
    y = layer(x)
    y.backward(torch.ones_like(y) * 0.5 + torch.linspace(0, 1, y.numel()).view_as(y))
    return y.detach(), x.grad, {k: p.grad.clone() for k, p in layer.named_parameters()}


def test_dropout_bitwise_identical_across_recompute_policies():
    x = torch.randn(16, 2, H)
    results = {}
    for recompute in ("none", "selective", "full"):
        seqpar.manual_seed(0)  # same initial weights for every policy
        layer = seqpar.TransformerLayer(_cfg(recompute=recompute, hidden_dropout=0.2, attention_dropout=0.3))
        results[recompute] = _run(layer, x)
    ref = results["none"]
    for recompute in ("selective", "full"):
        y, gx, grads = results[recompute]
        assert torch.equal(y, ref[0]), recompute
        assert torch.equal(gx, ref[1]), recompute
        for key in grads:
            assert torch.equal(grads[key], ref[2][key]), (recompute, key)


def test_dropout_is_active_and_seeded():
    layer = seqpar.TransformerLayer(_cfg(hidden_dropout=0.2, attention_dropout=0.3))
    x = torch.randn(16, 2, H)
    y1, y1_again, y2 = _run(layer, x, 3)[0], _run(layer, x, 3)[0], _run(layer, x, 4)[0]
    assert torch.equal(y1, y1_again)
    assert not torch.allclose(y1, y2)
    layer.eval()
    with torch.no_grad():
        y_eval = layer(x)
    assert not torch.allclose(y1, y_eval)
    # consecutive training steps draw fresh masks
    seqpar.manual_seed(3)
    with torch.no_grad():
        layer.train()
        first, second = layer(x), layer(x)
    assert not torch.equal(first, second)


def test_init_is_deterministic_and_layer_dependent():
    seqpar.manual_seed(11)
    a = seqpar.TransformerLayer(_cfg(), layer_number=0).full_state_dict()
    seqpar.manual_seed(11)
    b = seqpar.TransformerLayer(_cfg(), layer_number=0).full_state_dict()
    c = seqpar.TransformerLayer(_cfg(), layer_number=1).full_state_dict()
    key = "self_attention.query_key_value.weight"
    assert torch.equal(a[key], b[key]) and not torch.equal(a[key], c[key])


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_memory_within_table2_bounds(recompute):
    s, b, h, a = 256, 2, 128, 4
    cfg = seqpar.TransformerConfig(hidden_size=h, num_attention_heads=a, hidden_dropout=0.1,
                                   attention_dropout=0.1, recompute=recompute, params_dtype=torch.bfloat16,
                                   backend="torch")
    layer = seqpar.TransformerLayer(cfg)
    x = torch.randn(s, b, h, dtype=torch.bfloat16, requires_grad=True)
    with ActivationMeter() as meter:
        y = layer(x)
    lower = layer_activation_bytes(s, b, h, a, recompute=recompute, bytes_per_mask=0)
    upper = 1.05 * layer_activation_bytes(s, b, h, a, recompute=recompute)
    assert lower <= meter.bytes <= upper, meter.report(s * b * h)
    y.float().sum().backward()  # the graph the meter saw is usable


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_attention_heads=5), "divisible"), (dict(hidden_size=0), "hidden_size"),
    (dict(recompute="partial"), "partial"), (dict(backend="tpu"), "tpu"), (dict(activation="relu"), "relu"),
    (dict(hidden_dropout=1.0), "hidden_dropout"), (dict(attention_dropout=-0.1), "attention_dropout"),
    (dict(ffn_hidden_size=-4), "ffn_hidden_size"), (dict(params_dtype=torch.int32), "params_dtype"),
])
def test_config_rejects(kwargs, match):
    with pytest.raises(ValueError, match=match):
        _cfg(**kwargs)


@pytest.mark.parametrize("x, match", [
    (torch.randn(8, 2, H + 1), "48"), (torch.randn(8, H), "s_local"), (torch.randn(8, 2, H).double(), "dtype"),
    (torch.randint(0, 3, (8, 2, H)), "floating"), ([1.0], "list"), (torch.randn(0, 2, H), "non-empty"),
])
def test_layer_rejects_bad_input(x, match):
    """... before it draws its dropout seed: a rejected call used up a draw, so the next good call got
    other masks than it would have (a retry after fixing the input did not reproduce a run)."""
    layer = seqpar.TransformerLayer(_cfg(hidden_dropout=0.1))
    seqpar.manual_seed(3)
    state = torch.get_rng_state()
    with pytest.raises(ValueError, match=match):
        layer(x)
    assert torch.equal(torch.get_rng_state(), state)


@pytest.mark.parametrize("from_env", [False, True], ids=["argument", "SEQPAR_BACKEND"])
def test_explicit_unavailable_backend_raises_before_drawing(from_env, monkeypatch):
    """A backend that can't run on the input's device (cuda on CPU tensors) is refused before the dropout
    seeds are drawn: the layer drew them, then the first op refused, so the retry on a usable backend
    got other masks than a first call (a run did not reproduce)."""
    if from_env:
        monkeypatch.setenv("SEQPAR_BACKEND", "cuda")
    layer = seqpar.TransformerLayer(_cfg(hidden_dropout=0.1, attention_dropout=0.1,
                                         backend="auto" if from_env else "cuda"))
    x = torch.randn(8, 2, H)
    seqpar.manual_seed(3)
    state = torch.get_rng_state()
    source = r" \(from SEQPAR_BACKEND\)" if from_env else ""
    with pytest.raises(ValueError, match=f"backend 'cuda'{source} can't run on cpu: the cuda backend needs CUDA"):
        layer(x)
    assert torch.equal(torch.get_rng_state(), state)


def test_state_dict_validation():
    layer = seqpar.TransformerLayer(_cfg())
    sd = layer.full_state_dict()
    bad = dict(sd)
    bad.pop("mlp.dense_h_to_4h.bias")
    with pytest.raises(ValueError, match="dense_h_to_4h.bias"):
        layer.load_full_state_dict(bad)
    bad = dict(sd)
    bad["self_attention.dense.weight"] = torch.zeros(H, H + 1)
    with pytest.raises(ValueError, match="self_attention.dense.weight"):
        layer.load_full_state_dict(bad)


def test_gpt_recompute_policies_match():
    """GPTModel with dropout gives the same loss and gradients under every recompute policy."""
    tokens = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(3))
    results = []
    for recompute in ("none", "selective", "full"):
        seqpar.manual_seed(8)
        cfg = seqpar.TransformerConfig(hidden_size=32, num_attention_heads=4, hidden_dropout=0.2,
                                       attention_dropout=0.1, recompute=recompute)
        model = seqpar.GPTModel(cfg, num_layers=3, vocab_size=64, max_seq_len=16)
        loss = model(tokens, tokens.roll(-1, 1)).mean()
        loss.backward()
        results.append((loss.detach(), {k: p.grad for k, p in model.named_parameters()}))
    for loss, grads in results[1:]:
        torch.testing.assert_close(loss, results[0][0], atol=1e-5, rtol=1e-5)
        for key, grad in results[0][1].items():
            torch.testing.assert_close(grads[key], grad, atol=1e-5, rtol=1e-4, msg=key)


def test_gpt_rejects_bad_tokens():
    model = seqpar.GPTModel(_cfg(), num_layers=1, vocab_size=16, max_seq_len=8)
    for tokens, match in ((torch.zeros(2, 9, dtype=torch.long), "max_seq_len"),
                          (torch.zeros(2, 4), "int64"), (torch.zeros(8, dtype=torch.long), "int64")):
        with pytest.raises(ValueError, match=match):
            model(tokens)


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_triton_layer_memory_within_selective_figure(recompute):
    """The flash-style attention core keeps nothing s^2-sized: with backend="triton" every recompute
    policy stays within Table 2's selective-recompute figure (Triton interpreter on CPU)."""
    pytest.importorskip("triton")
    if not torch.cuda.is_available() and not seqpar._ext.triton_interpreter_enabled():
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    s, b, h, a = 64, 2, 64, 2
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = seqpar.TransformerConfig(hidden_size=h, num_attention_heads=a, hidden_dropout=0.1, attention_dropout=0.1,
                                   recompute=recompute, params_dtype=torch.bfloat16, backend="triton")
    layer = seqpar.TransformerLayer(cfg, device=device)
    x = torch.randn(s, b, h, dtype=torch.bfloat16, device=device, requires_grad=True)
    seqpar.manual_seed(4)
    with ActivationMeter() as meter:
        y = layer(x)
    assert meter.bytes <= layer_activation_bytes(s, b, h, a, recompute="selective"), meter.report(s * b * h)
    assert not any(len(r.shape) >= 2 and r.shape[-2:] == (s, s) for r in meter.records), meter.report()
    y.float().sum().backward()
    # Same seed, same masks: the triton layer computes what the torch reference layer computes.
    reference = seqpar.TransformerLayer(dataclasses.replace(cfg, backend="torch"), device=device)
    reference.load_full_state_dict(layer.full_state_dict())
    x_ref = x.detach().clone().requires_grad_()
    seqpar.manual_seed(4)
    y_ref = reference(x_ref)
    y_ref.float().sum().backward()
    torch.testing.assert_close(y.float(), y_ref.float(), atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(x.grad.float(), x_ref.grad.float(), atol=5e-2, rtol=5e-2)


def test_memory_report_names_paper_terms():
    s, b, h, a = 64, 2, 32, 4
    cfg = seqpar.TransformerConfig(hidden_size=h, num_attention_heads=a, hidden_dropout=0.1, attention_dropout=0.1,
                                   params_dtype=torch.bfloat16, backend="torch")
    layer = seqpar.TransformerLayer(cfg)
    with ActivationMeter() as meter:
        layer(torch.randn(s, b, h, dtype=torch.bfloat16, requires_grad=True))
    sbh, as2b = s * b * h * 2, a * s * s * b * 2  # bytes of one [s, b, h] / [b, a, s, s] bf16 tensor
    got = meter.by_label()
    expected = {"QKV input": sbh, "Q, K, V": 3 * sbh, "softmax output": as2b, "dropout output": as2b,
                "projection input": sbh, "fc1 input": sbh, "GeLU input": 4 * sbh, "fc2 input": 4 * sbh}
    for label, n in expected.items():
        assert got[label] == n, f"{label}: {got.get(label)} != {n}\n{meter.report(sbh / 2)}"
    for label in ("LN1 input", "LN2 input"):  # plus at most two fp32 LayerNorm statistics per token
        assert sbh <= got[label] <= sbh + 8 * s * b, meter.report(sbh / 2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("convert", ["to", "method"])
def test_converted_layer_and_model_run_like_ones_built_in_that_dtype(dtype, convert):
    seqpar.manual_seed(0)
    cfg = _cfg(hidden_size=32, backend="torch")
    method = {torch.bfloat16: "bfloat16", torch.float16: "half"}[dtype]

    def converted(module):
        return module.to(dtype) if convert == "to" else getattr(module, method)()

    layer = converted(seqpar.TransformerLayer(cfg))
    built = seqpar.TransformerLayer(dataclasses.replace(cfg, params_dtype=dtype))
    built.load_full_state_dict(layer.full_state_dict())
    x = torch.randn(8, 2, 32, dtype=dtype)
    assert torch.equal(layer(x), built(x))
    with pytest.raises(ValueError, match=f"x dtype torch.float32 != params_dtype: the layer's parameters are {dtype}"):
        layer(x.float())
    model = converted(seqpar.GPTModel(cfg, 1, 37, 16))
    built = seqpar.GPTModel(dataclasses.replace(cfg, params_dtype=dtype), 1, 37, 16)
    built.load_full_state_dict(model.full_state_dict())
    tokens = torch.randint(0, 37, (2, 8), generator=torch.Generator().manual_seed(0))
    assert torch.equal(model(tokens, tokens), built(tokens, tokens))


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_bf16_layer_with_its_norms_kept_in_fp32_runs_in_bf16(arch):
    """HF's _keep_in_fp32_modules recipe: the norms back in fp32 in a bf16 layer. Its input check read the
    input norm's dtype and refused bf16 inputs ("the layer's parameters are torch.float32"), and its first
    linear refused fp32 ones. Now the linears give the compute dtype: bf16 in, bf16 out, each gradient in
    its parameter's dtype, close to the all-bf16 layer."""
    extra = {} if arch == "gpt" else dict(normalization="rmsnorm", activation="swiglu", position_embedding="rope",
                                          add_bias_linear=False)
    seqpar.manual_seed(0)
    layer = seqpar.TransformerLayer(_cfg(hidden_size=32, backend="torch", **extra)).bfloat16()
    all_bf16 = copy.deepcopy(layer)
    layer.input_layernorm.float()
    layer.post_attention_layernorm.float()
    x = torch.randn(8, 2, 32, dtype=torch.bfloat16)
    got, want = layer(x.clone().requires_grad_()), all_bf16(x.clone().requires_grad_())
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)   # norm weights of 1 and 0: bf16 rounding only
    got.float().square().sum().backward()
    assert all(p.grad is not None and p.grad.dtype == p.dtype for p in layer.parameters())
    assert layer.input_layernorm.weight.dtype == torch.float32
    with pytest.raises(ValueError, match="x dtype torch.float32 != params_dtype: the layer's parameters are "
                                         "torch.bfloat16"):
        layer(x.float())


def test_layer_converted_to_an_unsupported_dtype_says_so():
    layer = seqpar.TransformerLayer(_cfg(backend="torch")).to(torch.complex64)
    with pytest.raises(ValueError, match="parameters are torch.complex64"):
        layer(torch.randn(8, 2, H))


LLAMA = dict(normalization="rmsnorm", activation="swiglu", position_embedding="rope", add_bias_linear=False,
             num_query_groups=1)


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_a_float64_layer_passes_gradcheck_on_the_torch_backend(arch):
    """Every fused op takes float64 on the torch backend, yet layers and models refused it: a layer of your
    own (a subclass, a replaced part) could not be gradchecked whole. Now params_dtype=torch.float64 (or
    .double()) computes in float64 throughout ("auto" picks the torch backend), dropout and selective
    recompute included, with respect to the input and every parameter."""
    from torch.func import functional_call

    cfg = _cfg(hidden_size=8, num_attention_heads=2, params_dtype=torch.float64, hidden_dropout=0.25,
               attention_dropout=0.25, recompute="selective", **(LLAMA if arch == "llama" else {}))
    seqpar.manual_seed(0)
    layer = seqpar.TransformerLayer(cfg)
    names = [name for name, _ in layer.named_parameters()]
    params = tuple(p.detach().clone().requires_grad_() for p in layer.parameters())
    x = torch.randn(4, 2, 8, dtype=torch.float64, requires_grad=True)

    def f(x, *values):
        seqpar.manual_seed(1)   # the same masks in every call
        return functional_call(layer, dict(zip(names, values)), (x,))

    assert f(x, *params).dtype == torch.float64
    assert torch.autograd.gradcheck(f, (x,) + params, fast_mode=True)


def test_a_float64_model_s_loss_is_float64_and_kernel_backends_refuse_it_before_drawing():
    """The vocabulary loss of float64 logits is float64 (F.cross_entropy's); a kernel backend asked for a
    float64 layer is refused with the inputs, before the layer draws its dropout seeds."""
    seqpar.manual_seed(0)
    model = seqpar.GPTModel(_cfg(hidden_size=8, num_attention_heads=2, params_dtype=torch.float64), 1, 20, 4)
    tokens = torch.randint(0, 20, (2, 4), generator=torch.Generator().manual_seed(0))
    loss = model(tokens, tokens)
    logits = model(tokens)
    assert loss.dtype == torch.float64
    want = F.cross_entropy(logits.reshape(-1, 20), tokens.t().reshape(-1), reduction="none").view(4, 2)
    torch.testing.assert_close(loss, want, rtol=1e-12, atol=1e-12)
    layer = seqpar.TransformerLayer(_cfg(params_dtype=torch.float64, backend="triton", hidden_dropout=0.1))
    x = torch.randn(8, 2, H, dtype=torch.float64)
    state = torch.get_rng_state()
    with pytest.raises(ValueError, match="backend 'triton' can't compute in torch.float64"):
        layer(x)
    assert torch.equal(torch.get_rng_state(), state)


@pytest.mark.parametrize("recompute", ["none", "full"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_autocast_runs_as_the_model_in_that_dtype(dtype, recompute):
    """Under torch.autocast an fp32 layer / GPTModel computes exactly as the same weights converted to
    the autocast dtype (dropout on), and the parameters' fp32 gradients are that model's, cast."""
    cfg = _cfg(hidden_size=32, backend="torch", hidden_dropout=0.1, attention_dropout=0.1, recompute=recompute)
    tokens = torch.randint(0, 37, (2, 8))
    x = torch.randn(8, 2, 32)
    for build, inputs in ((lambda: seqpar.TransformerLayer(cfg), (x,)), (lambda: seqpar.GPTModel(cfg, 1, 37, 16),
                                                                       (tokens, tokens))):
        seqpar.manual_seed(0)
        fp32, low = build(), build()
        low.load_state_dict(fp32.state_dict())
        low.to(dtype)
        seqpar.manual_seed(1)
        with torch.autocast("cpu", dtype=dtype):
            got = fp32(*inputs)
        got.float().sum().backward()
        seqpar.manual_seed(1)
        want = low(*(t.to(dtype) if t.is_floating_point() else t for t in inputs))
        want.float().sum().backward()
        assert got.dtype == want.dtype and torch.equal(got, want)
        for (name, p), q in zip(fp32.named_parameters(), low.parameters()):
            assert p.grad.dtype == torch.float32 and torch.equal(p.grad, q.grad.float()), name


def test_a_second_thread_under_autocast_is_refused_and_the_parameters_survive():
    """Under autocast a call swaps the module's parameters for their casts. A second thread calling the same
    module meanwhile took the casts for the parameters and put them back for good when it left: the layer
    then held bf16 tensors instead of its Parameters (training reached none of them). The second thread
    now gets a RuntimeError; the first call and the parameters are unaffected."""
    import threading

    layer = seqpar.TransformerLayer(_cfg(hidden_size=32, backend="torch"))
    params = dict(layer.named_parameters())
    x = torch.randn(8, 2, 32)
    errors = []

    def other_thread():
        try:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                layer(x)
        except RuntimeError as error:
            errors.append(str(error))

    def during_the_call(module, args):   # the MLP runs inside the layer's autocast call
        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join()

    handle = layer.mlp.register_forward_pre_hook(during_the_call)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    handle.remove()
    assert len(errors) == 1 and "already running under torch.autocast in another thread" in errors[0], errors
    assert all(p is params[name] and isinstance(p, torch.nn.Parameter) for name, p in layer.named_parameters())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(layer(x), y)


def test_autocast_runs_each_hook_once_and_the_parallel_linears_as_converted():
    """Under autocast a layer or model re-entered its own __call__ (torch.func.functional_call): its hooks
    ran twice, the second time on the cast input. ColumnParallelLinear / RowParallelLinear with
    sequence_parallel=True (nn.Linear math at t = 1) failed in backward: the SP ops' backward multiplied a
    bf16 gradient by the fp32 weight. Both now run as if converted, like the layer."""
    import copy
    from seqpar.nn import ColumnParallelLinear, RowParallelLinear

    calls = []
    layer = seqpar.TransformerLayer(_cfg(hidden_size=32, backend="torch"))
    layer.register_forward_pre_hook(lambda module, args: calls.append(args[0].dtype))
    model = seqpar.GPTModel(_cfg(hidden_size=32, backend="torch"), 1, 37, 16)
    model.register_forward_hook(lambda module, args, output: calls.append("model"))
    tokens = torch.randint(0, 37, (2, 8))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        layer(torch.randn(8, 2, 32))
        model(tokens, tokens)
    assert calls == [torch.float32, "model"]
    for cls in (ColumnParallelLinear, RowParallelLinear):
        linear = cls(16, 8, sequence_parallel=True)
        converted = copy.deepcopy(linear).bfloat16()
        x = torch.randn(4, 2, 16, requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = linear(x)
        got.float().square().sum().backward()
        x_low = x.detach().bfloat16().requires_grad_()
        want = converted(x_low)
        want.float().square().sum().backward()
        assert got.dtype == torch.bfloat16 and torch.equal(got, want), cls.__name__
        assert torch.equal(x.grad, x_low.grad.float()), cls.__name__
        for p, q in zip(linear.parameters(), converted.parameters()):
            assert p.grad.dtype == torch.float32 and torch.equal(p.grad, q.grad.float()), cls.__name__


@pytest.mark.parametrize("layer_number", [-1, 2**63, 2**64, 1.0, True])
def test_layer_number_outside_63_bits_is_rejected(layer_number):
    with pytest.raises(ValueError, match=f"layer_number must be an int in \\[0, 2\\*\\*63\\), got {layer_number!r}"):
        seqpar.TransformerLayer(_cfg(backend="torch"), layer_number=layer_number)


def test_largest_layer_number_is_accepted():
    seqpar.TransformerLayer(_cfg(backend="torch"), layer_number=2**63 - 1)


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_functional_call_gradients_reach_the_passed_parameters(recompute):
    """torch.func.functional_call puts the module's own parameters back when the forward returns; the
    recompute in backward must still run on the passed ones (their gradients, and an input gradient
    computed with them), as with recompute="none" and dropout on."""
    x = torch.randn(8, 2, 32)
    results = {}
    for policy in ("none", recompute):
        seqpar.manual_seed(1)
        layer = seqpar.TransformerLayer(seqpar.TransformerConfig(hidden_size=32, num_attention_heads=4,
                                                                 hidden_dropout=0.1, attention_dropout=0.1,
                                                                 recompute=policy, backend="torch"))
        passed = {name: (p.detach() * 1.5).requires_grad_() for name, p in layer.named_parameters()}
        x_leaf = x.clone().requires_grad_()
        seqpar.manual_seed(2)
        y = torch.func.functional_call(layer, passed, (x_leaf,))
        results[policy] = torch.autograd.grad(y.square().sum(), [x_leaf, *passed.values()], allow_unused=True)
        assert all(p.grad is None for p in layer.parameters())      # nothing reached the module's own
    for got, want in zip(results[recompute], results["none"]):
        assert got is not None
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_torch_compile_traces_a_layer_without_graph_breaks(recompute):
    """Nothing in the layer's forward is opaque to Dynamo when no meter is active and dropout is off
    (memory labels were ContextVar sets: one graph break each; seqpar's checkpoint re-runs with
    torch.autograd.grad in backward, which Dynamo can't trace: under compile the recomputed regions
    take torch's checkpoint); the compiled layer computes what the eager one does."""
    seqpar.manual_seed(0)
    layer = seqpar.TransformerLayer(_cfg(recompute=recompute))
    x = torch.randn(8, 2, H)
    explanation = torch._dynamo.explain(layer)(x)
    assert explanation.graph_break_count == 0, [str(b.reason)[:200] for b in explanation.break_reasons]
    torch._dynamo.reset()
    results = []
    for run in (layer, torch.compile(layer, backend="aot_eager")):
        x_leaf = x.clone().requires_grad_()
        y = run(x_leaf)
        y.square().sum().backward()
        results.append((y.detach(), x_leaf.grad, [p.grad.clone() for p in layer.parameters()]))
        layer.zero_grad()
    torch.testing.assert_close(results[1], results[0], rtol=1e-6, atol=1e-6)


def test_the_attention_backend_is_chosen_for_the_dropout_the_core_runs(monkeypatch):
    """The layer chose its attention backend as if dropout were on (select_backend's default), then the
    core chose again with its real dropout: a backend that runs the core only without dropout (the triton
    kernel on triton < 3.3, simulated) refused an eval forward, or a training one with attention_dropout
    0, though attention_core runs it; under auto the layer fell back to torch. Now both ask the same."""
    pytest.importorskip("triton")
    from seqpar.ops import registry
    if registry.environment_reason("triton", torch.device("cpu")) is not None:
        pytest.skip("the triton interpreter is not enabled")
    import triton.language

    monkeypatch.delattr(triton.language, "gather")   # as on triton < 3.3: the kernel's dropout can't run
    seqpar.manual_seed(0)
    layer = seqpar.TransformerLayer(seqpar.TransformerConfig(hidden_size=32, num_attention_heads=2,
                                                             attention_dropout=0.1, backend="triton"))
    x = torch.randn(8, 1, 32)
    with seqpar.ops.registry.record_selections() as seen:
        layer.eval()(x)
    assert seen["attention_core"] == {"triton"}
    with pytest.raises(ValueError, match=r"attention dropout in the triton kernel needs triton >= 3.3"):
        layer.train()(x)
