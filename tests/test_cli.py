"""python -m seqpar info / bench / plan run and print what they promise; usage errors are one line."""
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from seqpar import cli
from seqpar.memory import evaluate_recompute, first_stage_parameters

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _assert_png(path):
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 20_000, (path, len(data))


def test_info_lists_backends():
    out = subprocess.run([sys.executable, "-m", "seqpar", "info"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "torch" in out.stdout and "CUDA extension seqpar._C" in out.stdout
    assert "attention_core" in out.stdout and "bias_dropout_add_layer_norm" in out.stdout


def test_info_shows_every_auto_fallback(capsys, monkeypatch):
    """Per op and device: the backend "auto" picks, why it skips each one before it, and the inputs a
    backend turns away (where auto falls back further); with every backend usable (simulated GPU), auto
    picks the op's first choice and the LayerNorm kernels list their row limit only (no hidden-size one)."""
    import seqpar._ext as ext

    cli.info()
    out = capsys.readouterr().out
    lines = out.splitlines()
    att = lines.index(next(l for l in lines if l.strip().startswith("attention_core")))
    assert "auto -> torch" in lines[att] and "tries triton, cuda, torch" in lines[att]
    block = "\n".join(lines[att + 1:att + 5])
    assert "triton skipped by auto:" in block and "cuda   skipped by auto:" in block
    assert "triton limits: sm_80 or newer; head dim d a multiple of 8 in [16, 128]" in block
    monkeypatch.setattr(ext, "triton_unavailable_reason", lambda device, auto=False: None)
    monkeypatch.setattr(ext, "cuda_unavailable_reason", lambda device: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "simulated")
    cli.info()
    out = capsys.readouterr().out
    gpu = out[out.index("backends on cuda"):]
    assert "attention_core                 auto -> triton" in gpu
    ln = gpu[gpu.index("bias_dropout_add_layer_norm"):].splitlines()
    assert "auto -> cuda" in ln[0], ln[:3]
    limits = "fp32 / fp16 / bf16 (float64 runs on the torch backend only); rows < 2**30."
    assert [line.split() for line in ln[1:3]] == [[name, "limits:", *limits.split()] for name in ("triton", "cuda")]


@pytest.mark.timeout(180)
def test_bench_prints_five_experiments(tmp_path):
    path = tmp_path / "rows.json"
    cmd = [sys.executable, "-m", "seqpar", "bench", "--tp", "2", "--seq-len", "32", "--hidden", "32", "--heads", "4",
           "--batch", "2", "--iters", "1", "--warmup", "0", "--json", str(path), "--plot", str(tmp_path / "fig8.png")]
    scratch = tmp_path / "tmp"      # where the spawned ranks' file store goes (removed after the run)
    scratch.mkdir()
    # torch's own cache elsewhere: torch.utils.checkpoint imports torch._dynamo, which makes its directory in
    # TMPDIR unless the variable names one (torch sets it in os.environ when it first makes it: the test passed
    # where an earlier test in the same process had imported torch._dynamo, and failed alone)
    env = dict(os.environ, TMPDIR=str(scratch), TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=170, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert not list(scratch.iterdir())
    for name in ("no recompute", "sequence parallel", "full recompute", "selective recompute",
                 "selective + sequence parallel"):
        assert name in out.stdout
    written = json.loads(path.read_text())
    rows = written["rows"]
    assert written["complete"] is True
    assert [r["recompute"] for r in rows] == ["none", "none", "full", "selective", "selective"]
    by_name = {r["experiment"]: r for r in rows}
    # selective keeps less than none, full keeps least, SP keeps less than plain TP
    assert by_name["full recompute"]["activation_bytes"] < by_name["selective recompute"]["activation_bytes"] \
        < by_name["no recompute"]["activation_bytes"]
    assert by_name["sequence parallel"]["activation_bytes"] < by_name["no recompute"]["activation_bytes"]
    for r in rows:  # seqpar regenerates masks: between Table 2 without and with them
        assert 0.95 * r["table2_bytes_no_masks"] <= r["activation_bytes"] <= 1.05 * r["table2_bytes"], r
    _assert_png(tmp_path / "fig8.png")


@pytest.mark.timeout(120)
def test_bench_json_keeps_the_rows_of_a_run_stopped_part_way(tmp_path, monkeypatch):
    """A run killed part way (a device call's time limit) keeps the experiments it measured."""
    from seqpar.bench import layer_bench

    real = layer_bench.layer_config

    def config_failing_at_full_recompute(args, sequence_parallel, recompute, dtype):
        if recompute == "full":
            raise RuntimeError("stopped here")
        return real(args, sequence_parallel, recompute, dtype)

    monkeypatch.setattr(layer_bench, "layer_config", config_failing_at_full_recompute)
    path = tmp_path / "rows.json"
    with pytest.raises(RuntimeError, match="stopped here"):
        layer_bench.main(["--tp", "1", "--seq-len", "16", "--hidden", "32", "--heads", "4", "--batch", "1",
                          "--iters", "1", "--warmup", "0", "--dtype", "fp32", "--json", str(path)])
    written = json.loads(path.read_text())
    assert written["complete"] is False and written["config"]["seq_len"] == 16
    assert [r["experiment"] for r in written["rows"]] == ["no recompute", "sequence parallel"]
    base, sp = written["rows"]
    assert base["overhead"] == 0.0 and sp["overhead"] == pytest.approx(sp["combined_ms"] / base["combined_ms"] - 1)


# ------------------------------------------------------------------------------- plan
def test_plan_prints_uniform_policies_and_a_plan_that_fits(tmp_path, capsys):
    png = tmp_path / "plan.png"
    result = cli.plan(["--model", "530B", "--sp", "--other-gib", "2", "--plot", str(png)])
    out = capsys.readouterr().out
    sizes = dict(seq_len=2048, micro_batch=1, hidden=20480, heads=128, num_layers=105, vocab=51200)
    baseline = evaluate_recompute("none", **sizes, tp=8, pp=35, sequence_parallel=False).activation_bytes
    both = evaluate_recompute("selective", **sizes, tp=8, pp=35, sequence_parallel=True).activation_bytes
    line = next(l for l in out.splitlines() if l.strip().startswith("tensor + sequence parallel + selective"))
    assert f"{100 * both / baseline:.0f}%" in line and "yes" in line, out   # the paper's ~5x: 20%
    plan = result["plan"]
    params = first_stage_parameters(20480, 105, 51200, 2048, tp=8, pp=35)
    assert plan.activation_bytes <= result["budget"] == 78 * 2**30 - 18 * params
    assert f"{plan.counts['none']} x none, {plan.counts['selective']} x selective" in out
    _assert_png(png)


@pytest.mark.parametrize("argv", [["--model", "llama3-8B"], ["--model", "llama3-70B", "--flash-attention"],
                                  ["--arch", "llama", "--hidden", "1024", "--heads", "16", "--kv-heads", "4",
                                   "--ffn-hidden", "2816", "--layers", "8", "--tp", "4", "--gpu-memory", "1.2"],
                                  ["--model", "qwen3-32B"],
                                  ["--arch", "llama", "--hidden", "1000", "--heads", "16", "--kv-heads", "4",
                                   "--kv-channels", "128", "--qk-norm", "--layers", "8", "--tp", "4"]],
                         ids=["llama3-8B", "llama3-70B-flash", "custom-llama", "qwen3-32B", "custom-qwen3"])
def test_plan_llama_block(argv, capsys):
    """The Llama block's activations (its terms, no dropout) and parameters (SwiGLU, GQA, no biases, no
    position table, untied head) are what seqpar.memory says for it."""
    result = cli.plan(argv + ["--sp"])
    out = capsys.readouterr().out
    args = result["args"]
    assert args.arch == "llama" and "llama block" in out
    block = dict(normalization="rmsnorm", activation="swiglu", hidden_dropout=False, attention_dropout=False,
                 num_query_groups=args.kv_heads, ffn_hidden=args.ffn_hidden, flash_attention=args.flash_attention,
                 kv_channels=args.kv_channels, qk_layernorm=args.qk_norm)
    sizes = dict(seq_len=args.seq_len, micro_batch=args.micro_batch, hidden=args.hidden, heads=args.heads,
                 num_layers=args.layers, vocab=args.vocab)
    for label, sp, policy, cost in result["uniform"]:
        assert cost == evaluate_recompute(policy, **sizes, tp=args.tp, pp=args.pp, sequence_parallel=sp, **block), label
    params = first_stage_parameters(args.hidden, args.layers, args.vocab, args.seq_len, tp=args.tp, pp=args.pp,
                                    ffn_hidden=args.ffn_hidden, heads=args.heads, num_query_groups=args.kv_heads,
                                    kv_channels=args.kv_channels, qk_layernorm=args.qk_norm,
                                    normalization="rmsnorm", activation="swiglu", add_bias_linear=False,
                                    position_embedding="rope", share_embeddings_and_output_weights=False)
    assert f"{params:,} parameters" in out
    if args.flash_attention:   # selective recompute saves nothing under a flash-style core
        by_label = {label: cost.activation_bytes for label, _, _, cost in result["uniform"]}
        assert by_label["tensor + sequence parallel + selective"] == by_label["tensor + sequence parallel"]
    if args.model == "llama3-8B":   # 8.03B parameters over t = 8 ranks (the untied head included)
        assert 0.99e9 < params < 1.01e9
    if args.model == "qwen3-32B":   # 32.8B parameters over t = 8, p = 2 (the last stage's head ~ the embedding)
        assert (args.kv_channels, args.qk_norm) == (128, True) and "d=128" in out and "q/k norms" in out
        assert 32.5e9 < params * 16 < 33.0e9


def test_plan_without_sp_takes_a_sequence_length_t_does_not_divide(capsys):
    """Only sequence parallelism needs t | s: without --sp the command planned nothing and failed on the
    table's sequence-parallel rows. Now it leaves those rows out and plans as the API does (fitting the
    peak: include_working_set=True)."""
    from seqpar.memory import plan_recompute

    result = cli.plan(["--model", "22B", "--seq-len", "2047"])
    out = capsys.readouterr().out
    assert "(no sequence-parallel rows: t=8 does not divide s=2047)" in out and "tensor + sequence" not in out
    assert [label for label, sp, _, _ in result["uniform"]] == [
        "tensor parallel (baseline)", "tensor parallel + selective", "full recompute"]
    expected = plan_recompute(**result["sizes"], budget_bytes=result["budget"], sequence_parallel=False,
                              include_working_set=True, **result["options"])
    assert result["sizes"]["seq_len"] == 2047 and result["plan"] == expected and expected.counts["selective"] > 0


def test_plan_reports_when_nothing_fits(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.plan(["--model", "1T", "--gpu-memory", "38"])      # the model state alone needs 36.6 GiB
    assert exit_info.value.code == 1
    assert "no plan without sequence parallelism" in capsys.readouterr().out
    # the full-recompute floor over the budget: it said "budget_bytes 1.64625e+09 is below 5.29321e+09 ...",
    # raw bytes and an API argument, where sequence parallelism would have fitted
    with pytest.raises(SystemExit):
        cli.plan(["--model", "22B", "--gpu-memory", "50"])
    out = capsys.readouterr().out
    assert re.search(r"no plan without sequence parallelism: even full recompute of every layer needs 6\.\d GiB of "
                     r"activations at its peak, over the 3\.5 GiB budget; with --sp it needs 1\.6 GiB, which fits", out), out


@pytest.mark.parametrize("argv, match", [
    (["--gpu-memory", "0.01"], "the model state alone (60.2 MiB) leaves no room for activations in 0.01 GiB"),
    (["--other-gib", "100"], "--other-gib 100 GiB leaves no room for activations in 80 GiB beside the model state "
                             "(60.2 MiB)"),
], ids=["model state", "other"])
def test_plan_blames_what_exhausted_the_budget(argv, match, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.plan(["--hidden", "64", "--heads", "4", "--layers", "2"] + argv)
    assert exit_info.value.code == 1 and match in capsys.readouterr().out


# ------------------------------------------------------------------------------- usage errors
def _usage_error(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and len(err.strip().splitlines()) == 1, err
    return err


@pytest.mark.parametrize("argv, match", [
    (["bench", "--backend", "foo"], "invalid choice: 'foo'"),
    (["bench", "--tp", "0"], "--tp must be positive, got 0"),
    (["bench", "--heads", "3"], "heads=3"),
    (["bench", "--dropout", "1.5"], "--dropout must be in"),
    # in [0, 1) but not a probability seqpar takes: the ranks were spawned and failed there, exit 1
    (["bench", "--dropout", "0.999"], "--dropout must be in [0, 0.998046875), got 0.999"),
    (["plan"], "give --model or --hidden, --heads, --layers"),
    (["plan", "--model", "22B", "--tp", "5"], "--tp 5 does not divide --heads 64"),
    # the messages name the options, not seqpar.memory's arguments (num_layers, num_query_groups)
    (["plan", "--model", "22B", "--pp", "7"], "--pp 7 does not divide --layers 48"),
    (["plan", "--hidden", "64", "--heads", "4", "--layers", "-2"], "--layers must be positive, got -2"),
    (["plan", "--model", "42B"], "invalid choice: '42B'"),
    (["plan", "--model", "llama3-70B", "--arch", "gpt"], "--model llama3-70B is a llama model, not --arch gpt"),
    (["plan", "--model", "22B", "--kv-heads", "8"], "--kv-heads is for --arch llama"),
    (["plan", "--model", "22B", "--kv-channels", "128"], "--kv-channels is for --arch llama"),
    (["plan", "--model", "22B", "--qk-norm"], "--qk-norm is for --arch llama"),
    (["plan", "--model", "qwen3-32B", "--kv-channels", "0"], "--kv-channels must be positive, got 0"),
    # TransformerConfig refuses an odd head dim with RoPE: the plan of a layer that can't be built was printed
    (["plan", "--model", "qwen3-32B", "--kv-channels", "127"], "--kv-channels 127: the Llama block's RoPE needs an even"),
    (["plan", "--arch", "llama", "--hidden", "96", "--heads", "32", "--layers", "2"], "--hidden / --heads = 3: the"),
    (["plan", "--arch", "llama", "--hidden", "1024", "--heads", "16", "--layers", "8", "--kv-heads", "3"],
     "--kv-heads 3 does not divide --heads 16"),
    (["plan", "--model", "22B", "--gpu-memory", "inf"], "--gpu-memory must be finite and positive, got inf"),
    (["plan", "--model", "22B", "--gpu-memory", "nan"], "--gpu-memory must be finite and positive, got nan"),
    (["plan", "--model", "22B", "--other-gib", "inf"], "--other-gib must be finite and non-negative, got inf"),
    # finite GiB but not in bytes: the budget was inf and planning failed with exit 1
    (["plan", "--model", "22B", "--gpu-memory", "1e300"], "--gpu-memory must be finite and positive, got 1e+300"),
    # a byte count that overflows: a ZeroDivisionError traceback (the overflowed baseline was NaN, then 0)
    (["plan", "--model", "22B", "--bytes-per-mask", "1e308"], "one layer's activations overflows a float byte count"),
    (["plan", "--model", "22B", "--layers", "10000000000"], "--layers 10000000000 is more than 65536"),
    (["plan", "--model", "22B", "--plot", "/nonexistent/dir/x.png"],
     "--plot /nonexistent/dir/x.png: its folder /nonexistent/dir does not exist"),
    (["bench", "--json", "/nonexistent/dir/x.json"], "--json /nonexistent/dir/x.json: its folder /nonexistent/dir"),
    (["bench", "--json", "/"], "--json /: is a directory"),
    # found only after the run (a traceback): root passes os.access, /proc takes no new files
    (["bench", "--json", "/proc/x.json"], "--json /proc/x.json: can't be written (No such file or directory)"),
    (["bench", "--json", ""], "--json: an empty path"),   # was ignored: no file, no error
    (["info", "--verbose"], "unrecognized arguments: --verbose"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_usage_errors_are_one_line_exit_2(argv, match, capsys):
    assert match in _usage_error(argv, capsys)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only message")
def test_bench_cuda_backend_on_cpu_is_a_usage_error(capsys, monkeypatch):
    err = _usage_error(["bench", "--backend", "cuda"], capsys)
    assert "--backend cuda can't run on cpu" in err and "CUDA tensors" in err
    # from the environment: named as such, not as "--backend triton can't run add_rms_norm" (an op the gpt
    # layer never calls, the first in the registry's order)
    monkeypatch.setenv("SEQPAR_BACKEND", "triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    err = _usage_error(["bench"], capsys)
    assert "SEQPAR_BACKEND=triton can't run on cpu" in err
    err = _usage_error(["bench", "--device", "cuda"], capsys)
    assert "no CUDA device" in err


def test_bench_under_torchrun_checks_the_backend_on_its_local_rank_s_gpu(monkeypatch):
    """Every rank probed the kernels on the current device, cuda:0, before main() made its LOCAL_RANK's GPU
    current: a context on GPU 0 from every rank (about 500 MB each)."""
    from seqpar.bench import layer_bench

    checked = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(layer_bench, "_backend_unusable", lambda backend, device: checked.append(device))
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "3")
    layer_bench.parse_args(["--device", "cuda", "--tp", "4", "--backend", "cuda"])
    assert checked == [torch.device("cuda", 3)]


@pytest.mark.parametrize("command", [["plan", "--model", "22B"], ["bench"]], ids=["plan", "bench"])
def test_plot_without_matplotlib_says_how_to_get_it(command, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)   # import matplotlib now raises ImportError
    err = _usage_error(command + ["--plot", str(tmp_path / "x.png")], capsys)
    assert "pip install 'seqpar[plot]'" in err
    assert not (tmp_path / "x.png").exists()


@pytest.mark.parametrize("command", [["plan", "--model", "22B"], ["bench"]], ids=["plan", "bench"])
@pytest.mark.parametrize("name,match", [("fig.txt", "extension .txt"), ("fig", "no extension")])
def test_plot_file_types_matplotlib_does_not_write_are_usage_errors(command, name, match, tmp_path, capsys):
    """fig.txt failed in matplotlib after the whole run; fig was written as fig.png while the command
    said 'wrote fig'."""
    pytest.importorskip("matplotlib")
    err = _usage_error(command + ["--plot", str(tmp_path / name)], capsys)
    assert match in err and ".png" in err
    assert not list(tmp_path.iterdir())


def test_bench_rank_failure_is_one_line_exit_1():
    """Spawned ranks that reject the layer while running (a head size the Triton kernel does not take)
    give one line naming the problem, not every rank's traceback."""
    out = subprocess.run([sys.executable, "-m", "seqpar", "bench", "--seq-len", "16", "--hidden", "6", "--heads", "2",
                          "--iters", "1", "--warmup", "0", "--dtype", "fp32", "--backend", "triton"],
                         capture_output=True, text=True, timeout=170)
    if "TRITON_INTERPRET" in out.stderr:
        pytest.skip("the triton backend needs TRITON_INTERPRET=1 on CPU")
    assert out.returncode == 1 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "rank" in out.stderr and "triton" in out.stderr and "Traceback" not in out.stderr + out.stdout


@pytest.mark.timeout(180)
@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (a device whose writes fail)")
def test_bench_json_that_fails_to_write_is_one_line_exit_1():
    """--json to a file whose writes fail after it opened (a full disk; /dev/full) dumped rank 0's
    traceback; the run reports it in one line naming the path."""
    out = subprocess.run([sys.executable, "-m", "seqpar", "bench", "--seq-len", "16", "--hidden", "16", "--heads", "2",
                          "--batch", "1", "--iters", "1", "--warmup", "0", "--json", "/dev/full"],
                         capture_output=True, text=True, timeout=170)
    assert out.returncode == 1 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "--json /dev/full: could not write it" in out.stderr and "Traceback" not in out.stderr + out.stdout


@pytest.mark.timeout(150)
@pytest.mark.parametrize("command,first", [
    (["plan", "--model", "22B"], "seqpar plan:"),
    # a spawned rank printed its progress line into the closed pipe: the parent reported its traceback
    (["bench", "--tp", "2", "--seq-len", "8", "--hidden", "16", "--heads", "2", "--batch", "1", "--iters", "1",
      "--warmup", "0"], "seqpar bench: spawning 2"),
], ids=["plan", "bench-tp2"])
def test_a_reader_that_closes_the_pipe_ends_the_command_quietly(command, first):
    """``python -m seqpar plan ... | head -1`` printed a BrokenPipeError traceback."""
    proc = subprocess.Popen([sys.executable, "-m", "seqpar", *command], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().startswith(first)
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=140) in (0, 1) and "Traceback" not in err and "Error" not in err, err


_KILLED_RANK_SCRIPT = """
import os, signal, sys
import seqpar.bench.layer_bench as layer_bench
real = layer_bench.run_experiments
def killed_on_rank_1(args, rank, *rest):              # at module level: the spawned ranks import it too
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)           # as the out-of-memory killer does: no report
    return real(args, rank, *rest)
layer_bench.run_experiments = killed_on_rank_1
if __name__ == "__main__":
    from seqpar.cli import main
    main(["bench"] + sys.argv[1:])
"""


@pytest.mark.timeout(150)
def test_bench_names_a_rank_killed_without_a_report(tmp_path):
    """A spawned rank killed by a signal posted nothing: the parent waited on its queue for ever (both
    ranks killed), or blamed rank 0 with its gloo 'Connection reset by peer' traceback."""
    script = tmp_path / "killed_rank.py"
    script.write_text(_KILLED_RANK_SCRIPT)
    out = subprocess.run([sys.executable, str(script), "--tp", "2", "--seq-len", "8", "--hidden", "16", "--heads", "2",
                          "--batch", "1", "--iters", "1", "--warmup", "0"], capture_output=True, text=True, timeout=140)
    assert out.returncode == 1 and "rank 1 died (signal 9) without a report" in out.stderr, out.stderr[-2000:]
    assert "Traceback" not in out.stderr, out.stderr[-2000:]


@pytest.mark.parametrize("argv, peak_part", [
    (["--model", "175B"], None),                                   # the first stage sets the peak, nothing on top
    (["--model", "22B"], "rebuilt in a recomputed backward"),
    (["--model", "llama3-8B", "--tp", "8", "--pp", "1", "--seq-len", "2048"], "in the loss's backward")])
def test_plan_names_what_sets_the_peak(argv, peak_part, capsys):
    """The planned-mix line named the loss backward's working set for a pipeline whose last stage stays
    below the peak (175B: "+ 75 MiB in the loss's backward on the last stage's 4.1 GiB" beside 32.1 GiB)."""
    result = cli.plan(argv + ["--sp"])
    line = next(l for l in capsys.readouterr().out.splitlines() if l.strip().startswith("per stage:"))
    plan = result["plan"]
    if peak_part is None:
        assert plan.peak_bytes == plan.activation_bytes and "at the peak" not in line, line
    else:
        assert "at the peak" in line and peak_part in line, line
