"""Rotary position embeddings: HF Llama's default RoPE (reimplemented here) and an fp64 reference against
the torch reference, the triton backend (CPU interpreter here) and the cuda backend (GPU-marked); shard
offsets, in place vs out of place, gradients, validation and torch.compile. Llama 3.1's scaled frequencies
(RopeScaling) against transformers' own "llama3" frequencies, bit for bit, and the rotation by them."""
import pytest
import torch

from seqpar.ops import LinearScaling, RopeScaling, YarnScaling, rotary_embedding
from seqpar.ops.rotary import rope_frequencies, rope_inv_freq
from tests.gpu import GPU_DTYPES, skip_unless_backend_runs
from tests.tolerances import assert_error_within

THETA = 10000.0


# ----------------------------------------------------------------------------- helpers
def _qk(s, b, hq, hk, d, dtype, device="cpu", gen_seed=0, requires_grad=False):
    g = torch.Generator().manual_seed(gen_seed)
    q = torch.randn(s, b, hq, d, generator=g).to(dtype).to(device)
    k = torch.randn(s, b, hk, d, generator=g).to(dtype).to(device)
    return q.requires_grad_(requires_grad), k.requires_grad_(requires_grad)


def _rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def _default_inv_freq(d, theta=THETA):
    return 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).to(dtype=torch.float) / d))


def _hf_rope(q, k, position_offset=0, theta=THETA, inv_freq=None):
    """HF Llama: LlamaRotaryEmbedding (default rope type, or the given ``inv_freq``) + apply_rotary_pos_emb,
    on the [b, H, s, d] layout HF uses, written out."""
    s, b, _, d = q.shape
    inv_freq = (_default_inv_freq(d, theta) if inv_freq is None else inv_freq).to(q.device)
    position_ids = torch.arange(position_offset, position_offset + s, device=q.device)[None, :].expand(b, -1)
    freqs = position_ids[..., None].float() * inv_freq.to(dtype=torch.float)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = (emb.cos() * 1.0).to(q.dtype), (emb.sin() * 1.0).to(q.dtype)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    qh, kh = q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3)
    q_embed = (qh * cos) + (_rotate_half(qh) * sin)
    k_embed = (kh * cos) + (_rotate_half(kh) * sin)
    return q_embed.permute(2, 0, 1, 3), k_embed.permute(2, 0, 1, 3)


