"""Fused residual add + RMSNorm: HF LlamaRMSNorm's formula (reimplemented here) and an fp64 reference
against the torch reference, the triton backend (CPU interpreter here; whole and chunked rows) and the
cuda backend (GPU-marked); what is saved for backward, gradcheck, validation and torch.compile."""
import pytest
import torch

from seqpar.ops import add_rms_norm
from tests.gpu import GPU_DTYPES, skip_unless_backend_runs
from tests.tolerances import assert_error_within, assert_fp32_outputs

EPS = 1e-6
OUT_NAMES = ("y", "residual_out", "grad_x", "grad_residual", "grad_weight")


# ----------------------------------------------------------------------------- helpers
def _make_inputs(shape, dtype, device="cpu", has_residual=True, w_dtype=None, gen_seed=0):
    """Fresh random leaves (never zeros) and the two incoming gradients."""
    g = torch.Generator().manual_seed(gen_seed)
    h = shape[-1]

    def rnd(*s, scale=1.0, shift=0.0, dt=dtype):
        return (torch.randn(*s, generator=g) * scale + shift).to(dt).to(device).requires_grad_()

    return dict(x=rnd(*shape), residual=rnd(*shape, scale=2.0, shift=0.3) if has_residual else None,
                weight=rnd(h, scale=0.3, shift=1.0, dt=w_dtype or dtype),
                grad_y=torch.randn(*shape, generator=g).to(dtype).to(device),
                grad_residual_out=torch.randn(*shape, generator=g).to(dtype).to(device))


def _run(inp, backend, use_residual_out=True):
    """(y, residual_out, grad_x, grad_residual or None, grad_weight)."""
    y, ro = add_rms_norm(inp["x"], inp["residual"], inp["weight"], eps=EPS, backend=backend)
    loss = (y.float() * inp["grad_y"].float()).sum()
    if use_residual_out:
        loss = loss + (ro.float() * inp["grad_residual_out"].float()).sum()
    leaves = [t for t in (inp["x"], inp["residual"], inp["weight"]) if t is not None]
    grads = iter(torch.autograd.grad(loss, leaves))
    gx = next(grads)
    gres = next(grads) if inp["residual"] is not None else None
    return y, ro, gx, gres, next(grads)


def _hf_rms_norm(hidden_states, weight, eps=EPS):
    """HF Llama's LlamaRMSNorm.forward, written out (transformers is not imported in these tests)."""
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + eps)
    return weight * hidden_states.to(input_dtype)


def _reference_fp64(inp, use_residual_out=True):
    """The math directly in float64 (residual_out as the op stores it: rounded to the input dtype), on the
    inputs' device: built on the host, the 20000-row GPU cases took about a minute each."""
    x = inp["x"].detach().double().requires_grad_()
    res = None if inp["residual"] is None else inp["residual"].detach().double().requires_grad_()
    w = inp["weight"].detach().double().requires_grad_()
    ro = x if res is None else x + res
    y = ro * torch.rsqrt(ro.pow(2).mean(-1, keepdim=True) + EPS) * w
    loss = (y * inp["grad_y"].double()).sum()
    if use_residual_out:
        loss = loss + (ro * inp["grad_residual_out"].double()).sum()
    leaves = [t for t in (x, res, w) if t is not None]
    grads = iter(torch.autograd.grad(loss, leaves))
    gx = next(grads)
    return y, ro, gx, (next(grads) if res is not None else None), next(grads)


def _check_fp32(got, torch_fp32, ref64):
    assert_fp32_outputs(OUT_NAMES, got, torch_fp32, ref64, ("grad_weight",))   # grad_weight sums every row


def _check_error_within(got, torch_same_dtype, ref64):
    for name, a, t, e in zip(OUT_NAMES, got, torch_same_dtype, ref64):
        if e is None:
            continue
        assert not torch.isnan(a).any(), f"{name}: NaN (unwritten output?)"
        assert a.dtype == t.dtype, name
        assert_error_within(a, t, e, name=name)   # on the outputs' device, as the reference


