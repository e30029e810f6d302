"""The backend registry's visibility of auto fallbacks: what "auto" picks and why it skips the others
(auto_report, shown by ``python -m seqpar info``), and the backends that actually ran
(record_selections, recorded in the bench rows)."""
import torch

from seqpar.ops import attention_core, bias_dropout_add_layer_norm, registry


def test_auto_report_names_the_pick_the_skipped_and_the_limits(monkeypatch):
    import seqpar._ext as ext

    cpu = registry.auto_report(torch.device("cpu"))
    att = cpu["attention_core"]
    assert att.picked == "torch" and set(att.skipped) == {"triton", "cuda"}
    assert "CUDA tensors" in att.skipped["cuda"]
    assert "head dim" in att.limits["triton"]
    assert cpu["bias_dropout_add_layer_norm"].limits == {}        # any h: nothing turned away
    # the Llama ops' kernels say in words what they turn away (their checks' docstrings)
    assert cpu["swiglu"].limits["cuda"].startswith("fp32 / fp16 / bf16")
    assert cpu["rotary_embedding"].limits["triton"].startswith("head dim d <= 8192")
    # A machine where every backend is usable (simulated): auto picks the op's first choice.
    monkeypatch.setattr(ext, "triton_unavailable_reason", lambda device, auto=False: None)
    monkeypatch.setattr(ext, "cuda_unavailable_reason", lambda device: None)
    gpu = registry.auto_report(torch.device("cuda"))
    assert gpu["attention_core"].picked == "triton" and gpu["attention_core"].skipped == {}
    assert gpu["bias_dropout_add_layer_norm"].picked == "cuda"


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
        assert row["backends"] == {"attention_core": "torch", "bias_dropout_add_layer_norm": "torch"}, row
    out = capsys.readouterr().out
    assert "attention_core ran on: torch" in out and "bias_dropout_add_layer_norm ran on: torch" in out