def _reference_fp64(x, position_offset=0, theta=THETA, inverse=False, inv_freq=None):
    """The rotation in float64: the op's fp32 angles (as HF forms them), their cos / sin in float64."""
    s, d = x.shape[0], x.shape[-1]
    inv_freq = _default_inv_freq(d, theta) if inv_freq is None else inv_freq
    angle = (torch.arange(position_offset, position_offset + s).float()[:, None] * inv_freq).double()
    cos, sin = angle.cos()[:, None, None, :], angle.sin()[:, None, None, :] * (-1 if inverse else 1)
    x64 = x.detach().double().cpu()
    x1, x2 = x64[..., : d // 2], x64[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def _run(q, k, backend, grads, **kwargs):
    """(q_rot, k_rot, grad_q, grad_k) for incoming gradients ``grads``."""
    q, k = q.detach().requires_grad_(), k.detach().requires_grad_()
    q_rot, k_rot = rotary_embedding(q, k, backend=backend, **kwargs)
    gq, gk = torch.autograd.grad((q_rot, k_rot), (q, k), grads)
    return q_rot, k_rot, gq, gk


@pytest.fixture
def poisoned_triton(monkeypatch):
    """Outputs the rotary launchers write start as NaN (the custom op allocates them with torch.empty)."""
    from seqpar.ops import rotary

    real = rotary._new_like
    monkeypatch.setattr(rotary, "_new_like", lambda x: real(x).fill_(float("nan")))


# Ugly shapes: s not a power of two, d = 80 (half = 40), Hq != Hk (grouped-query attention).
CASES = [pytest.param(37, 2, 4, 2, 80, 0, THETA, id="s37-b2-gqa4x2-d80"),
         pytest.param(5, 3, 3, 3, 64, 1000, 500000.0, id="s5-b3-mha3-d64-offset1000-theta5e5"),
         pytest.param(9, 1, 6, 1, 18, 4093, THETA, id="s9-b1-mqa6x1-d18-offset4093")]


# ----------------------------------------------------------------------------- fp32 against HF
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("s,b,hq,hk,d,offset,theta", CASES)
def test_fp32_matches_hf_llama_rope(backend, s, b, hq, hk, d, offset, theta, poisoned_triton):
    q, k = _qk(s, b, hq, hk, d, torch.float32)
    q_rot, k_rot = rotary_embedding(q, k, position_offset=offset, theta=theta, backend=backend)
    q_hf, k_hf = _hf_rope(q, k, offset, theta)
    torch.testing.assert_close(q_rot, q_hf, atol=1e-6, rtol=0)
    torch.testing.assert_close(k_rot, k_hf, atol=1e-6, rtol=0)
    torch.testing.assert_close(q_rot.double(), _reference_fp64(q, offset, theta), atol=2e-6, rtol=0)
    assert q_rot.is_contiguous() and k_rot.is_contiguous()


@pytest.mark.parametrize("s,b,hq,hk,d,offset,theta", CASES[:2])
def test_triton_gradients_match_torch(s, b, hq, hk, d, offset, theta, poisoned_triton):
    q, k = _qk(s, b, hq, hk, d, torch.float32)
    grads = _qk(s, b, hq, hk, d, torch.float32, gen_seed=1)
    ref = _run(q, k, "torch", grads, position_offset=offset, theta=theta)
    got = _run(q, k, "triton", grads, position_offset=offset, theta=theta)
    for name, a, e in zip(("q_rot", "k_rot", "grad_q", "grad_k"), got, ref):
        torch.testing.assert_close(a, e, atol=1e-6, rtol=0, msg=name)
    # backward is the rotation by -angle
    torch.testing.assert_close(got[2].double(), _reference_fp64(grads[0], offset, theta, inverse=True),
                               atol=2e-6, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_triton_half_error_within_2x_torch(dtype, poisoned_triton):
    q, k = _qk(37, 2, 4, 2, 80, dtype)
    grads = _qk(37, 2, 4, 2, 80, dtype, gen_seed=1)
    torch_same = _run(q, k, "torch", grads, position_offset=3)
    got = _run(q, k, "triton", grads, position_offset=3)
    refs = (_reference_fp64(q, 3), _reference_fp64(k, 3), _reference_fp64(grads[0], 3, inverse=True),
            _reference_fp64(grads[1], 3, inverse=True))
    for name, a, t, e in zip(("q_rot", "k_rot", "grad_q", "grad_k"), got, torch_same, refs):
        assert a.dtype == dtype, name
        assert_error_within(a, t, e, name=name)
    # and the once-rounded rotation is at least as close to the exact one as HF's bf16 arithmetic
    q_hf, _ = _hf_rope(q, k, 3)
    assert (torch_same[0].double() - refs[0]).abs().max() <= (q_hf.double() - refs[0]).abs().max()


# ----------------------------------------------------------------------------- sequence shards
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_shard_with_offset_equals_unsharded_slice(backend):
    """Global positions: each sequence shard, given its first row's position, reproduces the rows of the
    unsharded result exactly (and a wrong offset does not)."""
    q, k = _qk(24, 2, 4, 2, 32, torch.float32)
    q_full, k_full = rotary_embedding(q, k, backend=backend)
    for start, stop in ((0, 8), (8, 16), (16, 24), (5, 19)):
        q_s, k_s = rotary_embedding(q[start:stop], k[start:stop], position_offset=start, backend=backend)
        assert torch.equal(q_s, q_full[start:stop]) and torch.equal(k_s, k_full[start:stop]), (start, stop)
    q_wrong, _ = rotary_embedding(q[8:16], k[8:16], backend=backend)
    assert not torch.equal(q_wrong, q_full[8:16])


# ----------------------------------------------------------------------------- in place
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_inplace_on_fused_qkv_views_matches_out_of_place(backend):
    """q and k as views of one fused QKV projection output [s, b, (Hq + 2 Hk) * d] (non-contiguous, any
    strides): in place writes into them and returns them; values and gradients equal the out-of-place op's."""
    s, b, hq, hk, d = 11, 2, 4, 2, 16
    g = torch.Generator().manual_seed(5)
    x = torch.randn(s, b, 8, generator=g, requires_grad=True)
    w = torch.randn((hq + 2 * hk) * d, 8, generator=g)
    grads = _qk(s, b, hq, hk, d, torch.float32, gen_seed=2)

    def rotated(inplace):
        qkv = (x @ w.t()).view(s, b, hq + 2 * hk, d)
        q, k = qkv[:, :, :hq], qkv[:, :, hq:hq + hk]
        q_rot, k_rot = rotary_embedding(q, k, position_offset=7, inplace=inplace, backend=backend)
        if inplace:
            assert q_rot is q and k_rot is k
        loss = (q_rot * grads[0]).sum() + (k_rot * grads[1]).sum() + qkv[:, :, hq + hk:].square().sum()
        return q_rot.detach().clone(), k_rot.detach().clone(), torch.autograd.grad(loss, x)[0]

    out_of_place, in_place = rotated(False), rotated(True)
    for a, e in zip(in_place, out_of_place):
        torch.testing.assert_close(a, e, atol=1e-6, rtol=1e-6)


def test_gradcheck_fp64_torch_backend():
    q, k = _qk(5, 2, 3, 1, 8, torch.float64, requires_grad=True)
    for inplace in (False, True):
        assert torch.autograd.gradcheck(
            lambda a, c: rotary_embedding(a.clone(), c.clone(), position_offset=3, inplace=inplace, backend="torch"),
            (q, k))


@pytest.mark.parametrize("order", ["fake-first", "real-first"])
def test_fake_tensor_calls_leave_later_real_calls_alone(order):
    """The torch backend caches the frequencies per (device, d, theta). A FakeTensorMode call (shape
    inference, make_fx) cached a fake tensor that every later real call then used (an error, or a layer
    returning a FakeTensor), and after a real call a fake one got the cached real tensor (an error)."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    from seqpar.ops.rotary import _inv_freq_on

    _inv_freq_on.cache_clear()
    q, k = _qk(4, 1, 2, 2, 8, torch.float32)

    def fake_call():
        with FakeTensorMode() as mode:
            q_rot, _ = rotary_embedding(mode.from_tensor(q), mode.from_tensor(k), backend="torch")
        assert isinstance(q_rot, FakeTensor) and q_rot.shape == q.shape

    def real_call():
        q_rot, k_rot = rotary_embedding(q, k, backend="torch")
        assert not isinstance(q_rot, FakeTensor)
        for got, want in zip((q_rot, k_rot), _hf_rope(q, k)):
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)

    calls = (fake_call, real_call, fake_call, real_call)
    for call in calls if order == "fake-first" else calls[1:]:
        call()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_nothing_is_saved_for_backward(backend):
    q, k = _qk(4, 1, 2, 2, 8, torch.float32, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        q_rot, k_rot = rotary_embedding(q, k, backend=backend)
    assert saved == []
    (q_rot.sum() + k_rot.sum()).backward()
    assert q.grad is not None and k.grad is not None


def test_triton_custom_ops_pass_opcheck():
    q, k = _qk(3, 2, 2, 1, 8, torch.float32)
    llama3 = list(rope_frequencies(THETA, RopeScaling(8.0, 1.0, 4.0, 64)))
    yarn = list(rope_frequencies(THETA, YarnScaling(4.0, 32), 8))
    torch.library.opcheck(torch.ops.seqpar.rotary_embedding_triton, (q, 2, list(rope_frequencies(THETA, LinearScaling(4.0))),
                                                                    False))
    torch.library.opcheck(torch.ops.seqpar.rotary_embedding_triton, (q, 5, [THETA], False))
    torch.library.opcheck(torch.ops.seqpar.rotary_embedding_triton, (k, 0, llama3, True))
    torch.library.opcheck(torch.ops.seqpar.rotary_embedding_triton_inplace, (q.clone(), 5, llama3, True))
    torch.library.opcheck(torch.ops.seqpar.rotary_embedding_triton, (q, 2, yarn, False))


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("inplace", [False, True], ids=["out_of_place", "inplace"])
def test_torch_compile_traces_the_op(inplace, backend):
    """fullgraph: the torch backend's in-place path returned copy_'s result, which Dynamo does not take for
    the input the autograd Function marks dirty (a graph break)."""
    torch._dynamo.reset()

    def f(q, k):
        if inplace:  # leaves can't be modified in place: rotate copies
            q, k = q * 1.0, k * 1.0
        q_rot, k_rot = rotary_embedding(q, k, position_offset=2, backend=backend, inplace=inplace)
        return q_rot * 2.0, k_rot + 1.0

    q, k = _qk(6, 2, 2, 1, 16, torch.float32, requires_grad=True)
    outs_c = torch.compile(f, backend="aot_eager", fullgraph=True)(q, k)
    grads_c = torch.autograd.grad(outs_c[0].square().sum() + outs_c[1].sum(), (q, k))
    outs_e = f(q, k)
    grads_e = torch.autograd.grad(outs_e[0].square().sum() + outs_e[1].sum(), (q, k))
    for a, e in zip(outs_c + grads_c, outs_e + grads_e):
        torch.testing.assert_close(a, e, rtol=0, atol=0)


def test_inplace_with_q_and_k_one_tensor_is_refused_under_torch_compile_too():
    q, _ = _qk(6, 2, 2, 1, 16, torch.float32)
    f = torch.compile(lambda q: rotary_embedding(q, q, inplace=True, backend="torch"), backend="aot_eager")
    with pytest.raises(Exception, match="not to share elements"):
        f(q.clone())


# ----------------------------------------------------------------------------- Llama 3.1's scaling
# (d, theta, scaling): every case has frequencies in all three bands (kept, blended, stretched)
LLAMA3 = [pytest.param(16, 500000.0, RopeScaling(8.0, 1.0, 4.0, 64), id="d16-f8-L64"),
          pytest.param(128, 500000.0, RopeScaling(), id="llama3.1-d128"),
          pytest.param(64, 500000.0, RopeScaling(32.0, 1.0, 4.0, 8192), id="llama3.2-1b-d64"),
          pytest.param(80, 10000.0, RopeScaling(4.0, 2.0, 3.0, 300), id="d80-f4-lo2-hi3-L300")]


@pytest.mark.parametrize("d,theta,scaling", LLAMA3)
def test_llama3_frequencies_are_transformers_bit_for_bit(d, theta, scaling):
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    transformers.logging.set_verbosity_error()
    config = transformers.LlamaConfig(
        hidden_size=2 * d, num_attention_heads=2, num_hidden_layers=1, intermediate_size=8, vocab_size=8,
        max_position_embeddings=2 * scaling.original_max_position_embeddings,
        rope_parameters=dict(rope_type="llama3", rope_theta=theta, factor=scaling.factor,
                             low_freq_factor=scaling.low_freq_factor, high_freq_factor=scaling.high_freq_factor,
                             original_max_position_embeddings=scaling.original_max_position_embeddings))
    theirs, attention_factor = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    ours, default = rope_inv_freq(d, theta, scaling), rope_inv_freq(d, theta)
    assert torch.equal(ours, theirs) and attention_factor == 1.0
    assert torch.equal(default, _default_inv_freq(d, theta))
    kept, stretched = ours == default, torch.isclose(ours, default / scaling.factor, rtol=1e-6, atol=0)
    assert kept.any() and stretched.any() and (~kept & ~stretched).any(), (ours, default)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("d,theta,scaling", LLAMA3[::3])
def test_llama3_scaled_rotation_and_gradients(backend, d, theta, scaling, poisoned_triton):
    """The rotation by the scaled frequencies (HF's apply_rotary_pos_emb with them, fp32 within 1e-6) and
    its backward (the rotation by -angle), at a shard's offset."""
    q, k = _qk(7, 2, 4, 2, d, torch.float32)
    grads = _qk(7, 2, 4, 2, d, torch.float32, gen_seed=1)
    inv_freq = rope_inv_freq(d, theta, scaling)
    q_rot, k_rot, gq, _ = _run(q, k, backend, grads, position_offset=300, theta=theta, rope_scaling=scaling)
    q_hf, k_hf = _hf_rope(q, k, 300, inv_freq=inv_freq)
    torch.testing.assert_close((q_rot, k_rot), (q_hf, k_hf), atol=1e-6, rtol=0)
    torch.testing.assert_close(gq.double(), _reference_fp64(grads[0], 300, inverse=True, inv_freq=inv_freq),
                               atol=2e-6, rtol=0)
    unscaled = rotary_embedding(q, k, position_offset=300, theta=theta, backend=backend)[0]
    assert (unscaled - q_rot).abs().max() > 0.1    # the scaling matters at these positions


@pytest.mark.parametrize("dynamic", [None, True], ids=["default", "dynamic"])
def test_llama3_scaling_compiles_in_one_graph(dynamic):
    """Also with every float made a symbol (dynamic=True) and recompiled for another scaling (a Llama 3.2
    draft model beside a Llama 3.1 one): Dynamo raised an AssertionError on a symbol (a scaling field, math.pi)
    first met inside the autograd Function's subgraph."""
    torch._dynamo.reset()
    q, k = _qk(6, 2, 2, 1, 16, torch.float32, requires_grad=True)
    for factor in (8.0, 32.0):
        scaling = RopeScaling(factor, 1.0, 4.0, 64)

        def f(q, k):
            q_rot, k_rot = rotary_embedding(q, k, position_offset=2, theta=500000.0, rope_scaling=scaling,
                                            backend="torch")
            return q_rot * 2.0, k_rot

        compiled = torch.compile(f, backend="aot_eager", fullgraph=True, dynamic=dynamic)(q, k)
        eager = f(q, k)
        torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
        torch.testing.assert_close(torch.autograd.grad(compiled[0].sum(), q), torch.autograd.grad(eager[0].sum(), q),
                                   rtol=0, atol=0)


def test_a_theta_compile_made_symbolic_stays_in_one_graph():
    """A theta torch.compile makes symbolic (an argument under dynamic=True; a second model of another theta
    recompiled): the checks' math.isfinite was a graph break there, an error under fullgraph=True (a Llama
    GPTModel under dynamic=True compiled to 14 graphs, its layer loop run eagerly)."""
    torch._dynamo.reset()

    def f(q, k, theta):
        return rotary_embedding(q, k, theta=theta, rope_scaling=RopeScaling(8.0, 1.0, 4.0, 64), backend="torch")

    q, k = _qk(6, 2, 2, 1, 16, torch.float32)
    compiled = torch.compile(f, backend="aot_eager", dynamic=True, fullgraph=True)
    for theta in (500000.0, 10000.0):
        torch.testing.assert_close(compiled(q, k, theta), f(q, k, theta), rtol=0, atol=0)


@pytest.mark.parametrize("fields, match", [
    (dict(factor=0.0), "factor must be a finite positive"), (dict(factor=float("nan")), "factor"),
    (dict(factor=1e-39), "factor must be within fp32's range"),    # frequencies inf: NaN rotations
    (dict(low_freq_factor=4.0, high_freq_factor=4.0), "must be below high_freq_factor"),
    (dict(high_freq_factor=True), "high_freq_factor must be a finite positive"),
    (dict(original_max_position_embeddings=8192.0), "original_max_position_embeddings must be a positive int"),
    (dict(original_max_position_embeddings=0), "original_max_position_embeddings must be a positive int"),
])
def test_bad_rope_scaling_raises_naming_the_field(fields, match):
    with pytest.raises(ValueError, match=match):
        RopeScaling(**fields)


# ----------------------------------------------------------------------------- YaRN's scaling
# (d, theta, scaling): Qwen2.5's long-context setting (factor 4 over 32768), small ones with all three bands
# (kept, blended, interpolated), untruncated, an explicit attention factor, other betas, factor 1
YARN = [pytest.param(128, 1e6, YarnScaling(4.0, 32768), id="qwen2.5-d128-f4"),
        pytest.param(16, 10000.0, YarnScaling(4.0, 32), id="d16-f4-L32"),
        pytest.param(80, 500000.0, YarnScaling(8.0, 300, beta_fast=16.0, beta_slow=2.0, truncate=False),
                     id="d80-betas-untruncated"),
        pytest.param(64, 10000.0, YarnScaling(16.0, 2048, attention_factor=1.25), id="d64-attention-factor"),
        pytest.param(32, 10000.0, YarnScaling(1.0, 64), id="d32-f1")]


@pytest.mark.parametrize("d,theta,scaling", YARN)
def test_yarn_frequencies_and_attention_factor_are_transformers_bit_for_bit(d, theta, scaling):
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    transformers.logging.set_verbosity_error()
    params = dict(rope_type="yarn", rope_theta=theta, factor=scaling.factor, beta_fast=scaling.beta_fast,
                  beta_slow=scaling.beta_slow, truncate=scaling.truncate,
                  original_max_position_embeddings=scaling.original_max_position_embeddings)
    if scaling.attention_factor is not None:
        params["attention_factor"] = scaling.attention_factor
    config = transformers.LlamaConfig(hidden_size=2 * d, num_attention_heads=2, num_hidden_layers=1,
                                      intermediate_size=8, vocab_size=8, rope_parameters=params,
                                      max_position_embeddings=4 * scaling.original_max_position_embeddings)
    theirs, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    ours, default = rope_inv_freq(d, theta, scaling), rope_inv_freq(d, theta)
    assert torch.equal(ours, theirs) and scaling.attention_scaling == attention_factor
    if scaling.factor > 1 and d >= 32:
        kept, interpolated = ours == default, torch.isclose(ours, default / scaling.factor, rtol=1e-6, atol=0)
        assert kept.any() and interpolated.any() and (~kept & ~interpolated).any(), (ours, default)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_yarn_rotation_and_gradients_without_the_attention_factor(backend, poisoned_triton):
    """The rotation by YaRN's frequencies is HF's apply_rotary_pos_emb with cos / sin before its attention
    factor (the layer applies that in the softmax scale); the backward rotates by -angle."""
    d, theta, scaling = 16, 10000.0, YarnScaling(4.0, 32)
    q, k = _qk(7, 2, 4, 2, d, torch.float32)
    grads = _qk(7, 2, 4, 2, d, torch.float32, gen_seed=1)
    inv_freq = rope_inv_freq(d, theta, scaling)
    q_rot, k_rot, gq, _ = _run(q, k, backend, grads, position_offset=90, theta=theta, rope_scaling=scaling)
    torch.testing.assert_close((q_rot, k_rot), _hf_rope(q, k, 90, inv_freq=inv_freq), atol=1e-6, rtol=0)
    torch.testing.assert_close(gq.double(), _reference_fp64(grads[0], 90, inverse=True, inv_freq=inv_freq),
                               atol=2e-6, rtol=0)


@pytest.mark.parametrize("dynamic", [None, True], ids=["default", "dynamic"])
def test_yarn_scaling_compiles_in_one_graph(dynamic):
    """Two YaRN factors and a theta made symbolic (dynamic=True): the correction range is computed from
    plain floats before the graph's autograd Function, as the llama3 fields are."""
    torch._dynamo.reset()
    q, k = _qk(6, 2, 2, 1, 16, torch.float32, requires_grad=True)
    for factor, theta in ((4.0, 10000.0), (8.0, 500000.0)):
        def f(q, k, theta):
            q_rot, k_rot = rotary_embedding(q, k, position_offset=2, theta=theta,
                                            rope_scaling=YarnScaling(factor, 32), backend="torch")
            return q_rot * 2.0, k_rot

        compiled = torch.compile(f, backend="aot_eager", fullgraph=True, dynamic=dynamic)(q, k, theta)
        eager = f(q, k, theta)
        torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
        torch.testing.assert_close(torch.autograd.grad(compiled[0].sum(), q), torch.autograd.grad(eager[0].sum(), q),
                                   rtol=0, atol=0)


@pytest.mark.parametrize("fields, match", [
    (dict(factor=0.5), "factor must be a finite float >= 1"), (dict(factor=float("inf")), "factor"),
    (dict(beta_fast=0.0), "beta_fast must be a finite positive"), (dict(beta_slow=True), "beta_slow"),
    (dict(attention_factor=-1.0), "attention_factor must be a finite positive"),
    (dict(original_max_position_embeddings=32.0), "original_max_position_embeddings must be a positive int"),
    (dict(truncate=1), "truncate must be a bool, got 1"),
])
def test_bad_yarn_scaling_raises_naming_the_field(fields, match):
    with pytest.raises(ValueError, match=match):
        YarnScaling(**{"factor": 4.0, "original_max_position_embeddings": 32, **fields})


@pytest.mark.parametrize("factor", [2.0, 4.0, 0.5, 3.7])
def test_linear_frequencies_are_transformers_bit_for_bit(factor):
    """HF's "linear" (position interpolation; DeepSeek Coder's factor 4): the default frequencies over factor."""
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    transformers.logging.set_verbosity_error()
    config = transformers.LlamaConfig(hidden_size=256, num_attention_heads=2, num_hidden_layers=1, intermediate_size=8,
                                      vocab_size=8, rope_parameters=dict(rope_type="linear", factor=factor,
                                                                         rope_theta=100000.0))
    theirs, attention_factor = ROPE_INIT_FUNCTIONS["linear"](config, "cpu")
    assert torch.equal(rope_inv_freq(128, 100000.0, LinearScaling(factor)), theirs) and attention_factor == 1.0


def test_linear_scaling_rotates_as_hf_and_compiles():
    """(dynamic=True's symbolic floats go the same way as the llama3 and YaRN fields, tested above.)"""
    q, k = _qk(6, 2, 2, 1, 16, torch.float32, requires_grad=True)
    scaling = LinearScaling(4.0)

    def f(q, k):
        return rotary_embedding(q, k, position_offset=5, theta=10000.0, rope_scaling=scaling, backend="torch")

    torch._dynamo.reset()
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)(q, k)
    torch.testing.assert_close(compiled, f(q, k), rtol=0, atol=0)
    hf = _hf_rope(q.detach(), k.detach(), 5, inv_freq=rope_inv_freq(16, 10000.0, scaling))
    torch.testing.assert_close(tuple(t.detach() for t in compiled), hf, atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="LinearScaling.factor must be a finite positive float"):
        LinearScaling(0.0)


def test_yarn_with_theta_1_is_a_value_error():
    """Its correction range divides by ln theta (a ZeroDivisionError, as in HF's)."""
    q, k = _qk(4, 1, 2, 1, 8, torch.float32)
    with pytest.raises(ValueError, match="YaRN's scaling needs a rope_theta other than 1"):
        rotary_embedding(q, k, theta=1.0, rope_scaling=YarnScaling(4.0, 32), backend="torch")


# ----------------------------------------------------------------------------- validation
BAD = [
    ("q_3d", dict(q=torch.randn(4, 2, 8)), "q must be"),
    ("q_int", dict(q=torch.ones(4, 2, 2, 8, dtype=torch.int32)), "q must be"),
    ("k_not_tensor", dict(k=1.0), "k must be a tensor"),
    ("k_dtype", dict(k=torch.randn(4, 2, 1, 8, dtype=torch.bfloat16)), "k dtype"),
    ("k_seq", dict(k=torch.randn(5, 2, 1, 8)), "k shape"),
    ("k_head_dim", dict(k=torch.randn(4, 2, 1, 10)), "k shape"),
    ("d_odd", dict(q=torch.randn(4, 2, 2, 7), k=torch.randn(4, 2, 1, 7)), "d must be even"),
    ("device", dict(k=torch.randn(4, 2, 1, 8, device="meta")), "one device"),
    ("offset_negative", dict(position_offset=-1), "position_offset"),
    ("offset_float", dict(position_offset=2.0), "position_offset"),
    ("offset_bool", dict(position_offset=True), "position_offset"),
    ("theta_zero", dict(theta=0.0), "theta"),
    ("theta_inf", dict(theta=float("inf")), "theta"),
    ("theta_past_fp32", dict(theta=1e39), "within fp32's range"),      # fp32 inf: frequencies 1, 0, 0, 0
    ("theta_under_fp32", dict(theta=1e-46), "within fp32's range"),    # fp32 0: frequencies 1, inf, inf, inf
    ("inplace_int", dict(inplace=1), "inplace must be a bool"),
    ("scaling_dict", dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}), "rope_scaling must be a "),
    ("inplace_strided_d", dict(q=torch.randn(4, 2, 2, 16)[..., ::2], inplace=True), "unit stride along d"),
    ("inplace_same_tensor", dict(k="q", inplace=True), "not to share elements"),
    ("backend_unknown", dict(backend="cudnn"), "unknown backend"),
]


