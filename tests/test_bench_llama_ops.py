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
    for op in ("op=rmsnorm", "op=swiglu", "op=rope", "op=dropout", "op=bda"):
        for provider in ("seqpar-triton", "seqpar-torch", "torch-eager"):
            for metric in ("fwd_ms", "bwd_gbps", "fwdbwd_frac_copy", "fwd_gpu_ms", "bwd_gpu_frac_copy",
                           "fwdbwd_host_ms"):
                assert (op, provider, metric) in got, (op, provider, metric)
    assert all(float(r["value"]) > 0 for r in rows)


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
