"""python -m seqpar info / bench run and print what they promise."""
import json
import subprocess
import sys

import pytest


def test_info_lists_backends():
    out = subprocess.run([sys.executable, "-m", "seqpar", "info"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "torch" in out.stdout and "CUDA extension seqpar._C" in out.stdout
    assert "attention_core" in out.stdout and "bias_dropout_add_layer_norm" in out.stdout


@pytest.mark.timeout(180)
def test_bench_prints_five_experiments(tmp_path):
    path = tmp_path / "rows.json"
    cmd = [sys.executable, "-m", "seqpar", "bench", "--tp", "2", "--seq-len", "32", "--hidden", "32", "--heads", "4",
           "--batch", "2", "--iters", "1", "--warmup", "0", "--json", str(path)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=170)
    assert out.returncode == 0, out.stderr[-3000:]
    for name in ("no recompute", "sequence parallel", "full recompute", "selective recompute",
                 "selective + sequence parallel"):
        assert name in out.stdout
    rows = json.loads(path.read_text())["rows"]
    assert [r["recompute"] for r in rows] == ["none", "none", "full", "selective", "selective"]
    by_name = {r["experiment"]: r for r in rows}
    # selective keeps less than none, full keeps least, SP keeps less than plain TP
    assert by_name["full recompute"]["activation_bytes"] < by_name["selective recompute"]["activation_bytes"] \
        < by_name["no recompute"]["activation_bytes"]
    assert by_name["sequence parallel"]["activation_bytes"] < by_name["no recompute"]["activation_bytes"]


def test_bench_rejects_bad_shape():
    out = subprocess.run([sys.executable, "-m", "seqpar", "bench", "--heads", "3", "--tp", "2"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "heads" in out.stderr
