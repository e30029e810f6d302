"""bench/bench_layernorm_dropout.py and bench/bench_attention.py --quick, run as a user runs them (a script,
TRITON_INTERPRET unset): the seqpar-triton rows are measured (LayerNorm with dropout off and on, both
clocks: eager call time and GPU time, the latter's CPU fallback; attention with grouped-query k/v)."""
import collections
import csv
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch

from bench.gpu_summary import config_fields

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run_quick(script, tmp_path, *extra):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, os.path.join(ROOT, "bench", script), "--quick", "--out", str(tmp_path),
                          *extra], capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "failed" not in out.stdout, out.stdout
    with open(tmp_path / script.replace(".py", ".csv")) as f:
        return list(csv.DictReader(f)), out.stdout


def test_layernorm_dropout_quick_measures_triton_with_dropout_off_and_on(tmp_path):
    rows, stdout = _run_quick("bench_layernorm_dropout.py", tmp_path)
    got = {(r["provider"], r["config"].split(",")[2], r["metric"]) for r in rows if r["provider"] != "device-copy"}
    for p in ("p=0.0", "p=0.1"):
        for provider in ("seqpar-triton", "seqpar-torch", "torch-eager"):
            for metric in ("fwdbwd_ms", "fwd_frac_copy", "fwd_gpu_ms", "bwd_gpu_gbps", "fwdbwd_gpu_frac_copy",
                           "bwd_host_ms", "fwd_gpu_calls"):
                assert (provider, p, metric) in got, (provider, p, metric)
    # on CPU the GPU time is the wall-clock fallback: no queue to check, no L2 to rotate around
    assert not {m for _, _, m in got if m.endswith(("_gpu_queue_full", "_gpu_l2_reuse"))}
    assert "on CPU: wall time" in stdout
    assert all(float(r["value"]) > 0 for r in rows)
    # bench/gpu_summary.py reads the sweep coordinates back from the config strings
    assert all({"tokens", "h", "p"} <= set(config_fields(r["config"])) for r in rows if r["provider"] != "device-copy")
    # a copy of the same bytes per (tokens, h), under the config without p (gpu_summary's same-bytes entries)
    copies = {(r["config"], r["metric"]) for r in rows if r["provider"] == "device-copy"}
    for h in (64, 200):
        for metric in ("fwd_gpu_ms", "bwd_gpu_gbps", "fwdbwd_gpu_ms"):
            assert (f"tokens=48,h={h},dtype=bfloat16", metric) in copies, (h, metric)


def test_attention_quick_runs_triton_with_gqa(tmp_path):
    rows, _ = _run_quick("bench_attention.py", tmp_path, "--gqa-group", "2", "--dropouts", "0.1", "--providers",
                         "seqpar-triton,torch-eager")
    configs = {(r["provider"], r["config"]) for r in rows if r["metric"] == "fwdbwd_ms"}
    for provider in ("seqpar-triton", "torch-eager"):
        assert any(prov == provider and "H=4 Hkv=2" in c and "p=0.1" in c for prov, c in configs), configs
    assert all({"s", "d", "p", "causal"} <= set(config_fields(c)) for _, c in configs)


@pytest.mark.parametrize("stop, status", [(KeyboardInterrupt, 130), (RuntimeError, 1)], ids=["sigint", "error"])
def test_interrupted_sweep_keeps_the_rows_measured(tmp_path, monkeypatch, stop, status):
    """bench/gpu_suite.sh ends a step at its time limit with SIGINT: the rows measured before it are
    written (the interrupt lands in the second configuration here) and the exit status says 130. An
    error outside the providers' own handling (a CUDA error left behind) keeps them too, status 1."""
    from bench import bench_layernorm_dropout as bench

    calls = []

    def bench_config(provider, tokens, h, p, dtype, device, timer, copy_gbps, rows):
        calls.append((provider, tokens, h, p))
        if len(calls) == 2:
            raise stop("stopped in the second configuration")
        rows.add(f"tokens={tokens},h={h},p={p}", provider, "fwdbwd_ms", 1.5)

    monkeypatch.setattr(bench, "bench_config", bench_config)
    assert bench.main(["--quick", "--out", str(tmp_path)]) == status
    assert len(calls) == 2                                  # the sweep ended at the interrupt
    with open(tmp_path / "bench_layernorm_dropout.csv") as f:
        rows = list(csv.DictReader(f))
    measured = [r for r in rows if r["provider"] != "device-copy" or r["metric"] == "copy_gbps"]
    assert [(r["provider"], r["metric"]) for r in measured] == [("device-copy", "copy_gbps"),
                                                               (calls[0][0], "fwdbwd_ms")]
    assert measured[1]["config"] == f"tokens={calls[0][1]},h={calls[0][2]},p={calls[0][3]}"