@pytest.mark.parametrize("overrides,match", [pytest.param(o, m, id=i) for i, o, m in BAD])
def test_bad_inputs_raise_value_error(overrides, match):
    args = dict(q=torch.randn(4, 2, 2, 8), k=torch.randn(4, 2, 1, 8), position_offset=0, theta=THETA,
                inplace=False, backend="torch")
    args.update(overrides)
    if args["k"] == "q":
        args["k"] = args["q"]
    with pytest.raises(ValueError, match=match):
        rotary_embedding(args.pop("q"), args.pop("k"), **args)



def test_inplace_refuses_overlapping_slices_of_one_buffer():
    """Overlapping views would rotate the shared heads twice; disjoint ones (fused QKV heads, interleaved
    heads) are fine. The check looked at each view's first element only: even heads and heads 1-3 (both
    hold head 2), or boxes crossing in two dims, got past it and head 2 was rotated twice, silently. An
    expanded k (its heads one memory) raced in the Triton kernel."""
    buf = torch.randn(4, 2, 6, 8)
    for q, k in ((buf[:, :, 0:2], buf[:, :, 1:3]), (buf[:, :, 1:3], buf[:, :, 0:2]), (buf[0:3], buf[1:4]),
                 (buf[:, :, 0::2], buf[:, :, 1:4]), (buf[0:2, :, 1:3], buf[1:3, :, 0:2])):
        with pytest.raises(ValueError, match="not to share elements"):
            rotary_embedding(q, k, inplace=True, backend="torch")
    with pytest.raises(ValueError, match="inplace=True needs k without repeated elements"):
        rotary_embedding(buf[:, :, 0:2], buf[:, :, 5:6].expand(4, 2, 3, 8), inplace=True, backend="torch")
    qkv = torch.randn(4, 2, 12, 8)
    interleaved = torch.randn(4, 2, 6, 8)
    for q, k in ((qkv[:, :, 0:6], qkv[:, :, 6:9]), (interleaved[:, :, 0::2], interleaved[:, :, 1::2])):
        want = rotary_embedding(q, k, backend="torch")
        rotary_embedding(q, k, inplace=True, backend="torch")
        torch.testing.assert_close((q, k), want, rtol=0, atol=0)

