"""bench/kernel_report.py: its SASS loop and mask accounting on hand-made instruction lists, and one real
sm_90a compile (no GPU needed) of a LayerNorm kernel with dropout, whose static budget it checks."""
import inspect
import json
import os
import subprocess
import sys

import pytest

from bench import kernel_report as K

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MASK = (("/x/triton_kernels/philox.py", 40), ("/x/triton_kernels/attention.py", 161), ("/x/k.py", 214))
BODY = (("/x/triton_kernels/attention.py", 150), ("/x/k.py", 214))
TAIL = (("/x/k.py", 230),)


def _fn(specs, branches):
    """A Function from (opcode, chain) pairs and backward branches (from index, to index)."""
    instrs = [K.Instr(op, op, chain) for op, chain in specs]
    spans = [(to, frm) for frm, to in branches]
    return K.Function("k", instrs, spans, K._merge(spans))


def test_loops_regions_and_mask_counts():
    specs = ([("IMAD", BODY)] + [("LOP3", MASK)] * 6 + [("FSEL", MASK), ("HGMMA", BODY), ("BRA", BODY)]
             + [("FMUL", TAIL), ("BRA", TAIL)])
    fn = _fn(specs, [(9, 0), (11, 10)])
    assert fn.loops == [(0, 9), (10, 11)]
    assert K.loop_by_call(fn, [214], "k.py") == (0, 9)            # the loop inlined at line 214
    assert K.loop_by_call(fn, [999], "k.py") is None
    stats = K.region_stats(fn, (0, 9))
    # 10 instructions; integer: IMAD + 6 LOP3 (BRA, FSEL, HGMMA are not); of which mask: the 6 LOP3.
    assert (stats.instructions, stats.int_instructions, stats.mask_int, stats.mask_region) == (10, 7, 6, "main loop")
    assert K.largest_loop(fn) == (0, 9) and K.largest_loop(fn, with_mask=True) == (0, 9)
    assert K.is_int("UIADD3") and K.is_int("PRMT") and not K.is_int("FFMA")


def test_main_loop_is_the_innermost_loop_at_the_call():
    """GQA's dk/dv kernel loops over a kv head's q heads around the query-block loops: the main loop is the
    inner loop inlined at the unmasked call, not the head loop that encloses it (and the masked one)."""
    MASKED = (("/x/triton_kernels/attention.py", 150), ("/x/k.py", 210))
    HEADS = (("/x/k.py", 205),)
    specs = ([("IMAD", HEADS)] + [("FFMA", MASKED)] * 3 + [("BRA", MASKED)]
             + [("HGMMA", BODY)] * 5 + [("BRA", BODY), ("IADD3", HEADS), ("BRA", HEADS)])
    fn = _fn(specs, [(4, 1), (10, 5), (12, 0)])
    assert fn.loops == [(0, 12)]
    assert K.loop_by_call(fn, [214], "k.py") == (5, 10)
    assert K.loop_by_call(fn, [210], "k.py") == (1, 4)


def test_main_loop_without_inline_call_sites_is_the_loop_without_masked_lines():
    """Triton 3.6's line info keeps the innermost line only: the GQA dk/dv kernel's unmasked inner loop is
    told from the masked one by the absence of the inner function's ``if MASK:`` lines (here 160)."""
    INNER, MASKED, HEAD = (("/x/triton_kernels/attention.py", 155),), (("/x/triton_kernels/attention.py", 160),), \
        (("/x/triton_kernels/attention.py", 205),)
    # the masked loop (1..8) runs more of the inner function's code than the unmasked one (9..12)
    specs = ([("IMAD", HEAD)] + [("FFMA", INNER)] * 6 + [("FSEL", MASKED), ("BRA", INNER)]
             + [("HGMMA", INNER)] * 3 + [("BRA", INNER), ("IADD3", HEAD), ("BRA", HEAD)])
    fn = _fn(specs, [(8, 1), (12, 9), (14, 0)])
    inner_lines, masked_lines = range(150, 175), [160]
    assert K.loop_by_lines(fn, inner_lines, masked_lines, "triton_kernels/attention.py") == (9, 12)
    assert K.loop_by_call(fn, [214], "k.py") is None         # no call frames to find it by
    assert K.loop_by_lines(fn, inner_lines, [155, 160], "triton_kernels/attention.py") is None