@pytest.fixture
def poisoned_triton(monkeypatch):
    """Every buffer the Triton launchers allocate starts as NaN."""
    from seqpar.triton_kernels import rms_norm as kernels, rows

    real = rows.empty
    monkeypatch.setattr(rows, "empty", lambda shape, dtype, device: real(shape, dtype, device).fill_(float("nan")))
    return kernels


@pytest.fixture
def chunked_triton(poisoned_triton, monkeypatch):
    """Rows longer than 64 columns take the chunked kernels (32-column chunks)."""
    monkeypatch.setattr(poisoned_triton, "MAX_FUSED_HIDDEN", 64)
    monkeypatch.setattr(poisoned_triton, "MAX_FUSED_HIDDEN_BWD", 64)
    monkeypatch.setattr(poisoned_triton, "CHUNK_COLUMNS", 32)
    return poisoned_triton


# ----------------------------------------------------------------------------- the torch reference
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_torch_reference_is_hf_llama_rms_norm_bitwise(dtype):
    """y equals LlamaRMSNorm(x + residual) bit for bit (weight in the input dtype), for [b, s, h] inputs."""
    inp = _make_inputs((2, 9, 96), dtype)
    y, ro = add_rms_norm(inp["x"], inp["residual"], inp["weight"], eps=EPS, backend="torch")
    with torch.no_grad():
        hidden = inp["residual"] + inp["x"]  # HF: residual + hidden_states
        assert torch.equal(ro, hidden)
        assert torch.equal(y, _hf_rms_norm(hidden, inp["weight"]))
        y_none, ro_none = add_rms_norm(inp["x"], None, inp["weight"], eps=EPS, backend="torch")
        assert torch.equal(y_none, _hf_rms_norm(inp["x"], inp["weight"]))
        assert torch.equal(ro_none, inp["x"])


@pytest.mark.parametrize("has_residual", [True, False], ids=["residual", "no_residual"])
def test_torch_reference_matches_fp64_math(has_residual):
    inp = _make_inputs((3, 5, 77), torch.float32, has_residual=has_residual)
    for name, a, e in zip(OUT_NAMES, _run(inp, "torch"), _reference_fp64(inp)):
        if e is not None:
            torch.testing.assert_close(a.double(), e, atol=1e-5, rtol=1e-5, msg=name)