def test_strided_head_dim_is_copied_out_of_place():
    q, k = torch.randn(4, 2, 2, 16)[..., ::2], torch.randn(4, 2, 1, 8)
    got = rotary_embedding(q, k, backend="triton")
    ref = rotary_embedding(q.contiguous(), k, backend="triton")
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])


# ----------------------------------------------------------------------------- GPU
GPU_CASES = [(1024, 2, 32, 8, 128, 0), (4096, 1, 32, 8, 128, 0), (333, 3, 12, 4, 80, 77), (64, 4, 16, 16, 64, 8192),
             (17, 2, 8, 2, 256, 131000), (5, 1, 3, 1, 18, 1)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype_name", list(GPU_DTYPES))
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: "s{}-b{}-h{}x{}-d{}-off{}".format(*c))
@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_gpu_backend_matches_references(backend, case, dtype_name):
    """Against HF (fp32, within 1e-6; angles up to 131000 rad take cos / sin's slow range reduction) and
    the fp64 rotation (half precision: within 2x the torch reference's error), forward and backward."""
    skip_unless_backend_runs(backend)
    s, b, hq, hk, d, offset = case
    dtype = GPU_DTYPES[dtype_name]
    q, k = _qk(s, b, hq, hk, d, dtype, device="cuda")
    grads = _qk(s, b, hq, hk, d, dtype, device="cuda", gen_seed=1)
    got = _run(q, k, backend, grads, position_offset=offset)
    torch_same = _run(q, k, "torch", grads, position_offset=offset)
    if dtype == torch.float32:
        q_hf, k_hf = _hf_rope(q, k, offset)
        torch.testing.assert_close(got[0], q_hf, atol=1e-6, rtol=0)
        torch.testing.assert_close(got[1], k_hf, atol=1e-6, rtol=0)
        for a, e in zip(got, torch_same):
            torch.testing.assert_close(a, e, atol=1e-6, rtol=0)
    else:
        refs = (_reference_fp64(q, offset), _reference_fp64(k, offset),
                _reference_fp64(grads[0], offset, inverse=True), _reference_fp64(grads[1], offset, inverse=True))
        for a, t, e in zip(got, torch_same, refs):
            assert_error_within(a.cpu(), t.cpu(), e)