_TWO_SIGINTS = """
import os, signal, sys, time
from seqpar.bench.results import ResultRows
rows = ResultRows("cpu", "two_sigints")
with rows.sweep():
    rows.add("c", "p", "m", 1.0)
    os.kill(os.getpid(), signal.SIGINT)     # timeout's SIGINT to the command ...
    time.sleep(30)
    rows.add("c", "p", "never", 2.0)
os.kill(os.getpid(), signal.SIGINT)         # ... and then to its process group
time.sleep(0.2)
sys.exit(rows.finish(sys.argv[1], quick=True))
"""


def test_a_second_sigint_does_not_lose_the_rows(tmp_path):
    """`timeout --signal=INT` (bench/gpu_suite.sh's step limit) signals the command and then its whole
    process group: on the GPU machine the second SIGINT landed while the sweep was handling the first,
    and the LayerNorm sweep's rows were lost. Only the first SIGINT may raise."""
    out = subprocess.run([sys.executable, "-c", _TWO_SIGINTS, str(tmp_path)], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert out.returncode == 130, out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr
    with open(tmp_path / "two_sigints.csv") as f:
        assert [r["metric"] for r in csv.DictReader(f)] == ["m"]


@pytest.mark.parametrize("stop", [None, RuntimeError], ids=["finished", "failed"])
def test_a_sweep_without_an_interrupt_gives_sigint_back(stop):
    import signal

    from seqpar.bench.results import ResultRows

    before = signal.getsignal(signal.SIGINT)
    with ResultRows("cpu", "t").sweep():
        if stop is not None:
            raise stop("a provider's error")
    assert signal.getsignal(signal.SIGINT) is before


class FakeTimer:
    """bench_layernorm_dropout.Timer's interface: runs each callable once, counting the provider's
    forward calls inside each timed region, and reports fixed times (call 2 ms, GPU 0.5 ms per call) as
    the CUDA method would; ``l2`` small enough that a tiny configuration needs several input sets."""

    def __init__(self, l2):
        from seqpar.bench.timing import input_sets

        self.device, self.l2, self._sets = torch.device("cpu"), l2, input_sets
        self.forwards, self.gpu_log = 0, []

    def __call__(self, fn):
        fn()
        return 2.0

    def gpu(self, fns):
        from seqpar.bench.timing import DeviceTime

        fns = list(fns) if isinstance(fns, (list, tuple)) else [fns]
        before = self.forwards
        for fn in fns:
            fn()
        self.gpu_log.append((len(fns), self.forwards - before))
        return DeviceTime(ms=0.5, host_ms=0.1, calls=4, batches=8, queue_full=0.75, method="cuda-back-to-back")

    def input_sets(self, nbytes):
        return self._sets(nbytes, self.l2)


def test_layernorm_gpu_time_rotates_input_sets_and_times_backward_alone(monkeypatch):
    """bench_config with a fake timer: the GPU-time calls take turns over copies of the inputs (distinct
    tensors, enough of them to keep 2 L2 sizes between uses of one), the backward callables run no
    forward, and both clocks' rows are written from their own times."""
    from bench import bench_layernorm_dropout as bench
    from seqpar.bench.results import ResultRows

    timer, seen = FakeTimer(l2=64 * 1024), []
    real = bench._torch_bda_ln

    def counting(x, *args):
        timer.forwards += 1
        seen.append(x.data_ptr())
        return real(x, *args)

    monkeypatch.setattr(bench, "_torch_bda_ln", counting)
    rows = ResultRows("NVIDIA H200", "bench_layernorm_dropout")
    ms = bench.bench_config("torch-eager", 8, 64, 0.1, torch.float32, torch.device("cpu"), timer, 100.0, rows)
    nbytes = bench.minimal_bytes(8, 64, 4)
    sets = timer.input_sets(nbytes["fwd"])
    assert sets > 1 and timer.gpu_log == [(sets, sets), (sets, 0), (sets, sets)]   # fwd, bwd alone, fwd+bwd
    assert len(set(seen[1:1 + sets])) == sets                 # one distinct x per input set
    table = {(r["metric"]): float(r["value"]) for r in rows.rows}
    for d in ("fwd", "bwd", "fwdbwd"):
        assert table[f"{d}_ms"] == 2.0 and table[f"{d}_gpu_ms"] == 0.5 and table[f"{d}_gpu_queue_full"] == 0.75
        assert table[f"{d}_gpu_frac_copy"] == pytest.approx(nbytes[d] / 0.5e-3 / 1e9 / 100.0, rel=1e-5)
        assert table[f"{d}_frac_copy"] == pytest.approx(nbytes[d] / 2e-3 / 1e9 / 100.0, rel=1e-5)
        assert table[f"{d}_gpu_l2_reuse"] >= 2.0
    assert ms["fwdbwd"] == 2.0 and ms["fwdbwd_gpu"] == 0.5


def test_overlap_parts_are_a_list():
    from bench.bench_overlap import parse_args

    assert parse_args(["--part", "gemm,project"]).part == ["gemm", "project"]
    assert parse_args([]).part == ["gemm", "gloo", "project"]
    with pytest.raises(SystemExit):
        parse_args(["--part", "gemm,nccl"])


def test_torch_compile_baseline_is_compiled_afresh_per_configuration(monkeypatch):
    """The torch-compile rows time a function compiled for the shape being timed: Dynamo's caches are
    reset first (no dynamic-shape graph or eager fallback left from the previous configuration) and
    shapes are static. Donated buffers are off: the backward is timed on retained graphs."""
    import torch._functorch.config as functorch_config

    from bench.bench_layernorm_dropout import compiled_for_one_shape

    monkeypatch.setattr(functorch_config, "donated_buffer", True)   # torch's default; restored after the test
    events = []
    monkeypatch.setattr(torch._dynamo, "reset", lambda: events.append("reset"))
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: events.append(("compile", fn, kw)) or fn)
    fn = compiled_for_one_shape(len, torch.device("cuda"))
    assert fn is len and events == ["reset", ("compile", len, {"dynamic": False})]
    assert functorch_config.donated_buffer is False
    with pytest.raises(RuntimeError, match="CUDA only"):
        compiled_for_one_shape(len, torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_torch_compile_baseline_backward_runs_twice_on_a_retained_graph(monkeypatch):
    """The benchmarks time the compiled backward on a retained graph, again and again: at 508368d (torch 2.11,
    H200) Inductor's donated buffers refused that in every LayerNorm, RMSNorm and dropout configuration. The
    gradients equal eager's."""
    import torch._functorch.config as functorch_config

    from bench.bench_layernorm_dropout import _torch_bda_ln, compiled_for_one_shape

    monkeypatch.setattr(functorch_config, "donated_buffer", True)
    g = torch.Generator().manual_seed(0)
    x, res = (torch.randn(64, 256, generator=g).cuda().requires_grad_() for _ in range(2))
    bias, w, b = (torch.randn(256, generator=g).cuda().requires_grad_() for _ in range(3))
    compiled = compiled_for_one_shape(lambda x, bias, res: _torch_bda_ln(x, bias, res, w, b, 0.0), x.device)
    outs = compiled(x, bias, res)
    grads_out = tuple(torch.randn_like(o) for o in outs)
    leaves = (x, bias, res, w, b)
    first = torch.autograd.grad(outs, leaves, grads_out, retain_graph=True)
    second = torch.autograd.grad(outs, leaves, grads_out, retain_graph=True)
    expected = torch.autograd.grad(_torch_bda_ln(x, bias, res, w, b, 0.0), leaves, grads_out)
    for got_1, got_2, want in zip(first, second, expected):
        torch.testing.assert_close(got_1, want, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got_2, got_1, rtol=0, atol=0)


def test_profile_kernels_quick_profiles_every_case(tmp_path):
    from bench.profile_kernels import cases

    rows, _ = _run_quick("profile_kernels.py", tmp_path)
    assert {r["case"] for r in rows} == set(cases(quick=True))
    by_case = {}
    for r in rows:
        if r["metric"] == "cpu_us":
            by_case.setdefault(r["case"], []).append((float(r["value"]), r["kernel"]))
    # the seqpar cases spend their step in the seqpar ops (the interpreter's kernels), slowest first
    for case, ops in by_case.items():
        if "seqpar-triton" in case:
            assert max(ops)[1].startswith("seqpar::"), (case, sorted(ops)[-3:])


def test_attention_compile_only_runs_each_configuration_and_writes_no_rows(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "bench_attention.py"), "--quick",
                          "--compile-only", "--providers", "seqpar-triton", "--dropouts", "0,0.1",
                          "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert [line.split()[0] for line in out.stdout.splitlines() if line.endswith("compiled")] == ["seqpar-triton"] * 2
    assert "p=0.1" in out.stdout and not list(tmp_path.iterdir())


STUB_PYTHON = """#!/usr/bin/env bash
# python3 as bench/gpu_suite.sh calls it, faked: records the call and creates the files a run would write
echo "$*" >> "$STUB_CALLS"
[[ -n "${STUB_FAIL:-}" && "$*" == *"$STUB_FAIL"* ]] && exit 1
[[ -n "${STUB_SLEEP:-}" && "$*" == *"$STUB_SLEEP"* ]] && sleep 60
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
  case "${args[$i]}" in
    --out) touch "${args[$((i + 1))]}/$(basename -- "${args[0]}" .py).csv" ;;
    --json) touch "${args[$((i + 1))]}" ;;
  esac
done
"""


def _fake_python3_env(tmp_path):
    """The environment that runs bench/gpu_suite.sh with STUB_PYTHON as python3, $OUT tmp_path/out."""
    stub = tmp_path / "bin" / "python3"
    stub.parent.mkdir()
    stub.write_text(STUB_PYTHON)
    stub.chmod(0o755)
    return dict(os.environ, PATH=f"{stub.parent}:{os.environ['PATH']}", OUT=str(tmp_path / "out"),
                STUB_CALLS=str(tmp_path / "calls.txt"))


def test_gpu_suite_parts_fit_what_the_device_tool_brings_back(tmp_path):
    """bench/gpu_suite.sh with every part in one call (python3 faked): every step runs, and $OUT holds at
    most 8 files, the most the device tool brings back; an unknown part is refused before anything runs."""
    env = _fake_python3_env(tmp_path)
    out, calls = tmp_path / "out", tmp_path / "calls.txt"
    script = os.path.join(ROOT, "bench", "gpu_suite.sh")
    parts = ["tests", "norms", "llama", "attention", "layer", "profile"]
    done = subprocess.run(["bash", script, *parts], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= 8 and "suite.log" in files, files
    log = (out / "suite.log").read_text()
    steps = 2 + 1 + 2 + 2 + 2 + 3 + 2   # set-up, then each part in the order of `parts`
    assert log.count("exit status 0") == log.count("s)\n") == steps, log   # "=== ... (limit Ns)" per step
    ran = calls.read_text()
    assert "-m pytest -q -m gpu -ra --durations=15 -n 12 --timeout 120 tests" in ran   # (the stub imports anything)
    assert ran.count("--compile-only") == 4 + 6 + 8
    assert "layer_bench_gpu.json" in ran and "torch-eager" not in ran       # the name gpu_summary reads first
    assert log.splitlines()[-1].endswith(f"summary: {steps} steps; failed: none; skipped: none"), log
    # the call's budget: with 5 s of SUITE_SECONDS the install is skipped, said so, and the call stops there
    starved = subprocess.run(["bash", script, "layer"], capture_output=True, text=True, timeout=60,
                             env=dict(env, OUT=str(tmp_path / "starved"), SUITE_SECONDS="5"))
    log = (tmp_path / "starved" / "suite.log").read_text()
    assert starved.returncode == 1 and "skipped (" in log and "seqpar is not installed" in log, log
    assert "-m seqpar bench" not in calls.read_text().split("layer_bench_gpu.json")[-1]
    # a failed install stops the call too (every step after it would measure nothing)
    failed = subprocess.run(["bash", script, "tests"], capture_output=True, text=True, timeout=60,
                            env=dict(env, OUT=str(tmp_path / "failed"), STUB_FAIL="--no-build-isolation"))
    assert failed.returncode == 1 and "pytest" not in calls.read_text().split("--no-build-isolation")[-1]
    # SUITE_SECONDS: a fraction is dropped (bash has integer arithmetic only); anything else is refused
    fraction = subprocess.run(["bash", script, "layer"], capture_output=True, text=True, timeout=60,
                              env=dict(env, OUT=str(tmp_path / "fraction"), SUITE_SECONDS="212.5"))
    assert fraction.returncode == 0 and "(limit 150s)" in (tmp_path / "fraction" / "suite.log").read_text()
    bad = subprocess.run(["bash", script, "layer"], capture_output=True, text=True, timeout=60,
                         env=dict(env, OUT=str(tmp_path / "bad"), SUITE_SECONDS="soon"))
    assert bad.returncode == 2 and "SUITE_SECONDS must be a number of seconds, got 'soon'" in bad.stderr
    # a fraction without whole seconds is refused, naming what was given
    bad = subprocess.run(["bash", script, "layer"], capture_output=True, text=True, timeout=60,
                         env=dict(env, OUT=str(tmp_path / "bad"), SUITE_SECONDS=".5"))
    assert bad.returncode == 2 and "got '.5'" in bad.stderr, bad.stderr
    refused = subprocess.run(["bash", script, "tests", "bogus"], capture_output=True, text=True, timeout=60,
                             env=dict(env, OUT=str(tmp_path / "refused")))
    assert refused.returncode == 2 and "unknown part 'bogus'" in refused.stderr
    assert not (tmp_path / "refused").exists()


def test_a_parallel_compile_step_ends_at_its_limit(tmp_path):
    """The compile steps' processes each ran under their own timeout, in its own process group: the step's
    SIGINT at its limit (cut by SUITE_SECONDS below theirs) never reached them, and the step waited for
    them (up to 110 s past its limit). Their timeouts now run in the step's group (--foreground)."""
    env = dict(_fake_python3_env(tmp_path), STUB_SLEEP="--compile-only", SUITE_SECONDS="12")
    started = time.monotonic()
    done = subprocess.run(["bash", os.path.join(ROOT, "bench", "gpu_suite.sh"), "norms"], capture_output=True,
                          text=True, timeout=120, env=env)
    took = time.monotonic() - started
    log = (tmp_path / "out" / "suite.log").read_text()
    assert "[norms-compile] exit status 124" in log and "[norms] skipped" in log, log
    assert took < 40, (took, log)       # the limit (12 s) and SIGINT's effect, not the processes' 60 s
    assert done.returncode == 1


def test_gpu_suite_runs_every_step_and_exits_1_when_one_failed(tmp_path):
    """gpu_suite.sh exited 0 (its last command, ls) with failed gpu tests or a crashed benchmark: it now
    runs every step still, ends with a summary line naming the failed ones, and exits 1."""
    env = dict(_fake_python3_env(tmp_path), STUB_FAIL="bench_llama_ops.py")
    done = subprocess.run(["bash", os.path.join(ROOT, "bench", "gpu_suite.sh"), "llama", "layer"],
                          capture_output=True, text=True, timeout=60, env=env)
    log = (tmp_path / "out" / "suite.log").read_text()
    assert done.returncode == 1, (done.stdout, log)
    assert "bench_overlap.py" in (tmp_path / "calls.txt").read_text()    # the steps after it ran
    assert log.splitlines()[-1].endswith("summary: 7 steps; failed: llama (exit 1); skipped: none"), log
    assert "layer_bench_gpu.json" in done.stdout                         # $OUT is still listed
    # out of budget: the install is skipped, the call stops there, and the summary says so
    starved = subprocess.run(["bash", os.path.join(ROOT, "bench", "gpu_suite.sh"), "tests"], capture_output=True,
                             text=True, timeout=60, env=dict(env, OUT=str(tmp_path / "starved"), SUITE_SECONDS="5"))
    assert starved.returncode == 1
    assert "summary: 1 steps; failed: none; skipped: install" in (tmp_path / "starved" / "suite.log").read_text()


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="--quick runs Triton in its CPU interpreter")
@pytest.mark.parametrize("script, argv, want", [
    ("bench_attention", ["--seqlens", "16", "--head-dims", "24", "--tokens", "16", "--hidden", "48", "--dropouts", "0",
                         "--providers", "seqpar-triton"], {"s": "16", "d": "24", "H": "2", "b": "1"}),
    ("bench_llama_ops", ["--ops", "rope", "--seq", "5", "--heads", "2", "--kv-heads", "1", "--head-dim", "8",
                         "--providers", "seqpar-torch"], {"s": "5", "hq": "2", "hk": "1", "d": "8"}),
    ("bench_layernorm_dropout", ["--hidden", "24", "--tokens", "6", "-p", "0", "--providers", "seqpar-torch"],
     {"tokens": "6", "h": "24", "p": "0.0"}),
], ids=["attention", "llama_ops", "layernorm"])
def test_quick_keeps_the_sweep_options_given(script, argv, want, tmp_path):
    """--quick replaced --seqlens, --heads, --hidden, ... by its tiny shapes without a word: it now fills in
    only the options not given."""
    import importlib

    module = importlib.import_module(f"bench.{script}")
    assert module.main(["--quick", "--out", str(tmp_path), *argv]) == 0
    with open(tmp_path / f"{script}.csv") as f:
        configs = {r["config"] for r in csv.DictReader(f) if r["provider"] != "device-copy"
                   and "vs_best" not in r["metric"]}
    assert configs and all(config_fields(c).items() >= want.items() for c in configs), configs


@pytest.mark.parametrize("script, argv, match", [
    ("bench_attention", ["--dropouts", "abc"], "--dropouts must be comma-separated probabilities in [0, 0.998046875), got 'abc'"),
    ("bench_attention", ["--dropouts", "1.5"], "got '1.5'"),     # skipped every provider, exit 0
    ("bench_attention", ["--dropouts", "nan"], "got 'nan'"),
    ("bench_attention", ["--seqlens", "0,64"], "--seqlens must be comma-separated positive integers, got '0,64'"),
    ("bench_llama_ops", ["--hidden", "4k"], "--hidden must be comma-separated positive integers, got '4k'"),
    ("bench_llama_ops", ["--heads", "0"], "--heads must be positive, got 0"),
    ("bench_layernorm_dropout", ["--tokens", ""], "--tokens must be comma-separated positive integers, got ''"),
    ("bench_layernorm_dropout", ["-p", "0.1,1"], "-p must be comma-separated probabilities in [0, 0.998046875), got '0.1,1'"),
])
def test_bad_sweep_values_are_usage_errors(script, argv, match, capsys):
    """A value the sweep can't use was a traceback mid-run (int('4k')), or a sweep that skipped every
    provider and exited 0 (p = 1.5)."""
    import importlib

    module = importlib.import_module(f"bench.{script}")
    with pytest.raises(SystemExit) as exit_info:
        module.main(["--quick", *argv])
    assert exit_info.value.code == 2 and match in capsys.readouterr().err


def _suite_commands(script):
    """The argv of every ``python3 bench/<script>.py ...`` command in bench/gpu_suite.sh (continuation
    lines joined; shell variables as the suite would expand them for one head dim, hidden size, dropout
    and op)."""
    import re
    import shlex

    with open(os.path.join(ROOT, "bench", "gpu_suite.sh")) as f:
        text = f.read().replace("\\\n", " ")
    found = re.findall(rf"python3 bench/{script}\.py ([^;&'\n]*)", text)
    return [shlex.split(args.replace('"$OUT"', "/tmp/out").replace("$d", "64").replace("$h", "4096")
                         .replace("$p", "0.1").replace("$op", "rmsnorm")) for args in found]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU answer after parsing")
@pytest.mark.parametrize("script", ["bench_layernorm_dropout", "bench_llama_ops", "bench_attention"])
def test_the_gpu_suites_command_lines_parse(script, capsys):
    """A suite step whose options no longer parse (a renamed option, a misspelled provider) would show
    only on the device, costing its time: each command parses here and stops at the device check."""
    import importlib

    module = importlib.import_module(f"bench.{script}")
    commands = _suite_commands(script)
    assert commands, script
    for argv in commands:
        assert module.main(argv) == 2, argv
        captured = capsys.readouterr()
        assert "needs a CUDA device" in captured.out + captured.err, (argv, captured)


def test_the_attention_log_names_the_tiles_the_autotuner_picked(monkeypatch):
    import triton

    from bench.bench_attention import tuned_configs
    from seqpar.triton_kernels import attention as A

    for kernel in (A._fwd_tuned, A._dq_tuned, A._dkdv_tuned):
        monkeypatch.delattr(kernel, "best_config", raising=False)
    assert tuned_configs() == "fwd -, dq -, dkdv -"            # nothing tuned yet (CPU: never)
    monkeypatch.setattr(A._fwd_tuned, "best_config", triton.Config({"BLOCK_M": 128, "BLOCK_N": 32}, num_warps=8,
                                                                   num_stages=3), raising=False)
    monkeypatch.setattr(A._dkdv_tuned, "best_config", triton.Config({"BLOCK_M": 32, "BLOCK_N": 128}, num_warps=8,
                                                                    num_stages=2), raising=False)
    assert tuned_configs() == "fwd 128x32 w8 s3, dq -, dkdv 32x128 w8 s2"


def test_layernorm_compile_only_runs_each_configuration_and_writes_no_rows(tmp_path, capsys, monkeypatch):
    """--compile-only (gpu_suite.sh's parallel warm-up of the caches): one untimed fwd+bwd per provider and
    configuration, a provider that can't run skipped, no rows; the timed run's log line reads Inductor's
    cache counters."""
    from bench import bench_layernorm_dropout as bench
    from torch._dynamo.utils import counters

    assert bench.main(["--quick", "--compile-only", "--hidden", "64", "--tokens", "8,5", "-p", "0,0.1",
                       "--providers", "seqpar-triton,torch-compile", "--out", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    compiled = [line.split()[1] for line in lines if ": compiled (" in line]
    assert compiled == [f"tokens={n},h=64,p={p},dtype=bfloat16:" for n in (8, 5) for p in (0.0, 0.1)], lines
    assert sum("torch-compile" in line and "skipped (torch.compile is benchmarked on CUDA only" in line
               for line in lines) == 4, lines
    assert not list(tmp_path.iterdir())
    monkeypatch.setitem(counters, "inductor", collections.Counter(fxgraph_cache_hit=3, fxgraph_cache_miss=1))
    monkeypatch.setitem(counters, "aot_autograd", collections.Counter(autograd_cache_miss=2))
    assert bench.inductor_cache_counts() == "graphs 3 hits / 1 misses, autograd 0 hits / 2 misses"


def test_rows_name_seqpar_s_commit_not_the_project_around_an_installed_copy(tmp_path, monkeypatch):
    """Installed in a venv inside the user's own repository, rows carried the user's HEAD as seqpar's
    commit (git rev-parse from site-packages finds the enclosing checkout)."""
    from seqpar.bench import results

    monkeypatch.delenv("SEQPAR_COMMIT", raising=False)
    tmp_path = tmp_path / "a checkout"          # a space in the path (split() read three words)
    tmp_path.mkdir()
    git = ["git", "-c", "user.email=a@b", "-c", "user.name=a", "-C", str(tmp_path)]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "commit", "-q", "--allow-empty", "-m", "user project"], check=True)
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], check=True, capture_output=True, text=True).stdout
    site_packages = tmp_path / ".venv" / "lib" / "site-packages"
    site_packages.mkdir(parents=True)
    monkeypatch.setattr(results, "_REPO", str(site_packages))
    assert results.git_commit() == "unknown"
    monkeypatch.setattr(results, "_REPO", str(tmp_path))             # a checkout of seqpar itself
    assert results.git_commit() == head.strip()


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_rows_from_a_changed_tree_carry_a_dirty_commit(tmp_path, monkeypatch):
    """Rows measured on uncommitted changes carried HEAD's commit unmarked. A changed tracked file marks
    it "-dirty"; an untracked file or appended result rows (bench/results/, which one benchmark of a
    suite writes before the next one starts) do not."""
    from seqpar.bench import results

    monkeypatch.delenv("SEQPAR_COMMIT", raising=False)
    git = ["git", "-c", "user.email=a@b", "-c", "user.name=a", "-C", str(tmp_path)]
    subprocess.run([*git, "init", "-q"], check=True)
    (tmp_path / "bench" / "results").mkdir(parents=True)
    (tmp_path / "kernel.py").write_text("x = 1\n")
    (tmp_path / "bench" / "results" / "rows.csv").write_text("device,date,commit\n")
    subprocess.run([*git, "add", "kernel.py", "bench/results/rows.csv"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "seqpar"], check=True)
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], check=True, capture_output=True,
                          text=True).stdout.strip()
    monkeypatch.setattr(results, "_REPO", str(tmp_path))
    assert results.git_commit() == head
    (tmp_path / "notes.txt").write_text("untracked\n")
    with open(tmp_path / "bench" / "results" / "rows.csv", "a") as f:
        f.write("H200,2025-01-01,abc\n")
    assert results.git_commit() == head
    (tmp_path / "kernel.py").write_text("x = 2\n")
    assert results.git_commit() == head + "-dirty"
