"""bench/bench_llama_ops.py: --help, and a --quick CPU smoke run (Triton interpreter) writing its rows."""
import csv
import os

import pytest

from bench import bench_llama_ops


def test_help_exits_cleanly(capsys):
    with pytest.raises(SystemExit) as exc:
        bench_llama_ops.main(["--help"])
    assert exc.value.code == 0
    assert "copy bandwidth" in capsys.readouterr().out


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="--quick runs Triton in its CPU interpreter")
def test_quick_run_writes_rows(tmp_path):
    assert bench_llama_ops.main(["--quick", "--out", str(tmp_path)]) == 0
    with open(tmp_path / "bench_llama_ops.csv") as f:
        rows = list(csv.DictReader(f))
    got = {(r["config"].split(",")[0], r["provider"], r["metric"]) for r in rows}
    for op in ("op=rmsnorm", "op=swiglu", "op=rope", "op=dropout"):
        for provider in ("seqpar-triton", "seqpar-torch", "torch-eager"):
            for metric in ("fwd_ms", "bwd_gbps", "fwdbwd_frac_copy", "fwd_gpu_ms", "bwd_gpu_frac_copy",
                           "fwdbwd_host_ms"):
                assert (op, provider, metric) in got, (op, provider, metric)
    assert all(float(r["value"]) > 0 for r in rows)


def test_the_rmsnorm_backward_variants_change_their_setting_only_inside_their_context(monkeypatch):
    """variant-triton-bwd-w16 is seqpar-triton with the RMSNorm backward's tiles at 8 elements per thread
    while its calls run: 16 warps for the 4096-column tiles (h = 4096 whole rows, h = 8192 two chunks)
    instead of the shipped 32; variant-triton-bwd-pipelined its row loop at 2 stages (shipped 1); the
    settings restored after; both refused on the other ops."""
    import torch

    from seqpar.triton_kernels import rms_norm, rows

    monkeypatch.setattr(rows, "interpreting", lambda: False)     # the GPU launch policy
    variant = bench_llama_ops.VARIANTS["variant-triton-bwd-w16"]

    def warps(h):
        return rms_norm._bwd_config(16384, h)[3]["num_warps"]

    assert (warps(4096), warps(8192)) == (32, 32)
    with variant.applied():
        assert (warps(4096), warps(8192)) == (16, 16)
    assert rms_norm.BWD_ELEMENTS_PER_THREAD == 4 and (warps(4096), warps(8192)) == (32, 32)
    with bench_llama_ops.VARIANTS["variant-triton-bwd-pipelined"].applied():
        assert rms_norm.BWD_ROW_STAGES == 2 and warps(4096) == 32
    assert rms_norm.BWD_ROW_STAGES == 1
    for name in ("variant-triton-bwd-w16", "variant-triton-bwd-pipelined"):
        for op, size in (("swiglu", dict(tokens=4, ffn=8)), ("rope", dict(seq=2, batch=1, heads=2, kv_heads=1,
                                                                           head_dim=8))):
            with pytest.raises(RuntimeError, match="only for rmsnorm"):
                bench_llama_ops.make_problem(op, name, size, torch.float32, torch.device("cpu"))


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the Triton kernel runs in its CPU interpreter")
def test_the_pinned_dropout_providers_compute_seqpar_dropout():
    """The dropout providers call one kernel each (seqpar.ops.dropout picks its own): seqpar-triton and
    seqpar-torch give seqpar.ops.dropout's values and input gradient for the same spec, bit for bit."""
    import importlib

    import torch

    from seqpar import ops

    D = importlib.import_module("seqpar.ops.dropout")
    size, cpu = dict(tokens=6, hidden=40), torch.device("cpu")
    spec = D.make_dropout_spec(bench_llama_ops.DROPOUT_P, True, 1234)
    for provider in ("seqpar-triton", "seqpar-torch"):
        problem = bench_llama_ops.make_problem("dropout", provider, size, torch.float32, cpu)
        (x,), (grad,) = problem.leaves, problem.grads
        (y,) = problem.fns[provider]()
        (gx,) = torch.autograd.grad(y, x, grad)
        want = ops.dropout(x.detach(), spec)
        assert torch.equal(y, want) and (want == 0).any() and (want != 0).any(), provider
        assert torch.equal(gx, ops.dropout(grad, spec)), provider