@pytest.mark.gpu
@pytest.mark.parametrize("scaling", [RopeScaling(), YarnScaling(4.0, 8192)], ids=["llama3.1", "yarn-f4"])
@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_gpu_scaled_rotation_matches_hf(backend, scaling):
    """Llama 3.1's frequencies (d 128, theta 5e5, factor 8) and YaRN's at positions past the original context."""
    skip_unless_backend_runs(backend)
    q, k = _qk(64, 2, 16, 4, 128, torch.float32, device="cuda")
    grads = _qk(64, 2, 16, 4, 128, torch.float32, device="cuda", gen_seed=1)
    got = _run(q, k, backend, grads, position_offset=9000, theta=500000.0, rope_scaling=scaling)
    want = _run(q, k, "torch", grads, position_offset=9000, theta=500000.0, rope_scaling=scaling)
    q_hf, k_hf = _hf_rope(q, k, 9000, inv_freq=rope_inv_freq(128, 500000.0, scaling))
    torch.testing.assert_close((got[0], got[1]), (q_hf, k_hf), atol=1e-6, rtol=0)
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e, atol=1e-6, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_gpu_inplace_fused_qkv_and_unaligned(backend):
    """In place on strided views of a fused QKV output, and the scalar path (a 2-byte offset)."""
    skip_unless_backend_runs(backend)
    s, b, hq, hk, d = 300, 2, 8, 2, 128
    qkv = torch.randn(s, b, (hq + 2 * hk) * d, device="cuda", dtype=torch.bfloat16).view(s, b, hq + 2 * hk, d)
    q, k = qkv[:, :, :hq], qkv[:, :, hq:hq + hk]
    q0, k0, v0 = q.clone(), k.clone(), qkv[:, :, hq + hk:].clone()
    ref = rotary_embedding(q0, k0, position_offset=40, backend="torch")
    out = rotary_embedding(q, k, position_offset=40, inplace=True, backend=backend)
    assert out[0] is q and out[1] is k
    assert torch.equal(qkv[:, :, hq + hk:], v0), "v must be untouched"
    assert_error_within(q.cpu(), ref[0].cpu(), _reference_fp64(q0, 40))
    assert_error_within(k.cpu(), ref[1].cpu(), _reference_fp64(k0, 40))
    base = torch.randn(s * b * hq * d + 1, device="cuda", dtype=torch.bfloat16)
    q2 = base[1:].view(s, b, hq, d)
    k2 = torch.randn(s, b, hk, d, device="cuda", dtype=torch.bfloat16)
    got = rotary_embedding(q2, k2, position_offset=5, backend=backend)
    want = rotary_embedding(q2, k2, position_offset=5, backend="torch")
    assert_error_within(got[0].cpu(), want[0].cpu(), _reference_fp64(q2, 5))