def test_function_lines_name_the_masked_branches():
    from seqpar.triton_kernels import attention as A

    lines, masked = K.function_lines(A._bwd_dkdv_inner)
    source, first = inspect.getsourcelines(A._bwd_dkdv_inner.fn)
    assert lines == range(first, first + len(source))
    masked_code = [source[n - first].strip() for n in masked]
    assert masked_code == ["pT = tl.where(rows[None, :] >= offs_n[:, None], pT, 0.0)"]


def test_mask_in_its_own_inner_loop_is_counted_per_pass():
    """The v1 kernels drew each element's mask in a rolled loop: the region is that inner loop."""
    specs = [("LDG", BODY)] + [("IMAD", MASK)] * 4 + [("BRA", MASK), ("STG", BODY), ("BRA", BODY)]
    fn = _fn(specs, [(5, 1), (7, 0)])
    assert fn.loops == [(0, 7)]
    stats = K.region_stats(fn, (0, 7))
    assert stats.mask_region == "inner loop" and stats.mask_int == 4 and stats.instructions == 8


def test_cuda_template_arguments_are_parsed():
    base, args = K._template_args("void seqpar::bdaln::fwd_kernel<__nv_bfloat16, 8, 4, true>(seqpar::bdaln::FwdArgs)")
    assert base == "seqpar::bdaln::fwd_kernel" and args == ["__nv_bfloat16", "8", "4", "true"]
    base, args = K._template_args("void seqpar::(anonymous namespace)::softmax_dropout_fwd_kernel<__half, 128>(__half*)")
    assert base == "seqpar::(anonymous namespace)::softmax_dropout_fwd_kernel" and args == ["__half", "128"]
    base, args = K._template_args("void seqpar::bdaln::bwd_kernel<float, 4, 8, (seqpar::rows::RowKind)2>"
                                  "(seqpar::bdaln::BwdArgs, long)")
    assert base == "seqpar::bdaln::bwd_kernel" and args == ["float", "4", "8", "chunked"]


