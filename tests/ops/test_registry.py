"""The backend registry's visibility of auto fallbacks: what "auto" picks and why it skips the others
(auto_report, shown by ``python -m seqpar info``), and the backends that actually ran
(record_selections, recorded in the bench rows)."""
import os
import subprocess
import sys

import pytest
import torch

from seqpar.ops import attention_core, bias_dropout_add_layer_norm, registry


def test_auto_report_names_the_pick_the_skipped_and_the_limits(monkeypatch):
    import seqpar._ext as ext

    cpu = registry.auto_report(torch.device("cpu"))
    att = cpu["attention_core"]
    assert att.picked == "torch" and set(att.skipped) == {"triton", "cuda"}
    assert "CUDA tensors" in att.skipped["cuda"]
    assert "head dim" in att.limits["triton"]
    row_limit = "fp32 / fp16 / bf16 (float64 runs on the torch backend only); rows < 2**30."   # any h
    assert cpu["bias_dropout_add_layer_norm"].limits == {"triton": row_limit, "cuda": row_limit}
    # the Llama ops' kernels say in words what they turn away (their checks' docstrings)
    assert cpu["swiglu"].limits["cuda"].startswith("fp32 / fp16 / bf16")
    assert cpu["rotary_embedding"].limits["triton"].startswith("head dim d <= 8192")
    # A machine where every backend is usable (simulated): auto picks the op's first choice.
    monkeypatch.setattr(ext, "triton_unavailable_reason", lambda device, auto=False: None)
    monkeypatch.setattr(ext, "cuda_unavailable_reason", lambda device: None)
    gpu = registry.auto_report(torch.device("cuda"))
    assert gpu["attention_core"].picked == "triton" and gpu["attention_core"].skipped == {}
    assert gpu["bias_dropout_add_layer_norm"].picked == "cuda"


def test_a_backend_forced_by_seqpar_backend_that_cant_run_names_the_variable(monkeypatch, capsys):
    """SEQPAR_BACKEND=triton on CPU tensors (no interpreter): every op called with backend="auto" raises,
    and the message said "backend 'triton' can't run ..." without naming the variable that chose it; an
    explicit backend= keeps the plain message. ``seqpar info`` says the variable overrides its auto
    choices, and names a bad value instead of failing."""
    from seqpar import cli

    monkeypatch.setattr(registry._ext, "triton_unavailable_reason", lambda device, auto=False: "no triton here")
    monkeypatch.setenv("SEQPAR_BACKEND", "triton")
    with pytest.raises(ValueError, match=r"^backend 'triton' \(from SEQPAR_BACKEND\) can't run swiglu: no triton"):
        registry.select("swiglu", "auto", torch.device("cpu"))
    with pytest.raises(ValueError, match=r"^backend 'triton' can't run swiglu: no triton"):
        registry.select("swiglu", "triton", torch.device("cpu"))
    cli.info()
    assert 'SEQPAR_BACKEND=triton: every op called with backend="auto"' in capsys.readouterr().out
    monkeypatch.setenv("SEQPAR_BACKEND", "bogus")
    cli.info()
    assert "SEQPAR_BACKEND='bogus' is not one of" in capsys.readouterr().out


def test_a_gpu_the_cuda_extension_has_no_kernels_for_is_skipped_by_auto(monkeypatch):
    """The default build has sm_80 / sm_90 kernels only; on an older GPU (a T4, sm_75) the cuda backend was
    offered anyway and its first launch failed ("no kernel image"). The extension now says whether its
    kernels run on the device (asked once per device): auto takes the next backend, an explicit
    backend="cuda" names the GPU and the rebuild (simulated GPU and extension here)."""
    import contextlib

    import seqpar._ext as ext

    class OldGpuExtension:
        def kernel_image_error(self):
            return "no kernel image is available for execution on the device"

    monkeypatch.setattr(ext, "cuda_extension_error", lambda: None)
    monkeypatch.setattr(ext, "cuda_extension", OldGpuExtension)
    monkeypatch.setattr(ext, "triton_unavailable_reason", lambda device, auto=False: None)
    monkeypatch.setattr(torch.cuda, "device", lambda index: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (7, 5))
    ext._kernel_image_error.cache_clear()
    try:
        gpu = torch.device("cuda", 0)
        assert "sm_75" in ext.cuda_unavailable_reason(gpu) and "SEQPAR_CUDA_ARCHS=75" in ext.cuda_unavailable_reason(gpu)
        assert registry.select("swiglu", "auto", gpu) is registry.get("swiglu", "triton")
        with pytest.raises(ValueError, match=r"backend 'cuda' can't run swiglu: seqpar._C has no kernels for this GPU"):
            registry.select("swiglu", "cuda", gpu)
    finally:
        ext._kernel_image_error.cache_clear()


