"""The README's examples run as written: launched with torchrun on 2 gloo ranks (CPU)."""
import re
import subprocess
import sys
from pathlib import Path

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
