"""Regenerated-mask dropout: torch reference semantics and the CUDA kernel of csrc/dropout.cu."""
import dataclasses

import pytest
import torch

import seqpar
from seqpar import _ext
from seqpar.ops import bias_dropout_add_layer_norm
from seqpar.ops import registry
from seqpar.ops.dropout import (OP, DropoutSpec, apply_keep_mask, bias_dropout_add, dropout, make_dropout_spec,
                                select_backend)
from seqpar.random import dropout_threshold, philox4x32


def _masked(x, spec, backend="auto"):
    """apply_keep_mask on the backend the op "dropout" selects for x (no autograd)."""
    return apply_keep_mask(x, spec, select_backend(x, backend))


def _count_kernel_launches(monkeypatch, launched):
    """Wrap the dropout op's kernel backends so that each call appends the backend's name to ``launched``."""
    for name in ("cuda", "triton"):
        impl = registry.get(OP, name)

        def counted(x, spec, *fused, impl=impl, name=name):
            launched.append(name)
            return impl.forward(x, spec, *fused)
        monkeypatch.setitem(registry._REGISTRY[OP], name, dataclasses.replace(impl, forward=counted, backward=counted))


def _keep_by_definition(seed, rows, n_cols, p):
    """Element (r, c) is kept iff byte c % 4 of word (c % 16) // 4 of Philox-4x32-7(seed, (c // 16, r_lo,
    r_hi, 0)) is >= round(p * 256): computed per element, without the reference's group expansion."""
    r = rows.view(-1, 1)
    c = torch.arange(n_cols).view(1, -1)
    words = torch.stack(philox4x32(seed, c // 16, r & 0xFFFFFFFF, r >> 32, torch.zeros(1, dtype=torch.int64)))
    word = words.gather(0, ((c % 16) // 4).expand(r.shape[0], -1).unsqueeze(0))[0]
    return ((word >> (8 * (c % 4))) & 0xFF) >= round(p * 256)


@pytest.mark.parametrize("row_offset", [40, 2**31 - 9, 2**40 + 3], ids=["r40", "r2^31", "r2^40"])
def test_mask_matches_definition_and_backward_regenerates(row_offset):
    spec = DropoutSpec(0.25, 2**40 + 1234, row_offset)
    x = torch.randn(5, 7, 33, requires_grad=True)
    y = dropout(x, spec)
    keep = _keep_by_definition(spec.seed, torch.arange(35) + row_offset, 33, 0.25).view(5, 7, 33)
    assert 0.6 < keep.float().mean() < 0.9
    scale = float(torch.tensor(256 / 192, dtype=torch.float32))
    torch.testing.assert_close(y, x * keep * scale, rtol=0, atol=0)
    g = torch.randn_like(y)
    y.backward(g)
    torch.testing.assert_close(x.grad, g * keep * scale, rtol=0, atol=0)


def test_row_offset_shards_compose():
    spec = DropoutSpec(0.5, 9, 0)
    x = torch.randn(12, 16)
    full = _masked(x, spec)
    top = _masked(x[:5], spec)
    bottom = _masked(x[5:], DropoutSpec(0.5, 9, 5))
    assert torch.equal(torch.cat([top, bottom]), full)


def test_spec_threshold_scale_and_small_p():
    spec = DropoutSpec(0.1, 3, 0)
    assert spec.threshold == 26 and spec.active
    assert spec.scale == float(torch.tensor(256 / 230, dtype=torch.float32))
    x = torch.randn(4, 40)
    assert _masked(x, DropoutSpec(0.0, 3, 0)) is x and not DropoutSpec(0.0, 3, 0).active
    for build in (lambda: DropoutSpec(0.001, 3, 0), lambda: make_dropout_spec(0.001, True, 3)):
        with pytest.warns(UserWarning, match="drops nothing"):   # round(0.256) = 0: it dropped nothing, silently
            assert not build().active


def test_bias_dropout_add_and_validation():
    x, bias, res = torch.randn(4, 8), torch.randn(8), torch.randn(4, 8)
    spec = DropoutSpec(0.3, 5, 0)
    torch.testing.assert_close(bias_dropout_add(x, bias, res, spec), res + _masked(x + bias, spec))
    assert not make_dropout_spec(0.3, False, None).active
    for bad in (1.0, -0.1, "0.1", 0.999):
        with pytest.raises(ValueError, match="dropout probability"):
            make_dropout_spec(bad, True, 1)
    with pytest.raises(ValueError, match=r"round\(p \* 256\) < 256.*0.9985"):
        DropoutSpec(0.9985, 1, 0)
    assert dropout_threshold(0.9975) == 255



def test_bias_dropout_add_broadcasts_nothing():
    """Each mismatch a ValueError naming the argument: no broadcast (one mask row shared by every row of a
    residual), no dtype promotion, no device error from deep inside."""
    x, bias, res = torch.randn(3, 8), torch.randn(8), torch.randn(3, 8)
    spec = DropoutSpec(0.5, 5, 0)
    bad = {
        "bias of another width": (x, torch.randn(1), res, spec, r"bias must be a \[8\] tensor"),
        "residual of x's row": (x, bias, torch.randn(8), spec, r"residual must be a \[3, 8\] tensor"),
        "x one row, residual three": (torch.randn(8), torch.randn(8), res, spec, r"residual must be a \[8\]"),
        "residual with a batch dim more": (x, bias, torch.randn(5, 3, 8), spec, "residual must be"),
        "fp32 residual on fp16 x": (x.half(), bias.half(), res, spec, "of x's torch.float16"),
        "residual on another device": (x, bias, res.to("meta"), spec, "on cpu, got torch.float32 .* on meta"),
        "spec a float": (x, bias, res, 0.5, "spec must be a seqpar.ops.DropoutSpec, got float"),
        "integer x": (x.long(), None, res.long(), spec, "x must be a floating"),
    }
    for name, (xb, bb, rb, sb, match) in bad.items():
        with pytest.raises(ValueError, match=match):
            bias_dropout_add(xb, bb, rb, sb)
    torch.testing.assert_close(bias_dropout_add(x, None, res, spec), res + _masked(x, spec))


def test_dropout_and_spec_validation():
    spec = DropoutSpec(0.5, 5, 0)
    for x, match in ((torch.ones(3, 8, dtype=torch.int64), "x must be a floating"),
                     (torch.tensor(1.0), r"x must be a floating \[\.\.\., h\] tensor, got torch.float32 \(\)")):
        with pytest.raises(ValueError, match=match):
            dropout(x, spec)
    with pytest.raises(ValueError, match="spec must be"):
        dropout(torch.randn(3, 8), 0.5)
    empty = torch.randn(3, 0)
    assert dropout(empty, spec) is empty                  # nothing to drop (reshape(-1, 0) is ambiguous)
    # The fields the kernels read are checked as the fused ops check them: 2**64 would alias seed 0.
    for kwargs, match in (({"seed": 1.5}, "seed must be an int"), ({"seed": -1}, "seed must be an int"),
                          ({"seed": 2**64}, r"seed must be an int in \[0, 2\*\*62\)"),
                          ({"row_offset": -3}, r"row_offset must be an int in \[0, 2\*\*62\), got -3"),
                          ({"row_offset": True}, "row_offset must be an int"),
                          # rows count on from it in int64: 2**64 was an OverflowError deep in a kernel call
                          ({"row_offset": 2**62}, r"row_offset must be an int in \[0, 2\*\*62\), got 4611686018427387904")):
        with pytest.raises(ValueError, match=match):
            DropoutSpec(0.5, **kwargs)
    # training must be a bool ("False" is truthy), and a given seed is checked even with dropout off.
    for training in ("False", None, 1):
        with pytest.raises(ValueError, match="training must be a bool"):
            make_dropout_spec(0.5, training, 3)
    with pytest.raises(ValueError, match="seed must be an int"):
        make_dropout_spec(0.5, False, -1)

@pytest.mark.gpu
@pytest.mark.parametrize("cols", [1000, 1003], ids=["aligned", "ragged"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cuda_kernel_matches_reference(dtype, cols):
    from seqpar import _ext

    if _ext.cuda_extension_error():
        pytest.skip(_ext.cuda_extension_error())
    spec = DropoutSpec(0.1, 2**40 + 3, 2**32 - 77)
    x = torch.randn(300, cols, device="cuda", dtype=dtype)
    got = _masked(x, spec, "cuda")
    keep = spec.keep_mask_2d(300, cols, "cpu")
    expected = (x.float().cpu() * keep * spec.scale).to(dtype)
    assert torch.equal(got.cpu(), expected)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_dropped_inf_or_nan_is_zero_as_in_the_kernels(backend):
    """The torch reference computed x * keep * scale: a dropped inf became NaN (inf * 0), and the layer
    norm's whole row with it, where the Triton and CUDA kernels select 0. Dropped positions hold inf and
    NaN here, forward and backward; kept ones are finite."""
    spec = make_dropout_spec(0.5, True, 123)
    keep = spec.keep_mask_2d(4, 32, "cpu")
    x = torch.randn(4, 32).masked_fill(~keep, float("inf"))
    x[~keep & (torch.arange(32) % 2 == 0)] = float("nan")
    residual, weight, bias = torch.randn(4, 32), torch.ones(32), torch.zeros(32)
    x.requires_grad_()
    y, residual_out = bias_dropout_add_layer_norm(x, None, residual, weight, bias, p=0.5, seed=123, backend=backend)
    want = residual + torch.where(keep, x.detach() * spec.scale, 0.0)
    assert torch.equal(residual_out, want) and y.isfinite().all()
    grad = torch.randn(4, 32).masked_fill(~keep, float("nan"))   # through the mask again: dropped -> 0
    residual_out.backward(grad)
    assert torch.equal(x.grad, torch.where(keep, grad * spec.scale, 0.0))


def test_the_output_takes_in_place_ops_like_f_dropout():
    """``out = dropout(x, spec); out += residual`` raised "Output 0 of _Dropout is a view and is being
    modified inplace" (the op returned a view of its [rows, h] result); F.dropout's output takes it. The
    gradient of the in-place sum is the mask's, scaled."""
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(4, 3, 40, generator=gen, requires_grad=True)
    residual = torch.randn(4, 3, 40, generator=gen)
    spec = DropoutSpec(0.3, 17, 0)
    out = dropout(x, spec)
    out += residual
    weights = torch.randn(4, 3, 40, generator=gen)
    (out * weights).sum().backward()
    keep = spec.keep_mask_2d(12, 40, x.device).view(4, 3, 40)
    torch.testing.assert_close(out, torch.where(keep, x.detach() * spec.scale, 0.0) + residual, rtol=0, atol=0)
    torch.testing.assert_close(x.grad, torch.where(keep, weights * spec.scale, 0.0), rtol=0, atol=0)


@pytest.mark.skipif(_ext.cuda_extension_error() is not None, reason="needs the built CUDA extension seqpar._C")
def test_the_cuda_mask_kernel_is_a_custom_op_that_traces(monkeypatch):
    """CUDA tensors take csrc/dropout.cu. It was called on ``data_ptr()`` straight from the autograd
    Function: torch.compile broke the graph there in every layer with dropout (fullgraph=True failed), and
    a fake tensor has no data. As a custom op it traces to one node with a fake implementation (fake CUDA
    tensors here: no GPU needed; without autograd, which a CPU-only torch can't build for them).
    On a GPU the build has no kernels for (simulated, and Triton set aside) the mask comes from the torch
    reference instead: the kernel was launched whenever the extension imported, and failed there ("no
    kernel image")."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    launched = []
    _count_kernel_launches(monkeypatch, launched)
    monkeypatch.setattr(_ext, "triton_unavailable_reason", lambda device, auto=False: "no triton here")
    spec = DropoutSpec(0.25, 9, 2**40)
    for gpu_reason in (None, "seqpar._C has no kernels for this GPU (sm_75: no kernel image)"):
        monkeypatch.setattr(_ext, "cuda_unavailable_reason", lambda device, reason=gpu_reason: reason)
        launched.clear()
        with FakeTensorMode():
            x = torch.empty(6, 3, 40, device="cuda", dtype=torch.bfloat16)
            out = _masked(x, spec)
        assert isinstance(out, FakeTensor) and out.shape == x.shape and out.dtype == x.dtype and out.is_cuda
        assert launched == (["cuda"] if gpu_reason is None else []), gpu_reason


# ----------------------------------------------------------------------------- the Triton kernel
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
BITS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


@pytest.fixture
def triton_dropout(monkeypatch):
    """triton_kernels/dropout.py's launcher, with every buffer it allocates poisoned with NaN first."""
    from seqpar.triton_kernels import dropout as kernels, rows

    real = rows.empty
    monkeypatch.setattr(rows, "empty", lambda shape, dtype, device: real(shape, dtype, device).fill_(float("nan")))
    return kernels.dropout_rows


def _reference(x, spec):
    h = x.shape[-1]
    keep = spec.keep_mask_2d(x.numel() // h, h, x.device).view(x.shape)
    return torch.where(keep, x * spec.scale, 0.0)


def _assert_bitwise(got, want):
    """The same bits, except that a NaN matches any NaN: torch's own NaN bits vary (its vectorised CPU
    fp32 -> bf16 conversion writes 0xFFFF, the scalar tail 0x7FC0)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    assert torch.equal(got.view(BITS[got.dtype])[~nan], want.view(BITS[want.dtype])[~nan])


@pytest.mark.parametrize("h", [1, 15, 16, 40, 300], ids=lambda h: f"h{h}")
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_triton_kernel_matches_reference_bitwise(dtype, h, triton_dropout):
    """The launcher on CPU tensors (interpreter): the torch reference's bits for every rows x row_offset x p,
    row_offset near 2**62 included (the int64 row's high word in the Philox counter)."""
    gen = torch.Generator().manual_seed(h)
    for rows in (1, 7, 33):
        for row_offset in (0, 2**62 - 20):
            for p in (0.1, 0.5, 0.99):
                spec = DropoutSpec(p, 2**40 + 77, row_offset)
                x = torch.randn(rows, h, generator=gen).to(dtype)
                got = triton_dropout(x, spec.seed, spec.row_offset, spec.threshold)
                _assert_bitwise(got, _reference(x, spec))


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_triton_kernel_non_finite_dropped_is_zero_kept_passes(dtype, triton_dropout):
    """inf, -inf and NaN in dropped positions give 0; kept ones pass through (inf * scale, NaN); [..., h]
    inputs keep their shape (rows of h across the leading dims)."""
    spec = DropoutSpec(0.5, 31, 2**33 + 5)
    keep = spec.keep_mask_2d(6, 40, "cpu")
    x = torch.randn(6, 40).to(dtype)
    specials = torch.tensor([float("inf"), float("-inf"), float("nan")]).to(dtype)
    x[::2, 1::3] = specials[0]
    x[1::2, ::4] = specials[1]
    x[:, 2::5] = specials[2]
    assert (~x.isfinite() & keep).any() and (~x.isfinite() & ~keep).any()
    got = triton_dropout(x.view(2, 3, 40), spec.seed, spec.row_offset, spec.threshold)
    assert got.shape == (2, 3, 40)
    _assert_bitwise(got.view(6, 40), _reference(x, spec))
    assert (got.view(6, 40)[~keep] == 0).all()


def test_triton_launcher_validates_inputs(triton_dropout):
    x = torch.randn(3, 8)
    for args, match in (((x.t(), 1, 0, 26), "x must be a contiguous"), ((x.double(), 1, 0, 26), "float64"),
                        ((x, 1, 0, 0), r"threshold P must be an int in \[1, 256\), got 0"),
                        ((x, 1, 0, 256), "got 256"), ((x, -1, 0, 26), "seed must be"),
                        ((x, 1, 2**62, 26), r"row_offset must be an int in \[0, 2\*\*62\)")):
        with pytest.raises(ValueError, match=match):
            triton_dropout(*args)
    assert triton_dropout(torch.randn(0, 8), 1, 0, 26).shape == (0, 8)


def test_apply_keep_mask_takes_the_triton_kernel_without_the_cuda_extension(monkeypatch):
    """A CUDA tensor on a machine where seqpar._C is not built (or has no kernels for the GPU) but Triton
    runs: the Triton kernel, not the torch reference's hundred small ops per mask. Simulated with fake CUDA
    tensors (no GPU needed); the launchers are custom ops with fake implementations. float64 and a GPU
    with neither kernel take the reference."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    launched = []
    _count_kernel_launches(monkeypatch, launched)
    no_cuda = "seqpar._C is not built (no nvcc at install)"
    spec = DropoutSpec(0.25, 9, 2**40)
    cases = {  # (cuda reason, triton reason, dtype) -> the launcher that runs (None: the torch reference)
        (None, None, torch.bfloat16): "cuda",
        (no_cuda, None, torch.bfloat16): "triton",
        (no_cuda, None, torch.float16): "triton",
        (no_cuda, None, torch.float32): "triton",
        (no_cuda, None, torch.float64): None,
        (no_cuda, "triton is not importable", torch.bfloat16): None,
    }
    for (cuda_reason, triton_reason, dtype), want in cases.items():
        monkeypatch.setattr(_ext, "cuda_unavailable_reason", lambda device, r=cuda_reason: r)
        monkeypatch.setattr(_ext, "triton_unavailable_reason", lambda device, auto=False, r=triton_reason: r)
        launched.clear()
        with FakeTensorMode():
            x = torch.empty(6, 3, 40, device="cuda", dtype=dtype)
            out = dropout(x, spec)
        assert isinstance(out, FakeTensor) and out.shape == x.shape and out.dtype == x.dtype and out.is_cuda
        assert launched == ([want] if want else []), (cuda_reason, triton_reason, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("cols", [1000, 1003, 4099], ids=["aligned", "ragged", "chunked"])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_triton_kernel_on_gpu_matches_reference(dtype, cols, monkeypatch):
    """On a GPU, with the CUDA extension set aside: apply_keep_mask runs the Triton kernel (column blocks
    of 1024 on the device), bit for bit the torch reference's values computed on the CPU."""
    from tests.gpu import skip_unless_backend_runs

    skip_unless_backend_runs("triton")
    launched = []
    _count_kernel_launches(monkeypatch, launched)
    monkeypatch.setattr(_ext, "cuda_unavailable_reason", lambda device: "set aside by the test")
    spec = DropoutSpec(0.1, 2**40 + 3, 2**32 - 77)
    x = torch.randn(300, cols, device="cuda").to(dtype)
    got = _masked(x, spec)
    assert launched == ["triton"]
    _assert_bitwise(got.cpu(), _reference(x.cpu(), spec))


@pytest.mark.parametrize("dynamic", [None, False])
def test_compiled_op_takes_each_call_s_seed_without_recompiling(dynamic):
    """A compiled function calling a fused op with seed=None (drawn inside: a graph break) or with a seed
    drawn outside and handed over with seqpar.random.graph_ints compiles once: the seeds are dynamic
    inputs of the graph. They were plain ints, constants of it: the second call recompiled, and under
    dynamic=False every call did (past Dynamo's recompile limit the function ran eagerly). Each call's
    mask is fresh and equals eager's for the same generator state."""
    from torch._dynamo.testing import CompileCounter
    x = torch.randn(4, 32)

    def drawn_inside(x):
        return dropout(x * 2, make_dropout_spec(0.5, True, None)) + 1

    def drawn_outside(x, seed):
        return dropout(x * 2, make_dropout_spec(0.5, True, seed)) + 1

    for fn, seeds in ((drawn_inside, lambda: ()), (drawn_outside, lambda: (seqpar.random.graph_ints(seqpar.random.next_op_seed()),))):
        torch._dynamo.reset()
        counter = CompileCounter()
        compiled = torch.compile(fn, backend=counter, dynamic=dynamic)
        outputs = []
        for _ in range(4):
            state = torch.get_rng_state()
            out = compiled(x, *seeds())
            torch.set_rng_state(state)
            torch.testing.assert_close(out, fn(x, *seeds()), rtol=0, atol=0)
            outputs.append(out)
        assert counter.frame_count == (2 if fn is drawn_inside else 1), counter.frame_count
        assert len({tuple(o.flatten().tolist()) for o in outputs}) == 4
    torch._dynamo.reset()


def test_standalone_dropout_takes_the_backend_it_is_given(monkeypatch):
    """dropout and bias_dropout_add chose their kernel by rules of their own: backend= did not exist,
    SEQPAR_BACKEND and a layer's backend did not reach them (a layer on backend "torch" ran the mask
    kernels on a GPU; on "triton" the torch mask on a GPU with the CUDA extension), and record_selections
    never saw them. They are the registry's op "dropout" now: an explicit backend runs (or is refused
    with the reason), every backend gives the same bits, and the selections are recorded."""
    x, res = torch.randn(6, 40), torch.randn(6, 40)
    spec = DropoutSpec(0.25, 9, 2**33)
    reference = _reference(x, spec)
    with pytest.raises(ValueError, match="backend 'cuda' can't run dropout: "):
        dropout(x, spec, backend="cuda")
    runs = ["torch"] + (["triton"] if registry.environment_reason("triton", x.device) is None else [])
    for name in runs:
        with registry.record_selections() as seen:
            _assert_bitwise(dropout(x, spec, backend=name), reference)
            _assert_bitwise(bias_dropout_add(x, None, res, spec, backend=name), res + reference)
        assert seen == {"dropout": {name}}
        monkeypatch.setenv("SEQPAR_BACKEND", name)
        with registry.record_selections() as seen:
            dropout(x, spec)
        assert seen == {"dropout": {name}}
        monkeypatch.delenv("SEQPAR_BACKEND")


def test_public_draws_are_plain_ints_and_export_as_seed_inputs():
    """The public draws return plain ints: as DynamicInts (the graph inputs the layers hand their compiled
    graphs) they printed as "DynamicInt(...)", hashed 50x slower, and a program exported with one as its
    seed= input raised NameError on every call. An exported program with a seed input applies that
    seed's mask."""
    from torch.export import export

    seeds = [seqpar.random.next_op_seed(), seqpar.random.next_layer_seed(3), *seqpar.random.next_layer_streams(3)]
    assert all(type(s) is int and str(s).isdigit() for s in seeds), seeds
    assert all(type(s) is not int for s in seqpar.random.graph_ints(tuple(seeds)))

    class Dropped(torch.nn.Module):
        def forward(self, x, seed):
            return dropout(x, make_dropout_spec(0.5, True, seed))

    x, seed = torch.randn(4, 32), seqpar.random.next_op_seed()
    program = export(Dropped(), (x, seed), strict=False)
    _assert_bitwise(program.module()(x, seed), Dropped()(x, seed))


# ----------------------------------------------------------------------------- bias_dropout_add in one pass
def _unfused_bias_dropout_add(x, bias, residual, spec):
    """What bias_dropout_add computed before its fusion, and autograd's gradients of it: three separate ops,
    the mask on the torch backend."""
    return residual + dropout(x if bias is None else x + bias, spec, backend="torch")


def _bda_inputs(rows_shape, h, dtype, bias, contiguous, gen):
    """x, bias (or None), residual of shape rows_shape + (h,) in ``dtype``, requiring grad; with
    ``contiguous=False`` each a strided view (a transpose, every other column, every other element)."""
    shape = tuple(rows_shape) + (h,)
    if contiguous:
        x = torch.randn(shape, generator=gen).to(dtype)
        res = (4 * torch.randn(shape, generator=gen)).to(dtype)
        b = torch.randn(h, generator=gen).to(dtype) if bias else None
    else:
        x = torch.randn(shape[::-1], generator=gen).to(dtype).permute(*reversed(range(len(shape))))
        res = (4 * torch.randn(shape[:-1] + (2 * h,), generator=gen)).to(dtype)[..., ::2]
        b = torch.randn(2 * h, generator=gen).to(dtype)[::2] if bias else None
        assert not x.is_contiguous() and not res.is_contiguous() and (b is None or not b.is_contiguous())
    leaves = [t.detach().requires_grad_() if t is not None else None for t in (x, b, res)]
    return leaves


def _bda_run(fn, x, b, res, grad):
    """fn's output and the gradients of x, bias and residual for ``grad`` (fresh leaves each call)."""
    x, res = x.detach().requires_grad_(), res.detach().requires_grad_()
    b = b.detach().requires_grad_() if b is not None else None
    out = fn(x, b, res)
    out.backward(grad)
    return out.detach(), x.grad, None if b is None else b.grad, res.grad


@pytest.mark.parametrize("contiguous", [True, False], ids=["contiguous", "strided"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_bias_dropout_add_bitwise_in_every_backend(dtype, bias, contiguous, triton_dropout):
    """Forward and the gradients of x, bias and residual, bit for bit the unfused residual + dropout(x + bias)
    and its autograd backward, on the torch and triton (interpreter) backends: fp32 / fp16 / bf16, with and
    without bias, strided inputs (and a strided gradient), h = 300 and 40 (not multiples of 16), 70 rows
    (a ragged last row block under the interpreter's 64 x 512 tiles) and 600 rows at h = 40 (512 x 64)."""
    gen = torch.Generator().manual_seed(7)
    for rows_shape, h in (((5, 14), 300), ((600,), 40)):
        spec = DropoutSpec(0.3, 2**40 + 5, 2**33 - 3)
        x, b, res = _bda_inputs(rows_shape, h, dtype, bias, contiguous, gen)
        grad = torch.randn(tuple(rows_shape) + (h,), generator=gen).to(dtype)
        if not contiguous:
            grad = torch.randn((h,) + tuple(rows_shape), generator=gen).to(dtype).movedim(0, -1)
        want = _bda_run(lambda x, b, r: _unfused_bias_dropout_add(x, b, r, spec), x, b, res, grad)
        for backend in ("torch", "triton"):
            got = _bda_run(lambda x, b, r: bias_dropout_add(x, b, r, spec, backend=backend), x, b, res, grad)
            for name, g, w in zip(("out", "grad_x", "grad_bias", "grad_residual"), got, want):
                assert (g is None) == (w is None), (backend, name)
                if w is not None:
                    _assert_bitwise(g, w)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_triton_launcher_fuses_bias_and_residual_bitwise(dtype, triton_dropout):
    """The launcher's optional bias and residual: round(residual + round(where(keep, round(x + bias) * scale,
    0))) with torch's three roundings, each alone and together; inf / NaN in dropped positions of x + bias
    add exactly 0, kept ones pass through; rows not a multiple of the row block, h not of 16."""
    gen = torch.Generator().manual_seed(3)
    spec = DropoutSpec(0.3, 2**40 + 77, 2**62 - 40)   # not 0.5: scale 2 is exact, hiding a missed rounding
    keep = spec.keep_mask_2d(70, 300, "cpu")
    x = torch.randn(70, 300, generator=gen).to(dtype)
    x[::3, 1::7] = float("inf")
    x[1::3, ::5] = float("nan")
    assert (~x.isfinite() & keep).any() and (~x.isfinite() & ~keep).any()
    bias = torch.randn(300, generator=gen).to(dtype)
    res = (8 * torch.randn(70, 300, generator=gen)).to(dtype)
    for b, r in ((bias, res), (bias, None), (None, res)):
        got = triton_dropout(x, spec.seed, spec.row_offset, spec.threshold, bias=b, residual=r)
        want = _reference(x if b is None else x + b, spec)
        _assert_bitwise(got, want if r is None else r + want)
        if r is not None:
            _assert_bitwise(got[~keep], r[~keep])
    # a residual near the dtype's largest value: residual + dropped rounds (and overflows) once, not fused
    big = torch.full((70, 300), torch.finfo(dtype).max / 2, dtype=dtype)
    _assert_bitwise(triton_dropout(x, spec.seed, spec.row_offset, spec.threshold, bias=bias, residual=big),
                    big + _reference(x + bias, spec))


def test_triton_launcher_validates_bias_and_residual(triton_dropout):
    x = torch.randn(4, 8)
    for kwargs, match in (({"bias": torch.randn(16)[::2]}, r"bias must be a contiguous \[8\] tensor"),
                          ({"bias": torch.randn(8).half()}, "bias must be .* of x's torch.float32"),
                          ({"residual": torch.randn(8, 4).t()}, r"residual must be a contiguous \[4, 8\]"),
                          ({"residual": torch.randn(3, 8)}, "residual must be")):
        with pytest.raises(ValueError, match=match):
            triton_dropout(x, 1, 0, 26, **kwargs)


class _SeqparOps(torch.utils._python_dispatch.TorchDispatchMode):
    """Records every op that reaches the dispatcher (custom ops by their seqpar:: name)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func.overloadpacket._qualified_op_name if hasattr(func, "overloadpacket") else func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
def test_bias_dropout_add_forward_is_one_kernel(bias, triton_dropout):
    """The forward on the triton backend is one op, seqpar::dropout_triton with the bias and residual: it
    was three passes over [rows, h] (aten add of the bias, the dropout kernel, aten add of the residual;
    7 reads / writes of the tensor where the fused pass makes 3). The backward: the mask kernel on the
    gradient and, with a bias, the column sum."""
    x, res = torch.randn(6, 40, requires_grad=True), torch.randn(6, 40, requires_grad=True)
    b = torch.randn(40, requires_grad=True) if bias else None
    spec = DropoutSpec(0.25, 9, 0)
    with _SeqparOps() as forward:
        out = bias_dropout_add(x, b, res, spec, backend="triton")
    assert forward.ops == ["seqpar::dropout_triton"], forward.ops
    with _SeqparOps() as backward:
        out.backward(torch.randn(6, 40))
    assert backward.ops.count("seqpar::dropout_triton") == 1 and "aten::add" not in backward.ops, backward.ops
    assert ("aten::sum" in backward.ops) == bias, backward.ops


def test_bias_dropout_add_inactive_or_empty_runs_no_kernel(monkeypatch):
    """An inactive spec or an empty tensor: residual + (x + bias) in plain torch ops, as before (no kernel,
    no backend check: backend="cuda" on a CPU tensor is not refused); gradients those of the adds."""
    launched = []
    _count_kernel_launches(monkeypatch, launched)
    gen = torch.Generator().manual_seed(5)
    for shape, spec in (((4, 24), DropoutSpec(0.0, 3, 0)), ((0, 24), DropoutSpec(0.5, 3, 0))):
        x, res = torch.randn(shape, generator=gen, requires_grad=True), torch.randn(shape, generator=gen)
        b = torch.randn(24, generator=gen, requires_grad=True)
        out = bias_dropout_add(x, b, res, spec, backend="cuda")
        assert torch.equal(out, res + (x + b))
        out.sum().backward()
        assert torch.equal(x.grad, torch.ones(shape)) and torch.equal(b.grad, torch.full((24,), float(shape[0])))
    assert launched == []


def test_bias_dropout_add_compiles_to_the_fused_kernel(triton_dropout):
    """torch.compile (aot_eager) of bias_dropout_add on the triton backend: the eager values and gradients,
    bit for bit, and one seqpar::dropout_triton node (with the bias and residual) in the forward graph, no
    separate add."""
    from torch._dynamo.testing import AotEagerAndRecordGraphs

    torch._dynamo.reset()
    spec = DropoutSpec(0.3, 2**40 + 1, 17)
    gen = torch.Generator().manual_seed(9)
    x, b, res = _bda_inputs((3, 5), 40, torch.bfloat16, True, True, gen)
    grad = torch.randn(3, 5, 40, generator=gen).to(torch.bfloat16)

    def fn(x, b, r):
        return bias_dropout_add(x, b, r, spec, backend="triton")

    recorder = AotEagerAndRecordGraphs()
    got = _bda_run(torch.compile(fn, backend=recorder, fullgraph=True), x, b, res, grad)
    want = _bda_run(fn, x, b, res, grad)
    for g, w in zip(got, want):
        _assert_bitwise(g, w)
    targets = [n.target for g in recorder.fw_graphs for n in g.graph.nodes if n.op == "call_function"]
    fused = [t for t in targets if "dropout_triton" in str(t)]
    assert len(fused) == 1 and not [t for t in targets if "add" in str(t)], targets
    torch._dynamo.reset()


def test_dropout_custom_ops_pass_opcheck():
    """The changed schemas (optional bias and residual) against their fake implementations."""
    x, bias, res = torch.randn(5, 24), torch.randn(24), torch.randn(5, 24)
    op = torch.ops.seqpar.dropout_triton.default
    for args in ((x, 9, 3, 26, bias, res), (x, 9, 3, 26, None, res), (x, 9, 3, 26, bias, None),
                 (x, 9, 3, 26, None, None), (x, 9, 3, 26)):
        torch.library.opcheck(op, args)


@pytest.mark.gpu
@pytest.mark.parametrize("cols", [1000, 1003], ids=["aligned", "ragged"])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_bias_dropout_add_kernels_on_gpu_match_reference(dtype, cols):
    """On a GPU, the cuda and triton backends' fused forward and the gradients, bit for bit the unfused torch
    composition computed on the GPU (a misaligned residual takes the CUDA kernel's scalar path)."""
    from tests.gpu import skip_unless_backend_runs

    gen = torch.Generator().manual_seed(cols)
    spec = DropoutSpec(0.1, 2**40 + 3, 2**32 - 77)
    x, b, res = (t.detach().cuda() for t in _bda_inputs((300,), cols, dtype, True, True, gen))
    grad = torch.randn(300, cols, generator=gen).to(dtype).cuda()
    want = _bda_run(lambda x, b, r: _unfused_bias_dropout_add(x, b, r, spec), x, b, res, grad)
    for backend in ("triton", "cuda"):
        skip_unless_backend_runs(backend)
        for r in (res, torch.empty(300 * cols + 1, dtype=dtype, device="cuda")[1:].view(300, cols).copy_(res)):
            got = _bda_run(lambda x, b, r: bias_dropout_add(x, b, r, spec, backend=backend), x, b, r, grad)
            for g, w in zip(got, want):
                _assert_bitwise(g.cpu(), w.cpu())