def _compiled_rows(*jobs):
    """kernel_report's rows of Triton jobs, compiled for sm_90a in a process without the CPU interpreter
    (Triton's bundled ptxas and nvdisasm); skips where those tools are missing."""
    pytest.importorskip("triton")
    code = ("import json, sys; sys.path.insert(0, 'bench'); import kernel_report as K; "
            f"print(json.dumps([K._triton_row(job) for job in {list(jobs)!r}]))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=240)
    if proc.returncode != 0 and "not found (Triton's bundled copy or PATH)" in proc.stderr:
        pytest.skip(proc.stderr.strip().splitlines()[-1])
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_row_kernels_compile_for_sm90_within_budget():
    """Real configurations end to end (bench/results/kernel_report.txt has every one):
    - the LayerNorm forward, bf16, h = 1024, dropout on: no spills, the mask within 12 integer
      instructions per element;
    - the LayerNorm backward's chunk programs at h = 12288 (dropout on; their row sums come from the
      row-sum pass): 32-warp programs (4 elements per thread) without spills, so within the 64 registers a
      1024-thread program may use;
    - the RMSNorm backward at h = 4096: 16-warp programs (8 elements per thread) without spills, within
      64 registers, so that two of them fit an SM."""
    row, rms, ln_chunks = _compiled_rows(("ln", "fwd", 1024, "bf16", True, 0),
                                         ("rmsnorm", "bwd", 4096, "bf16", False, 0),
                                         ("ln", "bwd", 12288, "bf16", True, 0))
    assert row["registers"] > 0 and row["spill_bytes"] == 0
    assert row["counted"] == "whole kernel" and row["mask_int"] > 0
    assert row["mask_int"] / row["elements_per_thread"] <= 12
    for bwd, warps, per_thread in ((rms, 16, 8), (ln_chunks, 32, 4)):
        assert f" w{warps}" in bwd["config"] and bwd["elements_per_thread"] == per_thread
        assert 0 < bwd["registers"] <= 64 and bwd["spill_bytes"] == 0
    assert ln_chunks["config"].endswith(" c3")


def test_attention_launches_record_every_autotune_config():
    """The attention launcher tunes once per length bucket and then launches the tuned tile as a fixed
    config; kernel_report's recorder stands in for the autotuner and has no best_config, so the report
    died in attention_launches (AttributeError) before compiling anything."""
    pytest.importorskip("triton")
    code = ("import json, sys; sys.path.insert(0, 'bench'); import kernel_report as K, torch; "
            "L = K.attention_launches(64, torch.bfloat16, True); "
            "print(json.dumps({k: (v.fn.__name__, len(v.configs)) for k, v in L.items()}))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    launches = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [name for name, _ in launches.values()] == ["_attn_fwd_kernel", "_attn_bwd_dq_kernel",
                                                      "_attn_bwd_dkdv_kernel"], launches
    assert all(n > 1 for _, n in launches.values()), launches


def _global_store_widths(src: str) -> dict:
    """{demangled kernel: Counter of its global stores' opcodes ("STG.E.128", "STG.E.U16", ...)} of one
    csrc/*.cu compiled for sm_90a as kernel_report compiles it (nvcc; Triton's bundled nvdisasm)."""
    import collections
    import shutil
    import tempfile

    pytest.importorskip("triton")
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc not found")
    try:
        K._triton_tool("nvdisasm")
    except Exception as e:   # noqa: BLE001 - the tool lookup's own message is the skip reason
        pytest.skip(str(e))
    csrc = os.path.join(ROOT, "csrc")
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        subprocess.run([nvcc, "-cubin", f"-arch={K.ARCH}", "-O3", "-DNDEBUG", "-std=c++17", "-I", csrc, "-o", cubin,
                        os.path.join(csrc, src)], check=True, capture_output=True, timeout=240)
        with open(cubin, "rb") as f:
            functions = K.parse_sass(f.read())
    names = K._demangle(sorted(functions))
    return {names[m]: collections.Counter(i.text.split()[1] if i.text.startswith("@") else i.text.split()[0]
                                          for i in fn.instrs if i.opcode == "STG")
            for m, fn in functions.items()}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("src, kernel, most_narrow_stores", [
    ("rotary.cu", "rope_kernel", 0),
    ("rms_norm.cu", "rmsnorm::fwd_kernel", 1),                  # rstd, one fp32 a row
    ("bias_dropout_add_layer_norm.cu", "bdaln::fwd_kernel", 2),  # mean and rstd
])
def test_cuda_kernels_store_16_byte_packs_whole(src, kernel, most_narrow_stores):
    """Every instantiation of a kernel with 16-byte packs (bf16 / fp16 8 elements, fp32 4) stores them with
    16-byte stores: an assignment of the Pack struct let nvcc split such stores into 2- and 4-byte ones (the
    rotary kernel, 8 stores a pack, ran at 21% of the copy bandwidth on an H200; the LayerNorm and RMSNorm
    forwards split some too). The narrow stores left are the per-row statistics."""
    widths = _global_store_widths(src)
    checked = 0
    for name, stores in widths.items():
        if kernel not in name or not any(f"{t}, {v}" in name for t, v in
                                         (("__nv_bfloat16", 8), ("__half", 8), ("float", 4))):
            continue
        checked += 1
        narrow = sum(n for op, n in stores.items() if op != "STG.E.128")
        assert stores["STG.E.128"] > 0 and narrow <= most_narrow_stores, (name, dict(stores))
    assert checked >= 3, sorted(widths)
