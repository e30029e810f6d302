"""The README's examples run as written: launched with torchrun on 2 gloo ranks (CPU)."""
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


def _torchrun(script: str, *args: str, nproc: int = 2, timeout: float = 180) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--standalone",
           str(ROOT / "examples" / script), *args]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"{' '.join(cmd)} failed:\n{out.stdout}\n{out.stderr}"
    return out.stdout


def test_layer_example_matches_unsharded_layer_and_table2():
    stdout = _torchrun("layer_example.py", "--seq-len", "64", "--hidden", "64", "--heads", "4")
    error = float(re.search(r"max \|y - unsharded y\| = (\S+)", stdout).group(1))
    measured, table2 = (float(v.replace(",", "")) for v in
                        re.search(r"activation bytes per rank: (\S+) measured, (\S+) Table 2", stdout).groups())
    assert error < 1e-5, stdout
    # fp32 on CPU: Table 2 counts one byte per dropout-mask element, which seqpar regenerates instead.
    s, b, h, t = 64, 2, 64, 2
    masks = 2 * s * b * h / t
    assert abs(measured - (table2 - masks)) <= 0.02 * table2, stdout


def test_readme_snippet_runs_as_written(tmp_path):
    readme = (ROOT / "README.md").read_text()
    start = readme.index("```python", readme.index("Its core, runnable as written"))
    snippet = readme[start + len("```python"):readme.index("```", start + 9)]
    (tmp_path / "examples").mkdir()
    script = tmp_path / "examples" / "my_layer.py"
    script.write_text(snippet)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    measured, table2 = (float(v) for v in
                        re.search(r"activation bytes per rank: (\d+) measured, (\d+) Table 2", out.stdout).groups())
    assert 0.9 * table2 < measured < table2, out.stdout


@pytest.mark.timeout(240)
@pytest.mark.parametrize("family, script", [("gpt2", ["hf_gpt2_finetune.py", "--heads", "4"]),
                                            # the Llama family's path, with Qwen3's q / k norms and heads
                                            # 2 h / a wide
                                            ("qwen3", ["hf_finetune.py", "--family", "qwen3", "--heads", "8",
                                                       "--kv-heads", "2"])])
def test_finetune_example_trains_and_hands_the_weights_back(tmp_path, family, script):
    transformers = pytest.importorskip("transformers")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(ROOT / "examples" / script[0]), *script[1:], "--steps", "3", "--layers", "2", "--hidden", "64",
           "--seq-len", "32", "--batch", "2", "--save", str(tmp_path / "out")]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=200)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    losses = [float(x) for x in re.findall(r"^step \d+/3 .*loss (\S+)", done.stdout, re.M)]
    assert len(losses) == 3 and losses[-1] < losses[0], output
    measured, formula = (float(x) for x in re.search(
        r"activations (\S+) MiB on this rank \(formula: (\S+) MiB\)", done.stdout).groups())
    assert 0.95 * formula <= measured <= 1.05 * formula, output
    seqpar_loss, hf_loss = (float(x) for x in re.search(
        r"seqpar eval loss (\S+), HF model after the hand-back (\S+)", done.stdout).groups())
    assert abs(seqpar_loss - hf_loss) <= 1e-4, output
    saved = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert saved.config.hidden_size == 64 and saved.config.model_type == family


@pytest.fixture(scope="module")
def finetune_script():
    """examples/hf_finetune.py as a module (it imports transformers)."""
    pytest.importorskip("transformers")
    spec = importlib.util.spec_from_file_location("hf_finetune", ROOT / "examples" / "hf_finetune.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _finetune(tmp_path, nproc, *args):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           str(ROOT / "examples" / "hf_finetune.py"), "--heads", "4", "--layers", "2", "--hidden", "64",
           "--seq-len", "32", "--batch", "2", *args]
    done = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True,
                          text=True, timeout=200)
    assert done.returncode == 0, done.stdout + done.stderr
    return {int(step): float(loss) for step, loss in re.findall(r"^step (\d+)/\d+ loss (\S+)", done.stdout, re.M)}


@pytest.mark.timeout(300)
def test_finetune_example_resumes_its_checkpoint_at_another_size(tmp_path):
    """Steps 3-4 resumed on 1 rank from the 2-rank checkpoint after step 2 have the losses of the
    uninterrupted 2-rank run: the weights, AdamW's moments and step, the learning rate and the dropout
    seeds (GPT-2's dropout 0.1 is on) all carried over. Resumed without the dropout seeds, step 3's loss
    was 0.07 off; without AdamW's state, step 4's was 0.13 off."""
    pytest.importorskip("transformers")
    whole = _finetune(tmp_path, 2, "--steps", "4")
    first = _finetune(tmp_path, 2, "--steps", "2", "--checkpoint", str(tmp_path / "ckpt"))
    resumed = _finetune(tmp_path, 1, "--steps", "4", "--resume", str(tmp_path / "ckpt"))
    assert sorted(first) == [1, 2] and sorted(resumed) == [3, 4], (first, resumed)
    for step, loss in {**first, **resumed}.items():
        assert abs(loss - whole[step]) <= 1e-4, (step, loss, whole)