def test_gradcheck_fp64_torch_backend():
    g = torch.Generator().manual_seed(3)
    x, res = (torch.randn(4, 13, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    w = (1 + 0.2 * torch.randn(13, generator=g, dtype=torch.float64)).requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b, c: add_rms_norm(a, b, c, eps=1e-3, backend="torch"), (x, res, w))
    assert torch.autograd.gradcheck(lambda a, c: add_rms_norm(a, None, c, eps=1e-3, backend="torch"), (x, w))


# ----------------------------------------------------------------------------- triton vs the references (CPU)
SHAPES = [(1, 7), (3, 5, 100), (37, 768)]
SHAPE_IDS = ["1x7", "3x5x100", "37x768"]


@pytest.mark.parametrize("has_residual", [True, False], ids=["residual", "no_residual"])
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_triton_fp32_matches_torch_reference(shape, has_residual, poisoned_triton):
    inp = _make_inputs(shape, torch.float32, has_residual=has_residual)
    ref = _run(inp, "torch")
    got = _run(inp, "triton")
    assert torch.equal(got[1], ref[1]), "residual_out must be bitwise equal"
    _check_fp32(got, ref, _reference_fp64(inp))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("shape", SHAPES[1:], ids=SHAPE_IDS[1:])
def test_triton_half_error_within_2x_torch(shape, dtype, poisoned_triton):
    inp = _make_inputs(shape, dtype, w_dtype=torch.float32 if dtype == torch.float16 else None)
    ref64 = _reference_fp64(inp)
    torch_same = _run(inp, "torch")
    got = _run(inp, "triton")
    assert torch.equal(got[1], torch_same[1]), "residual_out must be bitwise equal (same rounding)"
    _check_error_within(got, torch_same, ref64)


@pytest.mark.parametrize("has_residual", [True, False], ids=["residual", "no_residual"])
@pytest.mark.parametrize("h", [100, 131], ids=["h100", "h131"])
def test_triton_chunked_rows(h, has_residual, chunked_triton):
    """Rows longer than the fused limit: two passes over 32-column chunks; the backward's row-sum pass (its
    buffer starts as NaN) and its (rows, chunk) grid."""
    inp = _make_inputs((2, 9, h), torch.float32, has_residual=has_residual)
    _check_fp32(_run(inp, "triton"), _run(inp, "torch"), _reference_fp64(inp))
    inp = _make_inputs((19, h), torch.bfloat16, has_residual=has_residual, gen_seed=1)
    _check_error_within(_run(inp, "triton"), _run(inp, "torch"), _reference_fp64(inp))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_unused_residual_out_and_strided_rows(backend):
    """x and residual as row-strided views; no gradient reaching residual_out (nothing read for it)."""
    inp = _make_inputs((11, 2 * 48), torch.float32)
    for name in ("x", "residual"):
        inp[name] = inp[name].detach()[:, 7:55].requires_grad_()
    inp["weight"] = inp["weight"].detach()[:48].clone().requires_grad_()
    inp["grad_y"] = inp["grad_y"][:, :48]
    assert inp["x"].stride() == (96, 1)
    ref64 = _reference_fp64(inp, use_residual_out=False)
    _check_fp32(_run(inp, backend, use_residual_out=False), ref64, ref64)   # each backend against the exact math


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("has_residual", [True, False], ids=["residual", "no_residual"])
def test_only_residual_out_used(backend, has_residual):
    """No gradient reaches y: x and residual get grad_residual_out, the weight none, as autograd gives an
    unused plain-torch norm. The op ran the norm backward on a zeros gradient: an inf in one row of x made
    that row's gradients NaN (0 * x_hat), and the weight got a zero (or NaN) gradient that an optimizer
    then decays."""
    inp = _make_inputs((5, 24), torch.float32, has_residual=has_residual)
    with torch.no_grad():
        inp["x"][0, 3] = float("inf")
    _, ro = add_rms_norm(inp["x"], inp["residual"], inp["weight"], backend=backend)
    leaves = [t for t in (inp["x"], inp["residual"], inp["weight"]) if t is not None]
    grads = torch.autograd.grad((ro * inp["grad_residual_out"]).sum(), leaves, allow_unused=True)
    for g in grads[:-1]:
        torch.testing.assert_close(g, inp["grad_residual_out"], rtol=0, atol=0)
    assert grads[-1] is None


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_x_and_residual_gradients_are_equal_and_independent(backend):
    inp = _make_inputs((6, 40), torch.float32)
    y, ro = add_rms_norm(inp["x"], inp["residual"], inp["weight"], backend=backend)
    ((y * inp["grad_y"]).sum() + ro.square().sum()).backward()
    assert torch.equal(inp["x"].grad, inp["residual"].grad)
    inp["x"].grad.add_(1.0)  # the two .grad tensors must not share memory
    assert not torch.equal(inp["x"].grad, inp["residual"].grad)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("has_residual", [True, False], ids=["residual", "no_residual"])
def test_saved_for_backward_is_residual_out_and_rstd(backend, has_residual):
    """Saved: residual_out [rows, h] (x itself without a residual), fp32 rstd [rows], the weight (a parameter)."""
    inp = _make_inputs((6, 50), torch.bfloat16, has_residual=has_residual)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _, ro = add_rms_norm(inp["x"], inp["residual"], inp["weight"], backend=backend)
    assert sorted(((tuple(t.shape), t.dtype) for t in saved), key=str) == sorted(
        [((6, 50), torch.bfloat16), ((50,), torch.bfloat16), ((6,), torch.float32)], key=str)
    if not has_residual:
        assert any(t.data_ptr() == inp["x"].data_ptr() for t in saved), "x itself is saved, not a copy"
        assert ro.data_ptr() == inp["x"].data_ptr()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_zero_rows(backend):
    inp = _make_inputs((0, 16), torch.float32)
    y, ro, gx, gres, gw = _run(inp, backend)
    assert y.shape == ro.shape == gx.shape == (0, 16)
    assert gw.shape == (16,) and not gw.abs().sum()


def _grads_with_frozen_weight(inp, backend, frozen):
    """(y, residual_out, x.grad, residual.grad, weight.grad) of fresh leaves, the weight frozen or not."""
    x, res, w = (inp[n].detach().clone().requires_grad_(not (frozen and n == "weight"))
                 for n in ("x", "residual", "weight"))
    y, ro = add_rms_norm(x, res, w, eps=EPS, backend=backend)
    ((y.float() * inp["grad_y"]).sum() + (ro.float() * inp["grad_residual_out"]).sum()).backward()
    return y, ro, x.grad, res.grad, w.grad


@pytest.mark.parametrize("h", [48, 96], ids=["whole", "chunked"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_frozen_weight_gets_no_gradient_and_no_column_sum(backend, h, chunked_triton, monkeypatch):
    """A frozen RMSNorm weight (PEFT / LoRA): no gradient, as autograd gives a leaf that doesn't require
    one, and the Triton backward writes no partial rows and launches no reduction (before, it computed the
    weight's column sum for autograd to drop); the other outputs are bitwise the trainable run's."""
    from seqpar.triton_kernels import rows

    reduced = []
    real = rows.reduce_partials
    monkeypatch.setattr(rows, "reduce_partials", lambda partials: reduced.append(partials.shape) or real(partials))
    inp = _make_inputs((3, 5, h), torch.float32)
    got = _grads_with_frozen_weight(inp, backend, frozen=True)
    assert got[4] is None and not reduced
    want = _grads_with_frozen_weight(inp, backend, frozen=False)
    assert len(reduced) == (backend == "triton")
    for name, g, w in zip(OUT_NAMES[:4], got, want):
        assert torch.equal(g, w), name


def test_triton_custom_ops_pass_opcheck():
    x, res, w = torch.randn(4, 24), torch.randn(4, 24), torch.randn(24)
    fwd = torch.ops.seqpar.add_rms_norm_triton_fwd
    torch.library.opcheck(fwd, (x, res, w, EPS))
    torch.library.opcheck(fwd, (x, None, w, EPS))
    _, ro, rstd = fwd(x, res, w, EPS)
    bwd = torch.ops.seqpar.add_rms_norm_triton_bwd
    torch.library.opcheck(bwd, (torch.randn(4, 24), torch.randn(4, 24), ro, w, rstd, True, True))
    torch.library.opcheck(bwd, (torch.randn(4, 24), None, ro, w, rstd, False, True))
    torch.library.opcheck(bwd, (torch.randn(4, 24), None, ro, w, rstd, True, False))   # a frozen weight


def test_torch_compile_traces_the_op():
    """fullgraph=True through backend selection, the autograd.Function and the custom ops (aot_eager:
    Inductor's C++ build takes minutes on a 2-core CPU)."""
    torch._dynamo.reset()

    def f(x, residual, w):
        y, ro = add_rms_norm(x, residual, w, backend="triton")
        return y * 2.0, ro + 1.0

    inp = _make_inputs((3, 5, 64), torch.float32)
    args = (inp["x"], inp["residual"], inp["weight"])
    outs_c = torch.compile(f, backend="aot_eager", fullgraph=True)(*args)
    grads_c = torch.autograd.grad(outs_c[0].sum() + outs_c[1].square().sum(), args)
    outs_e = f(*args)
    grads_e = torch.autograd.grad(outs_e[0].sum() + outs_e[1].square().sum(), args)
    for a, e in zip(outs_c + grads_c, outs_e + grads_e):
        torch.testing.assert_close(a, e, rtol=0, atol=0)


# ----------------------------------------------------------------------------- validation
def _valid():
    return dict(x=torch.randn(3, 8), residual=torch.randn(3, 8), weight=torch.randn(8))


BAD_INPUTS = [
    ("residual_shape", dict(residual=torch.randn(3, 9)), "residual shape"),
    ("residual_dtype", dict(residual=torch.randn(3, 8, dtype=torch.bfloat16)), "residual dtype.*promote nothing"),
    ("weight_shape", dict(weight=torch.randn(9)), "weight must be"),
    ("weight_int", dict(weight=torch.ones(8, dtype=torch.int64)), "weight must be"),
    ("x_int", dict(x=torch.ones(3, 8, dtype=torch.int32)), "x must be"),
    ("x_scalar", dict(x=torch.tensor(1.0), residual=None, weight=torch.randn(())), "x must be"),
    ("empty_hidden", dict(x=torch.randn(3, 0), residual=None, weight=torch.randn(0)), "non-empty last"),
    ("x_not_tensor", dict(x=[[1.0] * 8] * 3), "x must be a tensor"),
    ("residual_not_tensor", dict(residual=1.0), "residual must be a tensor"),
    ("device_mismatch", dict(weight=torch.randn(8, device="meta")), "one device"),
    ("eps_zero", dict(eps=0.0), "eps must be"),
    ("eps_nan", dict(eps=float("nan")), "eps must be"),
    ("eps_string", dict(eps="1e-6"), "eps must be"),
    ("backend_unknown", dict(backend="tritonn"), "unknown backend"),
]


@pytest.mark.parametrize("overrides,match", [pytest.param(o, m, id=i) for i, o, m in BAD_INPUTS])
def test_bad_inputs_raise_value_error(overrides, match):
    args = {**_valid(), "eps": EPS, "backend": "torch", **overrides}
    with pytest.raises(ValueError, match=match):
        add_rms_norm(args["x"], args["residual"], args["weight"], eps=args["eps"], backend=args["backend"])


def test_float64_runs_on_the_torch_backend_only():
    x = torch.randn(2, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match="backend 'triton' can't run add_rms_norm: float64"):
        add_rms_norm(x, None, torch.ones(8, dtype=torch.float64), backend="triton")
    y, _ = add_rms_norm(x, None, torch.ones(8, dtype=torch.float64))  # auto: torch
    assert y.dtype == torch.float64


def test_non_contiguous_layouts_are_handled():
    """A transposed x (last-dim stride != 1) is copied into rows; the result is the contiguous one's."""
    x, res, w = torch.randn(8, 5).t(), torch.randn(5, 8), torch.randn(8)
    y, ro = add_rms_norm(x, res, w, backend="triton")
    y_ref, ro_ref = add_rms_norm(x.contiguous(), res, w, backend="triton")
    assert torch.equal(y, y_ref) and torch.equal(ro, ro_ref)


# ----------------------------------------------------------------------------- GPU
# warp per row, block per row, odd (scalar) rows, and chunked rows: shared-memory sums (bf16 beyond 16384,
# fp32 beyond 8192) and global-memory sums (h * 4 bytes over the shared memory of a block).
GPU_SHAPES = [(1, 7), (3, 5, 256), (64, 1000), (17, 4096), (4, 5120), (3, 8192), (5, 12288), (2, 3, 16384),
              (3, 24576), (2, 40000), (2, 70000)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype_name", list(GPU_DTYPES))
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_gpu_backend_matches_references(backend, shape, dtype_name):
    skip_unless_backend_runs(backend)
    dtype = GPU_DTYPES[dtype_name]
    for has_residual in (True, False):
        inp = _make_inputs(shape, dtype, device="cuda", has_residual=has_residual)
        torch_same = _run(inp, "torch")
        got = _run(inp, backend)
        torch.cuda.synchronize()
        assert torch.equal(got[1], torch_same[1]), "residual_out must be bitwise equal"
        ref64 = _reference_fp64(inp)
        if dtype == torch.float32:
            _check_fp32(got, torch_same, ref64)
        else:
            _check_error_within(got, torch_same, ref64)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_gpu_unaligned_strided_and_many_rows(backend):
    """Scalar paths (a 2-byte offset), strided rows, no gradient for residual_out, and more rows than one
    wave of blocks (the grid-stride loop and the partial-row reduction)."""
    skip_unless_backend_runs(backend)
    base = torch.randn(64 * 1024 + 1, device="cuda", dtype=torch.bfloat16)
    x = base[1:].view(64, 1024).requires_grad_()
    inp = dict(x=x, residual=torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True),
               weight=torch.randn(1024, device="cuda", requires_grad=True),
               grad_y=torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16),
               grad_residual_out=torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16))
    _check_error_within(_run(inp, backend, use_residual_out=False), _run(inp, "torch", use_residual_out=False),
                        _reference_fp64(inp, use_residual_out=False))
    wide = torch.randn(300, 2 * 2048, device="cuda", requires_grad=True)
    inp = _make_inputs((300, 2048), torch.float32, device="cuda")
    inp["x"] = wide[:, 5:2053]
    _check_fp32(_run(inp, backend), _run(inp, "torch"), _reference_fp64(inp))
    for h in (256, 1024, 6144):
        inp = _make_inputs((20000, h), torch.float32, device="cuda")
        _check_fp32(_run(inp, backend), _run(inp, "torch"), _reference_fp64(inp))


@pytest.mark.gpu
@pytest.mark.parametrize("h", [512, 4096, 8192], ids=["warp", "block", "long"])
@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_gpu_frozen_weight(backend, h):
    skip_unless_backend_runs(backend)
    inp = _make_inputs((37, h), torch.bfloat16, device="cuda")
    got = _grads_with_frozen_weight(inp, backend, frozen=True)
    want = _grads_with_frozen_weight(inp, backend, frozen=False)
    assert got[4] is None
    for name, g, w in zip(OUT_NAMES[:4], got, want):
        assert torch.equal(g, w), name


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_gpu_torch_compile_inductor(backend):
    skip_unless_backend_runs(backend)
    torch._dynamo.reset()

    def f(x, residual, w):
        y, ro = add_rms_norm(x, residual, w, backend=backend)
        return torch.nn.functional.silu(y), ro * 0.5

    inp = _make_inputs((256, 2048), torch.bfloat16, device="cuda")
    args = (inp["x"], inp["residual"], inp["weight"])
    outs_c = torch.compile(f, fullgraph=True)(*args)
    outs_e = f(*args)
    assert torch.equal(outs_c[1], outs_e[1])
    torch.testing.assert_close(outs_c[0], outs_e[0], atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("residual_given", [True, False], ids=["residual", "no-residual"])
def test_residual_out_requires_grad_only_when_its_inputs_do(residual_given):
    """residual_out = x + residual does not depend on the weight, yet it came back requiring grad when
    only the weight did."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(2, 3, 16, generator=gen)
    residual = torch.randn(2, 3, 16, generator=gen) if residual_given else None
    weight = torch.randn(16, generator=gen, requires_grad=True)
    y, residual_out = add_rms_norm(x, residual, weight, backend="torch")
    assert y.requires_grad and not residual_out.requires_grad
    y.sum().backward()
    r = x if residual is None else x + residual
    torch.testing.assert_close(weight.grad, (r * torch.rsqrt(r.square().mean(-1, keepdim=True) + 1e-6)).sum(dim=(0, 1)),
                               rtol=1e-5, atol=1e-5)



@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_x_changed_in_place_after_the_forward_is_autograd_s_version_error(backend):
    """Without a residual the op saved a [rows, h] view of x made inside the Function (grad mode off): an
    in-place change of x after the forward raised autograd's "a view was created in no_grad mode" advice,
    which fit neither what was done nor the fix; torch.nn.RMSNorm (and the LayerNorm op) raise the version
    error naming the tensor."""
    x = torch.randn(4, 2, 8).mul(1.0).requires_grad_()   # a non-leaf, as a layer's output is
    weight = torch.ones(8, requires_grad=True)
    y, _ = add_rms_norm(x, None, weight, backend=backend)
    with torch.no_grad():
        x.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()