def test_triton_rotates_more_row_blocks_than_one_launch_holds(monkeypatch):
    """More blocks of (batch, head) rows than a CUDA grid's second axis holds (65535): the launcher splits b
    over several launches (s = 1, b = 65536, H = 32 at d = 128 is 2**21 rows, 65536 blocks of 32, where the
    kernel failed to launch). Here the limit is lowered to 3 blocks of 2 rows: q (b = 5, H = 3) takes 3
    launches of 2, 2 and 1 batches, k (H = 1) one."""
    import triton

    from seqpar.triton_kernels import rotary as kernel

    class Recorder:
        def __init__(self, jit_fn):
            self.jit_fn, self.grids = jit_fn, []

        def __getitem__(self, grid):
            self.grids.append(grid)
            return self.jit_fn[grid]

    recorder = Recorder(kernel._rope_kernel)
    monkeypatch.setattr(kernel, "_rope_kernel", recorder)
    monkeypatch.setattr(kernel, "MAX_ROW_BLOCKS", 3)
    monkeypatch.setattr(kernel, "_config", lambda n_rows, half: (2, triton.next_power_of_2(half), {}))
    q, k = torch.randn(2, 5, 3, 8), torch.randn(2, 5, 1, 8)
    got = rotary_embedding(q, k, position_offset=3, backend="triton")
    want = rotary_embedding(q, k, position_offset=3, backend="torch")
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert recorder.grids == [(2, 3), (2, 3), (2, 2), (2, 3)]


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_gpu_more_rows_than_one_launch_holds(backend):
    """s = 1, b = 65536, H = 32, d = 64 from an fp32 view 4 bytes off 16-byte alignment (the cuda kernel's
    scalar path): 2**21 (batch, head) rows, past one launch's 65535 row groups in both kernels (the cuda
    entry point refused "b * heads is too large"; auto picks cuda first). Within 1e-6 of the torch backend,
    as test_gpu_backend_matches_references asks in fp32."""
    skip_unless_backend_runs(backend)
    flat = torch.randn(1 * 65536 * 32 * 64 + 1, device="cuda")
    q = flat[1:].view(1, 65536, 32, 64)
    k = q[:, :, :8]
    got = rotary_embedding(q, k, position_offset=7, backend=backend)
    want = rotary_embedding(q, k, position_offset=7, backend="torch")
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_a_position_offset_that_is_a_size_exports_with_a_dynamic_sequence():
    """A position offset computed from a size (positions continuing after a prefix) is a SymInt under
    torch.export with a dynamic sequence length: the check took only a Python int (a ValueError), and the
    op's int() made it a constant of the program (a constraint violation). It stays symbolic now: the
    program rotates every length as eager does (the dropout row offset took a SymInt already; one check
    serves both)."""
    from torch.export import Dim, export

    class ContinuedPositions(torch.nn.Module):
        def forward(self, q, k):
            return rotary_embedding(q, k, position_offset=q.shape[0], backend="torch")

    s = Dim("s", min=2, max=64)
    q = torch.randn(8, 2, 2, 8)
    program = export(ContinuedPositions(), (q, q.clone()), dynamic_shapes=({0: s}, {0: s}), strict=False)
    for length in (8, 13):
        q = torch.randn(length, 2, 2, 8)
        torch.testing.assert_close(program.module()(q, q.clone()), ContinuedPositions()(q, q.clone()), rtol=0, atol=0)
