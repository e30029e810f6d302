"""SwiGLU: HF Llama's MLP activation (reimplemented here) and an fp64 reference against the torch
reference, the triton backend (CPU interpreter here) and the cuda backend (GPU-marked); what is saved for
backward, gradcheck, validation and torch.compile."""
import pytest
import torch
import torch.nn.functional as F

from seqpar.ops import swiglu
from tests.gpu import GPU_DTYPES, skip_unless_backend_runs
from tests.tolerances import assert_close, assert_error_within


def _gate_up(shape, dtype, device="cpu", gen_seed=0):
    """[..., 2n] leaf and the incoming gradient [..., n] (fresh random values, gate spread over silu's range)."""
    g = torch.Generator().manual_seed(gen_seed)
    x = (2.5 * torch.randn(*shape, generator=g)).to(dtype).to(device).requires_grad_()
    grad_y = torch.randn(*shape[:-1], shape[-1] // 2, generator=g).to(dtype).to(device)
    return x, grad_y


def _run(gate_up, grad_y, backend):
    y = swiglu(gate_up, backend=backend)
    (grad,) = torch.autograd.grad(y, gate_up, grad_y)
    return y, grad


def _hf_act(gate_up):
    """HF LlamaMLP's act_fn(gate_proj(x)) * up_proj(x) on the concatenated projections, in fp32."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    return F.silu(gate) * up


def _reference_fp64(gate_up, grad_y):
    x = gate_up.detach().double().cpu().requires_grad_()
    gate, up = x.chunk(2, dim=-1)
    y = gate * torch.sigmoid(gate) * up
    (grad,) = torch.autograd.grad(y, x, grad_y.double().cpu())
    return y, grad


@pytest.fixture
def poisoned_triton(monkeypatch):
    from seqpar.triton_kernels import rows

    real = rows.empty
    monkeypatch.setattr(rows, "empty", lambda shape, dtype, device: real(shape, dtype, device).fill_(float("nan")))


SHAPES = [(1, 2), (3, 5, 2 * 37), (33, 2 * 352)]
SHAPE_IDS = ["1x2", "3x5x74", "33x704"]


def test_torch_reference_is_hf_silu_times_up_bitwise():
    x, _ = _gate_up((4, 9, 2 * 96), torch.float32)
    assert torch.equal(swiglu(x, backend="torch"), _hf_act(x))


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_fp32_matches_fp64_reference(backend, shape, poisoned_triton):
    x, gy = _gate_up(shape, torch.float32)
    y, grad = _run(x, gy, backend)
    y64, grad64 = _reference_fp64(x, gy)
    assert y.shape == shape[:-1] + (shape[-1] // 2,) and grad.shape == x.shape
    assert_close(y, y64, dtype=torch.float32, msg="y")
    assert_close(grad, grad64, dtype=torch.float32, msg="grad_gate_up")
    if backend == "triton":
        y_t, grad_t = _run(x, gy, "torch")
        assert_close(y, y_t, msg="y vs torch")
        assert_close(grad, grad_t, msg="grad vs torch")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_triton_half_error_within_2x_torch(dtype, poisoned_triton):
    x, gy = _gate_up((33, 2 * 352), dtype)
    refs = _reference_fp64(x, gy)
    torch_same = _run(x, gy, "torch")
    got = _run(x, gy, "triton")
    for name, a, t, e in zip(("y", "grad_gate_up"), got, torch_same, refs):
        assert a.dtype == dtype, name
        assert_error_within(a, t, e, name=name)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_strided_rows_and_non_contiguous_layouts(backend):
    """gate_up as a row-strided view (a column block of a wider output), a transposed layout, and rows
    broadcast by expand (row stride 0)."""
    wide, gy = _gate_up((12, 2 * 80), torch.float32)
    x = wide[:, 16:16 + 2 * 40]
    assert x.stride() == (160, 1)
    y, grad = _run(x, gy[:, :40], backend)
    y64, grad64 = _reference_fp64(x, gy[:, :40])
    assert_close(y, y64, dtype=torch.float32)
    assert_close(grad, grad64, dtype=torch.float32)
    t = torch.randn(2 * 8, 5).t()  # last-dim stride 5
    assert torch.equal(swiglu(t, backend=backend), swiglu(t.contiguous(), backend=backend))
    b = torch.randn(1, 2 * 8).expand(6, -1)  # broadcast rows: row stride 0
    assert torch.equal(swiglu(b, backend=backend), swiglu(b.contiguous(), backend=backend))


def _column_major(t: torch.Tensor) -> torch.Tensor:
    """The same values in a column-major layout: what a saved-tensor hook may unpack (autograd asks for the
    values only)."""
    return t.detach().transpose(-1, -2).contiguous().transpose(-1, -2)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_backward_reads_gate_up_unpacked_in_another_layout(backend):
    """A saved-tensor hook that packs gate_up column-major: the Triton backward read it at unit column
    stride (gradient error 7.5 against the fp64 reference's 4e-7)."""
    x, gy = _gate_up((16, 2 * 32), torch.float32)
    with torch.autograd.graph.saved_tensors_hooks(_column_major, lambda t: t):
        y, grad = _run(x, gy, backend)
    y64, grad64 = _reference_fp64(x, gy)
    assert_close(grad, grad64, dtype=torch.float32)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_saves_only_gate_up(backend):
    """Only gate_up (the input itself) is saved: silu is recomputed in backward."""
    x, gy = _gate_up((6, 2 * 24), torch.bfloat16)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = swiglu(x, backend=backend)
    assert len(saved) == 1 and saved[0].data_ptr() == x.data_ptr() and saved[0].shape == x.shape
    y.backward(gy)
    assert x.grad is not None


def test_gradcheck_fp64_torch_backend():
    x = torch.randn(3, 4, 10, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a: swiglu(a, backend="torch"), (x,))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_zero_rows(backend):
    x, gy = _gate_up((0, 8), torch.float32)
    y, grad = _run(x, gy, backend)
    assert y.shape == (0, 4) and grad.shape == (0, 8)


def test_triton_custom_ops_pass_opcheck():
    x = torch.randn(4, 2 * 12)
    torch.library.opcheck(torch.ops.seqpar.swiglu_triton_fwd, (x,))
    torch.library.opcheck(torch.ops.seqpar.swiglu_triton_bwd, (torch.randn(4, 12), x))


def test_torch_compile_traces_the_op():
    torch._dynamo.reset()

    def f(x):
        return swiglu(x * 1.5, backend="triton") + 1.0

    x, _ = _gate_up((3, 5, 2 * 16), torch.float32)
    out_c = torch.compile(f, backend="aot_eager", fullgraph=True)(x)
    (grad_c,) = torch.autograd.grad(out_c.square().sum(), x)
    out_e = f(x)
    (grad_e,) = torch.autograd.grad(out_e.square().sum(), x)
    torch.testing.assert_close(out_c, out_e, rtol=0, atol=0)
    torch.testing.assert_close(grad_c, grad_e, rtol=0, atol=0)


@pytest.mark.parametrize("gate_up,match", [
    pytest.param([1.0, 2.0], "gate_up must be a tensor", id="not_tensor"),
    pytest.param(torch.ones(4, 6, dtype=torch.int32), "gate_up must be", id="int"),
    pytest.param(torch.tensor(1.0), "gate_up must be", id="scalar"),
    pytest.param(torch.randn(4, 7), "even and positive", id="odd_width"),
    pytest.param(torch.randn(4, 0), "even and positive", id="empty_width"),
])
def test_bad_inputs_raise_value_error(gate_up, match):
    with pytest.raises(ValueError, match=match):
        swiglu(gate_up)


def test_bad_backend_and_float64_kernel_refusal():
    with pytest.raises(ValueError, match="unknown backend"):
        swiglu(torch.randn(2, 4), backend="tritonn")
    with pytest.raises(ValueError, match="float64"):
        swiglu(torch.randn(2, 4, dtype=torch.float64), backend="triton")


# ----------------------------------------------------------------------------- GPU
GPU_SHAPES = [(1, 2), (7, 2 * 37), (4096, 2 * 11008), (2, 1024, 2 * 1792), (3, 2 * 14336)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype_name", list(GPU_DTYPES))
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_gpu_backend_matches_references(backend, shape, dtype_name):
    skip_unless_backend_runs(backend)
    dtype = GPU_DTYPES[dtype_name]
    x, gy = _gate_up(shape, dtype, device="cuda")
    got = _run(x, gy, backend)
    torch_same = _run(x, gy, "torch")
    if dtype == torch.float32:
        for a, e in zip(got, torch_same):
            assert_close(a, e)
    else:
        for a, t, e in zip(got, torch_same, _reference_fp64(x, gy)):
            assert_error_within(a.cpu(), t.cpu(), e)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_gpu_strided_and_unaligned(backend):
    skip_unless_backend_runs(backend)
    wide = torch.randn(300, 2 * 4096, device="cuda", dtype=torch.bfloat16)
    broadcast = torch.randn(1, 2 * 2048, device="cuda", dtype=torch.bfloat16).expand(300, -1)  # row stride 0
    # 16-byte aligned rows, then 2-byte offset, then one row read by all (the cuda kernel refused ld < 2n)
    for x in (wide[:, 8:8 + 2 * 2048], wide[:, 1:1 + 2 * 2047], broadcast):
        x = x.requires_grad_() if x.is_leaf else x.detach().requires_grad_()
        gy = torch.randn(300, x.shape[1] // 2, device="cuda", dtype=torch.bfloat16)
        for a, t, e in zip(_run(x, gy, backend), _run(x, gy, "torch"), _reference_fp64(x, gy)):
            assert_error_within(a.cpu(), t.cpu(), e)
    x = wide[:, 8:8 + 2 * 2048].detach().requires_grad_()       # gate_up unpacked column-major in backward
    gy = torch.randn(300, 2048, device="cuda", dtype=torch.bfloat16)
    with torch.autograd.graph.saved_tensors_hooks(_column_major, lambda t: t):
        hooked = _run(x, gy, backend)
    for a, t, e in zip(hooked, _run(x, gy, "torch"), _reference_fp64(x, gy)):
        assert_error_within(a.cpu(), t.cpu(), e)
