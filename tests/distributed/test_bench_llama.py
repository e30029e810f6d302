"""python -m seqpar bench --arch llama: the five experiments on a Llama block (2 spawned gloo ranks), the
measured bytes against the generalised formula, and its usage errors."""
import json
import subprocess
import sys

import pytest

from seqpar import cli


@pytest.mark.timeout(180)
def test_bench_llama_prints_five_experiments(tmp_path):
    """With Qwen3's knobs (heads 16 wide with h 64 and 8 heads, q / k norms): the Llama block's path, and
    those knobs' terms of the formula."""
    path = tmp_path / "rows.json"
    cmd = [sys.executable, "-m", "seqpar", "bench", "--arch", "llama", "--tp", "2", "--seq-len", "32", "--hidden", "64",
           "--heads", "8", "--kv-heads", "2", "--kv-channels", "16", "--qk-norm", "--ffn", "88", "--batch", "2",
           "--iters", "1", "--warmup", "0", "--json", str(path)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=170)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "llama (g=2 d=16 f=88 q/k norms) layer" in out.stdout and "formula MiB" in out.stdout and \
        "dropout=0.0" in out.stdout
    data = json.loads(path.read_text())
    assert (data["config"]["arch"], data["config"]["kv_heads"], data["config"]["ffn"]) == ("llama", 2, 88)
    assert (data["config"]["kv_channels"], data["config"]["qk_norm"]) == (16, True)
    rows = {r["experiment"]: r for r in data["rows"]}
    assert list(rows) == ["no recompute", "sequence parallel", "full recompute", "selective recompute",
                          "selective + sequence parallel"]
    assert rows["full recompute"]["activation_bytes"] < rows["selective recompute"]["activation_bytes"] \
        < rows["no recompute"]["activation_bytes"]
    for name, r in rows.items():
        assert r["table2_bytes"] == r["table2_bytes_no_masks"], r          # no dropout: no masks
        assert 0.95 * r["table2_bytes"] <= r["activation_bytes"] <= 1.05 * r["table2_bytes"], r


@pytest.mark.parametrize("argv, match", [
    (["bench", "--kv-heads", "2"], "--kv-heads is for --arch llama"),
    (["bench", "--arch", "llama", "--kv-heads", "3"], "heads % kv_heads == 0"),
    (["bench", "--arch", "llama", "--kv-heads", "1"], "kv_heads % tp == 0"),
    (["bench", "--arch", "llama", "--ffn", "351"], "ffn % tp == 0"),
    (["bench", "--arch", "mamba"], "invalid choice: 'mamba'"),
    (["bench", "--kv-channels", "16"], "--kv-channels is for --arch llama"),
    (["bench", "--qk-norm"], "--qk-norm is for --arch llama"),
    (["bench", "--arch", "llama", "--kv-channels", "15"], "--kv-channels 15: the Llama block's RoPE needs an even"),
    (["bench", "--arch", "llama", "--kv-channels", "0"], "--kv-channels must be positive, got 0"),
    # an odd h / a failed in the spawned ranks, after the launch
    (["bench", "--arch", "llama", "--hidden", "72", "--heads", "24"], "--hidden / --heads = 3: the Llama block's"),
], ids=["kv-heads-gpt", "kv-heads-divide", "kv-heads-tp", "ffn-tp", "arch", "kv-channels-gpt", "qk-norm-gpt",
        "kv-channels-odd", "kv-channels-zero", "odd-head-dim"])
def test_bench_llama_usage_errors_are_one_line_exit_2(argv, match, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and len(err.strip().splitlines()) == 1 and match in err, err


@pytest.mark.parametrize("argv, world_size, match", [
    (["bench", "--tp", "4"], "2", "--tp 4 under torchrun with 2 ranks"),
    (["bench", "--heads", "4"], "3", "tp=3"),
], ids=["tp-differs", "validated-at-world-size"])
def test_bench_under_torchrun_takes_tp_from_the_launch(argv, world_size, match, capsys, monkeypatch):
    """Under torchrun the launched ranks are the group: a different --tp was ignored (and the sizes were
    checked against it), now it is a usage error, and the sizes are checked against WORLD_SIZE."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", world_size)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and len(err.strip().splitlines()) == 1 and match in err, err