@pytest.mark.timeout(300)
def test_finetune_example_with_fsdp2_replicas_trains_as_one_rank_on_the_whole_batch(tmp_path):
    """--data-parallel 2 on 2 ranks (2 FSDP2 replicas of t = 1, each its own 2 sequences) prints the
    losses of 1 rank training on all 4 sequences (FSDP2 averages the replicas' gradients). (Dropout off:
    a replica's masks follow its own batch rows.) The README's TP x FSDP2 mesh (t = 2 replicas) is checked
    on 4 ranks in tests/distributed/test_data_parallel.py; 4 ranks of this script, each importing
    transformers, cost CI 20 s more."""
    pytest.importorskip("transformers")
    replicas = _finetune(tmp_path, 2, "--data-parallel", "2", "--dropout", "0", "--steps", "3")
    whole = _finetune(tmp_path, 1, "--batch", "4", "--dropout", "0", "--steps", "3")
    assert sorted(replicas) == [1, 2, 3], replicas
    for step, loss in replicas.items():
        assert abs(loss - whole[step]) <= 1e-4, (step, loss, whole)


@pytest.mark.parametrize("args, match", [
    (["--seq-len", "63"], "--seq-len 63 must be divisible by the 2 ranks"),
    (["--heads", "3"], "--hidden 128 must be divisible by --heads 3"),
    (["--family", "llama", "--heads", "6", "--hidden", "192", "--kv-heads", "3"], "the 3 k/v heads must be divisible"),
    (["--steps", "0"], "--steps must be positive, got 0"),
    (["--resume", "no/such/dir"], "--resume no/such/dir is not a directory"),
    (["--clip-grad", "-1"], "--clip-grad must be >= 0"),
    (["--data-parallel", "3"], "--data-parallel 3 must divide the 2 ranks"),
    (["--family", "llama", "--kv-heads", "0"], "--kv-heads must be positive, got 0"),   # was taken as "unset"
], ids=["seq-len", "heads", "kv-heads", "steps", "resume", "clip-grad", "data-parallel", "kv-heads-0"])
def test_finetune_example_refuses_sizes_the_ranks_cannot_split(args, match, finetune_script, monkeypatch, capsys):
    """Sizes that don't split over the ranks are a usage error of parse_args (main's first call, before
    any rank starts), not a traceback per rank from deep inside the model build. (In this process: the
    script imported once, not a Python per case.)"""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(sys, "argv", ["hf_finetune.py", *args])
    with pytest.raises(SystemExit) as exit_info:
        finetune_script.parse_args()
    assert exit_info.value.code == 2 and match in capsys.readouterr().err


def test_gpt2_script_has_no_kv_heads_option(finetune_script, monkeypatch, capsys):
    """hf_gpt2_finetune.py listed --kv-heads ("llama: k/v heads") and then refused it, naming a --family
    option the script doesn't have."""
    monkeypatch.setattr(sys, "argv", ["hf_gpt2_finetune.py", "--kv-heads", "2"])
    with pytest.raises(SystemExit):
        finetune_script.parse_args(family="gpt2")
    assert "unrecognized arguments: --kv-heads 2" in capsys.readouterr().err


@pytest.mark.parametrize("args, match", [
    (["--heads", "7"], "--hidden 256 must be divisible by --heads 7"),
    (["--seq-len", "255"], "--seq-len 255 and --heads 8 must be divisible by the 2 ranks"),
    (["--batch", "0"], "--batch must be positive, got 0"),
    (["--device", "cuda"], "--device cuda: no CUDA device is available"),
], ids=["heads", "seq-len", "batch", "cuda"])
def test_layer_example_refuses_bad_options_in_one_line(args, match, monkeypatch, capsys):
    """They surfaced as a ValueError traceback on every rank, --device cuda on a CPU machine as an
    AttributeError inside torch.cuda.set_device."""
    if "cuda" in args and torch.cuda.is_available():
        pytest.skip("a CUDA device is available")
    spec = importlib.util.spec_from_file_location("layer_example", ROOT / "examples" / "layer_example.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(sys, "argv", ["layer_example.py", *args])
    with pytest.raises(SystemExit) as exit_info:
        module.main()
    assert exit_info.value.code == 2 and match in capsys.readouterr().err

