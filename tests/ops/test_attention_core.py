"""attention_core: the Triton flash-style backend (CPU interpreter here, GPU when marked) and the CUDA
softmax-dropout backend (GPU only) against an independent fp64 computation, with the dropout mask of
seqpar.ops.attention_core.attention_keep_mask (the torch reference's mask); SDPA's keyword contract and
grouped-query attention against torch.nn.functional.scaled_dot_product_attention."""
import ctypes
import inspect
import math

import pytest
import torch
import torch.nn.functional as F

from seqpar.ops import registry
from seqpar.ops.attention_core import OP, attention_core, attention_keep_mask, causal_mask, select_backend
from seqpar.ops.dropout import DropoutSpec
from seqpar.random import dropout_threshold
from tests.tolerances import TOLERANCES, assert_error_within

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
SEED = 1234


def _ids(shape):
    return "b{}h{}s{}d{}".format(*shape)


def reference_fp64(q, k, v, grad_o, causal, p, seed, row_offset=0, scale=None):
    """o and (dq, dk, dv) in fp64 by autograd through plain torch ops, same mask convention. k, v with
    fewer heads (GQA) are repeated to q's heads first (autograd sums dk, dv over each group)."""
    b, heads, s_q, d = q.shape
    s_k = k.shape[2]
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    group = heads // k.shape[1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    scores = q64 @ k64.repeat_interleave(group, 1).transpose(-2, -1) * scale
    if causal:
        scores = scores.masked_fill(causal_mask(s_q, s_k, q.device), float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if p > 0:
        spec = DropoutSpec(p, seed, row_offset)
        keep = attention_keep_mask(spec, b, heads, s_q, s_k, q.device)
        probs = probs * keep * (256 / (256 - spec.threshold))     # the exact scale (kernels: its fp32 rounding)
    o = probs @ v64.repeat_interleave(group, 1)
    grads = torch.autograd.grad(o, (q64, k64, v64), grad_o.double())
    return o.detach(), grads


def run(backend, q, k, v, grad_o, causal, p, seed=SEED, row_offset=0, **kw):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    o = attention_core(q, k, v, is_causal=causal, dropout_p=p, seed=seed, backend=backend,
                       row_offset=row_offset, **kw)
    grads = torch.autograd.grad(o, (q, k, v), grad_o)
    return o.detach(), grads


def randn(*shape, dtype=torch.float32, device=DEVICE):
    return torch.randn(*shape, dtype=dtype, device=device)


# ----------------------------------------------------------------------------- triton vs fp64 (CPU CI)
SHAPES = [(1, 1, 1, 32), (2, 3, 37, 64), (1, 2, 128, 128)]


@pytest.mark.parametrize("p", [0.0, 0.2], ids=["p0", "p0.2"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("shape", SHAPES, ids=_ids)
def test_triton_matches_fp64(shape, causal, p):
    """Outputs and dq, dk, dv in fp32 vs an fp64 computation with the reference dropout mask."""
    q, k, v = (randn(*shape) for _ in range(3))
    grad_o = randn(*shape)
    o, grads = run("triton", q, k, v, grad_o, causal, p)
    o_ref, grads_ref = reference_fp64(q, k, v, grad_o, causal, p, SEED)
    assert o.dtype == torch.float32 and o.shape == shape
    torch.testing.assert_close(o.double(), o_ref, atol=2e-5, rtol=1e-4)
    for name, g, g_ref in zip(("dq", "dk", "dv"), grads, grads_ref):
        assert g.shape == shape, name
        torch.testing.assert_close(g.double(), g_ref, atol=5e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("row_offset", [2**31 - 50, 2**40 + 3], ids=["r2^31", "r2^40"])
def test_triton_dropout_mask_is_the_reference_mask(row_offset):
    """With v = I (s_k = d) the output *is* the dropped probability matrix, and with grad_o = I (s_q = d)
    dv is its transpose: their zero patterns are the keep-mask, bit for bit, from the forward and from
    the transposed dk/dv tile, for several heads and batches, rows past 2**31 and 2**40 and a ragged
    s = 40 (not a multiple of 16). dq and dk match the torch reference (same mask) too."""
    b, heads, s, p = 2, 3, 40, 0.5
    q, k = randn(b, heads, s, s), randn(b, heads, s, s)
    eye = torch.eye(s, device=DEVICE).expand(b, heads, s, s)     # stride-0 batch/head dims
    keep = attention_keep_mask(DropoutSpec(p, SEED, row_offset), b, heads, s, s, q.device)
    assert 0.3 < keep.float().mean().item() < 0.7
    grads = {}
    for backend in ("triton", "torch"):
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, eye))
        o = attention_core(qq, kk, vv, is_causal=False, dropout_p=p, seed=SEED, row_offset=row_offset, backend=backend)
        grads[backend] = torch.autograd.grad(o, (qq, kk, vv), eye)
        if backend == "triton":
            assert torch.equal(o != 0, keep)
            o_triton = o.detach()
        else:
            torch.testing.assert_close(o_triton, o.detach(), atol=1e-6, rtol=1e-5)
    assert torch.equal(grads["triton"][2] != 0, keep.transpose(-2, -1))
    for name, g, g_ref in zip(("dq", "dk", "dv"), grads["triton"], grads["torch"]):
        torch.testing.assert_close(g, g_ref, atol=1e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")
    other_seed = attention_core(q, k, eye, is_causal=False, dropout_p=p, seed=SEED + 1, row_offset=row_offset,
                                backend="triton")
    assert not torch.equal(other_seed != 0, keep)


def test_flop_counter_counts_the_kernel_backends_as_sdpa():
    """FlopCounterMode sees a kernel backend's attention as one opaque custom op: it counted 0 FLOPs for it
    (a TransformerLayer on the triton backend lost its whole attention term). Now the triton backend counts
    what the torch backend's matmuls count: 4 b Hq s_q s_k d forward, twice that backward (GQA: per query
    head)."""
    from torch.utils.flop_counter import FlopCounterMode

    b, hq, hk, s_q, s_k, d = 2, 4, 2, 24, 40, 16
    counts = {}
    for backend in ("torch", "triton"):
        g = torch.Generator().manual_seed(0)
        q = torch.randn(b, hq, s_q, d, generator=g, requires_grad=True)
        k, v = (torch.randn(b, hk, s_k, d, generator=g, requires_grad=True) for _ in range(2))
        with FlopCounterMode(display=False) as counter:
            o = attention_core(q, k, v, is_causal=False, enable_gqa=True, backend=backend)
            forward = counter.get_total_flops()
            o.sum().backward()
        counts[backend] = (forward, counter.get_total_flops())
    assert counts["triton"] == counts["torch"] == (4 * b * hq * s_q * s_k * d, 12 * b * hq * s_q * s_k * d), counts


def test_triton_row_offset_matches_head_slice():
    """A tensor-parallel rank owning heads 2..3 of 4 passes row_offset = 2 * b * s_q and reproduces
    those heads of the single-device call, dropout included."""
    b, heads, s, d, p = 2, 4, 21, 32, 0.3
    q, k, v, grad_o = (randn(b, heads, s, d) for _ in range(4))
    o_full, g_full = run("triton", q, k, v, grad_o, True, p)
    sl = slice(2, 4)
    o_part, g_part = run("triton", q[:, sl], k[:, sl], v[:, sl], grad_o[:, sl], True, p, row_offset=2 * b * s)
    torch.testing.assert_close(o_part, o_full[:, sl], atol=1e-6, rtol=1e-6)
    for g, gf in zip(g_part, g_full):
        torch.testing.assert_close(g, gf[:, sl], atol=1e-6, rtol=1e-6)


def test_triton_backward_matches_directional_finite_difference():
    """d/de sum(w * o(x + e u)) by central differences (fp32, same dropout seed) vs <grad, u>."""
    shape, causal, p = (1, 2, 37, 32), True, 0.2
    q, k, v, w = (randn(*shape) for _ in range(4))
    u = [randn(*shape) for _ in range(3)]
    _, grads = run("triton", q, k, v, w, causal, p)
    analytic = sum((g.double() * d.double()).sum() for g, d in zip(grads, u)).item()

    def f(eps):
        qe, ke, ve = (t + eps * d for t, d in zip((q, k, v), u))
        o = attention_core(qe, ke, ve, is_causal=causal, dropout_p=p, seed=SEED, backend="triton")
        return (o.double() * w.double()).sum().item()

    eps = 1e-2
    numeric = (f(eps) - f(-eps)) / (2 * eps)
    assert abs(analytic) > 1.0
    assert abs(numeric - analytic) <= 2e-3 * abs(analytic), (numeric, analytic)


def test_triton_backward_at_logits_near_1e5_is_as_exact_as_torch():
    """fp32 with scale 1e4 (logits ~1e5): P is recomputed from the base-2 lse the forward stored. A
    natural-log lse converted back in the backward was an ulp of 1e5 off: dv 4e-3 of its size vs fp64,
    40000x the torch backend's error. (dq, dk are ~0 here and left out: rounding noise times 1e4.)"""
    shape = (1, 2, 32, 32)
    q, k, v, grad_o = (randn(*shape) for _ in range(4))
    _, (_, _, dv) = run("triton", q, k, v, grad_o, True, 0.0, scale=1e4)
    _, (_, _, dv_t) = run("torch", q, k, v, grad_o, True, 0.0, scale=1e4)
    _, (_, _, dv_ref) = reference_fp64(q, k, v, grad_o, True, 0.0, SEED, scale=1e4)
    assert_error_within(dv, dv_t, dv_ref, floor=1e-6 * dv_ref.abs().max().item(), name="dv")


def test_triton_fp16_backward_where_ds_passes_the_fp16_range():
    """fp16, q and k ~1e-2 (P nearly uniform), v and dO ~500: some |dS| = |P (dP - delta)| pass 65504
    while dq, dk (~2e3) are representable. The kernels round c dS (c = 1/8) for their GEMMs, not dS
    (which became inf, and dq, dk NaN); error vs fp64 within 2x the torch backend's (fp32 inside)."""
    b, heads, s, d = 1, 2, 32, 64
    g = torch.Generator().manual_seed(0)
    q, k = ((torch.randn(b, heads, s, d, generator=g) * 1e-2).half().to(DEVICE) for _ in range(2))
    v, grad_o = ((torch.randn(b, heads, s, d, generator=g) * 500).half().to(DEVICE) for _ in range(2))
    grads = run("triton", q, k, v, grad_o, False, 0.0)[1]
    grads_t = run("torch", q, k, v, grad_o, False, 0.0)[1]
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    scores = q64 @ k64.transpose(-2, -1) / math.sqrt(d)
    o64 = torch.softmax(scores, -1) @ v64
    ds64, *grads_ref = torch.autograd.grad(o64, (scores, q64, k64, v64), grad_o.double())
    assert ds64.abs().max() > 65504 > ds64.abs().max() / math.sqrt(d)    # the case in between
    for name, got, got_t, ref in zip(("dq", "dk", "dv"), grads, grads_t, grads_ref):
        assert torch.isfinite(got).all(), name
        assert_error_within(got, got_t, ref, floor=TOLERANCES[torch.float16][0] * ref.abs().max().item(), name=name)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_saved_tensors_have_nothing_quadratic(backend):
    """Through saved-tensor hooks: the triton backend keeps q, k, v, o and an fp32 lse only; the torch
    reference (checked so the test can fail) keeps s_q x s_k probabilities."""
    b, heads, s, d = 1, 2, 64, 16
    q, k, v = (randn(b, heads, s, d).requires_grad_() for _ in range(3))
    saved = []

    def pack(t):
        saved.append((tuple(t.shape), t.dtype, t.numel()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        o = attention_core(q, k, v, is_causal=True, dropout_p=0.1, seed=SEED, backend=backend)
    o.sum().backward()
    quadratic = [sh for sh, _, n in saved if n >= b * heads * s * s]
    if backend == "torch":
        assert quadratic
        return
    assert not quadratic, saved
    assert sorted(sh for sh, _, _ in saved) == sorted([(b, heads, s, d)] * 4 + [(b, heads, s)])
    assert [dt for sh, dt, _ in saved if sh == (b, heads, s)] == [torch.float32]
    assert registry._REGISTRY[OP]["triton"].recompute_free
    assert not registry._REGISTRY[OP]["torch"].recompute_free
    assert not registry._REGISTRY[OP]["cuda"].recompute_free


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_triton_half_precision_strided_qkv_views(dtype):
    """q, k, v as the layer passes them: [b, H, s, d] views of one fused [s, b, 3*H*d] tensor; error vs
    fp64 at most 2x the torch reference's error in the same dtype. o is a view of [s, b, H, d]."""
    s, b, heads, d, p = 33, 2, 2, 80, 0.1
    qkv = randn(s, b, 3 * heads * d, dtype=dtype)
    q, k, v = qkv.view(s, b, 3, heads, d).permute(2, 1, 3, 0, 4).unbind(0)
    assert not q.is_contiguous()
    grad_o = randn(b, heads, s, d, dtype=dtype)
    o, grads = run("triton", q, k, v, grad_o, True, p)
    o_t, grads_t = run("torch", q, k, v, grad_o, True, p)
    o_ref, grads_ref = reference_fp64(q, k, v, grad_o, True, p, SEED)
    assert o.dtype == dtype and all(g.dtype == dtype for g in grads)
    assert o.permute(2, 0, 1, 3).is_contiguous()            # [s, b, H, d] buffer: the layer's layout
    # fp16's floor for bf16 too: the kernels' bf16 roundings are to nearest even, under the CPU
    # interpreter as well (cast_rne); its truncating casts put dk at 3x torch's error, past this bound.
    floor = TOLERANCES[torch.float16][0]
    assert_error_within(o, o_t, o_ref, floor=floor, name="o")
    for name, g, g_t, g_ref in zip(("dq", "dk", "dv"), grads, grads_t, grads_ref):
        assert_error_within(g, g_t, g_ref, floor=floor * g_ref.abs().max().item(), name=name)


@pytest.mark.parametrize("s_q,s_k", [(20, 45), (45, 20)], ids=["sq<sk", "sq>sk"])
@pytest.mark.parametrize("tiles", ["m16n32", "m32n16"])
def test_triton_launcher_tiles_and_unequal_lengths(s_q, s_k, tiles):
    """The block-range logic (causal diagonal, ragged ends) for both tile orders and s_q != s_k,
    calling the launchers directly with pinned tiles; outputs poisoned with NaN first would show."""
    from seqpar.triton_kernels.attention import attention_bwd, attention_fwd

    bm, bn = (16, 32) if tiles == "m16n32" else (32, 16)
    b, heads, d, p, causal = 1, 2, 32, 0.25, True
    q, grad_o = randn(b, heads, s_q, d), randn(b, heads, s_q, d)
    k, v = randn(b, heads, s_k, d), randn(b, heads, s_k, d)
    scale, threshold = 0.3, dropout_threshold(p)
    fwd_cfg = {"BLOCK_M": bm, "BLOCK_N": bn}
    o, lse = attention_fwd(q, k, v, causal, scale, threshold, SEED, 7, config=fwd_cfg)
    dq, dk, dv = attention_bwd(grad_o, q, k, v, o, lse, causal, scale, threshold, SEED, 7,
                               config={"dq": fwd_cfg, "dkdv": {"BLOCK_M": bm, "BLOCK_N": bn}})
    o_ref, (dq_ref, dk_ref, dv_ref) = reference_fp64(q, k, v, grad_o, causal, p, SEED, row_offset=7, scale=scale)
    scores = (q.double() @ k.double().transpose(-2, -1)) * scale
    scores = scores.masked_fill(causal_mask(s_q, s_k, q.device), float("-inf"))
    # The kernels keep lse in base 2 (triton_kernels/attention.py's module doc).
    torch.testing.assert_close(lse.double(), torch.logsumexp(scores, -1) / math.log(2), atol=1e-5, rtol=1e-5)
    for name, got, ref in (("o", o, o_ref), ("dq", dq, dq_ref), ("dk", dk, dk_ref), ("dv", dv, dv_ref)):
        assert not got.isnan().any(), name
        torch.testing.assert_close(got.double(), ref, atol=5e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")


def test_triton_custom_ops_have_fake_implementations():
    """torch.compile traces the kernels through the fake (shape-only) implementations."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(2, 3, 17, 64)
        k = torch.empty(2, 3, 29, 64)
        o, lse = torch.ops.seqpar.attention_core_triton_fwd(q, k, k, True, 0.125, 26, 5, 0)
        dq, dk, dv = torch.ops.seqpar.attention_core_triton_bwd(o, q, k, k, o, lse, True, 0.125, 26, 5, 0)
        o_c, probs = torch.ops.seqpar.attention_core_cuda_fwd(q, k, k, True, 0.125, 26, 5, 0)
    assert o.shape == (2, 3, 17, 64) and o.permute(2, 0, 1, 3).is_contiguous()
    assert lse.shape == (2, 3, 17) and lse.dtype == torch.float32
    assert dq.shape == q.shape and dk.shape == dv.shape == k.shape
    assert o_c.shape == q.shape and probs.shape == (2, 3, 17, 29)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_torch_compile_fullgraph_matches_eager(backend):
    """fullgraph=True through the backend selection (its environment probes a constant to Dynamo), the
    autograd.Function and the custom ops: outputs and gradients equal the eager call's."""
    g = torch.Generator().manual_seed(11)
    leaves = [torch.randn(1, 2, 32, 16, generator=g, requires_grad=True) for _ in range(3)]

    def f(q, k, v):
        return attention_core(q, k, v, is_causal=True, dropout_p=0.1, seed=SEED, backend=backend)

    results = []
    for fn in (f, torch.compile(f, backend="aot_eager", fullgraph=True)):
        out = fn(*leaves)
        results.append((out, *torch.autograd.grad(out, leaves, torch.ones_like(out))))
    for eager, compiled in zip(*results):
        torch.testing.assert_close(compiled, eager, rtol=0, atol=0)


class _EmulatedSoftmaxDropout:
    """The two launchers of csrc/softmax_dropout.cu re-stated in torch on raw CPU pointers (fp32 math,
    results rounded to the tensors' dtype): checks the cuda backend's Python side (GEMMs with the scale
    as alpha, GQA grouping, in-place contract) without a GPU."""

    _DTYPES = {0: (torch.float32, ctypes.c_float), 1: (torch.float16, ctypes.c_uint16)}

    @classmethod
    def _view(cls, ptr, shape, dtype_code=0):
        dtype, c_type = cls._DTYPES[dtype_code]
        buf = (c_type * math.prod(shape)).from_address(ptr)
        return torch.frombuffer(buf, dtype=dtype).view(shape)

    @staticmethod
    def _spec(threshold, seed, row_offset):
        return DropoutSpec(threshold / 256, seed, row_offset)     # round(threshold / 256 * 256) == threshold

    def attention_softmax_dropout_fwd(self, scores, probs, b, heads, s_q, s_k, dtype, causal, seed,
                                      row_offset, threshold, stream):
        x, probs_t = (self._view(ptr, (b, heads, s_q, s_k), dtype) for ptr in (scores, probs))
        y = x.float()
        if causal:
            y = y.masked_fill(causal_mask(s_q, s_k, "cpu"), float("-inf"))
        probs_t.copy_(torch.softmax(y, dim=-1))
        if threshold > 0:
            spec = self._spec(threshold, seed, row_offset)
            x.copy_(probs_t.float() * attention_keep_mask(spec, b, heads, s_q, s_k, "cpu") * spec.scale)

    def attention_softmax_dropout_bwd(self, probs, grad, dropped, b, heads, s_q, s_k, dtype, causal,
                                      seed, row_offset, threshold, stream):
        shape = (b, heads, s_q, s_k)
        probs_t, g = (self._view(ptr, shape, dtype) for ptr in (probs, grad))
        p32, z = probs_t.float(), torch.ones(shape)
        if threshold > 0:
            spec = self._spec(threshold, seed, row_offset)
            z = attention_keep_mask(spec, *shape, "cpu") * spec.scale
            self._view(dropped, shape, dtype).copy_(p32 * z)
        gp = g.float() * z
        g.copy_(p32 * (gp - (gp * p32).sum(-1, keepdim=True)))


@pytest.mark.parametrize("kv_heads", [6, 2], ids=["mha", "gqa6:2"])
@pytest.mark.parametrize("p", [0.0, 0.2], ids=["p0", "p0.2"])
def test_cuda_backend_python_side_with_emulated_kernels(monkeypatch, p, kv_heads):
    _emulate_cuda_kernels(monkeypatch)
    shape = (2, 6, 37, 32)
    q, grad_o = randn(*shape), randn(*shape)
    k, v = randn(2, kv_heads, 37, 32), randn(2, kv_heads, 37, 32)
    q_view = torch.randn(37, 2, 6, 32).permute(1, 2, 0, 3)        # strided q, like the layer's views
    for qq in (q, q_view):
        o, grads = run("cuda", qq, k, v, grad_o, True, p, enable_gqa=True)
        o_ref, grads_ref = reference_fp64(qq, k, v, grad_o, True, p, SEED)
        torch.testing.assert_close(o.double(), o_ref, atol=2e-5, rtol=1e-4)
        for name, g, g_ref in zip(("dq", "dk", "dv"), grads, grads_ref):
            torch.testing.assert_close(g.double(), g_ref, atol=5e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")



def _emulate_cuda_kernels(monkeypatch):
    import seqpar._ext as ext

    if HAS_CUDA:
        pytest.skip("CPU emulation; the real kernels run in the gpu tests")
    monkeypatch.setattr(ext, "cuda_unavailable_reason", lambda device: None)
    monkeypatch.setattr(ext, "cuda_extension", lambda: _EmulatedSoftmaxDropout())
    monkeypatch.setattr(ext, "cuda_stream", lambda device: 0)


def test_cuda_backend_fp16_backward_where_dp_passes_the_fp16_range(monkeypatch):
    """fp16, v and dO ~100, d = 64: some |dP| = |dO . v| pass 65504 while c dP (c = 1/8) and the gradients
    are representable. The backward's first GEMM rounds c dP (scale as alpha), not dP (which became inf,
    and dq, dk NaN); error vs fp64 within 2x the torch backend's (fp32 inside). CPU: the GEMMs are the
    host code's, the softmax kernels emulated."""
    _emulate_cuda_kernels(monkeypatch)
    b, heads, s, d = 1, 2, 32, 64
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(b, heads, s, d, generator=g).half() for _ in range(2))
    v, grad_o = ((torch.randn(b, heads, s, d, generator=g) * 100).half() for _ in range(2))
    dp_max = (grad_o.double() @ v.double().transpose(-2, -1)).abs().max()
    assert dp_max > 65504 > dp_max / math.sqrt(d)                        # the case in between
    grads = run("cuda", q, k, v, grad_o, True, 0.0)[1]
    grads_t = run("torch", q, k, v, grad_o, True, 0.0)[1]
    grads_ref = reference_fp64(q, k, v, grad_o, True, 0.0, SEED)[1]
    for name, got, got_t, ref in zip(("dq", "dk", "dv"), grads, grads_t, grads_ref):
        assert torch.isfinite(got).all(), name
        assert_error_within(got, got_t, ref, floor=TOLERANCES[torch.float16][0] * ref.abs().max().item(), name=name)

def test_triton_custom_ops_pass_opcheck():
    """Schema, fake tensor and AOT-dispatch checks of the registered custom ops on real (tiny) inputs."""
    q, k, v = randn(1, 2, 17, 16), randn(1, 2, 9, 16), randn(1, 2, 9, 16)
    args = (q, k, v, True, 0.25, 26, 7, 3)
    torch.library.opcheck(torch.ops.seqpar.attention_core_triton_fwd.default, args)
    o, lse = torch.ops.seqpar.attention_core_triton_fwd(*args)
    torch.library.opcheck(torch.ops.seqpar.attention_core_triton_bwd.default,
                          (randn(1, 2, 17, 16), q, k, v, o, lse, True, 0.25, 26, 7, 3))


# ----------------------------------------------------------------------------- SDPA contract
def test_signature_is_sdpas():
    """SDPA's keyword names and defaults (keyword-only after q, k, v), then seqpar's own."""
    params = inspect.signature(attention_core).parameters
    assert list(params)[:3] == ["q", "k", "v"]
    expected = dict(attn_mask=None, is_causal=False, dropout_p=0.0, scale=None, enable_gqa=False, seed=None,
                    training=True, backend="auto")
    for name, default in expected.items():
        assert params[name].kind is inspect.Parameter.KEYWORD_ONLY, name
        assert params[name].default == default and repr(params[name].default) == repr(default), name


@pytest.mark.parametrize("kwargs", [{}, {"is_causal": True}, {"is_causal": False, "scale": 0.3},
                                    {"attn_mask": None, "dropout_p": 0.0, "enable_gqa": False}],
                         ids=["defaults", "causal", "scale", "explicit-defaults"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_matches_sdpa_with_its_keywords(backend, kwargs):
    """attention_core(q, k, v, **kw) == F.scaled_dot_product_attention(q, k, v, **kw); the default is
    not causal, as SDPA's."""
    q, k, v = (randn(2, 3, 19, 16, dtype=torch.float64).float() for _ in range(3))
    o = attention_core(q, k, v, backend=backend, **kwargs)
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), **kwargs)
    torch.testing.assert_close(o.double(), ref, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("scale", [-0.4, 0.0])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_any_finite_scale_as_sdpa(backend, scale):
    """A zero scale (uniform weights over the allowed keys) or a negative one (the scores' sign flips) is
    SDPA's math, forward and gradients, with causal masking and dropout; only a non-finite scale is
    refused."""
    q, k, v, grad_o = (randn(1, 2, 19, 16) for _ in range(4))
    o, grads = run(backend, q, k, v, grad_o, True, 0.2, scale=scale)
    o_ref, grads_ref = reference_fp64(q, k, v, grad_o, True, 0.2, SEED, scale=scale)
    for got, want in zip((o, *grads), (o_ref, *grads_ref)):
        torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=1e-4)
    for bad in (float("nan"), float("inf"), "0.1", True):
        with pytest.raises(ValueError, match="scale must be a finite float"):
            attention_core(q, k, v, scale=bad, backend=backend)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_the_output_takes_in_place_ops_like_sdpa(backend):
    """``o = attention_core(...); o.mul_(0.5)`` raised "Output 0 of _AttentionCore is a view and is being
    modified inplace" (the backends return a view of a grouped or sequence-major buffer); SDPA's output
    takes it. The torch backend keeps no output for backward: the gradients are those of SDPA(...) * 0.5.
    The flash-style Triton backward reads the output, as SDPA's flash backends do: backward then raises
    autograd's in-place error, as theirs does, instead of using the changed values."""
    q, grad_o = randn(1, 4, 9, 16), randn(1, 4, 9, 16)
    k, v = randn(1, 2, 9, 16), randn(1, 2, 9, 16)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    o = attention_core(q, k, v, is_causal=True, enable_gqa=True, backend=backend)
    o.mul_(0.5)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    o_ref = F.scaled_dot_product_attention(q64, k64, v64, is_causal=True, enable_gqa=True) * 0.5
    torch.testing.assert_close(o.detach().double(), o_ref, atol=2e-6, rtol=1e-5)
    if backend == "triton":
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            o.backward(grad_o)
        return
    o.backward(grad_o)
    grads_ref = torch.autograd.grad(o_ref, (q64, k64, v64), grad_o.double())
    for got, want in zip((q.grad, k.grad, v.grad), grads_ref):
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-4)


def test_triton_refuses_what_its_int32_offsets_or_its_triton_cannot_run(monkeypatch):
    """A tile's row offsets are row x sequence stride in int32: a view of a fused QKV with b h >= 5.6M
    (stride 3bh) wrapped around on the GPU (row 127 read another row's q; the interpreter's 32-row tiles
    hide it). Such strides are refused by name, like the dropout mask on a triton without tl.gather (< 3.3,
    which pyproject's triton >= 3.0 allows): auto then takes the next backend."""
    import triton.language as tl

    from seqpar.triton_kernels.attention import MAX_SEQ_STRIDE

    storage = torch.empty(MAX_SEQ_STRIDE + 64, dtype=torch.bfloat16)
    wide = storage.as_strided((1, 1, 2, 16), (16, 16, MAX_SEQ_STRIDE + 1, 1))   # two rows, far apart
    narrow = storage[:64].view(1, 1, 4, 16)
    with pytest.raises(ValueError, match=rf"sequence stride of {MAX_SEQ_STRIDE + 1} elements .* int32 tile offsets"):
        select_backend(wide, narrow[:, :, :2], narrow[:, :, :2], backend="triton")
    assert select_backend(narrow, narrow, narrow, backend="triton", dropout=True).name == "triton"
    monkeypatch.delattr(tl, "gather")
    with pytest.raises(ValueError, match=r"attention dropout in the triton kernel needs triton >= 3.3 \(tl.gather\)"):
        select_backend(narrow, narrow, narrow, backend="triton", dropout=True)
    assert select_backend(narrow, narrow, narrow, backend="triton", dropout=False).name == "triton"


def test_triton_backward_copies_a_grad_o_too_wide_for_its_int32_offsets(monkeypatch):
    """grad_o reaches the backward in whatever layout autograd hands it; one whose sequence stride is past
    the int32 tile offsets' limit is copied to a contiguous tensor first (q, k, v are refused in forward)."""
    from seqpar.triton_kernels import attention as kernels

    q, k, v = (randn(1, 1, 2, 16) for _ in range(3))
    o, lse = kernels.attention_fwd(q, k, v, True, 0.25)
    storage = torch.zeros(kernels.MAX_SEQ_STRIDE + 64)
    wide = storage.as_strided((1, 1, 2, 16), (16, 16, kernels.MAX_SEQ_STRIDE + 1, 1))
    wide.copy_(randn(1, 1, 2, 16))
    seen = []   # the grad_o each kernel is launched with
    real_launch = kernels._launch

    def launch(which, even_kernel, tuned_kernel, grid_rows, bh, args, *rest):
        seen.append(args[4 if which == "dq" else 3])
        return real_launch(which, even_kernel, tuned_kernel, grid_rows, bh, args, *rest)

    monkeypatch.setattr(kernels, "_launch", launch)
    grads = kernels.attention_bwd(wide, q, k, v, o, lse, True, 0.25)
    assert [g.stride(2) for g in seen] == [16, 16]
    want = kernels.attention_bwd(wide.contiguous(), q, k, v, o, lse, True, 0.25)
    for got, ref in zip(grads, want):
        torch.testing.assert_close(got, ref, atol=0, rtol=0)


def test_causal_alias():
    q, k, v = (randn(1, 2, 9, 16) for _ in range(3))
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    for kwargs in ({"causal": True}, {"causal": True, "is_causal": True}):
        torch.testing.assert_close(attention_core(q, k, v, backend="torch", **kwargs), ref, atol=1e-6, rtol=1e-5)
    full = F.scaled_dot_product_attention(q, k, v)
    torch.testing.assert_close(attention_core(q, k, v, causal=False, backend="torch"), full, atol=1e-6, rtol=1e-5)
    for kwargs in ({"causal": True, "is_causal": False}, {"causal": False, "is_causal": True}):
        with pytest.raises(ValueError, match="disagree"):
            attention_core(q, k, v, **kwargs)


@pytest.mark.parametrize("case", ["tensor_mask", "bool_mask", "is_causal_str", "causal_int", "gqa_str"])
def test_sdpa_keywords_reject_what_they_do_not_support(case):
    q = randn(1, 2, 8, 16)
    kwargs, match = {
        "tensor_mask": ({"attn_mask": torch.zeros(8, 8)}, r"attn_mask: only None is supported.*\(8, 8\)"),
        "bool_mask": ({"attn_mask": torch.ones(8, 8, dtype=torch.bool)}, "only None is supported"),
        "is_causal_str": ({"is_causal": "yes"}, "is_causal must be a bool"),
        "causal_int": ({"causal": 1}, "causal must be a bool"),
        "gqa_str": ({"enable_gqa": "yes"}, "enable_gqa must be a bool"),
    }[case]
    with pytest.raises(ValueError, match=match):
        attention_core(q, q, q, **kwargs)


# ----------------------------------------------------------------------------- grouped-query attention
GQA = [(6, 2), (6, 3)]


def _gqa_inputs(b, heads, kv_heads, s, d, dtype=torch.float32):
    return randn(b, heads, s, d, dtype=dtype), randn(b, kv_heads, s, d, dtype=dtype), \
        randn(b, kv_heads, s, d, dtype=dtype), randn(b, heads, s, d, dtype=dtype)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("heads,kv_heads", GQA, ids=lambda v: str(v))
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_gqa_matches_sdpa(backend, heads, kv_heads, causal):
    """enable_gqa=True: o and dq, dk, dv against SDPA's enable_gqa in fp64 (dropout 0); dk, dv have k's
    Hk heads (each the sum over its group of q heads)."""
    q, k, v, grad_o = _gqa_inputs(2, heads, kv_heads, 37, 16)
    o, grads = run(backend, q, k, v, grad_o, causal, 0.0, enable_gqa=True)
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    o_ref = F.scaled_dot_product_attention(q64, k64, v64, is_causal=causal, enable_gqa=True)
    grads_ref = torch.autograd.grad(o_ref, (q64, k64, v64), grad_o.double())
    assert o.shape == q.shape and grads[1].shape == grads[2].shape == k.shape
    torch.testing.assert_close(o.double(), o_ref, atol=2e-6, rtol=1e-5)
    for name, g, g_ref in zip(("dq", "dk", "dv"), grads, grads_ref):
        torch.testing.assert_close(g.double(), g_ref, atol=1e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")


def test_gqa_dropout_rows_are_per_q_head_and_shard_by_rank():
    """With dropout, GQA draws the mask of the q heads (head-major rows over Hq): triton and the torch
    reference both match the fp64 computation on k, v repeated to Hq heads. A tensor-parallel rank owning
    q heads 3..5 and kv head 1 of (Hq, Hk) = (6, 2) passes row_offset = 3 * b * s and reproduces those
    heads of the single-device call: o, dq of its q heads and dk, dv of its kv head."""
    b, heads, kv_heads, s, d, p = 2, 6, 2, 21, 16, 0.3
    q, k, v, grad_o = _gqa_inputs(b, heads, kv_heads, s, d)
    o_ref, grads_ref = reference_fp64(q, k, v, grad_o, True, p, SEED)
    for backend in ("triton", "torch"):
        o, grads = run(backend, q, k, v, grad_o, True, p, enable_gqa=True)
        torch.testing.assert_close(o.double(), o_ref, atol=2e-5, rtol=1e-4)
        for name, g, g_ref in zip(("dq", "dk", "dv"), grads, grads_ref):
            torch.testing.assert_close(g.double(), g_ref, atol=5e-5, rtol=1e-4, msg=lambda m: f"{backend} {name}: {m}")
        q_sl, kv_sl = slice(3, 6), slice(1, 2)
        o_part, g_part = run(backend, q[:, q_sl], k[:, kv_sl], v[:, kv_sl], grad_o[:, q_sl], True, p,
                             row_offset=3 * b * s, enable_gqa=True)
        torch.testing.assert_close(o_part, o[:, q_sl], atol=1e-6, rtol=1e-6)
        for g, gf, sl in zip(g_part, grads, (q_sl, kv_sl, kv_sl)):
            torch.testing.assert_close(g, gf[:, sl], atol=1e-6, rtol=1e-6)


def test_grouped_keep_mask_is_the_mask_in_group_rows_layout():
    """The torch reference draws its attention-dropout mask in group_rows' layout [b, Hk, G s, s_k]:
    the same bits as the [b, Hq, s, s_k] mask, regrouped (here also at a row offset, s_q != s_k)."""
    from seqpar.ops.attention_core import group_rows
    b, heads, kv_heads, s_q, s_k = 2, 6, 2, 5, 7
    spec = DropoutSpec(0.3, SEED, 40)
    grouped = attention_keep_mask(spec, b, heads, s_q, s_k, "cpu", kv_heads)
    assert grouped.shape == (b, kv_heads, heads // kv_heads * s_q, s_k)
    assert torch.equal(grouped, group_rows(attention_keep_mask(spec, b, heads, s_q, s_k, "cpu"), kv_heads))


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_gqa_keeps_k_and_v_at_their_heads(backend):
    """Nothing saved for backward is k or v repeated to Hq heads: the saved tensors are q, k, v as given
    (Hk heads), then triton's o and lse or the torch reference's two s x s probability tensors (in
    group_rows' layout [b, Hk, G s, s]: Hq s x s matrices, no more)."""
    b, heads, kv_heads, s, d = 1, 6, 2, 16, 16
    q = randn(b, heads, s, d).requires_grad_()
    k, v = (randn(b, kv_heads, s, d).requires_grad_() for _ in range(2))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        o = attention_core(q, k, v, is_causal=True, enable_gqa=True, dropout_p=0.1, seed=SEED, backend=backend)
    o.sum().backward()
    extra = [(b, heads, s, d), (b, heads, s)] if backend == "triton" else [(b, kv_heads, heads // kv_heads * s, s)] * 2
    assert sorted(saved) == sorted([(b, heads, s, d), (b, kv_heads, s, d), (b, kv_heads, s, d)] + extra)


@pytest.mark.parametrize("kv_heads,kwargs,match", [
    (2, {}, "enable_gqa=True"),
    (4, {"enable_gqa": True}, "dividing q heads"),
    (0, {"enable_gqa": True}, "at least one head, got 6 q heads and 0 k/v heads"),
    ((0, 0), {}, "at least one head, got 0 q heads"),
], ids=["heads-differ-without-enable_gqa", "kv-heads-not-dividing", "no-kv-heads", "no-heads"])
def test_gqa_bad_head_counts(kv_heads, kwargs, match):
    heads, kv_heads = kv_heads if isinstance(kv_heads, tuple) else (6, kv_heads)
    q, k = randn(1, heads, 8, 16), randn(1, kv_heads, 8, 16)
    with pytest.raises(ValueError, match=match):
        attention_core(q, k, k, **kwargs)


# ----------------------------------------------------------------------------- large logits (cuda path)
def test_cuda_path_scales_scores_inside_the_gemm():
    """The cuda backend's score GEMM (scaled_matmul: baddbmm with alpha = scale) scales the fp32
    accumulator before rounding to fp16, so logits whose unscaled q k^T overflows fp16 (> 65504) stay
    finite; runs on CPU (the same host code drives cuBLAS on the GPU)."""
    from seqpar.ops.attention_core import group_rows, scaled_matmul

    b, heads, kv_heads, s, d = 1, 4, 2, 8, 64
    q = (33 + torch.rand(b, heads, s, d)).half()                  # q . k ~ 64 * 33.5^2 ~ 7e4
    k = (33 + torch.rand(b, kv_heads, s, d)).half()
    assert torch.isinf(q[:, :2] @ k.transpose(-2, -1)).any()      # the unscaled product overflows
    scale = d ** -0.5
    scores = scaled_matmul(group_rows(q, kv_heads), k.transpose(-2, -1), scale).view(b, heads, s, s)
    ref = torch.matmul(q.double(), k.double().repeat_interleave(2, 1).transpose(-2, -1)) * scale
    assert scores.dtype == torch.float16 and torch.isfinite(scores).all()
    torch.testing.assert_close(scores.double(), ref, atol=0, rtol=2e-3)


# ----------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("d", [12, 20, 160], ids=lambda d: f"d{d}")
def test_triton_rejects_unsupported_head_dim(d):
    q = randn(1, 2, 8, d)
    with pytest.raises(ValueError, match=f"d={d}"):
        attention_core(q, q, q, backend="triton")
    reason = registry.unavailable_reason(OP, "triton", q.device, q=q, k=q, v=q, causal=True)
    assert reason and f"d={d}" in reason
    o = attention_core(q, q, q, backend="auto")              # auto falls back to a backend that can
    assert o.shape == q.shape and torch.isfinite(o).all()


def test_auto_prefers_triton_then_falls_back(monkeypatch):
    """With every backend usable (simulated: no GPU here), auto picks the recompute-free triton
    backend; for a head dim triton can't run it falls back to cuda, then torch. fp32 runs the triton
    kernels' IEEE FMA testing mode, so auto takes cuda for it; an explicit triton still runs it."""
    import seqpar._ext as ext

    q64, q12 = torch.empty(1, 2, 8, 64, dtype=torch.bfloat16), torch.empty(1, 2, 8, 12, dtype=torch.bfloat16)
    q64_fp32 = q64.float()
    assert select_backend(q64, q64, q64).name == "torch"          # CPU: auto never uses the interpreter
    monkeypatch.setattr(ext, "triton_unavailable_reason", lambda device, auto=False: None)
    monkeypatch.setattr(ext, "cuda_unavailable_reason", lambda device: None)
    assert select_backend(q64, q64, q64).name == "triton"
    assert select_backend(q12, q12, q12).name == "cuda"
    assert select_backend(q64, q64, q64, backend="cuda").name == "cuda"
    assert select_backend(q64_fp32, q64_fp32, q64_fp32).name == "cuda"
    assert select_backend(q64_fp32, q64_fp32, q64_fp32, backend="triton").name == "triton"
    reason = registry.unavailable_reason(OP, "triton", q64.device, auto=True, q=q64_fp32, k=q64_fp32, v=q64_fp32)
    assert "fp32" in reason and "backend='triton'" in reason
    assert registry.unavailable_reason(OP, "triton", q64.device, q=q64_fp32, k=q64_fp32, v=q64_fp32) is None
    monkeypatch.setenv("SEQPAR_BACKEND", "torch")
    assert select_backend(q64, q64, q64).name == "torch"


def test_triton_check_accepts_the_issue_head_dims():
    for d in (32, 64, 80, 96, 128):
        q = torch.empty(1, 1, 4, d)
        assert registry._REGISTRY[OP]["triton"].check(q=q, k=q, v=q, causal=True) is None, d


@pytest.mark.parametrize("case", ["dtype", "kv_shape", "head_dim", "head_dim_zero", "sparse", "p_one", "p_negative",
                                  "p_rounds_to_256", "rank3"])
def test_bad_input_raises_value_error(case):
    q, k, v = (randn(1, 2, 8, 32) for _ in range(3))
    kwargs, match = {}, None
    if case == "dtype":
        k, match = k.half(), "dtypes differ"
    elif case == "kv_shape":
        v, match = randn(1, 2, 9, 32), "k shape"
    elif case == "head_dim":
        k, v, match = randn(1, 2, 8, 64), randn(1, 2, 8, 64), "head dim"
    elif case == "head_dim_zero":   # the default scale 1 / sqrt(d) was a ZeroDivisionError
        q = k = v = randn(1, 2, 8, 0)
        match = r"head dim d of at least 1, got q shape \(1, 2, 8, 0\)"
    elif case == "sparse":          # failed deep inside (aten::view on SparseCPU)
        q, match = q.to_sparse(), "q must be a dense .strided. tensor, got layout torch.sparse_coo"
    elif case == "p_one":
        kwargs, match = {"dropout_p": 1.0}, "1.0"
    elif case == "p_negative":
        kwargs, match = {"dropout_p": -0.1}, "-0.1"
    elif case == "p_rounds_to_256":
        kwargs, match = {"dropout_p": 0.999}, r"round\(p \* 256\) < 256.*0.999"
    elif case == "rank3":
        q, match = q[0], r"\[b, heads, s, d\]"
    with pytest.raises(ValueError, match=match):
        attention_core(q, k, v, backend="triton", **kwargs)


def test_cuda_backend_unavailable_on_cpu_raises():
    if HAS_CUDA:
        pytest.skip("CPU-only check")
    q = randn(1, 1, 4, 32)
    with pytest.raises(ValueError, match="cuda"):
        attention_core(q, q, q, backend="cuda")


# ----------------------------------------------------------------------------- GPU
def _gpu_backend_ready(backend):
    reason = registry.unavailable_reason(OP, backend, torch.device("cuda"))
    if reason:
        pytest.skip(reason)


@pytest.mark.gpu
@pytest.mark.parametrize("p", [0.0, 0.2], ids=["p0", "p0.2"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("shape", [(1, 1, 1, 32), (2, 3, 37, 64), (1, 2, 128, 128), (2, 2, 200, 96)], ids=_ids)
@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_gpu_fp32_matches_fp64(backend, shape, causal, p):
    _gpu_backend_ready(backend)
    q, k, v, grad_o = (randn(*shape) for _ in range(4))
    o, grads = run(backend, q, k, v, grad_o, causal, p)
    o_ref, grads_ref = reference_fp64(q, k, v, grad_o, causal, p, SEED)
    torch.testing.assert_close(o.double(), o_ref, atol=5e-5, rtol=1e-4)
    for name, g, g_ref in zip(("dq", "dk", "dv"), grads, grads_ref):
        torch.testing.assert_close(g.double(), g_ref, atol=2e-4, rtol=1e-3, msg=lambda m: f"{name}: {m}")


@pytest.mark.gpu
@pytest.mark.parametrize("scale", [-0.4, 0.0])
@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_gpu_any_finite_scale(backend, scale):
    """test_any_finite_scale_as_sdpa on the device: the cuda backend's score GEMM takes the scale as
    its alpha (negative or zero included)."""
    _gpu_backend_ready(backend)
    q, k, v, grad_o = (randn(2, 3, 37, 64) for _ in range(4))
    o, grads = run(backend, q, k, v, grad_o, True, 0.2, scale=scale)
    o_ref, grads_ref = reference_fp64(q, k, v, grad_o, True, 0.2, SEED, scale=scale)
    torch.testing.assert_close(o.double(), o_ref, atol=5e-5, rtol=1e-4)
    for name, g, g_ref in zip(("dq", "dk", "dv"), grads, grads_ref):
        torch.testing.assert_close(g.double(), g_ref, atol=2e-4, rtol=1e-3, msg=lambda m: f"{name}: {m}")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_gpu_dropout_mask_is_the_reference_mask(backend):
    _gpu_backend_ready(backend)
    b, heads, s_q, s_k, p, row_offset = 2, 3, 77, 64, 0.5, 999
    q, k = randn(b, heads, s_q, s_k), randn(b, heads, s_k, s_k)
    eye = torch.eye(s_k, device="cuda").expand(b, heads, s_k, s_k).contiguous()
    o = attention_core(q, k, eye, is_causal=False, dropout_p=p, seed=SEED, row_offset=row_offset, backend=backend)
    keep = attention_keep_mask(DropoutSpec(p, SEED, row_offset), b, heads, s_q, s_k, q.device)
    assert torch.equal(o != 0, keep)


def eager_same_dtype(q, k, v, grad_o, causal, p, seed):
    """Plain torch in the inputs' dtype (GEMMs round to it, softmax in fp32): the "same-dtype torch"
    baseline of the 2x error rule."""
    b, heads, s_q, d = q.shape
    s_k = k.shape[2]
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d))
    if causal:
        scores = scores.masked_fill(causal_mask(s_q, s_k, q.device), float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    if p > 0:
        spec = DropoutSpec(p, seed, 0)
        probs = probs * attention_keep_mask(spec, b, heads, s_q, s_k, q.device) * spec.scale
    o = probs @ v
    return o.detach(), torch.autograd.grad(o, (q, k, v), grad_o)


@pytest.mark.gpu
@pytest.mark.parametrize("p", [0.0, 0.1], ids=["p0", "p0.1"])
@pytest.mark.parametrize("s", [2048, 4096])
@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_gpu_bf16_long_sequences(backend, s, p):
    """bf16, d = 128, causal: error vs the fp32 torch reference (same inputs, upcast) within 2x the
    error of plain torch in bf16."""
    _gpu_backend_ready(backend)
    b, heads, d = 1, 4, 128
    q, k, v, grad_o = (randn(b, heads, s, d, dtype=torch.bfloat16) for _ in range(4))
    o, grads = run(backend, q, k, v, grad_o, True, p)
    o_t, grads_t = eager_same_dtype(q, k, v, grad_o, True, p, SEED)
    o_ref, grads_ref = run("torch", q.float(), k.float(), v.float(), grad_o.float(), True, p)
    assert_error_within(o, o_t, o_ref, floor=1e-3, name="o")
    for name, g, g_t, g_ref in zip(("dq", "dk", "dv"), grads, grads_t, grads_ref):
        assert_error_within(g, g_t, g_ref, floor=1e-3 * g_ref.abs().max().item(), name=name)


@pytest.mark.gpu
def test_gpu_triton_peak_memory_has_no_quadratic_term():
    """fwd + bwd at b = 1, 8 heads, s = 4096 allocates ~32 MB (o, dq, dk, dv, lse), far below the
    268 MB that one bf16 s x s score matrix per head would take."""
    _gpu_backend_ready("triton")
    b, heads, s, d = 1, 8, 4096, 128
    q, k, v = (randn(b, heads, s, d, dtype=torch.bfloat16).requires_grad_() for _ in range(3))
    attention_core(q, k, v, dropout_p=0.1, seed=SEED, backend="triton").sum().backward()   # autotune, warm
    q.grad = k.grad = v.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    o = attention_core(q, k, v, dropout_p=0.1, seed=SEED, backend="triton")
    o.sum().backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    assert extra < b * heads * s * s * 2 // 4, extra


@pytest.mark.gpu
@pytest.mark.parametrize("p", [0.0, 0.2], ids=["p0", "p0.2"])
@pytest.mark.parametrize("heads,kv_heads", GQA + [(8, 1)], ids=lambda v: str(v))
@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_gpu_gqa_matches_fp64(backend, heads, kv_heads, p):
    """GQA on the GPU kernels (fp32, ragged s = 200, d = 64): o, dq, dk, dv vs the fp64 computation on k, v
    repeated to Hq heads, the dropout mask drawn per q head."""
    _gpu_backend_ready(backend)
    q, k, v, grad_o = _gqa_inputs(2, heads, kv_heads, 200, 64)
    o, grads = run(backend, q, k, v, grad_o, True, p, enable_gqa=True)
    o_ref, grads_ref = reference_fp64(q, k, v, grad_o, True, p, SEED)
    assert grads[1].shape == k.shape
    torch.testing.assert_close(o.double(), o_ref, atol=5e-5, rtol=1e-4)
    for name, g, g_ref in zip(("dq", "dk", "dv"), grads, grads_ref):
        torch.testing.assert_close(g.double(), g_ref, atol=2e-4, rtol=1e-3, msg=lambda m: f"{name}: {m}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_gpu_softmax_kernel_infinite_scores_give_the_limit_not_nan(dtype):
    """The softmax-dropout kernel reads +-inf scores (fp16 overflow of large logits) as +-FLT_MAX: a row's
    +inf entries share its probability equally, -inf entries get 0, a row of -inf only is uniform; NaN
    never appears. Backward of those probabilities is finite too."""
    _gpu_backend_ready("cuda")
    from seqpar import _ext

    b, heads, s_q, s_k = 1, 2, 4, 40
    scores = torch.randn(b, heads, s_q, s_k, device="cuda").to(dtype)
    scores[0, 0, 0, [3, 17]] = float("inf")                   # two +inf: 1/2 each
    scores[0, 0, 1, :] = float("-inf")                          # all -inf: uniform
    scores[0, 0, 2, ::3] = float("-inf")                        # some -inf: zero there, softmax elsewhere
    scores[0, 1, 3, 5] = float("inf")
    scores[0, 1, 3, 6] = float("-inf")
    expected = torch.softmax(scores.float().clamp(-3e38, 3e38), dim=-1)
    probs = torch.full_like(scores, float("nan"))
    x = scores.clone()
    ext = _ext.cuda_extension()
    ext.attention_softmax_dropout_fwd(x.data_ptr(), probs.data_ptr(), b, heads, s_q, s_k, _ext.DTYPE_CODES[dtype],
                                      False, 0, 0, 0, _ext.cuda_stream(x.device))
    torch.cuda.synchronize()
    assert torch.isfinite(probs).all()
    assert probs[0, 0, 0, 3].item() == probs[0, 0, 0, 17].item() == 0.5
    torch.testing.assert_close(probs[0, 0, 1].float(), torch.full((s_k,), 1 / s_k, device="cuda"), atol=1e-3, rtol=0)
    torch.testing.assert_close(probs.float(), expected, **dict(zip(("atol", "rtol"), TOLERANCES[dtype])))
    grad = torch.randn_like(probs)
    ext.attention_softmax_dropout_bwd(probs.data_ptr(), grad.data_ptr(), 0, b, heads, s_q, s_k,
                                      _ext.DTYPE_CODES[dtype], False, 0, 0, 0, _ext.cuda_stream(x.device))
    torch.cuda.synchronize()
    assert torch.isfinite(grad).all()


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_gpu_fp16_large_logits_stay_finite(backend):
    """fp16 logits whose unscaled q k^T overflows fp16 (|q . k| ~ 7e4 > 65504): outputs and gradients are
    finite, and each output row is a convex combination of the value rows it attends to (dropout 0). (The
    scaled scores, ~9e3, are rounded to fp16's spacing of 8 on the cuda path, so which key wins a row is
    not comparable with an fp32 reference; the bounds are.)"""
    _gpu_backend_ready(backend)
    b, heads, kv_heads, s, d = 1, 4, 2, 64, 64
    q = (33 + torch.rand(b, heads, s, d, device="cuda")).half()
    k = (33 + torch.rand(b, kv_heads, s, d, device="cuda")).half()
    v, grad_o = randn(b, kv_heads, s, d, dtype=torch.float16), randn(b, heads, s, d, dtype=torch.float16)
    assert torch.isinf(q[:, :2] @ k.transpose(-2, -1)).any()
    o, grads = run(backend, q, k, v, grad_o, True, 0.0, enable_gqa=True)
    for name, got in zip(("o", "dq", "dk", "dv"), (o,) + grads):
        assert torch.isfinite(got).all(), name
    v_rep = v.float().repeat_interleave(heads // kv_heads, 1)                  # [b, H, s, d]
    low = torch.cummin(v_rep, dim=2).values                                    # over keys j <= i (causal)
    high = torch.cummax(v_rep, dim=2).values
    assert (o.float() >= low - 1e-2).all() and (o.float() <= high + 1e-2).all()


def test_triton_autotunes_once_per_length_bucket(monkeypatch):
    """On a GPU the autotuner keys on the exact s_q / s_k: a generation loop benchmarked the tiles again
    at every new length. The launcher tunes at the first length of a power-of-two bucket of (s_q, s_k)
    and launches the tuned tile as a fixed config at the bucket's other lengths. (Fake kernels record the
    launches; the interpreter always takes its fixed tile.)"""
    import triton

    from seqpar.triton_kernels import attention as A

    launches, s_q_index = [], A._attn_fwd_kernel.arg_names.index("S_Q")

    class Kernel:
        def __init__(self, name, best=None):
            self.name, self.best_config = name, best

        def __getitem__(self, grid):
            # tuning holds the lock: best_config is one attribute per kernel, which another thread could set
            assert self.name == "fixed" or A._TUNE_LOCK.locked()
            return lambda *args, **meta: launches.append((self.name, args[s_q_index], meta.get("BLOCK_M"),
                                                          meta.get("num_warps")))

    tuned = triton.Config({"BLOCK_M": 64, "BLOCK_N": 32}, num_warps=4, num_stages=3)
    monkeypatch.setattr(A, "_interpret", lambda: False)
    monkeypatch.setattr(A, "_BUCKET_CONFIGS", {})
    monkeypatch.setattr(A, "_fwd_tuned", Kernel("tuned", tuned))
    monkeypatch.setattr(A, "_fwd_even", Kernel("fixed"))
    for s in (100, 120, 128, 129, 5, 16):
        q = torch.randn(1, 2, s, 16, dtype=torch.bfloat16)
        A.attention_fwd(q, q, q, True, 0.25)
    assert launches == [("tuned", 100, None, None), ("fixed", 120, 64, 4), ("fixed", 128, 64, 4),
                        ("tuned", 129, None, None), ("tuned", 5, None, None), ("fixed", 16, 64, 4)]


def test_triton_autotuner_cache_is_cleared_when_the_gpu_arch_changes(monkeypatch):
    """Triton's autotune cache keys leave the device out: in a process with an H100 and an L4, the L4's
    first call reused the H100's choice untimed (a tile the L4's shared memory can't hold). The cache is
    cleared whenever a kernel tunes for another arch than it last did."""
    import triton

    from seqpar.triton_kernels import attention as A

    class Kernel:
        def __init__(self):
            self.cache, self.best_config = {"old": 1}, triton.Config({"BLOCK_M": 64}, num_warps=4)

        def __getitem__(self, grid):
            return lambda *args, **meta: None

    tuned = Kernel()
    archs = iter([(9, 0), (9, 0), (8, 9), (8, 9)])
    monkeypatch.setattr(A, "_interpret", lambda: False)
    monkeypatch.setattr(A, "_BUCKET_CONFIGS", {})
    monkeypatch.setattr(A, "_TUNED_FOR", {})
    monkeypatch.setattr(A, "_fwd_tuned", tuned)
    monkeypatch.setattr(A, "_arch", lambda like: next(archs))
    seen = []
    for s in (16, 64, 256, 1024):   # a new bucket each: every call tunes
        q = torch.randn(1, 2, s, 16, dtype=torch.bfloat16)
        A.attention_fwd(q, q, q, True, 0.25)
        seen.append(dict(tuned.cache))
        tuned.cache["tuned"] = s
    assert seen == [{"old": 1}, {"old": 1, "tuned": 16}, {}, {"tuned": 256}]


def test_triton_fp32_launches_one_fixed_tile_without_the_autotuner(monkeypatch):
    """fp32 (a testing mode: IEEE FMA dots) takes one modest 8-warp tile per kernel as a fixed config; the
    autotuner is never called (triton 3.6's benchmarks even the one config a prune leaves, at every new
    shape of the gpu tests)."""
    from seqpar.triton_kernels import attention as A

    launches = []

    class Kernel:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **meta: launches.append((self.name, {key: meta.get(key) for key in
                                                                      ("BLOCK_M", "BLOCK_N", "num_warps")}))

    monkeypatch.setattr(A, "_interpret", lambda: False)
    for which in ("fwd", "dq", "dkdv"):
        monkeypatch.setattr(A, f"_{which}_tuned", Kernel(f"{which} tuned"))
        monkeypatch.setattr(A, f"_{which}_even", Kernel(which))
    q = torch.randn(1, 2, 40, 16)
    o, lse = A.attention_fwd(q, q, q, True, 0.25)
    A.attention_bwd(o, q, q, q, o, lse, True, 0.25)
    assert [name for name, _ in launches] == ["fwd", "dq", "dkdv"]
    for name, meta in launches:
        assert meta == {key: A.FP32_CONFIG[name][key] for key in meta}
        assert meta["num_warps"] == 8


def test_a_refused_call_draws_no_seed():
    """The seed (seed=None) was drawn before the explicit backend was checked: a refused call moved torch's
    generator on, so every later mask differed from a run without it."""
    q = randn(1, 2, 4, 8)   # head dim 8: not the triton kernel's
    state = torch.get_rng_state()
    with pytest.raises(ValueError, match="head dim d=8"):
        attention_core(q, q, q, is_causal=True, dropout_p=0.1, backend="triton")
    assert torch.equal(torch.get_rng_state(), state)
    attention_core(q, q, q, is_causal=True, dropout_p=0.1, backend="torch")
    assert not torch.equal(torch.get_rng_state(), state)


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_torch_backend_takes_batched_gradients(kv_heads):
    """autograd.grad(is_grads_batched=True) and jacobian(vectorize=True) vmap the backward, which had no
    batching rule for group_rows' unflatten (a torch-internal RuntimeError); each batched gradient now
    equals its own backward, as with F.scaled_dot_product_attention."""
    q = randn(1, 4, 5, 8).requires_grad_()
    k, v = (randn(1, kv_heads, 5, 8).requires_grad_() for _ in range(2))
    o = attention_core(q, k, v, is_causal=True, enable_gqa=True, backend="torch")
    grads_o = randn(3, *o.shape)
    batched = torch.autograd.grad(o, (q, k, v), grads_o, is_grads_batched=True, retain_graph=True)
    for i in range(3):
        one = torch.autograd.grad(o, (q, k, v), grads_o[i], retain_graph=True)
        for got, want in zip(batched, one):
            torch.testing.assert_close(got[i], want, atol=1e-6, rtol=1e-5)
