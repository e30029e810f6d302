"""bench/bench_layernorm_dropout.py and bench/bench_attention.py --quick, run as a user runs them (a script,
TRITON_INTERPRET unset): the seqpar-triton rows are measured (LayerNorm with dropout off and on,
attention with grouped-query k/v)."""
import csv
import os
import subprocess
import sys

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
    rows, _ = _run_quick("bench_layernorm_dropout.py", tmp_path)
    got = {(r["provider"], r["config"].split(",")[2], r["metric"]) for r in rows if r["provider"] != "device-copy"}
    for p in ("p=0.0", "p=0.1"):
        for provider in ("seqpar-triton", "seqpar-torch", "torch-eager"):
            assert (provider, p, "fwdbwd_ms") in got, (provider, p)
    assert all(float(r["value"]) > 0 for r in rows)
    # bench/gpu_summary.py reads the sweep coordinates back from the config strings
    assert all({"tokens", "h", "p"} <= set(config_fields(r["config"])) for r in rows if r["provider"] != "device-copy")


def test_attention_quick_runs_triton_with_gqa(tmp_path):
    rows, _ = _run_quick("bench_attention.py", tmp_path, "--gqa-group", "2", "--dropouts", "0.1", "--providers",
                         "seqpar-triton,torch-eager")
    configs = {(r["provider"], r["config"]) for r in rows if r["metric"] == "fwdbwd_ms"}
    for provider in ("seqpar-triton", "torch-eager"):
        assert any(prov == provider and "H=4 Hkv=2" in c and "p=0.1" in c for prov, c in configs), configs
    assert all({"s", "d", "p", "causal"} <= set(config_fields(c)) for _, c in configs)