def test_record_selections_collects_what_ran_nested():
    q = torch.randn(1, 2, 8, 16)
    x, w = torch.randn(3, 40), torch.ones(40)
    with registry.record_selections() as outer:
        attention_core(q, q, q)
        with registry.record_selections() as inner:
            bias_dropout_add_layer_norm(x, None, x, w, w, backend="torch")
    assert outer == {"attention_core": {"torch"}, "bias_dropout_add_layer_norm": {"torch"}}
    assert inner == {"bias_dropout_add_layer_norm": {"torch"}}
    attention_core(q, q, q)                                     # nothing records outside the blocks
    assert outer["attention_core"] == {"torch"} and "attention_core" not in inner


def test_layer_bench_rows_record_the_backends_that_ran(capsys):
    from seqpar.bench import layer_bench

    rows = layer_bench.main(["--tp", "1", "--seq-len", "8", "--hidden", "32", "--heads", "2", "--batch", "1",
                             "--iters", "1", "--warmup", "0", "--dtype", "fp32"])
    assert len(rows) == 5
    for row in rows:
        assert row["backends"] == {"attention_core": "torch", "bias_dropout_add_layer_norm": "torch",
                                   "dropout": "torch"}, row   # dropout: the MLP output's bias-dropout-add
    out = capsys.readouterr().out
    assert "attention_core ran on: torch" in out and "bias_dropout_add_layer_norm ran on: torch" in out
    assert "dropout ran on: torch" in out


# ----------------------------------------------------------------------------- argument checks every op shares
def _sparse_cases():
    from seqpar.ops import add_rms_norm, all_gather_matmul, bias_dropout_add, dropout, DropoutSpec, rotary_embedding, swiglu

    x, res, w, b = torch.randn(3, 8), torch.randn(3, 8), torch.randn(8), torch.randn(8)
    q = torch.randn(2, 1, 1, 4)
    return {   # (call, the argument the ValueError must name)
        "layer norm weight": (lambda: bias_dropout_add_layer_norm(x, None, res, w.to_sparse(), b), "ln_weight"),
        "layer norm bias": (lambda: bias_dropout_add_layer_norm(x, b.to_sparse(), res, w, b), "bias"),
        "rms norm x": (lambda: add_rms_norm(x.to_sparse(), None, w), "x"),
        # the torch reference accepted a sparse weight and returned a sparse y
        "rms norm weight": (lambda: add_rms_norm(x, None, w.to_sparse()), "weight"),
        "swiglu": (lambda: swiglu(x.to_sparse()), "gate_up"),
        "rotary": (lambda: rotary_embedding(q.to_sparse(), q), "q"),
        "dropout": (lambda: dropout(x.to_sparse(), DropoutSpec(0.1, 3)), "x"),
        "bias_dropout_add": (lambda: bias_dropout_add(x, None, res.to_sparse(), DropoutSpec(0.1, 3)), "residual"),
        # accepted silently too
        "comm matmul weight": (lambda: all_gather_matmul(x[:, None], w[None].to_sparse(), None, group=None), "weight"),
    }


@pytest.mark.parametrize("case", list(_sparse_cases()))
def test_every_op_refuses_a_sparse_argument_by_name(case):
    """Sparse tensors passed every op's checks and failed deep inside torch (RuntimeError,
    NotImplementedError), or were accepted: registry.check_dense names them."""
    call, name = _sparse_cases()[case]
    with pytest.raises(ValueError, match=f"{name} must be a dense .strided. tensor, got layout torch.sparse_coo"):
        call()


def test_numbers_too_large_for_a_float_or_an_int64_are_value_errors():
    """eps / theta of 10**400 passed the checks (an int compares finite) and overflowed converting to a
    float; position_offset 2**63 was a RuntimeError in the torch reference and ran on the triton backend."""
    from seqpar.ops import add_rms_norm, rotary_embedding

    x, w, q = torch.randn(3, 8), torch.randn(8), torch.randn(2, 1, 1, 4)
    for call, match in ((lambda: bias_dropout_add_layer_norm(x, None, x, w, w, eps=10**400), "eps must be"),
                        (lambda: add_rms_norm(x, None, w, eps=10**400), "eps must be"),
                        (lambda: rotary_embedding(q, q, theta=10**400), "theta must be"),
                        (lambda: rotary_embedding(q, q, position_offset=2**62),
                         r"position_offset must be an int in \[0, 2\*\*62\), got 4611686018427387904")):
        with pytest.raises(ValueError, match=match):
            call()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_layer_norm_takes_one_column_of_any_stride(backend):
    """h = 1: x = randn(1, 4).t() is contiguous ([4, 1], strides (1, 4)) but was refused for its column
    stride, which the kernels never step along."""
    x, res = torch.randn(1, 4).t(), torch.randn(1, 4).t()
    w, b = torch.randn(1), torch.randn(1)
    got = bias_dropout_add_layer_norm(x, None, res, w, b, backend=backend)
    want = bias_dropout_add_layer_norm(x.contiguous(), None, res.contiguous(), w, b, backend="torch")
    assert all(torch.equal(g, e) for g, e in zip(got, want))


def test_nested_selection_records_leave_by_identity():
    """The inner block's exit removed the first recorder equal to it (list.remove compares by ==): the
    outer one, when both held the same backends, so the outer missed later selections and its own exit
    raised, hiding the exception under way."""
    x = torch.randn(1, 2, 4, 16)
    with registry.record_selections() as outer:
        attention_core(x, x, x, backend="torch")
        with registry.record_selections() as inner:
            attention_core(x, x, x, backend="torch")
        assert inner == outer
        bias_dropout_add_layer_norm(torch.randn(3, 16), None, torch.randn(3, 16), torch.ones(16), torch.zeros(16),
                                    backend="torch")
    assert set(outer) == {"attention_core", "bias_dropout_add_layer_norm"} and set(inner) == {"attention_core"}
    assert registry._RECORDERS == []
    with pytest.raises(KeyError):
        with registry.record_selections():
            with registry.record_selections():
                raise KeyError("the user's")
    assert registry._RECORDERS == []


def test_a_cuda_runtime_error_that_is_not_about_the_arch_is_quoted_without_the_rebuild_advice(monkeypatch):
    """Every failure of the extension's probe read "no kernels for this GPU ... rebuild with
    SEQPAR_CUDA_ARCHS": an old driver on an H100 was told to rebuild for the sm_90 it had."""
    import contextlib

    import seqpar._ext as ext

    class OldDriverExtension:
        def kernel_image_error(self):
            return "CUDA driver version is insufficient for CUDA runtime version"

    monkeypatch.setattr(ext, "cuda_extension_error", lambda: None)
    monkeypatch.setattr(ext, "cuda_extension", lambda: OldDriverExtension())
    monkeypatch.setattr(torch.cuda, "device", lambda index: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (9, 0))
    ext._kernel_image_error.cache_clear()
    try:
        reason = ext.cuda_unavailable_reason(torch.device("cuda", 0))
        assert reason.startswith("seqpar._C's kernels can't run on this GPU (sm_90): CUDA driver version is "
                                 "insufficient") and "update the driver" in reason and "SEQPAR_CUDA_ARCHS" not in reason
        OldDriverExtension.kernel_image_error = lambda self: "the provided PTX was compiled with an unsupported toolchain."
        ext._kernel_image_error.cache_clear()   # newer PTX than the driver's JIT: native code for the GPU helps too
        assert ext.cuda_unavailable_reason(torch.device("cuda", 0)).endswith("build native code for the GPU with "
                                                                             "SEQPAR_CUDA_ARCHS=90)")
    finally:
        ext._kernel_image_error.cache_clear()


def test_the_triton_attention_kernel_is_not_offered_below_sm_80(monkeypatch):
    """On a T4 (sm_75, 64 KiB of shared memory a block) every attention tile needs more: auto picked triton
    and its launch failed with OutOfResources. Now auto passes it over; the row kernels still run there."""
    import seqpar._ext as ext
    from seqpar.ops.attention_core import OP

    monkeypatch.setattr(ext, "cuda_capability", lambda device: (7, 5))
    q = torch.randn(1, 2, 4, 16)
    monkeypatch.setattr(type(q), "is_cuda", property(lambda self: True))
    reason = registry.get(OP, "triton").check(q=q, k=q, v=q, causal=True, dropout=False)
    assert reason == ("the triton attention kernel needs sm_80 or newer (its tiles need more shared memory than "
                      "older GPUs have a block), got sm_75")


def test_a_registered_backend_whose_check_needs_its_inputs(monkeypatch):
    """A backend registered in torch's place with a check that takes its inputs (the documented
    ``check(**inputs)``): the device-level reports (``python -m seqpar info``) called it with none
    (TypeError), and auto, finding no backend, said only "no backend can run" without the reasons."""
    import dataclasses

    def check(q, k, v, **_):
        """head dim d <= 32"""
        return None if q.shape[-1] <= 32 else f"head dim {q.shape[-1]} > 32"

    monkeypatch.delenv("SEQPAR_BACKEND", raising=False)
    original = registry.get("attention_core", "torch")
    monkeypatch.setitem(registry._REGISTRY["attention_core"], "torch", dataclasses.replace(original, check=check))
    cpu = torch.device("cpu")
    assert registry.backend_report(cpu)["attention_core"]["torch"] is None
    assert registry.auto_report(cpu)["attention_core"].limits["torch"] == "head dim d <= 32"
    q = torch.randn(1, 2, 4, 64)
    with pytest.raises(ValueError, match=r"no backend can run attention_core on cpu with these inputs \(.*"
                                         r"torch: head dim 64 > 32\)"):
        attention_core(q, q, q, is_causal=True, backend="auto")
    q = torch.randn(1, 2, 4, 32)
    torch.testing.assert_close(attention_core(q, q, q, is_causal=True, backend="auto"),
                               torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True))


def test_the_interpreter_asked_for_after_triton_was_imported_is_refused_with_the_reason():
    """TRITON_INTERPRET=1 set after ``import seqpar`` (which imports triton) left triton.language's
    helpers compiled for the GPU: the registry offered the interpreter, and the triton attention kernel
    died with "Cannot call @triton.jit'd outside of the scope of a kernel". Now a ValueError says why."""
    pytest.importorskip("triton")
    code = ("import os, torch, seqpar; os.environ['TRITON_INTERPRET'] = '1'\n"
            "cfg = seqpar.TransformerConfig(hidden_size=32, num_attention_heads=4, backend='triton')\n"
            "try:\n    seqpar.TransformerLayer(cfg)(torch.randn(8, 2, 32))\n"
            "except ValueError as e:\n    print('ValueError:', e)\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=240)
    assert "ValueError:" in proc.stdout and "set after triton was imported" in proc.stdout, \
        (proc.stdout + proc.stderr)[-2000:]


def test_the_row_kernels_refuse_2_30_rows_by_name_and_auto_passes_them_over():
    """The Triton row kernels index rows in int32: a row block or a backward's row range past 2**31
    wrapped negative and passed the row mask (memory before the tensor read and written, or gradient
    rows never written), and the CUDA launchers threw past 2**31 rows. Both kernel backends now refuse
    2**30 rows or more before running anything (auto runs them on torch); 2**30 - 1 rows pass the check.
    The inputs are expanded views: no memory behind their rows."""
    from seqpar.ops import add_rms_norm, swiglu

    def rows_of(n, h=4):
        return torch.zeros(1, h).expand(n, h)

    def calls(n):
        w = torch.ones(4)
        yield "bias_dropout_add_layer_norm", lambda b: bias_dropout_add_layer_norm(
            rows_of(n), None, rows_of(n), w, w, p=0.0, training=False, backend=b)
        yield "add_rms_norm", lambda b: add_rms_norm(rows_of(n), rows_of(n), w, backend=b)
        yield "swiglu", lambda b: swiglu(rows_of(n), backend=b)

    if registry.environment_reason("triton", torch.device("cpu")) is None:   # the interpreter
        for op, call in calls(2**30):
            with pytest.raises(ValueError, match=rf"backend 'triton' can't run {op}: 1073741824 rows: "):
                call("triton")
    for op in ("bias_dropout_add_layer_norm", "add_rms_norm", "swiglu"):
        for name in ("triton", "cuda"):
            impl = registry.get(op, name)
            assert "1073741824 rows: the row kernels take fewer than 2**30" in impl.check(dtype=torch.bfloat16,
                                                                                          rows=2**30)
            assert impl.check(dtype=torch.bfloat16, rows=2**30 - 1) is None
            assert "rows < 2**30" in registry.describe_limits(impl)


def test_the_row_limit_puts_no_bound_on_an_exported_dynamic_size():
    """Under torch.export with a dynamic row count the row limit was a guard (rows < 2**30), which capped
    the program's sizes: a Dim without a max was a constraint violation, Dim.AUTO silently bounded. The
    check refuses symbolic rows only where they are certainly too many; the program runs every size."""
    from torch.export import Dim, export
    from seqpar.ops import add_rms_norm, swiglu

    if registry.environment_reason("triton", torch.device("cpu")) is not None:
        pytest.skip("the triton interpreter is not enabled")

    class RowOps(torch.nn.Module):
        def forward(self, x, w):
            return swiglu(add_rms_norm(x, None, w, backend="triton")[0], backend="triton")

    rows = Dim("rows")
    w = torch.rand(8) + 0.5
    program = export(RowOps(), (torch.randn(6, 8), w), dynamic_shapes=({0: rows}, None), strict=False)
    for n in (6, 11):
        x = torch.randn(n, 8)
        torch.testing.assert_close(program.module()(x, w), RowOps()(x, w), rtol=0, atol=0)


def _float64_calls():
    """(op, its public call on fp64 tensors given a backend, the tensors) per fused op, with dropout."""
    from seqpar.ops import DropoutSpec, add_rms_norm, dropout, rotary_embedding, swiglu

    def t(*shape, seed):
        return torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed)).requires_grad_()

    h = 8
    spec = DropoutSpec(0.25, 5, 3)
    yield ("bias_dropout_add_layer_norm", lambda b, *a: bias_dropout_add_layer_norm(*a, p=0.25, seed=7, backend=b),
           (t(2, 3, h, seed=0), t(h, seed=1), t(2, 3, h, seed=2), t(h, seed=3), t(h, seed=4)))
    yield ("attention_core", lambda b, *a: attention_core(*a, is_causal=True, dropout_p=0.25, seed=3, enable_gqa=True,
                                                          backend=b),
           (t(1, 4, 5, 16, seed=0), t(1, 2, 5, 16, seed=1), t(1, 2, 5, 16, seed=2)))
    yield "dropout", lambda b, x: dropout(x, spec, backend=b), (t(3, h, seed=0),)
    yield "add_rms_norm", lambda b, *a: add_rms_norm(*a, eps=1e-3, backend=b), (t(3, h, seed=0), t(3, h, seed=1),
                                                                                 t(h, seed=2))
    yield "swiglu", lambda b, x: swiglu(x, backend=b), (t(3, 2 * h, seed=0),)
    yield ("rotary_embedding", lambda b, *a: rotary_embedding(*a, position_offset=2, backend=b),
           (t(4, 1, 2, h, seed=0), t(4, 1, 1, h, seed=1)))


@pytest.mark.parametrize("op, call, inputs", list(_float64_calls()), ids=lambda v: v if isinstance(v, str) else "")
def test_every_fused_op_takes_float64_on_torch_and_its_kernels_turn_it_away(op, call, inputs):
    """One dtype table for every op (registry.DTYPES): float64 (gradcheck's dtype) ran on the torch backend
    of the RMSNorm, SwiGLU, RoPE and dropout ops, but the LayerNorm and the attention core refused it
    (ValueError), so neither could be gradchecked or checked against an fp64 torch computation. Auto runs
    fp64 on torch; an explicit kernel backend names the dtype."""
    with registry.record_selections() as ran:
        assert torch.autograd.gradcheck(lambda *a: call("auto", *a), inputs)
    assert ran[op] == {"torch"}
    for name in ("triton", "cuda"):
        assert "float64" in registry.get(op, name).check(
            **({"q": inputs[0], "k": inputs[1], "v": inputs[2]} if op == "attention_core" else {"dtype": torch.float64}))
    if registry.environment_reason("triton", torch.device("cpu")) is None:   # the interpreter
        with pytest.raises(ValueError, match=f"backend 'triton' can't run {op}: .*float64"):
            call("triton", *inputs)
